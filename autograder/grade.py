"""Grade a folder of submissions with nbgrader and report every student's score.

    python -m autograder grade SUBMISSIONS [--out DIR]

SUBMISSIONS is laid out as nbgrader's submitted/<student>/<assignment>/<assignment>.ipynb. For each
assignment found, the grader registers it from source/ in a gradebook under DIR, runs
`nbgrader autograde` and `nbgrader generate_feedback` against SUBMISSIONS, then writes
DIR/grades.csv (one row per student, assignment and question) and prints a table.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from .build import nbgrader


@dataclass(frozen=True)
class Score:
    student: str
    assignment: str
    question: str     # the grade cell's id, e.g. test_tile_update or q1_unnormalized
    kind: str         # "auto" for hidden-tested code, "manual" for answers graded by hand
    points: float
    max_points: float


def found_assignments(submissions: Path) -> list[str]:
    return sorted({p.name for student in submissions.iterdir() if student.is_dir()
                   for p in student.iterdir() if p.is_dir()})


def read_scores(db: Path) -> list[Score]:
    from nbgrader.api import Gradebook

    scores = []
    with Gradebook(f"sqlite:///{db}") as gb:
        for assignment in gb.assignments:
            for submission in gb.assignment_submissions(assignment.name):
                for notebook in submission.notebooks:
                    for grade in notebook.grades:
                        kind = "auto" if grade.cell.cell_type == "code" else "manual"
                        scores.append(Score(submission.student.id, assignment.name, grade.name, kind,
                                            float(grade.score), float(grade.max_score)))
    return sorted(scores, key=lambda s: (s.student, s.assignment, s.question))


def write_csv(scores: list[Score], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "assignment", "question", "kind", "points", "max_points"])
        for s in scores:
            writer.writerow([s.student, s.assignment, s.question, s.kind, f"{s.points:g}", f"{s.max_points:g}"])


def table(scores: list[Score]) -> str:
    """Each student's autograded score per assignment, with the questions lost spelled out."""
    lines = []
    for assignment in sorted({s.assignment for s in scores}):
        rows = [s for s in scores if s.assignment == assignment and s.kind == "auto"]
        questions = sorted({s.question for s in rows})
        students = sorted({s.student for s in rows})
        width = max(len(x) for x in ["student", *students])
        header = f"{'student':<{width}}  " + "  ".join(questions) + "  total"
        lines += [f"\n{assignment} (autograded; answers to the questions are graded by hand)", header, "-" * len(header)]
        for student in students:
            mine = {s.question: s for s in rows if s.student == student}
            cells = "  ".join(f"{mine[q].points:g}/{mine[q].max_points:g}".center(len(q)) for q in questions)
            total = sum(s.points for s in mine.values())
            out_of = sum(s.max_points for s in mine.values())
            lines.append(f"{student:<{width}}  {cells}  {total:g}/{out_of:g}")
    return "\n".join(lines)


def grade(submissions: Path, out: Path) -> list[Score]:
    """Autograde every student of every assignment under `submissions`; write grades and feedback to `out`."""
    submissions, out = submissions.resolve(), out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    db = out / "gradebook.db"
    folders = [f"--CourseDirectory.submitted_directory={submissions}",
               f"--CourseDirectory.autograded_directory={out / 'autograded'}",
               f"--CourseDirectory.feedback_directory={out / 'feedback'}",
               f"--CourseDirectory.release_directory={out / 'release'}"]
    for assignment in found_assignments(submissions):
        print(f"grade: {assignment}", flush=True)
        nbgrader("generate_assignment", assignment, "--force", *folders, db=db)
        nbgrader("autograde", assignment, "--force", *folders, db=db)
        nbgrader("generate_feedback", assignment, "--force", *folders, db=db)
    scores = read_scores(db)
    write_csv(scores, out / "grades.csv")
    return scores
