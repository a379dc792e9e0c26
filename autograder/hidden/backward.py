"""Hidden checks for 06_backward: the forward with its log-sum-exp and the backward pass, in PyTorch and
as Triton kernels.

Each check runs on its own variety of shapes: T and S odd, tiles that do not divide them, GQA 4:1 and
2:1 beside Hq = Hkv, chunked prefill and custom positions, rows whose first tiles or all keys are
invisible. The GQA cases are kept out of the other backward checks, so a dk/dv written per query head
loses the GQA points alone. Tolerances are flashcourse.checks.core.TOLERANCES for float32 (1e-4
relative and absolute) against torch.autograd through the float64 reference; every case is seeded but the memory
probe's, drawn when it runs (checks.core.unpredictable_seed).

The Triton checks run each kernel alone, as the notebook's parts do: Δ from o and do; dK/dV and dQ from
q, k, v, do and the exact lse and Δ, so a mistake in one kernel never costs another's points. They run in
float32, under the interpreter on a CPU (small shapes) or compiled on a GPU (head dimension 64, four times
longer sequences and offsets, true FP32 products through the kernels' input_precision="ieee"), so the float32
tolerances hold everywhere and a failure is a mistake, not rounding. How close bf16 gets is measured by
tests/test_backward_kernel_gpu.py, not graded. Most lengths are multiples of no block size, so a (batch, head)
ends in a padded block, and there are always several heads and, with GQA, two KV heads and two sequences, so
rows past T that leak into the next head, a KV head that sums the wrong query heads and an index that leaves
out the batch can show. Both gradient kernels also run with blocks other than their launcher's own (16 x 16,
32 x 16, 16 x 64), where loop bounds that hold for one ratio of BLOCK_M to BLOCK_N fail for another, and with
causal=False and T != S. An unmasked store of Δ is caught only when the program order leaves its padding in
place (it also writes past the end of Δ). Under the interpreter programs run one after another, so a dQ race
cannot show on a CPU; compiled, test_backward_dq also runs a case of 64 queries over 4096 keys five times,
where many programs would add into the same rows of dQ at once.

Memory has no hidden check: the visible one of its cell, measured from outside on one head scaled up
until its [T, S] matrix of P takes 512 MiB (checks.backward.PROBE_MATRIX_BYTES), is as strong as a check
can be, and a second such probe would double the cell's time.
"""

import torch

from flashcourse.checks import core as ac
from flashcourse.checks import backward as bc
from flashcourse import runtime

BIG = 10**6   # the position of a padding key: later than every query, so never visible
TILES = (1, 3, 7, 16, 64)


def _odd_cases():
    """Odd T and S, tiles that do not divide them, Hq = Hkv, prefill and chunked prefill."""
    return [
        ac.make_case("prefill, T = S = 13", batch=2, q_heads=3, kv_heads=3, t=13, s=13, seed=300),
        ac.make_case("chunked prefill, T = 7, S = 29", batch=1, q_heads=2, kv_heads=2, t=7, s=29, seed=301),
        ac.make_case("decode, T = 1, S = 31", batch=2, q_heads=1, kv_heads=1, t=1, s=31, seed=302),
        ac.make_case("value dim 8, key dim 16", batch=1, q_heads=2, kv_heads=2, t=9, s=11, d=16, dv=8, seed=303),
        ac.make_case("gapped positions", batch=2, q_heads=2, kv_heads=2, t=4, s=10, seed=304,
                     key_positions=torch.arange(10) * 3, query_positions=torch.tensor([[2, 9, 20, 27], [0, 4, 12, 30]])),
        ac.make_case("scores in the tens", batch=1, q_heads=2, kv_heads=2, t=11, s=11, seed=305, score_scale=10.0),
    ]


def _gqa_cases():
    """GQA 4:1 and 2:1, prefill and chunked prefill, with odd lengths."""
    return [
        ac.make_case("GQA 4:1, prefill T = S = 11", batch=1, q_heads=8, kv_heads=2, t=11, s=11, seed=310),
        ac.make_case("GQA 2:1, chunked prefill T = 5, S = 17", batch=2, q_heads=4, kv_heads=2, t=5, s=17, seed=311),
        ac.make_case("GQA 4:1, one KV head, S = 23", batch=1, q_heads=4, kv_heads=1, t=9, s=23, seed=312),
        ac.make_case("GQA 2:1, positions [B, T]", batch=2, q_heads=2, kv_heads=1, t=3, s=9, seed=313,
                     query_positions=torch.tensor([[2, 5, 8], [0, 3, 6]])),
    ]


def _first_tiles_invisible_cases():
    """Rows whose first key tiles hold no visible key (a padded batch, a ring-buffer cache), with GQA."""
    return [
        ac.make_case("left-padded batch, GQA 2:1", batch=2, q_heads=4, kv_heads=2, t=4, s=12, seed=315,
                     key_positions=torch.stack([torch.arange(12), torch.cat([torch.full((5,), BIG), torch.arange(7)])]),
                     query_positions=torch.stack([torch.arange(8, 12), torch.arange(3, 7)])),
        ac.make_case("ring-buffer cache", batch=1, q_heads=2, kv_heads=1, t=3, s=16, seed=316,
                     key_positions=torch.cat([torch.arange(8, 16), torch.arange(8)]), query_positions=torch.tensor([3, 6, 14])),
    ]


def _no_key_cases():
    """Rows that see no key at all, and rows whose first tiles hold none; Hq = Hkv."""
    return [
        ac.make_case("left-padded, two rows see no key", batch=2, q_heads=2, kv_heads=2, t=4, s=12, seed=320,
                     key_positions=torch.cat([torch.full((5,), BIG), torch.arange(7)]),
                     query_positions=torch.tensor([[-2, -1, 3, 6], [0, 1, 2, 3]])),
        ac.make_case("ring-buffer cache", batch=1, q_heads=3, kv_heads=3, t=3, s=16, seed=321,
                     key_positions=torch.cat([torch.arange(8, 16), torch.arange(8)]),
                     query_positions=torch.tensor([3, 6, 14])),
        ac.make_case("query before every key", batch=1, q_heads=1, kv_heads=1, t=5, s=7, seed=322,
                     key_positions=torch.arange(7) + 2, query_positions=torch.tensor([0, 1, 2, 5, 8])),
    ]


def test_online_attention_lse(online_attention_lse) -> None:
    """o and lse for 03's general cases, the odd and GQA cases, with tiles of 1, 3, 7, 16 and more than S."""
    cases = [*ac.standard_cases(seed=100), *_odd_cases(), *_gqa_cases()]
    bc.check_forward_lse(online_attention_lse, [c.with_kwargs(tile=t) for c in cases for t in TILES])


def test_online_attention_lse_edges(online_attention_lse) -> None:
    """Rows with no key (o = 0, lse = -inf), first tiles with no visible key, and the ValueErrors."""
    cases = [*_no_key_cases(), *_first_tiles_invisible_cases()]
    bc.check_forward_lse(online_attention_lse, [c.with_kwargs(tile=t) for c in cases for t in (1, 2, 3, 5)])
    base = ac.make_case("tile 0", batch=1, q_heads=2, kv_heads=1, t=4, s=6, seed=330)
    ac.check_raises(online_attention_lse, base.with_kwargs(tile=0), "tile must be at least 1")
    ac.check_raises(online_attention_lse, base.with_kwargs(tile=-3), "tile must be at least 1")
    ac.check_raises(online_attention_lse, ac.make_case("Hq = 3, Hkv = 2", q_heads=3, kv_heads=2, t=4, s=6, seed=331),
                    "query heads must be a multiple of KV heads")


def test_attention_backward(attention_backward) -> None:
    """Gradients with Hq = Hkv: odd T and S, chunked prefill, decode, Dv != D, positions, large scores."""
    cases = [*_odd_cases(), *(c for c in ac.standard_cases(seed=340) if c.q.shape[1] == c.k.shape[1])]
    bc.check_backward(attention_backward, [c.with_kwargs(tile=t) for c in cases for t in TILES])


def test_attention_backward_gqa(attention_backward) -> None:
    """Gradients with GQA 4:1 and 2:1: dk and dv summed over each KV head's query heads."""
    bc.check_backward(attention_backward, [c.with_kwargs(tile=t) for c in _gqa_cases() for t in TILES])


def test_attention_backward_edges(attention_backward) -> None:
    """Rows that see no key: zero gradient, no NaN, for every tile size."""
    bc.check_backward(attention_backward, [c.with_kwargs(tile=t) for c in _no_key_cases() for t in (1, 2, 3, 5, 16)])



def _kernel_case(name, seed, t, s=None, **spec):
    """A float32 case on the runtime's device; on a GPU the head dimension is 64 and T, S (and an offset) grow 4x."""
    rt = runtime.current()
    grow = 1 if rt.interpret else 4
    s = t if s is None else s
    if spec.get("query_offset") is not None:
        spec["query_offset"] *= grow
    return ac.make_case(name, t=t * grow, s=s * grow, d=16 if rt.interpret else 64, seed=seed, device=rt.device,
                        **spec)


def test_backward_delta(backward_delta) -> None:
    """Δ alone: one row, lengths that no block divides and one that a block does, blocks of 16 to 128, many heads."""
    bc.check_delta(backward_delta, [
        _kernel_case("decode, T = 1", 400, 1, batch=2, q_heads=4, kv_heads=4),
        _kernel_case("T = 13, blocks of 16", 401, 13, batch=1, q_heads=5, kv_heads=5, block_m=16),
        _kernel_case("T = 65, blocks of 64", 402, 65, batch=2, q_heads=3, kv_heads=3, block_m=64),
        _kernel_case("T = 100, blocks of 32", 403, 100, batch=1, q_heads=2, kv_heads=2, block_m=32),
        _kernel_case("T = 64, blocks of 64", 404, 64, batch=2, q_heads=2, kv_heads=2, block_m=64),
        _kernel_case("T = 37, blocks of 128", 405, 37, batch=1, q_heads=3, kv_heads=3, block_m=128),
    ])


def _gradient_cases(seed):
    """What both gradient kernels are checked on: padded last blocks over several heads, GQA 4:1 and 2:1 with two
    sequences, chunked prefill, offsets in the cache, 0 with T > S and below 0 (rows that see no key), decode at
    the end of the cache and inside it, large scores, not causal with T != S, and blocks other than the
    launcher's own."""
    return [
        _kernel_case("prefill, T = S = 45", seed, 45, batch=2, q_heads=3, kv_heads=3),
        _kernel_case("GQA 4:1, T = S = 37", seed + 1, 37, batch=2, q_heads=8, kv_heads=2),
        _kernel_case("GQA 2:1, chunked prefill T = 13, S = 45", seed + 2, 13, 45, batch=2, q_heads=4, kv_heads=2),
        _kernel_case("query_offset 9 in the cache", seed + 3, 23, 50, batch=1, q_heads=2, kv_heads=1, query_offset=9),
        _kernel_case("query_offset 0, T > S", seed + 4, 37, 21, batch=1, q_heads=2, kv_heads=2, query_offset=0),
        _kernel_case("rows before key 0", seed + 5, 21, 17, batch=2, q_heads=2, kv_heads=2, query_offset=-7),
        _kernel_case("decode, GQA 2:1", seed + 6, 1, 29, batch=2, q_heads=4, kv_heads=2),
        _kernel_case("decode at offset 25 of a longer cache", seed + 12, 1, 40, batch=1, q_heads=4, kv_heads=2,
                     query_offset=25),
        _kernel_case("large scores", seed + 7, 33, batch=1, q_heads=2, kv_heads=2, score_scale=8.0),
        _kernel_case("not causal, GQA 2:1, T = 33, S = 19", seed + 8, 33, 19, batch=2, q_heads=4, kv_heads=2,
                     causal=False),
        _kernel_case("blocks 16 x 16, GQA 2:1, offset 5", seed + 9, 29, 40, batch=2, q_heads=4, kv_heads=2,
                     query_offset=5, blocks=(16, 16)),
        _kernel_case("blocks 32 x 16, T = S = 41", seed + 10, 41, batch=1, q_heads=2, kv_heads=1, blocks=(32, 16)),
        _kernel_case("blocks 16 x 64, chunked prefill", seed + 11, 19, 70, batch=1, q_heads=4, kv_heads=2,
                     blocks=(16, 64)),
    ]


def test_backward_dkdv(backward_dkdv) -> None:
    """dK and dV alone, given exact lse and Δ, on _gradient_cases: the loop's start, the diagonal, GQA sums."""
    bc.check_dkdv(backward_dkdv, _gradient_cases(410))


def test_backward_dq(backward_dq) -> None:
    """dQ alone, given exact lse and Δ, on _gradient_cases; compiled, also 64 queries over 4096 keys five times."""
    bc.check_dq(backward_dq, _gradient_cases(430))
    if not runtime.current().interpret:  # compiled: many key blocks, and any race on the same few rows of dQ
        crowded = ac.make_case("64 queries over 4096 keys", batch=1, q_heads=2, kv_heads=2, t=64, s=4096, d=64,
                               query_offset=4095, seed=450, device=runtime.current().device)
        bc.check_dq_repeated(backward_dq, crowded, runs=5)


def test_flash_attention_train(train_step_gradients) -> None:
    """loss.backward() through flash_attention_train: GQA, odd lengths, a query offset, rows that see no key."""
    bc.check_train_step(train_step_gradients, [
        _kernel_case("prefill, GQA 2:1, T = S = 29", 460, 29, batch=2, q_heads=4, kv_heads=2),
        _kernel_case("chunked prefill, GQA 4:1", 461, 11, 35, batch=1, q_heads=4, kv_heads=1, query_offset=20),
        _kernel_case("rows before key 0", 462, 15, 12, batch=1, q_heads=2, kv_heads=2, query_offset=-3),
        _kernel_case("GQA 2:1 over two KV heads, chunked prefill", 463, 13, 40, batch=2, q_heads=4, kv_heads=2),
    ])
