"""Time the batch grader: every notebook's wall time, the total, and the machine's load meanwhile.

    python benchmarks/grading.py SUBMISSIONS [--out DIR] [--jobs N] [--json FILE] [--class-of N]

SUBMISSIONS is laid out as for `python -m autograder grade` (a class from `python -m autograder.building.classroom`,
or autograder/samples/submitted). The notebooks are graded by grade.grade, jail on, exactly as the
command line grades them; each call of grade.grade_one is timed from outside and printed as it ends. The load averages
(/proc/loadavg) are read before and after: on a shared machine they say how much of the wall time
was someone else's. With --class-of N, SUBMISSIONS is taken to be `python -m autograder.building.classroom N`'s
class, and every learner's points are compared with the sample they handed in (a cheat's with the
buggy sample it started from, which it must not beat).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autograder.building import classroom  # noqa: E402
from autograder.grading import batch as grade, submission


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("submissions", type=Path)
    parser.add_argument("--out", type=Path, default=Path("build/bench-grades"))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path, help="also write the timings here")
    parser.add_argument("--class-of", type=int, metavar="N", help="check the grades of a synthetic class of N learners")
    args = parser.parse_args()

    seconds: dict[tuple[str, str], float] = {}
    grade_one = grade.grade_one

    def timed(student, assignment, *rest):
        start = time.monotonic()
        try:
            return grade_one(student, assignment, *rest)
        finally:
            seconds[student, assignment] = time.monotonic() - start
            print(f"{assignment:<22} {student:<28} {seconds[student, assignment]:7.2f} s", flush=True)

    grade.grade_one = timed
    before, start = load(), time.monotonic()
    outcomes = grade.grade(args.submissions, args.out, jobs=args.jobs, progress=False)
    total, after = time.monotonic() - start, load()

    by_assignment: dict[str, list[float]] = defaultdict(list)
    for (_, assignment), spent in seconds.items():
        by_assignment[assignment].append(spent)
    print(f"\n{'assignment':<22} {'notebooks':>9} {'mean s':>8} {'max s':>8}")
    for assignment, spent in sorted(by_assignment.items()):
        print(f"{assignment:<22} {len(spent):>9} {sum(spent) / len(spent):8.2f} {max(spent):8.2f}")
    graded = len(seconds)
    print(f"\n{graded} notebooks ({len(outcomes)} outcomes) with --jobs {args.jobs}: {total:.1f} s wall in all, "
          f"{total / max(graded, 1):.2f} s per notebook; load average before {before}, after {after}")
    print(grade.summary(outcomes).splitlines()[0])
    wrong = unexpected(outcomes, args.class_of) if args.class_of else []
    print(*wrong, sep="\n")
    if args.class_of:
        print(f"grades as the samples expect: {len(outcomes) - len(wrong)} of {len(outcomes)} notebooks")
    if args.json:
        args.json.write_text(json.dumps({"jobs": args.jobs, "total_s": total, "load_before": before,
                                         "load_after": after, "notebooks": {f"{s}/{a}": t for (s, a), t in
                                                                            seconds.items()}}, indent=1))
    return 1 if wrong else 0


def unexpected(outcomes: list[submission.Outcome], learners: int) -> list[str]:
    """A line for each notebook of the class whose points differ from its sample's (exceed them, for a cheat)."""
    on_gpu = frozenset(a for a in classroom.samples() if submission.on_gpu(submission.device_for(a)))
    limits, lines = classroom.expected_at_most(learners, on_gpu), []
    cheats = {key for key, source in classroom.plan(learners).items() if source in classroom.CHEATS}
    for outcome in outcomes:
        key = (outcome.student, outcome.assignment)
        got = {s.question: s.points for s in outcome.scores if s.kind == "auto"}
        want = limits[key]
        ok = all(got.get(q, 0) <= most for q, most in want.items()) if key in cheats else got == want
        if not ok:
            lines.append(f"  {outcome.student}/{outcome.assignment}: got {got}, expected {'at most ' * (key in cheats)}{want}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
