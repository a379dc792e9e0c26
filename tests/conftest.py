"""Shared test set-up: GPU tests skip on a CPU with the reason; the sample grading runs once."""

import json
import shutil
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "autograder" / "samples"


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


def expected_scores() -> dict[str, dict[str, dict[str, float]]]:
    """assignment -> student -> grade cell -> points, from autograder/samples/expected/*.json."""
    return {p.stem: json.loads(p.read_text()) for p in sorted((SAMPLES / "expected").glob("*.json"))}
