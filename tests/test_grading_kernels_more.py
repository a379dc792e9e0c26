"""05's and 06's points need the learner's own kernels and backward; the kernel world holds honest kernels whole.

Like tests/test_grading_kernels.py (04), for the other kernel assignments, each submission being
alt_correct's notebook with one or two cells changed:
- 05: a fast_attention that checks its inputs, launches a kernel that does nothing on a scratch
  buffer and returns torch's answer. The grader's own fast_attention, launching the learner's
  fast_fwd_kernel (the release stub, or one whose body does nothing), finds the kernel's points
  missing; what needs no fast_fwd_kernel (fast_decode's own kernels) keeps its points.
- 06: a train_step_gradients rewritten to take o, dq, dk and dv from torch autograd over plain
  attention, beside the release stub of FlashAttention.backward. The grader calls source/'s given
  train_step_gradients, which reaches the stub, so that cell scores nothing.
Then, with no grading and no jail, what kernel_world.build takes from the honest kernel variations
of tests/test_launches.py (and from two of its cheats), and one program run end to end on the CPU.
"""

import ast
import copy
import importlib.util
import json
import os
import subprocess
import sys

import nbformat
import pytest
import torch

import test_launches
from autograder.jail import sandbox as jail
from autograder.grading import kernel_world
from conftest import ROOT, SAMPLES, assert_auto_points, expected_scores, feedback_page, grade_submissions

needs_jail = pytest.mark.skipif(jail.why_no_jail() is not None, reason=f"no jail here: {jail.why_no_jail()}")
FLASH, FAST, BACKWARD = "04_triton_flash", "05_fast_kernel", "06_backward"


def _nb(folder, assignment: str) -> dict:
    return json.loads((folder / assignment / f"{assignment}.ipynb").read_text())


def _cell(nb: dict, grade_id: str) -> str:
    return next("".join(c["source"]) for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") == grade_id)


def _notebook(assignment: str, **cells: str) -> dict:
    """alt_correct's notebook with the named cells' code replaced."""
    nb = copy.deepcopy(_nb(SAMPLES / "submitted" / "alt_correct", assignment))
    for cell in nb["cells"]:
        grade_id = cell["metadata"].get("nbgrader", {}).get("grade_id")
        if grade_id in cells:
            cell["source"] = cells[grade_id]
    return nb


def _replace_function(cell: str, name: str, body: str) -> str:
    """The cell with the top-level function `name`'s body (docstring included) replaced by `body`."""
    node = next(s for s in ast.parse(cell).body if isinstance(s, ast.FunctionDef) and s.name == name)
    lines = cell.splitlines(keepends=True)
    return "".join(lines[:node.body[0].lineno - 1]) + body + "".join(lines[node.end_lineno:])


ALT = SAMPLES / "submitted" / "alt_correct"
RELEASE = ROOT / "notebooks"

# --- 05: a wrapper that launches a do-nothing kernel on a scratch buffer and returns torch's answer ---
ALT_FAST = _cell(_nb(ALT, FAST), "fast_attention")
# alt_correct's checks of the arguments: its body up to where it makes the inputs contiguous to launch
ALT_FAST_CHECKS = ALT_FAST[ALT_FAST.index("    _check_inputs(q, k, v)"):ALT_FAST.index("    q, k, v = q.contiguous()")]
TORCH_FAST = '''
@triton.jit
def _scratch_kernel(x_ptr):
    """Launched on a scratch buffer; computes nothing."""
    pass


def fast_attention(q, k, v, query_offset=None, block_m=None, block_n=None, window=None, causal=True,
                   exp2=True, split_diagonal=True, tma=None, **launch):
    """alt_correct's checks, a launch that does nothing, and the answer from torch."""
''' + ALT_FAST_CHECKS + '''    _scratch_kernel[(1,)](torch.zeros(1, device=q.device))
    kk, vv = (x.float().repeat_interleave(q_heads // kv_heads, dim=1) for x in (k, v))
    scores = q.float() @ kk.transpose(-2, -1) / math.sqrt(d)
    q_pos = torch.arange(t, device=q.device)[:, None] + offset
    k_pos = torch.arange(s, device=q.device)[None, :]
    visible = k_pos <= q_pos if causal else torch.ones(t, s, dtype=torch.bool, device=q.device)
    if window is not None:
        visible = visible & (k_pos > q_pos - window)
    p = torch.nan_to_num(scores.masked_fill(~visible, float("-inf")).softmax(-1))
    return p.matmul(torch.nan_to_num(vv)).to(q.dtype)
'''
FAST_STUB = _cell(_nb(RELEASE, FAST), "fast_fwd_kernel")       # the release cell: _attend_tile and the kernel raise
FAST_DOES_NOTHING = _replace_function(_cell(_nb(ALT, FAST), "fast_fwd_kernel"), "fast_fwd_kernel",
                                      '    """Launched, and computes nothing."""\n    pass\n')
# test_prefill 3, test_diagonal_split 2, test_window_and_skipping 2, test_decode 3, test_validation 1
FULL_FAST = expected_scores()[FAST]["alt_correct"]

# --- 06: train_step_gradients from torch autograd, FlashAttention.backward left as the release stub ---
AUTOGRAD_TRAIN_STEP = '''    """(o, dq, dk, dv) from torch autograd over plain attention; flash_attention_train is never called."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    lq, lk, lv = leaves
    kk, vv = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (lk, lv))
    t, s = q.shape[2], k.shape[2]
    offset = s - t if query_offset is None else query_offset
    hidden = torch.arange(s, device=q.device)[None, :] > torch.arange(t, device=q.device)[:, None] + offset
    scores = (lq @ kk.transpose(-2, -1) / q.shape[-1] ** 0.5).masked_fill(hidden, float("-inf"))
    o = scores.softmax(-1) @ vv
    o.backward(do)
    return o.detach(), lq.grad, lk.grad, lv.grad
'''
TRAIN_AUTOGRAD = _replace_function(_cell(_nb(RELEASE, BACKWARD), "flash_attention_train"), "train_step_gradients",
                                   AUTOGRAD_TRAIN_STEP)
FULL_BACKWARD = expected_scores()[BACKWARD]["alt_correct"]

CASES = {  # student -> (assignment, notebook, expected points)
    # The release stub raises in the kernel, which Triton does not compile: every test cell that calls
    # fast_attention loses its points in the grader's run, test_validation too (its last line launches the
    # kernel with causal=False and a negative offset, to show that it must not raise). test_decode keeps its
    # 3: fast_decode launches alt_correct's own decode kernels, which need no fast_fwd_kernel.
    "fast_stub_and_torch_answer": (FAST, _notebook(FAST, fast_fwd_kernel=FAST_STUB, fast_attention=TORCH_FAST),
                                   {**FULL_FAST, "test_prefill": 0.0, "test_diagonal_split": 0.0,
                                    "test_window_and_skipping": 0.0, "test_validation": 0.0}),
    # A kernel that compiles and writes nothing: the three cells that check fast_attention's numbers lose
    # their 7 points; test_validation keeps its 1 (ValueErrors raised before the launch, and the launch it
    # makes is checked only for not raising and for the output's shape), test_decode its 3.
    "fast_does_nothing_and_torch_answer": (FAST, _notebook(FAST, fast_fwd_kernel=FAST_DOES_NOTHING,
                                                           fast_attention=TORCH_FAST),
                                           {**FULL_FAST, "test_prefill": 0.0, "test_diagonal_split": 0.0,
                                            "test_window_and_skipping": 0.0}),
    # Only test_flash_attention_train goes through FlashAttention.backward; the other backward cells call
    # flash_attention_backward (alt_correct's, unchanged) directly.
    "train_step_from_autograd": (BACKWARD, _notebook(BACKWARD, flash_attention_train=TRAIN_AUTOGRAD),
                                 {**FULL_BACKWARD, "test_flash_attention_train": 0}),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    return grade_submissions(tmp_path_factory.mktemp("kernels_more"), {s: (a, nb) for s, (a, nb, _) in CASES.items()})


@pytest.mark.parametrize("student", CASES)
@pytest.mark.slow
@needs_jail
def test_points_need_the_learners_kernels(graded, student):
    """Each shortcut loses what the learner's kernel or backward is worth and keeps exactly the rest."""
    outcomes, _ = graded
    assert_auto_points(outcomes[student], CASES[student][2])


@pytest.mark.slow
@needs_jail
def test_the_feedback_says_which_run_failed(graded):
    """05's torch answer passed in the notebook and failed only through the grader's wrapper; 06's reached the stub."""
    _, out = graded
    fast = feedback_page(out, "fast_does_nothing_and_torch_answer")
    assert any(f"launched by the grader{quote}s own fast_attention" in fast for quote in ("&#39;", "'"))
    backward = feedback_page(out, "train_step_from_autograd")
    assert "NotImplementedError:" in backward  # the error's "ename: evalue" (the listed stub: NotImplementedError())


def test_the_rewritten_train_step_is_right_on_its_own():
    """The autograd train_step_gradients passes 06's visible check when called itself: its 0 is the stub's."""
    from flashcourse.checks import core as attention_checks, backward as backward_checks

    namespace = {"torch": torch}
    exec(TRAIN_AUTOGRAD[TRAIN_AUTOGRAD.index("def train_step_gradients"):], namespace)
    cases = [attention_checks.make_case("prefill, GQA 2:1, T = S = 19", batch=1, q_heads=4, kv_heads=2, t=19, seed=64),
             attention_checks.make_case("chunked prefill at 5", batch=2, q_heads=2, kv_heads=2, t=9, s=30,
                                        query_offset=5, seed=65)]
    backward_checks.check_train_step(namespace["train_step_gradients"], cases)
    with pytest.raises(NotImplementedError):  # the release stub that source/'s train_step_gradients reaches
        exec(TRAIN_AUTOGRAD[TRAIN_AUTOGRAD.index("class FlashAttention"):TRAIN_AUTOGRAD.index("def train_step_gradients")]
             + "FlashAttention.backward(None, None)\n", {"torch": torch})


# --- The kernel world of honest kernels, written other ways (no grading, no jail) ---
SOURCE_04 = nbformat.read(ROOT / "source" / FLASH / f"{FLASH}.ipynb", as_version=4)
NAME = "flash_fwd_kernel"  # the grader takes the learner's kernels by the exercise's names


def _renamed(variant: dict, key: str) -> list[str]:
    """test_launches' cells with its kernel under the exercise's name."""
    return [cell.replace("attn_kernel", NAME) for cell in variant[key]]


def _module_text(world: kernel_world.KernelWorld) -> str:
    """The learner-kernel module the program writes (`_module.write(...)`)."""
    call = next(n for n in ast.walk(ast.parse(world.program)) if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute) and n.func.attr == "write"
                and isinstance(n.func.value, ast.Name) and n.func.value.id == "_module")
    return ast.literal_eval(call.args[0])


def _loaded(world: kernel_world.KernelWorld) -> list[str]:
    """The kernel names the program loads from that module."""
    call = next(n for n in ast.walk(ast.parse(world.program)) if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Name) and n.func.id == "load")
    return ast.literal_eval(call.args[1])


def _import_module(text: str, tmp_path):
    path = tmp_path / "learner_kernels.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("learner_kernels_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


KERNEL_04 = _cell(_nb(ALT, FLASH), NAME)
AUTOTUNED_ALIAS = (KERNEL_04.replace(f"@triton.jit\ndef {NAME}(", "def _flash_fwd_body(", 1)
                   + f'\n\n{NAME} = triton.autotune(configs=[triton.Config({{}}, num_warps=4)], key=["T"])('
                     'triton.jit(_flash_fwd_body))\n')
IMPORTS = test_launches.IMPORTS
KERNEL_VARIANTS = {
    **{key: _renamed(test_launches.HONEST, key) for key in (
        "autotune stacked over jit", "from triton import jit", "jit with arguments under an alias of triton",
        "kernel from triton.jit(f) and triton.autotune(...)(kernel)", "kernel defined in a later cell than the wrapper",
        "a cell that does not parse is skipped")},
    "heuristics stacked over autotune and jit": [IMPORTS, f'''
@triton.heuristics({{"EVEN": lambda args: args["N"] % 16 == 0}})
@triton.autotune(configs=[triton.Config({{}}, num_warps=4)], key=["N"])
@triton.jit
def {NAME}(q_ptr, o_ptr, N, EVEN: tl.constexpr):
    pass
'''],
    "heuristics over triton.jit of a function under another name": [IMPORTS, f'''
def attend(q_ptr, o_ptr, N, EVEN: tl.constexpr):
    pass

{NAME} = triton.heuristics({{"EVEN": lambda args: args["N"] % 16 == 0}})(triton.jit(attend))
'''],
    "04's kernel, autotuned, aliased from triton.jit(f)": [IMPORTS, AUTOTUNED_ALIAS],
}


@pytest.mark.parametrize("cells", KERNEL_VARIANTS.values(), ids=KERNEL_VARIANTS.keys())
def test_honest_kernels_are_taken_whole(cells, tmp_path):
    """An honest kernel written another way: nothing missing, and the kernel module defines it as a plain jit kernel."""
    import triton

    world = kernel_world.build(cells, SOURCE_04, {"flash_attention"})
    assert world.missing == {}
    assert _loaded(world) == [NAME]
    text = _module_text(world)
    assert "autotune" not in text and "heuristics" not in text
    kernel = getattr(_import_module(text, tmp_path), NAME)   # compiled, or interpreted where the runtime chose so
    assert isinstance(kernel, triton.runtime.jit.KernelInterface) and callable(kernel.fn)


def test_a_kernel_imported_from_the_engine_is_not_taken():
    """The engine's kernel imported under the exercise's name: the world loads no kernel, imports no engine, refuses."""
    world = kernel_world.build(test_launches.CHEATS["kernel imported from the engine"], SOURCE_04, {"flash_attention"})
    assert world.missing == {"flash_attention": f"{NAME} in your notebook is not a @triton.jit kernel"}
    assert _loaded(world) == [] and NAME not in _module_text(world)
    assert "flashcourse.engine" not in world.program
    assert "def flash_attention(" in world.program  # the grader's own wrapper, which KernelRun refuses to call


def test_a_torch_only_wrapper_is_not_in_the_world():
    """A PyTorch wrapper: the world holds the grader's wrapper and the kernel if named as asked, never torch's code."""
    torch_code = "torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v"
    as_in_test_launches = kernel_world.build(test_launches.CHEATS["plain PyTorch wrapper"], SOURCE_04,
                                             {"flash_attention"})
    assert as_in_test_launches.missing == {"flash_attention": f"your notebook defines no @triton.jit kernel named {NAME}"}
    assert _loaded(as_in_test_launches) == [] and "attn_kernel" not in as_in_test_launches.program
    named = kernel_world.build(_renamed(test_launches.CHEATS, "plain PyTorch wrapper"), SOURCE_04, {"flash_attention"})
    assert named.missing == {} and _loaded(named) == [NAME] and f"def {NAME}(" in _module_text(named)
    for world in (as_in_test_launches, named):
        assert torch_code not in world.program and world.program.count("def flash_attention(") == 1
        assert f"{NAME}[grid](" in world.program  # the one flash_attention is the instructor's, which launches


RUN = r'''
import sys
import torch
exec(compile(open(sys.argv[1]).read(), "the kernel world", "exec"))
from flashcourse.checks import reference
torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 37, 32) for _ in range(3))
got = flash_attention(q, k, v)
want = reference.attention(q, k, v).float()
print(type(flash_fwd_kernel).__name__, float((got - want).abs().max()))
assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())
'''


def test_an_autotuned_alias_computes_attention_through_the_graders_wrapper(tmp_path):
    """04's kernel as `k = autotune(...)(triton.jit(f))`, run by the world's program on the CPU, matches the reference."""
    world = kernel_world.build(KERNEL_VARIANTS["04's kernel, autotuned, aliased from triton.jit(f)"], SOURCE_04,
                               {"flash_attention"})
    assert world.missing == {}
    here = str(tmp_path / "kernel-run")  # not the jail's /tmp path: this runs outside a jail
    program = tmp_path / "program.py"
    program.write_text(world.program.replace(os.path.dirname(kernel_world.MODULE_PATH), here))
    env = {**os.environ, "FLASHCOURSE_DEVICE": "cpu", "TRITON_CACHE_DIR": str(tmp_path / "triton-cache")}
    run = subprocess.run([sys.executable, "-c", RUN, str(program)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    kind, error = run.stdout.split()[-2:]
    assert kind == "CompiledFirst" and float(error) < 1e-4  # compiled for sm_90 first, then interpreted


SPECIALIZED = '''
import triton
import triton.language as tl


@triton.jit
def copy_kernel(x_ptr, n, BLOCK: tl.constexpr):
    tl.static_assert(BLOCK <= 32)             # a constexpr the compile must see as given
    offsets = tl.arange(0, n)                 # compiles only where Triton makes n a constant: n == 1
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets))
'''


def test_the_compile_check_keeps_what_changes_the_code(tmp_path):
    """The sm_90 compile, cut at TTGIR and shared by launches of one specialization, still sees a 1 and a constexpr."""
    sys.path.insert(0, str(ROOT / "autograder" / "jail" / "inside"))
    try:
        import kernel_host
    finally:
        sys.path.pop(0)
    module = tmp_path / "kernels.py"
    module.write_text(SPECIALIZED)
    compiler = kernel_host.Compiler(str(module))
    x = torch.zeros(64)

    def compiles(n, block):
        try:
            compiler.check("copy_kernel", (x, n), {"BLOCK": block}, (1, 1, 1))
            return True
        except kernel_host.KernelDidNotCompile as refusal:
            assert "does not compile for a GPU (sm_90)" in str(refusal)
            return False

    try:
        assert compiles(1, 16)            # n = 1 is a constant: tl.arange(0, 1)
        assert not compiles(16, 16)       # any other n is not, divisible by 16 or not
        assert not compiles(17, 16)
        assert not compiles(1, 64)        # the constexpr is compiled as given
        assert compiles(1, 32)
    finally:
        compiler.process.kill()
