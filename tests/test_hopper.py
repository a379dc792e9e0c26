"""08's engine (longest_first, fp8, hopper) on small shapes: Triton's interpreter on a CPU, compiled on a GPU; the
Gluon kernel compiled for sm_90 without a GPU."""

import pytest
import torch

from flashcourse.checks import core as ac
from flashcourse.checks import triton_flash as kc
from flashcourse import runtime
from flashcourse.checks import reference

RT = runtime.current()
# T = 45, S = 51, GQA 2, 32 x 16 blocks: neither T nor S divides into the blocks.
ODD = kc.case("odd", batch=2, q_heads=4, kv_heads=2, t=45, s=51, d=32, block_m=32, block_n=16, dtype=RT.dtype,
              device=RT.device)


# --- steps 2 and 3: longest-first order, the persistent grid; step 6: the FP8 forward ----------------------------


@pytest.mark.parametrize("persistent, head_group", [(True, None), (False, None), (True, 3), (False, 1)])
@pytest.mark.parametrize("causal, offset", [(True, None), (True, 0), (False, None)])
def test_lpt_attention_matches(persistent, head_group, causal, offset):
    """Work items in longest-first order, one program each or dealt to a persistent grid, over all heads or in
    head groups (3 of 8 (batch x head)s leaves a smaller last group): the same attention."""
    from flashcourse.engine.longest_first import lpt_attention

    case = ODD if offset is None else kc.case("past the keys", q_heads=2, kv_heads=1, t=33, s=20, query_offset=0,
                                              block_m=16, block_n=16, dtype=RT.dtype, device=RT.device)
    want = reference.attention(case.q.cpu(), case.k.cpu(), case.v.cpu(), causal=causal,
                               query_positions=None if offset is None else torch.arange(case.q.shape[2]) + offset)
    got = lpt_attention(case.q, case.k, case.v, query_offset=offset, causal=causal, persistent=persistent,
                        head_group=head_group)
    rtol, atol = ac.tolerance(RT.dtype)
    torch.testing.assert_close(got.cpu().double(), want, rtol=rtol, atol=atol)


def test_lpt_programs_are_fewer_than_items_when_persistent():
    """The persistent grid has at most a few programs per multiprocessor; the other grid one per item."""
    from flashcourse.engine.longest_first import lpt_programs

    assert lpt_programs({"BLOCK_M": 64}, 10_000, RT.device, persistent=False) == 10_000
    assert lpt_programs({"BLOCK_M": 64}, 10_000, RT.device, persistent=True) < 10_000
    assert lpt_programs({"BLOCK_M": 64}, 3, RT.device, persistent=True) == 3


def test_grid_tail_simulation():
    """Longest first across all heads ends the grid at least as evenly as longest first per head."""
    from flashcourse.bench.fast import tail

    for t in (1024, 16384):
        result = tail(t, 32768 // t, 32, 64, 64)
        assert 0.9 < result["fast order"] <= result["LPT order"] <= 1.0
        assert 0.9 < result["persistent LPT"] <= 1.0
    assert tail(256, 1, 1, 64, 64, processors=1)["LPT order"] == 1.0   # one slot: never idle


def test_random_rotation_is_orthogonal_and_keeps_scores():
    """R Rᵀ = I, so (QR)(KR)ᵀ = QKᵀ; the same seed gives the same R."""
    from flashcourse.engine.fp8 import random_rotation

    rot = random_rotation(64, seed=3)
    torch.testing.assert_close(rot @ rot.T, torch.eye(64), atol=1e-5, rtol=0)
    q, k = torch.randn(2, 5, 64), torch.randn(2, 7, 64)
    torch.testing.assert_close((q @ rot) @ (k @ rot).transpose(-1, -2), q @ k.transpose(-1, -2), atol=1e-4, rtol=1e-4)
    assert torch.equal(rot, random_rotation(64, seed=3)) and not torch.equal(rot, random_rotation(64, seed=4))


def _dequantize(x8, scales, block):
    """x8 [B, H, N, D] e4m3 and scales [B, H, ceil(N / block)] -> FP32 values."""
    return x8.float() * scales.repeat_interleave(block, dim=2)[:, :, :x8.shape[2], None]


def test_quantize_blocks():
    """Each block's largest |x| lands on 448; values come back within e4m3's rounding; a zero block gets scale 1."""
    from flashcourse.engine.fp8 import FP8_MAX, quantize_blocks

    x = torch.randn(2, 3, 37, 16) * torch.tensor([1.0, 50.0, 0.01])[None, :, None, None]
    x[0, 0, 16:32] = 0.0
    x8, scales = quantize_blocks(x, 16)
    assert x8.shape == x.shape and scales.shape == (2, 3, 3)
    assert scales[0, 0, 1] == 1.0
    back = _dequantize(x8, scales, 16)
    # e4m3 keeps 3 mantissa bits: a normal value is within 2^-4 of itself, a subnormal within half of 2^-9 (times the scale)
    bound = torch.maximum(x.abs() / 16, scales.repeat_interleave(16, dim=2)[:, :, :37, None] * 2.0**-10)
    assert ((back - x).abs() <= bound * 1.0001).all()
    amax = x8.float().abs().view(2, 3, 37 * 16)
    assert amax[1, 1].max() == FP8_MAX


def test_quantize_fp8_rounds_as_torch():
    """Blocks whose largest |x| is 448 get scale 1, so quantize_fp8 rounds x itself: it gives PyTorch's e4m3 byte for
    every e4m3 value, every midpoint between two (ties to even), the FP32 values just either side of each midpoint,
    subnormals, ±0 and random values up to ±448, where Triton's own conversion in the interpreter would not."""
    from flashcourse.engine.fp8 import FP8, quantize_fp8

    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    values = values[(values >= 0) & values.isfinite()].unique().sort().values      # 0, 2^-9, ..., 448
    mids = (values[1:] + values[:-1]) / 2
    ys = torch.cat([values, mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(448.0)),
                    torch.rand(4000, generator=torch.Generator().manual_seed(0)) * 448, torch.tensor([-0.0, 2.0**-11])])
    ys = torch.cat([ys, -ys])
    per_block = 16 * 32 - 1                                                 # one entry of each block is 448
    ys = torch.cat([ys, torch.zeros(-ys.numel() % per_block)]).view(-1, per_block)
    x = torch.cat([torch.full((ys.shape[0], 1), 448.0), ys], dim=1).view(1, 1, -1, 32)  # [1, 1, N, 32]
    x8, scales = quantize_fp8(x.to(RT.device), 16)
    assert (scales == 1.0).all()
    got, want = x8.cpu().view(torch.uint8).flatten(), x.to(FP8).view(torch.uint8).flatten()
    wrong = (got != want).nonzero().flatten()
    assert wrong.numel() == 0, f"{wrong.numel()} values rounded unlike torch, e.g. {x.flatten()[wrong[:5]].tolist()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [16, 24])
def test_quantize_fp8_matches_quantize_blocks(dtype, block):
    """The one-pass kernel gives quantize_blocks's bytes and scales bit for bit: N = 45 (no block divides it), a block
    of zeros (scale 1), heads 1000 times apart, a block of 24 rows (not a power of two); transposed, Vᵀ [B, H, D, 48]
    holds the same bytes and zeros in its padding columns, and relabelled, relabel_keys's order of them."""
    from flashcourse.engine.fp8 import quantize_blocks, quantize_fp8, relabel_keys

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 45, 32, generator=gen) * torch.tensor([1.0, 30.0, 0.03])[None, :, None, None]
    x[1, 0, block:2 * block] = 0.0
    x = x.to(dtype)
    want8, want_scales = quantize_blocks(x, block)
    assert want_scales[1, 0, 1] == 1.0
    x8, scales = quantize_fp8(x.to(RT.device), block)
    assert x8.shape == want8.shape and x8.dtype == want8.dtype
    assert torch.equal(x8.cpu().view(torch.uint8), want8.view(torch.uint8)), "e4m3 bytes differ from quantize_blocks's"
    assert torch.equal(scales.cpu(), want_scales), "scales differ from quantize_blocks's"
    v_t, v_scales = quantize_fp8(x.to(RT.device), block, transpose=True)
    assert v_t.shape == (2, 3, 32, 48)
    assert torch.equal(v_t[..., :45].cpu().view(torch.uint8), want8.transpose(2, 3).view(torch.uint8))
    assert not v_t[..., 45:].cpu().view(torch.uint8).any(), "Vᵀ's padding columns must be zero"
    assert torch.equal(v_scales.cpu(), want_scales)
    relabelled, _ = quantize_fp8(x.to(RT.device), block, transpose=True, relabel=True)
    assert torch.equal(relabelled.cpu().view(torch.uint8), relabel_keys(v_t).cpu().view(torch.uint8)), \
        "quantize_fp8(..., relabel=True) must write relabel_keys's order"


@pytest.mark.parametrize("rotate", [False, True])
def test_prepare_fp8_matches_its_pytorch_path(rotate):
    """prepare_fp8 (quantize_fp8 three times) holds the same bytes and scales as quantize_blocks three times and a
    transposed, padded copy of V, GQA, T = 45 and S = 51, with and without the rotation of Q and K; with relabel,
    Vᵀ's keys in relabel_keys's order."""
    from flashcourse.bench.fast import fp8_inputs_equal, prepare_fp8_torch
    from flashcourse.engine.fp8 import prepare_fp8, random_rotation, relabel_keys

    rotation = random_rotation(32, seed=0, device=RT.device) if rotate else None
    got = prepare_fp8(ODD.q, ODD.k, ODD.v, rotation)
    want = prepare_fp8_torch(ODD.q, ODD.k, ODD.v, rotation)
    assert got.v_t.shape == want.v_t.shape == (2, 2, 32, 64) and got.rotated == rotate
    assert fp8_inputs_equal(got, want)
    relabelled = prepare_fp8(ODD.q, ODD.k, ODD.v, rotation, relabel=True)
    assert relabelled.relabelled and not got.relabelled
    assert torch.equal(relabelled.v_t.view(torch.uint8), relabel_keys(got.v_t).view(torch.uint8))


def test_relabel_keys_is_the_operand_order():
    """relabel_keys moves key 8 h + 2 t + lo of each 16 to column 4 t + 2 h + lo (the order in which a thread of the
    8-bit wgmma's P operand holds its values), across batch and heads; refused where it does not apply (relabelled
    Vᵀ in fp8_forward, relabel without the transpose)."""
    from flashcourse.engine.fp8 import FP8, fp8_forward, prepare_fp8, quantize_fp8, relabel_keys

    v_t = torch.arange(48, dtype=torch.uint8).expand(2, 3, 4, 48).contiguous().view(FP8)  # key n holds the byte n
    got = relabel_keys(v_t).view(torch.uint8)                            # [B, H, D, S16]
    column = torch.arange(48)
    h, t, lo = (column % 16) // 2 % 2, (column % 16) // 4, column % 2  # column 4 t + 2 h + lo within its 16
    want = (column // 16 * 16 + 8 * h + 2 * t + lo).to(torch.uint8)
    assert torch.equal(got, want.expand(2, 3, 4, 48)), got[0, 0, 0]
    assert got[0, 0, 0, :16].tolist() == [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]
    with pytest.raises(ValueError, match="transpose=True"):
        quantize_fp8(ODD.v, 16, relabel=True)
    with pytest.raises(ValueError, match="relabel=False"):
        fp8_forward(prepare_fp8(ODD.q, ODD.k, ODD.v, relabel=True))


def test_rotation_spreads_an_outlier():
    """A channel 100 times larger than the rest: rotating Q and K first makes the quantized scores closer to QKᵀ."""
    from flashcourse.engine.fp8 import quantize_blocks, random_rotation

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 64, 64, generator=gen), torch.randn(1, 1, 64, 64, generator=gen)
    q[..., 5] *= 100
    k[..., 5] *= 100
    exact = q @ k.transpose(-1, -2)

    def score_error(rotation):
        qr, kr = (q @ rotation, k @ rotation) if rotation is not None else (q, k)
        q8, k8 = quantize_blocks(qr, 16), quantize_blocks(kr, 16)
        scores = _dequantize(*q8, 16) @ _dequantize(*k8, 16).transpose(-1, -2)
        return float((scores - exact).pow(2).mean().sqrt())
    assert score_error(random_rotation(64, seed=1)) < 0.7 * score_error(None)


def _fp8_emulated(inputs, causal, block_n):
    """fp8_fwd_kernel's arithmetic in PyTorch, one row at a time over tiles of block_n keys (query i at S - T + i)."""
    from flashcourse.engine.fp8 import P_SHIFT

    q8, k8, s = inputs.q, inputs.k, inputs.k.shape[2]
    batch, q_heads, t, d = q8.shape
    group = q_heads // k8.shape[1]
    v8 = inputs.v_t[..., :s].transpose(2, 3)                                # [B, Hkv, S, D]
    qk_scale = 1.4426950408889634 / d ** 0.5
    out = torch.empty(batch, q_heads, t, d)
    for b in range(batch):
        for h in range(q_heads):
            kv = h // group
            q_scale = inputs.q_scale[b, h].repeat_interleave(inputs.block)[:t, None]    # [T, 1]
            m, l = torch.full((t,), float("-inf")), torch.zeros(t)
            acc, unit = torch.zeros(t, d), inputs.v_scale[b, kv, 0]
            for n0 in range(0, s, block_n):
                keys = torch.arange(n0, min(n0 + block_n, s))
                k_scale, v_scale = inputs.k_scale[b, kv, n0 // inputs.block], inputs.v_scale[b, kv, n0 // inputs.block]
                scores = (q8[b, h].float() @ k8[b, kv, keys].float().T) * (qk_scale * q_scale * k_scale)
                if causal:
                    scores = scores.masked_fill(keys[None, :] > torch.arange(t)[:, None] + s - t, float("-inf"))
                m_new = torch.maximum(m, scores.max(dim=1).values)
                ref = torch.where(m_new == float("-inf"), 0.0, m_new)
                alpha, p = torch.exp2(m - ref), torch.exp2(scores - (ref - P_SHIFT.value)[:, None])
                l = l * alpha + p.sum(dim=1)
                acc = acc * (alpha * unit / v_scale)[:, None] + p.to(q8.dtype).float() @ v8[b, kv, keys].float()
                m, unit = m_new, v_scale
            out[b, h] = acc * unit / l[:, None]
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_fp8_changes_of_v_unit_are_exact(causal):
    """Every key with the same K row: each query's scores are equal, so every P is exactly 2^8 (no rounding) and
    row i's output is the mean of the dequantized V rows it sees, even with V's blocks 600 times apart in scale."""
    from flashcourse.engine.fp8 import fp8_block, fp8_forward, prepare_fp8

    block = fp8_block()
    gen = torch.Generator().manual_seed(0)
    s, t = 3 * block + 5, 2 * block + 3
    q = torch.randn(1, 2, t, 32, generator=gen)
    k = torch.randn(1, 1, 1, 32, generator=gen).expand(1, 1, s, 32).contiguous()
    v = torch.randn(1, 1, s, 32, generator=gen)
    v[:, :, block:2 * block] *= 30
    v[:, :, 2 * block:] *= 0.05
    inputs = prepare_fp8(q.to(RT.device), k.to(RT.device), v.to(RT.device))
    got = fp8_forward(inputs, causal=causal, out_dtype=torch.float32).cpu()
    values = _dequantize(inputs.v_t[..., :s].transpose(2, 3).cpu(), inputs.v_scale.cpu(), block)[0, 0]  # [S, D]
    seen = torch.arange(s)[None, :] <= torch.arange(t)[:, None] + s - t if causal else torch.ones(t, s, dtype=torch.bool)
    want = (seen.float() @ values) / seen.sum(1, keepdim=True)                                          # [T, D]
    # exact up to FP32 rounding in the interpreter; Hopper's FP8 tensor cores keep about 14 bits of their sums
    tol = 1e-5 if RT.interpret else 1e-3
    torch.testing.assert_close(got[0], want.expand(2, t, 32), rtol=tol, atol=tol * float(v.abs().max()))


@pytest.mark.skipif(RT.interpret, reason="Triton's interpreter rounds FP32 to e4m3 wrongly when rounding up crosses "
                    "a power of two (1.98 becomes 1.0), so only the compiled kernel can match the emulation")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d", [16, 64])
def test_fp8_kernel_matches_its_arithmetic(causal, d):
    """The compiled FP8 kernel computes what its description says (emulated in PyTorch), V's blocks 30x apart;
    at D = 16 its Q Kᵀ runs in fp16, on the same e4m3 values.

    Both round P to e4m3, but from FP32 scores summed in different orders, so a P on a rounding boundary can
    land one e4m3 step apart and move its row by a few per cent of V's largest value, and the FP8 tensor cores
    keep about 14 bits of their sums (rows agreed to about 2^-14 of V's largest value on the H200). So the
    median row must agree to 2^-12 and the mean row to 2e-3; a wrong scale or a missed change of V's unit
    moves most rows by a large fraction of V."""
    from flashcourse.engine.fp8 import fp8_block, fp8_forward, fp8_fwd_tuned, prepare_fp8

    block = fp8_block()
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 300, d, generator=gen), *(torch.randn(1, 2, 2 * block + 51, d, generator=gen)
                                                           for _ in range(2))
    v[:, :, block:2 * block] *= 30
    v[:, :, 2 * block:] *= 0.05
    inputs = prepare_fp8(q.to(RT.device), k.to(RT.device), v.to(RT.device))
    got = fp8_forward(inputs, causal=causal, out_dtype=torch.float32).cpu()
    cpu = type(inputs)(**{name: x.cpu() if torch.is_tensor(x) else x for name, x in vars(inputs).items()})
    want = _fp8_emulated(cpu, causal, fp8_fwd_tuned.best_config.kwargs["BLOCK_N"])
    row_error = (got - want).abs().amax(dim=-1) / float(v.abs().max())     # [B, Hq, T]
    assert row_error.median() < 2.0**-12 and row_error.mean() < 2e-3, (row_error.median(), row_error.mean())


@pytest.mark.parametrize("rotate", [False, True])
def test_fp8_attention_near_the_reference(rotate):
    """FP8 (interpreted on a CPU, compiled on a GPU) against float64 attention, GQA, odd T and S: RMS error < 5e-2."""
    from flashcourse.engine.fp8 import fp8_attention, random_rotation

    rotation = random_rotation(32, seed=0, device=RT.device) if rotate else None
    got = fp8_attention(ODD.q, ODD.k, ODD.v, rotation=rotation).cpu().double()
    want = reference.attention(ODD.q.cpu(), ODD.k.cpu(), ODD.v.cpu())
    assert (got - want).pow(2).mean().sqrt() < 5e-2


def test_fp8_attention_near_the_reference_below_d32():
    """At D = 16, where Q Kᵀ runs in fp16 on the e4m3 values (an 8-bit product sums 32 values or more), FP8
    attention against float64, causal, GQA: RMS error < 5e-2, as at D = 32."""
    from flashcourse.engine.fp8 import fp8_attention

    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 4, 45, 16, generator=gen), *(torch.randn(1, 2, 51, 16, generator=gen) for _ in range(2))
    got = fp8_attention(q.to(RT.device), k.to(RT.device), v.to(RT.device)).cpu().double()
    assert (got - reference.attention(q, k, v)).pow(2).mean().sqrt() < 5e-2


# --- step 5: FlashAttention-3's schedule in Gluon ------------------------------------------------------------


def test_hopper_attention_refuses_what_it_cannot_run():
    """hopper_attention with fallback=False: a ValueError for shapes and dtypes it does not take, naming them
    and fast_attention; on a machine without a Hopper GPU a RuntimeError that says so."""
    from flashcourse.engine.hopper import hopper_attention

    q = torch.randn(1, 2, 256, 64, dtype=torch.bfloat16)
    for bad, words in (((q.float(), q.float(), q.float()), "torch.float32"),
                       ((torch.randn(1, 2, 256, 32, dtype=torch.bfloat16),) * 3, "D = 32")):
        with pytest.raises(ValueError, match=words) as raised:
            hopper_attention(*bad, fallback=False)
        assert "fast_attention" in str(raised.value)
    with pytest.raises(ValueError, match="query_offset must be >= 0"):
        hopper_attention(q, q[:, :, :128], q[:, :, :128], fallback=False)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="Hopper|Gluon"):
            hopper_attention(q, q, q, fallback=False)


def test_hopper_attention_falls_back_to_fast_attention():
    """By default, inputs the schedule cannot run (here: no Hopper GPU, or fp32) are computed by 08's
    `attention`: 05's fast_attention, for any head dimension and for causal queries before key 0 too."""
    from flashcourse.engine.any_input import attention
    from flashcourse.engine.fast_attention import fast_attention
    from flashcourse.engine.hopper import hopper_attention

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=gen).to(RT.device) for _ in range(3))
    assert torch.equal(hopper_attention(q, k, v), fast_attention(q, k, v))
    assert torch.equal(hopper_attention(q, k, v, causal=False, query_offset=3),
                       fast_attention(q, k, v, causal=False, query_offset=3))
    before = hopper_attention(q, k[:, :, :20], v[:, :, :20])          # T = 40 > S = 20: queries 0-19 see no key
    assert torch.equal(before[:, :, :20], torch.zeros_like(before[:, :, :20]))
    assert torch.equal(before[:, :, 20:], fast_attention(q[:, :, 20:], k[:, :, :20], v[:, :, :20], query_offset=0))
    wide = torch.randn(1, 2, 40, 40, generator=gen).to(RT.device)
    assert torch.equal(hopper_attention(wide, wide, wide), attention(wide, wide, wide))


def test_hopper_schedule_follows_the_measured_rule():
    """Persistent causal up to T = 4k and always without a mask; the ping-pong without a mask up to T = 2k at
    D = 128 only; three consumers causal at D = 64 from T = 8k."""
    from flashcourse.engine.hopper import hopper_consumers, hopper_overlap, hopper_schedule

    assert [hopper_consumers(t, 64, True) for t in (1024, 2048, 4096, 8192, 16384)] == [2, 2, 2, 3, 3]
    assert [hopper_overlap(t, 128, True) for t in (1024, 2048, 4096, 16384)] == [True, True, False, False]
    assert not hopper_overlap(1024, 128, False)
    assert hopper_consumers(16384, 128, True) == hopper_consumers(16384, 64, False) == 2

    assert hopper_schedule(1024, 128, True) == (True, False)
    assert hopper_schedule(4096, 128, True) == (True, False)
    assert hopper_schedule(16384, 128, True) == (False, False)
    assert hopper_schedule(1024, 128, False) == hopper_schedule(2048, 128, False) == (True, True)
    assert hopper_schedule(4096, 128, False) == (True, False)
    assert hopper_schedule(1024, 64, False) == hopper_schedule(2048, 64, False) == (True, False)
    assert hopper_schedule(1024, 64, True) == (True, False)


def test_hopper_report():
    """--hopper's table: one row per shape, the ratios to cuDNN and to fast_attention from its columns."""
    from flashcourse.bench.fast import HOPPER_SCHEDULES, hopper_report

    row = {"dtype": "bf16", "causal": True, "d": 128, "q_heads": 32, "kv_heads": 8, "t": 1024, "batch": 32,
           "fast_attention": 400.0, "hopper_attention": 500.0, "SDPA cuDNN": 500.0, "SDPA flash": 250.0,
           "fast error": 1e-3, "hopper error": 2e-3, **{name: 100.0 + i for i, name in enumerate(HOPPER_SCHEDULES)}}
    text = hopper_report({"environment": "a test", "prefill": [row]})
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len(table) == 3 and len({line.count("|") for line in table}) == 1
    assert table[2] == ("| bf16 | yes | 128 | 32/8 | 1024 | 32 | 400.0 | 500.0 | 500.0 | 250.0 | 1.00 | 1.00 | 1.25 | "
                        "1.0e-03 | 2.0e-03 | 100.0 | 101.0 | 102.0 | 103.0 |")


def test_time_row_takes_turns_and_keeps_the_median(monkeypatch):
    """Rounds alternate the order of the implementations (a, b, c, then c, b, a) and every pair of rounds starts
    one place later (b, c, a, then a, c, b), so that each takes every place; each keeps the median of its rounds
    (not one lucky round), and one that fails every round is NaN, not a number from another round."""
    import math

    from flashcourse.bench import fast

    calls, times = [], {"a": [2.0, 1.0, 2.0, 4.0], "b": [2.0, 8.0, 4.0, 4.0], "c": [math.nan] * 4}
    monkeypatch.setattr(fast, "_ms", lambda fn: fn())

    def timed(name):
        def run():
            calls.append(name)
            return times[name][calls.count(name) - 1]
        return run
    monkeypatch.setattr(fast, "_or_nan", lambda measure, fn: measure(fn))
    row = {}
    fast._time_row(row, {name: timed(name) for name in "abc"}, flops=1e9, rounds=4)
    assert calls == ["a", "b", "c", "c", "b", "a", "b", "c", "a", "a", "c", "b"]
    assert row["rounds"] == 4 and row["rotated"] and row["statistic"] == "median"
    assert row["a"] == 0.5 and row["b"] == 0.25 and math.isnan(row["c"])   # a's best round alone would be 1.0


def test_hopper_grid_takes_its_rounds(monkeypatch, tmp_path):
    """--hopper --rounds 3 times every implementation of every row three times and keeps the median: the rounds
    reach prefill_hopper's timing, and the saved row and the report say how it was timed."""
    import json

    from flashcourse.bench import fast
    from flashcourse.engine import fast_attention, hopper

    calls = []
    monkeypatch.setattr(fast.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fast, "environment", lambda: "a test")
    monkeypatch.setattr(fast, "_prefill_cases", lambda grid: iter([(
        dict(dtype="bf16", causal=True, d=64, q_heads=2, kv_heads=2, t=128, batch=1), None, None, None, 1e9,
        {"SDPA cuDNN": lambda: calls.append("cuDNN"), "SDPA flash": lambda: calls.append("flash")})]))
    monkeypatch.setattr(hopper, "hopper_attention", lambda *args, **kwargs: calls.append("hopper"))
    monkeypatch.setattr(fast_attention, "fast_attention", lambda *args, **kwargs: calls.append("fast"))
    monkeypatch.setattr(fast, "max_error", lambda *args: 0.0)
    monkeypatch.setattr(fast, "_ms", lambda fn: fn() or 2.0)
    out = tmp_path / "grid.md"
    assert fast.main(["--hopper", "--rounds", "3", "--json", str(tmp_path / "grid.json"), "--out", str(out)]) == 0
    (row,) = json.loads((tmp_path / "grid.json").read_text())["prefill"]
    assert row["rounds"] == 3 and row["statistic"] == "median"
    assert "TFLOP/s: the median of 3 rounds" in out.read_text()
    old = {"environment": "a test", "prefill": [{k: v for k, v in row.items() if k != "rounds"}]}
    assert "rounds" not in fast.hopper_report(old)                 # grids saved before --hopper took rounds
    # eight implementations a round (two course kernels, two SDPA backends, four schedules), each timed three
    # times, then each kernel once more for its error
    assert calls.count("cuDNN") == calls.count("flash") == calls.count("fast") - 1 == 3
    assert calls.count("hopper") == 5 * 3 + 1 and row["hopper_attention"] == 1e9 / 2.0 / 1e9


def test_fp8_prepare_takes_its_rounds(monkeypatch, tmp_path):
    """--fp8-prepare --rounds 3 times fp8_attention end to end and its neighbours three times a row and keeps the
    median; the report says so (its rows saved before rounds existed say nothing of them)."""
    import json

    from flashcourse.bench import fast
    from flashcourse.engine import fp8, hopper

    calls = []

    def fake(name):
        return lambda *args, **kwargs: calls.append(name)
    monkeypatch.setattr(fast.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fast, "environment", lambda: "a test")
    monkeypatch.setattr(fast, "_inputs", lambda *args: (None, None, None))
    monkeypatch.setattr(fast, "_sdpa", lambda *args: fake("cuDNN"))
    for name in ("prepare_fp8_torch", "fp8_inputs_equal", "max_error", "rms_error"):
        monkeypatch.setattr(fast, name, lambda *args: 0.0)
    for name in ("fp8_attention", "fp8_forward", "hopper_fp8_forward", "prepare_fp8", "random_rotation"):
        monkeypatch.setattr(fp8, name, fake(name))
    monkeypatch.setattr(hopper, "hopper_attention", fake("hopper_attention"))
    monkeypatch.setattr(fast, "_ms", lambda fn: fn() or 2.0)
    out = tmp_path / "fp8.md"
    assert fast.main(["--fp8-prepare", "--rounds", "3", "--json", str(tmp_path / "fp8.json"), "--out", str(out)]) == 0
    rows = json.loads((tmp_path / "fp8.json").read_text())["fp8_prepare"]
    assert len(rows) == len(fast.FP8_PREPARE) and all(r["rounds"] == 3 and r["statistic"] == "median" for r in rows)
    assert calls.count("cuDNN") == 3 * len(rows)
    assert calls.count("fp8_attention") == (3 + 1) * len(rows)     # three rounds, then once for its errors
    # the Gluon kernel on Q quantized by prepare_fp8 and on Q left to its consumers: three rounds each, then the
    # former once for its errors
    assert calls.count("hopper_fp8_forward") == (2 * 3 + 1) * len(rows)
    report = out.read_text()
    assert "TFLOP/s: the median of 3 rounds" in report and "| prepare K, V (ms) |" in report
    old = {"environment": "a test", "fp8_prepare": [{k: v for k, v in rows[0].items()
                                                     if k not in ("rounds", "prepare_kv_ms",
                                                                  "FP8 Gluon kernel, Q in bf16")}]}
    assert "rounds" not in fast.fp8_prepare_report(old) and "Q in bf16" not in fast.fp8_prepare_report(old)


@pytest.mark.parametrize("choice", ["consumers", "overlap", "tma_store"])
def test_choice_report(choice):
    """--consumers', --overlap's and --tma-store's table: one row per shape, the second setting over the first and
    each over cuDNN from its columns, and how many rounds each figure is the median (or best) of."""
    from flashcourse.bench.fast import HOPPER_CHOICES, choice_report

    first, second = HOPPER_CHOICES[choice][1]
    row = {"dtype": "bf16", "causal": True, "d": 64, "q_heads": 32, "kv_heads": 8, "t": 4096, "batch": 8,
           "SDPA cuDNN": 400.0, "SDPA flash": 300.0, "hopper_attention": 420.0, first: 390.0, second: 420.0,
           "identical": False}
    table = [line for line in choice_report({"environment": "a test", choice: [row]}, choice).splitlines()
             if line.startswith("|")]
    assert len(table) == 3 and len({line.count("|") for line in table}) == 1
    assert table[0].count(first) == 3 and table[0].count(second) == 3   # its column, the ratio and over cuDNN
    assert table[2] == ("| bf16 | yes | 64 | 32/8 | 4096 | 8 | 400.0 | 300.0 | 420.0 | 390.0 | 420.0 | 1.077 | "
                        "0.975 | 1.050 | 1.050 | no |")
    # the rounds a run took and their statistic are stated; a row saved before --rounds existed was the best of
    # two, one saved before the median the best of its rounds
    assert "the best of 2 rounds" in choice_report({"environment": "a test", choice: [row]}, choice)
    assert "the best of 5 rounds" in choice_report({"environment": "a test", choice: [{**row, "rounds": 5}]}, choice)
    median = {**row, "rounds": 5, "statistic": "median"}
    assert "the median of 5 rounds" in choice_report({"environment": "a test", choice: [median]}, choice)


def test_fp8_schedule_report():
    """--fp8-schedule's table: one row per shape, its FP8 default over step 5's choice, over bf16 and over cuDNN
    from its columns, and how many rounds each figure is the median (or best) of."""
    from flashcourse.bench.fast import FP8_SCHEDULE_STEPS, fp8_schedule_report

    steps = list(FP8_SCHEDULE_STEPS)
    row = {"causal": False, "t": 2048, "batch": 16, "rounds": 3, "SDPA cuDNN": 640.0, "hopper_attention": 600.0,
           **dict(zip(steps, (720.0, 700.0, 750.0, 792.0))), "identical": True}
    text = fp8_schedule_report({"environment": "a test", "fp8_schedule": [row]})
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len(table) == 3 and len({line.count("|") for line in table}) == 1
    assert table[2] == "| no | 2048 | 16 | 640.0 | 600.0 | 720.0 | 700.0 | 750.0 | 792.0 | 1.100 | 1.320 | 1.238 | yes |"
    assert "the best of 3 rounds, every other round in reverse order." in text   # timed before the order moved
    moved = fp8_schedule_report({"environment": "a test", "fp8_schedule": [{**row, "rotated": True}]})
    assert "the best of 3 rounds, every other round in reverse order, each pair of rounds starting one place" in moved


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU")
def test_hopper_bench_refuses_a_cpu(capsys):
    """--hopper, --consumers, --overlap, --tma-store and --fp8-schedule measure nothing without a GPU and say so."""
    from flashcourse.bench import GPU_NEEDED
    from flashcourse.bench.fast import main

    for mode in ("--hopper", "--consumers", "--overlap", "--tma-store", "--fp8-schedule"):
        assert main([mode]) == 1
        assert GPU_NEEDED in capsys.readouterr().out


def test_hopper_plot_draws_the_saved_grid(tmp_path):
    """hopper_plot on the saved H200 grid: three panels, one line per implementation or schedule, a PNG written."""
    import json

    from flashcourse import bench
    from flashcourse.bench.fast import HOPPER_NAMES, HOPPER_SCHEDULES, hopper_plot

    grid = json.loads(bench.measured("fast_hopper.json").read_text())
    figure = hopper_plot(grid, str(tmp_path / "hopper.png"))
    assert [len(ax.lines) for ax in figure.axes] == [len(HOPPER_NAMES)] * 2 + [len(HOPPER_SCHEDULES) + 1]
    assert all(len(line.get_xdata()) >= 4 for ax in figure.axes for line in ax.lines)
    assert (tmp_path / "hopper.png").stat().st_size > 10_000


def test_fp8_schedule_plot_draws_the_saved_run(tmp_path):
    """fp8_schedule_plot on the saved H100 run: a bar per implementation and shape, at the table's heights."""
    import json

    from flashcourse import bench
    from flashcourse.bench.fast import FP8_SCHEDULE_STEPS, fp8_schedule_plot

    result = json.loads(bench.measured("fp8_schedule.json").read_text())
    figure = fp8_schedule_plot(result, str(tmp_path / "fp8.png"))
    bars = figure.axes[0].containers
    assert len(bars) == 2 + len(FP8_SCHEDULE_STEPS)
    assert [b.get_height() for b in bars[-1]] == [r["+ o by TMA"] for r in result["fp8_schedule"]]
    assert (tmp_path / "fp8.png").stat().st_size > 10_000


SM90_DRIVER = """
class Sm90Driver:  # stands in for the GPU driver: the target it names is an H100/H200's
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


triton.runtime.driver.set_active(Sm90Driver())
"""

SM90_SASS = """
def wgmma_loops(cubin):
    # The SASS loops (a branch back to a label) that hold wgmma (HGMMA in 16 bits, QGMMA in 8), each a list of lines
    path = os.path.join(os.environ["TRITON_CACHE_DIR"], "kernel.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    sass = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout
    labels, code = {}, []
    for line in sass.splitlines():
        label = re.match(r"\\s*(\\.L_x_\\d+):", line)
        if label:
            labels[label.group(1)] = len(code)
        elif re.match(r"\\s+/\\*[0-9a-f]{4,}\\*/", line):
            code.append(line)
    loops = []
    for end, line in enumerate(code):
        target = re.search(r"BRA[^;]*?(\\.L_x_\\d+)", line)
        if target and labels.get(target.group(1), end) < end:
            body = code[labels[target.group(1)]:end + 1]
            if any("GMMA" in x for x in body):
                loops.append(body)
    return loops


def loops_without_selects(cubin):
    # The 16-bit wgmma loops with no select (SEL, FSEL): a mask compiles into selects on every score, so these are
    # tile loops without mask code
    return sum(any("HGMMA" in x for x in body) and not any(re.search(r"\\bF?SEL\\b", x) for x in body)
               for body in wgmma_loops(cubin))


def tile_loop_shuffles(cubin):
    # The shuffles (SHFL) in the shortest wgmma loop, the tile loop: values moved between a warp's threads
    return sum("SHFL" in x for x in min(wgmma_loops(cubin), key=len))


"""

SM90_COMPILE = """
import contextlib, io, json, os, re, subprocess, sys

import torch
import triton  # imported before the course's runtime turns the interpreter on (there is no GPU here), so that
from triton.experimental.gluon import language  # Gluon's own standard functions are compiled ones
from triton.backends.compiler import GPUTarget

from flashcourse import runtime
from flashcourse.engine import hopper as fk

if fk.gluon is None:
    print(json.dumps({"no gluon": triton.__version__}))
    sys.exit(0)
os.environ["TRITON_INTERPRET"] = "0"
runtime.pin_hopper_ptxas()  # as the runtime does on a Hopper GPU

""" + SM90_DRIVER + SM90_SASS + """gl, results = fk.gl, []


def descriptor(x, block, dtype):
    return fk.GluonDescriptor.from_tensor(x, block, gl.NVMMASharedLayout.get_default_for(block, dtype))


for d, causal, pingpong, persistent, store_lse, fp8, consumers, overlap, tma_store, qq in json.loads(sys.argv[1]):
    torch_dtype, dtype = (torch.float8_e4m3fn, gl.float8e4nv) if fp8 else (torch.bfloat16, gl.bfloat16)
    q_desc = (descriptor(torch.empty(512, d, dtype=torch.bfloat16), [64, d], gl.bfloat16) if qq else
              descriptor(torch.empty(512, d, dtype=torch_dtype), [64, d], dtype))
    k_desc = descriptor(torch.empty(256, d, dtype=torch_dtype), [fk.HOPPER_BLOCK_N, d], dtype)
    v_desc = descriptor(torch.empty(d, 256, dtype=torch_dtype), [d, fk.HOPPER_BLOCK_N], dtype) if fp8 else k_desc
    scales = torch.empty(2, 2)
    with contextlib.redirect_stdout(io.StringIO()) as ptxas_log:   # TRITON_DUMP_PTXAS_LOG prints it
        compiled = fk.hopper_fwd_kernel.warmup(
            q_desc, k_desc, v_desc, torch.empty(1, 2, 256, d, dtype=torch.bfloat16), torch.empty(1, 2, 256), scales,
            scales, scales, torch.zeros(1, dtype=torch.int32), 256, 256, 2, 1, 2, 0, 2, 2, 0.1, D=d,
            BLOCK_N=fk.HOPPER_BLOCK_N, STAGES=3 if fp8 else fk.HOPPER_STAGES, CAUSAL=causal, PINGPONG=pingpong,
            PERSISTENT=persistent, STORE_LSE=store_lse, FP8=fp8, P_SHIFT=8 if fp8 else 0, CONSUMERS=consumers,
            OVERLAP=overlap, TMA_STORE=tma_store,
            o_desc=descriptor(torch.empty(512, d, dtype=torch.bfloat16), [64, d], gl.bfloat16) if tma_store else None,
            QQ=qq, q8_layout=gl.NVMMASharedLayout.get_default_for([64, d], gl.float8e4nv) if qq else None,
            num_warps=4, grid=(1,))
    ptx = compiled.asm["ptx"]
    results.append({"cubin": len(compiled.asm["cubin"]), "wgmma": ptx.count("wgmma.mma_async"),
                    "e4m3": ptx.count(".e4m3.e4m3"), "shared": compiled.metadata.shared,
                    "ptxas_log": "registers" in ptxas_log.getvalue(), "serialized": "C7512" in ptxas_log.getvalue(),
                    "tma_stores": ptx.count("cp.async.bulk.tensor.2d.global.shared"),
                    "registers": sorted({int(n) for n in re.findall(r"setmaxnreg\\.\\w+\\.sync\\.aligned\\.u32\\s+(\\d+)",
                                                                     ptx)}),
                    "loops_without_selects": loops_without_selects(compiled.asm["cubin"]),
                    "tile_loop_shuffles": tile_loop_shuffles(compiled.asm["cubin"])})
print(json.dumps(results))
"""


PIN_PTXAS = """
import json, os

from triton import knobs
from triton.backends.nvidia.compiler import get_ptxas

from flashcourse import runtime

try:
    cuda12 = knobs.nvidia.ptxas.version
except RuntimeError:  # this Triton ships no separate ptxas for older targets
    cuda12 = None
before = get_ptxas(90)
pinned = runtime.pin_hopper_ptxas()
print(json.dumps({"before": before.version, "after": get_ptxas(90).version, "pinned": pinned, "cuda12": cuda12,
                  "variable": os.environ.get("TRITON_PTXAS_BLACKWELL_PATH"), "again": runtime.pin_hopper_ptxas()}))
"""


def test_hopper_kernels_are_assembled_by_cuda_12s_ptxas():
    """pin_hopper_ptxas leaves sm_90 to a CUDA 12 ptxas, the one this Triton ships, whichever it would use (Triton
    3.9 took CUDA 13.4's, which serialized the overlapped schedules' products: the compile test above), and says
    so in TRITON_PTXAS_BLACKWELL_PATH for the processes it starts; a ptxas named there already is kept."""
    import json
    import os
    import subprocess
    import sys

    triton_nvidia = pytest.importorskip("triton.backends.nvidia.compiler")
    if not hasattr(triton_nvidia, "get_ptxas"):
        pytest.skip("this Triton has no get_ptxas: it chooses its ptxas itself")
    def pin_in_a_fresh_process(env):
        done = subprocess.run([sys.executable, "-c", PIN_PTXAS], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_PTXAS_BLACKWELL_PATH")}
    result = pin_in_a_fresh_process(env)
    if not (result["cuda12"] or "").startswith("12."):
        assert result["pinned"] is None and result["after"] == result["before"], result
        pytest.skip(f"this Triton ships no CUDA 12 ptxas ({result}): sm_90 is assembled as it chooses")
    assert result["after"].startswith("12."), result
    assert result["again"] is None, result                          # pinned once
    if result["before"].startswith("12."):
        assert result["pinned"] is None and result["variable"] is None, result
    else:
        assert result["pinned"] and result["variable"] == result["pinned"], result
    assert pin_in_a_fresh_process(env | {"TRITON_PTXAS_BLACKWELL_PATH": "/nonexistent/ptxas"})["pinned"] is None


def test_hopper_kernel_compiles_for_sm90_without_a_gpu(tmp_path):
    """hopper_fwd_kernel compiles to an sm_90 binary with this machine's Triton and no GPU (a stand-in driver names
    the target, Triton's own ptxas assembles it, in a fresh cache): a Gluon name that moved, as the TMA load did in
    Triton 3.9, fails here before it fails on a Hopper. Each binary holds wgmma (on e4m3 tiles where FP8, and only
    there), fits in shared memory and gives its consumers 232 registers, or 160 when there are three; with
    the overlap across items too, and o written by TMA copies (and only there), the overlap's two Q buffers and
    o's buffers side by side being the most shared memory any schedule asks for, and with FP8's Q quantized in the
    kernel (QQ), whose bf16 Q buffers and e4m3 copies take more than the same schedule's e4m3 Q. With the ptxas the
    runtime pins, ptxas does not serialize the products for want of registers (its warning C7512) but where three
    consumers overlap items, a pair never launched. The tile loop shuffles no
    more than its row reductions need, in FP8 too (P's relabelled keys stay in their threads). In bf16 without
    the overlap its SASS holds a tile loop with no select (the tiles every row sees whole, without mask code);
    under the overlap, where one loop decides each tile's mask, none."""
    import json
    import os
    import subprocess
    import sys

    configs = [  # D, causal, pingpong, persistent, STORE_LSE, FP8, consumers, overlap, TMA_STORE, QQ
        (128, True, True, True, False, False, 2, False, False, False),
        (64, False, False, False, True, False, 2, False, True, False),
        (128, False, True, False, True, False, 2, True, False, False),
        (128, True, False, True, False, True, 2, True, True, False),
        (64, False, True, False, True, True, 2, True, False, False),
        (64, True, True, True, False, False, 3, False, True, False),
        (64, True, False, False, True, False, 3, True, False, False),
        (128, True, True, True, True, False, 2, True, True, False),
        (128, True, False, True, False, False, 2, True, True, False),
        (128, True, False, True, False, True, 2, True, True, True),    # the fourth, Q quantized in the kernel
        (64, False, True, False, False, True, 2, False, False, True)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path),
                                                                             "TRITON_DUMP_PTXAS_LOG": "1"}
    done = subprocess.run([sys.executable, "-c", SM90_COMPILE, json.dumps(configs)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    if isinstance(results, dict):
        pytest.skip(f"Triton {results['no gluon']} has no Gluon layer: hopper_attention refuses, as tested above")
    assert len(results) == len(configs)
    for config, result in zip(configs, results):
        assert result["cubin"] > 0 and result["wgmma"] >= 4, (config, result)
        assert (result["e4m3"] == result["wgmma"]) if config[5] else not result["e4m3"], (config, result)
        assert result["shared"] <= 227 * 1024, (config, result)
        assert (result["tma_stores"] > 0) == config[8], (config, result)
        # ptxas does not serialize the products for want of registers (C7512), in FP8 too (its P relabelled at an
        # item's end through its own layout), but for three consumers with the overlap, a pair hopper_attention
        # never launches (hopper_consumers, hopper_overlap); CUDA 13.4's ptxas, Triton 3.9's own for sm_90,
        # serialized every overlapped schedule: the runtime pins CUDA 12's (pin_hopper_ptxas)
        assert result["ptxas_log"] and (config[6] == 3 and config[7] or not result["serialized"]), (config, result)
        # the tile loop shuffles at most what its row reductions need (max and sum: two rows a thread, two shuffles
        # each); in FP8 too, whose P keeps its values in each thread as it becomes the 8-bit operand (P's keys
        # relabelled): carrying P across took 24 in the kernel before (Triton 3.9, the default FP8 launch)
        assert result["tile_loop_shuffles"] <= 8, (config, result)
        consumer_registers, other = (160, 232) if config[6] == 3 else (232, 160)
        assert consumer_registers in result["registers"] and other not in result["registers"], (config, result)
        # without the overlap, the tiles every row sees whole run in a loop of their own with no mask code; under
        # it one loop decides each tile's mask at run time, and its selects stand in that loop (FP8's tile loops
        # hold selects of their own, with or without the mask)
        if config[7] or not config[5]:
            assert (result["loops_without_selects"] > 0) == (not config[7]), (config, result)
    assert results[9]["shared"] > results[3]["shared"], (results[9], results[3])


SM90_COMPILE_BACKWARD = """
import contextlib, io, json, os, re, subprocess, sys

import torch
import triton  # imported before the course's runtime turns the interpreter on, as in SM90_COMPILE
from triton.experimental.gluon import language
from triton.backends.compiler import GPUTarget

from flashcourse import runtime
from flashcourse.engine import hopper_backward as hb

if hb.gluon is None:
    print(json.dumps({"no gluon": triton.__version__}))
    sys.exit(0)
os.environ["TRITON_INTERPRET"] = "0"
runtime.pin_hopper_ptxas()  # as the runtime does on a Hopper GPU

""" + SM90_DRIVER + SM90_SASS + """results = []
for kernel, d, causal, atomic, regs in json.loads(sys.argv[1]):
    x = torch.empty(1, 2, 512, d, dtype=torch.bfloat16)
    f = torch.empty(1, 2, 512)
    scalars = (512, 512, 2, 1, 0, 0.1, 0.1)
    with contextlib.redirect_stdout(io.StringIO()) as ptxas_log:   # TRITON_DUMP_PTXAS_LOG prints it
        if kernel == "dkdv":
            ds_layout = hb._shared_layout([hb.BWD_BLOCK_M, hb.BWD_HALF_N], torch.bfloat16)
            compiled = hb.hopper_dkdv_kernel.warmup(
                hb._descriptor(x, hb.BWD_BLOCK_M), hb._descriptor(x, hb.BWD_BLOCK_M),
                hb._descriptor(x, hb.BWD_HALF_N), hb._descriptor(x, hb.BWD_HALF_N), f, f,
                hb._dq_descriptor(x.float()) if atomic else hb._descriptor(x, hb.BWD_BLOCK_M), x, x, *scalars,
                ds_layout, D=d, BLOCK_M=hb.BWD_BLOCK_M, HALF_N=hb.BWD_HALF_N, STAGES=hb.BWD_STAGES, CAUSAL=causal,
                ATOMIC_DQ=atomic, CONSUMER_REGS=regs, num_warps=4, grid=(1,))
        else:
            compiled = hb.hopper_dq_kernel.warmup(
                hb._descriptor(x, hb.DQ_HALF_M), hb._descriptor(x, hb.DQ_HALF_M), hb._descriptor(x, hb.DQ_BLOCK_N),
                hb._descriptor(x, hb.DQ_BLOCK_N), f, f, x, *scalars, D=d, HALF_M=hb.DQ_HALF_M,
                BLOCK_N=hb.DQ_BLOCK_N, STAGES=hb.DQ_STAGES, CAUSAL=causal, num_warps=4, grid=(1,))
    ptx = compiled.asm["ptx"]
    results.append({"cubin": len(compiled.asm["cubin"]), "wgmma": ptx.count("wgmma.mma_async"),
                    "adds": ptx.count("cp.reduce.async.bulk"),
                    "atomics": ptx.count("red.global") + ptx.count("atom.global"), "shared": compiled.metadata.shared,
                    "ptxas_log": "registers" in ptxas_log.getvalue(), "serialized": "C7512" in ptxas_log.getvalue(),
                    "registers": sorted({int(n) for n in re.findall(r"setmaxnreg\\.\\w+\\.sync\\.aligned\\.u32\\s+(\\d+)",
                                                                     ptx)}),
                    "loops_without_selects": loops_without_selects(compiled.asm["cubin"])})
print(json.dumps(results))
"""


def test_hopper_backward_kernels_compile_for_sm90_without_a_gpu(tmp_path):
    """Step 8's dK/dV and dQ kernels compile to sm_90 binaries with this machine's Triton and no GPU, as
    hopper_fwd_kernel does above: each holds wgmma and fits in shared memory, and only ATOMIC_DQ adds into dq, by TMA
    reductions (no atomics from registers). ptxas does not serialize the products for want of registers (its
    warning C7512, under which each wgmma waits for the one before), as Triton 3.6's did to the atomic kernel under
    a causal mask at D = 128 while the kernel formed its products transposed, and would to dQ's product issued a
    tile later at D = 128 (the kernel does that at D = 64 only). Each holds a tile loop with no select: under a
    causal mask the tiles the diagonal crosses run in a loop of their own. The dK/dV kernel's consumers get the
    registers asked (CONSUMER_REGS for consumer 1, the rest of 504 less the producer's 24 for consumer 0)."""
    import json
    import os
    import subprocess
    import sys

    configs = [("dkdv", 128, True, False, 232), ("dkdv", 128, True, True, 232), ("dkdv", 64, False, True, 240),
               ("dkdv", 64, True, True, 232), ("dkdv", 128, False, True, 240), ("dq", 128, True, False, None),
               ("dq", 64, False, False, None)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path),
                                                                             "TRITON_DUMP_PTXAS_LOG": "1"}
    done = subprocess.run([sys.executable, "-c", SM90_COMPILE_BACKWARD, json.dumps(configs)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    if isinstance(results, dict):
        pytest.skip(f"Triton {results['no gluon']} has no Gluon layer: hopper_backward falls back, as tested below")
    for (kernel, d, causal, atomic, regs), result in zip(configs, results):
        assert result["cubin"] > 0 and result["wgmma"] >= 4, (kernel, d, result)
        assert result["shared"] <= 227 * 1024, (kernel, d, result)
        assert (result["adds"] > 0) == atomic and result["atomics"] == 0, (kernel, d, atomic, result)
        assert result["ptxas_log"] and not result["serialized"], (kernel, d, result)
        # the tiles every row sees whole run in a loop of their own, with no mask code
        assert result["loops_without_selects"] > 0, (kernel, d, causal, result)
        if kernel == "dkdv":
            assert regs in result["registers"] and 504 - 24 - regs in result["registers"], (regs, result)


SM90_COMPILE_FP8 = """
import json, sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.tools.tensor_descriptor import TensorDescriptor

# The course's runtime would choose the interpreter (no GPU here), and @triton.jit reads that choice when the
# module is imported: it is shown a Hopper instead, so that fp8_fwd_kernel is a kernel to compile.
torch.cuda.is_available = lambda: True
torch.cuda.get_device_name = lambda *args: "an sm_90 target on a CPU"
torch.cuda.get_device_capability = lambda *args: (9, 0)
""" + SM90_DRIVER + """
from flashcourse.engine import fp8

results = []
for d, block_m, block_n, warps in json.loads(sys.argv[1]):
    q8 = torch.empty(1, 2, 256, d, dtype=torch.float8_e4m3fn)
    v_t = torch.empty(2, d, 256, dtype=torch.float8_e4m3fn)
    o = torch.empty(1, 2, 256, d, dtype=torch.bfloat16)
    scales = torch.empty(2, 2)
    compiled = fp8.fp8_fwd_kernel.warmup(
        q8, TensorDescriptor.from_tensor(q8.view(2, 256, d), [1, block_n, d]),
        TensorDescriptor.from_tensor(v_t, [1, d, block_n]), o, scales, scales, scales, *q8.stride()[:3],
        *o.stride()[:3], 256, 256, 0, 2, 1, 2, 2, 0.1, D=d, BLOCK_M=block_m, BLOCK_N=block_n, SCALE_BLOCK=128,
        CAUSAL=True, num_warps=warps, num_stages=3, grid=(1,))
    ptx = compiled.asm["ptx"]
    results.append({"cubin": len(compiled.asm["cubin"]), "e4m3": ptx.count(".e4m3.e4m3"),
                    "f16": ptx.count(".f16.f16")})
print(json.dumps(results))
"""


def test_fp8_forward_compiles_for_sm90_without_a_gpu(tmp_path):
    """fp8_fwd_kernel compiles to an sm_90 binary with each of its GPU tile shapes, at D = 16, 64 and 128 (a
    stand-in driver names the target). An 8-bit product sums 32 values or more, so below D = 32 Q Kᵀ runs in fp16
    (which holds every e4m3 value) and only P V reads e4m3; from D = 32 both products do."""
    import json
    import os
    import subprocess
    import sys

    configs = [(d, block_m, block_n, warps) for d in (16, 64, 128) for block_m, block_n, warps in [(128, 128, 8),
                                                                                                  (64, 64, 4)]]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", SM90_COMPILE_FP8, json.dumps(configs)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == len(configs)
    for (d, *_), result in zip(configs, results):
        assert result["cubin"] > 0 and result["e4m3"] > 0, (d, result)
        assert (result["f16"] > 0) == (d < 32), (d, result)


def test_hopper_attention_train_runs_06s_kernels_where_gluon_cannot():
    """Off a Hopper GPU hopper_attention_train is 06's flash_attention_train, gradients bit for bit (GQA 2, T = 20
    after S = 28 keys, D = 16), and hopper_backward(fallback=False) says why the Gluon kernels refused."""
    from flashcourse.engine.backward import flash_attention_lse, flash_attention_train
    from flashcourse.engine.hopper_backward import hopper_attention_train, hopper_backward

    torch.manual_seed(0)
    q = torch.randn(1, 4, 20, 16, device=RT.device, dtype=RT.dtype)
    k, v = (torch.randn(1, 2, 28, 16, device=RT.device, dtype=RT.dtype) for _ in range(2))
    do = torch.randn_like(q)
    grads = []
    for train in (hopper_attention_train, flash_attention_train):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        train(*leaves).backward(do)
        grads.append([x.grad for x in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    o, lse = flash_attention_lse(q, k, v)
    with pytest.raises((ValueError, RuntimeError), match="hopper"):
        hopper_backward(q, k, v, o, lse, do, fallback=False)


def test_dkdv_registers_follow_the_measured_rule():
    """dkdv_registers picks, on every row of the saved --registers run where the two splits lay more than 2 %
    apart, the faster one, for the dQ path hopper_backward takes at that length."""
    import json

    from flashcourse.bench.hopper_backward import REGISTER_COLUMNS, REGISTER_SPLITS, register_column
    from flashcourse.engine.hopper_backward import ONE_KERNEL_FROM_T, dkdv_registers

    rows = json.loads(open("benchmarks/results/2026-12-07-h100-backward-registers.json").read())["registers"]
    fewer, more = REGISTER_COLUMNS
    decided = [r for r in rows if abs(r[more] / r[fewer] - 1) > 0.02]
    assert len(decided) >= 4
    for r in decided:
        faster = max(REGISTER_SPLITS, key=lambda regs: r[register_column(regs)])
        assert dkdv_registers(r["d"], r["causal"], r["t"] >= ONE_KERNEL_FROM_T) == faster, r


def test_registers_bench_times_both_splits(monkeypatch, tmp_path):
    """--registers times hopper_backward at each split and cuDNN, five rounds a row, asks for the split it names,
    and reports each split over the other and over cuDNN; its plot draws from the saved run."""
    import json

    from flashcourse.bench import hopper_backward as bench
    from flashcourse.engine import hopper, hopper_backward

    asked = []
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "environment", lambda: "a test")
    monkeypatch.setattr(bench, "_row_inputs", lambda causal, d, t, kv: (*[torch.zeros(1)] * 4, 1e12, dict(
        causal=causal, d=d, t=t, q_heads=32, kv_heads=kv, batch=1)))
    monkeypatch.setattr(hopper, "hopper_attention_lse", lambda *args, **kwargs: (None, None))
    monkeypatch.setattr(hopper_backward, "hopper_backward",
                        lambda *args, consumer_registers, **kwargs: asked.append(consumer_registers) or (
                            torch.zeros(1), torch.zeros(1), torch.full((1,), float(consumer_registers == 240))))
    monkeypatch.setattr(bench, "_sdpa", lambda *args: lambda q, k, v: None)
    monkeypatch.setattr(bench.torch.autograd, "grad", lambda *args, **kwargs: None)
    monkeypatch.setattr(bench, "_time_row", lambda row, timings, flops, rounds: row.update(
        {n: (200.0 if n == "SDPA cuDNN" else float(n.split()[0])) for n in timings}, rounds=rounds))
    out = tmp_path / "regs.md"
    assert bench.main(["--registers", "--json", str(tmp_path / "regs.json"), "--out", str(out)]) == 0
    rows = json.loads((tmp_path / "regs.json").read_text())["registers"]
    assert len(rows) == len(bench.REGISTER_ROWS) and all(r["rounds"] == bench.REGISTER_ROUNDS for r in rows)
    assert asked.count(232) == asked.count(240) == len(rows)          # each split asked once a row, for its bits
    assert not any(r["dk, dv identical"] for r in rows)                # dv differed between the fakes
    assert "| 232 | 240 | 200 | 1.034 | 1.160 | 1.200 | no |" in out.read_text()
    saved = json.loads(open("benchmarks/results/2026-12-07-h100-backward-registers.json").read())
    bench.registers_plot(saved, str(tmp_path / "regs.png"))
    assert (tmp_path / "regs.png").stat().st_size > 10_000


def test_hopper_backward_report_and_plot_from_the_saved_run(tmp_path):
    """The Gluon backward's saved run: a table row per measured shape with its ratio to cuDNN (the committed
    numbers), and a plot with one group of bars per implementation, written as a PNG."""
    import json

    from flashcourse import bench
    from flashcourse.bench.hopper_backward import BACKWARD, ROWS, plot, report

    result = json.loads(bench.measured("hopper_backward.json").read_text())
    assert [(r["causal"], r["d"], r["t"], r["kv_heads"]) for r in result["rows"]] == ROWS
    text = report(result)
    first = result["rows"][0]
    assert f"| {first['Gluon bwd'] / first['SDPA cuDNN bwd']:.2f} |" in text
    assert text.count("| causal D128 T8k 32/32 |") == 2          # the backward table and the training table
    figure = plot(result, str(tmp_path / "backward.png"))
    assert len(figure.axes[0].containers) == len(BACKWARD)
    assert all(len(bars) == len(ROWS) for bars in figure.axes[0].containers)
    assert (tmp_path / "backward.png").stat().st_size > 10_000


def test_gradient_error_sees_each_gradient():
    """The backward benchmarks' error: zero for the naive attention's own FP32 gradients (GQA 2, causal, T = 6
    after S = 9 keys), and the size of a change made to any one of dq, dk and dv in the heads it compares."""
    from flashcourse.bench.gradients import gradient_error, gradients, naive_attention

    gen = torch.Generator().manual_seed(5)
    q, do = (torch.randn(1, 4, 6, 8, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 2, 9, 8, generator=gen) for _ in range(2))
    exact = gradients(lambda q, k, v: naive_attention(q, k, v, True), q, k, v, do)
    assert gradient_error(exact, q, k, v, do, True) < 1e-6
    for i in range(3):
        changed = [g.clone() for g in exact]
        changed[i][0, 0, 2, 3] += 0.25
        assert abs(gradient_error(changed, q, k, v, do, True) - 0.25) < 1e-5


def test_prepare_fp8_can_leave_q_to_the_kernel():
    """prepare_fp8(quantize_q=False) leaves Q as it came (q_scale None) and quantizes K and V as before; fp8_forward,
    which reads Q in e4m3, refuses such inputs by name; and fp8_attention on bf16 inputs, where the Gluon kernel does
    not run, quantizes Q itself: the o of fp8_forward on inputs prepared whole."""
    from flashcourse.engine.fp8 import fp8_attention, fp8_forward, prepare_fp8

    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=gen).to(RT.device, torch.bfloat16) for _ in range(3))
    left, whole = prepare_fp8(q, k, v, quantize_q=False), prepare_fp8(q, k, v)
    assert left.q_scale is None and torch.equal(left.q, q)
    for name in ("k", "v_t"):
        assert torch.equal(getattr(left, name).view(torch.uint8), getattr(whole, name).view(torch.uint8)), name
    assert torch.equal(left.k_scale, whole.k_scale) and torch.equal(left.v_scale, whole.v_scale)
    with pytest.raises(ValueError, match="quantize_q=True"):
        fp8_forward(left)
    assert torch.equal(fp8_attention(q, k, v), fp8_forward(whole, out_dtype=torch.bfloat16))


def test_hopper_fp8_forward_refuses_what_it_cannot_run():
    """hopper_fp8_forward names why it cannot run and fp8_forward instead: here, no Hopper GPU, or on one D = 16;
    fp8_attention then computes with fp8_forward."""
    from flashcourse.engine.fp8 import fp8_attention, fp8_forward, hopper_fp8_forward, prepare_fp8

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=gen).to(RT.device) for _ in range(3))
    inputs = prepare_fp8(q, k, v)
    with pytest.raises(ValueError, match="D = 64 or 128.*use fp8_forward|Hopper GPU.*use fp8_forward"):
        hopper_fp8_forward(inputs)
    assert torch.equal(fp8_attention(q, k, v), fp8_forward(inputs))
