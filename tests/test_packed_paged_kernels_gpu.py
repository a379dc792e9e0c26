"""The packed variable-length and paged-KV-cache kernels compiled on a CUDA GPU: bf16 and fp16, lengths up to a few
thousand, D = 64 and 128, pages of 16, 64 and 256 keys, against FP32 references one sequence at a time."""

import pytest
import torch

from conftest import assert_graph_replays_eager
from test_packed_paged_kernels import sequence_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton kernels)")]


def packed(lengths_q, lengths_k, q_heads, kv_heads, d, dtype, seed=0):
    """q [total_q, Hq, D], k and v [total_k, Hkv, D] on the GPU, seeded; cu_seqlens_q and cu_seqlens_k int32."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(lengths_q), q_heads, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(sum(lengths_k), kv_heads, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(sum(lengths_k), kv_heads, d, device="cuda", dtype=dtype, generator=gen)
    cu = [torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32) for lengths in (lengths_q, lengths_k)]
    return q, k, v, *cu


def rows(lengths):
    """Each sequence's slice of the packed rows."""
    start = 0
    for n in lengths:
        yield slice(start, start + n)
        start += n


# (query lengths, key lengths): no block divides them; 0 and 1; a prefix cache (more keys); more queries than keys.
LONG = ([1, 777, 3001, 0, 2048, 129, 300], [1, 777, 3001, 5, 2548, 1129, 100])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d, causal", [(128, True), (64, True), (128, False)])
def test_varlen_long(dtype, d, causal):
    """GQA 8/2: o within 2e-2 of FP32 and lse within 1e-2 (finite rows), sequence by sequence; rows that see no
    key (len_q > len_k, causal) give o = 0 and lse = -inf."""
    from flashcourse.engine.packed_paged import varlen_attention

    q, k, v, cu_q, cu_k = packed(*LONG, 8, 2, d, dtype)
    o, lse = varlen_attention(q, k, v, cu_q, cu_k, causal=causal)
    assert o.dtype == dtype and lse.dtype == torch.float32 and not o.isnan().any() and not lse.isnan().any()
    for b, (qs, ks) in enumerate(zip(rows(LONG[0]), rows(LONG[1]))):
        want_o, want_lse = sequence_attention(q[qs].float(), k[ks].float(), v[ks].float(), causal)
        error = (o[qs].float() - want_o).abs().max() if qs.stop > qs.start else 0.0
        assert error < 2e-2, f"sequence {b}: max |o - FP32| = {error:.2e}"
        assert torch.equal(torch.isinf(lse[:, qs]), torch.isinf(want_lse)), f"sequence {b}: rows with no key differ"
        seen = torch.isfinite(want_lse)
        if seen.any():
            assert (lse[:, qs][seen] - want_lse[seen]).abs().max() < 1e-2, f"sequence {b}: lse off"


def test_varlen_train_gradients():
    """bf16, GQA 8/2, D = 128: dq, dk, dv within 2 % of FP32 autograd's largest gradient; sequences with no query,
    no key, and more queries than keys (causal rows with no key)."""
    from flashcourse.engine.packed_paged import varlen_attention_train

    lengths_q, lengths_k = [300, 0, 1000, 77, 200], [300, 5, 1200, 0, 150]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, 8, 2, 128, torch.bfloat16, seed=1)
    do = torch.randn_like(q)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    varlen_attention_train(*leaves, cu_q, cu_k).backward(do)
    ref = [x.float().requires_grad_() for x in (q, k, v)]
    want = torch.zeros(q.shape, device="cuda")
    for qs, ks in zip(rows(lengths_q), rows(lengths_k)):
        want = want.index_copy(0, torch.arange(qs.start, qs.stop, device="cuda"),
                               sequence_attention(ref[0][qs], ref[1][ks], ref[2][ks], True)[0])
    want.backward(do.float())
    for name, got, exact in zip(("dq", "dk", "dv"), leaves, ref):
        error = float((got.grad.float() - exact.grad).abs().max() / exact.grad.abs().max())
        assert error < 2e-2, f"{name}: max |error| / max |gradient| = {error:.2e}"


def paged_from(keys, values, page_size, seed=0):
    """Sequences' keys and values [L, Hkv, D] written into a shuffled pool [num_pages, page_size, Hkv, D] (unfilled
    slots NaN): (k_cache, v_cache, block_table int32 [B, max_pages], cache_seqlens int32 [B])."""
    lengths = [k.shape[0] for k in keys]
    needed = [-(-n // page_size) for n in lengths]
    kv_heads, d = keys[0].shape[1:]
    num_pages = sum(needed) + 1
    physical = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).cuda()
    caches = [torch.full((num_pages, page_size, kv_heads, d), float("nan"), device="cuda", dtype=keys[0].dtype)
              for _ in range(2)]
    table = torch.zeros(len(lengths), max(needed) + 1, device="cuda", dtype=torch.int32)
    start = 0
    for b, n in enumerate(lengths):
        pages = physical[start:start + needed[b]]
        start += needed[b]
        table[b, :needed[b]] = pages.to(torch.int32)
        for cache, x in zip(caches, (keys[b], values[b])):
            padded = torch.full((needed[b] * page_size, kv_heads, d), float("nan"), device="cuda", dtype=x.dtype)
            padded[:n] = x
            cache[pages] = padded.view(needed[b], page_size, kv_heads, d)
    return *caches, table, torch.tensor(lengths, device="cuda", dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size, d", [(16, 128), (64, 128), (256, 128), (64, 64)])
def test_paged_decode_long(dtype, page_size, d):
    """Hq = 32, Hkv = 8, lengths 0 to 8192 (partial last pages), shuffled pages: o within 1e-2 of FP32 with the
    default splits and with 7; o = 0 for the empty sequence."""
    from flashcourse.engine.packed_paged import paged_decode

    lengths = [1, 4097, 0, 2500, 3000, 16, 8192]
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(len(lengths), 32, d, device="cuda", dtype=dtype, generator=gen)
    keys = [torch.randn(n, 8, d, device="cuda", dtype=dtype, generator=gen) for n in lengths]
    values = [torch.randn(n, 8, d, device="cuda", dtype=dtype, generator=gen) for n in lengths]
    k_cache, v_cache, table, seqlens = paged_from(keys, values, page_size)
    for splits in (None, 7):
        o = paged_decode(q, k_cache, v_cache, table, seqlens, splits=splits)
        assert o.dtype == dtype and not o.isnan().any(), f"splits={splits}: NaN in o"
        for b, n in enumerate(lengths):
            if n == 0:
                assert (o[b] == 0).all(), "the empty sequence must give o = 0"
                continue
            want = sequence_attention(q[b:b + 1].float(), keys[b].float(), values[b].float(), False)[0][0]
            error = (o[b].float() - want).abs().max()
            assert error < 1e-2, f"splits={splits}, sequence {b} (S = {n}): max |o - FP32| = {error:.2e}"


def test_paged_decode_in_a_cuda_graph():
    """Two paged decodes captured in one CUDA graph: every replay writes exactly the eager outputs."""
    from flashcourse.engine.packed_paged import paged_decode

    gen = torch.Generator(device="cuda").manual_seed(4)
    calls = []
    for lengths in ([8191, 3, 1000], [0, 5000, 64]):
        q = torch.randn(len(lengths), 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        keys = [torch.randn(n, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for n in lengths]
        values = [torch.randn(n, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for n in lengths]
        calls.append((q, *paged_from(keys, values, 16)))
    assert_graph_replays_eager(paged_decode, calls, replays=5)


def test_float32_head_dimension_128():
    """FP32 inputs at D = 128 (smaller tiles, so that they fit in shared memory): varlen_attention within 1e-4 of
    the FP32 reference (true FP32 products), paged_decode within 5e-3 (tl.dot takes FP32 as TF32)."""
    from flashcourse.engine.packed_paged import paged_decode, varlen_attention

    lengths = [300, 1, 77]
    q, k, v, cu_q, cu_k = packed(lengths, lengths, 4, 2, 128, torch.float32)
    o, _ = varlen_attention(q, k, v, cu_q, cu_k)
    for qs in rows(lengths):
        error = (o[qs] - sequence_attention(q[qs], k[qs], v[qs], True)[0]).abs().max()
        assert error < 1e-4, f"varlen, sequence {qs}: max |o - FP32| = {error:.2e}"
    keys, values = [k[qs] for qs in rows(lengths)], [v[qs] for qs in rows(lengths)]
    queries = q[[n - 1 for n in torch.tensor(lengths).cumsum(0).tolist()]]          # each sequence's last query
    o = paged_decode(queries, *paged_from(keys, values, 16))
    for b in range(len(lengths)):
        want = sequence_attention(queries[b:b + 1], keys[b], values[b], False)[0][0]
        error = (o[b] - want).abs().max()
        assert error < 5e-3, f"paged, sequence {b}: max |o - FP32| = {error:.2e}"
