# READY
# %% [imports] The backward pass in Triton: the forward kernel's helpers come from assignment 05
import math

import torch

from flashcourse import runtime

runtime.setup(quiet=True)  # before Triton is imported: on a CPU this turns on its interpreter

import triton  # noqa: E402  (after the runtime's choice)
import triton.language as tl  # noqa: E402

from flashcourse.engine.fast_kernel import (  # noqa: E402  (05's tile step, launch configs and checks)
    LOG2E, TensorDescriptor, _attend_tile, _check_inputs, _prefill_configs, tma_supported)


# %% [forward] The forward kernel, saving one log-sum-exp per query row
@triton.jit
def flash_fwd_lse_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,              # q [B, Hq, T, D], k and v [B, Hkv, S, D] (USE_TMA: descriptors), o like q
    lse_ptr,                                 # lse [B, Hq, T], FP32, contiguous: natural log, -inf for a row that sees no key
    stride_qb, stride_qh, stride_qt,         # q's strides over batch, head and query (D is contiguous)
    stride_kb, stride_kh, stride_ks,         # k's strides over batch, KV head and key
    stride_vb, stride_vh, stride_vs,         # v's strides over batch, KV head and key
    stride_ob, stride_oh, stride_ot,         # o's strides over batch, head and query
    T, S,                                    # number of queries and of keys
    offset,                                  # absolute position of query 0 (query i sits at offset + i)
    q_heads,                                 # Hq: splits the grid's second axis into (batch, head)
    group,                                   # Hq // Hkv: query heads sharing one KV head
    qk_scale,                                # log2(e) / sqrt(D): scores go straight to exp2
    D: tl.constexpr,                         # head dimension, a power of two >= 16
    BLOCK_M: tl.constexpr,                   # queries per program
    BLOCK_N: tl.constexpr,                   # keys per step of the loop
    CAUSAL: tl.constexpr,                    # False: every query sees every key
    USE_TMA: tl.constexpr,                   # K and V through tensor descriptors (Hopper's TMA) rather than pointers
    DOT_PRECISION: tl.constexpr = "ieee",    # FP32 inputs: "ieee" is true FP32, "tf32" rounds to 10 bits
):
    """05's fast kernel (exp2, diagonal split), which also stores L = m + log(l) for the backward pass."""
    block = tl.num_programs(0) - 1 - tl.program_id(0)   # the longest (last) query blocks first
    bh = tl.program_id(1)                                # which (batch, query head)
    b = bh // q_heads
    h = bh % q_heads
    kv_h = h // group

    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)       # [BLOCK_M] query indices
    cols = tl.arange(0, D)                               # [D]
    row_ok = rows < T
    q_pos = offset + rows                                # [BLOCK_M] absolute positions
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + rows[:, None] * stride_qt + cols[None, :],
                mask=row_ok[:, None], other=0.0)         # [BLOCK_M, D]
    kv_index = b * (q_heads // group) + kv_h            # this (batch, KV head) in k and v viewed as [B * Hkv, S, D]
    if USE_TMA:
        k_src = k_ptr
        v_src = v_ptr
    else:
        k_src = k_ptr + b * stride_kb + kv_h * stride_kh
        v_src = v_ptr + b * stride_vb + kv_h * stride_vh

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # running maximum per row, base 2 (scores times log2(e))
    l = tl.zeros((BLOCK_M,), tl.float32)                 # running sum of exp2(s - m)
    acc = tl.zeros((BLOCK_M, D), tl.float32)             # running sum of exp2(s - m) * v

    if CAUSAL:
        last_row = tl.minimum((block + 1) * BLOCK_M, T) - 1
        stop = tl.minimum(S, offset + last_row + 1)      # one past the last key the block's last query sees
        diagonal = tl.maximum(offset + block * BLOCK_M, 0)  # keys before this are visible to every row
    else:
        stop = S
        diagonal = S
    # Whole tiles below both the diagonal and S run unmasked; a partial tile (keys past S) needs the mask.
    masked_from = (tl.minimum(diagonal, tl.maximum(stop, 0)) // BLOCK_N) * BLOCK_N
    for n0 in range(0, masked_from, BLOCK_N):            # below the diagonal: no mask
        acc, l, m = _attend_tile(acc, l, m, q, k_src, v_src, kv_index, n0, q_pos, S, stride_ks, stride_vs, 0,
                                 qk_scale, D, BLOCK_N, False, CAUSAL, False, True, USE_TMA, DOT_PRECISION)
    for n0 in range(masked_from, stop, BLOCK_N):         # on the diagonal, and the last partial tile
        acc, l, m = _attend_tile(acc, l, m, q, k_src, v_src, kv_index, n0, q_pos, S, stride_ks, stride_vs, 0,
                                 qk_scale, D, BLOCK_N, True, CAUSAL, False, True, USE_TMA, DOT_PRECISION)
    seen = l > 0                                         # False for a row that sees no key (or past T)
    o = acc / tl.where(seen, l, 1.0)[:, None]            # such a row's output is 0
    lse2 = m + tl.log2(tl.where(seen, l, 1.0))          # base 2, since m is in the scores-times-log2(e) domain
    lse = tl.where(seen, lse2 * 0.6931471805599453, float("-inf"))  # natural log: times ln(2)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + rows[:, None] * stride_ot + cols[None, :],
             o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + bh * T + rows, lse, mask=row_ok)


flash_fwd_lse_tuned = triton.autotune(configs=_prefill_configs(), key=["T", "S", "D", "group", "CAUSAL"])(
    flash_fwd_lse_kernel)


def flash_attention_lse(q, k, v, query_offset=None, causal=True):
    """(o, lse): attention of q [B, Hq, T, D] over k, v [B, Hkv, S, D], and lse [B, Hq, T] in FP32 (natural log).

    Query i sits at query_offset + i (default S - T), key j at j. A query that sees no key (a negative
    offset puts it before key 0) gets o = 0 and lse = -inf.
    """
    _check_inputs(q, k, v)
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    offset = S - T if query_offset is None else int(query_offset)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)                                                       # [B, Hq, T, D]
    lse = torch.empty(B, Hq, T, device=q.device, dtype=torch.float32)             # [B, Hq, T]
    tma = tma_supported(q)
    k_arg, v_arg = k, v
    if tma:  # k and v as [B * Hkv, S, D]; each config's pre-hook gives the descriptors its BLOCK_N
        k_arg, v_arg = (TensorDescriptor.from_tensor(x.view(B * Hkv, S, D), [1, 16, D]) for x in (k, v))
    grid = lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * Hq)  # noqa: E731  (blocks from the config)
    flash_fwd_lse_tuned[grid](
        q, k_arg, v_arg, o, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        T, S, offset, Hq, Hq // Hkv, LOG2E / math.sqrt(D),
        D=D, CAUSAL=causal, USE_TMA=tma)
    return o, lse


# %% [delta] Preprocessing: Δ = rowsum(dO ∘ O), one FP32 number per query row
@triton.jit
def backward_delta_kernel(
    o_ptr, do_ptr,                           # o and do [B, Hq, T, D], contiguous
    delta_ptr,                               # delta [B, Hq, T], FP32, contiguous (the output)
    T,                                       # number of queries
    D: tl.constexpr,                         # head dimension
    BLOCK_M: tl.constexpr,                   # query rows per program
):
    """One program: BLOCK_M rows of one (batch, head). Rows past T are neither read nor written."""
    block = tl.program_id(0)
    bh = tl.program_id(1)                                # which (batch, query head)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)       # [BLOCK_M]
    cols = tl.arange(0, D)                               # [D]
    row_ok = rows < T
    offsets = bh * T * D + rows[:, None] * D + cols[None, :]
    o = tl.load(o_ptr + offsets, mask=row_ok[:, None], other=0.0).to(tl.float32)    # [BLOCK_M, D]  read M*D
    do = tl.load(do_ptr + offsets, mask=row_ok[:, None], other=0.0).to(tl.float32)  # [BLOCK_M, D]  read M*D
    tl.store(delta_ptr + bh * T + rows, tl.sum(o * do, axis=1), mask=row_ok)        # [BLOCK_M]     write M


def backward_delta(o, do, block_m=64):
    """Δ [B, Hq, T] in FP32: the row sums of dO ∘ O, for o and do [B, Hq, T, D]."""
    B, Hq, T, D = o.shape
    o, do = o.contiguous(), do.contiguous()
    delta = torch.empty(B, Hq, T, device=o.device, dtype=torch.float32)             # [B, Hq, T]
    backward_delta_kernel[(triton.cdiv(T, block_m), B * Hq)](o, do, delta, T, D=D, BLOCK_M=block_m)
    return delta


# %% [dkdv] dK and dV: one program per key block and (batch, KV head), looping over the queries that see it
@triton.jit
def _dkdv_tile(
    dk, dv,                                  # accumulators [BLOCK_N, D], FP32
    k, v,                                    # [BLOCK_N, D] the program's keys and values
    q_src, do_src, lse_src, delta_src,       # this (batch, query head)'s q and do at query 0, lse and delta at query 0
    dq_src,                                  # with ATOMIC_DQ: this (batch, query head)'s FP32 dq at query 0
    m0,                                      # first query of the tile
    keys,                                    # [BLOCK_N] key indices
    offset, T,                               # position of query 0; number of queries
    stride_qt, stride_dot,                   # q's and do's strides over queries
    qk_scale,                                # log2(e) / sqrt(D)
    sm_scale,                                # 1 / sqrt(D) (with ATOMIC_DQ: dq's factor)
    D: tl.constexpr,                         # head dimension
    BLOCK_M: tl.constexpr,                   # queries per tile
    MASKED: tl.constexpr,                    # True on the causal diagonal: hide keys after each query
    ATOMIC_DQ: tl.constexpr,                 # also add this tile's share of dq, with atomics
    DOT_PRECISION: tl.constexpr,             # tl.dot's input_precision for FP32 inputs
):
    """The queries m0 .. m0 + BLOCK_M - 1 against the program's keys, transposed: keys along rows."""
    rows = m0 + tl.arange(0, BLOCK_M)                    # [BLOCK_M] query indices
    cols = tl.arange(0, D)                               # [D]
    row_ok = rows < T
    q = tl.load(q_src + rows[:, None] * stride_qt + cols[None, :], mask=row_ok[:, None], other=0.0)    # [BLOCK_M, D]
    do = tl.load(do_src + rows[:, None] * stride_dot + cols[None, :], mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]
    lse = tl.load(lse_src + rows, mask=row_ok, other=float("-inf"))                    # [BLOCK_M], natural log
    delta = tl.load(delta_src + rows, mask=row_ok, other=0.0)                          # [BLOCK_M]
    # A row past T or a row that sees no key (lse = -inf) has P = 0: give it lse = +inf, so exp2 gives 0, not inf.
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)      # base 2: L * log2(e)
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)                        # [BLOCK_N, BLOCK_M] = (Q K^T)^T
    p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])                                 # P^T rebuilt: exp(S - L)
    if MASKED:
        visible = keys[:, None] <= (offset + rows)[None, :]                            # key j visible to query i
        p_t = tl.where(visible, p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)               # dV += P^T dO
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)                      # [BLOCK_N, BLOCK_M] = (dO V^T)^T
    ds_t = p_t * (dp_t - delta[None, :])                                               # dS^T = P^T ∘ (dP^T - Δ)
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)                # dK += dS^T Q (scaled at the end)
    if ATOMIC_DQ:  # dQ += dS K, added into FP32 memory that every key block of this row also adds to
        dq = tl.dot(tl.trans(ds_t).to(k.dtype), k, input_precision=DOT_PRECISION)      # [BLOCK_M, D]
        tl.atomic_add(dq_src + rows[:, None] * D + cols[None, :], dq * sm_scale, mask=row_ok[:, None])
    return dk, dv


@triton.jit
def backward_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,             # q and do [B, Hq, T, D], k and v [B, Hkv, S, D]
    lse_ptr, delta_ptr,                      # lse and Δ [B, Hq, T], FP32, contiguous
    dk_ptr, dv_ptr,                          # dk and dv like k and v, contiguous (the outputs)
    dq_ptr,                                  # dq [B, Hq, T, D] in FP32, zeroed, contiguous (written only with ATOMIC_DQ)
    stride_qb, stride_qh, stride_qt,         # q's strides over batch, head and query (D is contiguous)
    stride_kb, stride_kh, stride_ks,         # k's strides over batch, KV head and key
    stride_vb, stride_vh, stride_vs,         # v's strides over batch, KV head and key
    stride_dob, stride_doh, stride_dot,      # do's strides over batch, head and query
    T, S,                                    # number of queries and of keys
    offset,                                  # absolute position of query 0 (query i sits at offset + i)
    kv_heads,                                # Hkv: splits the grid's second axis into (batch, KV head)
    group,                                   # Hq // Hkv: the query heads that read this KV head
    qk_scale,                                # log2(e) / sqrt(D): scores go straight to exp2
    sm_scale,                                # 1 / sqrt(D): dS is taken w.r.t. the scaled scores, dK = scale dS^T Q
    D: tl.constexpr,                         # head dimension, a power of two >= 16
    BLOCK_M: tl.constexpr,                   # queries per step of the loop
    BLOCK_N: tl.constexpr,                   # keys per program
    CAUSAL: tl.constexpr,                    # False: every query sees every key
    ATOMIC_DQ: tl.constexpr,                 # True: this kernel also accumulates dq (no dq kernel afterwards)
    DOT_PRECISION: tl.constexpr = "ieee",    # FP32 inputs: "ieee" is true FP32
):
    """One program: BLOCK_N keys of one (batch, KV head); dK and dV summed over every query that sees them.

    Grouped-query attention without repeating K and V: the program visits the `group` query heads
    of its KV head in turn, so their contributions are summed in registers, never raced in memory.
    Causal block skipping runs backwards: key n0 is seen first by query n0 - offset, so earlier
    query blocks are skipped; the blocks that the diagonal crosses are masked, those after it not.
    """
    block = tl.program_id(0)                             # which block of keys (block 0, the most work, first)
    bkv = tl.program_id(1)                               # which (batch, KV head)
    b = bkv // kv_heads
    kv_h = bkv % kv_heads
    keys = block * BLOCK_N + tl.arange(0, BLOCK_N)       # [BLOCK_N] key indices
    cols = tl.arange(0, D)                               # [D]
    key_ok = keys < S
    k = tl.load(k_ptr + b * stride_kb + kv_h * stride_kh + keys[:, None] * stride_ks + cols[None, :],
                mask=key_ok[:, None], other=0.0)         # [BLOCK_N, D]
    v = tl.load(v_ptr + b * stride_vb + kv_h * stride_vh + keys[:, None] * stride_vs + cols[None, :],
                mask=key_ok[:, None], other=0.0)         # [BLOCK_N, D]
    dk = tl.zeros((BLOCK_N, D), tl.float32)
    dv = tl.zeros((BLOCK_N, D), tl.float32)

    if CAUSAL:
        first = tl.maximum(block * BLOCK_N - offset, 0)  # the first query that sees key block * BLOCK_N
        start = tl.minimum((first // BLOCK_M) * BLOCK_M, T)
        full = block * BLOCK_N + BLOCK_N - 1 - offset    # from this query on, every key of the block is visible
        unmasked_from = tl.minimum(start + tl.cdiv(tl.maximum(full - start, 0), BLOCK_M) * BLOCK_M, T)
    else:
        start = 0
        unmasked_from = 0
    for g in range(group):                               # the query heads of this KV head
        h = kv_h * group + g
        bh = b * kv_heads * group + h                    # (batch, query head) in lse and delta
        q_src = q_ptr + b * stride_qb + h * stride_qh
        do_src = do_ptr + b * stride_dob + h * stride_doh
        for m0 in range(start, unmasked_from, BLOCK_M):  # on the diagonal: masked
            dk, dv = _dkdv_tile(dk, dv, k, v, q_src, do_src, lse_ptr + bh * T, delta_ptr + bh * T,
                                dq_ptr + bh * T * D, m0, keys, offset, T, stride_qt, stride_dot, qk_scale, sm_scale,
                                D, BLOCK_M, True, ATOMIC_DQ, DOT_PRECISION)
        for m0 in range(unmasked_from, T, BLOCK_M):      # after it: every key visible, no mask
            dk, dv = _dkdv_tile(dk, dv, k, v, q_src, do_src, lse_ptr + bh * T, delta_ptr + bh * T,
                                dq_ptr + bh * T * D, m0, keys, offset, T, stride_qt, stride_dot, qk_scale, sm_scale,
                                D, BLOCK_M, False, ATOMIC_DQ, DOT_PRECISION)
    out = bkv * S * D + keys[:, None] * D + cols[None, :]  # dk and dv are contiguous [B, Hkv, S, D]
    tl.store(dk_ptr + out, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=key_ok[:, None])
    tl.store(dv_ptr + out, dv.to(dv_ptr.dtype.element_ty), mask=key_ok[:, None])


# %% [dq] dQ: one program per query block and (batch, query head), looping over the keys it sees
@triton.jit
def _dq_tile(
    dq,                                      # accumulator [BLOCK_M, D], FP32
    q, do, lse2, delta,                      # the program's q, do [BLOCK_M, D]; lse in base 2 and Δ [BLOCK_M]
    k_src, v_src,                            # this (batch, KV head)'s K and V at key 0
    n0,                                      # first key of the tile
    q_pos,                                   # [BLOCK_M] absolute query positions
    S, stride_ks, stride_vs,                 # number of keys; K's and V's strides over keys
    qk_scale,                                # log2(e) / sqrt(D)
    D: tl.constexpr,                         # head dimension
    BLOCK_N: tl.constexpr,                   # keys per tile
    MASKED: tl.constexpr,                    # True on the causal diagonal: hide keys after each query
    DOT_PRECISION: tl.constexpr,             # tl.dot's input_precision for FP32 inputs
):
    """dQ += dS K over the keys n0 .. n0 + BLOCK_N - 1 (keys past S load as 0 and add nothing)."""
    keys = n0 + tl.arange(0, BLOCK_N)                    # [BLOCK_N]
    cols = tl.arange(0, D)                               # [D]
    key_ok = keys < S
    k = tl.load(k_src + keys[:, None] * stride_ks + cols[None, :], mask=key_ok[:, None], other=0.0)  # [BLOCK_N, D]
    v = tl.load(v_src + keys[:, None] * stride_vs + cols[None, :], mask=key_ok[:, None], other=0.0)  # [BLOCK_N, D]
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)                          # [BLOCK_M, BLOCK_N]
    p = tl.math.exp2(s * qk_scale - lse2[:, None])                                     # P rebuilt from L
    if MASKED:
        p = tl.where(keys[None, :] <= q_pos[:, None], p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)                        # [BLOCK_M, BLOCK_N] = dO V^T
    ds = p * (dp - delta[:, None])                                                     # dS = P ∘ (dP - Δ)
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)                # dQ += dS K (scaled at the end)


@triton.jit
def backward_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,             # q and do [B, Hq, T, D], k and v [B, Hkv, S, D]
    lse_ptr, delta_ptr,                      # lse and Δ [B, Hq, T], FP32, contiguous
    dq_ptr,                                  # dq like q, contiguous (the output)
    stride_qb, stride_qh, stride_qt,         # q's strides over batch, head and query (D is contiguous)
    stride_kb, stride_kh, stride_ks,         # k's strides over batch, KV head and key
    stride_vb, stride_vh, stride_vs,         # v's strides over batch, KV head and key
    stride_dob, stride_doh, stride_dot,      # do's strides over batch, head and query
    T, S,                                    # number of queries and of keys
    offset,                                  # absolute position of query 0 (query i sits at offset + i)
    q_heads,                                 # Hq: splits the grid's second axis into (batch, head)
    group,                                   # Hq // Hkv: query heads sharing one KV head
    qk_scale,                                # log2(e) / sqrt(D)
    sm_scale,                                # 1 / sqrt(D): dQ = scale dS K
    D: tl.constexpr,                         # head dimension, a power of two >= 16
    BLOCK_M: tl.constexpr,                   # queries per program
    BLOCK_N: tl.constexpr,                   # keys per step of the loop
    CAUSAL: tl.constexpr,                    # False: every query sees every key
    DOT_PRECISION: tl.constexpr = "ieee",    # FP32 inputs: "ieee" is true FP32
):
    """One program: BLOCK_M queries of one (batch, head); the forward kernel's loop, with dQ as its sum."""
    block = tl.num_programs(0) - 1 - tl.program_id(0)   # the longest (last) query blocks first
    bh = tl.program_id(1)                                # which (batch, query head)
    b = bh // q_heads
    h = bh % q_heads
    kv_h = h // group
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)       # [BLOCK_M] query indices
    cols = tl.arange(0, D)                               # [D]
    row_ok = rows < T
    q_pos = offset + rows                                # [BLOCK_M] absolute positions
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + rows[:, None] * stride_qt + cols[None, :],
                mask=row_ok[:, None], other=0.0)         # [BLOCK_M, D]
    do = tl.load(do_ptr + b * stride_dob + h * stride_doh + rows[:, None] * stride_dot + cols[None, :],
                 mask=row_ok[:, None], other=0.0)        # [BLOCK_M, D]
    lse = tl.load(lse_ptr + bh * T + rows, mask=row_ok, other=float("-inf"))   # [BLOCK_M]
    delta = tl.load(delta_ptr + bh * T + rows, mask=row_ok, other=0.0)         # [BLOCK_M]
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # P = 0 where no key is seen
    k_src = k_ptr + b * stride_kb + kv_h * stride_kh
    v_src = v_ptr + b * stride_vb + kv_h * stride_vh
    dq = tl.zeros((BLOCK_M, D), tl.float32)

    if CAUSAL:
        last_row = tl.minimum((block + 1) * BLOCK_M, T) - 1
        stop = tl.minimum(S, offset + last_row + 1)      # one past the last key the block's last query sees
        diagonal = tl.maximum(offset + block * BLOCK_M, 0)
        masked_from = (tl.minimum(diagonal, tl.maximum(stop, 0)) // BLOCK_N) * BLOCK_N
    else:
        stop = S
        masked_from = S                                  # keys past S add nothing: no mask at all
    for n0 in range(0, masked_from, BLOCK_N):            # below the diagonal: no mask
        dq = _dq_tile(dq, q, do, lse2, delta, k_src, v_src, n0, q_pos, S, stride_ks, stride_vs, qk_scale,
                      D, BLOCK_N, False, DOT_PRECISION)
    for n0 in range(masked_from, stop, BLOCK_N):         # on the diagonal
        dq = _dq_tile(dq, q, do, lse2, delta, k_src, v_src, n0, q_pos, S, stride_ks, stride_vs, qk_scale,
                      D, BLOCK_N, True, DOT_PRECISION)
    tl.store(dq_ptr + bh * T * D + rows[:, None] * D + cols[None, :], (dq * sm_scale).to(dq_ptr.dtype.element_ty),
             mask=row_ok[:, None])


# %% [backward] flash_attention_backward: Δ, then dK and dV, then dQ
def _backward_configs(shapes, interpreted):
    """triton.autotune's choices, (BLOCK_M, BLOCK_N, warps, stages) each; on a CPU one small pair of blocks."""
    if runtime.current().interpret:
        shapes = [(*interpreted, 4, 1)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st) for bm, bn, w, st in shapes]


# dK/dV hold two [BLOCK_N, D] accumulators, so few queries per step; dQ holds one [BLOCK_M, D], so few keys.
# Unequal blocks on a CPU too, so that the interpreter checks the causal bounds where BLOCK_M != BLOCK_N.
dkdv_tuned = triton.autotune(
    configs=_backward_configs([(32, 128, 4, 3), (64, 128, 8, 3), (32, 64, 4, 3), (64, 64, 4, 3)], (16, 32)),
    key=["T", "S", "D", "group", "CAUSAL", "ATOMIC_DQ"], reset_to_zero=["dq_ptr"])(backward_dkdv_kernel)
dq_tuned = triton.autotune(
    configs=_backward_configs([(128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)], (32, 16)),
    key=["T", "S", "D", "group", "CAUSAL"])(backward_dq_kernel)


def flash_attention_backward(q, k, v, o, lse, do, query_offset=None, causal=True, atomic_dq=False):
    """(dq, dk, dv) of attention, given the forward's o and lse [B, Hq, T] and the output's gradient do.

    Shapes as in the forward pass: q, o, do [B, Hq, T, D]; k, v [B, Hkv, S, D]; each gradient comes
    back shaped and typed like its input, dk and dv summed over the query heads that share them.

    dQ comes from a kernel of its own, which walks each query block's keys as the forward pass does:
    nothing is written twice, so dq is the same bit for bit on every run. atomic_dq=True instead adds
    each key block's share into an FP32 dq with atomics inside the dK/dV kernel: one kernel fewer, but
    its order of additions (so its rounding) changes from run to run, and it measured 2.2 to 2.4 times
    slower on the H200 (bf16, causal, D = 128, T = 1k to 16k: flashcourse/measured/backward.json), the
    atomics' traffic to dq costing more than recomputing P and dP in a second kernel.
    """
    _check_inputs(q, k, v)
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if tuple(o.shape) != tuple(q.shape) or tuple(do.shape) != tuple(q.shape):
        raise ValueError(f"o and do must be shaped like q {list(q.shape)}, got {list(o.shape)} and {list(do.shape)}")
    if tuple(lse.shape) != (B, Hq, T):
        raise ValueError(f"lse must be [B, Hq, T] = {[B, Hq, T]}, got {list(lse.shape)}")
    offset = S - T if query_offset is None else int(query_offset)
    q, k, v, do = q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous()
    lse = lse.float().contiguous()
    delta = backward_delta(o, do)                                              # [B, Hq, T]
    dk, dv = torch.empty_like(k), torch.empty_like(v)                          # [B, Hkv, S, D]
    dq32 = torch.zeros(B, Hq, T, D if atomic_dq else 0, device=q.device, dtype=torch.float32)  # FP32 dq; empty if unused
    strides = (q.stride(0), q.stride(1), q.stride(2),
               k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2),
               do.stride(0), do.stride(1), do.stride(2))
    scale = 1.0 / math.sqrt(D)
    grid = lambda meta: (triton.cdiv(S, meta["BLOCK_N"]), B * Hkv)  # noqa: E731  (key blocks, batch x KV head)
    dkdv_tuned[grid](q, k, v, do, lse, delta, dk, dv, dq32, *strides, T, S, offset, Hkv, Hq // Hkv,
                     LOG2E * scale, scale, D=D, CAUSAL=causal, ATOMIC_DQ=atomic_dq)
    if atomic_dq:
        return dq32.to(q.dtype), dk, dv
    dq = torch.empty_like(q)                                                   # [B, Hq, T, D]
    grid = lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * Hq)  # noqa: E731  (query blocks, batch x head)
    dq_tuned[grid](q, k, v, do, lse, delta, dq, *strides, T, S, offset, Hq, Hq // Hkv,
                   LOG2E * scale, scale, D=D, CAUSAL=causal)
    return dq, dk, dv


# %% [train] An autograd.Function: loss.backward() runs the kernels above
class FlashAttention(torch.autograd.Function):
    """Saves q, k, v, o and the log-sum-exp (O(T) numbers per head, never the [T, S] P) for the backward pass."""

    @staticmethod
    def forward(ctx, q, k, v, query_offset=None, causal=True):
        o, lse = flash_attention_lse(q, k, v, query_offset, causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.query_offset, ctx.causal = query_offset, causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(q, k, v, o, lse, do, ctx.query_offset, ctx.causal)
        return dq, dk, dv, None, None


def flash_attention_train(q, k, v, query_offset=None, causal=True):
    """Attention that autograd can differentiate: scaled_dot_product_attention(q, k, v, is_causal=True) when T == S.

    q [B, Hq, T, D], k and v [B, Hkv, S, D]; query i sits at query_offset + i (default S - T).
    """
    return FlashAttention.apply(q, k, v, query_offset, causal)
