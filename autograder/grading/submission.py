"""One submission graded: its notebook read safely, `nbgrader autograde` and `generate_feedback` run on it
in a scratch course folder of its own, under a time and memory limit, and its scores read back.

The batch (autograder/grading/batch.py) and the Dask workers (autograder/grading/cluster.py) both grade
through `grade_one`; each nbgrader command runs in a fresh child of the warm server
(autograder/grading/warm.py).
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from flashcourse import DEVICE_ENV

from autograder.grading import warm
from autograder.jail import sandbox as jail
from autograder.jail.sandbox import ANOMALIES_ENV

STUDENT_TIMEOUT_S = 30 * 60     # a whole notebook; one cell is limited by nbgrader_config's JailedExecute.timeout
MEMORY_LIMIT_BYTES = 16 << 30   # address space of the grading processes (torch reserves some up front)
MAX_NOTEBOOK_BYTES = 64 << 20   # a submitted notebook larger than this is not graded
# Where the device is left to grading (--device auto), a GPU grades only these, whose graded code is Triton
# kernels. The PyTorch assignments' small tests run faster on a CPU than as thousands of tiny launches from
# a dozen kernels sharing one GPU, each paying for a CUDA context of its own.
COMPILED_ASSIGNMENTS = ("04_triton_flash", "05_fast_kernel", "06_backward")


@dataclass(frozen=True)
class Score:
    student: str
    assignment: str
    question: str     # the grade cell's id, e.g. test_tile_update or q1_unnormalized
    kind: str         # "auto" for tested code, "manual" for answers graded by hand
    points: float
    max_points: float


@dataclass
class Outcome:
    student: str
    assignment: str
    scores: list[Score] = field(default_factory=list)
    problem: str = ""  # why the notebook could not be graded; empty when it was
    anomalies: list[str] = field(default_factory=list)  # what else went wrong while it was graded


def nbgrader_args(*args: str, db: Path, folders: dict[str, Path]) -> list[str]:
    return [*args, f"--CourseDirectory.db_url=sqlite:///{db}", "--log-level=WARN",
            *(f"--CourseDirectory.{k}_directory={v}" for k, v in folders.items())]


def nbgrader_cmd(*args: str, db: Path, folders: dict[str, Path]) -> list[str]:
    return [sys.executable, "-m", "nbgrader", *nbgrader_args(*args, db=db, folders=folders)]


def run_nbgrader(args: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run `nbgrader ARGS` from the course root under the memory limit, in a fresh child of this process's
    warm server (autograder/grading/warm.py); its exit status (None past the timeout, when it is killed) and output.
    A command that grades on a GPU has no address-space limit: CUDA reserves far more than it ever uses (the
    jail lifts its kernels' limit for the same reason)."""
    code = warm.server().run(args, str(log), timeout, env, memory=0 if on_gpu(env) else MEMORY_LIMIT_BYTES)
    text = log.read_text(errors="replace") if log.exists() else ""
    if code == warm.LOST:
        text += "\nRuntimeError: the grading server stopped while this command ran"
    return code, text


def read_scores(db: Path, student: str) -> list[Score]:
    """Every grade of `student` in a gradebook."""
    from nbgrader.api import Gradebook

    scores = []
    with Gradebook(f"sqlite:///{db}") as gb:
        for assignment in gb.assignments:
            for submission in gb.assignment_submissions(assignment.name):
                if submission.student.id != student:
                    continue
                for notebook in submission.notebooks:
                    for grade in notebook.grades:
                        kind = "auto" if grade.cell.cell_type == "code" else "manual"
                        scores.append(Score(submission.student.id, assignment.name, grade.name, kind,
                                            float(grade.score), float(grade.max_score)))
    return sorted(scores, key=lambda s: (s.student, s.assignment, s.question))


def questions(db: Path) -> list[tuple[str, str, float]]:
    """(question, kind, max points) of every grade cell registered in a template gradebook."""
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{db}") as gb:
        return [(cell.name, "auto" if cell.cell_type == "code" else "manual", float(cell.max_score))
                for assignment in gb.assignments for notebook in assignment.notebooks
                for cell in notebook.grade_cells]


def zeros(student: str, assignment: str, questions: list[tuple[str, str, float]], problem: str,
          anomalies: list[str] | None = None) -> Outcome:
    """No grade could be computed: zero on every question of the assignment, with the reason."""
    scores = [Score(student, assignment, q, kind, 0.0, most) for q, kind, most in questions]
    return Outcome(student, assignment, scores, problem, anomalies or [])


def read_submission(notebook: Path) -> bytes:
    """The submitted notebook's bytes: a regular file opened without following a link, size capped."""
    fd = os.open(notebook, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{notebook.name} is not a regular file")
        if info.st_size > MAX_NOTEBOOK_BYTES:
            raise ValueError(f"{notebook.name} is {info.st_size >> 20} MiB, over the {MAX_NOTEBOOK_BYTES >> 20} MiB limit")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(MAX_NOTEBOOK_BYTES + 1)
    finally:
        os.close(fd)


def unreadable(notebook: Path, error: OSError | ValueError) -> str:
    """Why read_submission refused a notebook, as the summary says it."""
    reason = "it is a symbolic link" if isinstance(error, OSError) and notebook.is_symlink() else str(error)
    return f"the notebook was not graded: {reason}"


# What nbgrader's log says, and what it means for the student. A kernel that dies, hangs or runs out
# of memory no longer fails nbgrader: execute.py replaces it and names it among the anomalies.
KNOWN_FAILURES = [
    ("NotJSONError", "the file is not a readable notebook (empty, truncated or not JSON)"),
]


def explain_failure(log: str) -> str:
    """One plain sentence for an nbgrader failure, from its log."""
    for marker, words in KNOWN_FAILURES:
        if marker in log:
            return words
    lines = [line.strip() for line in log.splitlines() if "Error" in line]
    return (lines or ["nbgrader failed without a message"])[-1][:300]


def on_gpu(env: dict[str, str] | None) -> bool:
    """Whether a command run with `env` (device_for's) grades on a GPU; gpus() heeds this process's own --device."""
    return (env or {}).get(DEVICE_ENV) != "cpu" and bool(jail.gpus())


def device_for(assignment: str) -> dict[str, str]:
    """The environment that picks where an assignment's notebooks are graded: what --device said, if anything,
    and otherwise the CPU for every assignment but those with Triton kernels (flashcourse.runtime decides for them)."""
    if os.environ.get(DEVICE_ENV, "auto") == "auto" and assignment not in COMPILED_ASSIGNMENTS:
        return {DEVICE_ENV: "cpu"}
    return {}


def grade_one(student: str, assignment: str, notebook: Path, template: Path, out: Path,
              questions: list[tuple[str, str, float]], cell_timeout: int | None = None,
              trusted: bool = False) -> Outcome:
    """Autograde one student's notebook in a scratch course folder and copy the results to `out`."""
    try:
        submitted = read_submission(notebook)
    except (OSError, ValueError) as error:
        return zeros(student, assignment, questions, unreadable(notebook, error))
    with tempfile.TemporaryDirectory(prefix="flashcourse-grade-") as tmp:
        scratch = Path(tmp)
        folders = {"submitted": scratch / "submitted", "autograded": scratch / "autograded",
                   "feedback": scratch / "feedback"}
        target = folders["submitted"] / student / assignment
        target.mkdir(parents=True)
        (target / f"{assignment}.ipynb").write_bytes(submitted)
        db = scratch / "gradebook.db"
        shutil.copy(template, db)
        anomalies_file = scratch / "anomalies.txt"
        options = [f"--JailedExecute.timeout={cell_timeout}"] if cell_timeout else []
        if trusted:
            options.append("--JailedExecute.trusted=True")
        env = {ANOMALIES_ENV: str(anomalies_file), **device_for(assignment)}
        code, log = run_nbgrader(nbgrader_args("autograde", assignment, "--student", student, "--force", *options,
                                               db=db, folders=folders), scratch / "autograde.log", STUDENT_TIMEOUT_S, env)
        anomalies = anomalies_file.read_text().splitlines() if anomalies_file.exists() else []
        if code is None:
            return zeros(student, assignment, questions, f"grading stopped after {STUDENT_TIMEOUT_S} s", anomalies)
        scores = read_scores(db, student)
        if code or not scores:
            return zeros(student, assignment, questions, f"the notebook could not be graded: {explain_failure(log)}",
                         anomalies)
        code, log = run_nbgrader(nbgrader_args("generate_feedback", assignment, "--student", student, "--force",
                                               db=db, folders=folders), scratch / "feedback.log", STUDENT_TIMEOUT_S, env)
        if code:
            anomalies.append(f"feedback could not be generated: {explain_failure(log)}")
        for kind in ("autograded", "feedback"):
            source = folders[kind] / student / assignment
            if source.exists():
                shutil.copytree(source, out / kind / student / assignment, symlinks=True, dirs_exist_ok=True)
        return Outcome(student, assignment, scores, anomalies=anomalies)


def register(assignment: str, templates: Path) -> Path:
    """A gradebook holding the assignment's grade cells, copied for each student."""
    db = templates / f"{assignment}.db"
    folders = {"release": templates / "release"}
    code, log = run_nbgrader(nbgrader_args("generate_assignment", assignment, "--force", db=db, folders=folders),
                             templates / f"{assignment}.log", 600)
    if code:
        raise RuntimeError(f"nbgrader generate_assignment {assignment} failed:\n{log}")
    return db
