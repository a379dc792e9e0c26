"""Grade a folder of submissions with nbgrader, every student apart and several at once.

    python -m autograder grade SUBMISSIONS [--out DIR] [--jobs N]

SUBMISSIONS is laid out as nbgrader's submitted/<student>/<assignment>/<assignment>.ipynb. Each
assignment is registered once from source/ in a template gradebook. Each (student, assignment) is
then graded on its own: the one notebook is read (a regular file, never through a link, size
capped) into a scratch course folder with a copy of the template gradebook, `nbgrader autograde`
and `nbgrader generate_feedback` run there under a time and memory limit, and the results are
copied out. Each nbgrader command runs in a fresh child forked from a warm server that has already
imported nbgrader, torch and the hidden checks (autograder/warm.py), so a batch pays that start-up
once. The learner's code runs only in the jail (autograder/jail.py), which sees none of these folders.
A student whose grading fails in any way gets zero for what was not graded and a line in the
summary; the others are unaffected, and the batch always ends with grades.csv and the summary.

Without a working jail, grading refuses to start unless `trusted=True` (--trusted): the notebooks
are then run without one, which is only for notebooks you trust, such as the course's samples.

DIR receives grades.csv (one row per student, assignment and question), feedback/<student>/
<assignment>/, autograded/<student>/<assignment>/ and summary.txt (what went wrong, in words).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from flashcourse import DEVICE_ENV

from . import ROOT, cgroups, jail, warm
from .build import assignments as known_assignments
from .execute import ANOMALIES_ENV

STUDENT_TIMEOUT_S = 30 * 60     # a whole notebook; one cell is limited by nbgrader_config's JailedExecute.timeout
MEMORY_LIMIT_BYTES = 16 << 30   # address space of the grading processes (torch reserves some up front)
MAX_NOTEBOOK_BYTES = 64 << 20   # a submitted notebook larger than this is not graded
# Where the device is left to grading (--device auto), a GPU grades only these, whose graded code is Triton
# kernels. The PyTorch assignments' small tests run faster on a CPU than as thousands of tiny launches from
# a dozen kernels sharing one GPU, each paying for a CUDA context of its own.
COMPILED_ASSIGNMENTS = ("04_triton_flash", "05_fast_kernel", "06_backward")
# The order notebooks are handed out in: the longest first, so that the short ones fill the end of the batch
# instead of one long notebook running alone after all the rest (longest-processing-time order). From the
# mean seconds per notebook of a class of 50 (benchmarks/results/2026-11-30-grading-class-of-50.md), the same
# order on the 2-core CPU machine and on the H200: 06 13 / 118, 05 10 / 34, 04 9 / 25, 03 5.6 / 6.6,
# 07 5.4 / 4.3, 02 1.8 / 2.9, 01 1.8 / 1.4. An assignment not named here goes last.
LONGEST_FIRST = ("06_backward", "05_fast_kernel", "04_triton_flash", "03_online_attention", "07_ring_attention",
                 "02_single_query", "01_online_softmax")


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
    warm server (autograder/warm.py); its exit status (None past the timeout, when it is killed) and output.
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


def find_jobs(submissions: Path) -> tuple[list[tuple[str, str, Path]], list[Outcome]]:
    """(student, assignment, notebook) for every submission, longest to grade first, and outcomes for the
    ungradable ones."""
    jobs, known = [], set(known_assignments())
    unreadable: list[Outcome] = []
    for folder in sorted(p for p in submissions.glob("*/*") if p.is_dir()):
        student, assignment = folder.parent.name, folder.name
        if assignment not in known:
            unreadable.append(Outcome(student, assignment, problem=f"{assignment} is not an assignment of this course"))
            continue
        if folder.is_symlink() or folder.parent.is_symlink():
            unreadable.append(Outcome(student, assignment, problem="the submission folder is a symbolic link"))
            continue
        notebook = folder / f"{assignment}.ipynb"
        if not notebook.exists() and not notebook.is_symlink():
            others = sorted(p.name for p in folder.glob("*.ipynb"))
            why = (f"no {notebook.name}; found {', '.join(others)} instead (notebooks must keep their name)"
                   if others else f"no {notebook.name} was submitted")
            unreadable.append(Outcome(student, assignment, problem=why))
            continue
        jobs.append((student, assignment, notebook))
    return sorted(jobs, key=longest_first), unreadable


def longest_first(job: tuple[str, str, Path]) -> tuple[int, str]:
    """The sort key that hands out the assignments that take longest to grade first, students in order within each."""
    student, assignment, _ = job
    rank = LONGEST_FIRST.index(assignment) if assignment in LONGEST_FIRST else len(LONGEST_FIRST)
    return rank, student


def register(assignment: str, templates: Path) -> Path:
    """A gradebook holding the assignment's grade cells, copied for each student."""
    db = templates / f"{assignment}.db"
    folders = {"release": templates / "release"}
    code, log = run_nbgrader(nbgrader_args("generate_assignment", assignment, "--force", db=db, folders=folders),
                             templates / f"{assignment}.log", 600)
    if code:
        raise RuntimeError(f"nbgrader generate_assignment {assignment} failed:\n{log}")
    return db


def grade(submissions: Path, out: Path, jobs: int = 2, progress: bool = True,
          cell_timeout: int | None = None, trusted: bool = False, scheduler: str | None = None) -> list[Outcome]:
    """Grade every student of every assignment under `submissions`; write grades, feedback and summary to `out`.

    Notebooks are graded by `jobs` threads here, or on a Dask cluster when `scheduler` is given: the
    address of its scheduler, or "local" for a cluster of `jobs` processes on this machine (see
    autograder/cluster.py). Raises jail.NoJail before grading anything when no jail can be built on
    the machine that would run the notebooks (this one, unless the scheduler is remote), unless
    `trusted`; remote workers refuse on their own.
    """
    from tqdm import tqdm

    remote = scheduler not in (None, "local")
    no_jail = None if remote else jail.why_no_jail()
    if no_jail and not trusted:
        raise jail.NoJail(f"learners' notebooks are only run in a jail, and none can be built here: {no_jail}")
    apart = None
    if not remote and not no_jail:
        cgroups.export()  # found once here, for the grading processes to come
        shared = jail.isolation()
        if shared:  # one notebook at a time: no jail can then crowd out another
            jobs, apart = 1, f"jails cannot be kept apart here ({shared}): notebooks were graded one at a time"
    submissions, out = submissions.resolve(), out.resolve()
    for kind in ("autograded", "feedback"):
        shutil.rmtree(out / kind, ignore_errors=True)
    (out / "templates").mkdir(parents=True, exist_ok=True)
    todo, outcomes = find_jobs(submissions)
    assignments = sorted({a for _, a, _ in todo} | {o.assignment for o in outcomes if o.assignment in known_assignments()})
    templates = {a: register(a, out / "templates") for a in assignments}
    asked = {a: questions(templates[a]) for a in assignments}  # read once, before any student runs
    outcomes = [zeros(o.student, o.assignment, asked[o.assignment], o.problem) if o.assignment in asked else o
                for o in outcomes]
    if scheduler:
        from .cluster import grade_on_cluster

        graded = grade_on_cluster(scheduler, todo, templates, asked, out, jobs, cell_timeout, trusted)
    else:
        graded = ((outcome, no_jail) for outcome in _grade_here(todo, templates, asked, out, jobs, cell_timeout, trusted))
    unjailed = set()
    with tqdm(total=len(todo), desc="grading", unit="notebook", disable=not progress, file=sys.stdout) as bar:
        for outcome, why in graded:
            outcomes.append(outcome)
            unjailed |= {why} - {None}
            bar.set_postfix_str(f"{outcome.student}/{outcome.assignment}")
            bar.update()
    outcomes.sort(key=lambda o: (o.assignment, o.student))
    write_csv(outcomes, out / "grades.csv")
    (out / "summary.txt").write_text(summary(outcomes, "; ".join(sorted(unjailed)) or None, apart))
    return outcomes


def _grade_here(todo: list[tuple[str, str, Path]], templates: dict[str, Path],
                asked: dict[str, list[tuple[str, str, float]]], out: Path, jobs: int,
                cell_timeout: int | None, trusted: bool) -> Iterator[Outcome]:
    """Grade each (student, assignment, notebook) of `todo` with `jobs` threads on this machine, as each ends."""
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(grade_one, s, a, nb, templates[a], out, asked[a], cell_timeout, trusted): (s, a)
                   for s, a, nb in todo}
        for future in as_completed(futures):
            student, assignment = futures[future]
            try:
                yield future.result()
            except Exception as error:  # a grader fault must not lose the other students' grades
                yield zeros(student, assignment, asked[assignment], f"grader error: {error}")


def write_csv(outcomes: list[Outcome], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "assignment", "question", "kind", "points", "max_points"])
        for s in (s for o in outcomes for s in o.scores):
            writer.writerow([s.student, s.assignment, s.question, s.kind, f"{s.points:g}", f"{s.max_points:g}"])


def summary(outcomes: list[Outcome], no_jail: str | None = None, apart: str | None = None) -> str:
    """What went wrong, one line per student, notebook and anomaly, in plain words; `apart` says why notebooks
    were graded one at a time, if they were."""
    lines = [f"- {o.student}, {o.assignment}: {what}" for o in outcomes for what in [o.problem, *o.anomalies] if what]
    normal = sum(not o.problem and not o.anomalies for o in outcomes)
    head = f"{normal} of {len(outcomes)} notebooks graded normally."
    if no_jail:
        head += ("\nWarning: these notebooks were run WITHOUT a jail, as trusted notebooks (--trusted): " + no_jail)
    if apart:
        head += f"\nNote: {apart}."
    return head + ("\nProblems:\n" + "\n".join(lines) if lines else " No problems.") + "\n"


def table(outcomes: list[Outcome]) -> str:
    """Each student's autograded score per assignment, question by question."""
    lines = []
    for assignment in sorted({o.assignment for o in outcomes}):
        mine = [o for o in outcomes if o.assignment == assignment]
        names = sorted({s.question for o in mine for s in o.scores if s.kind == "auto"})
        width = max(len(x) for x in ["student", *(o.student for o in mine)])
        header = f"{'student':<{width}}  " + "  ".join(names) + "  total"
        lines += [f"\n{assignment} (autograded; answers to the questions are graded by hand)", header,
                  "-" * len(header)]
        for o in mine:
            auto = {s.question: s for s in o.scores if s.kind == "auto"}
            cells = "  ".join((f"{auto[q].points:g}/{auto[q].max_points:g}" if q in auto else "-").center(len(q))
                              for q in names)
            total = f"{sum(s.points for s in auto.values()):g}/{sum(s.max_points for s in auto.values()):g}"
            lines.append(f"{o.student:<{width}}  {cells}  {total}" + ("  (see summary)" if o.problem or o.anomalies else ""))
    return "\n".join(lines)
