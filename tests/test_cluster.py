"""Grading on a real Dask cluster: a scheduler and workers in processes of their own, on 127.0.0.1.

The workers are started as on another machine (`dask worker`, the course on PYTHONPATH, a scratch
folder of their own); grades must equal the local run's, a killed worker's notebook must be graded
by the other one, and a worker without a jail must refuse.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from autograder.grading import cluster, batch as grade
from autograder.jail import sandbox as jail
from conftest import ROOT, SAMPLES, expected_scores

pytestmark = pytest.mark.slow
ASSIGNMENT = "01_online_softmax"
COMPARED = ["alt_correct", "bug_l_not_rescaled", "cheat_patched_checks"]  # correct, a named bug, a cheat
START_TIMEOUT_S = 60


def _submissions(into: Path, students: list[str]) -> Path:
    """A submitted/ folder holding these sample students' 01 notebooks."""
    for student in students:
        shutil.copytree(SAMPLES / "submitted" / student / ASSIGNMENT, into / student / ASSIGNMENT)
    return into


def _kill_tree(process: subprocess.Popen) -> None:
    """Kill a process and everything it started (nbgrader and the jail run in sessions of their own)."""
    for pid in [process.pid, *jail.descendants(process.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


@contextmanager
def dask_cluster(folder: Path, workers: list[str], worker_env: dict[str, str] | None = None):
    """A `dask scheduler` and one single-threaded `dask worker` per name: (scheduler address, processes by name)."""
    from distributed import Client

    folder.mkdir(parents=True, exist_ok=True)
    scheduler_file = folder / "scheduler.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": str(cluster.ALLOWED_FAILURES)}
    common = ["--host", "127.0.0.1", "--no-dashboard", "--scheduler-file", str(scheduler_file)]
    log = (folder / "dask.log").open("w")
    started = [subprocess.Popen([sys.executable, "-m", "dask", "scheduler", "--port", "0", *common],
                                cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)]
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not scheduler_file.exists():
            assert time.monotonic() < deadline and started[0].poll() is None, "the scheduler did not start"
            time.sleep(0.2)
        by_name = {}
        for name in workers:
            by_name[name] = subprocess.Popen(
                [sys.executable, "-m", "dask", "worker", "--name", name, "--nthreads", "1", "--no-nanny",
                 "--local-directory", str(folder / name), *common],
                cwd=folder, env={**env, **(worker_env or {})}, stdout=log, stderr=subprocess.STDOUT)
            started.append(by_name[name])
        address = json.loads(scheduler_file.read_text())["address"]
        with Client(address, timeout=START_TIMEOUT_S) as client:
            client.wait_for_workers(len(workers), timeout=START_TIMEOUT_S)
        yield address, by_name
    finally:
        for process in reversed(started):
            _kill_tree(process)
        log.close()


def _kill_when_grading(address: str, workers: dict[str, subprocess.Popen], spare: set[str]) -> str:
    """Wait until a worker not in `spare` is grading a notebook, kill it with all it started; its name."""
    from distributed import Client

    with Client(address) as client:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            names = {address: info["name"] for address, info in client.scheduler_info()["workers"].items()}
            for where, keys in client.processing().items():
                name = names.get(where)
                if name in workers and name not in spare and any(str(k).startswith("grade-") for k in keys):
                    time.sleep(2)  # well inside the notebook: nbgrader and the jail are running
                    _kill_tree(workers[name])
                    return name
            time.sleep(0.1)
    raise AssertionError("no worker started grading")


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """Three 01 samples graded by the local thread pool, as expected: (submissions, output folder)."""
    folder = tmp_path_factory.mktemp("local")
    submissions = _submissions(folder / "submitted", COMPARED)
    outcomes = grade.grade(submissions, folder / "grades", jobs=2, progress=False)
    expected = expected_scores()[ASSIGNMENT]
    assert {o.student: {s.question: s.points for s in o.scores if s.kind == "auto"} for o in outcomes} == \
        {student: expected[student] for student in COMPARED}
    return submissions, folder / "grades"


def test_cluster_grades_equal_local_grades(local_run, tmp_path):
    """Two `dask worker` processes grade 01 samples: grades.csv and the result files equal the local run's."""
    submissions, local = local_run
    with dask_cluster(tmp_path / "cluster", ["w1", "w2"]) as (address, _):
        outcomes = grade.grade(submissions, tmp_path / "grades", progress=False, scheduler=address)
    assert not [o.problem for o in outcomes if o.problem]
    assert (tmp_path / "grades" / "grades.csv").read_text() == (local / "grades.csv").read_text()
    for kind in cluster.RESULT_KINDS:
        here = sorted(p.relative_to(local) for p in (local / kind).rglob("*") if p.is_file())
        there = sorted(p.relative_to(tmp_path / "grades")
                       for p in (tmp_path / "grades" / kind).rglob("*") if p.is_file())
        assert there == here and here, kind
    feedback = tmp_path / "grades" / "feedback" / "bug_l_not_rescaled" / ASSIGNMENT / f"{ASSIGNMENT}.html"
    assert "l is not multiplied by alpha" in feedback.read_text()


def _grade_killing_workers(tmp_path: Path, student: str, workers: list[str], kills: int, wait_s: float):
    """Grade `student`'s 01 on a cluster of `workers`, killing `kills` of them in turn, each while it grades the
    notebook, then waiting up to wait_s for the grade: (its outcome, the killed workers, those still running)."""
    submissions = _submissions(tmp_path / "submitted", [student])
    with dask_cluster(tmp_path / "cluster", workers) as (address, processes):
        result = {}
        thread = threading.Thread(target=lambda: result.update(
            outcomes=grade.grade(submissions, tmp_path / "grades", progress=False, scheduler=address)))
        thread.start()
        killed = []
        for _ in range(kills):
            killed.append(_kill_when_grading(address, processes, spare=set(killed)))
        thread.join(timeout=wait_s)
        running = {name for name, p in processes.items() if p.poll() is None}
    [outcome] = result["outcomes"]
    return outcome, killed, running


def test_killed_worker_notebook_is_graded_by_the_other(tmp_path):
    """A worker killed mid-notebook: the scheduler runs the task again on the other worker, and the grade is right."""
    student = "bug_l_not_rescaled"
    outcome, [killed], running = _grade_killing_workers(tmp_path, student, ["w1", "w2"], kills=1, wait_s=300)
    assert running == {"w1", "w2"} - {killed}   # the killed worker is gone, the other one still runs
    assert outcome.problem == ""
    auto = {s.question: s.points for s in outcome.scores if s.kind == "auto"}
    assert auto == expected_scores()[ASSIGNMENT][student]
    assert (tmp_path / "grades" / "feedback" / student / ASSIGNMENT / f"{ASSIGNMENT}.html").exists()


def test_notebook_whose_workers_all_die_is_reported(tmp_path):
    """A notebook whose worker dies twice gets zero and a line in the summary, not nothing."""
    student = "alt_correct"
    outcome, _, _ = _grade_killing_workers(tmp_path, student, ["w1", "w2"], kills=2, wait_s=120)
    assert "the worker grading it died, 2 times" in outcome.problem
    assert outcome.scores and not any(s.points for s in outcome.scores)
    summary = (tmp_path / "grades" / "summary.txt").read_text()
    assert f"{student}, {ASSIGNMENT}: not graded: the worker grading it died" in summary
    rows = (tmp_path / "grades" / "grades.csv").read_text().splitlines()[1:]
    assert len(rows) == len(outcome.scores) and all(row.startswith(f"{student},") for row in rows)


def test_notebooks_are_reported_when_no_worker_is_left(tmp_path, monkeypatch):
    """The only worker dies mid-notebook: once no worker has been left for WORKER_WAIT_S, the student is reported."""
    monkeypatch.setattr(cluster, "WORKER_WAIT_S", 5)
    outcome, _, _ = _grade_killing_workers(tmp_path, "blank", ["w1"], kills=1, wait_s=120)
    assert outcome.problem == "not graded: no Dask worker was left for 5 s"
    assert outcome.scores and not any(s.points for s in outcome.scores)


def test_unreachable_scheduler_stops_grading(tmp_path):
    """A scheduler that cannot be reached stops the batch before any notebook, with the reason."""
    import dask
    import distributed  # noqa: F401  its configuration's defaults first: set() restores only what existed before

    submissions = _submissions(tmp_path / "submitted", ["blank"])
    with dask.config.set({"distributed.comm.timeouts.connect": "2s"}), \
            pytest.raises(cluster.NoWorkers, match="the Dask scheduler at tcp://127.0.0.1:9 cannot be reached"):
        grade.grade(submissions, tmp_path / "grades", progress=False, scheduler="tcp://127.0.0.1:9")


@pytest.fixture(scope="module")
def jailless_worker(tmp_path_factory):
    """A cluster of one worker, w1, that cannot build a jail: bubblewrap is not on its PATH. The scheduler's address."""
    folder = tmp_path_factory.mktemp("jailless")
    (folder / "bin").mkdir()
    without_bwrap = {"PATH": f"{Path(sys.executable).parent}:{folder / 'bin'}"}
    with dask_cluster(folder / "cluster", ["w1"], without_bwrap) as (address, _):
        yield address


def test_worker_without_a_jail_refuses(jailless_worker, tmp_path):
    """A worker where bubblewrap is missing grades nothing and says why."""
    submissions = _submissions(tmp_path / "submitted", ["blank"])
    [outcome] = grade.grade(submissions, tmp_path / "grades", progress=False, scheduler=jailless_worker)
    assert "only run in a jail, and worker w1 cannot build one: bubblewrap (bwrap) is not installed" in outcome.problem
    assert not any(s.points for s in outcome.scores)
    assert not (tmp_path / "grades" / "autograded").exists()


def test_worker_without_a_jail_grades_trusted_notebooks_and_says_so(jailless_worker, tmp_path):
    """With --trusted, the jail-less worker grades the course's own sample, and the summary warns it ran unjailed."""
    submissions = _submissions(tmp_path / "submitted", ["blank"])
    [outcome] = grade.grade(submissions, tmp_path / "grades", progress=False, scheduler=jailless_worker, trusted=True)
    assert outcome.problem == "" and outcome.scores
    assert "WITHOUT a jail" in (tmp_path / "grades" / "summary.txt").read_text()
    assert (tmp_path / "grades" / "feedback" / "blank" / ASSIGNMENT / f"{ASSIGNMENT}.html").exists()


def test_local_dask_cluster_grades_like_the_thread_pool(local_run, tmp_path):
    """--scheduler local: a Dask cluster of worker processes on this machine gives the same grades.csv."""
    _, local = local_run
    one = _submissions(tmp_path / "submitted", ["bug_l_not_rescaled"])
    grade.grade(one, tmp_path / "grades", jobs=1, progress=False, scheduler="local")
    rows = [r for r in (local / "grades.csv").read_text().splitlines() if r.startswith("bug_l_not_rescaled,")]
    assert (tmp_path / "grades" / "grades.csv").read_text().splitlines()[1:] == rows


def test_worker_with_another_course_refuses(jailless_worker):
    """A worker whose grading code differs from the instructor's names the files and grades nothing."""
    from distributed import Client

    digest = cluster.course_digest()
    digest["autograder/hidden/online_softmax.py"] = "0" * 64
    with Client(jailless_worker) as client:
        outcome, files, _, _ = client.submit(cluster.grade_on_worker, "s", ASSIGNMENT, b"{}", b"", [("q", "auto", 1.0)],
                                             None, False, digest, pure=False).result()
    assert "worker w1 has another version of the course (autograder/hidden/online_softmax.py differ" in outcome.problem
    assert files == {} and [s.points for s in outcome.scores] == [0.0]


def test_grading_alone_waits_for_every_other_grading(tmp_path, monkeypatch):
    """A worker whose jails cannot be kept apart grades under one lock per user and machine: a second thread, with
    a file descriptor of its own as another worker process would have, waits until the first is done."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    events = []

    def grade(name):
        with cluster._one_at_a_time():
            events.append(f"{name} starts")
            time.sleep(0.3)
            events.append(f"{name} ends")

    threads = [threading.Thread(target=grade, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first, second = events[0].split()[0], events[2].split()[0]
    assert events == [f"{first} starts", f"{first} ends", f"{second} starts", f"{second} ends"], events


@pytest.mark.parametrize("name", ["../x.html", "/etc/passwd", "feedback/../../x", "templates/x.db", "feedback"])
def test_result_files_stay_in_the_student_folder(tmp_path, name):
    """A returned file whose path would leave out/<kind>/<student>/<assignment>/ is refused, and no file is written."""
    with pytest.raises(ValueError, match="outside the student's folders"):
        cluster.write_results(tmp_path, "s", ASSIGNMENT, {"feedback/page.html": b"x", name: b"x"})
    assert not any(tmp_path.iterdir())


def test_result_files_land_in_the_student_folder(tmp_path):
    """Returned files are written under out/<kind>/<student>/<assignment>/, subfolders kept."""
    cluster.write_results(tmp_path, "s", ASSIGNMENT, {"feedback/page.html": b"a", "autograded/sub/nb.ipynb": b"b"})
    assert (tmp_path / "feedback" / "s" / ASSIGNMENT / "page.html").read_bytes() == b"a"
    assert (tmp_path / "autograded" / "s" / ASSIGNMENT / "sub" / "nb.ipynb").read_bytes() == b"b"
