"""Grade a folder of submissions with nbgrader, every student apart and several at once.

    python -m autograder grade SUBMISSIONS [--out DIR] [--jobs N]

SUBMISSIONS is laid out as nbgrader's submitted/<student>/<assignment>/<assignment>.ipynb. Each
assignment is registered once from source/ in a template gradebook. Each (student, assignment) is
then graded on its own: the one notebook is copied into a scratch course folder with a copy of the
template gradebook, `nbgrader autograde` and `nbgrader generate_feedback` run there under a time
and memory limit, and the results are copied out. A student whose grading crashes or hangs gets
zero for what was not graded and a line in the summary; the others are unaffected.

DIR receives grades.csv (one row per student, assignment and question), feedback/<student>/
<assignment>/, autograded/<student>/<assignment>/ and summary.txt (what went wrong, in words).
"""

from __future__ import annotations

import csv
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from . import ROOT
from .build import assignments as known_assignments, nbgrader_environment

STUDENT_TIMEOUT_S = 30 * 60     # a whole notebook; one cell is limited by nbgrader_config's Execute.timeout
MEMORY_LIMIT_BYTES = 16 << 30   # address space of the grading processes (torch reserves some up front)


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
    problem: str = ""  # empty when the notebook was graded normally


def nbgrader_cmd(*args: str, db: Path, folders: dict[str, Path]) -> list[str]:
    return [sys.executable, "-m", "nbgrader", *args, f"--CourseDirectory.db_url=sqlite:///{db}",
            "--log-level=WARN", *(f"--CourseDirectory.{k}_directory={v}" for k, v in folders.items())]


SANDBOX_KERNEL = "flashcourse-sandbox"


def sandbox_kernel(scratch: Path, hidden: list[Path]) -> dict[str, str] | None:
    """A kernelspec that runs the learner's kernel under bubblewrap, or None where bwrap is missing.

    The kernel sees the machine read-only, a private /tmp holding only this student's scratch folder
    (writable), and empty folders in place of `hidden` (source/, the submissions, the grader's output)
    and of the scratch gradebook. Returns the environment that makes nbgrader find the kernelspec.
    """
    bwrap = shutil.which("bwrap")
    if not bwrap:
        return None
    home = scratch / "home"
    home.mkdir()
    argv = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    # The course and its environment stay visible even when they live under /tmp (a CI clone).
    for keep in sorted({ROOT, Path(sys.prefix).resolve()}):
        argv += ["--ro-bind", str(keep), str(keep)]
    argv += ["--bind", str(scratch), str(scratch), "--die-with-parent"]
    for path in hidden:
        if path.is_dir():
            argv += ["--tmpfs", str(path)]
        elif path.exists():
            argv += ["--ro-bind", "/dev/null", str(path)]
    argv += [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    spec = scratch / "jupyter" / "kernels" / SANDBOX_KERNEL
    spec.mkdir(parents=True)
    caches = {"HOME": home, "IPYTHONDIR": home / ".ipython", "MPLCONFIGDIR": home / ".matplotlib",
              "TRITON_CACHE_DIR": home / ".triton", "TMPDIR": scratch / "tmp"}
    # Interrupts go as messages: a signal would reach bwrap, not the kernel inside it.
    (spec / "kernel.json").write_text(json.dumps({
        "argv": argv, "display_name": "Python 3 (grading sandbox)", "language": "python", "interrupt_mode": "message",
        "env": {k: str(v) for k, v in caches.items()}}))
    (scratch / "tmp").mkdir()
    return {"JUPYTER_PATH": str(scratch / "jupyter"), "TMPDIR": str(scratch / "tmp")}


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))


def run_limited(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run cmd in its own process group under the memory limit; kill the whole group at the timeout."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=nbgrader_environment(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True, preexec_fn=_limit_memory)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out


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


def zeros(student: str, assignment: str, template: Path, problem: str) -> Outcome:
    """No grade could be computed: zero on every question, with the reason."""
    scores = [Score(student, assignment, q, kind, 0.0, most) for q, kind, most in questions(template)]
    return Outcome(student, assignment, scores, problem)


# What nbgrader's log says, and what it means for the student.
KNOWN_FAILURES = [
    ("NotJSONError", "the file is not a readable notebook (empty, truncated or not JSON)"),
    ("DeadKernelError", "the notebook's kernel died (the notebook exited, or ran out of memory)"),
    ("CellTimeoutError", "a cell ran past its time limit"),
    ("MemoryError", "the notebook ran out of memory"),
]


def explain_failure(log: str) -> str:
    """One plain sentence for an nbgrader failure, from its log."""
    for marker, words in KNOWN_FAILURES:
        if marker in log:
            return words
    lines = [line.strip() for line in log.splitlines() if "Error" in line]
    return (lines or ["nbgrader failed without a message"])[-1][:300]


def grade_one(student: str, assignment: str, notebook: Path, template: Path, out: Path,
              cell_timeout: int | None = None, hidden: tuple[Path, ...] = ()) -> Outcome:
    """Autograde one student's notebook in a scratch course folder and copy the results to `out`."""
    with tempfile.TemporaryDirectory(prefix="flashcourse-grade-") as tmp:
        scratch = Path(tmp)
        folders = {"submitted": scratch / "submitted", "autograded": scratch / "autograded",
                   "feedback": scratch / "feedback"}
        target = folders["submitted"] / student / assignment
        target.mkdir(parents=True)
        shutil.copy(notebook, target / f"{assignment}.ipynb")
        db = scratch / "gradebook.db"
        shutil.copy(template, db)
        options = [f"--Execute.timeout={cell_timeout}"] if cell_timeout else []
        sandbox = sandbox_kernel(scratch, [*hidden, db])
        if sandbox:
            options.append(f"--Execute.kernel_name={SANDBOX_KERNEL}")
        code, log = run_limited(nbgrader_cmd("autograde", assignment, "--student", student, "--force", *options,
                                             db=db, folders=folders), STUDENT_TIMEOUT_S, sandbox)
        if code is None:
            return zeros(student, assignment, template, f"grading stopped after {STUDENT_TIMEOUT_S} s")
        scores = read_scores(db, student)
        if code or not scores:
            return zeros(student, assignment, template, f"the notebook could not be graded: {explain_failure(log)}")
        run_limited(nbgrader_cmd("generate_feedback", assignment, "--student", student, "--force",
                                 db=db, folders=folders), STUDENT_TIMEOUT_S)
        for kind in ("autograded", "feedback"):
            source = folders[kind] / student / assignment
            if source.exists():
                shutil.copytree(source, out / kind / student / assignment, dirs_exist_ok=True)
        return Outcome(student, assignment, scores)


def find_jobs(submissions: Path) -> tuple[list[tuple[str, str, Path]], list[Outcome]]:
    """(student, assignment, notebook) for every submission, and outcomes for the ungradable ones."""
    jobs, known = [], set(known_assignments())
    unreadable: list[Outcome] = []
    for folder in sorted(p for p in submissions.glob("*/*") if p.is_dir()):
        student, assignment = folder.parent.name, folder.name
        if assignment not in known:
            unreadable.append(Outcome(student, assignment, problem=f"{assignment} is not an assignment of this course"))
            continue
        notebook = folder / f"{assignment}.ipynb"
        if not notebook.exists():
            others = sorted(p.name for p in folder.glob("*.ipynb"))
            why = (f"no {notebook.name}; found {', '.join(others)} instead (notebooks must keep their name)"
                   if others else f"no {notebook.name} was submitted")
            unreadable.append(Outcome(student, assignment, problem=why))
            continue
        jobs.append((student, assignment, notebook))
    return jobs, unreadable


def register(assignment: str, templates: Path) -> Path:
    """A gradebook holding the assignment's grade cells, copied for each student."""
    db = templates / f"{assignment}.db"
    folders = {"release": templates / "release"}
    code, log = run_limited(nbgrader_cmd("generate_assignment", assignment, "--force", db=db, folders=folders), 600)
    if code:
        raise RuntimeError(f"nbgrader generate_assignment {assignment} failed:\n{log}")
    return db


def grade(submissions: Path, out: Path, jobs: int = 2, progress: bool = True,
          cell_timeout: int | None = None) -> list[Outcome]:
    """Grade every student of every assignment under `submissions`; write grades, feedback and summary to `out`."""
    from tqdm import tqdm

    submissions, out = submissions.resolve(), out.resolve()
    for kind in ("autograded", "feedback"):
        shutil.rmtree(out / kind, ignore_errors=True)
    (out / "templates").mkdir(parents=True, exist_ok=True)
    todo, outcomes = find_jobs(submissions)
    templates = {a: register(a, out / "templates") for a in sorted({a for _, a, _ in todo} |
                                                                      {o.assignment for o in outcomes
                                                                       if o.assignment in known_assignments()})}
    outcomes = [zeros(o.student, o.assignment, templates[o.assignment], o.problem) if o.assignment in templates else o
                for o in outcomes]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool, \
            tqdm(total=len(todo), desc="grading", unit="notebook", disable=not progress, file=sys.stdout) as bar:
        # What a learner's kernel must not read: the instructor's notebooks, everyone's submissions
        # (the samples too), grades and feedback. The grader's code stays readable: the kernel runs
        # the test cells with it, and it is public anyway.
        hidden = (ROOT / "source", ROOT / "autograder" / "samples", ROOT / "gradebook.db", ROOT / "submitted",
                  ROOT / "autograded", ROOT / "feedback", submissions, out)
        futures = {pool.submit(grade_one, s, a, nb, templates[a], out, cell_timeout, hidden): (s, a)
                   for s, a, nb in todo}
        for future in as_completed(futures):
            student, assignment = futures[future]
            try:
                outcomes.append(future.result())
            except Exception as error:  # a grader fault must not lose the other students' grades
                outcomes.append(zeros(student, assignment, templates[assignment], f"grader error: {error}"))
            bar.set_postfix_str(f"{student}/{assignment}")
            bar.update()
    outcomes.sort(key=lambda o: (o.assignment, o.student))
    write_csv(outcomes, out / "grades.csv")
    (out / "summary.txt").write_text(summary(outcomes))
    return outcomes


NO_SANDBOX = ("bubblewrap (bwrap) is not installed, so learners' kernels ran without a sandbox and could read "
              "source/ and other submissions: install it (Debian/Ubuntu: apt-get install bubblewrap).")


def write_csv(outcomes: list[Outcome], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "assignment", "question", "kind", "points", "max_points"])
        for s in (s for o in outcomes for s in o.scores):
            writer.writerow([s.student, s.assignment, s.question, s.kind, f"{s.points:g}", f"{s.max_points:g}"])


def summary(outcomes: list[Outcome]) -> str:
    """What went wrong, one line per student and notebook, in plain words."""
    problems = [f"- {o.student}, {o.assignment}: {o.problem}" for o in outcomes if o.problem]
    graded = sum(not o.problem for o in outcomes)
    head = f"{graded} of {len(outcomes)} notebooks graded normally."
    if not shutil.which("bwrap"):
        head += "\nWarning: " + NO_SANDBOX
    return head + ("\nProblems:\n" + "\n".join(problems) if problems else " No problems.") + "\n"


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
            lines.append(f"{o.student:<{width}}  {cells}  {total}" + ("  (see summary)" if o.problem else ""))
    return "\n".join(lines)
