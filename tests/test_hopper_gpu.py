"""08's compiled kernels on a CUDA GPU: longest-first order and FP8 at long shapes against an FP32 reference, and
hopper_attention (Gluon) under each schedule on a Hopper GPU."""

import pytest
import torch

from flashcourse.engine.fp8 import fp8_attention, random_rotation
from flashcourse.engine.hopper import hopper_attention, hopper_attention_lse
from flashcourse.engine.longest_first import lpt_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton kernels)")]


@pytest.mark.parametrize("persistent, head_group", [(True, None), (False, None), (True, 3), (False, 16)])
@pytest.mark.parametrize("causal", [True, False])
def test_lpt_long_autotuned(persistent, head_group, causal):
    """Longest-first order, persistent or one program per item, in L2-sized or given head groups (3 leaves a
    smaller last group): T = S = 3001, GQA 4, D = 128, error within 2e-2."""
    from flashcourse.bench.fast import _inputs, max_error

    q, k, v = _inputs(2, 8, 2, 3001, 3001, 128, torch.bfloat16)
    out = lpt_attention(q, k, v, causal=causal, persistent=persistent, head_group=head_group)
    assert max_error(out, q, k, v, causal) < 2e-2


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("d, causal", [(128, True), (128, False), (64, True)])
def test_fp8_long(d, causal, rotate):
    """FP8 at T = S = 2125 (no block divides it), GQA 4, N(0, 1) inputs, against FP32: RMS error below 3e-2
    and max error below 0.5 (e4m3 keeps 3 mantissa bits: one value rounds by up to 6 %, and a row that
    sees one key returns that key's V so rounded)."""
    from flashcourse.bench.fast import _inputs, max_error, rms_error

    q, k, v = _inputs(2, 8, 2, 2125, 2125, d, torch.bfloat16)
    rotation = random_rotation(d, seed=0, device="cuda") if rotate else None
    out = fp8_attention(q, k, v, causal=causal, rotation=rotation)
    assert out.dtype == torch.bfloat16
    assert rms_error(out, q, k, v, causal) < 3e-2 and max_error(out, q, k, v, causal) < 0.5



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rotate", [False, True])
def test_prepare_fp8_matches_its_pytorch_path(dtype, rotate):
    """prepare_fp8 (quantize_fp8, one compiled pass per tensor) holds the same bytes and scales as quantize_blocks
    three times and a transposed, padded copy of V, bit for bit: T = S = 2125 (no block divides it), GQA 4, D = 128,
    a block of zeros, with and without the rotation of Q and K."""
    from flashcourse.bench.fast import _inputs, fp8_inputs_equal, prepare_fp8_torch
    from flashcourse.engine.fp8 import prepare_fp8

    q, k, v = _inputs(2, 8, 2, 2125, 2125, 128, dtype)
    v[1, 1, 128:256] = 0.0
    rotation = random_rotation(128, seed=0, device="cuda") if rotate else None
    got, want = prepare_fp8(q, k, v, rotation), prepare_fp8_torch(q, k, v, rotation)
    assert got.v_t.shape == (2, 2, 128, 2128) and not got.v_t[..., 2125:].view(torch.uint8).any()
    assert fp8_inputs_equal(got, want)

def _hopper_with_gluon() -> bool:
    from flashcourse.engine import hopper

    return hopper.gluon is not None and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper_with_gluon(),
                    reason="hopper_attention needs a Hopper GPU and Triton's Gluon layer")
@pytest.mark.parametrize("persistent, pingpong", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch, q_heads, kv_heads, t, s, d, causal", [
    (2, 8, 2, 1024, 1024, 128, True),      # GQA 4, several items per program when persistent
    (1, 8, 8, 384, 1000, 64, True),        # queries at the end of a longer cache; S not a multiple of a tile
    (2, 4, 2, 256, 777, 128, False),       # not causal, the last tile runs into the next head's keys
    (3, 40, 8, 1280, 1280, 128, True),     # 1200 items: more than one wave
    (1, 4, 2, 200, 200, 128, True),        # T not a multiple of 128: the last tile reads the next head's queries
    (2, 4, 4, 1, 333, 64, False),          # one query, as in decoding
    (1, 8, 2, 1000, 1100, 64, True),       # neither T nor S a multiple of 128, queries after 100 keys
])
def test_hopper_attention(persistent, pingpong, dtype, batch, q_heads, kv_heads, t, s, d, causal):
    """hopper_attention under each schedule against an FP64 reference, within 2e-2."""
    from flashcourse.checks import reference
    from flashcourse.bench.fast import _inputs

    q, k, v = _inputs(batch, q_heads, kv_heads, t, s, d, dtype)
    got = hopper_attention(q, k, v, causal=causal, persistent=persistent, pingpong=pingpong, fallback=False)
    want = reference.attention(q.cpu(), k.cpu(), v.cpu(), causal=causal)
    error = (got.cpu().double() - want).abs().max()
    assert error < 2e-2, f"persistent={persistent}, pingpong={pingpong}: max |error| {error:.2e}"


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper_with_gluon(),
                    reason="hopper_attention needs a Hopper GPU and Triton's Gluon layer")
@pytest.mark.parametrize("persistent, pingpong", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("batch, q_heads, kv_heads, t, s, causal", [
    (2, 8, 2, 1024, 1024, True),           # GQA 4, several items per program when persistent
    (1, 8, 8, 384, 1000, True),            # two items of 192 queries at the end of a longer cache
    (3, 40, 8, 1280, 1280, True),          # 840 items: more than one wave
    (1, 8, 2, 1000, 1100, True),           # T not a multiple of 192: the last item's rows past T are not stored
    (2, 4, 2, 256, 777, False),            # not causal, the last tile runs into the next head's keys
])
def test_hopper_attention_three_consumers(persistent, pingpong, batch, q_heads, kv_heads, t, s, causal):
    """Three consumer warpgroups (192 query rows an item) give two's o and lse bit for bit: each row's loop over
    the keys is the same; a turn passed to the wrong consumer hangs, a block of Q loaded for the wrong rows
    differs. Two are within 2e-2 of an FP64 reference."""
    from flashcourse.bench.fast import _inputs
    from flashcourse.checks import reference

    q, k, v = _inputs(batch, q_heads, kv_heads, t, s, 64, torch.bfloat16)
    schedule = dict(causal=causal, persistent=persistent, pingpong=pingpong, fallback=False)
    o2, lse2 = hopper_attention_lse(q, k, v, consumers=2, **schedule)
    o3, lse3 = hopper_attention_lse(q, k, v, consumers=3, **schedule)
    want = reference.attention(q.cpu(), k.cpu(), v.cpu(), causal=causal)
    assert (o2.cpu().double() - want).abs().max() < 2e-2
    assert torch.equal(o3, o2), f"max |o3 - o2| {float((o3.float() - o2.float()).abs().max()):.2e}"
    assert torch.equal(lse3, lse2), f"max |lse3 - lse2| {float((lse3 - lse2).abs().max()):.2e}"
    assert torch.equal(hopper_attention(q, k, v, consumers=3, **schedule), o3)


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper_with_gluon(),
                    reason="hopper_attention needs a Hopper GPU and Triton's Gluon layer")
@pytest.mark.parametrize("persistent, pingpong", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("batch, q_heads, kv_heads, t, s, d, causal", [
    (2, 8, 2, 1024, 1024, 128, True),      # GQA 4, several items per program when persistent
    (1, 8, 8, 384, 1000, 64, True),        # queries at the end of a longer cache; S not a multiple of a tile
    (2, 4, 2, 256, 777, 128, False),       # not causal, the last tile runs into the next head's keys
    (3, 40, 8, 1280, 1280, 128, True),     # 1200 items: more than one wave
    (1, 4, 2, 200, 200, 128, True),        # T not a multiple of 128
    (2, 4, 4, 1, 333, 64, False),          # one query, as in decoding
    (1, 8, 2, 1000, 1100, 64, True),       # neither T nor S a multiple of 128, queries after 100 keys
])
def test_hopper_attention_overlap(persistent, pingpong, batch, q_heads, kv_heads, t, s, d, causal):
    """The overlap across items (the next item's first S beside this one's last P V) gives one item at a time's
    o and lse bit for bit, with two consumers and, at D = 64, three: a product read from the wrong Q buffer or
    V tile, or an item's output written with the next item's m and l, differs."""
    from flashcourse.bench.fast import _inputs

    q, k, v = _inputs(batch, q_heads, kv_heads, t, s, d, torch.bfloat16, seed=t + s)
    for consumers in (2, 3) if d == 64 else (2,):
        schedule = dict(causal=causal, persistent=persistent, pingpong=pingpong, consumers=consumers,
                        fallback=False)
        o, lse = hopper_attention_lse(q, k, v, overlap=False, **schedule)
        o_overlap, lse_overlap = hopper_attention_lse(q, k, v, overlap=True, **schedule)
        assert torch.equal(o_overlap, o), (consumers, float((o_overlap.float() - o.float()).abs().max()))
        assert torch.equal(lse_overlap, lse), (consumers, float((lse_overlap - lse).abs().max()))
        assert torch.equal(hopper_attention(q, k, v, overlap=True, **schedule), o)


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper_with_gluon(),
                    reason="hopper_attention needs a Hopper GPU and Triton's Gluon layer")
@pytest.mark.parametrize("persistent, pingpong, overlap", [(False, False, False), (True, True, False),
                                                           (True, False, True)])
@pytest.mark.parametrize("batch, q_heads, kv_heads, t, s, d, causal, dtype", [
    (2, 8, 2, 1024, 1024, 128, True, torch.bfloat16),    # GQA 4, several items per program when persistent
    (1, 8, 8, 320, 1000, 64, True, torch.bfloat16),      # T % 128 == 64: the last item's second consumer has no rows
    (2, 4, 2, 192, 777, 128, False, torch.float16),      # not causal, fp16, S not a multiple of a tile
    (1, 4, 4, 8192, 8192, 64, True, torch.bfloat16),     # three consumers (hopper_consumers' choice)
])
def test_hopper_attention_tma_store(persistent, pingpong, overlap, batch, q_heads, kv_heads, t, s, d, causal, dtype):
    """o written through shared memory by TMA copies gives the threads' own stores' o and lse bit for bit: a copy
    to the wrong rows, one that writes a consumer's rows past T into the next head, or a buffer refilled before
    its copy read it, differs. T not a multiple of 64 is refused, with the reason."""
    from flashcourse.bench.fast import _inputs

    q, k, v = _inputs(batch, q_heads, kv_heads, t, s, d, dtype, seed=t + s)
    schedule = dict(causal=causal, persistent=persistent, pingpong=pingpong, overlap=overlap, fallback=False)
    o, lse = hopper_attention_lse(q, k, v, tma_store=False, **schedule)
    o_tma, lse_tma = hopper_attention_lse(q, k, v, tma_store=True, **schedule)
    assert torch.equal(o_tma, o), float((o_tma.float() - o.float()).abs().max())
    assert torch.equal(lse_tma, lse)
    assert torch.equal(hopper_attention(q, k, v, tma_store=True, **schedule), o)
    with pytest.raises(ValueError, match="multiple of 64"):
        hopper_attention(q[:, :, :t - 1], k, v, tma_store=True, **schedule)


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper_with_gluon(),
                    reason="hopper_attention needs a Hopper GPU and Triton's Gluon layer")
def test_hopper_attention_refuses_three_consumers_at_d128():
    """At D = 128 three consumers would spill their accumulators: refused, with the reason."""
    from flashcourse.bench.fast import _inputs

    q, k, v = _inputs(1, 2, 2, 256, 256, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="3 at D = 64"):
        hopper_attention(q, k, v, consumers=3)


@pytest.mark.parametrize("t, s, d, dtype, causal", [
    (200, 200, 96, torch.bfloat16, True),     # D = 96
    (256, 256, 32, torch.float16, False),     # D = 32
    (128, 300, 64, torch.float32, True),      # fp32
])
def test_hopper_attention_falls_back_where_its_schedule_does_not_apply(t, s, d, dtype, causal):
    """Inputs the Gluon schedule does not take are computed by step 7's `attention` (fast_attention, or this
    schedule on D padded to 128), with the same answer; with fallback=False they raise, naming fast_attention."""
    from flashcourse.bench.fast import _inputs
    from flashcourse.checks import reference
    from flashcourse.engine.any_input import attention

    q, k, v = _inputs(1, 4, 2, t, s, d, dtype)
    got = hopper_attention(q, k, v, causal=causal)
    assert torch.equal(got, attention(q, k, v, causal=causal))
    want = reference.attention(q.cpu(), k.cpu(), v.cpu(), causal=causal)
    assert (got.cpu().double() - want).abs().max() < 2e-2
    with pytest.raises(ValueError, match="use fast_attention"):
        hopper_attention(q, k, v, causal=causal, fallback=False)


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper_with_gluon(),
                    reason="hopper_attention needs a Hopper GPU and Triton's Gluon layer")
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("batch, q_heads, kv_heads, t, s, d, causal", [
    (2, 8, 2, 1024, 1024, 128, True),      # GQA 4
    (1, 8, 8, 384, 1000, 64, True),        # queries at the end of a longer cache
    (2, 4, 2, 256, 777, 128, False),       # not causal, S not a multiple of a tile
    (1, 4, 2, 200, 200, 128, True),        # T not a multiple of 128: the last tile's rows past T are not stored
    (1, 8, 2, 1000, 1100, 64, False),      # neither T nor S a multiple of 128
])
def test_hopper_attention_lse(persistent, batch, q_heads, kv_heads, t, s, d, causal):
    """hopper_attention_lse's o is hopper_attention's, bit for bit, and its lse is an FP32 log-sum-exp within 1e-4
    of one computed in FP64 from the same bf16 inputs."""
    import math

    gen = torch.Generator(device="cuda").manual_seed(t + s + d)
    q = torch.randn(batch, q_heads, t, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(batch, kv_heads, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    o, lse = hopper_attention_lse(q, k, v, causal=causal, persistent=persistent, fallback=False)
    assert torch.equal(o, hopper_attention(q, k, v, causal=causal, persistent=persistent, fallback=False))
    scores = q.double() @ k.double().repeat_interleave(q_heads // kv_heads, 1).transpose(-1, -2) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(~torch.ones(t, s, dtype=torch.bool, device="cuda").tril(s - t), -math.inf)
    want = torch.logsumexp(scores, -1)
    assert lse.dtype == torch.float32 and lse.shape == (batch, q_heads, t)
    assert float((lse.double() - want).abs().max()) < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper_with_gluon(),
                    reason="hopper_fp8_forward needs a Hopper GPU and Triton's Gluon layer")
@pytest.mark.parametrize("persistent, pingpong", [(False, False), (True, True)])
@pytest.mark.parametrize("quantize_q", [True, False])
@pytest.mark.parametrize("batch, q_heads, kv_heads, t, s, d, causal", [
    (2, 8, 2, 1024, 1024, 128, True),      # GQA 4
    (1, 8, 8, 1000, 1100, 64, True),       # queries at the end of a longer cache, neither a multiple of 128
    (2, 4, 1, 333, 777, 128, False),       # MQA, not causal
])
def test_hopper_fp8_forward(persistent, pingpong, quantize_q, batch, q_heads, kv_heads, t, s, d, causal):
    """Step 5's schedule with FP8=True, on the same prepared K and V as the Triton FP8 kernel, Q quantized by
    prepare_fp8 or by the kernel's consumers (quantize_q=False): against FP32, an RMS error within 1.25x the
    Triton kernel's (plus 1e-3) and below 3e-2, max error below 0.5; a scale or a unit of acc applied to the wrong
    tile or row, or a key of P met by another key's row of V (Vᵀ's keys relabelled unlike P's), would be far
    outside. Inputs prepared for the Triton kernel (keys in order) are refused by name."""
    from flashcourse.bench.fast import _inputs, max_error, rms_error
    from flashcourse.engine.fp8 import fp8_forward, hopper_fp8_forward, prepare_fp8

    q, k, v = _inputs(batch, q_heads, kv_heads, t, s, d, torch.bfloat16, seed=t + s)
    inputs = prepare_fp8(q, k, v)
    got = hopper_fp8_forward(prepare_fp8(q, k, v, quantize_q=quantize_q, relabel=True), causal=causal,
                             persistent=persistent, pingpong=pingpong)
    with pytest.raises(ValueError, match="relabel=True"):
        hopper_fp8_forward(inputs, causal=causal)
    triton_kernel = fp8_forward(inputs, causal=causal, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    rms, rms_triton = rms_error(got, q, k, v, causal), rms_error(triton_kernel, q, k, v, causal)
    assert rms < min(3e-2, 1.25 * rms_triton + 1e-3), (rms, rms_triton)
    assert max_error(got, q, k, v, causal) < 0.5


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper_with_gluon(),
                    reason="hopper_fp8_forward needs a Hopper GPU and Triton's Gluon layer")
@pytest.mark.parametrize("d, causal", [(128, True), (64, False)])
def test_fp8_attention_quantizes_fp16_q_in_the_kernel(d, causal):
    """fp8_attention on fp16 inputs leaves Q to the Gluon kernel's consumers, as on bf16 ones: o in fp16 with an
    RMS error within 1.25x (plus 1e-3) that of the Triton kernel on the same inputs prepared whole."""
    from flashcourse.bench.fast import _inputs, max_error, rms_error
    from flashcourse.engine.fp8 import fp8_forward, hopper_fp8_forward, prepare_fp8

    q, k, v = _inputs(1, 8, 2, 1024, 1024, d, torch.float16, seed=d)
    got = fp8_attention(q, k, v, causal=causal)
    left = hopper_fp8_forward(prepare_fp8(q, k, v, quantize_q=False, relabel=True), causal=causal,
                              out_dtype=torch.float16)
    triton_kernel = fp8_forward(prepare_fp8(q, k, v), causal=causal, out_dtype=torch.float16)
    assert got.dtype == torch.float16 and torch.equal(got, left)
    rms, rms_triton = rms_error(got, q, k, v, causal), rms_error(triton_kernel, q, k, v, causal)
    assert rms < min(3e-2, 1.25 * rms_triton + 1e-3), (rms, rms_triton)
    assert max_error(got, q, k, v, causal) < 0.5


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper_with_gluon(),
                    reason="hopper_fp8_forward needs a Hopper GPU and Triton's Gluon layer")
@pytest.mark.parametrize("batch, q_heads, kv_heads, t, s, d, causal", [
    (2, 8, 2, 1024, 1024, 128, True),      # GQA 4
    (1, 8, 8, 960, 1100, 64, True),        # queries at the end of a longer cache; T a multiple of 64, not of 128
    (3, 4, 1, 320, 448, 128, False),       # MQA, not causal
])
def test_hopper_fp8_forward_schedule_keeps_its_sums(batch, q_heads, kv_heads, t, s, d, causal):
    """hopper_fp8_forward's default (persistent, the overlap across items, o by TMA) gives the o of one item at a
    time with o stored by threads bit for bit, in bf16 and fp16, with Q quantized before or in the kernel (where
    the overlap quantizes the next item's Q under this item's last product): the schedule moves work in time, not
    the sums. o by TMA is refused where T is not a multiple of 64, and left out there by default."""
    from flashcourse.bench.fast import _inputs
    from flashcourse.engine.fp8 import hopper_fp8_forward, prepare_fp8

    q, k, v = _inputs(batch, q_heads, kv_heads, t, s, d, torch.bfloat16, seed=t + s)
    for inputs in (prepare_fp8(q, k, v, relabel=True), prepare_fp8(q, k, v, quantize_q=False, relabel=True)):
        for out_dtype in (torch.bfloat16, torch.float16):
            plain = hopper_fp8_forward(inputs, causal=causal, out_dtype=out_dtype, persistent=False, overlap=False,
                                       tma_store=False)
            got = hopper_fp8_forward(inputs, causal=causal, out_dtype=out_dtype)
            assert got.dtype == out_dtype and torch.equal(got, plain)
    short = prepare_fp8(q[:, :, :t - 32].contiguous(), k, v, relabel=True)   # T - 32: not a multiple of 64
    with pytest.raises(ValueError, match="multiple of 64"):
        hopper_fp8_forward(short, causal=causal, tma_store=True)
    assert torch.equal(hopper_fp8_forward(short, causal=causal),
                       hopper_fp8_forward(short, causal=causal, persistent=False, overlap=False))
