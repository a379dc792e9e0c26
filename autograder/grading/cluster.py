"""Grading on a Dask distributed cluster: each (student, assignment) is one task, graded on a worker.

    python -m autograder grade SUBMISSIONS --scheduler tcp://HOST:8786   # workers on other machines
    python -m autograder grade SUBMISSIONS --scheduler local             # a Dask cluster on this machine

Workers need not see the instructor's files. The instructor's side reads each notebook safely
(submission.read_submission) and sends its bytes with the task, with the assignment's template gradebook.
On the worker, `grade_on_worker` writes both into a scratch folder of its own and runs
submission.grade_one there, in the worker's own jail, then returns the Outcome with the autograded and
feedback files as bytes, which the instructor's side writes into the one output folder. A worker
that cannot build a jail refuses every task with the reason (unless the instructor passed
--trusted), and so does a remote worker whose course differs from the instructor's as the notebook
is sent (other hidden checks would give other grades).

A worker that dies mid-notebook has its task run again on another worker once: the scheduler allows
ALLOWED_FAILURES deaths per task (its own setting: `local` sets it, a remote scheduler must be started
with it, see the README). After that the student gets zero and a line in the summary, never nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from autograder import ROOT
from autograder.jail import sandbox as jail
from autograder.grading.submission import MAX_NOTEBOOK_BYTES, Outcome, grade_one, read_submission, unreadable, zeros

ALLOWED_FAILURES = 1                # worker deaths a task survives: one retry on another worker
MAX_RESULT_BYTES = 4 * MAX_NOTEBOOK_BYTES   # the autograded and feedback files of one notebook, together
IN_FLIGHT_PER_THREAD = 2            # notebooks sent ahead per worker thread: the rest wait on the instructor's side
WORKER_WAIT_S = 120                 # how long grading waits, with no worker at all, before giving up
WATCH_EVERY_S = 2                   # how often the scheduler is asked whether any worker is left
RESULT_KINDS = ("autograded", "feedback")
# What decides a grade on the worker's side: if any of it differs from the instructor's, grades would too.
GRADING_CODE = ("nbgrader_config.py", "autograder/**/*.py", "autograder/hidden/**/*.py", "flashcourse/**/*.py")


class NoWorkers(RuntimeError):
    """The scheduler cannot be reached, or has no worker to grade on."""


def course_digest() -> dict[str, str]:
    """sha256 of every file of the course that decides a grade, by path: compared between instructor and worker."""
    return {str(p.relative_to(ROOT)): hashlib.sha256(p.read_bytes()).hexdigest()
            for pattern in GRADING_CODE for p in sorted(ROOT.glob(pattern)) if p.is_file()}


def _differences(theirs: dict[str, str], ours: dict[str, str]) -> list[str]:
    return sorted(path for path in theirs.keys() | ours.keys() if theirs.get(path) != ours.get(path))


def _worker_name() -> str:
    from distributed import get_worker

    worker = get_worker()
    return str(worker.name) if worker.name is not None else worker.address


@contextlib.contextmanager
def _one_at_a_time():
    """Hold this machine's grading lock of this user (a file lock: every thread and worker process of the user
    waits on it), for a worker whose jails cannot be kept apart."""
    fd = os.open(Path(tempfile.gettempdir()) / f"flashcourse-grading-{os.geteuid()}.lock",
                 os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def grade_on_worker(student: str, assignment: str, notebook: bytes, template: bytes,
                    questions: list[tuple[str, str, float]], cell_timeout: int | None, trusted: bool,
                    digest: dict[str, str] | None) -> tuple[Outcome, dict[str, bytes], str | None, str | None]:
    """Runs on a worker: grade one notebook in a scratch folder; (outcome, result files by path, why unjailed,
    why graded alone).

    `digest` is the instructor's course_digest(), None where the worker reads the instructor's own files
    (a local cluster). The files are keyed "<kind>/<path inside the student's folder>"; they are left
    out, with an anomaly, when together they exceed MAX_RESULT_BYTES. The third item is why this
    worker had no jail when it graded as --trusted, else None; the last, why it graded this notebook alone
    (its jails cannot be kept apart: jail.isolation), else None.
    """
    from distributed import get_worker

    where = _worker_name()
    differ = _differences(digest, course_digest()) if digest is not None else []
    if differ:
        shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
        return zeros(student, assignment, questions, f"not graded: worker {where} has another version of the course "
                     f"({shown} differ from the instructor's); give it the same course to grade with"), {}, None, None
    no_jail = jail.why_no_jail()
    if no_jail and not trusted:
        return zeros(student, assignment, questions, f"not graded: learners' notebooks are only run in a jail, "
                     f"and worker {where} cannot build one: {no_jail}"), {}, None, None
    shared = None if no_jail else jail.isolation()
    alone = (f"worker {where} graded one notebook at a time, since its jails cannot be kept apart ({shared})"
             if shared else None)
    with _one_at_a_time() if shared else contextlib.nullcontext(), \
            tempfile.TemporaryDirectory(prefix="flashcourse-task-", dir=get_worker().local_directory) as tmp:
        scratch = Path(tmp)
        submitted = scratch / "submitted" / f"{assignment}.ipynb"
        submitted.parent.mkdir()
        submitted.write_bytes(notebook)
        gradebook = scratch / "template.db"
        gradebook.write_bytes(template)
        out = scratch / "out"
        outcome = grade_one(student, assignment, submitted, gradebook, out, questions, cell_timeout, trusted)
        files = {}
        for kind in RESULT_KINDS:
            folder = out / kind / student / assignment
            for path in sorted(folder.rglob("*")):
                if path.is_file() and not path.is_symlink():
                    files[f"{kind}/{path.relative_to(folder).as_posix()}"] = path.read_bytes()
        size = sum(map(len, files.values()))
        if size > MAX_RESULT_BYTES:
            outcome.anomalies.append(f"the autograded notebook and feedback were not kept: {size >> 20} MiB, over "
                                     f"the {MAX_RESULT_BYTES >> 20} MiB limit")
            files = {}
    return outcome, files, no_jail, alone


def write_results(out: Path, student: str, assignment: str, files: dict[str, bytes]) -> None:
    """Write a worker's result files into out/<kind>/<student>/<assignment>/; none if any path would leave it."""
    paths = {name: PurePosixPath(name) for name in files}
    for name, path in paths.items():
        if path.is_absolute() or ".." in path.parts or len(path.parts) < 2 or path.parts[0] not in RESULT_KINDS:
            raise ValueError(f"a worker returned a file outside the student's folders: {name!r}")
    for name, path in paths.items():
        target = out / path.parts[0] / student / assignment / Path(*path.parts[1:])
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(files[name])


def _client(scheduler: str, jobs: int):
    """A client of the scheduler at `scheduler`, or of a new cluster of `jobs` processes on this machine for 'local'."""
    import dask
    from distributed import Client, LocalCluster

    if scheduler != "local":
        try:
            return Client(scheduler)
        except OSError as error:
            raise NoWorkers(f"the Dask scheduler at {scheduler} cannot be reached: {error}") from None
    with dask.config.set({"distributed.scheduler.allowed-failures": ALLOWED_FAILURES}):
        cluster = LocalCluster(n_workers=max(1, jobs), threads_per_worker=1, processes=True,
                               dashboard_address="127.0.0.1:0", silence_logs=logging.ERROR)  # any free port
    return Client(cluster, set_as_default=False)


def _cancel_when_no_worker(client, futures: dict, stop: threading.Event) -> None:
    """Cancel every unfinished future once the scheduler has had no worker for WORKER_WAIT_S, until `stop`."""
    alone_since = None
    while not stop.wait(WATCH_EVERY_S):
        if client.nthreads():
            alone_since = None
        elif alone_since is None:
            alone_since = time.monotonic()
        elif time.monotonic() - alone_since > WORKER_WAIT_S:
            client.cancel([f for f in list(futures.values()) if not f.done()], reason="no worker left")


def grade_on_cluster(scheduler: str, todo: list[tuple[str, str, Path]], templates: dict[str, Path],
                     asked: dict[str, list[tuple[str, str, float]]], out: Path, jobs: int,
                     cell_timeout: int | None, trusted: bool) -> Iterator[tuple[Outcome, str | None, str | None]]:
    """Grade each (student, assignment, notebook) of `todo` on the cluster; yield (outcome, why a worker had no jail,
    why it graded the notebook alone).

    Results are written into `out` as they arrive. Notebooks are read here and sent a few at a time,
    so that a large class does not sit in memory at once. Once no worker has been left for
    WORKER_WAIT_S, the notebooks not graded yet are reported rather than waited for.
    """
    from distributed import KilledWorker, as_completed
    from distributed.client import FutureCancelledError

    client, stop = _client(scheduler, jobs), threading.Event()
    try:
        try:
            client.wait_for_workers(1, timeout=WORKER_WAIT_S)
        except TimeoutError:
            raise NoWorkers(f"no Dask worker joined the scheduler at {scheduler} within {WORKER_WAIT_S} s: "
                            f"start some (see the README)") from None
        # Sent with every task rather than scattered once: data held by a worker dies with it, a task's own doesn't.
        gradebooks = {assignment: path.read_bytes() for assignment, path in templates.items()}
        remote = scheduler != "local"  # a local cluster's workers read these very files: nothing to compare
        pending = iter(todo)
        running = as_completed(loop=client.loop)
        tasks, futures = {}, {}
        threading.Thread(target=_cancel_when_no_worker, args=(client, futures, stop), daemon=True).start()

        def send() -> Iterator[tuple[Outcome, str | None, str | None]]:
            """Submit notebooks until each worker thread has a few; yield the outcome of those that cannot be read."""
            ahead = IN_FLIGHT_PER_THREAD * max(1, sum(client.nthreads().values()))  # workers may join or leave
            while running.count() < ahead:
                student, assignment, notebook = next(pending, (None, None, None))
                if student is None:
                    return
                try:
                    submitted = read_submission(notebook)
                except (OSError, ValueError) as error:
                    yield zeros(student, assignment, asked[assignment], unreadable(notebook, error)), None, None
                    continue
                future = client.submit(grade_on_worker, student, assignment, submitted, gradebooks[assignment],
                                       asked[assignment], cell_timeout, trusted, course_digest() if remote else None,
                                       pure=False, retries=1,
                                       key=f"grade-{student}-{assignment}-{uuid.uuid4().hex[:8]}")
                tasks[future.key] = (student, assignment)
                futures[future.key] = future
                running.add(future)

        yield from send()
        for future in running:
            student, assignment = tasks.pop(future.key)
            futures.pop(future.key)
            unjailed = alone = None
            try:
                outcome, files, unjailed, alone = future.result()
                write_results(out, student, assignment, files)
            except KilledWorker:
                outcome = zeros(student, assignment, asked[assignment],
                                f"not graded: the worker grading it died, {ALLOWED_FAILURES + 1} times")
            except FutureCancelledError:
                outcome = zeros(student, assignment, asked[assignment],
                                f"not graded: no Dask worker was left for {WORKER_WAIT_S} s")
            except Exception as error:  # a grader fault must not lose the other students' grades
                outcome = zeros(student, assignment, asked[assignment], f"grader error: {error}")
            future.release()
            yield outcome, unjailed, alone
            yield from send()
    finally:
        stop.set()
        cluster = client.cluster
        client.close()
        if cluster is not None:
            cluster.close()
