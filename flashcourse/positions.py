"""Absolute positions of queries and keys, as the course's attention functions resolve them.

Query i sits at position offset + i (offset = S - T unless positions are given); key j sits at
position j. Positions, where given, are [length] (shared by the batch) or [B, length].

This module answers no exercise, so graded notebooks may import it: 03's given helper
`resolve_positions` does.
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
