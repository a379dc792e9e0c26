"""The learner's self-check runs the visible tests and says which fail."""

import pytest

from conftest import SAMPLES, expected_scores
from flashcourse import selfcheck

pytestmark = pytest.mark.slow
NOTEBOOK = "01_online_softmax/01_online_softmax.ipynb"
TESTS = len(expected_scores()["01_online_softmax"]["alt_correct"])     # 01's graded test cells


def test_correct_notebook_passes(capsys):
    """A correct notebook passes every visible test and exits 0."""
    assert selfcheck.main([str(SAMPLES / "submitted" / "alt_correct" / NOTEBOOK)]) == 0
    assert f"{TESTS} of {TESTS} visible tests pass" in capsys.readouterr().out


def test_blank_notebook_fails_loudly(capsys):
    """The untouched release fails every test with NotImplementedError and exits 1."""
    assert selfcheck.main([str(SAMPLES / "submitted" / "blank" / NOTEBOOK)]) == 1
    out = capsys.readouterr().out
    assert f"0 of {TESTS} visible tests pass" in out and "NotImplementedError" in out
