"""04's kernel points are earned by the learner's kernel computing the answer, launched by the grader.

Each kernel test cell runs twice: with the learner's wrapper, and with the instructor's wrapper
launching the learner's kernels in a jail of their own (autograder/grading/kernel_world.py). A wrapper that
computes the answer with torch beside a launch that never runs, or a launch whose output is ignored,
loses what the kernel is worth; so does a kernel that runs only as Python (here one list
comprehension, which the interpreter runs and Triton's compiler refuses). A kernel written another
honest way (under another name, wrapped by autotune, with a @triton.jit helper) keeps full marks.
Each submission is alt_correct's notebook with one or two cells changed.
"""

import copy
import json

import nbformat
import pytest

from autograder.jail import sandbox as jail
from autograder.grading import kernel_world
from conftest import SAMPLES, assert_auto_points, expected_scores, feedback_page, grade_submissions

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(jail.why_no_jail() is not None, reason=f"no jail here: {jail.why_no_jail()}")]
FLASH = "04_triton_flash"
FULL = expected_scores()[FLASH]["alt_correct"]
KERNEL_CELLS = ("test_prefill", "test_offset", "test_query_offset", "test_gqa", "test_block_skipping", "test_window",
                "test_window_skipping")

# The answer from torch; the launch below it is never reached.
TORCH_ANSWER = '''
def _torch_attention(q, k, v, offset, window):
    group = q.shape[1] // k.shape[1]
    kk, vv = (x.float().repeat_interleave(group, dim=1) for x in (k, v))
    scores = q.float() @ kk.transpose(-2, -1) / math.sqrt(q.shape[-1])
    q_pos = torch.arange(q.shape[2], device=q.device)[:, None] + offset
    k_pos = torch.arange(k.shape[2], device=q.device)[None, :]
    visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.nan_to_num(scores.softmax(-1)).matmul(torch.nan_to_num(vv)).to(q.dtype)
'''

LAUNCH = '''flash_fwd_kernel[grid](
            q, k, v, o, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
            t, s, offset, q_heads, q_heads // kv_heads, window or 0, 1.0 / math.sqrt(d),
            D=d, BLOCK_M=block_m, BLOCK_N=block_n, WINDOWED=window is not None, **launch)'''

WRAPPER = '''
def flash_attention(q, k, v, query_offset=None, block_m=32, block_n=32, window=None, **launch):
    batch, q_heads, t, d = q.shape
    _, kv_heads, s, _ = k.shape
    if len({q.device, k.device, v.device}) > 1:
        raise ValueError("q, k and v live on different devices")
    if q_heads % kv_heads != 0:
        raise ValueError("Hq must be a multiple of Hkv")
    if d < 16 or (d & (d - 1)) != 0:
        raise ValueError("D must be a power of two, at least 16")
    offset = s - t if query_offset is None else query_offset
    o = torch.empty_like(q)
    grid = (triton.cdiv(t, block_m), batch * q_heads)
    LAUNCH_HERE
    return ANSWER_HERE
'''
TORCH_CALL = "_torch_attention(q, k, v, offset, window)"
IF_FALSE = WRAPPER.replace("LAUNCH_HERE", "if False:\n        " + LAUNCH.replace("\n", "\n    ")).replace("ANSWER_HERE", TORCH_CALL)
IGNORED = WRAPPER.replace("LAUNCH_HERE", LAUNCH).replace("ANSWER_HERE", TORCH_CALL)
DO_NOTHING_BODY = '''
    """Launched, and computes nothing."""
    pass
'''


def _notebook(**cells: str) -> dict:
    """alt_correct's 04 with the named cells' code replaced."""
    nb = copy.deepcopy(json.loads((SAMPLES / "submitted" / "alt_correct" / FLASH / f"{FLASH}.ipynb").read_text()))
    for cell in nb["cells"]:
        grade_id = cell["metadata"].get("nbgrader", {}).get("grade_id")
        if grade_id in cells:
            cell["source"] = cells[grade_id]
    return nb


def _cell(grade_id: str) -> str:
    nb = json.loads((SAMPLES / "submitted" / "alt_correct" / FLASH / f"{FLASH}.ipynb").read_text())
    return next("".join(c["source"]) for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") == grade_id)


KERNEL = _cell("flash_fwd_kernel")
SIGNATURE = KERNEL[:KERNEL.index('    """One program')]
STUB = SIGNATURE + '    """Not written yet."""\n    raise NotImplementedError()\n'
# Python the interpreter runs and Triton's compiler refuses: the kernel does not compile for a GPU.
PYTHON_IN_BODY = KERNEL.replace('    block = tl.program_id(0)', '    unused = [i for i in range(3)]\n    block = tl.program_id(0)', 1)
# Honest, written otherwise: the body under another name, wrapped by autotune, one step in a jit helper.
OTHERWISE = (KERNEL.replace("def flash_fwd_kernel(", "def _flash_fwd_body(", 1)
             .replace("    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)", "    rows = _query_rows(block, BLOCK_M)", 1)
             + '\n\nflash_fwd_kernel = triton.autotune(configs=[triton.Config({}, num_warps=4)], key=["T"])(_flash_fwd_body)\n')
HELPER = '''@triton.jit
def _query_rows(block, BLOCK_M: tl.constexpr):
    """The query indices of program `block`."""
    return block * BLOCK_M + tl.arange(0, BLOCK_M)


'''

LOST = {**FULL, **dict.fromkeys(KERNEL_CELLS, 0.0)}
CASES = {  # student -> (notebook, expected points)
    "launch_under_if_false": (_notebook(flash_fwd_kernel=STUB, flash_attention=TORCH_ANSWER + IF_FALSE), LOST),
    "launch_ignored": (_notebook(flash_fwd_kernel=SIGNATURE + DO_NOTHING_BODY, flash_attention=TORCH_ANSWER + IGNORED),
                       LOST),
    "python_in_kernel_body": (_notebook(flash_fwd_kernel=PYTHON_IN_BODY), LOST),
    "kernel_written_otherwise": (_notebook(flash_fwd_kernel=HELPER + OTHERWISE), FULL),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    return grade_submissions(tmp_path_factory.mktemp("kernels"), {s: (FLASH, nb) for s, (nb, _) in CASES.items()})


@pytest.mark.parametrize("student", CASES)
def test_kernel_points_need_the_kernel(graded, student):
    """Each shortcut loses the kernel's points and keeps the rest; the kernel written otherwise keeps all."""
    outcomes, _ = graded
    assert_auto_points(outcomes[student], CASES[student][1])


def test_the_feedback_says_the_kernel_was_run_by_the_grader(graded):
    """The message names the grader's launch, and for Python in the body, the GPU compilation that failed."""
    _, out = graded
    ignored = feedback_page(out, "launch_ignored")
    assert "launched by the grader&#39;s own flash_attention" in ignored or "launched by the grader's own" in ignored
    python = feedback_page(out, "python_in_kernel_body")
    assert "does not compile for a GPU (sm_90)" in python


def test_the_kernel_world_holds_only_kernels():
    """What the grader takes from a notebook: its kernels, jit helpers and triton imports; not its wrapper,
    not a plain function the kernel calls, not a global that is not a constant."""
    source = nbformat.read(f"source/{FLASH}/{FLASH}.ipynb", as_version=4)
    learner = ["import torch\nimport triton\nimport triton.language as tl\nimport math",
               "SECRET = open('/etc/hostname').read()\nBLOCK = tl.constexpr(16)\n"
               "def plain(x):\n    return x\n\n" + HELPER + OTHERWISE.replace("    cols = tl.arange(0, D)", "    cols = tl.arange(0, D) + plain(0) * BLOCK + SECRET", 1),
               TORCH_ANSWER + IF_FALSE]
    world = kernel_world.build(learner, source, {"flash_attention"})
    module = world.program[world.program.index("_module.write("):world.program.index("globals().update")]
    assert "def _flash_fwd_body" in module and "def _query_rows" in module and "BLOCK = triton.language.constexpr(16)" in module
    assert "def plain" not in module and "SECRET =" not in module and "autotune" not in module
    assert "_torch_attention" not in world.program
