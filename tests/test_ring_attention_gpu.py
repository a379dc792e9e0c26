"""07's ring on GPUs: NCCL between 2 processes, one GPU each, each step on the course's Triton kernel (06's
flash_attention_lse, one call per pair of position runs). Against the float64 reference (float32 at 1e-4,
bf16 at 2e-2), both layouts, causal or not, GQA, T = 301 (not a multiple of 2P); the kernel step against the
PyTorch step on the same shards; and a longer bf16 ring against the same kernel on one GPU."""


import pytest
import torch

from flashcourse.checks import core as ac
from flashcourse import distributed
from flashcourse.checks import reference
from flashcourse.checks import ring_attention as rc

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2,
                                 reason=f"needs 2 CUDA GPUs for NCCL, found {torch.cuda.device_count()}")]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
COMBINATIONS = [(d, layout, causal) for d in DTYPES for layout in rc.LAYOUTS for causal in (True, False)]
LONG = dict(batch=1, q_heads=8, kv_heads=2, t=4099, d=128, seed=32)      # shards of 1025 and 1024 tokens


def _case(dtype_name: str):
    return ac.make_case("GQA 8 : 2, T = 301", batch=2, q_heads=8, kv_heads=2, t=301, d=64, seed=31,
                        dtype=DTYPES[dtype_name])


def _every_ring_on_gpu(rank, world_size):
    """On one rank: ring_attention on its GPU for every combination, and the long bf16 case in both layouts;
    the output shards on the CPU."""
    from flashcourse.engine.ring_attention import ring_attention

    outputs = {}
    for dtype_name, layout, causal in COMBINATIONS:
        case = _case(dtype_name)
        q, k, v = (rc.shard(x, rank, world_size, layout).cuda() for x in (case.q, case.k, case.v))
        outputs[dtype_name, layout, causal] = ring_attention(q, k, v, causal=causal, layout=layout).cpu()
    long = ac.make_case("long", dtype=torch.bfloat16, **LONG)
    for layout in rc.LAYOUTS:
        q, k, v = (rc.shard(x, rank, world_size, layout).cuda() for x in (long.q, long.k, long.v))
        outputs["long", layout] = ring_attention(q, k, v, layout=layout).cpu()
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


@pytest.mark.parametrize("layout", rc.LAYOUTS)
def test_long_ring_equals_the_kernel_on_one_gpu(ring_outputs, layout):
    """bf16, T = 4099, D = 128: the ring on 2 GPUs, unsharded, equals 06's kernel over the whole sequence on one
    GPU to bf16 rounding (both round their outputs to bf16 once; the ring merges its parts in float32)."""
    from flashcourse.engine.backward import flash_attention_lse

    long = ac.make_case("long", dtype=torch.bfloat16, **LONG)
    one_gpu, _ = flash_attention_lse(long.q.cuda(), long.k.cuda(), long.v.cuda(), causal=True)
    ring = rc.unshard([answer["long", layout] for answer in ring_outputs], layout)
    rtol, atol = ac.tolerance(torch.bfloat16)
    torch.testing.assert_close(ring.float(), one_gpu.cpu().float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("layout", rc.LAYOUTS)
def test_kernel_step_equals_the_pytorch_step(world_size, layout):
    """shard_attention on a GPU (the Triton kernel on each pair of runs) gives the (o, lse) of its PyTorch path
    on the CPU, for every pair of shards, float32, causal: runs before, overlapping and after the queries."""
    from flashcourse.engine import ring_attention as ring

    case = ac.make_case("GQA 4 : 2, T = 37", batch=2, q_heads=4, kv_heads=2, t=37, d=32, seed=33)
    for rank in range(world_size):
        for owner in range(world_size):
            qp, kp = (rc.layout_positions(37, r, world_size, layout) for r in (rank, owner))
            q = rc.shard(case.q, rank, world_size, layout)
            k, v = (rc.shard(x, owner, world_size, layout) for x in (case.k, case.v))
            o_cpu, lse_cpu = ring.shard_attention(q, k, v, qp, kp)
            o_gpu, lse_gpu = ring.shard_attention(q.cuda(), k.cuda(), v.cuda(), qp, kp)
            where = f"P = {world_size}, {layout}, queries of rank {rank}, keys of rank {owner}"
            torch.testing.assert_close(o_gpu.cpu(), o_cpu, rtol=1e-4, atol=1e-4, msg=lambda m: f"{where}: o: {m}")
            torch.testing.assert_close(lse_gpu.cpu(), lse_cpu, rtol=1e-4, atol=1e-4, msg=lambda m: f"{where}: lse: {m}")
