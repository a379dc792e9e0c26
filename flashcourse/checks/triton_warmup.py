"""The Triton warm-up of assignment 04: four micro-kernels, their PyTorch specs and their checks.

Each warm-up is one step towards the attention kernel:

    tile_copy      a masked, strided tile load and store      spec: the copy itself
    row_softmax    a numerically safe softmax of whole rows    spec: torch.softmax
    score_tile     scaled scores q k^T, one tile per program   spec: q @ k.T / sqrt(D)
    running_stats  the online-softmax statistics over tiles    spec: m = max, l = sum exp(s - m)

The specs are the single definition of what each kernel computes; the notebook shows them with
`show`. Each `check_*` calls the learner's wrapper, compares with the spec in float64, and says
what is wrong in the kernel's terms: which element and block, and which classic mistake the
wrong answer matches (mask missing, strides swapped, maximum not subtracted, masked lanes
counted, ...), only when the output matches that mistake.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from flashcourse.checks import recurrence

FP32_EXP_LIMIT = math.log(torch.finfo(torch.float32).max)   # 88.72: exp(x) overflows FP32 past it
PADDING = -1.0          # what tile_copy's wrapper puts around x: an element of x is never negative
ENCODE = 1024           # tile_copy's input holds ENCODE * row + column, so a misplaced element says where it came from
RTOL, ATOL = 1e-5, 1e-6                   # FP32 kernels against the float64 specs
SCORE_RTOL, SCORE_ATOL = 1e-4, 1e-4       # tl.dot sums D products in FP32
TF32_ATOL = 3e-2                          # TF32's 10-bit mantissa, summed over D <= 64 products


# --- The specs -------------------------------------------------------------------------------


def tile_copy_spec(x: torch.Tensor) -> torch.Tensor:
    """x [M, N] -> out [M, N], a copy: out[i, j] = x[i, j], whatever the strides of x and out."""
    return x.clone()


def row_softmax_spec(x: torch.Tensor) -> torch.Tensor:
    """x [M, N] -> out [M, N]: out[i] = exp(x[i] - max x[i]) / sum_j exp(x[i, j] - max x[i])."""
    e = torch.exp(x - x.max(dim=1, keepdim=True).values)      # [M, N], every entry <= 1
    return e / e.sum(dim=1, keepdim=True)


def score_tile_spec(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [M, D], k [N, D] -> s [M, N] = q @ k.T / sqrt(D): every query's score against every key."""
    return q @ k.T / math.sqrt(q.shape[1])


def running_stats_spec(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """s [M, N] scores (-inf where hidden) -> m [M] = max_j s[i, j], l [M] = sum_j exp(s[i, j] - m[i]).

    A row with no finite score has m = -inf and l = 0.
    """
    m = s.max(dim=1).values                                    # [M]
    reference = torch.where(m == -math.inf, 0.0, m)            # exp(-inf - (-inf)) would be NaN
    return m, torch.exp(s - reference[:, None]).sum(dim=1)


def show(spec: Callable) -> None:
    """Print a spec's source: the definition the kernel is checked against."""
    print(inspect.getsource(spec))


# --- Inputs ------------------------------------------------------------------------------------


def copy_input(rows: int, cols: int) -> torch.Tensor:
    """[rows, cols] float32 holding ENCODE * row + column: every element names its own place."""
    return (torch.arange(rows)[:, None] * ENCODE + torch.arange(cols)[None, :]).float()


def softmax_input(rows: int, cols: int, seed: int = 0, large: float = 1000.0) -> torch.Tensor:
    """Seeded scores [rows, cols] around 0, with row 1 shifted by `large`: exp overflows FP32 there
    unless the maximum is subtracted."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 3
    x[1] += large
    return x


def scores_input(rows: int, cols: int, block_n: int, seed: int = 0) -> torch.Tensor:
    """Seeded scores [rows, cols] with what the attention kernel meets: -inf entries, a row whose first
    two tiles are -inf (m stays -inf), a row with no finite score, and a row of scores near 1000."""
    s = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 4
    s[torch.rand(rows, cols, generator=torch.Generator().manual_seed(seed + 1)) < 0.2] = -math.inf
    s[0, : 2 * block_n] = -math.inf
    s[2] = -math.inf
    s[3] += 1000.0
    return s


# --- Shared pieces ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Where:
    """A place in an [M, N] output and the program (block) that owns it."""

    row: int
    col: int
    block_m: int
    block_n: int

    def __str__(self) -> str:
        return f"[{self.row}, {self.col}] (block ({self.row // self.block_m}, {self.col // self.block_n}))"


def _call(fn: Callable, what: str, *args, **kwargs):
    """The learner's wrapper called; a kernel still raising NotImplementedError is named as such."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise
    except Exception as error:  # the interpreter wraps the kernel's exception in its own
        if "NotImplementedError" in f"{type(error).__name__}: {error}":
            raise NotImplementedError(f"{what}: the kernel still raises NotImplementedError") from None
        raise


def _tensor(got, shape: tuple[int, ...], what: str) -> torch.Tensor:
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{what} returned {type(got).__name__}, expected a tensor of shape {list(shape)}")
    if tuple(got.shape) != tuple(shape):
        raise AssertionError(f"{what} returned shape {list(got.shape)}, expected {list(shape)}")
    return got.detach().cpu().double()


def _first_wrong(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> tuple[int, ...] | None:
    """Index of the first element outside the tolerance (NaN against a number counts), or None."""
    infinite = torch.isinf(want)
    close = (got - want).abs() <= atol + rtol * want.abs()
    bad = ~torch.where(infinite, got == want, close)
    return tuple(int(i) for i in bad.nonzero()[0]) if bool(bad.any()) else None


def _matches(got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL, atol: float = ATOL) -> bool:
    return _first_wrong(got, want, rtol, atol) is None


# --- tile_copy -------------------------------------------------------------------------------------


def _read_flat(x: torch.Tensor, block_m: int, addresses: torch.Tensor) -> torch.Tensor:
    """What a load at element offsets `addresses` from x[0, 0] gets in tile_copy's layout: x stored
    column by column with a column stride of M + BLOCK_M, PADDING between and after the columns."""
    m, n = x.shape
    col, row = addresses // (m + block_m), addresses % (m + block_m)
    inside = (row < m) & (col < n)
    return torch.where(inside, x[row.clamp(max=m - 1), col.clamp(max=n - 1)], torch.tensor(PADDING, dtype=x.dtype))


def explain_tile_copy(canvas, x: torch.Tensor, block_m: int, block_n: int, what: str = "tile_copy") -> str | None:
    """None when canvas [M + BLOCK_M, N + BLOCK_N] holds x in its top-left [M, N] and NaN elsewhere."""
    m, n = x.shape
    got = _tensor(canvas, (m + block_m, n + block_n), f"{what} (the whole canvas)")
    out, want = got[:m, :n], tile_copy_spec(x).double()
    bad = _first_wrong(out, want, 0.0, 0.0)
    if bad is None:
        border = ~torch.isnan(got)
        border[:m, :n] = False
        if not bool(border.any()):
            return None
        r, c = (int(i) for i in border.nonzero()[0])
        return (f"{what}: out itself is right, but the kernel also stored at canvas [{r}, {c}], outside the "
                f"[{m}, {n}] output (block ({r // block_m}, {c // block_n}) hangs over its edge): the store's mask "
                "is missing or too loose; mask it with rows < M and cols < N.")
    where = Where(*bad, block_m, block_n)
    value = float(out[bad])
    message = f"{what}, x of shape [{m}, {n}], blocks {block_m} x {block_n}: out{where} is {value:g}, expected {float(want[bad]):g}."
    rows, cols = torch.arange(m)[:, None], torch.arange(n)[None, :]
    swapped = _read_flat(x, block_m, rows * (m + block_m) + cols).double()     # rows with stride_xn, columns with stride_xm
    contiguous = _read_flat(x, block_m, rows * n + cols).double()              # x taken as contiguous [M, N]
    if _matches(out, swapped, 0.0, 0.0):
        return message + (" out[i, j] holds x[j, i] (or the padding): the strides are swapped; the row index "
                          "goes with stride_xm and the column index with stride_xn.")
    if _matches(out, contiguous, 0.0, 0.0):
        return message + (" The load read x as if it were contiguous (rows * N + cols): x is stored column by "
                          "column here, so address it as rows * stride_xm + cols * stride_xn.")
    if math.isnan(value):
        return message + " Nothing was stored there (the canvas's NaN is left): no program's store covered it."
    if value == PADDING:
        return message + " That is the padding around x: the load's address points outside x."
    source_row, source_col = divmod(int(value), ENCODE)
    if value == int(value) and 0 <= source_row < m and source_col < n:
        return message + f" It holds x[{source_row}, {source_col}]: the load's or the store's address is wrong there."
    return message


def check_tile_copy(tile_copy: Callable, shapes: Iterable[tuple[int, int]], block_m: int = 16,
                    block_n: int = 16, device="cpu") -> None:
    """tile_copy(x, block_m, block_n) returns its canvas: x in the top-left corner, NaN everywhere else."""
    for m, n in shapes:
        x = copy_input(m, n)
        got = _call(tile_copy, "tile_copy", x.to(device), block_m=block_m, block_n=block_n)
        problem = explain_tile_copy(got, x, block_m, block_n)
        if problem:
            raise AssertionError(problem)


# --- row_softmax -----------------------------------------------------------------------------------


def _padded(x: torch.Tensor, width: int, fill: float) -> torch.Tensor:
    return torch.cat([x, torch.full((x.shape[0], width - x.shape[1]), fill, dtype=x.dtype)], dim=1)


def explain_row_softmax(got, x: torch.Tensor, what: str = "row_softmax") -> str | None:
    """None when got matches row_softmax_spec(x); else the first wrong element and the mistake it matches."""
    m, n = x.shape
    got = _tensor(got, (m, n), what)
    x64 = x.double()
    want = row_softmax_spec(x64)
    bad = _first_wrong(got, want, RTOL, ATOL)
    if bad is None:
        return None
    i, j = bad
    block = 1 << (n - 1).bit_length()
    message = (f"{what}, x of shape [{m}, {n}] (BLOCK_N = {block}): out[{i}, {j}] is {float(got[bad]):.6g}, "
               f"expected {float(want[bad]):.6g}.")
    if not bool(torch.isfinite(got[i]).all()) and float(x64[i].max()) > FP32_EXP_LIMIT:
        return message + (f" Row {i} reaches {float(x64[i].max()):.4g}, and exp of anything above "
                          f"{FP32_EXP_LIMIT:.2f} overflows FP32 to inf (inf / inf = NaN): subtract the row's maximum "
                          "before tl.exp.")
    counted = row_softmax_spec(_padded(x64, block, 0.0))[:, :n]
    if block > n and _matches(got, counted):
        return message + (f" The {block - n} masked lanes past column {n - 1} were loaded as 0 and counted in the "
                          "sum (and the maximum): load with other=float('-inf'), so exp gives 0 there.")
    if _matches(got, torch.exp(x64 - x64.max(dim=1, keepdim=True).values)):
        return message + " The output is exp(x - max) without the division by the row's sum."
    return message


def check_row_softmax(row_softmax: Callable, inputs: Iterable[torch.Tensor], device="cpu") -> None:
    """row_softmax(x) against the spec, for each x (rows whose length is no power of two)."""
    for x in inputs:
        problem = explain_row_softmax(_call(row_softmax, "row_softmax", x.to(device)), x)
        if problem:
            raise AssertionError(problem)


# --- score_tile ------------------------------------------------------------------------------------


def explain_score_tile(got, q: torch.Tensor, k: torch.Tensor, block_m: int, block_n: int,
                       what: str = "score_tile") -> str | None:
    """None when got matches score_tile_spec(q, k) at FP32's tolerance. TF32 is named only for scores
    computed on a GPU: the interpreter multiplies in true FP32 whatever input_precision says."""
    got_on_gpu = isinstance(got, torch.Tensor) and got.device.type == "cuda"
    m, d = q.shape
    n = k.shape[0]
    got = _tensor(got, (m, n), what)
    q64, k64 = q.double(), k.double()
    want = score_tile_spec(q64, k64)
    bad = _first_wrong(got, want, SCORE_RTOL, SCORE_ATOL)
    if bad is None:
        return None
    message = (f"{what}, q [{m}, {d}], k [{n}, {d}], blocks {block_m} x {block_n}: s{Where(*bad, block_m, block_n)} "
               f"is {float(got[bad]):.6g}, expected {float(want[bad]):.6g}.")
    unscaled = q64 @ k64.T
    if _matches(got, unscaled, SCORE_RTOL, SCORE_ATOL):
        return message + f" The scores are not scaled: multiply q k^T by scale = 1/sqrt(D) = {1 / math.sqrt(d):.4g}."
    if _matches(got, unscaled / d, SCORE_RTOL, SCORE_ATOL):
        return message + f" The scores are divided by D = {d}; the scale is 1/sqrt(D)."
    if got_on_gpu and bool(((got - want).abs() <= TF32_ATOL).all()):
        return message + (" Every score is within TF32's rounding (a 10-bit mantissa) but not within FP32's: pass "
                          "input_precision=\"ieee\" to tl.dot, which otherwise multiplies FP32 on TF32 tensor cores.")
    return message


def check_score_tile(score_tile: Callable, shapes: Iterable[tuple[int, int, int]], block_m: int = 16,
                     block_n: int = 16, seed: int = 0, device="cpu") -> None:
    """score_tile(q, k, block_m, block_n) against q @ k.T / sqrt(D), for each (M, N, D)."""
    generator = torch.Generator().manual_seed(seed)
    for m, n, d in shapes:
        q, k = torch.randn(m, d, generator=generator), torch.randn(n, d, generator=generator)
        got = _call(score_tile, "score_tile", q.to(device), k.to(device), block_m=block_m, block_n=block_n)
        problem = explain_score_tile(got, q, k, block_m, block_n)
        if problem:
            raise AssertionError(problem)


# --- running_stats ---------------------------------------------------------------------------------


def _traced(s: torch.Tensor, block_n: int, bug: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, l) of recurrence.trace row by row: the course's online recurrence, a bug injected or not."""
    ms, ls = [], []
    for row in s.tolist():
        last = recurrence.trace(row, [0.0] * len(row), block_n, bug)[-1]
        ms.append(last.m_new)
        ls.append(last.l_new)
    return torch.tensor(ms, dtype=torch.float64), torch.tensor(ls, dtype=torch.float64)


def explain_running_stats(got, s: torch.Tensor, block_n: int, what: str = "running_stats") -> str | None:
    """None when got = (m, l) matches running_stats_spec(s); else the first wrong row and the mistake it matches."""
    rows, n = s.shape
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise AssertionError(f"{what} returned {type(got).__name__}, expected the pair (m, l)")
    m_got, l_got = _tensor(got[0], (rows,), f"{what}'s m"), _tensor(got[1], (rows,), f"{what}'s l")
    s64 = s.double()
    m_want, l_want = running_stats_spec(s64)
    where = f"{what}, s of shape [{rows}, {n}], BLOCK_N = {block_n}"
    bad = _first_wrong(m_got, m_want, RTOL, ATOL)
    if bad is not None:
        (i,) = bad
        message = f"{where}: m[{i}] is {float(m_got[i]):.6g}, expected the row's maximum {float(m_want[i]):.6g}."
        last_tile = s64[:, (n - 1) // block_n * block_n:].max(dim=1).values
        if _matches(m_got, last_tile):
            return message + " m is the maximum of the last tile only: keep m = max(m, max of the tile)."
        if n % block_n and _matches(m_got, m_want.clamp(min=0)):
            return message + (" m is 0 wherever every score is below 0 or -inf: the masked lanes past the last key "
                              "were loaded as 0 and counted; load them with other=float('-inf').")
        return message
    bad = _first_wrong(l_got, l_want, RTOL, ATOL)
    if bad is None:
        return None
    (i,) = bad
    row = s64[i]
    message = f"{where}: m is right, but l[{i}] is {float(l_got[i]):.6g}, expected {float(l_want[i]):.6g}."
    if math.isnan(float(l_got[i])) and bool((row[:block_n] == -math.inf).all()):
        return message + (f" Row {i}'s first tile is all -inf, so m is still -inf there and exp(-inf - (-inf)) = "
                          "NaN: take the exponentials against 0 while m is -inf (a safe reference).")
    if math.isinf(float(l_got[i])) and float(row.max()) > FP32_EXP_LIMIT:
        return message + (f" Row {i} reaches {float(row.max()):.4g}: exp(s) overflows FP32 past {FP32_EXP_LIMIT:.2f}; "
                          "subtract the running maximum before tl.exp.")
    if _matches(l_got[i:i + 1], torch.exp(row).sum()[None]):
        return message + (" l is the sum of exp(s), not of exp(s - m): subtract the running maximum (exp overflows "
                          f"FP32 once a score passes {FP32_EXP_LIMIT:.2f}).")
    if _matches(l_got, _traced(s64, block_n, "l_not_rescaled")[1]):
        return message + (" l is not multiplied by alpha = exp(m_old - m_new) when a tile raises the maximum, so "
                          "the earlier terms keep their old scale.")
    padded = n % block_n
    if padded and _matches(l_got, l_want + (block_n - padded) * torch.exp(-torch.where(m_want == -math.inf, 0.0, m_want))):
        return message + (f" The {block_n - padded} masked lanes of the last tile were loaded as 0 and each added "
                          "exp(0 - m) to l: load with other=float('-inf').")
    return message


def check_running_stats(running_stats: Callable, inputs: Iterable[torch.Tensor], block_m: int = 16,
                        block_n: int = 16, device="cpu") -> None:
    """running_stats(s, block_m, block_n) returns (m, l) of each row, computed one key tile at a time."""
    for s in inputs:
        got = _call(running_stats, "running_stats", s.to(device), block_m=block_m, block_n=block_n)
        problem = explain_running_stats(got, s, block_n)
        if problem:
            raise AssertionError(problem)
