"""07's ring on GPUs: NCCL between 2 processes, one GPU each, against the float64 reference (float32 at
1e-4, bf16 at 2e-2), both layouts, causal or not, GQA, T = 301 (not a multiple of 2P)."""


import pytest
import torch

from flashcourse import attention_checks as ac
from flashcourse import distributed, reference
from flashcourse import ring_checks as rc

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2,
                                 reason=f"needs 2 CUDA GPUs for NCCL, found {torch.cuda.device_count()}")]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
COMBINATIONS = [(d, layout, causal) for d in DTYPES for layout in rc.LAYOUTS for causal in (True, False)]


def _case(dtype_name: str):
    return ac.make_case("GQA 8 : 2, T = 301", batch=2, q_heads=8, kv_heads=2, t=301, d=64, seed=31,
                        dtype=DTYPES[dtype_name])


def _every_ring_on_gpu(rank, world_size):
    """On one rank: ring_attention on its GPU for every combination; the output shards on the CPU."""
    from flashcourse.engine.ring_attention import ring_attention

    outputs = {}
    for dtype_name, layout, causal in COMBINATIONS:
        case = _case(dtype_name)
        q, k, v = (rc.shard(x, rank, world_size, layout).cuda() for x in (case.q, case.k, case.v))
        outputs[dtype_name, layout, causal] = ring_attention(q, k, v, causal=causal, layout=layout).cpu()
    return outputs


@pytest.fixture(scope="module")
def ring_outputs():
    """Every combination's output shards from one NCCL group of 2 processes (starting one costs seconds)."""
    return distributed.run(_every_ring_on_gpu, 2, backend="nccl", timeout_s=300)


@pytest.mark.parametrize("dtype_name, layout, causal", COMBINATIONS)
def test_ring_attention_nccl_two_gpus(ring_outputs, dtype_name, layout, causal):
    """The exported ring_attention on 2 GPUs over NCCL equals the reference at the dtype's tolerance."""
    case = _case(dtype_name)
    shards = [answer[dtype_name, layout, causal] for answer in ring_outputs]
    assert all(s.dtype == DTYPES[dtype_name] for s in shards)
    rtol, atol = ac.tolerance(DTYPES[dtype_name])
    torch.testing.assert_close(rc.unshard(shards, layout).double(),
                               reference.attention(case.q, case.k, case.v, causal=causal), rtol=rtol, atol=atol)
