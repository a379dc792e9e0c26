"""The engine's fast kernels over the inputs flash-attn's own tests use, judged by flash-attn's rule.

The grid follows flash-attn's test suite (tests/test_flash_attn.py in Dao-AILab/flash-attention): its
(T, S) pairs, head dimensions that are not powers of two, MHA, GQA and MQA, causal, local (a sliding
window) and full attention, bf16 and fp16. Its tolerance rule: a kernel's largest error against a float64 reference may be at most
twice the error of plain PyTorch attention computed in the kernel's own dtype (plus a small floor).

A causal mask with T != S is aligned bottom-right, as flash-attn aligns it: query i sits at S - T + i, so
with T > S the first T - S queries see no key and give o = 0 (lse = -inf, gradients 0). A window w keeps the
keys a query sees to its w latest positions: flash-attn's window_size (w - 1, 0), the local windows the course's
kernels take (causal ones).

Each kernel either computes a case within the rule or refuses it with a ValueError; `refusal` says which
cases each kernel is documented to refuse. The entry points of `flashcourse.engine.any_input` (08's step 7)
and `hopper_attention` refuse none. A ValueError elsewhere, or a case computed that is listed as
refused, fails: the list is kept to what the kernels do.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

# flash-attn's (T, S) pairs and head dimensions; on a CPU (Triton's interpreter) a few small ones.
GPU_PAIRS = [(113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1024, 1024),
             (1023, 1024), (1024, 1023), (1, 239), (239, 1), (2048, 2048)]
GPU_HEAD_DIMS = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
CPU_PAIRS = [(1, 23), (23, 1), (13, 29), (29, 13), (31, 32)]
CPU_HEAD_DIMS = [16, 40]
HEADS = {"MHA": (4, 4), "GQA": (4, 2), "MQA": (4, 1)}   # (query heads, KV heads)
FLOOR = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}  # the rule's floor, per dtype


@dataclass(frozen=True)
class Case:
    t: int
    s: int
    d: int
    heads: str
    causal: bool
    dtype: torch.dtype
    window: int | None = None   # causal only: each query sees its `window` latest positions

    def __str__(self):
        mask = f"window {self.window}" if self.window else "causal" if self.causal else "full"
        return f"T={self.t} S={self.s} D={self.d} {self.heads} {mask} {str(self.dtype).removeprefix('torch.')}"


def window_for(s: int) -> int:
    """The grid's window over S keys: a third of them, so that a query sees some keys and misses others."""
    return max(1, s // 3)


def inputs(case: Case, device, batch: int = 2):
    """q [B, Hq, T, D], k and v [B, Hkv, S, D] and do like q, seeded by the case, in its dtype."""
    hq, hkv = HEADS[case.heads]
    seed = f"{case.t} {case.s} {case.d} {case.heads} {case.causal}" + (f" {case.window}" if case.window else "")
    gen = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    shapes = [(batch, hq, case.t, case.d), (batch, hkv, case.s, case.d), (batch, hkv, case.s, case.d),
              (batch, hq, case.t, case.d)]
    return [torch.randn(shape, generator=gen).to(device=device, dtype=case.dtype) for shape in shapes]


def attention(q, k, v, causal: bool, window: int | None = None):
    """Plain attention in q's dtype (float64 for the reference): (o, lse); bottom-right causal mask (and
    window), rows that see no key give o = 0 and lse = -inf."""
    t, s, group = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])                  # [B, Hq, T, S]
    if causal:
        visible = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=s - t)
        if window:  # query i at s - t + i sees keys j > s - t + i - window
            visible &= ~torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=s - t - window)
        scores = scores.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores.float(), -1)                                   # [B, Hq, T]
    p = torch.softmax(scores, -1).nan_to_num(0.0)                               # a row of -inf gives 0, not NaN
    return p @ v, lse


def error(got, want) -> float:
    """Largest absolute difference, -inf against -inf counting as equal."""
    got, want = got.detach(), want.detach()
    both_inf = torch.isinf(got) & torch.isinf(want) & (got.sign() == want.sign())
    return float(torch.where(both_inf, 0.0, (got.double() - want.double()).abs()).nan_to_num(math.inf).max())


def within_rule(name: str, got, reference, pytorch, dtype) -> str | None:
    """None if got's error is at most twice PyTorch's own error in the dtype plus the floor; else why not."""
    mine, theirs = error(got, reference), error(pytorch, reference)
    if mine <= 2 * theirs + FLOOR[dtype]:
        return None
    return f"{name}: error {mine:.3g} > 2 x PyTorch's {theirs:.3g} + {FLOOR[dtype]:g}"


def _not_power_of_two(d: int) -> bool:
    return d < 16 or d & (d - 1) != 0


# The engine's entry points for any input (08's step 7) and the kernels they run; `hopper_attention` falls back
# to `attention` where its own schedule does not apply.
ANY_INPUT = {"attention": "fast_attention", "attention_lse": "fast_attention_lse",
             "attention_train": "flash_attention_train", "decode": "fast_decode"}


# What each kernel refuses with a ValueError (and why), as documented; None where it computes the case.
def refusal(kernel: str, case: Case) -> str | None:
    if kernel == "attention_train" and case.window:
        return "attention_train takes no window (06's backward kernels have none)"
    if kernel in ANY_INPUT or kernel == "hopper_attention":
        return None
    if _not_power_of_two(case.d):
        return "the head dimension must be a power of two >= 16"
    if kernel == "fast_attention" and case.causal and case.t > case.s:
        return "a causal mask with more queries than keys puts query 0 before key 0"
    return None


def _function(kernel: str):
    """The engine's function named `kernel`."""
    from flashcourse.engine import any_input
    from flashcourse.engine.backward import flash_attention_train
    from flashcourse.engine.decode import fast_decode
    from flashcourse.engine.fast_attention import fast_attention
    from flashcourse.engine.fast_lse import fast_attention_lse
    from flashcourse.engine.hopper import hopper_attention

    kernels = {"fast_attention": fast_attention, "fast_attention_lse": fast_attention_lse, "fast_decode": fast_decode,
               "flash_attention_train": flash_attention_train, "hopper_attention": hopper_attention}
    return kernels[kernel] if kernel in kernels else getattr(any_input, kernel)


def run(kernel: str, case: Case, device) -> tuple[str, str]:
    """("pass" | "refused" | "fail", detail) for one kernel on one case."""
    q, k, v, do = inputs(case, device)
    role = ANY_INPUT.get(kernel, kernel)           # what the entry point computes
    if role == "fast_decode":
        q, do = q[:, :, -1:], do[:, :, -1:]        # one new token after every key
    expected, function = refusal(kernel, case), _function(kernel)
    mask = {"causal": case.causal, **({"window": case.window} if case.window else {})}
    try:
        if role == "fast_attention_lse":
            o, lse = function(q, k, v, **mask)
            got = {"o": o, "lse": lse}
        elif role == "fast_decode":
            got = {"o": function(q, k, v)}
        elif role in ("fast_attention", "hopper_attention"):
            got = {"o": function(q, k, v, **mask)}
        else:
            leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
            o = function(*leaves, **mask)
            o.backward(do)
            got = {"o": o, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    except ValueError as refused:
        if expected is None:
            return "fail", f"refused with ValueError, not documented as refused: {refused}"
        if not str(refused):
            return "fail", "refused with a ValueError that says nothing"
        return "refused", str(refused)
    if expected is not None:
        return "fail", f"computed a case documented as refused ({expected}): update `refusal`"

    def computed_in(dtype):
        """What plain attention gives in dtype: o and lse, and the gradients where the kernel gave them."""
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        o, lse = attention(*xs, case.causal, case.window)  # decode's one query, at S - 1, sees every key
        result = {"o": o, "lse": lse}
        if "dq" in got:
            result.update(zip(("dq", "dk", "dv"), torch.autograd.grad(o, xs, do.to(dtype))))
        return result

    reference, pytorch = computed_in(torch.float64), computed_in(case.dtype)
    failures = [why for name, value in got.items()
                if (why := within_rule(name, value, reference[name], pytorch[name], case.dtype))]
    return ("fail", "; ".join(failures)) if failures else ("pass", "")
