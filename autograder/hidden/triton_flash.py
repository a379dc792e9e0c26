"""Hidden checks for 04_triton_flash, under Triton's interpreter on a CPU (float32) or compiled on a GPU.

Shapes are random but seeded, with T and S not multiples of the block sizes. On a CPU they stay
small (the interpreter runs each program in Python); on a GPU the head dimensions grow to 64 and
128 and the dtype is the runtime's (bf16, or fp16 without bf16 tensor cores). The warm-up kernels
work in float32 everywhere.
"""

import random

from flashcourse.checks import triton_flash as kc
from flashcourse import runtime
from flashcourse.checks import triton_warmup as wc

BLOCKS = [(16, 16), (32, 16), (16, 32), (32, 32), (64, 32)]


def _setting():
    rt = runtime.current()
    dims = (16, 32) if rt.interpret else (16, 64, 128)
    return rt, dims


def _case(name, rng, dims, rt, **spec):
    block_m, block_n = spec.pop("blocks", rng.choice(BLOCKS))
    return kc.case(name, d=spec.pop("d", rng.choice(dims)), block_m=block_m, block_n=block_n,
                   dtype=rt.dtype, device=rt.device, seed=rng.randrange(10**6), **spec)


def _odd(rng, low, high, block):
    """A length in [low, high] that is not a multiple of `block`."""
    while True:
        n = rng.randint(low, high)
        if n % block:
            return n


def test_tile_copy(tile_copy) -> None:
    """Shapes that divide by the blocks and shapes that do not, several block sizes, a single row and column."""
    device = runtime.current().device
    rng = random.Random(36)
    for block_m, block_n in BLOCKS:
        shapes = [(m, rng.randint(m, 80)) for m in (rng.randint(1, 70), rng.randint(1, 70))]
        wc.check_tile_copy(tile_copy, [*shapes, (block_m, 2 * block_n)], block_m=block_m, block_n=block_n,
                           device=device)
    wc.check_tile_copy(tile_copy, [(1, 1), (1, 33), (33, 40)], device=device)


def test_row_softmax(row_softmax) -> None:
    """Row lengths of 1, a power of two, and others; scores near 1000 and far below 0."""
    device = runtime.current().device
    inputs = [wc.softmax_input(rows, cols, seed=seed) for seed, (rows, cols) in
              enumerate(((3, 1), (2, 64), (5, 33), (7, 100), (2, 127)))]
    inputs += [wc.softmax_input(3, 50, seed=9, large=-3000.0), wc.softmax_input(2, 20, seed=10)[:1]]
    wc.check_row_softmax(row_softmax, inputs, device=device)


def test_score_tile(score_tile) -> None:
    """Several shapes, head dimensions 16 to 64 and block sizes; M and N dividing by no block."""
    device = runtime.current().device
    rng = random.Random(37)
    for block_m, block_n in BLOCKS:
        shapes = [(rng.randint(1, 70), rng.randint(1, 70), rng.choice((16, 32, 64))) for _ in range(2)]
        wc.check_score_tile(score_tile, shapes, block_m=block_m, block_n=block_n, seed=rng.randrange(10**6),
                            device=device)


def test_running_stats(running_stats) -> None:
    """Several shapes and tile sizes, with -inf tiles, empty rows, scores near 1000, N dividing or not."""
    device = runtime.current().device
    rng = random.Random(38)
    for block_m, block_n in BLOCKS:
        rows, cols = rng.randint(4, 50), rng.randint(2 * block_n + 1, 100)
        wc.check_running_stats(running_stats, [wc.scores_input(rows, cols, block_n, seed=rng.randrange(10**6)),
                                               wc.scores_input(rows, 3 * block_n, block_n, seed=rng.randrange(10**6))],
                               block_m=block_m, block_n=block_n, device=device)


def test_validation(flash_attention) -> None:
    """ValueError for D = 24 and 8, Hq % Hkv != 0, and (with a GPU) k and v on another device."""
    rt = runtime.current()
    kc.check_validation(flash_attention, rt.device, rt.dtype)


def test_prefill(flash_attention) -> None:
    """T = S, one KV head per query head, every block size, T not a multiple of the blocks, batches."""
    rt, dims = _setting()
    rng = random.Random(41)
    cases = []
    for block_m, block_n in BLOCKS:
        t = _odd(rng, 20, 90, block_m * block_n)
        heads = rng.choice((1, 2, 3))
        cases.append(_case(f"prefill {block_m}x{block_n}", rng, dims, rt, blocks=(block_m, block_n),
                           batch=rng.choice((1, 2)), q_heads=heads, kv_heads=heads, t=t))
    cases.append(_case("prefill, one query", rng, dims, rt, q_heads=2, kv_heads=2, t=1))
    cases.append(_case("prefill, large scores", rng, dims, rt, q_heads=1, kv_heads=1, t=45, score_scale=20.0))
    kc.check_cases(flash_attention, cases)


def test_offset(flash_attention) -> None:
    """Chunked prefill (T < S) and decode (T = 1) at the default offset S - T."""
    rt, dims = _setting()
    rng = random.Random(42)
    cases = []
    for block_m, block_n in BLOCKS[:4]:
        s = _odd(rng, 40, 100, block_n)
        cases.append(_case(f"chunked prefill {block_m}x{block_n}", rng, dims, rt, blocks=(block_m, block_n),
                           batch=2, q_heads=2, kv_heads=2, t=_odd(rng, 3, s - 10, block_m), s=s))
        cases.append(_case(f"decode {block_m}x{block_n}", rng, dims, rt, blocks=(block_m, block_n),
                           batch=2, q_heads=2, kv_heads=2, t=1, s=s))
    kc.check_cases(flash_attention, cases)


def test_query_offset(flash_attention) -> None:
    """Explicit query offsets: 0, in the middle of the cache, and for decode."""
    rt, dims = _setting()
    rng = random.Random(46)
    explicit = []
    for t, s, offset in ((7, 60, 20), (1, 45, 30), (33, 70, 5), (1, 50, 0)):
        explicit.append(_case(f"query_offset={offset}", rng, dims, rt, batch=1, q_heads=2, kv_heads=2,
                              t=t, s=s, query_offset=offset))
    kc.check_cases(flash_attention, explicit)


def test_gqa(flash_attention) -> None:
    """Grouped-query attention with 1, 2, 4 and 8 query heads per KV head: head h reads KV head h // group."""
    rt, dims = _setting()
    rng = random.Random(43)
    cases = []
    for group in (1, 2, 4, 8):
        kv_heads = rng.choice((1, 2)) if group < 8 else 1
        t = _odd(rng, 10, 50, 16)
        cases.append(_case(f"GQA group {group}", rng, dims, rt, batch=rng.choice((1, 2)),
                           q_heads=group * kv_heads, kv_heads=kv_heads, t=t))
    kc.check_cases(flash_attention, cases)


def test_block_skipping(flash_attention) -> None:
    """Keys no query may see (a preallocated cache past the queries) are NaN: the output must stay finite."""
    rt, dims = _setting()
    rng = random.Random(44)
    cases = []
    for block_m, block_n in BLOCKS:
        t = _odd(rng, 5, 50, block_m)
        offset = rng.randint(0, 30)
        s = offset + t + rng.randint(block_n + 1, 2 * block_n + 7)      # at least one whole tile past the queries
        cases.append(_case(f"cache past the queries, {block_m}x{block_n}", rng, dims, rt,
                           blocks=(block_m, block_n), q_heads=2, kv_heads=2, t=t, s=s, query_offset=offset))
    cases.append(_case("decode into a preallocated cache", rng, dims, rt, blocks=(16, 16), q_heads=2, kv_heads=2,
                       t=1, s=80, query_offset=20))
    kc.check_block_skipping(flash_attention, cases)


def test_window(flash_attention) -> None:
    """Sliding window: several widths and block sizes against reference.attention(window=w)."""
    rt, dims = _setting()
    rng = random.Random(45)
    cases = []
    for window, (block_m, block_n) in zip((1, 5, 16, 23, 40), BLOCKS):
        t = _odd(rng, 30, 90, block_n)
        cases.append(_case(f"window {window}", rng, dims, rt, blocks=(block_m, block_n), batch=rng.choice((1, 2)),
                           q_heads=2, kv_heads=2, t=t, window=window))
    kc.check_window(flash_attention, cases)


def test_window_skipping(flash_attention) -> None:
    """Sliding window: NaN in the keys before the window of each block stays unread, decode included."""
    rt, dims = _setting()
    rng = random.Random(47)
    skipped = [_case("window, whole tiles before it", rng, dims, rt, blocks=(16, 16), q_heads=2, kv_heads=2,
                     t=10, s=90, window=20),
               _case("window, decode", rng, dims, rt, blocks=(16, 32), q_heads=2, kv_heads=2, t=1, s=77, window=9)]
    kc.check_block_skipping(flash_attention, skipped)
