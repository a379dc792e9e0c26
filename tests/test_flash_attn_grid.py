"""The engine's fast kernels on flash-attn's test grid (tests/flash_attn_grid.py): a small part of it on the
CPU, in Triton's interpreter; all of it on a GPU, with a table of what passed, was refused and failed."""

import itertools
from collections import Counter

import pytest
import torch

from flash_attn_grid import (ANY_INPUT, CPU_HEAD_DIMS, CPU_PAIRS, GPU_HEAD_DIMS, GPU_PAIRS, HEADS, Case, refusal, run,
                             window_for)

KERNELS = ["fast_attention", "fast_attention_lse", "flash_attention_train", "fast_decode", *ANY_INPUT]
WINDOWED = {"fast_attention", "fast_attention_lse", "attention", "attention_lse", "attention_train"}  # take `window`


def _cases(pairs, dims, dtypes, kernel):
    """Every pair, dim and dtype; the head layouts and masks taken in turn, not multiplied (decode: full only;
    a window only where the function takes one)."""
    masks = ["full"] if ANY_INPUT.get(kernel, kernel) == "fast_decode" else \
        ["causal", "full", "local"] if kernel in WINDOWED else ["causal", "full"]
    layouts = itertools.cycle(itertools.product(HEADS, masks))
    cases = []
    for (t, s), d, dtype in itertools.product(pairs, dims, dtypes):
        heads, mask = next(layouts)
        cases.append(Case(t, s, d, heads, mask != "full", dtype, window_for(s) if mask == "local" else None))
    return cases


@pytest.mark.parametrize("kernel", KERNELS)
def test_grid_on_the_cpu(kernel):
    """Each kernel computes each small case within twice PyTorch's own float32 error, or refuses it as documented."""
    outcomes = [(case, *run(kernel, case, "cpu")) for case in _cases(CPU_PAIRS, CPU_HEAD_DIMS, [torch.float32], kernel)]
    failed = [f"{case}: {detail}" for case, verdict, detail in outcomes if verdict == "fail"]
    assert not failed, f"{kernel}, {len(failed)} of {len(outcomes)} cases:\n" + "\n".join(failed)
    assert any(verdict == "pass" for _, verdict, _ in outcomes), f"{kernel} computed none of the cases"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton kernels)")
@pytest.mark.parametrize("pair", GPU_PAIRS, ids=[f"{t}x{s}" for t, s in GPU_PAIRS])
@pytest.mark.parametrize("kernel", [*KERNELS, "hopper_attention"])
def test_grid_on_the_gpu(kernel, pair, capsys):
    """Flash-attn's head dims at one of its (T, S) pairs, bf16 and fp16: each case within its rule or refused as
    documented. One test per kernel and pair, so that part of the grid can be run (pytest -k "train and 1x239")."""
    if ANY_INPUT.get(kernel, kernel) == "flash_attention_train" and pair[0] * pair[1] > 1024 * 1024:
        pytest.skip("the float64 autograd reference is kept to T * S <= 1024 * 1024")
    cases = [c for c in _cases(GPU_PAIRS, GPU_HEAD_DIMS, [torch.bfloat16, torch.float16], kernel)
             if (c.t, c.s) == pair]
    outcomes = [(case, *run(kernel, case, "cuda")) for case in cases]
    counts = Counter(verdict for _, verdict, _ in outcomes)
    refused = Counter(refusal(kernel, case) for case, verdict, _ in outcomes if verdict == "refused")
    with capsys.disabled():
        print(f"\n{kernel} T={pair[0]} S={pair[1]}: {len(outcomes)} cases, {counts['pass']} passed, "
              f"{counts['refused']} refused, {counts['fail']} failed; refusals: {dict(refused)}", flush=True)
    failed = [f"{case}: {detail}" for case, verdict, detail in outcomes if verdict == "fail"]
    assert not failed, f"{kernel}, {len(failed)} of {len(outcomes)} cases:\n" + "\n".join(failed)


def test_the_rule_catches_a_classic_mistake():
    """Attention with the scale left out, or with the rows that see no key left as NaN, breaks the rule."""
    from flash_attn_grid import attention, inputs, within_rule

    case = Case(29, 13, 16, "GQA", True, torch.float32)
    q, k, v, _ = inputs(case, "cpu")
    reference, pytorch = attention(q.double(), k.double(), v.double(), True)[0], attention(q, k, v, True)[0]
    assert within_rule("o", pytorch, reference, pytorch, torch.float32) is None
    unscaled = attention(q * 4, k, v, True)[0]                     # D = 16: the missing 1/sqrt(D) is 1/4
    assert "o: error" in within_rule("o", unscaled, reference, pytorch, torch.float32)
    nan_rows = pytorch.clone()
    nan_rows[:, :, 0] = float("nan")                               # T > S: query 0 sees no key
    assert within_rule("o", nan_rows, reference, pytorch, torch.float32) is not None


def test_the_window_reference_is_flash_attns():
    """The reference's window w is flash-attn's window_size (w - 1, 0): a window one key wider breaks the rule."""
    from flash_attn_grid import attention, inputs, within_rule

    case = Case(29, 13, 16, "GQA", True, torch.float32, window=4)
    q, k, v, _ = inputs(case, "cpu")
    reference, lse = attention(q.double(), k.double(), v.double(), True, 4)
    assert torch.isinf(lse[:, :, :16]).all() and torch.isfinite(lse[:, :, 16:]).all()  # T > S: 16 queries before key 0
    scores = q[0, 0, -1].double() @ k[0, 0].double().T / 4                              # the last query sits at key 12
    assert torch.allclose(lse[0, 0, -1], torch.logsumexp(scores[9:], 0).float())       # it sees keys 9..12
    wider = attention(q, k, v, True, 5)[0]
    assert within_rule("o", wider, reference, attention(q, k, v, True, 4)[0], torch.float32) is not None


@pytest.mark.parametrize("d, dv", [(24, 40), (40, 16), (32, 64)])
def test_values_of_their_own_width(d, dv):
    """The any-input entry points take v of another width than q and k (queries and keys of 192, values of 128)."""
    from flash_attn_grid import attention, within_rule
    from flashcourse.engine import any_input

    gen = torch.Generator().manual_seed(d * 100 + dv)
    q, do = (torch.randn(2, 4, 13, w, generator=gen) for w in (d, dv))
    k, v = torch.randn(2, 2, 29, d, generator=gen), torch.randn(2, 2, 29, dv, generator=gen)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = any_input.attention_train(*leaves)
    o.backward(do)
    o_lse, lse = any_input.attention_lse(q, k, v)
    got = {"o": o, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad,
           "o of attention": any_input.attention(q, k, v), "o of attention_lse": o_lse, "lse": lse,
           "o of decode": any_input.decode(q[:, :, -1:], k, v)}

    def computed_in(dtype):
        xs = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        o, lse = attention(*xs, True)
        grads = torch.autograd.grad(o, xs, do.to(dtype))
        return {"o": o, "dq": grads[0], "dk": grads[1], "dv": grads[2], "o of attention": o,
                "o of attention_lse": o, "lse": lse, "o of decode": attention(*xs, False)[0][:, :, -1:]}

    reference, pytorch = computed_in(torch.float64), computed_in(torch.float32)
    assert got["o"].shape == (2, 4, 13, dv) and got["dv"].shape == v.shape
    failures = [why for name, value in got.items()
                if (why := within_rule(name, value, reference[name], pytorch[name], torch.float32))]
    assert not failures, f"D = {d}, Dv = {dv}: " + "; ".join(failures)
