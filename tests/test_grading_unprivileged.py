"""The same adversarial submissions graded by an ordinary user, not root: the same grades, nothing touched.

CI runs as root, where the jail drops to a uid of its own. An ordinary user's grader builds the jail
in a user namespace instead, so that path is exercised here: the batch grader itself runs as uid
UNPRIVILEGED with no capabilities (inside a mount namespace that only makes the Python environment
and the course readable to that uid, as they would be on an instructor's machine).
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from autograder import ROOT
from autograder.jail import delegate, sandbox as jail
from test_grading_robustness import ASSIGNMENT, CASES, _fingerprint, _write

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(jail.why_no_jail() is not None, reason=f"no jail here: {jail.why_no_jail()}")]
UNPRIVILEGED = 1000
STUDENTS = ("correct_neighbour", "mentions_any_word", "infects_the_grader", "leaves_daemons", "kills_everyone",
            "forges_a_message", "links_to_the_source")


def _readable_to_everyone(paths: list[Path]) -> list[str]:
    """bwrap options (run as root) under which every folder on the way to `paths` can be passed through."""
    options, covered = [], set()
    for path in paths:
        for parent in reversed(path.parents[:-1]):
            if parent in covered or os.stat(parent).st_mode & 0o001:
                continue
            covered.add(parent)
            child = path.relative_to(parent).parts[0]
            options += ["--perms", "0755", "--tmpfs", str(parent), "--bind", str(parent / child), str(parent / child)]
    return options


def _as_ordinary_user(argv: list[str], home: Path) -> list[str]:
    if os.geteuid() != 0:
        return argv
    wrapper = ["bwrap", "--dev-bind", "/", "/",
               *_readable_to_everyone([ROOT, Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), home]),
               "--", "/usr/bin/setpriv", "--reuid", str(UNPRIVILEGED), "--regid", str(UNPRIVILEGED), "--clear-groups",
               "--inh-caps=-all", "--bounding-set=-all", "--"]
    return wrapper + argv


def test_an_ordinary_user_grades_the_same():
    """Run as an ordinary user, the grader gives the adversarial submissions the same grades and touches nothing."""
    work = Path(tempfile.mkdtemp(prefix="flashcourse-unprivileged-", dir="/tmp"))
    try:
        for student in STUDENTS:
            folder = work / "submitted" / student / ASSIGNMENT
            folder.mkdir(parents=True)
            for name, content in CASES[student][0].items():
                _write(folder, name, content)
        for path in [work, *work.rglob("*")]:
            if not path.is_symlink():
                path.chmod(0o777 if path.is_dir() else 0o666)
        before = _fingerprint(ROOT)
        env = {**os.environ, "HOME": str(work), "JUPYTER_RUNTIME_DIR": str(work / "runtime")}
        run = subprocess.run(_as_ordinary_user([sys.executable, "-m", "autograder", "grade", str(work / "submitted"),
                                                "--out", str(work / "out"), "--jobs", "2"], work),
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert _fingerprint(ROOT) == before
        rows = [line.split(",") for line in (work / "out" / "grades.csv").read_text().splitlines()[1:]]
        got = {}
        for student, _, question, kind, points, _ in rows:
            if kind == "auto":
                got.setdefault(student, {})[question] = float(points)
        for student in STUDENTS:
            assert got[student] == CASES[student][1], (student, got[student], run.stdout[-2000:])
        summary = (work / "out" / "summary.txt").read_text()
        assert "left 3 process(es) running" in summary and "malformed" in summary, summary
        if os.geteuid() == 0:
            assert all(p.stat().st_uid == UNPRIVILEGED for p in (work / "out").iterdir()), "the grader was not the user"
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_the_jail_holds_for_an_ordinary_user():
    """tests/test_jail.py run by an ordinary user, whose kernels bubblewrap starts in a user namespace: every
    property and attack of the jail checked there too (the template's half skips: it needs root)."""
    home = Path(tempfile.mkdtemp(prefix="flashcourse-unprivileged-", dir="/tmp"))
    try:
        home.chmod(0o777)
        argv = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_jail.py"]
        run = subprocess.run(_as_ordinary_user(argv, home), cwd=ROOT, env={**os.environ, "HOME": str(home)},
                             capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        skips = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
        assert all("needs a root grader" in line for line in skips), skips   # only the template's half
        assert re.search(r"\b(1[0-9]|[2-9][0-9]) passed", run.stdout), run.stdout[-2000:]
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _work_attacks(which: str) -> dict:
    """student -> (assignment, notebook, expected points): the submissions of the suites that prove a point is
    earned only by the work: "ring" (07's ring measured per rank, no rank reading another's shards), or "kernels
    and memory" (kernels run by the grader, memory measured from outside)."""
    import test_grading_kernels as kernels
    import test_grading_kernels_more as kernels_more
    import test_grading_work as work

    if which == "ring":
        return {s: (work.RING, nb, points) for s, (nb, points) in work.RING_CASES.items()}
    return {**work.CASES, **kernels_more.CASES,
            **{s: (kernels.FLASH, nb, points) for s, (nb, points) in kernels.CASES.items()}}


@pytest.mark.parametrize("which", ["kernels and memory", "ring"])
def test_points_need_the_work_for_an_ordinary_user(which, delegated_cgroups):
    """Graded by an ordinary user, each shortcut to a kernel, memory or ring point scores what it scores as root,
    and each honest variant keeps full marks. Where a cgroup can be delegated to the user (as the course's image
    does), the grader starts in it, so its jails are kept apart and it grades two notebooks at once."""
    import json

    cases = _work_attacks(which)
    work = Path(tempfile.mkdtemp(prefix="flashcourse-unprivileged-", dir="/tmp"))
    try:
        for student, (assignment, nb, _) in cases.items():
            folder = work / "submitted" / student / assignment
            folder.mkdir(parents=True)
            (folder / f"{assignment}.ipynb").write_text(json.dumps(nb))
        for path in [work, *work.rglob("*")]:
            path.chmod(0o777 if path.is_dir() else 0o666)
        env = {**os.environ, "HOME": str(work), "JUPYTER_RUNTIME_DIR": str(work / "runtime")}
        run = subprocess.run(_as_ordinary_user([sys.executable, "-m", "autograder", "grade", str(work / "submitted"),
                                                "--out", str(work / "out"), "--jobs", "2"], work),
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
                             preexec_fn=(lambda: delegate.enter(delegated_cgroups)) if delegated_cgroups else None)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        got = {}
        for line in (work / "out" / "grades.csv").read_text().splitlines()[1:]:
            student, _, question, kind, points, _ = line.split(",")
            if kind == "auto":
                got.setdefault(student, {})[question] = float(points)
        wrong = {s: got.get(s) for s, (_, _, points) in cases.items() if got.get(s) != points}
        assert not wrong, (wrong, (work / "out" / "summary.txt").read_text()[-3000:])
        import test_grading_work

        summary = (work / "out" / "summary.txt").read_text()   # traced as this user too: the summary names them
        for student in set(test_grading_work.FUSED_STUDENTS) & set(cases):
            assert re.search(rf"- {student}, \S+: a measured call of \w+ ran torch's fused attention", summary), summary
    finally:
        shutil.rmtree(work, ignore_errors=True)
