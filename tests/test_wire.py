"""The jail's wire format: values cross intact, and anything malformed is refused as data."""

import math
import os
import time

import pytest
import torch

from autograder.jail.inside import wire


def _round_trip(value):
    tensors: dict = {}
    document = wire.encode(value, tensors)
    reader, writer = os.pipe()
    try:
        wire.send(writer, {"value": document}, tensors)
        received, got_tensors = wire.receive(reader, time.monotonic() + 5)
    finally:
        os.close(reader)
        os.close(writer)
    return wire.decode(received["value"], got_tensors)


def test_plain_values_cross_exactly():
    """Floats (infinities and NaN too), tuples, lists, dicts, dtypes and None come back as sent."""
    value = (1.0 / 3, -math.inf, [2, (3.5, None)], {"tile": 4, "dtype": torch.bfloat16}, "text", True)
    got = _round_trip(value)
    assert got == value
    assert math.isnan(_round_trip(float("nan")))


def test_tensors_cross_with_dtype_shape_and_bits():
    """A bf16 tensor comes back as the same bf16 tensor; a meta tensor as its shape and dtype."""
    x = torch.randn(3, 4).bfloat16()
    got = _round_trip([x, torch.empty(2, 5, device="meta")])
    assert got[0].dtype == torch.bfloat16 and torch.equal(got[0], x)
    assert got[1].device.type == "meta" and tuple(got[1].shape) == (2, 5)


def test_an_unsendable_value_is_named():
    """A function (or any object) has no wire form: decoding says which type it was."""
    with pytest.raises(wire.Unsendable, match="function"):
        _round_trip(lambda: 1)


@pytest.mark.parametrize("document", [
    {"tensor": "t9", "device": "cpu"},                 # a tensor that was not sent
    {"pickle": "gASV"},                                 # an unknown kind
    {"meta": ["float32", [-1]]},                        # a negative size
    {"dtype": "__class__"},                             # not a dtype
    {"dict": [[{"list": []}, 1]]},                      # an unhashable key
    {"a": 1, "b": 2, "c": 3},                           # not one kind
])
def test_malformed_values_are_refused(document):
    """Every malformed value raises Malformed, never anything else."""
    with pytest.raises(wire.Malformed):
        wire.decode(document, {})


def test_deep_nesting_is_refused():
    """A value nested deeper than the limit is refused before it can exhaust the grader's stack."""
    deep: object = 1
    for _ in range(wire.MAX_DEPTH + 5):
        deep = {"list": [deep]}
    with pytest.raises(wire.Malformed, match="deeply"):
        wire.decode(deep, {})


def test_oversized_and_broken_messages_are_refused():
    """A header announcing too many bytes, JSON that is not an object, and garbage tensors are refused."""
    for raw in (wire.HEADER.pack(wire.MAX_JSON_BYTES + 1, 0),
                wire.HEADER.pack(2, 0) + b"[]",
                wire.HEADER.pack(2, 4) + b"{}" + b"\xff\xff\xff\xff"):
        reader, writer = os.pipe()
        os.write(writer, raw)
        os.close(writer)
        with pytest.raises(wire.Malformed):
            wire.receive(reader, time.monotonic() + 5)
        os.close(reader)


def test_silence_times_out_and_a_closed_pipe_is_closed():
    """No message by the deadline raises TimedOut; a writer that went away raises Closed."""
    reader, writer = os.pipe()
    with pytest.raises(wire.TimedOut):
        wire.receive(reader, time.monotonic() + 0.2)
    os.close(writer)
    with pytest.raises(wire.Closed):
        wire.receive(reader, time.monotonic() + 5)
    os.close(reader)


def test_one_tensor_passed_three_times_arrives_as_one():
    """f(x, x, x) arrives as three references to one tensor; views of one storage arrive as copies."""
    x = torch.randn(2, 3)
    got = _round_trip([x, x, x, x[0], x[1]])
    assert got[0] is got[1] is got[2] and torch.equal(got[0], x)
    assert torch.equal(got[3], x[0]) and torch.equal(got[4], x[1])
