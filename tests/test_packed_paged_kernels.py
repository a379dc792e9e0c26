"""The engine's packed variable-length and paged-KV-cache kernels (flashcourse.engine.packed_paged) on small
shapes, float32: Triton's interpreter on a CPU (compiled on a GPU), against float64 references built here with
an explicit mask, one sequence at a time."""

import math

import pytest
import torch

from flashcourse import runtime
from flashcourse.checks import packed_paged as pp
from flashcourse.engine.packed_paged import paged_decode, varlen_attention, varlen_attention_train

RT = runtime.current()
# The varlen kernel's products are true FP32 ("ieee"); the paged kernel's tl.dot takes FP32 inputs as TF32 on a GPU.
TOL = 1e-4 if RT.interpret else 5e-3
FAR = 0.1  # what a wrong page or an unmasked slot does to o here (0.45 to 2.8 on these seeds): far past TOL


# ---------------------------------------------------------------------------------------------------------------
# References (float64)
# ---------------------------------------------------------------------------------------------------------------


def cumulative(lengths):
    """int32 [B + 1] cumulative lengths from 0 (09's checks build them), on the runtime's device."""
    return pp.cumulative(lengths).to(RT.device)


def packed_inputs(lengths_q, lengths_k, q_heads, kv_heads, d, seed=0):
    """q [total_q, Hq, D], k and v [total_k, Hkv, D], float32, seeded; cu_seqlens_q and cu_seqlens_k."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), q_heads, d, generator=gen)
    k = torch.randn(sum(lengths_k), kv_heads, d, generator=gen)
    v = torch.randn(sum(lengths_k), kv_heads, d, generator=gen)
    return [x.to(RT.device) for x in (q, k, v)] + [cumulative(lengths_q), cumulative(lengths_k)]


def sequence_attention(q, k, v, causal):
    """One sequence, in q's dtype (float64 here): q [T, Hq, D], k and v [S, Hkv, D] -> (o [T, Hq, D], lse [Hq, T]).

    Causal: query i at position S - T + i sees key j <= that position. A row that sees no key gets o = 0 and
    lse = -inf; it is kept out of the softmax, so that autograd through it gives zeros, not NaN."""
    t, q_heads, d = q.shape
    s, kv_heads = k.shape[0], k.shape[1]
    group = q_heads // kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)            # [S, Hq, D]
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d)                    # [Hq, T, S]
    visible = torch.ones(t, s, dtype=torch.bool, device=q.device)
    if causal:
        visible = torch.arange(s, device=q.device)[None, :] <= (s - t + torch.arange(t, device=q.device))[:, None]
    seen = visible.any(-1)                                                         # [T]
    scores = scores.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, -1) if s else torch.full((q_heads, t), -math.inf, dtype=q.dtype, device=q.device)
    p = torch.softmax(torch.where(seen[:, None], scores, torch.zeros_like(scores)), -1)   # rows with no key: finite
    p = torch.where(seen[:, None], p, torch.zeros_like(p))
    return torch.einsum("hts,shd->thd", p, v), lse


def varlen_reference(q, k, v, lengths_q, lengths_k, causal):
    """varlen_attention's (o [total_q, Hq, D], lse [Hq, total_q]) one sequence at a time, in q's dtype."""
    outs, lses = [], []
    cq, ck = [0], [0]
    for lq, lk in zip(lengths_q, lengths_k):
        cq.append(cq[-1] + lq)
        ck.append(ck[-1] + lk)
        o, lse = sequence_attention(q[cq[-2]:cq[-1]], k[ck[-2]:ck[-1]], v[ck[-2]:ck[-1]], causal)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, 1)


# ---------------------------------------------------------------------------------------------------------------
# varlen_attention
# ---------------------------------------------------------------------------------------------------------------

# (name, query lengths, key lengths): lengths 0 and 1, len_q > len_k (causal rows before key 0), len_q < len_k,
# lengths over several 16-row blocks (the diagonal split, the causal stop) and a sequence with no key at all.
VARLEN_CASES = [
    ("mixed", [5, 0, 17, 3, 33], [9, 4, 17, 1, 33]),
    ("one token", [1, 1, 1], [1, 40, 7]),
    ("more queries than keys", [20, 37], [3, 16]),
    ("prefix cache", [16, 7, 2], [48, 50, 31]),
    ("no keys", [4, 6, 0], [0, 6, 0]),
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("q_heads, kv_heads", [(4, 2), (4, 1), (2, 2)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("name, lengths_q, lengths_k", VARLEN_CASES, ids=[c[0] for c in VARLEN_CASES])
def test_varlen_matches_reference(name, lengths_q, lengths_k, q_heads, kv_heads, causal):
    """o and lse against the float64 reference, sequence by sequence; rows that see no key: o = 0, lse = -inf."""
    q, k, v, cu_q, cu_k = packed_inputs(lengths_q, lengths_k, q_heads, kv_heads, 16)
    o, lse = varlen_attention(q, k, v, cu_q, cu_k, causal=causal)
    want_o, want_lse = varlen_reference(q.cpu().double(), k.cpu().double(), v.cpu().double(), lengths_q, lengths_k,
                                        causal)
    assert o.shape == q.shape and o.dtype == q.dtype, f"o: {o.dtype} {list(o.shape)}, want like q {list(q.shape)}"
    assert lse.shape == (q_heads, q.shape[0]) and lse.dtype == torch.float32, f"lse: {lse.dtype} {list(lse.shape)}"
    o, lse = o.cpu().double(), lse.cpu().double()
    assert not o.isnan().any() and not lse.isnan().any(), "NaN in o or lse"
    unseen = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(lse), unseen), f"lse = -inf at {torch.isinf(lse).nonzero().tolist()}, " \
                                                  f"want at {unseen.nonzero().tolist()}"
    assert (o[unseen.T] == 0).all(), "a row that sees no key must give o = 0"
    assert (o - want_o).abs().max() < TOL, f"max |o - reference| = {(o - want_o).abs().max():.2e}"
    assert (lse[~unseen] - want_lse[~unseen]).abs().max() < TOL, \
        f"max |lse - reference| = {(lse[~unseen] - want_lse[~unseen]).abs().max():.2e}"


def test_varlen_max_seqlen_given():
    """max_seqlen_q given (no device sync) gives the same result as computed from cu_seqlens_q."""
    lengths_q, lengths_k = [5, 0, 33], [9, 4, 40]
    q, k, v, cu_q, cu_k = packed_inputs(lengths_q, lengths_k, 4, 2, 32)
    o, lse = varlen_attention(q, k, v, cu_q, cu_k)
    o2, lse2 = varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=33)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


def test_varlen_all_empty():
    """Every sequence of length 0: empty o and lse, no launch."""
    q, k, v, cu_q, cu_k = packed_inputs([0, 0], [0, 0], 2, 2, 16)
    o, lse = varlen_attention(q, k, v, cu_q, cu_k)
    assert o.shape == (0, 2, 16) and lse.shape == (2, 0)


def test_varlen_errors():
    """ValueErrors that say what is wrong."""
    q, k, v, cu_q, cu_k = packed_inputs([3, 4], [3, 4], 4, 2, 16)
    with pytest.raises(ValueError, match="power of two"):
        varlen_attention(q[..., :12].contiguous(), k[..., :12].contiguous(), v[..., :12].contiguous(), cu_q, cu_k)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        varlen_attention(q[:, :3].contiguous(), k, v, cu_q, cu_k)
    with pytest.raises(ValueError, match="int32"):
        varlen_attention(q, k, v, cu_q.long(), cu_k)
    with pytest.raises(ValueError, match="end at the 7 packed rows"):
        varlen_attention(q, k, v, cumulative([3, 3]), cu_k)
    with pytest.raises(ValueError, match="same B sequences"):
        varlen_attention(q, k, v, cumulative([3, 4, 0]), cu_k)
    with pytest.raises(ValueError, match=r"q \[total_q, Hq, D\]"):
        varlen_attention(q[None], k, v, cu_q, cu_k)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_varlen_train_gradients(causal):
    """dq, dk, dv of varlen_attention_train against float64 autograd of the reference: GQA 4/2, a sequence with
    more queries than keys (rows with no key, causal), one with no queries, one with no keys, one over several
    blocks."""
    lengths_q, lengths_k = [7, 0, 5, 3, 40], [7, 6, 2, 0, 45]
    q, k, v, cu_q, cu_k = packed_inputs(lengths_q, lengths_k, 4, 2, 16, seed=1)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(RT.device)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = varlen_attention_train(*leaves, cu_q, cu_k, causal=causal)
    o.backward(do)
    ref_leaves = [x.detach().cpu().double().requires_grad_() for x in (q, k, v)]
    want_o, _ = varlen_reference(*ref_leaves, lengths_q, lengths_k, causal)
    want_o.backward(do.cpu().double())
    assert (o.detach().cpu().double() - want_o.detach()).abs().max() < TOL
    for name, got, want in zip(("dq", "dk", "dv"), leaves, ref_leaves):
        assert got.grad is not None and got.grad.shape == want.shape, f"{name}: no gradient or wrong shape"
        error = (got.grad.cpu().double() - want.grad).abs().max()
        assert not got.grad.isnan().any() and error < 10 * TOL, f"{name}: max |error| = {error:.2e}"


# ---------------------------------------------------------------------------------------------------------------
# paged_decode
# ---------------------------------------------------------------------------------------------------------------


def paged_inputs(lengths, q_heads, kv_heads, d, page_size, fill=float("nan"), seed=0):
    """q [B, Hq, D]; each sequence's keys and values [L, Hkv, D] (contiguous, the reference's); the same keys in a
    shuffled page pool k_cache, v_cache [num_pages, page_size, Hkv, D] (random permutation of the pages, three
    spare pages, one table column more than needed, every unfilled slot set to `fill`), the block table int32
    [B, max_pages] and cache_seqlens int32 [B]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(lengths), q_heads, d, generator=gen)
    keys = [torch.randn(n, kv_heads, d, generator=gen) for n in lengths]
    values = [torch.randn(n, kv_heads, d, generator=gen) for n in lengths]
    needed = [-(-n // page_size) for n in lengths]
    max_pages = max(needed) + 1
    num_pages = sum(needed) + 3
    physical = torch.randperm(num_pages, generator=gen)
    k_cache = torch.full((num_pages, page_size, kv_heads, d), fill)
    v_cache = torch.full((num_pages, page_size, kv_heads, d), fill)
    table = torch.randint(0, num_pages, (len(lengths), max_pages), generator=gen)   # unused entries: any page
    used = 0
    for b, n in enumerate(lengths):
        for j in range(needed[b]):
            page = physical[used]
            used += 1
            table[b, j] = page
            rows = slice(j * page_size, min((j + 1) * page_size, n))
            k_cache[page, :rows.stop - rows.start] = keys[b][rows]
            v_cache[page, :rows.stop - rows.start] = values[b][rows]
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    device = [x.to(RT.device) for x in (q, k_cache, v_cache, table.to(torch.int32), seqlens)]
    return device, keys, values


def decode_reference(q, keys, values):
    """o [B, Hq, D] float64: each sequence's one query over all its keys; o = 0 for a sequence with none."""
    outs = []
    for b, (k, v) in enumerate(zip(keys, values)):
        if k.shape[0] == 0:
            outs.append(torch.zeros(q.shape[1:], dtype=torch.float64))
            continue
        o, _ = sequence_attention(q[b:b + 1].cpu().double(), k.double(), v.double(), causal=False)
        outs.append(o[0])
    return torch.stack(outs)


PAGED_CASES = [  # (lengths, Hq, Hkv, page_size, splits); on a CPU, tiles of 32 keys (paged_launch)
    ([37, 0, 16, 70, 1], 4, 2, 16, None),     # GQA, an empty sequence, a full last page, partial last pages; each
                                              # tile reads two pages of 16
    ([37, 0, 16, 70, 1], 4, 2, 16, 3),        # three splits: chunks of 32 keys, some of them empty
    ([100, 33], 8, 1, 32, 4),                 # MQA, pages of 32 keys: one page per tile
    ([5, 64, 65], 2, 2, 64, 2),               # MHA, one and two pages of 64: two tiles per page
]


@pytest.mark.parametrize("lengths, q_heads, kv_heads, page_size, splits", PAGED_CASES)
def test_paged_decode_matches_reference(lengths, q_heads, kv_heads, page_size, splits):
    """paged_decode over shuffled pages (unfilled slots NaN, never read) against the float64 reference of each
    sequence's contiguous keys; o = 0 for an empty sequence."""
    (q, k_cache, v_cache, table, seqlens), keys, values = paged_inputs(lengths, q_heads, kv_heads, 16, page_size)
    o = paged_decode(q, k_cache, v_cache, table, seqlens, splits=splits)
    assert o.shape == q.shape and o.dtype == q.dtype, f"o: {o.dtype} {list(o.shape)}, want like q {list(q.shape)}"
    assert not o.isnan().any(), "NaN in o: an unfilled slot (or an empty sequence) was read"
    error = (o.cpu().double() - decode_reference(q, keys, values)).abs().max()
    assert error < TOL, f"max |o - reference| = {error:.2e}"
    for b, n in enumerate(lengths):
        if n == 0:
            assert (o[b] == 0).all(), f"sequence {b} has no key: o must be 0"


def test_paged_decode_wrong_pages_are_caught():
    """The comparison above catches a page off by one: with the table shifted by one column, or every page index
    plus one, the output is far from the reference (and from the correct kernel's)."""
    lengths = [40, 70, 33]
    (q, k_cache, v_cache, table, seqlens), keys, values = paged_inputs(lengths, 4, 2, 16, 16, fill=0.5)
    want = decode_reference(q, keys, values)
    good = paged_decode(q, k_cache, v_cache, table, seqlens).cpu().double()
    assert (good - want).abs().max() < TOL
    for name, wrong in (("shifted by one column", torch.roll(table, -1, 1)),
                        ("page index + 1", (table + 1) % k_cache.shape[0])):
        out = paged_decode(q, k_cache, v_cache, wrong.contiguous(), seqlens).cpu().double()
        for b in range(len(lengths)):
            assert (out[b] - want[b]).abs().max() > FAR, f"table {name}: sequence {b} not caught"


def test_paged_decode_partial_page_is_masked():
    """Unfilled slots of each last page hold large finite values: the kernel ignores them, while attention that
    read the whole last page (a missing mask) would be far off, so the comparison would catch it."""
    lengths = [37, 21, 50]
    (q, k_cache, v_cache, table, seqlens), keys, values = paged_inputs(lengths, 4, 2, 16, 16, fill=3.0)
    o = paged_decode(q, k_cache, v_cache, table, seqlens).cpu().double()
    want = decode_reference(q, keys, values)
    assert (o - want).abs().max() < TOL, f"max |o - reference| = {(o - want).abs().max():.2e}"
    whole_pages = [-(-n // 16) * 16 for n in lengths]
    unmasked = decode_reference(q, [torch.cat([k, torch.full((w - n, *k.shape[1:]), 3.0)]) for k, n, w in
                                    zip(keys, lengths, whole_pages)],
                                [torch.cat([v, torch.full((w - n, *v.shape[1:]), 3.0)]) for v, n, w in
                                 zip(values, lengths, whole_pages)])
    for b in range(len(lengths)):
        assert (unmasked[b] - want[b]).abs().max() > FAR, f"sequence {b}: reading the whole page goes unseen"


def test_paged_decode_errors():
    """ValueErrors that say what is wrong."""
    (q, k_cache, v_cache, table, seqlens), _, _ = paged_inputs([20, 3], 4, 2, 16, 16)
    with pytest.raises(ValueError, match="page_size"):
        paged_decode(q, k_cache[:, :12].contiguous(), v_cache[:, :12].contiguous(), table, seqlens)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode(q[..., :12].contiguous(), k_cache[..., :12].contiguous(), v_cache[..., :12].contiguous(),
                     table, seqlens)
    with pytest.raises(ValueError, match="block_table must be int32"):
        paged_decode(q, k_cache, v_cache, table.long(), seqlens)
    with pytest.raises(ValueError, match="cache_seqlens must be int32"):
        paged_decode(q, k_cache, v_cache, table, seqlens[:1])
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_decode(q[:, :3].contiguous(), k_cache, v_cache, table, seqlens)
    with pytest.raises(ValueError, match="splits must be at least 1"):
        paged_decode(q, k_cache, v_cache, table, seqlens, splits=0)
