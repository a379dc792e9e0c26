"""The warm-up kernels of 04 and their checks, under Triton's interpreter (small shapes).

Each planted bug is the exported solution with one substitution, imported from a file (Triton reads
a kernel's source), and its check must name that mistake.
"""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from autograder.hidden import triton_flash as hidden
from flashcourse import runtime
from flashcourse.checks import triton_warmup as wc
from flashcourse.engine import triton_flash as engine

RT = runtime.current()
ENGINE = Path(engine.__file__)


def _variant(tmp_path: Path, old: str, new: str):
    """The engine module with `old` replaced by `new` (which must occur exactly once)."""
    text = ENGINE.read_text()
    assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times in the engine"
    path = tmp_path / f"variant_{abs(hash((old, new)))}.py"
    path.write_text(text.replace(old, new))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check(name: str, fn) -> None:
    """The visible test's checks of each warm-up, on the inputs of its test cell."""
    if name == "tile_copy":
        wc.check_tile_copy(fn, [(37, 45), (16, 20)], device=RT.device)
    elif name == "row_softmax":
        wc.check_row_softmax(fn, [wc.softmax_input(4, 70), wc.softmax_input(3, 5)], device=RT.device)
    elif name == "score_tile":
        wc.check_score_tile(fn, [(37, 45, 32), (20, 16, 16)], device=RT.device)
    else:
        wc.check_running_stats(fn, [wc.scores_input(20, 70, block_n=16)], device=RT.device)


@pytest.mark.parametrize("name", ["tile_copy", "row_softmax", "score_tile", "running_stats"])
def test_solution_passes_visible_and_hidden_checks(name):
    """The exported warm-up kernels pass their visible checks and their hidden tests."""
    fn = getattr(engine, name)
    _check(name, fn)
    getattr(hidden, f"test_{name}")(fn)


def test_specs_define_the_edge_cases():
    """The specs themselves: an empty row has m = -inf and l = 0; softmax rows sum to 1 at scores near 1000."""
    m, l = wc.running_stats_spec(torch.tensor([[-math.inf, -math.inf], [1000.0, 999.0]], dtype=torch.float64))
    assert m.tolist() == [-math.inf, 1000.0] and l[0] == 0 and l[1] == pytest.approx(1 + math.exp(-1))
    assert torch.allclose(wc.row_softmax_spec(wc.softmax_input(4, 70).double()).sum(1), torch.ones(4, dtype=torch.float64))
    assert wc.copy_input(3, 5)[2, 4] == 2 * wc.ENCODE + 4


PLANTED = [
    ("tile_copy", "tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on, tile, mask=inside)",
     "tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on, tile)",
     "out itself is right, but the kernel also stored at canvas .* the store's mask is missing"),
    ("tile_copy", "x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn",
     "x_ptr + rows[:, None] * stride_xn + cols[None, :] * stride_xm", "the strides are swapped"),
    ("tile_copy", "x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn",
     "x_ptr + rows[:, None] * N + cols[None, :]", "as if it were contiguous"),
    ("tile_copy", "rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                     # [BLOCK_M]",
     "rows = tl.arange(0, BLOCK_M)", r"Nothing was stored there"),
    ("row_softmax", 'mask=inside, other=float("-inf"))   # [BLOCK_N]', "mask=inside, other=0.0)",
     r"masked lanes past column 69 were loaded as 0 and counted"),
    ("row_softmax", "e = tl.exp(x - tl.max(x, axis=0))", "e = tl.exp(x)",
     r"Row 1 reaches .* overflows FP32 .* subtract the row's maximum"),
    ("row_softmax", "e / tl.sum(e, axis=0), mask=inside)", "e, mask=inside)", "without the division"),
    ("score_tile", 'input_precision="ieee") * scale', 'input_precision="ieee")', "not scaled"),
    ("score_tile", 'input_precision="ieee") * scale', 'input_precision="ieee") / D', "divided by D = 32"),
    ("running_stats", "l = l * tl.exp(m - ref) + ", "l = l + ", "l is not multiplied by alpha"),
    ("running_stats", 'ref = tl.where(m_new == float("-inf"), 0.0, m_new)    # rows that have seen no score yet',
     "ref = m_new", r"first tile is all -inf.* exp\(-inf - \(-inf\)\) = NaN"),
    ("running_stats", "mask=inside, other=float(\"-inf\"))\n        m_new", "mask=inside, other=0.0)\n        m_new",
     "masked lanes past the last key were loaded as 0"),
    ("running_stats", "l = l * tl.exp(m - ref) + tl.sum(tl.exp(s - ref[:, None]), axis=1)",
     "l = l + tl.sum(tl.exp(s), axis=1)", r"l is the sum of exp\(s\), not of exp\(s - m\)"),
    ("running_stats", "m_new = tl.maximum(m, tl.max(s, axis=1))\n        ref = tl.where(m_new == float(\"-inf\"), 0.0, m_new)    #",
     "m_new = tl.max(s, axis=1)\n        ref = tl.where(m_new == float(\"-inf\"), 0.0, m_new)    #",
     "maximum of the last tile only"),
]


@pytest.mark.parametrize("name, old, new, message", PLANTED, ids=[f"{p[0]}-{i}" for i, p in enumerate(PLANTED)])
def test_planted_bug_is_named(tmp_path, name, old, new, message):
    """A classic mistake planted in a warm-up fails its visible checks with the message that names it."""
    fn = getattr(_variant(tmp_path, old, new), name)
    with pytest.raises(AssertionError, match=message):
        _check(name, fn)


def test_unwritten_kernel_raises_not_implemented(tmp_path):
    """A kernel body left as the release's stub is reported as NotImplementedError, not as a wrong answer."""
    stub = _variant(tmp_path, "e = tl.exp(x - tl.max(x, axis=0))", "raise NotImplementedError()")
    with pytest.raises(NotImplementedError, match="row_softmax"):
        _check("row_softmax", stub.row_softmax)


def test_no_misnamed_mistake_for_an_unknown_bug(tmp_path):
    """A wrong answer that matches no known mistake is reported with its place only."""
    off = _variant(tmp_path, "e / tl.sum(e, axis=0), mask=inside)", "e / tl.sum(e, axis=0) + 0.5, mask=inside)")
    with pytest.raises(AssertionError) as failure:
        _check("row_softmax", off.row_softmax)
    text = str(failure.value)
    assert "out[0, 0]" in text and not any(w in text for w in ("masked lanes", "maximum", "division"))


@pytest.mark.slow
def test_blank_release_first_fails_at_the_first_warmup_test(tmp_path):
    """Run All on the unwritten 04: every cell before the first test runs (the masked load and store shown
    under the interpreter, the specs), and each warm-up test fails with NotImplementedError, not another error."""
    import nbformat
    from nbclient import NotebookClient

    from autograder.building import build
    from autograder.grading.preprocessors import is_test_cell

    nb = nbformat.read(build.RELEASE / "04_triton_flash" / "04_triton_flash.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    first_test = next(i for i, c in enumerate(code) if is_test_cell(c))
    raised = [i for i, c in enumerate(code) if any(o.output_type == "error" for o in c.outputs)]
    assert raised and raised[0] == first_test, f"cells {raised} raise; the first test is cell {first_test}"
    shown = "".join(o.get("text", "") for c in code[:first_test] for o in c.outputs)
    assert "lanes 5..7 got other=-1.0" in shown and "def tile_copy_spec" in shown
    warmups = [c for c in code if c.metadata.get("nbgrader", {}).get("grade_id", "") in
               {"test_tile_copy", "test_row_softmax", "test_score_tile", "test_running_stats"}]
    assert [o.ename for c in warmups for o in c.outputs if o.output_type == "error"] == ["NotImplementedError"] * 4
