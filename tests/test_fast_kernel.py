"""05's engine (fast_attention, decode, fast_lse) on small shapes: Triton's interpreter on a CPU, compiled on
a GPU."""

import pytest
import torch

from flashcourse.checks import core as ac
from flashcourse.checks import triton_flash as kc
from flashcourse import runtime
from flashcourse.checks import reference
from flashcourse.engine.decode import fast_decode
from flashcourse.engine.fast_attention import fast_attention

RT = runtime.current()
# T = 45, S = 51, GQA 2, 32 x 16 blocks: neither T nor S divides into the blocks.
ODD = kc.case("odd", batch=2, q_heads=4, kv_heads=2, t=45, s=51, d=32, block_m=32, block_n=16, dtype=RT.dtype,
              device=RT.device)
WINDOW = kc.case("window", q_heads=2, kv_heads=2, t=40, window=6, block_m=16, block_n=16, dtype=RT.dtype,
                 device=RT.device)


def test_standard_cases_autotuned():
    """Prefill, chunked prefill, decode, GQA and large scores through the autotuned launch."""
    kc.check_cases(fast_attention, ac.standard_cases(RT.dtype, RT.device))


@pytest.mark.parametrize("split", [True, False])
def test_split_and_single_loop(split):
    """T = 45, S = 51, GQA 2, 32 x 16 blocks: the diagonal split and the single loop both match."""
    kc.check_cases(fast_attention, [ODD.with_kwargs(split_diagonal=split)])


@pytest.mark.parametrize("tma", [True, False])
def test_descriptor_and_pointer_loads(tma):
    """K and V through tensor descriptors or through pointers: both match, with GQA, odd T and S, a window."""
    kc.check_cases(fast_attention, [ODD.with_kwargs(tma=tma)])
    kc.check_window(fast_attention, [WINDOW.with_kwargs(tma=tma)])


def test_without_host_descriptors(monkeypatch):
    """A Triton older than 3.4 (no host-built descriptors) falls back to 04's pointer loads."""
    from flashcourse.engine import fast_attention as engine

    monkeypatch.setattr(engine, "TensorDescriptor", None)
    assert not engine.tma_supported(ODD.q)
    kc.check_cases(engine.fast_attention, [ODD])


def test_exp_and_exp2_agree():
    """exp2 with log2(e) in the scale computes the same softmax as exp."""
    q, k, v = (torch.randn(1, 2, 40, 16, device=RT.device, dtype=RT.dtype) for _ in range(3))
    rtol, atol = ac.tolerance(RT.dtype)
    assert torch.allclose(fast_attention(q, k, v, exp2=False), fast_attention(q, k, v), rtol=rtol, atol=atol)


def test_not_causal():
    """causal=False: every query sees every key, T != S."""
    q = torch.randn(1, 2, 20, 16, device=RT.device, dtype=RT.dtype)
    k, v = (torch.randn(1, 1, 37, 16, device=RT.device, dtype=RT.dtype) for _ in range(2))
    want = reference.attention(q.cpu(), k.cpu(), v.cpu(), causal=False)
    rtol, atol = ac.tolerance(RT.dtype)
    assert torch.allclose(fast_attention(q, k, v, causal=False).cpu().double(), want, rtol=rtol, atol=atol)


def test_window_and_nan_past_the_queries():
    """A window, and queries in the middle of a cache whose tail is NaN."""
    kc.check_window(fast_attention, [WINDOW])
    kc.check_block_skipping(fast_attention, [kc.case("middle", q_heads=2, kv_heads=1, t=12, s=80, query_offset=25,
                                                     block_m=16, block_n=16, dtype=RT.dtype, device=RT.device)])


@pytest.mark.parametrize("splits", [None, 1, 3, 40])
def test_decode_splits(splits):
    """fast_decode, GQA 4, S = 50: any split count, 40 leaving most chunks empty, matches the reference."""
    q = torch.randn(2, 8, 1, 32, device=RT.device, dtype=RT.dtype)
    k, v = (torch.randn(2, 2, 50, 32, device=RT.device, dtype=RT.dtype) for _ in range(2))
    rtol, atol = ac.tolerance(RT.dtype)
    want = reference.attention(q.cpu(), k.cpu(), v.cpu())
    assert torch.allclose(fast_decode(q, k, v, splits=splits).cpu().double(), want, rtol=rtol, atol=atol)


def test_validation():
    """04's ValueErrors; fast_decode rejects T != 1; a window needs causal attention; blocks come in pairs."""
    kc.check_validation(fast_attention, RT.device, RT.dtype)
    q = torch.randn(1, 2, 4, 16, device=RT.device, dtype=RT.dtype)
    for call in (lambda: fast_decode(q, q, q), lambda: fast_attention(q, q, q, window=2, causal=False),
                 lambda: fast_attention(q, q, q, block_m=16), lambda: fast_attention(q, q, q, query_offset=-1)):
        with pytest.raises(ValueError):
            call()


def test_engine_passes_hidden_validation():
    from autograder.hidden import fast_kernel as hidden

    hidden.test_validation(fast_attention, fast_decode)


@pytest.mark.parametrize("grade_id", ["test_prefill", "test_diagonal_split", "test_window_and_skipping",
                                      "test_decode", "test_validation"])
def test_visible_cells_pass_the_engine(grade_id):
    """05's visible test cells (hidden tests removed), run on the exported engine."""
    from autograder.building import build

    cell = next(c for c in build.solution_cells("05_fast_kernel").cells
                if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)
    exec(cell.source, {"fast_attention": fast_attention, "fast_decode": fast_decode})  # noqa: S102  (the course's cell)


def test_check_against_baseline_names_the_switched_step():
    """A step that breaks only when switched on is named; a baseline that is wrong too gets its own message."""
    case = ac.make_case("prefill", q_heads=2, kv_heads=1, t=9, s=9, seed=5)

    def broken_split(q, k, v, split_diagonal=True):
        out = reference.attention(q, k, v).to(q.dtype)
        return out + 1.0 if split_diagonal else out

    with pytest.raises(AssertionError, match="With split_diagonal=False the same case is right.*unmasked tile"):
        ac.check_against_baseline(broken_split, [case], {"split_diagonal": False}, ac.STEP_HINTS["split_diagonal"])

    def broken_everywhere(q, k, v, split_diagonal=True):
        return reference.attention(q, k, v).to(q.dtype) + 1.0

    with pytest.raises(AssertionError) as error:
        ac.check_against_baseline(broken_everywhere, [case], {"split_diagonal": False},
                                  ac.STEP_HINTS["split_diagonal"])
    assert "split_diagonal=False" in str(error.value) and "unmasked tile" not in str(error.value)
    ac.check_against_baseline(lambda q, k, v, split_diagonal=True: reference.attention(q, k, v).to(q.dtype), [case],
                              {"split_diagonal": False}, ac.STEP_HINTS["split_diagonal"])


# --- the given steps: a forward that returns lse, decode at short caches and in one launch ----------------

def attention_lse_float64(q, k, v, offset, causal):
    """(o, lse) in float64: query i at offset + i, key j at j; a row that sees no key gets o = 0, lse = -inf."""
    q, k, v = (x.cpu().double() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5                   # [B, Hq, T, S]
    if causal:
        t, s = scores.shape[-2:]
        scores = scores.masked_fill(torch.arange(s)[None, :] > torch.arange(t)[:, None] + offset, float("-inf"))
    lse = torch.logsumexp(scores, -1)                                       # [B, Hq, T]
    weights = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return weights @ v, lse


@pytest.mark.parametrize("t, s, offset, causal", [(45, 51, None, True), (20, 37, None, False), (30, 30, -7, True),
                                                  (33, 60, 3, True)])
def test_fast_attention_lse_against_float64(t, s, offset, causal):
    """o and lse (natural log, FP32) against float64, GQA 2, T and S no multiple of a block; a negative offset
    leaves the first rows without a key: o = 0 and lse = -inf there, as 06's flash_attention_lse."""
    from flashcourse.engine.fast_lse import fast_attention_lse

    gen = torch.Generator().manual_seed(t + s)
    q, k, v = (torch.randn(2, h, n, 16, generator=gen).to(RT.device, RT.dtype)
               for h, n in ((4, t), (2, s), (2, s)))
    o, lse = fast_attention_lse(q, k, v, query_offset=offset, causal=causal)
    want_o, want_lse = attention_lse_float64(q, k, v, s - t if offset is None else offset, causal)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, t)
    rtol, atol = ac.tolerance(RT.dtype)
    torch.testing.assert_close(o.cpu().double(), want_o, rtol=rtol, atol=atol)
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(want_lse)), "rows without a key must have lse = -inf"
    seen = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.cpu().double()[seen], want_lse[seen], rtol=rtol, atol=atol)
    assert (offset is None or offset >= 0) or not seen.all(), "the negative offset must leave rows without a key"


def test_fast_attention_lse_gives_the_fast_kernels_output():
    """The same attention as fast_attention, explicit blocks or autotuned."""
    from flashcourse.engine.fast_lse import fast_attention_lse

    rtol, atol = ac.tolerance(RT.dtype)
    for blocks in ({}, {"block_m": 32, "block_n": 16}):
        o, _ = fast_attention_lse(ODD.q, ODD.k, ODD.v, **blocks)
        torch.testing.assert_close(o, fast_attention(ODD.q, ODD.k, ODD.v, **blocks), rtol=rtol, atol=atol)


def test_short_cache_splits():
    """One wave of programs (4 'multiprocessors' on a CPU), each split at least one tile of keys; decode with
    those splits matches the reference."""
    from flashcourse.engine.decode import decode_launch, short_cache_splits

    tile = decode_launch(RT.device)["BLOCK_N"]
    processors = torch.cuda.get_device_properties(RT.device).multi_processor_count if RT.device == "cuda" else 4
    assert short_cache_splits(1, 1, 1, RT.device) == 1
    assert short_cache_splits(1, 1, 2 * tile + 1, RT.device) == min(3, processors)
    assert short_cache_splits(1, 1, 1000 * tile, RT.device) == processors
    assert short_cache_splits(processors, 2, 1000 * tile, RT.device) == 1     # more (batch, KV head)s than processors
    q = torch.randn(2, 4, 1, 16, device=RT.device, dtype=RT.dtype)
    k, v = (torch.randn(2, 2, 3 * tile - 5, 16, device=RT.device, dtype=RT.dtype) for _ in range(2))
    splits = short_cache_splits(2, 2, k.shape[2], RT.device)
    want = reference.attention(q.cpu(), k.cpu(), v.cpu(), causal=False)
    rtol, atol = ac.tolerance(RT.dtype)
    assert torch.allclose(fast_decode(q, k, v, splits=splits).cpu().double(), want, rtol=rtol, atol=atol)


def test_decode_tickets_grow_and_stay():
    """The counters are zeros, allocated once per device: a smaller request gets the same tensor, a larger one
    a new tensor of zeros that is kept from then on."""
    from flashcourse.engine.decode import decode_tickets

    small = decode_tickets(RT.device, 3)
    assert small.dtype == torch.int32 and small.numel() >= 3 and not small.any()
    assert decode_tickets(RT.device, 1).data_ptr() == small.data_ptr()
    large = decode_tickets(RT.device, small.numel() + 1)
    assert large.numel() > small.numel() and not large.any()
    assert decode_tickets(RT.device, 2).data_ptr() == large.data_ptr()


def test_fused_decode_validation():
    """fused_decode's ValueErrors: 04's checks, T != 1, splits < 1."""
    from flashcourse.engine.decode import fused_decode

    q = torch.randn(1, 2, 4, 16, device=RT.device, dtype=RT.dtype)
    for call in (lambda: fused_decode(q, q, q), lambda: fused_decode(q[:, :, :1], q, q, splits=0),
                 lambda: fused_decode(q[:, :, :1], q[:, :1], q)):
        with pytest.raises(ValueError):
            call()


def test_decode_tickets_refuse_to_allocate_inside_a_capture(monkeypatch):
    """Counters allocated during a CUDA graph capture would belong to the graph's memory: refused, with the fix."""
    from flashcourse.engine import decode

    monkeypatch.setattr(decode, "_DECODE_TICKETS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="before capturing"):
        decode.decode_tickets("cuda:0", 8)


def test_decode_fused_report():
    """--decode-fused's table: one row per (B, S), the shares of the same-bytes copy as percentages."""
    from flashcourse.bench.fast import decode_fused_report

    row = {"batch": 1, "s": 8192, "splits": 16, "copy_same_bytes": 3.0, "fused_decode": 2.7, "fast_decode": 2.5,
           "SDPA cuDNN": 2.0, "fused_decode error": 1e-3, "fast_decode error": 1e-3}
    text = decode_fused_report({"environment": "a test", "decode_fused": [row]})
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len(table) == 3 and len({line.count("|") for line in table}) == 1
    assert table[2].startswith("| 1 | 8192 | 16 | 2.70 | 2.50 | 2.00 | 3.00 | 90 % | 83 % | 1.08 | 1.35 |")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU")
def test_decode_fused_refuses_a_cpu(capsys):
    """--decode-fused measures nothing without a GPU and says so."""
    from flashcourse.bench import GPU_NEEDED
    from flashcourse.bench.fast import main

    assert main(["--decode-fused"]) == 1
    assert GPU_NEEDED in capsys.readouterr().out


@pytest.mark.parametrize("window, offset", [(6, None), (1, None), (20, -7)])
def test_fast_attention_lse_applies_a_window(window, offset):
    """A window in the lse kernel, also with queries before key 0: o as the reference's, lse as its log-sum-exp
    (-inf where a query sees no key); a window needs causal attention and at least one key."""
    import math

    from flashcourse.checks import reference
    from flashcourse.engine.fast_lse import fast_attention_lse

    q, k, v = (x.float() for x in (ODD.q, ODD.k, ODD.v))
    t, s = q.shape[2], k.shape[2]
    qp = torch.arange(t) + (s - t if offset is None else offset)
    o, lse = fast_attention_lse(q, k, v, query_offset=offset, window=window, block_m=16, block_n=16)
    seen = qp >= 0
    want = reference.attention(q[:, :, seen], k, v, query_positions=qp[seen], window=window).float()
    assert torch.allclose(o[:, :, seen], want, atol=1e-4), float((o[:, :, seen] - want).abs().max())
    assert (o[:, :, ~seen] == 0).all()
    group = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    keys = torch.arange(s)
    visible = (keys[None, :] <= qp[:, None]) & (keys[None, :] > qp[:, None] - window)
    want_lse = torch.logsumexp(scores.masked_fill(~visible, -math.inf), -1)
    assert torch.allclose(lse, want_lse, atol=1e-4), float((lse - want_lse).nan_to_num().abs().max())
    for bad in (dict(window=0), dict(window=4, causal=False)):
        with pytest.raises(ValueError, match="window"):
            fast_attention_lse(q, k, v, **bad)


def test_ncu_summary_reads_the_raw_page(tmp_path):
    """Nsight Compute's raw CSV: each metric by name, the duration in microseconds whatever its unit, the five
    largest stall reasons without "selected", and a missing metric as NaN."""
    import math

    from flashcourse.bench.fast import NCU_METRICS, ncu_summary

    stalls = {"barrier": 3.14, "wait": 1.47, "long_scoreboard": 1.03, "no_instruction": 0.45, "gmma": 0.2,
              "dispatch_stall": 0.29, "selected": 1.0}
    values = {NCU_METRICS["duration_us"]: "0.588", NCU_METRICS["warps_active_per_sm"]: "11.999",
              NCU_METRICS["issue_active_per_cycle"]: "0.35", NCU_METRICS["tensor_pipe_pct"]: "1,058.0",
              **{f"smsp__average_warps_issue_stalled_{k}_per_issue_active.ratio": str(v) for k, v in stalls.items()}}
    header = ["Kernel Name", *values]
    units = ["", *("ms" if name == NCU_METRICS["duration_us"] else "" for name in values)]
    path = tmp_path / "raw.csv"
    path.write_text("==PROF== a line that is not a row\n" + "\n".join(
        ",".join(f'"{cell}"' for cell in row) for row in
        (header, units, ["hopper_fwd_kernel(args)", *values.values()])) + "\n")
    (kernel,) = ncu_summary(str(path), 1024)
    assert kernel["kernel"] == "hopper_fwd_kernel" and kernel["t"] == 1024
    assert kernel["duration_us"] == pytest.approx(588.0)
    assert kernel["warps_active_per_sm"] == pytest.approx(11.999) and kernel["issue_active_per_cycle"] == 0.35
    assert kernel["tensor_pipe_pct"] == pytest.approx(1058.0)
    assert list(kernel["stalls_per_issue"]) == ["barrier", "wait", "long_scoreboard", "no_instruction",
                                                "dispatch_stall"]
    assert math.isnan(kernel["dram_active_pct"])
