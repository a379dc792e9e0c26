"""The exported engine of 02 and 03 against the reference, and the hidden checks on it."""

import pytest
import torch

from autograder.hidden import online_attention as hidden03
from autograder.hidden import single_query as hidden02
from flashcourse import attention_checks as ac
from flashcourse.engine import online_attention as engine
from flashcourse.engine.single_query import online_attention_single


@pytest.mark.parametrize("name", ["causal_attention", "online_attention", "online_attention_edges",
                                  "online_attention_memory", "merge_partials", "split_attention"])
def test_engine_passes_hidden_checks(name):
    fn = getattr(engine, name.removesuffix("_edges").removesuffix("_memory"))
    getattr(hidden03, f"test_{name}")(fn)


def test_single_query_engine_passes_hidden_checks():
    hidden02.test_online_attention_single(online_attention_single)
    hidden02.test_online_attention_single_stable(online_attention_single)


def test_online_equals_causal_in_bf16():
    case = ac.standard_cases(torch.bfloat16)[4]
    out = engine.online_attention(case.q, case.k, case.v, tile=5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), engine.causal_attention(case.q, case.k, case.v).float(),
                               rtol=2e-2, atol=2e-2)


def test_value_errors():
    q, k = torch.randn(1, 3, 2, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError):
        engine.online_attention(q, k, k)
    q = torch.randn(1, 2, 2, 8)
    with pytest.raises(ValueError):
        engine.online_attention(q, k, k, tile=0)
    with pytest.raises(ValueError):
        engine.online_attention(q, k, k, query_positions=torch.tensor([-1, 3]))


def test_split_matches_online_and_merge_is_associative():
    case = ac.make_case("decode", batch=2, q_heads=4, kv_heads=2, t=1, s=50, seed=3)
    online = engine.online_attention(case.q, case.k, case.v)
    for chunks in (1, 3, 4, 7):
        torch.testing.assert_close(engine.split_attention(case.q, case.k, case.v, chunks=chunks), online,
                                   rtol=1e-5, atol=1e-5)
    p = ac.partial_states(case, [(0, 10), (10, 30), (30, 50)])
    flat = engine.merge_partials(p)
    nested = engine.merge_partials([p[2], engine.merge_partials([p[1], p[0]])])
    torch.testing.assert_close(flat[2] / flat[1], nested[2] / nested[1])
