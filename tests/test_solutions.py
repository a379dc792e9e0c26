"""Every solution notebook executes top to bottom on this machine, with its visible tests passing."""

import pytest

from autograder import build

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("assignment", build.assignments())
def test_solution_executes(assignment, tmp_path):
    """The worked solution (solution cells filled, hidden tests removed) runs without an error."""
    nb = build.solution_cells(assignment)
    build.execute(nb, tmp_path, timeout=900)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
