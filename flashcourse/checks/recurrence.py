"""The online-softmax recurrence as data: every tile's state, with the classic bugs injectable.

The checks use it to say which mistake a wrong answer looks like; the tile explorer draws it.
For one row of scores s and scalar values v, processed `tile` scores at a time:

    m_new = max(m_old, max(s_tile))         running maximum
    alpha = exp(m_old - m_new)              how much the old terms shrink
    p     = exp(s_tile - m_new)
    l_new = alpha * l_old + sum(p)          running denominator
    a_new = alpha * a_old + sum(p * v_tile) running unnormalized output
    output = a / l at the end

Reference: Milakov and Gimelshein, Online normalizer calculation for softmax (2018).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

# The mistakes a learner can inject (and the checks recognise), by name.
BUGS = {
    None: "correct",
    "l_not_rescaled": "l is not multiplied by alpha",
    "a_not_rescaled": "a is not multiplied by alpha",
    "per_tile_softmax": "each tile is normalized on its own (softmax per tile)",
}


@dataclass(frozen=True)
class TileStep:
    """The recurrence's state around one tile."""

    index: int                 # which tile, from 0
    scores: tuple[float, ...]
    values: tuple[float, ...]
    m_old: float
    l_old: float
    a_old: float
    m_new: float
    alpha: float
    p: tuple[float, ...]
    l_new: float
    a_new: float
    # l_old and a_old as this code rescaled them before adding the tile's terms (alpha times each when
    # correct, unchanged where a bug skips alpha); None where unknown, for a function seen only from outside.
    l_rescaled: float | None = None
    a_rescaled: float | None = None

    @property
    def output(self) -> float:
        """The partial output a / l after this tile (nan while no score has been seen)."""
        return self.a_new / self.l_new if self.l_new else math.nan


def _safe_exp_diff(x: float, reference: float) -> float:
    """exp(x - reference), with a -inf reference (nothing seen yet) treated as 0 to avoid -inf - -inf."""
    return math.exp(x - (reference if reference != -math.inf else 0.0))


def step(m: float, l: float, a: float, scores: Sequence[float], values: Sequence[float],
         bug: str | None = None, index: int = 0) -> TileStep:
    """One tile of the recurrence, optionally with one of BUGS injected."""
    if bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r}; choose one of {list(BUGS)}")
    m_new = max([m, *scores])
    alpha = _safe_exp_diff(m, m_new)
    p = tuple(_safe_exp_diff(s, m_new) for s in scores)
    tile_l = math.fsum(p)
    tile_a = math.fsum(pj * vj for pj, vj in zip(p, values))
    if bug == "per_tile_softmax":
        # Normalize the tile by itself and add it on, as if each tile were its own softmax: nothing is rescaled.
        l_rescaled, a_rescaled = l, a
        l_new = l + (1.0 if tile_l else 0.0)
        a_new = a + (tile_a / tile_l if tile_l else 0.0)
    else:
        l_rescaled = l if bug == "l_not_rescaled" else alpha * l
        a_rescaled = a if bug == "a_not_rescaled" else alpha * a
        l_new, a_new = l_rescaled + tile_l, a_rescaled + tile_a
    return TileStep(index, tuple(scores), tuple(values), m, l, a, m_new, alpha, p, l_new, a_new, l_rescaled, a_rescaled)


def trace(scores: Sequence[float], values: Sequence[float], tile: int, bug: str | None = None) -> list[TileStep]:
    """Every tile's step for one row, from the empty state (m=-inf, l=0, a=0)."""
    if tile < 1:
        raise ValueError("tile must be at least 1")
    steps, m, l, a = [], -math.inf, 0.0, 0.0
    for index, start in enumerate(range(0, len(scores), tile)):
        s = step(m, l, a, scores[start:start + tile], values[start:start + tile], bug, index)
        steps.append(s)
        m, l, a = s.m_new, s.l_new, s.a_new
    return steps


def merge(states: Sequence[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Combine partial states (m_i, l_i, a_i) into one: each rescaled by exp(m_i - max m)."""
    m = max(s[0] for s in states)
    l = math.fsum(li * _safe_exp_diff(mi, m) for mi, li, _ in states)
    a = math.fsum(ai * _safe_exp_diff(mi, m) for mi, _, ai in states)
    return m, l, a
