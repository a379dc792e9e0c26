"""flashcourse's reference, recurrence and checks: exact on the worked example, and they name mistakes."""

import math

import pytest
import torch

from flashcourse import runtime
from flashcourse.checks import online_softmax as checks, recurrence, reference
from flashcourse.engine import online_softmax as engine

WORKED = (checks.WORKED_SCORES, checks.WORKED_VALUES)


def test_runtime_chooses_the_interpreter_without_a_gpu(monkeypatch):
    """With no CUDA, the runtime picks the CPU, float32 and TRITON_INTERPRET=1."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    rt = runtime.current()
    assert (rt.device, rt.dtype, rt.interpret) == ("cpu", torch.float32, True)
    assert __import__("os").environ["TRITON_INTERPRET"] == "1"


def test_the_interpreter_skips_the_overflow_check_it_would_not_assert():
    """On the CPU, setup() turns off the interpreter's integer-overflow check (computed for every +, - and *, and
    asserted only under the interpreter's debug option, which is off): it made graded kernels a third slower."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from triton.runtime import interpreter

    options = interpreter.interpreter_builder.options
    if not hasattr(options, "sanitize_overflow"):
        pytest.skip("this Triton's interpreter has no overflow check")
    runtime.setup(quiet=True)
    assert interpreter.interpreter_builder.options.sanitize_overflow is False
    assert interpreter.interpreter_builder.options.debug is False   # with debug on, the check would be kept


def test_the_device_can_be_forced():
    """FLASHCOURSE_DEVICE=cpu picks the interpreter even beside a GPU; =cuda without a GPU says so."""
    import os
    import subprocess
    import sys

    probe = "from flashcourse import runtime; print(runtime.current().device)"
    env = {**os.environ, runtime.DEVICE_ENV: "cpu"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "cpu", done.stderr
    if not torch.cuda.is_available():
        env[runtime.DEVICE_ENV] = "cuda"
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode and "sees no CUDA GPU" in done.stderr


def test_worked_example_numbers():
    """The chapter's numbers: (1, 1.3679, 4.7358) after tile 1, alpha 0.3679 at tile 2, 1.8619 at the end."""
    first, second = recurrence.trace(*WORKED, tile=2)
    assert (round(first.m_new, 4), round(first.l_new, 4), round(first.a_new, 4)) == (1.0, 1.3679, 4.7358)
    assert round(second.alpha, 4) == 0.3679
    assert (round(second.l_new, 4), round(second.a_new, 4)) == (1.5530, 2.8915)
    assert round(second.output, 4) == checks.WORKED_ANSWER
    assert round(reference.softmax_weighted_sum(*WORKED), 4) == checks.WORKED_ANSWER


@pytest.mark.parametrize("tile", [1, 2, 3, 4, 7])
def test_trace_matches_reference_for_any_tile(tile):
    """The recurrence's final a / l equals the direct softmax average, whatever the tile size."""
    scores = [0.3, -2.0, 5.0, 1.0, -math.inf, 4.5, 2.2]
    values = [1.0, 2.0, -3.0, 0.5, 9.0, 1.5, -1.0]
    assert math.isclose(recurrence.trace(scores, values, tile)[-1].output,
                        reference.softmax_weighted_sum(scores, values), rel_tol=1e-12)


def test_reference_attention_matches_torch_sdpa():
    """The float64 reference equals torch's causal SDPA for T = S, and handles GQA by h // group."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    ours = reference.attention(q, k, v)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(ours, theirs)
    with pytest.raises(ValueError, match="multiple"):
        reference.attention(q, torch.randn(2, 3, 9, 16), torch.randn(2, 3, 9, 16))


@pytest.mark.parametrize("bug, words", [("l_not_rescaled", "l is not multiplied"),
                                        ("a_not_rescaled", "a is not multiplied")])
def test_tile_update_check_names_the_bug(bug, words):
    """A tile_update with a classic bug fails with a message naming that bug and the tile."""
    def buggy(m, l, a, scores, values):
        s = recurrence.step(m, l, a, scores, values, bug)
        return s.m_new, s.l_new, s.a_new

    with pytest.raises(AssertionError, match=f"tile 2.*{words}"):
        checks.check_tile_update_chain(buggy, *WORKED, tile=2)


def test_nan_from_an_all_minus_inf_tile_is_explained():
    """exp(-inf - -inf) in the first tile is reported as such, not as a bare mismatch."""
    def naive(m, l, a, scores, values):
        m_new = max(m, *scores)
        alpha = math.exp(m - m_new) if m_new != m else 1.0
        p = [math.exp(s - m_new) for s in scores]
        return m_new, alpha * l + sum(p), alpha * a + sum(x * y for x, y in zip(p, values))

    def naive_nan(m, l, a, scores, values):
        m_new = max(m, *scores)
        return m_new, math.exp(m - m_new) * l, math.exp(m - m_new) * a

    with pytest.raises(AssertionError, match="-inf - \\(-inf\\)"):
        checks.check_tile_update(naive_nan, [(-math.inf, 0.0, 0.0, [-math.inf], [1.0])])
    checks.check_tile_update(naive, [(0.0, 1.0, 2.0, [1.0, -1.0], [3.0, 4.0])])


def test_per_tile_softmax_is_recognised():
    """An online_softmax that normalizes each tile separately is named in the message."""
    def per_tile(scores, values, tile):
        steps = recurrence.trace(scores, values, tile, "per_tile_softmax")
        return steps[-1].a_new / steps[-1].l_new

    with pytest.raises(AssertionError, match="normalized on its own"):
        checks.check_online_softmax(per_tile, [(*WORKED, 2)])


def test_merge_without_rescaling_is_named():
    """A merge that adds l_i and a_i without exp(m_i - m) is named."""
    def naive_merge(states):
        return max(s[0] for s in states), sum(s[1] for s in states), sum(s[2] for s in states)

    with pytest.raises(AssertionError, match="without rescaling"):
        checks.check_merge_states(naive_merge, [(1.0, 2.0, 3.0), (2.0, 1.0, 1.0)])


def test_engine_passes_the_hidden_checks():
    """The exported solution of 01 passes every hidden check, so the hidden tests are satisfiable."""
    from autograder.hidden import online_softmax as hidden

    hidden.test_tile_update(engine.tile_update)
    hidden.test_online_softmax(engine.online_softmax)
    hidden.test_merge_states(engine.merge_states)


@pytest.mark.parametrize("bug", ["l_not_rescaled", "a_not_rescaled", "per_tile_softmax"])
def test_hidden_checks_catch_each_bug(bug):
    """Each classic bug fails the hidden online_softmax checks, even though some pass the worked example."""
    from autograder.hidden import online_softmax as hidden

    def buggy(scores, values, tile):
        last = recurrence.trace(scores, values, tile, bug)[-1]
        return last.a_new / last.l_new

    with pytest.raises(AssertionError):
        hidden.test_online_softmax(buggy)


def test_edge_cases_name_the_missing_safe_reference_and_the_overflow():
    """The visible edge cases catch a tile_update without a safe reference (NaN from -inf - -inf) and one
    that never subtracts the maximum (OverflowError at scores of 1e4), each with its cause."""
    def no_safe_reference(m, l, a, scores, values):
        m_new = max(m, *scores)
        p = [math.exp(s - m_new) for s in scores]
        return m_new, math.exp(m - m_new) * l + sum(p), math.exp(m - m_new) * a + sum(x * y for x, y in zip(p, values))

    def unshifted(m, l, a, scores, values):
        m_new = max(m, *scores)
        if m_new == -math.inf:
            return m, l, a
        alpha = math.exp(m) / math.exp(m_new)        # right in exact arithmetic, but exp(1e4) overflows
        p = [math.exp(s) / math.exp(m_new) for s in scores]
        return m_new, alpha * l + sum(p), alpha * a + sum(x * y for x, y in zip(p, values))

    checks.check_tile_update_chain(no_safe_reference, *WORKED, tile=2)      # the worked example alone passes
    with pytest.raises(AssertionError, match=r"exp\(-inf - \(-inf\)\) = NaN"):
        checks.check_tile_update(no_safe_reference, checks.EDGE_TILES)
    checks.check_tile_update_chain(unshifted, *WORKED, tile=2)
    with pytest.raises(AssertionError, match="OverflowError.*709.78.*Subtract the running maximum"):
        checks.check_tile_update(unshifted, checks.EDGE_TILES)
    with pytest.raises(AssertionError, match="largest m_i is 10001"):
        checks.check_merge_states(lambda states: (max(s[0] for s in states), sum(math.exp(s[0]) * s[1] for s in states),
                                                   sum(math.exp(s[0]) * s[2] for s in states)), checks.EDGE_MERGES[0])
    for scores, values, tile in checks.EDGE_ROWS:
        checks.check_tile_update_chain(engine.tile_update, scores, values, tile)
    checks.check_tile_update(engine.tile_update, checks.EDGE_TILES)
    checks.check_online_softmax(engine.online_softmax, checks.EDGE_ROWS)
    for states in checks.EDGE_MERGES:
        checks.check_merge_states(engine.merge_states, states)
