"""Absolute positions of queries and keys, as the course's attention functions resolve them, and the
checks of q, k and v's shapes that the Triton kernels make before launching.

Query i sits at position offset + i (offset = S - T unless positions are given); key j sits at
position j. Positions, where given, are [length] (shared by the batch) or [B, length].

This module holds no exercise's answer beyond plain shape checks, so graded notebooks may import it:
03 and 06 resolve their positions with `resolve_positions`, 05 and 06 check a kernel's inputs with
`check_kernel_inputs`.
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
    _check_heads(q_heads, kv_heads)
    qp = positions(query_positions, batch, t, s - t, q.device)         # [B, T]
    kp = positions(key_positions, batch, s, 0, q.device)               # [B, S]
    return qp, kp


def check_kernel_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Before a kernel is launched: q, k and v on one device, k and v both [B, Hkv, S, D] for q [B, Hq, T, D],
    Hq % Hkv == 0, and D a power of two >= 16. Raises ValueError for the first that fails."""
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}")
    batch, q_heads, _, d = q.shape
    if tuple(v.shape) != tuple(k.shape) or k.shape[0] != batch or k.shape[3] != d:
        raise ValueError(f"expected k and v of shape [{batch}, Hkv, S, {d}], got {list(k.shape)} and {list(v.shape)}")
    _check_heads(q_heads, k.shape[1])
    if d < 16 or d & (d - 1):
        raise ValueError(f"the head dimension must be a power of two >= 16 (tl.dot and tl.arange need it), got {d}; "
                         "flashcourse.engine.any_input pads any other one")


def _check_heads(q_heads: int, kv_heads: int) -> None:
    """GQA: each KV head serves the same number of query heads."""
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
