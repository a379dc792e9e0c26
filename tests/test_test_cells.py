"""How the grader reads the instructor's test cells and given code (autograder/grading/execute.py, kernel_world.py).

What the hidden part of a test cell prints stays out of the feedback, so the cell is cut at its
markers into visible and hidden parts; and the functions that source/ hands out whole are the
instructor's, found by where the solution regions are, never by the notebook's copy.
"""

import nbformat

from autograder.grading import kernel_world
from autograder.grading.execute import _test_parts
from autograder.grading.preprocessors import graded_names

CELL = '''"""A test."""
print("visible")
### BEGIN HIDDEN TESTS
print("hidden")
### END HIDDEN TESTS
print("after")
'''


def test_a_test_cell_is_cut_into_visible_and_hidden_parts():
    """Three parts, visible-hidden-visible, each keeping its line numbers for tracebacks."""
    parts = _test_parts(CELL)
    assert [visible for _, visible in parts] == [True, False, True]
    assert 'print("hidden")' in parts[1][0] and 'print("hidden")' not in parts[0][0] + parts[2][0]
    assert parts[1][0].splitlines()[3] == 'print("hidden")'   # line 4 of the cell stays line 4


def test_a_cell_whose_parts_do_not_compile_alone_is_one_hidden_part():
    """A marker inside an indented block: the whole cell runs as one part, and prints nothing to the feedback."""
    cell = 'if True:\n    x = 1\n    ### BEGIN HIDDEN TESTS\n    y = 2\n    ### END HIDDEN TESTS\n'
    assert _test_parts(cell) == [(cell, False)]
    assert _test_parts("x = 1\n") == [("x = 1\n", True)]


def test_given_definitions_are_the_functions_with_no_solution_in_them():
    """06's train_step_gradients and flash_attention_train are given whole; attention_backward is the learner's."""
    source = nbformat.read("source/06_backward/06_backward.ipynb", as_version=4)
    given = kernel_world.given_definitions(source, graded_names(source))
    defined = {line.split("(")[0].removeprefix("def ") for line in given.splitlines() if line.startswith("def ")}
    assert {"train_step_gradients", "flash_attention_train", "backward_delta"} <= defined
    assert not defined & {"attention_backward", "online_attention_lse", "flash_attention_backward"}
    assert "### BEGIN SOLUTION" not in given
