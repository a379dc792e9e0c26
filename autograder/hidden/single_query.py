"""Hidden checks for 02_single_query: random queries, every tile size from 1 to beyond S, large scores.

Compared with the float64 reference (flashcourse.checks.reference.attention) at rtol 1e-9, atol 1e-10:
plain Python floats are float64, and the recurrence only reorders sums. Both functions are the hidden
part of one graded cell of their own (test_online_attention_single_random), so a failure here costs that
cell's point and nothing beside it. Every case is seeded.
"""

import random

from flashcourse.checks import core as ac


def _case(rng: random.Random, s: int, d: int, q_scale: float = 1.5):
    q = [rng.gauss(0.0, q_scale) for _ in range(d)]
    k = [rng.gauss(0.0, 1.0) for _ in range(s * d)]
    v = [rng.gauss(0.0, 1.0) for _ in range(s * d)]
    return q, k, v


def test_online_attention_single(online_attention_single) -> None:
    """Random queries with S from 1 to 23 and every tile size from 1 to S + 3 (most not dividing S)."""
    rng = random.Random(2025)
    cases = []
    for s, d in [(1, 4), (2, 1), (5, 3), (7, 8), (12, 5), (23, 16)]:
        q, k, v = _case(rng, s, d)
        cases += [(q, k, v, s, d, tile) for tile in range(1, s + 4)]
    ac.check_single_query(online_attention_single, cases)


def test_online_attention_single_stable(online_attention_single) -> None:
    """Scores in the thousands (exp overflows unless the running maximum is subtracted), rising and
    falling maxima, and a tile larger than S."""
    rng = random.Random(7)
    cases = []
    for s, d, tile in [(9, 4, 2), (9, 4, 4), (16, 8, 5), (6, 2, 10)]:
        q, k, v = _case(rng, s, d, q_scale=900.0)
        cases.append((q, k, v, s, d, tile))
    # Keys whose scores rise tile after tile (alpha < 1 at every tile) and then fall (alpha = 1).
    d = 2
    rising = [x for j in range(8) for x in (float(j), 0.0)]
    cases.append(([40.0, 1.0], rising, [rng.gauss(0.0, 1.0) for _ in range(8 * d)], 8, d, 3))
    falling = [x for j in range(8) for x in (float(8 - j), 0.0)]
    cases.append(([40.0, 1.0], falling, [rng.gauss(0.0, 1.0) for _ in range(8 * d)], 8, d, 3))
    ac.check_single_query(online_attention_single, cases)
