"""Absolute positions of queries and keys, as the course's attention functions resolve them.

Query i sits at position offset + i (offset = S - T unless positions are given); key j sits at
position j. Positions, where given, are [length] (shared by the batch) or [B, length].

This module answers no exercise, so graded notebooks may import it: 03 and 06 resolve their positions
with `resolve_positions`.
"""

from __future__ import annotations

import torch


def positions(given: torch.Tensor | None, batch: int, length: int, offset: int, device) -> torch.Tensor:
    """Absolute positions as a [B, length] tensor: `given` ([length] or [B, length]) or offset + arange."""
    if given is None:
        return (torch.arange(length, device=device) + offset).expand(batch, length)
    given = torch.as_tensor(given, device=device)
    if given.dim() == 1:
        given = given.expand(batch, length)
    if tuple(given.shape) != (batch, length):
        raise ValueError(f"positions must have shape [{length}] or [{batch}, {length}], got {list(given.shape)}")
    return given


def resolve_positions(q: torch.Tensor, k: torch.Tensor, query_positions=None, key_positions=None):
    """Check Hq % Hkv == 0; return the absolute positions qp [B, T] and kp [B, S] (default: queries last)."""
    batch, q_heads, t, _ = q.shape
    kv_heads, s = k.shape[1], k.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
    qp = positions(query_positions, batch, t, s - t, q.device)         # [B, T]
    kp = positions(key_positions, batch, s, 0, q.device)               # [B, S]
    return qp, kp
