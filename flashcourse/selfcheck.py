"""Check your own notebook before you hand it in: run it from the top and report every test cell.

    python -m flashcourse.selfcheck notebooks/01_online_softmax/01_online_softmax.ipynb

or, from the last cell of a notebook (save it first), `selfcheck.run("01_online_softmax.ipynb")`.
The notebook runs in a fresh kernel, as the grader will run it; the exit status is 1 when any visible
test fails. The grader also runs hidden tests, so passing here is necessary, not sufficient.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TestResult:
    name: str
    points: float
    passed: bool
    message: str


def run(path: str | Path, timeout: int = 600, verbose: bool = True) -> list[TestResult]:
    """Execute a saved notebook in a fresh kernel and return the outcome of each test cell."""
    import nbformat
    from nbclient import NotebookClient

    path = Path(path).resolve()
    nb = nbformat.read(path, as_version=4)
    # Errors are recorded in the cells and the run goes on, as in grading.
    NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    results = []
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type != "code" or not meta.get("grade") or meta.get("solution"):
            continue
        errors = [o for o in cell.outputs if o.output_type == "error"]
        message = f"{errors[0].ename}: {errors[0].evalue}" if errors else ""
        results.append(TestResult(meta["grade_id"], float(meta.get("points", 0)), not errors, message))
    if verbose:
        print(report(path.name, results))
    return results


def report(name: str, results: list[TestResult]) -> str:
    lines = [f"{name}: {sum(r.passed for r in results)} of {len(results)} visible tests pass"]
    for r in results:
        lines.append(f"  {'PASS' if r.passed else 'FAIL'}  {r.name} ({r.points:g} points)"
                     + (f"\n        {r.message}" if r.message else ""))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    return 0 if all(r.passed for r in run(argv[0])) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
