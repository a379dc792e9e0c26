"""The learner's self-check runs the visible tests and says which fail."""

import pytest

from conftest import SAMPLES
from flashcourse import selfcheck

pytestmark = pytest.mark.slow
NOTEBOOK = "01_online_softmax/01_online_softmax.ipynb"


def test_correct_notebook_passes(capsys):
    """A correct notebook passes every visible test and exits 0."""
    assert selfcheck.main([str(SAMPLES / "submitted" / "alt_correct" / NOTEBOOK)]) == 0
    assert "3 of 3 visible tests pass" in capsys.readouterr().out


def test_blank_notebook_fails_loudly(capsys):
    """The untouched release fails every test with NotImplementedError and exits 1."""
    assert selfcheck.main([str(SAMPLES / "submitted" / "blank" / NOTEBOOK)]) == 1
    out = capsys.readouterr().out
    assert "0 of 3 visible tests pass" in out and "NotImplementedError" in out
