"""Without a jail, learners' notebooks are not run: the grader refuses and says how to get one.

A machine without bubblewrap is simulated by a PATH that holds only the virtual environment's
scripts. `--trusted` is the one way to grade there, and the summary then says so.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autograder import ROOT
from autograder.grading.submission import nbgrader_cmd, register
from conftest import SAMPLES, expected_scores

pytestmark = pytest.mark.slow
ASSIGNMENT = "01_online_softmax"
NO_BWRAP = {**os.environ, "PATH": str(Path(sys.executable).parent)}


@pytest.fixture
def one_student(tmp_path):
    shutil.copytree(SAMPLES / "submitted" / "alt_correct" / ASSIGNMENT, tmp_path / "submitted" / "someone" / ASSIGNMENT)
    return tmp_path


def _grade(folder: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autograder", "grade", str(folder / "submitted"),
                           "--out", str(folder / "out"), "--jobs", "1", *options],
                          cwd=ROOT, env=NO_BWRAP, capture_output=True, text=True, timeout=900)


def test_the_batch_refuses_without_a_jail(one_student):
    """No bubblewrap: exit status 2, a message naming bubblewrap, the container image and --trusted, no grades."""
    run = _grade(one_student)
    assert run.returncode == 2, run.stdout + run.stderr
    for words in ("bubblewrap", "docker build", "--trusted"):
        assert words in run.stderr
    assert not (one_student / "out" / "grades.csv").exists()


def test_trusted_notebooks_are_graded_and_the_summary_says_how(one_student):
    """--trusted grades without a jail, and both the output and summary.txt say it ran WITHOUT one."""
    run = _grade(one_student, "--trusted")
    assert run.returncode == 0, run.stdout + run.stderr
    summary = (one_student / "out" / "summary.txt").read_text()
    assert "WITHOUT a jail" in summary and "someone, 01_online_softmax" in summary
    full = sum(expected_scores()[ASSIGNMENT]["alt_correct"].values())
    assert f"{full}/{full}" in run.stdout


def test_plain_nbgrader_refuses_too(one_student):
    """`nbgrader autograde` itself, with the course's configuration, runs nothing of the notebook without a jail."""
    folders = {kind: one_student / kind for kind in ("submitted", "autograded", "feedback")}
    (one_student / "templates").mkdir()
    gradebook = register(ASSIGNMENT, one_student / "templates")
    run = subprocess.run(nbgrader_cmd("autograde", ASSIGNMENT, "--force", db=gradebook,
                                      folders=folders), cwd=ROOT, env=NO_BWRAP, capture_output=True, text=True,
                         timeout=900)
    assert "refusing to run this notebook without a jail" in run.stdout + run.stderr
    assert not list((one_student / "autograded").rglob("*.ipynb"))
