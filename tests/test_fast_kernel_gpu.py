"""The compiled fast kernels on a CUDA GPU: every hidden check of 05 and of 04, long shapes in bf16 and
fp16 against an FP32 reference, and split-KV decode at long S."""

import pytest
import torch

from conftest import assert_graph_replays_eager
from flashcourse.engine.decode import decode_tickets, fast_decode, fused_decode, short_cache_splits
from flashcourse.engine.fast_attention import fast_attention
from flashcourse.engine.fast_lse import fast_attention_lse

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton kernels)")]

HIDDEN = ["test_prefill", "test_diagonal_split", "test_window_and_skipping", "test_decode"]


def test_hidden_validation():
    """ValueErrors on the GPU, k and v on another device included."""
    from autograder.hidden import fast_kernel as hidden

    hidden.test_validation(fast_attention, fast_decode)


@pytest.mark.parametrize("name", HIDDEN)
def test_hidden_checks_compiled(name):
    """Every hidden check of 05 passes on the GPU, in the runtime's dtype (bf16 on an H200)."""
    from autograder.hidden import fast_kernel as hidden

    fn = fast_decode if name == "test_decode" else fast_attention
    getattr(hidden, name)(fn)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_long_autotuned(dtype, causal):
    """T = S = 3001 (no block divides it), GQA 4, D = 128, autotuned: error against FP32 within 2e-2."""
    from flashcourse.bench.fast import _inputs, max_error

    q, k, v = _inputs(2, 8, 2, 3001, 3001, 128, dtype)
    assert max_error(fast_attention(q, k, v, causal=causal), q, k, v, causal) < 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d, causal, window", [(128, True, None), (64, True, 300), (128, False, None)])
def test_descriptors_and_pointers(dtype, d, causal, window):
    """T = 1000 over S = 1777 (GQA 4): K and V through TMA descriptors and through pointers, both near FP32."""
    from flashcourse.checks import reference
    from flashcourse.bench.fast import _inputs

    q, k, v = _inputs(1, 8, 2, 1000, 1777, d, dtype)
    want = reference.attention(q.cpu(), k.cpu(), v.cpu(), causal=causal, window=window)
    for tma in (True, False):
        got = fast_attention(q, k, v, causal=causal, window=window, tma=tma).cpu().double()
        assert (got - want).abs().max() < 2e-2, f"tma={tma}: max |error| {(got - want).abs().max():.2e}"


@pytest.mark.parametrize("batch, s", [(1, 32768), (8, 8191), (3, 131072)])
def test_long_decode(batch, s):
    """fast_decode at long S, Hq = 32, Hkv = 8, default splits: error against FP32 within 1e-2."""
    from flashcourse.bench.fast import _inputs, max_error

    q, k, v = _inputs(batch, 32, 8, 1, s, 128, torch.bfloat16)
    assert max_error(fast_decode(q, k, v), q, k, v, False) < 1e-2


@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_decode_every_head_dimension(d):
    """fast_decode at D = 16 to 256 (flash-attn takes up to 256): the split kernel's tiles fit in shared memory."""
    from flashcourse.bench.fast import _inputs, max_error

    q, k, v = _inputs(2, 8, 2, 1, 4099, d, torch.bfloat16)
    assert max_error(fast_decode(q, k, v), q, k, v, False) < 1e-2


@pytest.mark.parametrize("causal, offset", [(True, None), (False, None), (True, -100)])
def test_fast_attention_lse_long(causal, offset):
    """T = 2000 over S = 3001 (GQA 4, D = 128, bf16, autotuned): o within 2e-2 of FP32, lse (FP32, natural log)
    within 1e-2 of 06's flash_attention_lse; with offset -100 the first 100 rows see no key: o = 0, lse = -inf."""
    from flashcourse.bench.fast import _inputs
    from flashcourse.engine.backward import flash_attention_lse

    q, k, v = _inputs(2, 8, 2, 2000, 3001, 128, torch.bfloat16)
    o, lse = fast_attention_lse(q, k, v, query_offset=offset, causal=causal)
    want_o, want_lse = flash_attention_lse(q, k, v, query_offset=offset, causal=causal)
    assert lse.dtype == torch.float32 and lse.shape == (2, 8, 2000)
    assert (o.float() - want_o.float()).abs().max() < 2e-2
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    seen = torch.isfinite(want_lse)
    assert (lse[seen] - want_lse[seen]).abs().max() < 1e-2
    if offset is not None:
        assert torch.isinf(lse[:, :, :100]).all() and (o[:, :, :100] == 0).all()


@pytest.mark.parametrize("batch, s", [(1, 1000), (1, 2048), (8, 1024)])
def test_short_cache_decode(batch, s):
    """fast_decode with short_cache_splits at short S (Hq = 32, Hkv = 8): one wave of splits of at least one tile,
    error against FP32 within 1e-2."""
    from flashcourse.bench.fast import _inputs, max_error

    q, k, v = _inputs(batch, 32, 8, 1, s, 128, torch.bfloat16)
    splits = short_cache_splits(batch, 8, s, "cuda")
    assert splits == min(torch.cuda.get_device_properties(0).multi_processor_count // (batch * 8), -(-s // 128))
    assert max_error(fast_decode(q, k, v, splits=splits), q, k, v, False) < 1e-2


@pytest.mark.parametrize("batch, s", [(1, 1000), (1, 8192), (8, 8191), (3, 131072)])
def test_fused_decode(batch, s):
    """fused_decode at Hq = 32, Hkv = 8, with short_cache_splits and with 64 splits: error against FP32 within 1e-2,
    and every counter back at 0 after each call."""
    from flashcourse.bench.fast import _inputs, max_error

    q, k, v = _inputs(batch, 32, 8, 1, s, 128, torch.bfloat16)
    for splits in (None, 64):
        assert max_error(fused_decode(q, k, v, splits=splits), q, k, v, False) < 1e-2, f"splits={splits}"
        assert not decode_tickets("cuda", batch * 8).any(), f"splits={splits}: a counter was left non-zero"


def test_fused_decode_replayed_in_a_cuda_graph():
    """Four fused calls on four caches in one CUDA graph, replayed 50 times: every replay writes exactly the eager
    outputs (the merge is the same arithmetic whichever program draws the last ticket), the counters end at 0."""
    from flashcourse.bench.fast import _inputs

    caches = [_inputs(1, 32, 8, 1, 8192, 128, torch.bfloat16, seed=i) for i in range(4)]
    assert_graph_replays_eager(fused_decode, caches, replays=50)
    assert not decode_tickets("cuda", 8).any()
