"""Record and replay: what the learner's kernel recorded is what the grader's replay returns."""

import math

import pytest
import torch

from autograder import record


@pytest.fixture
def recording(tmp_path, monkeypatch):
    monkeypatch.setenv(record.RECORD_DIR_ENV, str(tmp_path))
    return tmp_path


def _recorded(folder, name, function, *calls):
    namespace = {name: function}
    record.wrap(namespace, "test_cell", [name])
    for args in calls:
        try:
            namespace[name](*args)
        except ValueError:
            pass
    return record.Replayer(name, record.read(folder), folder)


def test_floats_tuples_and_infinities_replay_exactly(recording):
    """Plain values, -inf and nested tuples come back bit for bit."""
    replay = _recorded(recording, "f", lambda x, xs: (x / 3, -math.inf, [x, tuple(xs)]), (1.0, [2.0, 3.0]))
    assert replay(1.0, [2.0, 3.0]) == (1.0 / 3, -math.inf, [1.0, (2.0, 3.0)])


def test_tensors_replay_with_dtype_and_values(recording):
    """A bf16 tensor answer returns as the same bf16 tensor; inputs are matched by content."""
    x = torch.randn(3, 4).bfloat16()
    replay = _recorded(recording, "g", lambda t: t * 2, (x,))
    got = replay(x.clone())
    assert got.dtype == torch.bfloat16 and torch.equal(got, x * 2)


def test_unrecorded_input_fails(recording):
    """A call the notebook never made fails with a message, whatever the learner's code did."""
    replay = _recorded(recording, "h", lambda t: t + 1, (torch.zeros(2),))
    with pytest.raises(AssertionError, match="no recorded answer"):
        replay(torch.ones(2))


def test_exceptions_replay_as_themselves(recording):
    """A ValueError raised in the notebook is raised again by the replay, message included."""
    def strict(tile):
        raise ValueError(f"tile must be positive, got {tile}")

    replay = _recorded(recording, "k", strict, (0,))
    with pytest.raises(ValueError, match="got 0"):
        replay(0)


def test_randomness_is_reset_for_every_test_cell(recording):
    """Unseeded random inputs in a test cell are the same in the kernel and in the replay."""
    torch.randn(100)                      # earlier cells consume the global generator
    record.wrap({}, "cell", [])
    kernel_side = torch.randn(4)
    record.reset_randomness()
    assert torch.equal(kernel_side, torch.randn(4))


def test_nothing_is_recorded_outside_grading(monkeypatch):
    """When the learner runs the notebook, the graded functions are left as they are."""
    monkeypatch.delenv(record.RECORD_DIR_ENV, raising=False)
    function = lambda: 1  # noqa: E731
    namespace = {"f": function}
    record.wrap(namespace, "cell", ["f"])
    assert namespace["f"] is function
