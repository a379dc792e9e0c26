"""Plain `nbgrader autograde` and `nbgrader generate_feedback` refuse symbolic links, as `make grade` does.

nbgrader reads a submitted notebook through a link and copies every file beside it with shutil.copy,
which follows links: a notebook that is a link to source/ would score full marks, and a link beside it
would copy the master notebook or the hidden checks into the student's autograded/ and feedback/.
nbgrader_config.py installs this guard on nbgrader's Autograde and GenerateFeedback converters: before
either copies or runs anything of a student, it looks for links in the folder it reads (submitted/ or
autograded/), and one found makes nbgrader skip that student with an error naming each link; the other
students are graded as usual and the command exits non-zero.
"""

import functools
import os
from pathlib import Path

from nbgrader.converters import Autograde, GenerateFeedback, NbGraderException


def links_under(folder: Path) -> list[Path]:
    """`folder` if it is a symbolic link, or else every symbolic link below it, found without following any."""
    if folder.is_symlink():
        return [folder]
    found = []
    for parent, folders, files in os.walk(folder):  # os.walk lists a link to a folder and does not enter it
        found += [Path(parent, name) for name in sorted(folders + files) if Path(parent, name).is_symlink()]
    return found


def refuse_links(converter, assignment_id: str, student_id: str) -> None:
    """Raise NbGraderException, after logging each link, if the student's folder the converter reads holds one."""
    submission = Path(converter._format_source(assignment_id, student_id))
    student_folder = submission.parent
    links = [student_folder] if student_folder.is_symlink() else links_under(submission)
    for link in links:
        converter.log.error("Refusing %s's %s: %s is a symbolic link", student_id, assignment_id, link)
    if links:
        raise NbGraderException(f"{student_id}'s {assignment_id} holds symbolic links; nothing of it was read")


def guarded(init_assignment):
    """A converter's init_assignment, which copies the student's files, that first refuses links."""
    @functools.wraps(init_assignment)
    def init_assignment_without_links(self, assignment_id: str, student_id: str) -> None:
        refuse_links(self, assignment_id, student_id)
        init_assignment(self, assignment_id, student_id)

    init_assignment_without_links.refuses_links = True
    return init_assignment_without_links


def install() -> None:
    """Guard nbgrader's converters in this process; loading the configuration again guards them once."""
    for converter in (Autograde, GenerateFeedback):
        if not getattr(converter.init_assignment, "refuses_links", False):
            converter.init_assignment = guarded(converter.init_assignment)
