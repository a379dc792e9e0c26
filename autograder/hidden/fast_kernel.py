"""Hidden checks for 05_fast_kernel, under Triton's interpreter on a CPU (float32) or compiled on a GPU.

Correctness and the structure of the steps, never speed: the diagonal split gives what the single
masked loop gives, the autotuned launch what explicit blocks give, and the split-KV decode what the
unsplit one gives, for split counts that leave chunks empty too. 04's hidden checks are reused for
prefill, GQA, block skipping and the window. Shapes are seeded; T and S divide by no block size.
"""

import random

import torch

from autograder.hidden import triton_flash as h04
from flashcourse.checks import core as ac
from flashcourse.checks import triton_flash as kc
from flashcourse import runtime
from flashcourse.checks import reference


def _dims():
    rt = runtime.current()
    return rt, ((16, 32) if rt.interpret else (64, 128))


def test_validation(fast_attention, fast_decode) -> None:
    """The visible test's ValueErrors on other shapes: fast_attention's own three, fast_decode's."""
    rt = runtime.current()
    base = dict(q_heads=4, kv_heads=2, t=5, s=12, dtype=rt.dtype, device=rt.device, seed=60)
    ac.check_raises(fast_attention, ac.make_case("window=2, causal=False, blocks given", window=2, causal=False,
                                                 block_m=16, block_n=16, **base), "a sliding window needs causal=True")
    ac.check_raises(fast_attention, ac.make_case("block_n=32 alone", block_n=32, **base),
                    "give both block_m and block_n, or neither")
    ac.check_raises(fast_attention, ac.make_case("query_offset=-4", query_offset=-4, **base),
                    "a causal query before key 0 sees no key")
    decode = dict(s=20, dtype=rt.dtype, device=rt.device, seed=61)
    ac.check_raises(fast_decode, ac.make_case("D=48", q_heads=2, kv_heads=2, t=1, d=48, **decode),
                    "the head dimension 48 is not a power of two")
    ac.check_raises(fast_decode, ac.make_case("Hq=6, Hkv=4", q_heads=6, kv_heads=4, t=1, **decode),
                    "6 query heads cannot be shared evenly by 4 KV heads")
    ac.check_raises(fast_decode, ac.make_case("T=3", q_heads=2, kv_heads=2, t=3, **decode),
                    "decode takes one query per sequence")


def test_prefill(fast_attention) -> None:
    """04's prefill and GQA checks with explicit blocks, then the autotuned launch (no blocks given)."""
    h04.test_prefill(fast_attention)
    h04.test_gqa(fast_attention)
    rt, dims = _dims()
    rng = random.Random(51)
    cases = [ac.make_case(f"autotuned, T={t}, S={s}, group {hq // hkv}", batch=b, q_heads=hq, kv_heads=hkv, t=t, s=s,
                          d=rng.choice(dims), dtype=rt.dtype, device=rt.device, seed=rng.randrange(10**6))
             for b, hq, hkv, t, s in ((2, 2, 2, 37, 37), (1, 4, 1, 21, 50), (1, 2, 2, 1, 29))]
    kc.check_cases(fast_attention, cases)


def _compare(fast_attention, c: ac.Case, words: str) -> None:
    """The split and the single loop, each right, and equal to each other within the dtype's tolerance."""
    kc.check_cases(fast_attention, [c.with_kwargs(split_diagonal=False)])
    try:
        kc.check_cases(fast_attention, [c.with_kwargs(split_diagonal=True)])
    except AssertionError as error:
        raise AssertionError(f"{error} The single masked loop gets this case right and the split does not: {words}") \
            from None
    single, split = c.with_kwargs(split_diagonal=False).call(fast_attention), c.call(fast_attention)
    rtol, atol = ac.tolerance(c.q.dtype)
    if not torch.allclose(split.float(), single.float(), rtol=rtol, atol=atol):
        raise AssertionError(f"{c.describe()}: split_diagonal=True and False differ by "
                             f"{(split.float() - single.float()).abs().max():.2e}")


def test_diagonal_split(fast_attention) -> None:
    """Unmasked tiles below the diagonal, masked ones on it: the same output as one masked loop."""
    rt, dims = _dims()
    rng = random.Random(52)
    words = ac.STEP_HINTS["split_diagonal"]
    for (block_m, block_n), t, s, offset in (((16, 16), 37, 37, None), ((32, 16), 45, 45, None),
                                              ((16, 32), 40, 40, None), ((16, 16), 9, 60, 13),
                                              ((32, 16), 20, 71, None), ((16, 16), 30, 30, 0),
                                              ((16, 16), 37, 21, 0)):  # queries past the last key
        spec = dict(query_offset=offset) if offset is not None else {}
        c = kc.case(f"{block_m}x{block_n}, T={t}, S={s}", q_heads=2, kv_heads=1, t=t, s=s, d=rng.choice(dims),
                    block_m=block_m, block_n=block_n, dtype=rt.dtype, device=rt.device, seed=rng.randrange(10**6),
                    **spec)
        _compare(fast_attention, c, words)
    gen = torch.Generator().manual_seed(rng.randrange(10**6))
    q, k, v = (torch.randn(1, 2, 33, dims[0], generator=gen).to(rt.device, rt.dtype) for _ in range(3))
    want = reference.attention(q.cpu(), k.cpu(), v.cpu(), causal=False)
    rtol, atol = ac.tolerance(rt.dtype)
    for split in (True, False):
        got = fast_attention(q, k, v, causal=False, block_m=16, block_n=16, split_diagonal=split).cpu().double()
        assert torch.allclose(got, want, rtol=rtol, atol=atol), (
            f"causal=False, T=S=33, 16x16 blocks, split_diagonal={split}: every query sees every key, max |error| "
            f"{(got - want).abs().max():.2e}. Without the causal mask only the last, partial tile needs a mask.")


def test_window_and_skipping(fast_attention) -> None:
    """04's block-skipping and sliding-window checks: NaN past the last visible key is never read."""
    h04.test_block_skipping(fast_attention)
    h04.test_window(fast_attention)


def test_decode(fast_decode) -> None:
    """Split-KV decode against the reference and against one split, GQA 1-8, empty chunks included."""
    rt, dims = _dims()
    rng = random.Random(53)
    rtol, atol = ac.tolerance(rt.dtype)
    # More splits than keys (64) where S is short. For the longer caches 8 splits already leave chunks empty
    # under 16-key chunks, and S = 1 here (and S = 5 in the visible test) leaves them empty under any chunking:
    # 64 splits there would cost the interpreter most of this test and catch nothing more.
    for batch, q_heads, kv_heads, s, split_counts in ((1, 2, 2, 1, (None, 3, 8, 64)), (2, 4, 1, 45, (None, 3, 8)),
                                                      (1, 8, 4, 70, (None, 3, 8)), (1, 8, 1, 33, (None, 3, 8, 64))):
        gen = torch.Generator().manual_seed(rng.randrange(10**6))
        d = rng.choice(dims)
        q = torch.randn(batch, q_heads, 1, d, generator=gen).to(rt.device, rt.dtype)
        k = torch.randn(batch, kv_heads, s, d, generator=gen).to(rt.device, rt.dtype)
        v = torch.randn(batch, kv_heads, s, d, generator=gen).to(rt.device, rt.dtype)
        want = reference.attention(q.cpu(), k.cpu(), v.cpu())
        one = fast_decode(q, k, v, splits=1)
        where = f"B={batch}, Hq={q_heads}, Hkv={kv_heads}, S={s}, D={d}"
        assert torch.allclose(one.cpu().double(), want, rtol=rtol, atol=atol), (
            f"fast_decode, {where}, splits=1: max |error| {(one.cpu().double() - want).abs().max():.2e} against the "
            "reference (one chunk holding every key, so the split kernel itself is wrong)")
        for splits in split_counts:
            got = fast_decode(q, k, v, splits=splits).cpu().double()
            if not torch.allclose(got, want, rtol=rtol, atol=atol):
                error = (got - want).abs().max()
                raise AssertionError(f"fast_decode, {where}, splits={splits}: max |error| {error:.2e}, while splits=1 "
                                     f"is right. The mistake is in {ac.STEP_HINTS['splits']}")
