"""The kernel-launch check: graded wrappers count only when they launch a @triton.jit kernel of the notebook."""

import ast
from pathlib import Path
from textwrap import dedent

import nbformat
import pytest

from autograder.grading.launches import cell_trees, launching_functions, missing_launches

ROOT = Path(__file__).resolve().parent.parent
IMPORTS = "import torch\nimport triton\nimport triton.language as tl\n"
KERNEL = dedent("""
    @triton.jit
    def attn_kernel(q_ptr, o_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(o_ptr + i, tl.load(q_ptr + i))
""")
TORCH_WRAPPER = dedent("""
    def flash_attention(q, k, v, query_offset=None):
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
""")


def _solution_cells(assignment: str) -> list[str]:
    notebook = nbformat.read(ROOT / "source" / assignment / f"{assignment}.ipynb", as_version=4)
    return [cell.source for cell in notebook.cells
            if cell.cell_type == "code" and cell.metadata.get("nbgrader", {}).get("solution")]


def _cells(*sources: str) -> list[str]:
    return [dedent(source) for source in sources]


def _one_launch(kernel: str) -> str:
    """A @triton.jit kernel named `kernel`, of one pointer, and a flash_attention that launches it once."""
    return dedent(f"""
        @triton.jit
        def {kernel}(q_ptr):
            pass

        def flash_attention(q, k, v):
            {kernel}[(1,)](q)
            return q
        """)


def test_instructor_solution_of_04_launches():
    """04's solution cells: flash_attention launches flash_fwd_kernel, and nothing is reported missing."""
    cells = _solution_cells("04_triton_flash")
    assert {"flash_attention"} <= launching_functions(cells)
    assert missing_launches(cells, {"flash_attention"}) == {}


def test_instructor_solution_of_05_launches():
    """05's solution cells: fast_attention and fast_decode both launch kernels of the notebook."""
    cells = _solution_cells("05_fast_kernel")
    assert {"fast_attention", "fast_decode"} <= launching_functions(cells)
    assert missing_launches(cells, {"fast_attention", "fast_decode"}) == {}


HONEST = {
    "autotune stacked over jit": _cells(IMPORTS, """
        @triton.autotune(configs=[triton.Config({"BLOCK": 16})], key=["N"])
        @triton.jit
        def attn_kernel(q_ptr, o_ptr, N, BLOCK: tl.constexpr):
            pass

        def flash_attention(q, k, v):
            o = torch.empty_like(q)
            attn_kernel[lambda meta: (triton.cdiv(q.numel(), meta["BLOCK"]),)](q, o, q.numel())
            return o
        """),
    "from triton import jit": _cells("import torch\nfrom triton import jit\n", """
        @jit
        def attn_kernel(q_ptr, o_ptr):
            pass

        def flash_attention(q, k, v):
            o = torch.empty_like(q)
            attn_kernel[(1,)](q, o)
            return o
        """),
    "jit with arguments under an alias of triton": _cells("import triton as tr\n", """
        @tr.jit(debug=False)
        def attn_kernel(q_ptr, o_ptr):
            pass

        def flash_attention(q, k, v):
            attn_kernel[(1,)](q, q)
            return q
        """),
    "launch in a helper the wrapper calls": _cells(IMPORTS, KERNEL, """
        def _launch(q, o):
            attn_kernel[(1,)](q, o, N=16)

        def _prepare(q, k, v):
            o = torch.empty_like(q)
            _launch(q, o)
            return o

        def flash_attention(q, k, v):
            return _prepare(q.contiguous(), k, v)
        """),
    "kernel defined in a later cell than the wrapper": _cells(IMPORTS, """
        def flash_attention(q, k, v):
            o = torch.empty_like(q)
            attn_kernel[(1,)](q, o, N=16)
            return o
        """, KERNEL),
    "alias through a conditional expression": _cells(IMPORTS, KERNEL, """
        @triton.jit
        def attn_kernel_windowed(q_ptr, o_ptr, N: tl.constexpr):
            pass

        def flash_attention(q, k, v, window=None):
            launch = attn_kernel_windowed if window is not None else attn_kernel
            o = torch.empty_like(q)
            launch[(1,)](q, o, N=16)
            return o
        """),
    "plain alias and a grid-bound launcher": _cells(IMPORTS, KERNEL, """
        def flash_attention(q, k, v):
            fn = attn_kernel
            run = fn[(1,)]
            run(q, q, N=16)
            return q
        """),
    "a cell with a %time magic": _cells(IMPORTS, KERNEL, """
        def flash_attention(q, k, v):
            attn_kernel[(1,)](q, q, N=16)
            return q

        q = torch.randn(16)
        %time out = flash_attention(q, q, q)
        """),
    "the wrapper written in a %%time cell, with !shell and ? cells around": _cells(
        "!pip list\n" + IMPORTS, KERNEL, "attn_kernel?\n", """
        %%time
        def flash_attention(q, k, v):
            attn_kernel[(1,)](q, q, N=16)
            return q
        """),
    "kernel from triton.jit(f) and triton.autotune(...)(kernel)": _cells(IMPORTS, """
        def attn_body(q_ptr, o_ptr):
            pass

        attn_kernel = triton.jit(attn_body)
        attn_tuned = triton.autotune(configs=[], key=[])(attn_kernel)

        def flash_attention(q, k, v):
            attn_tuned[(1,)](q, q)
            return q
        """),
    "kernel passed to a helper that launches its parameter": _cells(IMPORTS, KERNEL, """
        def _run(kernel, grid, *args, **meta):
            kernel[grid](*args, **meta)

        def flash_attention(q, k, v):
            _run(attn_kernel, (1,), q, q, N=16)
            return q
        """),
    "kernel as a parameter's default": _cells(IMPORTS, KERNEL, """
        def flash_attention(q, k, v, *, kernel=attn_kernel):
            kernel[(1,)](q, q, N=16)
            return q
        """),
    "launch in a function nested inside the wrapper": _cells(IMPORTS, KERNEL, """
        def flash_attention(q, k, v):
            def go(x):
                attn_kernel[(1,)](x, x, N=16)
                return x
            return go(q)
        """),
    "a cell that does not parse is skipped": _cells(IMPORTS, "def broken(:\n", KERNEL, """
        def flash_attention(q, k, v):
            attn_kernel[(1,)](q, q, N=16)
            return q
        """),
}


@pytest.mark.parametrize("cells", HONEST.values(), ids=HONEST.keys())
def test_honest_variations_launch(cells):
    """A wrapper that launches the notebook's own kernel, written another honest way, passes."""
    assert "flash_attention" in launching_functions(cells)
    assert missing_launches(cells, {"flash_attention"}) == {}


CHEATS = {
    "plain PyTorch wrapper": _cells(IMPORTS, KERNEL, TORCH_WRAPPER),
    "kernel defined but never launched": _cells(IMPORTS, KERNEL, """
        def flash_attention(q, k, v):
            k_ = attn_kernel  # mentioned, never launched
            return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        """),
    "kernel imported from the engine": _cells(IMPORTS, """
        from flashcourse.engine.triton_flash import flash_fwd_kernel

        def flash_attention(q, k, v):
            o = torch.empty_like(q)
            flash_fwd_kernel[(1,)](q, k, v, o)
            return o
        """),
    "own kernel replaced by the engine's import in a later cell": _cells(
        IMPORTS, _one_launch("flash_fwd_kernel"), "from flashcourse.engine.triton_flash import flash_fwd_kernel\n"),
    "engine kernel imported inside the wrapper, shadowing the own one": _cells(IMPORTS, KERNEL, """
        def flash_attention(q, k, v):
            from flashcourse.engine.triton_flash import flash_fwd_kernel as attn_kernel
            attn_kernel[(1,)](q, k, v, q)
            return q
        """),
    "a non-jit function subscripted": _cells(IMPORTS, """
        class Grid:
            def __getitem__(self, grid):
                return lambda *args: None

        def attn_kernel(q_ptr, o_ptr):
            pass

        fake = Grid()

        def flash_attention(q, k, v):
            attn_kernel[(1,)](q, q)
            fake[(1,)](q, q)
            return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        """),
    "kernel redefined later as a plain function": _cells(IMPORTS, KERNEL, """
        def flash_attention(q, k, v):
            attn_kernel[(1,)](q, q, N=16)
            return q
        """, """
        def attn_kernel(q_ptr, o_ptr, N=16):
            pass
        """),
    "jit under a decorator that is not Triton's": _cells(IMPORTS, dedent("""
        def swap(kernel):
            from flashcourse.engine import triton_flash
            return triton_flash.flash_fwd_kernel

        @swap""") + _one_launch("attn_kernel")),
    "launch only in a function the wrapper never calls": _cells(IMPORTS, KERNEL, """
        def unused(q):
            attn_kernel[(1,)](q, q, N=16)
        """, TORCH_WRAPPER),
    "launch only inside a string": _cells(IMPORTS, KERNEL, """
        def flash_attention(q, k, v):
            exec("attn_kernel[(1,)](q, q, N=16)")
            return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        """),
}


@pytest.mark.parametrize("cells", CHEATS.values(), ids=CHEATS.keys())
def test_cheats_do_not_launch(cells):
    """A wrapper that does not launch a @triton.jit kernel of the notebook is reported missing."""
    assert "flash_attention" not in launching_functions(cells)
    assert set(missing_launches(cells, {"flash_attention"})) == {"flash_attention"}


def test_pytorch_wrapper_message_says_what_is_missing():
    """The message for a PyTorch wrapper names the wrapper and asks for kernel[grid](...)."""
    message = missing_launches(_cells(IMPORTS, KERNEL, TORCH_WRAPPER), {"flash_attention"})["flash_attention"]
    assert message.startswith("flash_attention launches no @triton.jit kernel defined in the notebook")
    assert "kernel[grid](...)" in message and "PyTorch" in message


def test_imported_kernel_message_names_it():
    """The message for a launched engine kernel names that kernel as not defined in the notebook."""
    message = missing_launches(CHEATS["kernel imported from the engine"], {"flash_attention"})["flash_attention"]
    assert message.startswith("flash_attention launches flash_fwd_kernel, which is not a @triton.jit kernel")


def test_undefined_or_imported_wrappers_are_missing():
    """A required wrapper that the notebook only imports, or never defines, is reported; one that launches is not."""
    cells = _cells(IMPORTS, KERNEL, """
        from flashcourse.engine.fast_attention import fast_attention

        def fast_decode(q, k, v):
            attn_kernel[(1,)](q, q, N=16)
            return q
        """)
    missing = missing_launches(cells, {"fast_attention", "fast_decode", "merge_partials"})
    assert set(missing) == {"fast_attention", "merge_partials"}
    assert "is not defined as a function in the notebook" in missing["fast_attention"]


def test_cell_trees_turn_ipython_syntax_into_python_and_skip_broken_cells():
    """Magics, shell lines and `?` become Python; a cell that still does not parse is left out."""
    trees = cell_trees(["%matplotlib inline\nx = 1\n", "!ls\n", "x?\n", "def broken(:\n", "y = 2\n"])
    assert len(trees) == 4
    assert all(isinstance(tree, ast.Module) for tree in trees)
    assert ast.unparse(trees[0]).endswith("x = 1")
