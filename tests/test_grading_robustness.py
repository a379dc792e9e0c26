"""Broken and hostile submissions: none scores more than a wrong answer, and the batch goes on.

Each submission is made at test time from a sample of 01 with one change. Hostile ones start from
the sample whose tile_update forgets to rescale l (a wrong answer worth 2 of 8 points), so any cheat
that worked would show up as more than 2 points. Broken-but-honest ones start from a correct sample.
"""

import copy
import json
import shutil

import pytest

from autograder import grade
from conftest import SAMPLES

pytestmark = pytest.mark.slow
ASSIGNMENT = "01_online_softmax"
NOTEBOOK = f"{ASSIGNMENT}.ipynb"
FULL = {"test_tile_update": 3, "test_online_softmax": 3, "test_merge_states": 2}
WRONG = {"test_tile_update": 0, "test_online_softmax": 0, "test_merge_states": 2}  # l not rescaled
ZERO = dict.fromkeys(FULL, 0)
CELL_TIMEOUT_S = 30


def _sample(student: str) -> dict:
    return json.loads((SAMPLES / "submitted" / student / ASSIGNMENT / NOTEBOOK).read_text())


CORRECT, BUGGY = _sample("alt_correct"), _sample("bug_l_not_rescaled")


def _cell(nb: dict, grade_id: str) -> dict:
    return next(c for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") == grade_id)


def with_cell(base: dict, code: str, at: int = 2) -> dict:
    """base with a learner-written code cell inserted (after the set-up cell by default)."""
    nb = copy.deepcopy(base)
    nb["cells"].insert(at, {"cell_type": "code", "id": f"learner-{at}", "metadata": {}, "source": code,
                            "outputs": [], "execution_count": None})
    return nb


def in_tile_update(base: dict, line: str) -> dict:
    """base with one line added at the top of tile_update's body."""
    nb = copy.deepcopy(base)
    cell = _cell(nb, "tile_update")
    marker = "    # exp2 form"
    source = "".join(cell["source"])
    assert marker in source
    cell["source"] = source.replace(marker, f"    {line}\n{marker}")
    return nb


def edited(base: dict, change) -> dict:
    nb = copy.deepcopy(base)
    change(nb)
    return nb


def _drop_test(nb):
    nb["cells"].remove(_cell(nb, "test_tile_update"))


def _duplicate_test(nb):
    cell = _cell(nb, "test_merge_states")
    nb["cells"].insert(nb["cells"].index(cell), copy.deepcopy(cell))


def _empty_tests(nb):
    for grade_id in FULL:
        _cell(nb, grade_id)["source"] = '"""emptied"""\npass'


def _strip_metadata(nb):
    for grade_id in FULL:
        _cell(nb, grade_id)["metadata"] = {}


def _more_points(nb):
    _cell(nb, "test_merge_states")["metadata"]["nbgrader"]["points"] = 100


PATCH_CHECKS = "import flashcourse.checks as c\nfor n in dir(c):\n    if n.startswith('check_'):\n        setattr(c, n, lambda *a, **k: None)"
PATCH_ALLCLOSE = "import math, torch, numpy\ntorch.allclose = numpy.allclose = lambda *a, **k: True\nmath.isclose = lambda *a, **k: True"
TRANSFORMER = "get_ipython().input_transformers_post.append(lambda lines: ['pass\\n'])"
CUSTOM_EXC = "get_ipython().set_custom_exc((BaseException,), lambda *a, **k: None)"
READ_SOURCE = ("import pathlib\nfor p in pathlib.Path('/').glob('**/source/01_online_softmax/*.ipynb'):\n"
               "    exec(compile(p.read_text(), 'x', 'exec'))")
WRITE_GRADER = ("import pathlib, os\nfor d in ('../../..', os.path.expanduser('~'), '/work'):\n"
                "    try:\n        (pathlib.Path(d) / 'grades.csv').write_text('alt_correct,999')\n"
                "    except OSError as e:\n        print(e)")

# student -> (files in submitted/<student>/01_online_softmax/, expected points, words the summary must hold)
CASES = {
    # honest but broken
    "warns_on_stderr": ({NOTEBOOK: in_tile_update(CORRECT, 'import warnings; warnings.warn("a harmless warning")')},
                        FULL, None),
    "loops_forever": ({NOTEBOOK: in_tile_update(CORRECT, "while True: pass")},
                      {"test_tile_update": 0, "test_online_softmax": 0, "test_merge_states": 2}, None),
    "asks_for_input": ({NOTEBOOK: with_cell(CORRECT, "name = input('your name? ')")}, FULL, None),
    "huge_output": ({NOTEBOOK: with_cell(CORRECT, "print('x' * 50_000_000)")}, FULL, None),
    "allocates_64_gib": ({NOTEBOOK: with_cell(CORRECT, "import torch\nblock = torch.ones(64 << 30, dtype=torch.uint8)")},
                         FULL, None),
    "exits_the_kernel": ({NOTEBOOK: with_cell(CORRECT, "import os\nos._exit(0)")}, ZERO, "kernel died"),
    "sys_exit": ({NOTEBOOK: with_cell(BUGGY, "import sys\nsys.exit(0)")}, WRONG, None),
    "wrong_name": ({"online_softmax.ipynb": CORRECT}, ZERO, "must keep their name"),
    "empty_file": ({NOTEBOOK: ""}, ZERO, "not a readable notebook"),
    "malformed_json": ({NOTEBOOK: json.dumps(CORRECT)[:-200]}, ZERO, "not a readable notebook"),
    "missing_notebook": ({}, ZERO, "no 01_online_softmax.ipynb was submitted"),
    "correct_neighbour": ({NOTEBOOK: CORRECT}, FULL, None),
    # hostile, on a wrong answer
    "patches_checks": ({NOTEBOOK: with_cell(BUGGY, PATCH_CHECKS)}, ZERO, None),
    "patches_allclose": ({NOTEBOOK: with_cell(BUGGY, PATCH_ALLCLOSE)}, WRONG, None),
    "input_transformer": ({NOTEBOOK: with_cell(BUGGY, TRANSFORMER)}, ZERO, None),
    "custom_exception_handler": ({NOTEBOOK: with_cell(BUGGY, CUSTOM_EXC)}, WRONG, None),
    "reads_the_source": ({NOTEBOOK: with_cell(BUGGY, READ_SOURCE)}, WRONG, None),
    "writes_grader_files": ({NOTEBOOK: with_cell(BUGGY, WRITE_GRADER)}, WRONG, None),
    "imports_the_engine": ({NOTEBOOK: with_cell(BUGGY, "from flashcourse.engine.online_softmax import *")},
                           ZERO, None),
    "deletes_a_test": ({NOTEBOOK: edited(BUGGY, _drop_test)}, WRONG, None),
    "duplicates_a_test": ({NOTEBOOK: edited(BUGGY, _duplicate_test)}, WRONG, None),
    "empties_the_tests": ({NOTEBOOK: edited(BUGGY, _empty_tests)}, WRONG, None),
    "strips_test_metadata": ({NOTEBOOK: edited(BUGGY, _strip_metadata)}, WRONG, None),
    "edits_points": ({NOTEBOOK: edited(BUGGY, _more_points)}, WRONG, None),
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
    """Each submission scores as asserted (never above a wrong answer for a cheat) and the summary explains."""
    outcomes, out = graded
    _, points, words = CASES[student]
    outcome = outcomes[student]
    got = {s.question: s.points for s in outcome.scores if s.kind == "auto"}
    assert got == points, f"{student}: {got}; problem: {outcome.problem!r}"
    assert all(s.max_points == FULL[s.question] for s in outcome.scores if s.kind == "auto"), "points were edited"
    if words:
        assert words in outcome.problem
        assert f"{student}, {ASSIGNMENT}: " in (out / "summary.txt").read_text()
    else:
        assert not outcome.problem, outcome.problem


def test_nothing_outside_the_scratch_folder_was_written(graded):
    """The writer's attempts landed nowhere: the grader's grades.csv has no forged line."""
    _, out = graded
    assert "999" not in (out / "grades.csv").read_text()


def test_grading_again_gives_the_same_grades(graded, tmp_path):
    """Grades are repeatable: regrading reproduces them exactly."""
    outcomes, _ = graded
    shutil.copytree(SAMPLES / "submitted" / "alt_correct", tmp_path / "submitted" / "correct_neighbour")
    again = grade.grade(tmp_path / "submitted", tmp_path / "out", progress=False)
    assert [(s.question, s.points) for s in again[0].scores] == \
           [(s.question, s.points) for s in outcomes["correct_neighbour"].scores]
