"""The compiled kernel on a CUDA GPU: the hidden checks in the GPU's dtype, bf16/fp16/fp32 at their
tolerances, FP32 against TF32, long sequences, and the benchmark helpers."""

import pytest
import torch

from flashcourse.checks import core as ac
from flashcourse.checks import triton_flash as kc

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton kernels)")]

HIDDEN = ["test_validation", "test_prefill", "test_offset", "test_query_offset", "test_gqa", "test_block_skipping",
          "test_window", "test_window_skipping"]


@pytest.fixture(scope="module")
def flash_attention():
    from flashcourse.engine.triton_flash import flash_attention

    return flash_attention


@pytest.mark.parametrize("name", HIDDEN)
def test_hidden_checks_compiled(flash_attention, name):
    """Every hidden check of the assignment passes on the GPU, in the runtime's dtype (bf16 on an H200)."""
    from autograder.hidden import triton_flash as hidden

    getattr(hidden, name)(flash_attention)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [64, 128])
def test_dtypes(flash_attention, dtype, d):
    """Prefill, chunked prefill, decode and GQA in each dtype, at that dtype's tolerance (FP32 at 1e-4)."""
    cases = [c.with_kwargs(block_m=64, block_n=64) for c in ac.standard_cases(dtype, "cuda", d=d)]
    kc.check_cases(flash_attention, cases)


@pytest.mark.parametrize("block_m, block_n, num_warps, num_stages",
                         [(32, 32, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3)])
def test_long_sequence_configs(flash_attention, block_m, block_n, num_warps, num_stages):
    """T = 2000 (not a multiple of any block), GQA 4, bf16, with the benchmark's launch configurations."""
    c = kc.case("long", batch=2, q_heads=8, kv_heads=2, t=2000, d=128, dtype=torch.bfloat16, device="cuda",
                block_m=block_m, block_n=block_n)
    kc.check_cases(flash_attention, [c.with_kwargs(num_warps=num_warps, num_stages=num_stages)])


def test_window_long(flash_attention):
    """A 256-key window over 3000 keys, with the keys before every window set to NaN for decode."""
    cases = [kc.case("window", batch=1, q_heads=4, kv_heads=1, t=3000, d=64, window=256, dtype=torch.bfloat16,
                     device="cuda", block_m=64, block_n=64),
             kc.case("window decode", batch=2, q_heads=4, kv_heads=2, t=1, s=3000, d=128, window=256,
                     dtype=torch.bfloat16, device="cuda", block_m=16, block_n=64)]
    kc.check_window(flash_attention, cases[:1])
    kc.check_block_skipping(flash_attention, cases[1:])


def test_tf32_breaks_the_fp32_tolerance(flash_attention):
    """FP32 inputs: "ieee" meets 1e-4; TF32 tensor cores (10-bit mantissa) do not."""
    from flashcourse import bench

    result = bench.tf32_errors()["errors"]
    assert result["ieee"]["passes"], result
    assert not result["tf32"]["passes"], result
    assert result["tf32"]["max_error"] > 10 * result["ieee"]["max_error"], result


def test_sweep_runs(flash_attention):
    """The notebook's benchmark helper measures all three methods and flash uses far less memory."""
    from flashcourse import bench

    rows = bench.sweep(lengths=(1024, 2048))
    assert len(rows) == 6
    flash = [r for r in rows if r["method"].startswith("flash")][-1]
    unfused = [r for r in rows if "unfused" in r["method"]][-1]
    assert flash["peak_mib"] < unfused["peak_mib"] / 10, rows
