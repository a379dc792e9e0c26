"""Checks specific to the Triton attention kernel of assignment 04, on top of `attention_checks`.

`attention_checks` compares an attention function with the reference and names the classic
mistakes (offset ignored for the default offset, KV head h % Hkv, scale, mask off by one). This
module adds what only a kernel with block sizes, an explicit query offset and a sliding window
can get wrong:

    check_cases           the reference comparison of attention_checks, plus the query block of a
                          wrong row and, for an explicit query_offset, whether it was ignored
    check_block_skipping  keys that no tile of a block-skipping loop reaches are filled with NaN; a
                          kernel that stops its loop at the last visible key (and, with a window,
                          starts at the first) never loads them, so its output stays finite
    check_window          window ignored, or off by one (a query sees its `window` latest positions)
    check_validation      ValueError before launch for bad head dims, head counts and devices

Every failure message says where (batch, head, query row, query block) and which mistake the
output matches.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Iterable

import torch

from flashcourse.checks import core as ac
from flashcourse.checks import reference
from flashcourse.positions import positions


def case(name: str, *, block_m: int = 32, block_n: int = 32, window: int | None = None, **spec) -> ac.Case:
    """A seeded `checks.core.Case` that also passes block sizes (and a window) to the kernel."""
    kwargs = {"block_m": block_m, "block_n": block_n}
    if window is not None:
        kwargs["window"] = window
    return ac.make_case(name, **spec, **kwargs)


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", "flash_attention")


def _expected(c: ac.Case, query_positions=None, window=None) -> torch.Tensor | None:
    """The float64 reference [B, Hq, T, D] for other query positions or window (None if undefined)."""
    qp = c.query_positions if query_positions is None else query_positions
    try:
        return reference.attention(c.q.cpu(), c.k.cpu(), c.v.cpu(), qp, c.key_positions, window=window)
    except ValueError:
        return None


def _close(got: torch.Tensor, want: torch.Tensor | None, dtype: torch.dtype) -> bool:
    if want is None:
        return False
    rtol, atol = ac.tolerance(dtype)
    return bool(((got - want).abs() <= atol + rtol * want.abs()).all())


def _block_of(c: ac.Case, message: str) -> str:
    """Add the query block of the reported row to a message of checks.core."""
    block_m = c.kwargs.get("block_m")
    marker = "query row "
    if block_m is None or marker not in message:
        return message
    row = int(message.split(marker, 1)[1].split(" ", 1)[0])
    return message.replace(f"{marker}{row} ", f"{marker}{row} (query block {row // block_m}) ", 1)


def _call(fn: Callable, c: ac.Case) -> torch.Tensor:
    try:
        return c.call(fn)
    except ValueError as error:
        raise AssertionError(f"{_name(fn)}, {c.describe()}: raised ValueError({str(error)!r}) on valid inputs") from None


def _problem(fn: Callable, c: ac.Case, got: torch.Tensor) -> str | None:
    """None when `got` is right for `c`, else the message: where, and which mistake it matches."""
    if "window" in c.kwargs:
        return _window_problem(fn, c, got)
    problem = ac.explain_output(got, c, tile=c.kwargs.get("block_n"), what=_name(fn))
    if not problem:
        return None
    t, s = c.q.shape[2], c.k.shape[2]
    offset = c.kwargs.get("query_offset")
    if offset is not None and isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(c.q.shape):
        got64 = got.detach().cpu().double()
        if offset != 0 and _close(got64, _expected(c, torch.arange(t)), c.q.dtype):
            problem += (f" The output is what queries at positions 0..{t - 1} give: query_offset={offset} was "
                        "ignored (query i must sit at query_offset + i).")
        elif offset != s - t and _close(got64, _expected(c, torch.arange(t) + s - t), c.q.dtype):
            problem += (f" The output is what the default offset S - T = {s - t} gives: query_offset={offset} "
                        "was not passed on to the kernel.")
    return _block_of(c, problem)


def check_cases(fn: Callable, cases: Iterable[ac.Case]) -> None:
    """Each case's output must match the reference (windowed where the case passes window=).

    A wrong output is reported with its query block and, for an explicit query_offset, whether the
    offset was ignored or replaced by the default S - T.
    """
    for c in cases:
        problem = _problem(fn, c, _call(fn, c))
        if problem:
            raise AssertionError(problem)


def nan_outside(c: ac.Case) -> ac.Case:
    """The same case with the keys and values that no tile of a block-skipping kernel reaches set to NaN.

    The last query sees keys up to its own position p; a loop that stops there loads at most
    BLOCK_N - 1 keys past p (the rest of its last tile), so keys from p + BLOCK_N on are never
    loaded, wherever the tiles start. With a window the first query sees nothing before
    p0 - window + 1, and keys at least BLOCK_N before that are skipped likewise. A kernel that loads
    NaN keys into a dot product returns NaN, even with their scores masked to -inf: 0 * NaN = NaN.
    """
    b, _, t, _ = c.q.shape
    s = c.k.shape[2]
    block_n = c.kwargs.get("block_n", 1)
    qp = positions(c.query_positions, b, t, s - t, "cpu")[0]
    keys = torch.arange(s)
    hidden = keys >= int(qp.max()) + block_n
    window = c.kwargs.get("window")
    if window is not None:
        hidden |= keys <= int(qp.min()) - window + 1 - block_n
    k, v = c.k.clone(), c.v.clone()
    k[:, :, hidden.to(k.device)] = float("nan")
    v[:, :, hidden.to(v.device)] = float("nan")
    return replace(c, k=k, v=v)


def check_block_skipping(fn: Callable, cases: Iterable[ac.Case]) -> None:
    """Right on the clean inputs, then finite (and still right) with the unreachable keys set to NaN."""
    check_cases(fn, cases)
    for c in cases:
        got = _call(fn, nan_outside(c))
        bad = ~torch.isfinite(got.detach().cpu())
        if bool(bad.any()):
            b, h, i, _ = (int(x) for x in bad.nonzero()[0])
            block_m = c.kwargs.get("block_m", 1)
            blocks = sorted({int(r) // block_m for r in bad.any(-1).nonzero()[:, 2]})
            windowed = c.kwargs.get("window") is not None
            last = "the block's last existing query (its last row below T)"
            edge = (f"after the last key {last} can see, or before the first key its first query can see (the "
                    "window)" if windowed else f"after the last key {last} can see")
            raise AssertionError(
                f"{_name(fn)}, {c.describe()}: keys and values that no query may see were set to NaN, and the "
                f"output has NaN at batch {b}, head {h}, query row {i} (query blocks {blocks}). The kernel loaded "
                f"keys {edge}: masking their scores to -inf is not enough, since p = 0 times a NaN value is NaN. "
                "Causal block skipping: end the loop at min(S, offset + last_row + 1), where last_row = "
                "min((block + 1) * BLOCK_M, T) - 1 is the block's last existing query row (rows from T on are "
                "padding and see nothing)"
                + (", and start it at the tile holding the first key the block's first query sees." if windowed
                   else "."))
        problem = _problem(fn, c, got)
        if problem:
            raise AssertionError(problem)


def _window_problem(fn: Callable, c: ac.Case, got: torch.Tensor) -> str | None:
    window = c.kwargs["window"]
    want = _expected(c, window=window)
    got64 = got.detach().cpu().double()
    if tuple(got.shape) != tuple(c.q.shape):
        return f"{_name(fn)}, {c.describe()}: output shape {list(got.shape)}, expected {list(c.q.shape)}"
    if _close(got64, want, c.q.dtype):
        return None
    rtol, atol = ac.tolerance(c.q.dtype)
    error = (got64 - want).abs() - rtol * want.abs()
    error = torch.nan_to_num(error, nan=math.inf)
    b, h, i, e = (int(x) for x in torch.unravel_index(error.argmax(), error.shape))
    message = (f"{_name(fn)}, {c.describe()}: wrong at batch {b}, head {h}, query row {i} (query block "
               f"{i // c.kwargs.get('block_m', 1)}), output element {e}: got {float(got64[b, h, i, e]):.6g}, expected "
               f"{float(want[b, h, i, e]):.6g}. With window={window}, query position p sees keys p - {window} < j <= p.")
    if _close(got64, _expected(c), c.q.dtype):
        return message + " The output is plain causal attention: the window was ignored."
    t, s = c.q.shape[2], c.k.shape[2]
    if t < s and c.query_positions is None and _close(got64, _expected(c, torch.arange(t), window), c.q.dtype):
        return message + f" The output is what queries at positions 0..{t - 1} give: the offset S - T was ignored."
    for other, words in ((window + 1, "j >= p - window (one key too many)"),
                         (window - 1, "j > p - window + 1 (one key too few)")):
        if other >= 1 and _close(got64, _expected(c, window=other), c.q.dtype):
            return message + f" The output matches a window off by one: the mask kept {words}."
    if bool(got64[b, h, i].isnan().any()):
        return message + (" The row is NaN: either the loop visited none of the keys this query sees, so l stayed 0 "
                          "and acc / l = 0 / 0 (check start and stop against the query's position), or an "
                          "exponential took -inf - (-inf) in a tile where the row had seen no key yet (use a safe "
                          "reference).")
    return message


def check_window(fn: Callable, cases: Iterable[ac.Case]) -> None:
    """Cases with kwargs window=w must match reference.attention(..., window=w)."""
    for c in cases:
        try:
            got = c.call(fn)
        except TypeError as error:
            raise AssertionError(f"{_name(fn)} does not take window=: {error}") from None
        except ValueError as error:
            raise AssertionError(f"{_name(fn)}, {c.describe()}: raised ValueError({str(error)!r}) on valid inputs") from None
        problem = _window_problem(fn, c, got)
        if problem:
            raise AssertionError(problem)


def check_validation(fn: Callable, device="cpu", dtype: torch.dtype = torch.float32) -> None:
    """ValueError, before anything is launched, for each input the kernel cannot take."""
    base = dict(t=8, s=8, dtype=dtype, device=device)
    ac.check_raises(fn, case("head dim 24", q_heads=2, kv_heads=2, d=24, **base),
                    "the head dimension 24 is not a power of two")
    ac.check_raises(fn, case("head dim 8", q_heads=2, kv_heads=2, d=8, **base),
                    "the head dimension 8 is smaller than 16")
    ac.check_raises(fn, case("Hq=3, Hkv=2", q_heads=3, kv_heads=2, **base),
                    "3 query heads cannot be shared evenly by 2 KV heads")
    if torch.cuda.is_available():
        # Needs a second real device: with a GPU, keep q there (or on the CPU) and move k and v across.
        split = case("k and v on another device", q_heads=2, kv_heads=2, **base)
        other = "cpu" if split.q.device.type == "cuda" else "cuda"
        ac.check_raises(fn, replace(split, k=split.k.to(other), v=split.v.to(other)),
                        f"q is on {split.q.device} while k and v are on {other}")
