"""The nbgrader pipeline on the sample submissions: every expected score, and feedback without hidden tests."""

import csv

import pytest

from conftest import SAMPLES, expected_scores

pytestmark = pytest.mark.slow
EXPECTED = expected_scores()


def _points(scores, assignment, student):
    return {s.question: s.points for s in scores if s.assignment == assignment and s.student == student
            and s.kind == "auto"}


@pytest.mark.parametrize("assignment, student", [(a, s) for a, students in EXPECTED.items() for s in students])
def test_sample_scores_as_expected(graded_samples, assignment, student):
    """Each sample loses exactly the points of the questions its bug affects."""
    scores, _ = graded_samples
    got = _points(scores, assignment, student)
    assert got == EXPECTED[assignment][student], f"{student} on {assignment}: got {got}"


def test_expectations_cover_every_sample(graded_samples):
    """Every sample submission has expected scores, and the correct and blank students exist everywhere."""
    graded = {(p.parent.name, p.name) for p in (SAMPLES / "submitted").glob("*/*")}
    covered = {(student, assignment) for assignment, students in EXPECTED.items() for student in students}
    assert graded == covered
    for assignment, students in EXPECTED.items():
        assert {"alt_correct", "blank"} <= set(students), assignment
        assert all(points > 0 for points in students["alt_correct"].values())
        assert not any(students["blank"].values())


def test_grades_csv_has_every_question(graded_samples):
    """grades.csv has one row per student, assignment and question, manual answers included."""
    scores, out = graded_samples
    rows = list(csv.DictReader((out / "grades.csv").open()))
    assert len(rows) == len(scores)
    assert {"auto", "manual"} == {r["kind"] for r in rows}


def test_feedback_shows_no_hidden_test(graded_samples):
    """Feedback HTML keeps the verdicts and messages but never hidden test code or tracebacks into it."""
    _, out = graded_samples
    pages = sorted((out / "feedback").glob("*/*/*.html"))
    assert len(pages) == len({(p.parent.parent.name, p.parent.name) for p in pages}) > 0
    for page in pages:
        text = page.read_text()
        for leak in ("HIDDEN TESTS", "autograder.hidden", "hidden.test_"):
            assert leak not in text, f"{page} shows {leak!r}"
    buggy = (out / "feedback" / "bug_l_not_rescaled" / "01_online_softmax" / "01_online_softmax.html").read_text()
    assert "l is not multiplied by alpha" in buggy, "the feedback should carry the check's diagnosis"
