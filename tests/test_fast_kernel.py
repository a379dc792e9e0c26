"""The exported fast kernel of 05 on small shapes: Triton's interpreter on a CPU, compiled on a GPU."""

import pytest
import torch

from flashcourse import attention_checks as ac
from flashcourse import kernel_checks as kc
from flashcourse import reference, runtime
from flashcourse.engine.fast_kernel import fast_attention, fast_decode

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
    from flashcourse.engine import fast_kernel

    monkeypatch.setattr(fast_kernel, "TensorDescriptor", None)
    assert not fast_kernel.tma_supported(ODD.q)
    kc.check_cases(fast_kernel.fast_attention, [ODD])


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
    from autograder import build

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
