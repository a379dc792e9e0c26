"""Run All on the unwritten release notebooks: nothing but the exercises' own cells fails.

Each solution is executed top to bottom, its visible tests passing, on a fresh Colab-like runtime from the
course's wheel (tests/test_colab.py); tests/test_build.py checks that the committed solutions are built from
source/.
"""

import pytest

from autograder.building import build

pytestmark = pytest.mark.slow


def test_blank_release_of_01_fails_only_in_its_tests(tmp_path):
    """Run All on the unwritten 01 reaches the explorer; only test cells fail, and the cells that need
    tile_update say so in words instead of raising."""
    import nbformat
    from nbclient import NotebookClient

    from autograder.grading.preprocessors import is_test_cell
    from flashcourse.explore import widgets

    nb = nbformat.read(build.RELEASE / "01_online_softmax" / "01_online_softmax.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    failing = [c.source.split("\n", 1)[0] for c in code if any(o.output_type == "error" for o in c.outputs)
               and not is_test_cell(c)]
    assert not failing, f"cells other than tests raise on the blank notebook: {failing}"
    first_test = next(i for i, c in enumerate(code) if is_test_cell(c))
    explorer = next(i for i, c in enumerate(code) if "widgets.tile_explorer()" in c.source)
    assert explorer < first_test, "the explorer must come before the first test, where Run All stops"
    said = ["".join(o.get("text", "") for o in c.outputs) for c in code if 'state_plot(update="tile_update")' in c.source]
    assert said == [widgets.NOT_WRITTEN + "\n"]


@pytest.mark.parametrize("assignment", build.assignments())
def test_blank_release_runs_until_the_first_exercise(assignment, tmp_path):
    """Run All on an unwritten notebook: nothing raises before the first exercise's stub, and a cell that is
    not a test raises only a stub's NotImplementedError, never a failure of its own (08, with no exercise, runs
    through without raising)."""
    import nbformat
    from nbclient import NotebookClient

    from autograder.grading.preprocessors import is_test_cell

    nb = nbformat.read(build.RELEASE / assignment / f"{assignment}.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    first_exercise = next((i for i, c in enumerate(code) if c.metadata.get("nbgrader", {}).get("solution")), len(code))
    # A stub kernel raises its NotImplementedError inside Triton's interpreter, which reports it as an
    # InterpreterError wrapping it (its value is the NotImplementedError's repr).
    raised = [(i, "NotImplementedError" if o.ename == "InterpreterError" and o.evalue.startswith("NotImplementedError(")
               else o.ename, c.source.split("\n", 1)[0]) for i, c in enumerate(code)
              for o in c.outputs if o.output_type == "error"]
    assert not [r for r in raised if r[0] < first_exercise], f"{assignment}: raises before the first exercise: {raised}"
    given = [r for r in raised if not is_test_cell(code[r[0]])]
    assert all(name == "NotImplementedError" for _, name, _ in given), f"{assignment}: a cell fails on its own: {given}"
