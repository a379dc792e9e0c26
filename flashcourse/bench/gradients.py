"""Gradients of the naive attention, the reference that the backward benchmarks (06's instructor benchmark, 08's
Gluon backward) hold the course's kernels to."""

from __future__ import annotations

import math

import torch


def naive_attention(q, k, v, causal: bool = True):
    """softmax(q k^T / sqrt(D)) v with the [B, Hq, T, S] scores in memory (K and V repeated for GQA); the
    causal mask is bottom-right, query i at position S - T + i."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)        # [B, Hq, S, D]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])                   # [B, Hq, T, S]
    if causal:
        t, s = scores.shape[-2:]
        hidden = torch.ones(t, s, dtype=torch.bool, device=q.device).triu(s - t + 1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, -1) @ v                                        # [B, Hq, T, D]


def gradients(attention, q, k, v, do):
    """(dq, dk, dv) of attention(q, k, v) for the output gradient do."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    return torch.autograd.grad(attention(q, k, v), (q, k, v), do)


def gradient_error(got, q, k, v, do, causal: bool) -> float:
    """max |error| of (dq, dk, dv) against FP32 autograd of the naive attention, over batch 0 and KV head 0
    (with its query heads)."""
    group = q.shape[1] // k.shape[1]
    part = lambda x, heads: x[:1, :heads].float()  # noqa: E731
    want = gradients(lambda q, k, v: naive_attention(q, k, v, causal), part(q, group), part(k, 1), part(v, 1),
                     part(do, group))
    mine = (got[0][:1, :group], got[1][:1, :1], got[2][:1, :1])
    return max(float((a.float() - b).abs().max()) for a, b in zip(mine, want))
