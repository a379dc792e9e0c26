"""Hidden checks for 01_online_softmax: random rows and tiles, -inf scores, large scores, merges.

Variety around what the visible tests already ask (flashcourse.checks.online_softmax.EDGE_TILES, EDGE_ROWS and
EDGE_MERGES: all -inf tiles, alpha = 1, scores of 1e4, an empty state, a single state), never a new
requirement. Each function is the hidden part of a graded cell of its own (test_tile_update_random,
test_online_softmax_random, test_merge_states_random), so a failure here costs that cell's point and
nothing beside it. Every case is seeded.
"""

import math
import random

from flashcourse.checks import online_softmax as checks, recurrence

NEG_INF = -math.inf


def _row(rng: random.Random, n: int, scale: float = 3.0) -> tuple[list[float], list[float]]:
    return [rng.gauss(0.0, scale) for _ in range(n)], [rng.gauss(0.0, 1.0) for _ in range(n)]


def _rows_and_tiles():
    """Rows with tile sizes of 1, larger than the row, and sizes that do not divide it."""
    rng = random.Random(2024)
    for n in (1, 2, 5, 7, 16, 33):
        scores, values = _row(rng, n)
        for tile in sorted({1, 2, 3, n, n + 4}):
            yield scores, values, tile


def _edge_rows():
    """Random rows with the visible tests' edge cases (checks.EDGE_ROWS) in them."""
    rng = random.Random(7)
    scores, values = _row(rng, 9)
    # A whole first tile of -inf (a fully masked tile) and scattered -inf later.
    yield [NEG_INF] * 3 + scores[3:], values, 3
    yield [s if i % 3 else NEG_INF for i, s in enumerate(scores)], values, 2
    # Tiles whose maximum never rises after the first tile: alpha = 1.
    yield [9.0, 1.0, 0.5, -2.0, 3.0, 8.9, -1.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], 2
    # Scores around 1e4, in tiles of 1 and 3.
    big, vals = _row(rng, 10, scale=1.0)
    yield [1e4 + s for s in big], vals, 3
    yield [1e4, -1e4, 5e3, 1e4 - 1.0], [1.0, -2.0, 3.0, 4.0], 1


def test_tile_update(tile_update) -> None:
    """Random states and tiles, chained over rows, plus -inf tiles, non-rising maxima and 1e4 scores."""
    rng = random.Random(11)
    cases = [(NEG_INF, 0.0, 0.0, [NEG_INF], [4.0])]                    # one -inf score from the empty state
    for _ in range(30):
        scores, values = _row(rng, rng.randint(1, 6))
        m = rng.gauss(0.0, 3.0)
        cases.append((m, rng.uniform(0.5, 4.0), rng.gauss(0.0, 2.0), scores, values))
    cases.append((2.5, 1.0, -1.0, [NEG_INF, NEG_INF, NEG_INF], [1.0, 2.0, 3.0]))  # all -inf after a score
    cases.append((1e4 - 5.0, 3.0, 1.0, [1e4 + 4.0, 1e4], [2.0, -1.0]))  # large scores, the maximum rises
    checks.check_tile_update(tile_update, cases)
    for scores, values, tile in [*_rows_and_tiles(), *_edge_rows()]:
        checks.check_tile_update_chain(tile_update, scores, values, tile)


def test_online_softmax(online_softmax) -> None:
    """Random rows with tile sizes 1, larger than the row and not dividing it; -inf tiles; 1e4 scores."""
    checks.check_online_softmax(online_softmax, [*_rows_and_tiles(), *_edge_rows()])


def _states(rng: random.Random, count: int) -> list[tuple[float, float, float]]:
    """Partial states of consecutive chunks of one random row, as separate workers would end."""
    states = []
    for _ in range(count):
        scores, values = _row(rng, rng.randint(1, 5))
        last = recurrence.trace(scores, values, tile=2)[-1]
        states.append((last.m_new, last.l_new, last.a_new))
    return states


def test_merge_states(merge_states) -> None:
    """Merges in any order and grouping, with an empty state, single states and large maxima."""
    rng = random.Random(5)
    for count in (1, 2, 3, 6):
        states = _states(rng, count)
        checks.check_merge_states(merge_states, states)
        checks.check_merge_states(merge_states, list(reversed(states)))
        shuffled = states[:]
        rng.shuffle(shuffled)
        checks.check_merge_states(merge_states, shuffled)
        checks.check_merge_states(merge_states, [*states, (NEG_INF, 0.0, 0.0)])
    states = _states(rng, 6)
    # Grouping: merging merged halves must equal merging everything at once.
    halves = [tuple(merge_states(states[:2])), tuple(merge_states(states[2:]))]
    checks.check_merge_states(merge_states, halves)
    nested = tuple(merge_states([tuple(merge_states(states[:3])), tuple(merge_states(states[3:]))]))
    want = recurrence.merge(states)
    if not all(checks.close(x, y) for x, y in zip(nested, want)):
        raise AssertionError(f"merge_states is not associative: merging two merged halves gave {nested}, "
                             f"merging all six states gives {want}")
    checks.check_merge_states(merge_states, [(1e4 + 3.0, 2.0, 3.0), (NEG_INF, 0.0, 0.0), (1e4 - 7.0, 1.5, -1.0)])
