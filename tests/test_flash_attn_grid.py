"""The engine's fast kernels on flash-attn's test grid (tests/flash_attn_grid.py): a small part of it on the
CPU, in Triton's interpreter; all of it on a GPU, with a table of what passed, was refused and failed."""

import itertools
from collections import Counter

import pytest
import torch

from flash_attn_grid import CPU_HEAD_DIMS, CPU_PAIRS, GPU_HEAD_DIMS, GPU_PAIRS, HEADS, Case, refusal, run

KERNELS = ["fast_attention", "fast_attention_lse", "flash_attention_train", "fast_decode"]


def _cases(pairs, dims, dtypes, kernel):
    """Every pair, dim and dtype; the head layouts and masks taken in turn, not multiplied (decode: full only)."""
    masks = [False] if kernel == "fast_decode" else [True, False]
    layouts = itertools.cycle(itertools.product(HEADS, masks))
    return [Case(t, s, d, *next(layouts), dtype) for (t, s), d, dtype in itertools.product(pairs, dims, dtypes)]


@pytest.mark.parametrize("kernel", KERNELS)
def test_grid_on_the_cpu(kernel):
    """Each kernel computes each small case within twice PyTorch's own float32 error, or refuses it as documented."""
    outcomes = [(case, *run(kernel, case, "cpu")) for case in _cases(CPU_PAIRS, CPU_HEAD_DIMS, [torch.float32], kernel)]
    failed = [f"{case}: {detail}" for case, verdict, detail in outcomes if verdict == "fail"]
    assert not failed, f"{kernel}, {len(failed)} of {len(outcomes)} cases:\n" + "\n".join(failed)
    assert any(verdict == "pass" for _, verdict, _ in outcomes), f"{kernel} computed none of the cases"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton kernels)")
@pytest.mark.parametrize("kernel", [*KERNELS, "hopper_attention"])
def test_grid_on_the_gpu(kernel, capsys):
    """Flash-attn's pairs and head dims, bf16 and fp16: each case within its rule or refused as documented."""
    cases = _cases(GPU_PAIRS, GPU_HEAD_DIMS, [torch.bfloat16, torch.float16], kernel)
    if kernel == "flash_attention_train":
        cases = [c for c in cases if c.t * c.s <= 1024 * 1024]   # the float64 autograd reference stays small
    outcomes = [(case, *run(kernel, case, "cuda")) for case in cases]
    counts = Counter(verdict for _, verdict, _ in outcomes)
    refused = Counter(refusal(kernel, case) for case, verdict, _ in outcomes if verdict == "refused")
    with capsys.disabled():
        print(f"\n{kernel}: {len(outcomes)} cases, {counts['pass']} passed, {counts['refused']} refused, "
              f"{counts['fail']} failed; refusals: {dict(refused)}")
    failed = [f"{case}: {detail}" for case, verdict, detail in outcomes if verdict == "fail"]
    assert not failed, f"{kernel}, {len(failed)} of {len(outcomes)} cases:\n" + "\n".join(failed[:40])


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
