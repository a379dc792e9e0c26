"""Shared test set-up: GPU tests skip on a CPU with the reason; the sample grading runs once."""

import json
import shutil
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "autograder" / "samples"


# Files whose tests run as the one ordinary user (and its delegated cgroups): one such test holding all the
# processes that user may start would starve another, so under pytest-xdist they share a process.
ORDINARY_USER_FILES = {"test_grading_unprivileged.py", "test_jail_isolation.py"}
ORDINARY_USER_SCOPE = "ordinary user"   # the one unit of work they make for pytest-xdist


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before pytest-xdist's own; a hook only where it is installed
def pytest_xdist_make_scheduler(config, log):
    """With --dist loadfile (make test), each file's tests (and its module fixtures) stay in one process, and the
    files that run as the ordinary user all go to the same one."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return ORDINARY_USER_SCOPE if Path(file).name in ORDINARY_USER_FILES else file

        def _assign_work_unit(self, node):
            # The ordinary user's files take about 7 minutes one after another: first, not last, so that the
            # other process is busy with everything else meanwhile.
            if ORDINARY_USER_SCOPE in self.workqueue:
                self.workqueue.move_to_end(ORDINARY_USER_SCOPE, last=False)
            super()._assign_work_unit(node)

    return FileScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the GPU machine (pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def graded_samples(tmp_path_factory):
    """Grade every sample submission once with the real nbgrader pipeline: (scores, output folder)."""
    from autograder.grading import batch as grade

    out = tmp_path_factory.mktemp("graded")
    submissions = out / "submitted"
    shutil.copytree(SAMPLES / "submitted", submissions)
    outcomes = grade.grade(submissions, out / "grades", progress=False)
    return [s for o in outcomes for s in o.scores], out / "grades"


def grade_submissions(root: Path, notebooks: dict[str, tuple[str, dict]]) -> tuple[dict, Path]:
    """Hand in each student's (assignment, notebook) under root/submitted and grade them all in one batch, two at
    a time: ({student: outcome}, the output folder)."""
    from autograder.grading import batch as grade

    for student, (assignment, nb) in notebooks.items():
        folder = root / "submitted" / student / assignment
        folder.mkdir(parents=True)
        (folder / f"{assignment}.ipynb").write_text(json.dumps(nb))
    outcomes = grade.grade(root / "submitted", root / "out", jobs=2, progress=False)
    return {o.student: o for o in outcomes}, root / "out"


def auto_points(outcome) -> dict[str, float]:
    """grade cell -> points of an outcome's automatically graded cells."""
    return {s.question: s.points for s in outcome.scores if s.kind == "auto"}


def assert_auto_points(outcome, expected: dict[str, float]) -> None:
    """The outcome's automatically graded points are `expected`; the message says what it got, and why."""
    got = auto_points(outcome)
    assert got == expected, (got, outcome.problem, outcome.anomalies)


def feedback_page(out: Path, student: str) -> str:
    """The HTML feedback page of the one notebook `student` handed in, graded into `out`."""
    return next((out / "feedback" / student).rglob("*.html")).read_text()


def expected_scores() -> dict[str, dict[str, dict[str, float]]]:
    """assignment -> student -> grade cell -> points, from autograder/samples/expected/*.json."""
    return {p.stem: json.loads(p.read_text()) for p in sorted((SAMPLES / "expected").glob("*.json"))}


@pytest.fixture
def delegated_cgroups():
    """Groups delegated to the tests' ordinary user (autograder/jail/delegate.py), or None where this process
    cannot make them (not root, no cgroup with the memory and pids controllers); removed afterwards, with
    whatever a grader left below them, deepest first."""
    import os

    from autograder.jail import cgroups, delegate
    from test_grading_unprivileged import UNPRIVILEGED

    if os.geteuid() != 0 or cgroups.place() is None:
        yield None
        return
    groups = delegate.delegated_groups(UNPRIVILEGED, UNPRIVILEGED)
    try:
        yield groups
    finally:
        for group in groups:
            for folder in sorted((p for p in [group, *group.rglob("*")] if p.is_dir()), key=lambda p: -len(p.parts)):
                folder.rmdir()


def assert_graph_replays_eager(fn, calls: list[tuple], replays: int) -> None:
    """fn on each argument tuple of `calls`, captured in one CUDA graph and replayed `replays` times: every replay
    writes exactly the eager outputs (each output is filled with NaN first, so a replay that writes nothing fails)."""
    eager = [fn(*call) for call in calls]            # also allocates what fn keeps outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = [fn(*call) for call in calls]
    for replay in range(replays):
        for out in outputs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i, (out, want) in enumerate(zip(outputs, eager)):
            assert torch.equal(out, want), f"replay {replay}, call {i}: differs from the eager result"
