"""Broken and hostile submissions: each gets no more than a wrong answer's score, and the batch goes on.

The submissions are made from the correct sample of 01 at test time, one change each.
"""

import json
import shutil

import pytest

from autograder import grade
from conftest import SAMPLES

pytestmark = pytest.mark.slow
ASSIGNMENT = "01_online_softmax"
FULL = {"test_tile_update": 3, "test_online_softmax": 3, "test_merge_states": 2}
CELL_TIMEOUT_S = 30


def _correct() -> dict:
    return json.loads((SAMPLES / "submitted" / "alt_correct" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb").read_text())


def _with_line_in_tile_update(line: str) -> dict:
    nb = _correct()
    cell = next(c for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") == "tile_update")
    source = "".join(cell["source"])
    marker = "    # exp2 form"
    assert marker in source
    cell["source"] = source.replace(marker, f"    {line}\n{marker}")
    return nb


def _with_cell_after_setup(code: str) -> dict:
    nb = _correct()
    nb["cells"].insert(2, {"cell_type": "code", "id": "learner-extra", "metadata": {}, "source": code,
                           "outputs": [], "execution_count": None})
    return nb


# student -> (what lands in submitted/<student>/01_online_softmax/, expected points, words in the summary)
CASES = {
    "warns_on_stderr": ({f"{ASSIGNMENT}.ipynb": _with_line_in_tile_update(
        'import warnings; warnings.warn("a harmless warning")')}, FULL, None),
    "loops_forever": ({f"{ASSIGNMENT}.ipynb": _with_line_in_tile_update("while True: pass")},
                      {"test_tile_update": 0, "test_online_softmax": 0, "test_merge_states": 2}, None),
    "exits_the_kernel": ({f"{ASSIGNMENT}.ipynb": _with_cell_after_setup("import os\nos._exit(0)")},
                         dict.fromkeys(FULL, 0), "kernel died"),
    "wrong_name": ({"online_softmax.ipynb": _correct()}, dict.fromkeys(FULL, 0), "must keep their name"),
    "empty_file": ({f"{ASSIGNMENT}.ipynb": ""}, dict.fromkeys(FULL, 0), "not a readable notebook"),
    "malformed_json": ({f"{ASSIGNMENT}.ipynb": json.dumps(_correct())[:-200]}, dict.fromkeys(FULL, 0),
                       "not a readable notebook"),
    "missing_notebook": ({}, dict.fromkeys(FULL, 0), "no 01_online_softmax.ipynb was submitted"),
    "correct_neighbour": ({f"{ASSIGNMENT}.ipynb": _correct()}, FULL, None),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("robustness")
    for student, (files, _, _) in CASES.items():
        folder = root / "submitted" / student / ASSIGNMENT
        folder.mkdir(parents=True)
        for name, content in files.items():
            (folder / name).write_text(content if isinstance(content, str) else json.dumps(content))
    outcomes = grade.grade(root / "submitted", root / "out", jobs=2, progress=False, cell_timeout=CELL_TIMEOUT_S)
    return {o.student: o for o in outcomes}, root / "out"


@pytest.mark.parametrize("student", CASES)
def test_score_and_summary(graded, student):
    """Each broken submission scores as asserted and the summary says what happened to it."""
    outcomes, out = graded
    _, points, words = CASES[student]
    outcome = outcomes[student]
    assert {s.question: s.points for s in outcome.scores if s.kind == "auto"} == points
    if words:
        assert words in outcome.problem
        assert f"{student}, {ASSIGNMENT}: " in (out / "summary.txt").read_text()
    else:
        assert not outcome.problem, outcome.problem


def test_grading_again_gives_the_same_grades(graded, tmp_path):
    """Grades are repeatable: regrading two of the submissions reproduces their grades exactly."""
    outcomes, _ = graded
    submitted = tmp_path / "submitted"
    for student in ("correct_neighbour", "warns_on_stderr"):
        shutil.copytree(SAMPLES / "submitted" / "alt_correct", submitted / student)
    again = grade.grade(submitted, tmp_path / "out", progress=False)
    for o in again:
        assert [(s.question, s.points) for s in o.scores] == [(s.question, s.points) for s in
                                                              outcomes["correct_neighbour"].scores]
