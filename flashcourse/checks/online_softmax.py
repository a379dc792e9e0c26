"""Checks whose failure messages name the learner's likely mistake.

Each `check_*` function calls the learner's function on given cases, compares with the reference,
and raises AssertionError with a message in the learner's terms: which tile, which statistic
(m, l or a), and which classic mistake the wrong answer matches. Test cells in the notebooks are
thin calls into these, so how grading works can change in one place.
"""

from __future__ import annotations

import math
import sys
from typing import Callable, Iterable, Sequence

from flashcourse.checks import recurrence, reference

# 01's worked example: one query, two tiles of two.
WORKED_SCORES = [0.0, 1.0, 2.0, -1.0]
WORKED_VALUES = [2.0, 4.0, 1.0, 3.0]
WORKED_TILE = 2
WORKED_ANSWER = 1.8619  # to four decimals; softmax(scores) @ values

# Plain Python floats: the recurrence reorders sums and exponentials, so allow a few ulps per term.
FLOAT_RTOL = 1e-9
FLOAT_ATOL = 1e-12

# exp(x) passes the largest 64-bit float (about 1.8e308) once x > 709.78: math.exp raises OverflowError.
EXP_LIMIT = math.log(sys.float_info.max)

NEG_INF = -math.inf

# What the exercises of 01 ask for beyond the worked example, written once: the visible tests check
# every one of them, and the hidden tests add random variety around them.
EDGE_TILES = (  # (m, l, a, scores, values) for check_tile_update
    (NEG_INF, 0.0, 0.0, (NEG_INF, NEG_INF), (1.0, 2.0)),       # an all -inf tile before any score: the state stays empty
    (5.0, 2.0, 1.5, (1.0, 4.0, -3.0), (1.0, 1.0, 1.0)),         # the maximum does not rise: alpha = 1
    (1e4, 1.0, 2.0, (1e4 + 1.0, 1e4 - 3.0), (3.0, -1.0)),       # scores of 1e4: exp overflows unless m is subtracted
)
EDGE_ROWS = (   # (scores, values, tile) for check_tile_update_chain and check_online_softmax
    # two fully masked (-inf) tiles first, then the worked example
    ((NEG_INF,) * 4 + (0.0, 1.0, 2.0, -1.0), (9.0, 9.0, 9.0, 9.0, 2.0, 4.0, 1.0, 3.0), 2),
    # -inf scattered among visible scores, a whole tile of -inf after the first, tiles of 3 over 7 scores
    ((1.0, NEG_INF, 0.5, NEG_INF, NEG_INF, NEG_INF, 3.0), (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0), 3),
    # scores of 1e4: the maximum rises, then does not
    ((1e4 - 1.0, -1e4, 1e4 + 2.0, 5e3, 1e4), (1.0, -2.0, 3.0, 4.0, 5.0), 2),
)
EDGE_MERGES = ( # lists of states for check_merge_states
    # an empty state among maxima of 1e4, not in order
    ((1e4, 2.0, 3.0), (NEG_INF, 0.0, 0.0), (1e4 - 2.0, 1.5, -1.0), (1e4 + 1.0, 1.0, 0.5)),
    # a single state: merged, it is itself
    ((2.0, 1.5, -0.5),),
)


def close(actual: float, expected: float, rtol: float = FLOAT_RTOL, atol: float = FLOAT_ATOL) -> bool:
    if math.isinf(expected) or math.isinf(actual):
        return actual == expected
    return abs(actual - expected) <= atol + rtol * abs(expected)


def _as_float(value, what: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise AssertionError(f"{what} should be a number, got {value!r} ({type(value).__name__})") from None


def _as_state(result, what: str) -> tuple[float, float, float]:
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        raise AssertionError(f"{what} should return the tuple (m, l, a), got {result!r}")
    return tuple(_as_float(x, f"{what}: {name}") for x, name in zip(result, "mla"))


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def overflow_hint(largest: float, name: str = "score") -> str:
    """Why exp overflowed, when the largest score (or the largest m_i of a merge, name="m_i") is `largest`."""
    fix = ("Weigh each state by exp(m_i - m), m the largest m_i" if name == "m_i"
           else "Subtract the running maximum before exponentiating")
    return (f"The largest {name} is {_fmt(largest)}, and exp(x) passes the largest 64-bit float (about 1.8e308) "
            f"once x > {EXP_LIMIT:.2f}. {fix}, so that exp never sees a positive argument.")


def _call(fn: Callable, what: str, scores: Sequence[float], *args, name: str = "score"):
    """fn(*args), with an OverflowError (exp of a large score) turned into the learner's diagnosis."""
    try:
        return fn(*args)
    except OverflowError as error:
        raise AssertionError(f"{what} raised OverflowError ({error}). {overflow_hint(max(scores), name)}") from None


def _nan_cause(m: float, scores: Sequence[float]) -> str:
    """The likely source of a NaN after reading `scores` from a state whose maximum was `m`."""
    if m == -math.inf and all(x == -math.inf for x in scores):
        return ("With m_old = -inf and a tile whose scores are all -inf, exp(m_old - m_new) is "
                "exp(-inf - (-inf)) = NaN: use a safe reference (for example 0) while nothing has been seen.")
    if max([m, *scores]) > EXP_LIMIT:
        return f"exp overflowed to inf, and inf - inf or inf / inf is NaN. {overflow_hint(max([m, *scores]))}"
    return "Look for exp(-inf - (-inf)), 0 / 0 or inf / inf in the update."


def _which_bug(got: tuple[float, float, float], m, l, a, scores, values) -> str:
    """Name the classic mistake whose state equals `got`, if any."""
    for bug, words in recurrence.BUGS.items():
        if bug is None:
            continue
        s = recurrence.step(m, l, a, scores, values, bug)
        if all(close(x, y, 1e-6, 1e-9) for x, y in zip(got, (s.m_new, s.l_new, s.a_new))):
            return f" This is exactly what happens when {words}."
    return ""


def explain_state(got, m, l, a, scores, values, where: str) -> str | None:
    """None when `got` is the correct state after one tile, else a message naming the statistic."""
    want = recurrence.step(m, l, a, scores, values)
    expected = {"m": want.m_new, "l": want.l_new, "a": want.a_new}
    if any(math.isnan(x) for x in got):
        return (f"{where}: got NaN in (m, l, a) = {tuple(map(_fmt, got))} for scores {list(map(_fmt, scores))} "
                f"from (m, l, a) = ({_fmt(m)}, {_fmt(l)}, {_fmt(a)}). {_nan_cause(m, scores)}")
    wrong = [name for name, x in zip("mla", got) if not close(x, expected[name])]
    if not wrong:
        return None
    details = ", ".join(f"{n} = {_fmt(got['mla'.index(n)])} (expected {_fmt(expected[n])})" for n in wrong)
    hint = ""
    if wrong == ["m"] or "m" in wrong:
        hint = " m must be the largest score seen so far, max(m_old, max(scores))."
    elif "l" in wrong and "a" not in wrong:
        hint = f" l should be alpha * l_old + sum(p) with alpha = exp(m_old - m_new) = {_fmt(want.alpha)}."
    elif "a" in wrong and "l" not in wrong:
        hint = f" a should be alpha * a_old + sum(p * values) with alpha = {_fmt(want.alpha)}."
    return (f"{where}: {details} for scores {list(map(_fmt, scores))} from (m, l, a) = "
            f"({_fmt(m)}, {_fmt(l)}, {_fmt(a)}).{hint}{_which_bug(got, m, l, a, scores, values)}")


def check_tile_update(tile_update: Callable, cases: Iterable[tuple]) -> None:
    """Each case is (m, l, a, scores, values); the learner's tile_update must return the next state."""
    for m, l, a, scores, values in cases:
        got = _as_state(_call(tile_update, "tile_update", [m, *scores], m, l, a, list(scores), list(values)),
                        "tile_update")
        problem = explain_state(got, m, l, a, scores, values, "tile_update")
        if problem:
            raise AssertionError(problem)


def check_tile_update_chain(tile_update: Callable, scores: Sequence[float], values: Sequence[float],
                            tile: int) -> None:
    """Feed the learner's own states from tile to tile and check each against the recurrence."""
    m, l, a = -math.inf, 0.0, 0.0
    for step in recurrence.trace(scores, values, tile):
        got = _as_state(_call(tile_update, f"tile_update at tile {step.index + 1}", [m, *step.scores], m, l, a,
                              list(step.scores), list(step.values)), "tile_update")
        problem = explain_state(got, m, l, a, step.scores, step.values, f"tile {step.index + 1}")
        if problem:
            raise AssertionError(problem)
        m, l, a = got


def explain_output(got: float, scores, values, tile: int, where: str) -> str | None:
    """None when `got` is softmax(scores) @ values, else what the wrong number looks like."""
    expected = reference.softmax_weighted_sum(scores, values)
    if close(got, expected, 1e-7, 1e-9):
        return None
    if math.isnan(got):
        if scores[:tile] and all(x == -math.inf for x in scores[:tile]):
            return (f"{where} returned NaN (tile={tile}). A tile whose scores are all -inf at the start leaves "
                    "m = -inf, and exp(-inf - (-inf)) is NaN: use a safe reference while nothing has been seen.")
        return f"{where} returned NaN (tile={tile}). {_nan_cause(-math.inf, scores)}"
    if math.isinf(got):
        return f"{where} returned {got} (tile={tile}): subtract the running maximum before exponentiating."
    message = f"{where} returned {_fmt(got)} for tile={tile}, expected {_fmt(expected)}."
    for bug, words in recurrence.BUGS.items():
        steps = recurrence.trace(scores, values, tile, bug)
        if bug and close(got, steps[-1].a_new / steps[-1].l_new, 1e-6, 1e-9):
            return message + f" That is the answer you get when {words}."
    return message + " Check each tile's m, l and a against the recurrence."


def check_online_softmax(online_softmax: Callable, cases: Iterable[tuple]) -> None:
    """Each case is (scores, values, tile); the result must equal softmax(scores) @ values."""
    for scores, values, tile in cases:
        got = _as_float(_call(online_softmax, f"online_softmax (tile={tile})", scores, list(scores), list(values),
                              tile), "online_softmax")
        problem = explain_output(got, scores, values, tile, "online_softmax")
        if problem:
            raise AssertionError(problem)


def check_merge_states(merge_states: Callable, states: Sequence[tuple[float, float, float]]) -> None:
    """The learner's merge of `states` must equal the rescaled sum, whatever the order."""
    want = recurrence.merge(states)
    got = _as_state(_call(merge_states, f"merge_states of {len(states)} states", [s[0] for s in states],
                          [tuple(s) for s in states], name="m_i"), "merge_states")
    wrong = [name for name, x, y in zip("mla", got, want) if not close(x, y)]
    if not wrong:
        return
    details = ", ".join(f"{n} = {_fmt(got['mla'.index(n)])} (expected {_fmt(want['mla'.index(n)])})" for n in wrong)
    hint = ""
    naive = (want[0], math.fsum(s[1] for s in states), math.fsum(s[2] for s in states))
    if all(close(x, y, 1e-6, 1e-9) for x, y in zip(got, naive)):
        hint = " The partial l and a were added without rescaling each by exp(m_i - m), m = max of the m_i."
    elif "m" in wrong:
        hint = " The merged m must be the largest m_i."
    raise AssertionError(f"merge_states of {len(states)} states: {details}.{hint}")
