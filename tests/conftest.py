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
    from autograder import grade

    out = tmp_path_factory.mktemp("graded")
    submissions = out / "submitted"
    shutil.copytree(SAMPLES / "submitted", submissions)
    outcomes = grade.grade(submissions, out / "grades", progress=False)
    return [s for o in outcomes for s in o.scores], out / "grades"


def expected_scores() -> dict[str, dict[str, dict[str, float]]]:
    """assignment -> student -> grade cell -> points, from autograder/samples/expected/*.json."""
    return {p.stem: json.loads(p.read_text()) for p in sorted((SAMPLES / "expected").glob("*.json"))}
