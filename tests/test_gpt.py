"""The small GPT of 06 in miniature on a CPU: trained with SDPA and with the course's kernels (Triton's
interpreter), from one seed, the two loss curves agree."""

import math

import pytest
import torch

from flashcourse import runtime
from instructor import gpt

pytestmark = pytest.mark.skipif(not runtime.current().interpret, reason="the CPU miniature; the GPU run is measured")


def test_corpus_ships_with_the_package():
    """The training text is flashcourse's own source, read through importlib.resources."""
    data = gpt.corpus()
    assert data.dtype == torch.uint8 and len(data) > 100_000
    assert b"def tile_update(" in bytes(data.tolist())  # the engine of 01 is part of it


def test_same_seed_same_curve():
    """Two runs with the same attention and seed give the same losses; another seed does not."""
    run = lambda seed: gpt.train(gpt.sdpa_attention, 2, gpt.CPU_CONFIG, batch=2, seed=seed)  # noqa: E731
    assert run(0) == run(0)
    assert run(0) != run(1)


def test_flash_and_sdpa_curves_agree():
    """Four steps, one layer: the course's kernels and SDPA give losses within 1e-4 of each other (float32)."""
    result = gpt.train_both()
    assert result["steps"] == 4 and len(result["sdpa"]) == len(result["flash_attention_train"]) == 4
    assert result["max_difference"] < 1e-4, result


def test_an_untrained_model_predicts_bytes_about_uniformly():
    """Step 0's loss over 64 sequences is within 0.1 of log 256 for any seed (a batch of 2 is too small a sample:
    its loss moves by tenths with the text of the corpus)."""
    for seed in (0, 1):
        first = gpt.train(gpt.sdpa_attention, 1, gpt.CPU_CONFIG, batch=64, seed=seed)[0]
        assert abs(first - math.log(256)) < 0.1, f"seed {seed}: step 0's loss {first:.3f}, log 256 = 5.545"


def test_seed_spread_reports_the_gap_beside_the_seeds_own_spread():
    """seed_spread trains both attentions from each seed and reports, over the flat part of the curves, the gap
    at each seed and how far SDPA's own loss moves from seed to seed."""
    spread = gpt.seed_spread(2, steps=5, after=0.4)
    assert spread["from_step"] == 2 and len(spread["gap_per_seed"]) == 2
    for gap, curves in zip(spread["gap_per_seed"], spread["curves"]):
        tail = lambda c: sum(c[2:]) / 3  # noqa: E731
        assert math.isclose(gap, tail(curves["flash_attention_train"]) - tail(curves["sdpa"]), rel_tol=1e-9)
    assert spread["sdpa_seed_range"] > 0  # two seeds: other weights, other batches
    assert len(spread["torch_kernels_gap_per_seed"]) == 2 and len(spread["curves"][0]["sdpa_efficient"]) == 5
