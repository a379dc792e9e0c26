"""Grade a folder of submissions with nbgrader, every student apart and several at once.

    python -m autograder grade SUBMISSIONS [--out DIR] [--jobs N]

SUBMISSIONS is laid out as nbgrader's submitted/<student>/<assignment>/<assignment>.ipynb. Each
assignment is registered once from source/ in a template gradebook. Each (student, assignment) is
then graded on its own: the one notebook is read (a regular file, never through a link, size
capped) into a scratch course folder with a copy of the template gradebook, `nbgrader autograde`
and `nbgrader generate_feedback` run there under a time and memory limit, and the results are
copied out. Each nbgrader command runs in a fresh child forked from a warm server that has already
imported nbgrader, torch and the hidden checks (autograder/grading/warm.py), so a batch pays that start-up
once. The learner's code runs only in the jail (autograder/jail/sandbox.py), which sees none of these folders.
A student whose grading fails in any way gets zero for what was not graded and a line in the
summary; the others are unaffected, and the batch always ends with grades.csv and the summary.

Without a working jail, grading refuses to start unless `trusted=True` (--trusted): the notebooks
are then run without one, which is only for notebooks you trust, such as the course's samples.

DIR receives grades.csv (one row per student, assignment and question), feedback/<student>/
<assignment>/, autograded/<student>/<assignment>/ and summary.txt (what went wrong, in words).
"""

from __future__ import annotations

import csv
import os
import shutil
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from flashcourse import DEVICE_ENV

from autograder.building.build import assignments as known_assignments
from autograder.building.build import graded_assignments
from autograder.grading.submission import Outcome, grade_one, questions, register, zeros
from autograder.jail import cgroups, sandbox as jail

# The order notebooks are handed out in: the longest first, so that the short ones fill the end of the batch
# instead of one long notebook running alone after all the rest (longest-processing-time order). From the
# mean seconds per notebook of a class of 50 (benchmarks/results/2026-11-30-grading-class-of-50.md), the same
# order on the 2-core CPU machine and on the H200: 06 13 / 118, 05 10 / 34, 04 9 / 25, 03 5.6 / 6.6,
# 07 5.4 / 4.3, 02 1.8 / 2.9, 01 1.8 / 1.4. An assignment not named here goes last. Every graded assignment is
# named; 08, which has no graded cells, is never handed out (find_jobs reports a submission of it as not graded).
LONGEST_FIRST = ("06_backward", "05_fast_kernel", "04_triton_flash", "03_online_attention", "07_ring_attention",
                 "09_packed_paged", "02_single_query", "01_online_softmax")


def find_jobs(submissions: Path) -> tuple[list[tuple[str, str, Path]], list[Outcome]]:
    """(student, assignment, notebook) for every submission, longest to grade first, and outcomes for the
    ungradable ones."""
    jobs, known, graded = [], set(known_assignments()), set(graded_assignments())
    unreadable: list[Outcome] = []
    for folder in sorted(p for p in submissions.glob("*/*") if p.is_dir()):
        student, assignment = folder.parent.name, folder.name
        if assignment not in known:
            unreadable.append(Outcome(student, assignment, problem=f"{assignment} is not an assignment of this course"))
            continue
        if assignment not in graded:
            unreadable.append(Outcome(student, assignment, problem=f"{assignment} is not graded: it has no graded cells "
                                                                   "(a notebook to read and run)"))
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


# What the memory points do not see when notebooks run on a GPU (README, "What 03's memory point proves").
ON_A_GPU = ("graded on a GPU (--device cuda): 03's and 06's memory points measure and watch the call's process on "
            "the CPU only, so memory held on the GPU and time in CUDA's fused attention are seen by neither probe; "
            "grade on a CPU (the default) for those points to prove what they say")


def grade(submissions: Path, out: Path, jobs: int = 2, progress: bool = True,
          cell_timeout: int | None = None, trusted: bool = False, scheduler: str | None = None) -> list[Outcome]:
    """Grade every student of every assignment under `submissions`; write grades, feedback and summary to `out`.

    Notebooks are graded by `jobs` threads here, or on a Dask cluster when `scheduler` is given: the
    address of its scheduler, or "local" for a cluster of `jobs` processes on this machine (see
    autograder/grading/cluster.py). Raises jail.NoJail before grading anything when no jail can be built on
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
    assignments = sorted({a for _, a, _ in todo} | {o.assignment for o in outcomes if o.assignment in graded_assignments()})
    templates = {a: register(a, out / "templates") for a in assignments}
    asked = {a: questions(templates[a]) for a in assignments}  # read once, before any student runs
    outcomes = [zeros(o.student, o.assignment, asked[o.assignment], o.problem) if o.assignment in asked else o
                for o in outcomes]
    if scheduler:
        from autograder.grading.cluster import grade_on_cluster

        graded = grade_on_cluster(scheduler, todo, templates, asked, out, jobs, cell_timeout, trusted)
    else:
        graded = ((outcome, no_jail, None) for outcome in _grade_here(todo, templates, asked, out, jobs, cell_timeout, trusted))
    unjailed, alone = set(), set()
    with tqdm(total=len(todo), desc="grading", unit="notebook", disable=not progress, file=sys.stdout) as bar:
        for outcome, why, why_alone in graded:
            outcomes.append(outcome)
            unjailed |= {why} - {None}
            alone |= {why_alone} - {None}
            bar.set_postfix_str(f"{outcome.student}/{outcome.assignment}")
            bar.update()
    outcomes.sort(key=lambda o: (o.assignment, o.student))
    write_csv(outcomes, out / "grades.csv")
    notes = sorted(({apart} | alone) - {None})
    if os.environ.get(DEVICE_ENV) == "cuda":
        notes.append(ON_A_GPU)
    (out / "summary.txt").write_text(summary(outcomes, "; ".join(sorted(unjailed)) or None, notes))
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


def summary(outcomes: list[Outcome], no_jail: str | None = None, notes: list[str] = ()) -> str:
    """What went wrong, one line per student, notebook and anomaly, in plain words; `notes` are the grader's own
    (why notebooks were graded one at a time, what a GPU grader does not watch)."""
    lines = [f"- {o.student}, {o.assignment}: {what}" for o in outcomes for what in [o.problem, *o.anomalies] if what]
    normal = sum(not o.problem and not o.anomalies for o in outcomes)
    head = f"{normal} of {len(outcomes)} notebooks graded normally."
    if no_jail:
        head += ("\nWarning: these notebooks were run WITHOUT a jail, as trusted notebooks (--trusted): " + no_jail)
    head += "".join(f"\nNote: {note}." for note in notes)
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
