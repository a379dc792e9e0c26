"""No student affects another, as root and as an ordinary user: each jail's processes and memory are counted
apart (a cgroup of its own), or, where they cannot be, notebooks are graded one at a time.

The attack: a notebook holds ~250 sleeping processes while an honest neighbour's code starts one. As an ordinary
user without per-jail accounting every jail counts against the grader's one RLIMIT_NPROC, and the neighbour's
fork failed. And memory held in memfds shows in no process's address space or resident size.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from autograder import ROOT
from autograder.jail import cgroups, delegate, sandbox as jail
from test_grading_robustness import ASSIGNMENT, BUGGY, CORRECT, FULL, NOTEBOOK, WRONG, _write, in_tile_update, with_cell
from test_grading_unprivileged import UNPRIVILEGED, _as_ordinary_user

pytestmark = pytest.mark.skipif(jail.why_no_jail() is not None, reason=f"no jail here: {jail.why_no_jail()}")
needs_cgroups = pytest.mark.skipif(cgroups.place() is None, reason=f"no per-jail cgroup here: {cgroups.why_not()}")

HOLD = ("import subprocess, time\nheld = []\ntry:\n    while len(held) < 400:\n"
        "        held.append(subprocess.Popen(['sleep', '600']))\nexcept OSError:\n    pass\n"
        "print(len(held), 'held')\ntime.sleep(25)")
MEMFD_HOG = ("import os\nheld = []\nfor _ in range(24):\n    fd = os.memfd_create('hog')\n"
             "    os.posix_fallocate(fd, 0, 64 << 20)\n    held.append(fd)\nprint(len(held) * 64, 'MiB held')")
STUDENTS = {  # student -> (notebook, autograded points expected whoever grades)
    "a_holds_processes": (with_cell(BUGGY, HOLD), WRONG),
    # honest: its tile_update starts a process each call, as 07's ranks do
    "b_honest_neighbour": (with_cell(in_tile_update(CORRECT, "__import__('subprocess').run(['true'], check=True)"),
                                     "import time\ntime.sleep(8)  # its tests run while the neighbour holds"), FULL),
    "c_memfd_hog": (with_cell(BUGGY, MEMFD_HOG), WRONG),
}


@pytest.fixture(params=["bubblewrap", "template"])
def started(request):
    template = None
    if request.param == "template":
        if os.geteuid() != 0:
            pytest.skip("a kernel template needs a root grader")
        template = jail.Template()
    kernel = jail.Jail(limits=jail.Limits(memory=512 << 20), template=template)
    kernel.start()
    yield kernel
    kernel.close()
    if template is not None:
        template.close()


def _run(kernel: jail.Jail, code: str) -> str:
    answer, _ = kernel.ask({"op": "run", "code": code}, None, time.monotonic() + 60)
    assert answer["error"] is None, answer["error"]
    return "".join(o.get("text", "") for o in answer["outputs"])


def test_shm_is_small_and_dev_read_only(started):
    """/dev/shm is a tmpfs of its own, as small as /tmp; /dev itself takes no file."""
    out = _run(started, "import os\ns = os.statvfs('/dev/shm')\nprint(s.f_blocks * s.f_frsize)\n"
                        "try:\n    open('/dev/planted', 'w'); print('wrote /dev')\nexcept OSError: print('refused')")
    size, verdict = out.split()
    assert int(size) <= jail.Limits().tmp_bytes and verdict == "refused", out


@needs_cgroups
def test_memfd_memory_is_the_jails_own(started):
    """Memory held in memfds, which no address-space limit sees, is charged to the jail: past its memory the
    kernel ends a process of that jail, and closing it names the limit."""
    assert started.accounting is not None
    try:
        answer, _ = started.ask({"op": "run", "code": MEMFD_HOG.replace("24", "16")}, None, time.monotonic() + 60)
    except Exception:  # the kernel was the process ended
        answer = None
    assert answer is None or answer["error"], answer
    started.close()
    assert any("memory" in hit for hit in started.hits), started.hits


@needs_cgroups
def test_the_images_entrypoint_delegates_a_cgroup_then_drops_to_the_user(delegated_cgroups):
    """`python -m autograder.jail.delegate --user U -- CMD` (the Dockerfile's entrypoint), run as root: CMD runs as U,
    inside groups U owns, where it can make each jail's groups."""
    if os.geteuid() != 0:
        pytest.skip("the entrypoint delegates only when started as root")
    show = ("import os; from autograder.jail import cgroups; "
            "print(os.getuid(), os.getgid(), os.getgroups(), cgroups.place() is not None)")
    env = {k: v for k, v in os.environ.items() if k != cgroups.PLACE_ENV}
    readable = _as_ordinary_user([], Path("/tmp"))          # the course and Python made readable to the user...
    readable = readable[:readable.index("/usr/bin/setpriv")]  # ...who the entrypoint itself becomes
    run = subprocess.run([*readable, sys.executable, "-m", "autograder.jail.delegate", "--user", str(UNPRIVILEGED),
                          "--", sys.executable, "-c", show], cwd="/", env={**env, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == [str(UNPRIVILEGED), str(UNPRIVILEGED), "[]", "True"], run.stdout + run.stderr


def _grade(as_user: bool, jobs: int = 3, delegated: list[Path] | None = None) -> tuple[dict, str]:
    """Grade STUDENTS side by side; with `delegated`, the grader starts inside those groups (delegate.enter)."""
    work = Path(tempfile.mkdtemp(prefix="flashcourse-isolation-", dir="/tmp"))
    try:
        for student, (notebook, _) in STUDENTS.items():
            folder = work / "submitted" / student / ASSIGNMENT
            folder.mkdir(parents=True)
            _write(folder, NOTEBOOK, notebook)
        for path in [work, *work.rglob("*")]:
            path.chmod(0o777 if path.is_dir() else 0o666)
        env = {**os.environ, "HOME": str(work), "JUPYTER_RUNTIME_DIR": str(work / "runtime"),
               jail.MEMORY_ENV: str(1 << 30)}
        env.pop(cgroups.PLACE_ENV, None)
        argv = [sys.executable, "-m", "autograder", "grade", str(work / "submitted"), "--out", str(work / "out"),
                "--jobs", str(jobs)]
        run = subprocess.run(_as_ordinary_user(argv, work) if as_user else argv, cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=900,
                             preexec_fn=(lambda: delegate.enter(delegated)) if delegated else None)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        got: dict[str, dict[str, float]] = {}
        for line in (work / "out" / "grades.csv").read_text().splitlines()[1:]:
            student, _, question, kind, points, _ = line.split(",")
            if kind == "auto":
                got.setdefault(student, {})[question] = float(points)
        return got, (work / "out" / "summary.txt").read_text()
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("who", ["root", "ordinary user", "ordinary user delegated a cgroup"])
def test_a_crowding_neighbour_moves_no_grade(who, request):
    """Graded side by side with a notebook holding all the processes it may and one filling memfds, an honest
    notebook that starts processes keeps its full score; the summary names what hit its own limits, or says
    that notebooks were graded one at a time where jails cannot be kept apart."""
    as_user = who.startswith("ordinary user")
    if os.geteuid() != 0 and who != "ordinary user":
        pytest.skip("needs a root grader")
    delegated = request.getfixturevalue("delegated_cgroups") if "delegated" in who else None
    if "delegated" in who and delegated is None:
        pytest.skip(f"no cgroup to delegate here: {cgroups.why_not()}")
    got, summary = _grade(as_user, delegated=delegated)
    assert got["b_honest_neighbour"] == FULL, (got, summary)
    for student, (_, points) in STUDENTS.items():
        assert got[student] == points, (student, got[student], summary)
    assert "b_honest_neighbour" not in summary, summary
    apart = cgroups.place() is not None and (not as_user or delegated is not None)
    lines = summary.splitlines()
    if apart:
        assert any("a_holds_processes" in line and "limit of 256 processes" in line for line in lines), summary
        assert any("c_memfd_hog" in line and "MiB of memory" in line for line in lines), summary
        assert "one at a time" not in summary, summary
    elif as_user:
        assert summary.count("graded one at a time") == 1, summary
