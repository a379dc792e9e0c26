"""The course's command line: `python -m autograder build|grade|demo|check`."""

import argparse
import os
import sys
from pathlib import Path

from flashcourse import DEVICE_ENV

from autograder import ROOT
from autograder.building import build
from autograder.grading import cluster, batch as grade
from autograder.jail import sandbox as jail

SAMPLES = ROOT / "autograder" / "samples" / "submitted"


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m autograder", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="regenerate notebooks/, solutions/ and the engine from source/")
    b.add_argument("assignments", nargs="*", help="only these assignments (default: all of source/)")
    b.add_argument("--check", action="store_true", help="only report what is out of date; exit 1 if anything is")
    b.add_argument("--no-execute", action="store_true",
                   help="keep executed solutions' outputs: carry a changed source's text into them "
                        "(a changed code cell loses its outputs and is listed as not executed)")
    b.add_argument("--solutions-to-run", type=Path, metavar="DIR",
                   help="write the out-of-date solutions, unexecuted, into DIR, to be executed on another machine "
                        "(python -m autograder.building.run_solutions DIR OUT there); build nothing else")
    b.add_argument("--executed-from", type=Path, metavar="OUT",
                   help="take out-of-date solutions from OUT, executed on another machine, instead of executing here")
    b.add_argument("--force", action="store_true",
                   help="replace release notebooks in notebooks/ even where they were edited since the last build "
                        "(a learner's work there is lost)")
    g = sub.add_parser("grade", help="autograde a folder laid out as submitted/<student>/<assignment>/")
    g.add_argument("submissions", type=Path)
    g.add_argument("--out", type=Path, default=ROOT / "build" / "grades")
    g.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="students graded at once")
    g.add_argument("--trusted", action="store_true",
                   help="where no jail can be built, run the notebooks without one: only for notebooks you trust")
    g.add_argument("--scheduler", metavar="ADDRESS",
                   help="grade on a Dask cluster: its scheduler's address (tcp://HOST:8786), whose workers each grade "
                        "in their own jail, or 'local' for a Dask cluster of --jobs processes here "
                        "(default: --jobs threads here)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the tests run the learners' functions: cuda compiles their Triton kernels on a GPU, "
                        "cpu runs them in Triton's interpreter (default: the GPU, if there is one, for the Triton "
                        "assignments 04-06, the CPU for the others)")
    d = sub.add_parser("demo", help="grade the sample submissions and print the table")
    d.add_argument("--out", type=Path, default=ROOT / "build" / "demo")
    d.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="students graded at once")
    c = sub.add_parser("check", help="run a notebook's visible tests, as a learner would; exit 1 if any fails")
    c.add_argument("notebook", type=Path)
    args = parser.parse_args()

    if args.command == "check":
        from flashcourse import selfcheck

        return selfcheck.main([str(args.notebook)])

    if args.command == "build":
        return build.main(args.assignments, check=args.check, execute_solutions=not args.no_execute,
                          force=args.force, executed_from=args.executed_from,
                          solutions_to_run_in=args.solutions_to_run)
    submissions = SAMPLES if args.command == "demo" else args.submissions
    if getattr(args, "device", "auto") != "auto":  # read by flashcourse.runtime here, in nbgrader and in the jail
        os.environ[DEVICE_ENV] = args.device
    # The samples are the course's own notebooks: the demo may run them without a jail, and says so.
    trusted = args.command == "demo" or args.trusted
    scheduler = getattr(args, "scheduler", None)
    remote = scheduler not in (None, "local")  # remote workers say themselves whether they have a jail
    no_jail = None if remote else jail.why_no_jail()
    if trusted and no_jail:
        print(f"Grading {submissions} as TRUSTED notebooks, without a jail: {no_jail}\n")
    try:
        outcomes = grade.grade(submissions, args.out, jobs=args.jobs, trusted=trusted, scheduler=scheduler)
    except jail.NoJail as refused:
        print(f"Not grading: {refused}", file=sys.stderr)
        return 2
    except cluster.NoWorkers as idle:
        print(f"Not grading: {idle}", file=sys.stderr)
        return 2
    print(grade.table(outcomes))
    print("\n" + grade.summary(outcomes))
    print(f"grades: {args.out / 'grades.csv'}\nfeedback: {args.out / 'feedback'}/<student>/<assignment>/\n"
          f"summary: {args.out / 'summary.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
