"""The ground truth: attention computed the obvious way, with the whole score matrix materialized.

Shapes follow the course: q [B, Hq, T, D], k and v [B, Hkv, S, D]. Query i sits at absolute
position offset + i with offset = S - T unless positions are given; key j sits at position j.
A query sees key j when key_position <= query_position (causal). Query head h reads KV head
h // (Hq // Hkv) (grouped-query attention).

Computed in float64 so that every implementation in the course, in any dtype, is compared with
something more exact than itself. References: Vaswani et al. (2017) for attention; Ainslie et al.
(2023) for grouped-query attention.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from flashcourse.positions import positions


def softmax_weighted_sum(scores: Sequence[float], values: Sequence[float]) -> float:
    """sum_j softmax(scores)_j * values_j for one row of plain floats: the worked example's answer."""
    if len(scores) != len(values) or not scores:
        raise ValueError("scores and values must be non-empty and of equal length")
    top = max(scores)
    if top == -math.inf:
        raise ValueError("every score is -inf: the softmax is undefined")
    weights = [math.exp(s - top) for s in scores]
    return math.fsum(w * x for w, x in zip(weights, values)) / math.fsum(weights)


def visible_mask(q: torch.Tensor, k: torch.Tensor, query_positions=None, key_positions=None,
                 window: int | None = None) -> torch.Tensor:
    """[B, 1, T, S] booleans: True where a query may attend to a key (causal, optionally windowed)."""
    batch, _, t, _ = q.shape
    s = k.shape[2]
    qp = positions(query_positions, batch, t, s - t, q.device)     # [B, T]
    kp = positions(key_positions, batch, s, 0, q.device)           # [B, S]
    mask = kp[:, None, None, :] <= qp[:, None, :, None]            # [B, 1, T, S]
    if window is not None:
        mask &= kp[:, None, None, :] > qp[:, None, :, None] - window
    return mask


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_positions=None, key_positions=None,
              causal: bool = True, window: int | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + mask) v in float64, returned as float64 [B, Hq, T, Dv].

    Raises ValueError when Hq is not a multiple of Hkv or a query row sees no key at all.
    """
    batch, q_heads, t, d = q.shape
    kv_heads = k.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
    group = q_heads // kv_heads
    k64 = k.double().repeat_interleave(group, dim=1)                # [B, Hq, S, D]
    v64 = v.double().repeat_interleave(group, dim=1)                # [B, Hq, S, Dv]
    scores = q.double() @ k64.transpose(-2, -1) / math.sqrt(d)      # [B, Hq, T, S]
    if causal or window is not None:
        mask = visible_mask(q, k, query_positions, key_positions, window)
        if not bool(mask.any(-1).all()):
            raise ValueError("a query row sees no key: its attention output is undefined")
        scores = scores.masked_fill(~mask, -math.inf)
    return torch.softmax(scores, dim=-1) @ v64
