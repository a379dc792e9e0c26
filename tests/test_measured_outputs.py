"""The executed solutions quote the measurements shipped with the package: every cell that prints what
`flashcourse.bench.measured` reads is run again here, on today's files, and must print what its stored output
shows. A measurement replaced without running the solution again (a stale table, a loss curve from an older run)
fails here, naming the cell.

Cells that measure live on a GPU (a branch on `rt.device`) are left out: their output is the GPU's run, not a
file's. The cell runs with the imports and the constant assignments of the cells before it."""

import ast
import contextlib
import io
import json
from pathlib import Path

import pytest

from conftest import ROOT

SOLUTIONS = sorted((ROOT / "solutions").glob("*/*.ipynb"))


def _code(cell) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _given(cells) -> str:
    """The imports and constant assignments (a literal on the right) of `cells`, top level only."""
    kept = []
    for cell in cells:
        try:
            tree = ast.parse(_code(cell))
        except SyntaxError:      # a cell magic: nothing of it is needed
            continue
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                kept.append(node)
            elif isinstance(node, ast.Assign):
                with contextlib.suppress(ValueError, TypeError, SyntaxError, RecursionError):
                    ast.literal_eval(node.value)
                    kept.append(node)
    return ast.unparse(ast.Module(body=kept, type_ignores=[]))


def _quoting_cells():
    for path in SOLUTIONS:
        cells = json.loads(path.read_text())["cells"]
        for index, cell in enumerate(cells):
            code = _code(cell)
            if cell["cell_type"] == "code" and "measured(" in code and "rt.device" not in code:
                yield pytest.param(path, index, id=f"{path.parent.name}:{cell.get('id', index)}")


@pytest.mark.parametrize("path, index", list(_quoting_cells()))
def test_solution_output_matches_the_measurements(path: Path, index: int, monkeypatch):
    """The cell, run on today's measurement files, prints exactly its stored output."""
    import IPython.display

    cells = json.loads(path.read_text())["cells"]
    cell = cells[index]
    stored = "".join("".join(o["text"]) for o in cell.get("outputs", [])
                     if o.get("output_type") == "stream" and o.get("name") == "stdout")
    monkeypatch.setattr(IPython.display, "display", lambda *args, **kwargs: None)   # figures are not compared
    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(_given([c for c in cells[:index] if c["cell_type"] == "code"]), "earlier cells", "exec"), namespace)
        printed.seek(0)
        printed.truncate()
        exec(compile(_code(cell), f"{path.name} cell {cell.get('id', index)}", "exec"), namespace)
    assert stored, f"{path.name}, cell {cell.get('id', index)} has no stored output: run the solution again"
    assert printed.getvalue() == stored, (
        f"{path.name}, cell {cell.get('id', index)}: its stored output differs from what today's measurement files "
        f"print; run the solution again (python -m autograder build, or on a GPU: build --solutions-to-run)")
