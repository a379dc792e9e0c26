"""Plain `nbgrader autograde` and `generate_feedback`, run from the course root, refuse symbolic links.

nbgrader alone would grade a notebook that is a link to source/ and copy what a link beside a notebook
points to (the master notebook, the hidden checks) into autograded/ and feedback/. Each student below
is one way of submitting a link; `honest` is graded, which shows that the refusal is about the links.
"""

import shutil
import subprocess
from pathlib import Path

import pytest
from nbgrader.api import Gradebook, MissingEntry

from autograder import ROOT
from autograder.grading.submission import nbgrader_cmd, register
from conftest import SAMPLES, expected_scores

pytestmark = pytest.mark.slow
ASSIGNMENT = "01_online_softmax"
NOTEBOOK = f"{ASSIGNMENT}.ipynb"
HONEST = SAMPLES / "submitted" / "alt_correct" / ASSIGNMENT
HIDDEN = ROOT / "autograder" / "hidden" / "online_softmax.py"
MASTER = ROOT / "source" / ASSIGNMENT / NOTEBOOK


def _honest(folder: Path) -> Path:
    shutil.copytree(HONEST, folder)
    return folder


def _notebook_is_a_link(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / NOTEBOOK).symlink_to(MASTER)
    return folder / NOTEBOOK


def _link_beside(folder: Path) -> Path:
    (_honest(folder) / "notes.txt").symlink_to(HIDDEN)
    return folder / "notes.txt"


def _link_nested(folder: Path) -> Path:
    (_honest(folder) / "data" / "more").mkdir(parents=True)
    (folder / "data" / "more" / "master.ipynb").symlink_to(MASTER)
    return folder / "data" / "more" / "master.ipynb"


def _folder_link_beside(folder: Path) -> Path:
    (_honest(folder) / "source").symlink_to(MASTER.parent)
    return folder / "source"


def _assignment_is_a_link(folder: Path) -> Path:
    folder.parent.mkdir(parents=True)
    folder.symlink_to(MASTER.parent)
    return folder


# student -> how the submission is made; each returns the link that must be named
LINKED = {"notebook_link": _notebook_is_a_link, "link_beside": _link_beside, "link_nested": _link_nested,
          "folder_link_beside": _folder_link_beside, "assignment_link": _assignment_is_a_link}


def _nbgrader(course: Path, *args: str) -> subprocess.CompletedProcess:
    folders = {kind: course / kind for kind in ("submitted", "autograded", "feedback")}
    return subprocess.run(nbgrader_cmd(*args, ASSIGNMENT, "--force", db=course / "templates" / f"{ASSIGNMENT}.db",
                                       folders=folders), cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """Autograde every student, plant a link in one honest student's autograded/ folder, generate feedback."""
    course = tmp_path_factory.mktemp("links")
    submitted = course / "submitted"
    links = {student: make(submitted / student / ASSIGNMENT) for student, make in LINKED.items()}
    for student in ("honest", "linked_after_grading"):
        _honest(submitted / student / ASSIGNMENT)
    (course / "templates").mkdir()
    register(ASSIGNMENT, course / "templates")
    autograde = _nbgrader(course, "autograde")
    planted = course / "autograded" / "linked_after_grading" / ASSIGNMENT / "notes.txt"
    planted.symlink_to(HIDDEN)
    feedback = _nbgrader(course, "generate_feedback")
    return course, links, planted, autograde, feedback


def _submission(course: Path, student: str):
    with Gradebook(f"sqlite:///{course / 'templates' / f'{ASSIGNMENT}.db'}") as gb:
        try:
            return gb.find_submission(ASSIGNMENT, student).score
        except MissingEntry:
            return None


@pytest.mark.parametrize("student", LINKED)
def test_a_submission_holding_a_link_is_refused_and_named(course, student):
    """No grade for the student, nothing of theirs in autograded/, and a log line naming the link."""
    folder, links, _, autograde, _ = course
    assert autograde.returncode != 0, "nbgrader should report the refused students"
    assert f"Refusing {student}'s {ASSIGNMENT}: {links[student]} is a symbolic link" in autograde.stderr
    assert _submission(folder, student) is None
    assert not (folder / "autograded" / student).exists()


def test_an_honest_student_beside_them_is_graded(course):
    folder, _, _, _, feedback = course
    assert _submission(folder, "honest") == sum(expected_scores()[ASSIGNMENT]["alt_correct"].values())
    assert (folder / "feedback" / "honest" / ASSIGNMENT / f"{ASSIGNMENT}.html").is_file(), feedback.stderr


def test_generate_feedback_refuses_a_link_in_autograded(course):
    folder, _, planted, _, feedback = course
    assert feedback.returncode != 0
    assert f"Refusing linked_after_grading's {ASSIGNMENT}: {planted} is a symbolic link" in feedback.stderr
    assert not (folder / "feedback" / "linked_after_grading").exists()


def test_nothing_a_link_points_to_is_copied(course):
    """autograded/ and feedback/ hold only what nbgrader made of the honest notebooks: no copy of a link's target."""
    folder = course[0]
    made = sorted(str(p.relative_to(folder)) for kind in ("autograded", "feedback") for p in (folder / kind).rglob("*")
                  if p.is_file() and not p.is_symlink())
    assert made == [f"autograded/honest/{ASSIGNMENT}/{NOTEBOOK}",
                    f"autograded/linked_after_grading/{ASSIGNMENT}/{NOTEBOOK}",
                    f"feedback/honest/{ASSIGNMENT}/{ASSIGNMENT}.html"]
