"""Checks for attention on tensors, whose failure messages name the learner's likely mistake.

An attention function under test takes q [B, Hq, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] (and
keyword arguments such as positions or a tile size) and returns [B, Hq, T, Dv] in q's dtype. The
checks compare it with `flashcourse.checks.reference.attention` (float64). When they differ, the output is
compared with deliberately wrong versions of the reference, one per classic mistake, and the
message says which one it matches and where (batch, head, query row):

    offset_ignored     query i placed at position i instead of S - T + i
    gqa_modulo         query head h reads KV head h % Hkv instead of h // (Hq // Hkv)
    no_scale           scores not multiplied by 1/sqrt(D)
    scale_over_d       scores multiplied by 1/D instead of 1/sqrt(D)
    mask_off_by_one    a key is visible when key < query instead of key <= query
    no_causal_mask     every query sees every key
    l_not_rescaled     (tiled) l not multiplied by alpha when the maximum rises
    a_not_rescaled     (tiled) the accumulator not multiplied by alpha
    per_tile_softmax   (tiled) each key tile normalized by itself
    no_rescale         (tiled) tile or chunk states added without exp(m_i - m)

NaN output where the reference is finite is reported as the -inf - -inf of a row whose first
tile had no visible key. Tolerances per dtype are the constants in TOLERANCES.

    from flashcourse.checks import core as ac
    cases = ac.standard_cases(torch.float32)
    ac.check_attention(my_attention, cases)                     # uses TOLERANCES[float32]
    ac.check_attention(my_attention, [c.with_kwargs(tile=4) for c in cases], tile_arg="tile")

References: Vaswani et al. (2017), attention; Ainslie et al. (2023), grouped-query attention;
Dao et al. (2022), FlashAttention.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence

import torch

from flashcourse.checks import online_softmax as checks, recurrence, reference
from flashcourse.positions import positions

# (rtol, atol) against the float64 reference, per dtype of the inputs. float32 allows for a
# different summation order; bf16 (8-bit mantissa) and fp16 (11-bit) allow for rounding of the
# inputs, of p cast to the value dtype, and of the output.
FLOAT64_TOL = (1e-9, 1e-10)
FLOAT32_TOL = (1e-4, 1e-4)
BFLOAT16_TOL = (2e-2, 2e-2)
FLOAT16_TOL = (5e-3, 5e-3)
TOLERANCES = {
    torch.float64: FLOAT64_TOL,
    torch.float32: FLOAT32_TOL,
    torch.bfloat16: BFLOAT16_TOL,
    torch.float16: FLOAT16_TOL,
}

NAN_HINT = ("a query row's first tile had no visible key: its maximum m was still -inf, and "
            "exp(-inf - -inf) is NaN. Use a safe reference (for example 0) for rows that have seen "
            "no visible key yet")
# A NaN that no recognised mistake explains: what to look at, naming no cause.
NAN_CHECKLIST = ("Check where each query sits (S - T + i unless positions are given) and which keys its loop "
                 "visits: a row that meets none of its keys keeps l = 0, and a / l = 0 / 0 is NaN. Check too that "
                 "a row with no visible key yet is measured against a safe reference (exp(-inf - -inf) is NaN)")

# The classic mistakes the checks recognise, by name, in the learner's words.
BUGS = {
    "offset_ignored": "the query offset was ignored: query row i was placed at position i instead of "
                      "S - T + i, so with T < S each query saw too few keys",
    "gqa_modulo": "query head h read KV head h % Hkv instead of h // (Hq // Hkv)",
    "no_scale": "the scores were not multiplied by 1/sqrt(D)",
    "scale_over_d": "the scores were multiplied by 1/D instead of 1/sqrt(D)",
    "mask_off_by_one": "the causal mask used key < query instead of key <= query (a query must see "
                       "the key at its own position)",
    "no_causal_mask": "there was no causal mask: every query saw every key, including later ones",
    "last_key_dropped": "the last key was never read: a loop over the keys that stops one key short",
    "exp2_without_log2e": "exp2 was used without the factor log2(e): 2^x is e^(x ln 2), so every score was "
                          "scaled by ln 2 = 0.693 too; multiply the scores (or the scale) by log2(e) = 1.4427 "
                          "before exp2",
    **{name: words for name, words in recurrence.BUGS.items() if name is not None},
    "no_rescale": "neither l nor a was rescaled: the partial states were added up without the factor "
                  "exp(m_i - m)",
}
# What a switched-on step of a kernel typically gets wrong, for check_against_baseline: the keyword that
# switches the step, and the mistake in the learner's words.
STEP_HINTS = {
    "split_diagonal": "an unmasked tile held a key that some query of the block may not see. Only tiles ending at "
                      "or before the block's first query position may skip the mask: round that position down to "
                      "a tile.",
    "splits": "the chunks or their merge. Every key must fall in exactly one chunk (the last chunk may be "
              "shorter, a chunk may hold no key), and each partial (m_i, l_i, acc_i) must be rescaled by "
              "exp(m_i - M), M the largest m_i, in both the numerator and the denominator; a chunk that holds no "
              "key has m = -inf and weighs 0.",
}
TILED_BUGS = (*(name for name in recurrence.BUGS if name is not None), "no_rescale")
MASK_BUGS = ("mask_off_by_one", "no_causal_mask")   # not named for a function that applies no mask (02)
WHOLE_BUGS = tuple(name for name in BUGS if name not in TILED_BUGS)


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing an output computed in `dtype` with the float64 reference."""
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerance for {dtype}; known: {list(TOLERANCES)}")
    return TOLERANCES[dtype]


@dataclass(frozen=True)
class Case:
    """One call of an attention function: its inputs, its keyword arguments, and how to describe it.

    `query_positions` and `key_positions` are what the reference uses ([T] or [B, T], None for the
    default offset S - T); `kwargs` is what the function under test receives besides q, k, v.
    """

    name: str
    q: torch.Tensor                     # [B, Hq, T, D]
    k: torch.Tensor                     # [B, Hkv, S, D]
    v: torch.Tensor                     # [B, Hkv, S, Dv]
    query_positions: torch.Tensor | None = None
    key_positions: torch.Tensor | None = None
    kwargs: dict = field(default_factory=dict)
    masked: bool = True                 # the function applies a causal mask (02's single query applies none)

    def with_kwargs(self, **kwargs) -> "Case":
        """The same inputs, called with extra keyword arguments (a tile size, block sizes...)."""
        return replace(self, kwargs={**self.kwargs, **kwargs})

    def to(self, device=None, dtype=None) -> "Case":
        """The same case on another device or in another floating dtype (positions stay integers)."""
        move = lambda x: None if x is None else x.to(device=device)  # noqa: E731
        return replace(self, q=self.q.to(device, dtype), k=self.k.to(device, dtype), v=self.v.to(device, dtype),
                       query_positions=move(self.query_positions), key_positions=move(self.key_positions),
                       kwargs={key: (x.to(device) if isinstance(x, torch.Tensor) else x)
                               for key, x in self.kwargs.items()})

    @property
    def shape_text(self) -> str:
        b, hq, t, d = self.q.shape
        return f"B={b}, Hq={hq}, Hkv={self.k.shape[1]}, T={t}, S={self.k.shape[2]}, D={d}"

    def describe(self) -> str:
        extra = "".join(f", {key}={_short(x)}" for key, x in self.kwargs.items())
        return f"case '{self.name}' [{self.shape_text}{extra}]"

    def call(self, fn: Callable) -> torch.Tensor:
        return fn(self.q, self.k, self.v, **self.kwargs)

    def expected(self) -> torch.Tensor:
        """The float64 reference output [B, Hq, T, Dv]."""
        return reference.attention(self.q, self.k, self.v, self.query_positions, self.key_positions)


def _short(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor{list(x.shape)}" if x.numel() > 8 else str(x.tolist())
    return repr(x)


def make_case(name: str, batch: int = 1, q_heads: int = 2, kv_heads: int = 1, t: int = 8, s: int | None = None,
              d: int = 16, dv: int | None = None, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0,
              score_scale: float = 1.0, query_positions=None, key_positions=None, query_offset: int | None = None,
              pass_positions: bool = True, **kwargs) -> Case:
    """Seeded random inputs for one case.

    score_scale multiplies q, so the scores grow by that factor (large scores test the running max).
    Positions given here are used by the reference and, when pass_positions, passed to the function
    as query_positions= / key_positions=. query_offset (for functions taking an offset instead of
    positions) is passed as query_offset= and the reference places query i at query_offset + i.
    """
    s = t if s is None else s
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, t, d, generator=gen, dtype=torch.float64) * score_scale
    k = torch.randn(batch, kv_heads, s, d, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, s, dv or d, generator=gen, dtype=torch.float64)
    qp = None if query_positions is None else torch.as_tensor(query_positions)
    kp = None if key_positions is None else torch.as_tensor(key_positions)
    if pass_positions:
        kwargs = {**({"query_positions": qp} if qp is not None else {}),
                  **({"key_positions": kp} if kp is not None else {}), **kwargs}
    if query_offset is not None:
        if qp is not None:
            raise ValueError("give query_positions or query_offset, not both")
        kwargs["query_offset"] = query_offset
        qp = torch.arange(t) + query_offset
    return Case(name, q, k, v, qp, kp, kwargs).to(device, dtype)


def standard_cases(dtype: torch.dtype = torch.float32, device="cpu", d: int = 16, seed: int = 0) -> list[Case]:
    """Prefill, chunked prefill, decode, GQA, batches, large scores (v has the head dim of q and k).

    No case gives positions, so a function that takes only q, k, v (offset S - T) can run all of them.
    """
    specs = [
        ("prefill", dict(batch=1, q_heads=2, kv_heads=2, t=16, s=16)),
        ("chunked prefill (T < S)", dict(batch=2, q_heads=2, kv_heads=2, t=5, s=19)),
        ("decode (T = 1)", dict(batch=2, q_heads=4, kv_heads=4, t=1, s=23)),
        ("GQA, 4 query heads per KV head", dict(batch=1, q_heads=8, kv_heads=2, t=12, s=12)),
        ("GQA chunked prefill", dict(batch=2, q_heads=6, kv_heads=3, t=7, s=20)),
        ("large scores", dict(batch=1, q_heads=2, kv_heads=1, t=9, s=9, score_scale=30.0)),
    ]
    return [make_case(name, d=d, dtype=dtype, device=device, seed=seed + i, **spec)
            for i, (name, spec) in enumerate(specs)]


PADDING = 10**6   # the position of a padding key: later than every query, so no query ever sees it


def position_cases(dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0) -> list[Case]:
    """Positions given explicitly, in each accepted form: queries [T] shared by the batch and [B, T] per
    sequence, keys [S] with gaps and [B, S] for a right-padded batch. Every query row sees the first key,
    so no row meets a tile without a visible key (that is empty_first_tile_cases' part)."""
    specs = [
        ("query positions [T], key positions [S] with gaps", dict(
            batch=2, q_heads=4, kv_heads=2, t=4, s=10, key_positions=torch.arange(10) * 3,
            query_positions=torch.tensor([5, 9, 20, 27]))),
        ("query positions [B, T]", dict(
            batch=2, q_heads=2, kv_heads=1, t=3, s=12, query_positions=torch.tensor([[4, 7, 11], [2, 3, 9]]))),
        ("key positions [B, S], right-padded batch", dict(
            batch=2, q_heads=2, kv_heads=2, t=3, s=9, query_positions=torch.tensor([[3, 4, 5], [6, 7, 8]]),
            key_positions=torch.tensor([list(range(6)) + [PADDING] * 3, list(range(9))]))),
    ]
    return [make_case(name, dtype=dtype, device=device, seed=seed + 10 + i, **spec)
            for i, (name, spec) in enumerate(specs)]


def empty_first_tile_cases(dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0) -> list[Case]:
    """Query rows whose first key tiles hold no visible key, where a missing safe reference gives NaN:
    a left-padded sequence ([T] positions) and a ring-buffer cache whose newer half is stored first
    ([B, T] positions)."""
    return [
        make_case("left-padded", t=2, s=8, dtype=dtype, device=device, seed=seed + 3,
                  key_positions=torch.tensor([PADDING] * 3 + list(range(5))), query_positions=torch.tensor([3, 4])),
        make_case("ring-buffer cache, GQA", batch=2, q_heads=4, kv_heads=2, t=2, s=12, dtype=dtype, device=device,
                  seed=seed + 4, key_positions=torch.cat([torch.arange(6, 12), torch.arange(6)]),
                  query_positions=torch.tensor([[2, 5], [4, 11]])),
    ]


def _positions(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    b, _, t, _ = case.q.shape
    s = case.k.shape[2]
    return (positions(case.query_positions, b, t, s - t, "cpu").cpu(),
            positions(case.key_positions, b, s, 0, "cpu").cpu())


def _scores_and_mask(case: Case, bug: str | None = None, dtype: torch.dtype = torch.float64):
    """Scores [B, Hq, T, S] and values [B, Hq, S, Dv] in dtype (float64 unless said), and the mask [B, 1, T, S],
    with `bug` injected."""
    q, k, v = (x.detach().cpu().to(dtype) for x in (case.q, case.k, case.v))
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    group = hq // hkv
    heads = torch.arange(hq) % hkv if bug == "gqa_modulo" else torch.arange(hq) // group
    k, v = k[:, heads], v[:, heads]
    scale = {"no_scale": 1.0, "scale_over_d": 1.0 / d,
             "exp2_without_log2e": math.log(2) / math.sqrt(d)}.get(bug, 1.0 / math.sqrt(d))
    scores = q @ k.transpose(-2, -1) * scale
    qp, kp = _positions(case)
    if bug == "offset_ignored" and case.query_positions is None:
        qp = torch.arange(t).expand(b, t)
    if bug == "mask_off_by_one":
        mask = kp[:, None, None, :] < qp[:, None, :, None]
    elif bug == "no_causal_mask":
        mask = torch.ones(b, 1, t, s, dtype=torch.bool)
    else:
        mask = kp[:, None, None, :] <= qp[:, None, :, None]
    if bug == "last_key_dropped":
        mask = mask.clone()
        mask[..., s - 1] = False
    return scores, v, mask


def variant(case: Case, bug: str) -> torch.Tensor:
    """The float64 output [B, Hq, T, Dv] that a function with mistake `bug` returns (NaN rows: no key)."""
    if bug not in WHOLE_BUGS:
        raise ValueError(f"unknown whole-matrix bug {bug!r}; choose one of {WHOLE_BUGS}")
    scores, v, mask = _scores_and_mask(case, bug)
    scores = scores.masked_fill(~mask, -math.inf)
    return torch.softmax(scores, dim=-1) @ v


def tiled_variant(case: Case, tile: int, bug: str | None = None) -> torch.Tensor:
    """The float64 recurrence over key tiles of `tile` keys, with one of TILED_BUGS injected (or none)."""
    if bug is not None and bug not in TILED_BUGS:
        raise ValueError(f"unknown tiled bug {bug!r}; choose one of {TILED_BUGS}")
    scores, v, mask = _scores_and_mask(case)
    scores = scores.masked_fill(~mask, -math.inf)                # [B, Hq, T, S]
    m = torch.full(scores.shape[:-1] + (1,), -math.inf, dtype=torch.float64)
    l = torch.zeros_like(m)
    a = torch.zeros(scores.shape[:-1] + (v.shape[-1],), dtype=torch.float64)
    for start in range(0, scores.shape[-1], tile):
        s_tile = scores[..., start:start + tile]
        m_new = torch.maximum(m, s_tile.amax(-1, keepdim=True))
        ref = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        alpha = torch.exp(m - ref)
        if bug == "no_rescale":
            # Each tile's state against its own maximum, as a chunk of flash-decoding computes it.
            own = s_tile.amax(-1, keepdim=True)
            ref = torch.where(torch.isfinite(own), own, torch.zeros_like(own))
        p = torch.exp(s_tile - ref)
        tile_l, tile_a = p.sum(-1, keepdim=True), p @ v[..., start:start + tile, :]
        if bug == "per_tile_softmax":
            seen = tile_l > 0
            l = l + seen.double()
            a = a + torch.where(seen, tile_a / torch.where(seen, tile_l, torch.ones_like(tile_l)), 0.0)
        else:
            l = (l if bug in ("l_not_rescaled", "no_rescale") else alpha * l) + tile_l
            a = (a if bug in ("a_not_rescaled", "no_rescale") else alpha * a) + tile_a
        m = m_new
    return a / l


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    """Elementwise |got - want| <= atol + rtol |want| (False where either is NaN)."""
    return (got - want).abs() <= atol + rtol * want.abs()


def _where(case: Case, index: tuple[int, ...]) -> str:
    b, h, i = index[:3]
    qp, _ = _positions(case)
    return f"batch {b}, head {h}, query row {i} (position {int(qp[b, i])})"


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _matching_bugs(got: torch.Tensor, case: Case, want: torch.Tensor, rtol: float, atol: float,
                   tile: int | None) -> list[str]:
    """The names of the mistakes whose output `got` equals (where that mistake's output is defined).

    Several can match on one case: with tile = 1, softmax per tile and unrescaled states coincide.
    """
    found = []
    named = [bug for bug in WHOLE_BUGS if case.masked or bug not in MASK_BUGS]
    candidates = [(bug, lambda bug=bug: variant(case, bug)) for bug in named]
    if tile is not None:
        candidates += [(bug, lambda bug=bug: tiled_variant(case, tile, bug)) for bug in TILED_BUGS]
    for bug, make in candidates:
        wrong = make()
        defined = wrong.isfinite().all(-1, keepdim=True).expand_as(wrong)
        differs = ~_close(wrong, want, rtol, atol) & defined
        if not bool(differs.any()):
            continue                      # this mistake gives the right answer on this case
        if bool(_close(got[defined], wrong[defined], 2 * rtol, 2 * atol).all()):
            found.append(bug)
    return found


def _empty_first_tile_nan(got: torch.Tensor, case: Case, want: torch.Tensor, rtol: float, atol: float,
                          tile: int | None, chunked: bool) -> bool:
    """Whether `got` is what a loop without a safe reference returns: NaN on exactly the rows that meet a tile
    with no visible key before any visible key (exp(-inf - -inf)), the reference on every other row.

    A single loop over tiles of `tile` keys: the rows whose first tile holds no visible key. Chunks of `tile`
    keys, each with a loop of its own (whose tile the learner chose): at least the rows that see no key of some
    chunk, at most those that do not see some chunk's first key. No tile known: rows that miss some key. A row
    that sees every key never meets a tile without a visible key, so its NaN has another cause (for example a
    query placed where it sees no key, whose l stays 0 and a / l = 0 / 0).
    """
    nan_rows = torch.isnan(got).any(-1)                                   # [B, Hq, T]
    _, _, mask = _scores_and_mask(case)
    visible = mask[:, 0]                                                  # [B, T, S]
    s = visible.shape[-1]
    if tile is None:
        lower, upper = torch.zeros_like(visible[..., 0]), ~visible.all(-1)
    elif not chunked:
        lower = upper = ~visible[..., :tile].any(-1)
    else:
        chunks = [visible[..., start:start + tile] for start in range(0, s, tile)]
        lower = torch.stack([~c.any(-1) for c in chunks]).any(0)
        upper = torch.stack([~c[..., 0] for c in chunks]).any(0)
    lower, upper = lower[:, None].expand_as(nan_rows), upper[:, None].expand_as(nan_rows)
    if bool((lower & ~nan_rows).any()) or bool((nan_rows & ~upper).any()):
        return False
    rest = ~nan_rows[..., None].expand_as(got)
    return bool(_close(got[rest], want[rest], 2 * rtol, 2 * atol).all())


def explain_output(got, case: Case, rtol: float | None = None, atol: float | None = None,
                   tile: int | None = None, what: str = "attention", advice: bool = True,
                   chunked: bool = False) -> str | None:
    """None when `got` matches the reference for `case`, else a message naming where and which mistake.

    `tile` is the key tile size the function was asked to use; when given, the tiled mistakes
    (l or a not rescaled, softmax per tile) are recognised too. `chunked`: each tile is a chunk whose
    state starts afresh and is merged afterwards (split_attention's chunks), not one step of a single
    loop. Without `advice`, a wrong output that matches no recognised mistake gets no list of usual
    suspects (the caller knows better).
    """
    where = f"{what}, {case.describe()}"
    case = case.to("cpu")                                       # references on the CPU, wherever `got` was computed
    want = case.expected()                                      # [B, Hq, T, Dv] float64
    if not isinstance(got, torch.Tensor):
        return f"{where}: should return a torch.Tensor, got {type(got).__name__}"
    if tuple(got.shape) != tuple(want.shape):
        return f"{where}: output shape {list(got.shape)}, expected [B, Hq, T, Dv] = {list(want.shape)}"
    if got.dtype != case.q.dtype:
        return f"{where}: output dtype {got.dtype}, expected q's dtype {case.q.dtype}"
    default_rtol, default_atol = tolerance(case.q.dtype)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    got = got.detach().cpu().double()
    nan = torch.isnan(got)
    if bool(nan.any()):
        index = tuple(int(x) for x in nan.nonzero()[0])
        rows = int(nan.any(-1).sum())
        message = f"{where}: NaN at {_where(case, index)} ({rows} row(s) with NaN)."
        off_by_one = variant(case, "mask_off_by_one")
        empty = off_by_one.isnan()
        if bool(nan.any(-1).eq(empty.any(-1)).all()) and bool(_close(got[~empty], off_by_one[~empty],
                                                                         2 * rtol, 2 * atol).all()):
            return f"{message} This is exactly what happens when {BUGS['mask_off_by_one']}: that row sees no key."
        if _empty_first_tile_nan(got, case, want, rtol, atol, tile, chunked):
            return f"{message} Likely cause: {NAN_HINT}."
        return message + (f" {NAN_CHECKLIST}." if advice else "")
    if bool(torch.isinf(got).any()):
        index = tuple(int(x) for x in torch.isinf(got).nonzero()[0])
        return (f"{where}: inf at {_where(case, index)}. Subtract the running maximum before exponentiating, "
                "so that exp never sees a large positive argument.")
    ok = _close(got, want, rtol, atol)
    if bool(ok.all()):
        return None
    error = ((got - want).abs() - rtol * want.abs()).masked_fill(ok, -math.inf)
    index = tuple(int(x) for x in torch.unravel_index(error.argmax(), error.shape))
    bad_rows = int((~ok).any(-1).sum())
    total_rows = want.shape[0] * want.shape[1] * want.shape[2]
    message = (f"{where}: wrong at {_where(case, index)}, output element {index[3]}: got {_fmt(got[index])}, "
               f"expected {_fmt(want[index])} (tolerance rtol={rtol:g}, atol={atol:g}); "
               f"{bad_rows} of {total_rows} query rows differ.")
    bugs = _matching_bugs(got, case, want, rtol, atol, tile)
    if bugs:
        return f"{message} This is exactly what happens when " + ", or when ".join(BUGS[b] for b in bugs) + "."
    return message + (" Check the scale 1/sqrt(D), the causal mask by position, and the KV head of each query head."
                      if advice else "")


def check_attention(fn: Callable, cases: Iterable[Case], rtol: float | None = None, atol: float | None = None,
                    tile_arg: str | None = None, tile_of: Callable[[Case], int] | None = None) -> None:
    """Call fn on every case and raise AssertionError at the first wrong output, naming the mistake.

    rtol/atol default to TOLERANCES for the inputs' dtype. tile_arg names the keyword argument that
    sets the key tile size (e.g. "tile" or "block_n"), so tiled mistakes are recognised too;
    tile_of, when the tile is derived from other arguments, computes it from the case: a chunk of keys
    whose state starts afresh and is merged afterwards (split_attention's chunks).
    """
    what = getattr(fn, "__name__", "attention")
    for case in cases:
        try:
            got = case.call(fn)
        except ValueError as error:
            raise AssertionError(_explain_value_error(case, error, what)) from None
        tile = tile_of(case) if tile_of else case.kwargs.get(tile_arg) if tile_arg else None
        problem = explain_output(got, case, rtol, atol, tile, what, chunked=tile_of is not None)
        if problem:
            raise AssertionError(problem)


def check_against_baseline(fn: Callable, cases: Iterable[Case], baseline: dict, hint: str,
                           tile_arg: str | None = None) -> None:
    """Like check_attention, for a function with a switch that changes how, not what, it computes: each case
    is first called with the keyword arguments `baseline` (the plain path: one split, one masked loop). When
    that is right and the case as given is wrong, the message adds `hint`, what the step being switched
    adds and how it typically goes wrong; when the baseline is wrong too, its own message is raised."""
    what = getattr(fn, "__name__", "attention")
    plain = ", ".join(f"{key}={value!r}" for key, value in baseline.items())
    for case in cases:
        check_attention(fn, [case.with_kwargs(**baseline)], tile_arg=tile_arg)
        try:
            got = case.call(fn)
        except ValueError as error:
            raise AssertionError(_explain_value_error(case, error, what)) from None
        problem = explain_output(got, case, tile=case.kwargs.get(tile_arg) if tile_arg else None, what=what,
                                 advice=False)
        if problem:
            raise AssertionError(f"{problem} With {plain} the same case is right, so the mistake is in the step "
                                 f"that setting changes: {hint}")


def _explain_value_error(case: Case, error: ValueError, what: str) -> str:
    message = f"{what}, {case.describe()}: raised ValueError({str(error)!r}) although every query row sees a key."
    if bool(variant(case, "mask_off_by_one").isnan().any()):
        message += f" This is what happens when {BUGS['mask_off_by_one']}: the first query then sees nothing."
    elif case.query_positions is None and bool(variant(case, "offset_ignored").isnan().any()):
        message += f" Perhaps {BUGS['offset_ignored']}."
    return message


def check_raises(fn: Callable, case: Case, reason: str) -> None:
    """fn must raise ValueError on `case`; `reason` says why, for the message."""
    what = getattr(fn, "__name__", "attention")
    try:
        got = case.call(fn)
    except ValueError:
        return
    except Exception as error:  # noqa: BLE001  (any other exception is the learner's bug, reported)
        raise AssertionError(f"{what}, {case.describe()}: should raise ValueError ({reason}), "
                             f"raised {type(error).__name__}: {error}") from None
    message = f"{what}, {case.describe()}: should raise ValueError ({reason}), returned normally"
    if isinstance(got, torch.Tensor) and bool(torch.isnan(got).any()):
        # A row that sees no key ends with l = 0 only if it never met exp(-inf - -inf).
        rows = int(torch.isnan(got).any(-1).sum())
        message += (f" with NaN in {rows} query row(s). Likely cause: {NAN_HINT}; the row then keeps l = 0, "
                    "which is how a row that sees no key is recognised")
    raise AssertionError(message)


def first_tile_empty_rows(case: Case, tile: int) -> torch.Tensor:
    """[B, T] booleans: query rows whose first key tile holds no visible key (where the NaN bug bites)."""
    _, _, mask = _scores_and_mask(case)
    return ~mask[:, 0, :, :tile].any(-1)


def recognise(got, case: Case, tile: int | None = None) -> str | None:
    """"correct" when `got` matches the reference, the name of the mistake it matches, else None."""
    if explain_output(got, case, tile=tile) is None:
        return "correct"
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(case.expected().shape):
        return None
    rtol, atol = tolerance(case.q.dtype)
    bugs = _matching_bugs(got.detach().cpu().double(), case, case.expected(), rtol, atol, tile)
    return bugs[0] if bugs else None


def full_matrix_error(what: str, case: Case, too_big: list, matrix: str, advice: str) -> AssertionError:
    """The failure of a call that created tensors `too_big` (AllocationTracker.created) as large as a whole
    [T, S] matrix of one head: the largest of them, and `advice` on how to keep only a tile of it."""
    t, s = case.q.shape[2], case.k.shape[2]
    biggest = max(too_big, key=lambda a: a.numel)
    return AssertionError(f"{what}, {case.describe()}: created a {biggest.dtype} tensor of shape {list(biggest.shape)} "
                          f"({biggest.numel} elements, from {biggest.op}), as large as the whole [T, S] = [{t}, {s}] "
                          f"{matrix}. {advice}")


def check_no_full_scores(fn: Callable, case: Case, tile_arg: str = "tile") -> None:
    """fn must compute attention without creating a tensor of T * S elements or more (scores, or a mask).

    The full score matrix of one (batch, head) alone has T * S elements, and so has its mask; a tiled
    implementation's largest tensor is about B * Hq * T * tile elements, far smaller for the case given
    (tile < S). The output must still be attention (correct, or one of the recognised mistakes, graded
    elsewhere). A function that runs in another process (a notebook being graded) is measured from outside
    instead: see `check_memory_from_outside`.
    """
    if hasattr(fn, "limited_call"):
        return check_memory_from_outside(fn, case, tile_arg)
    from flashcourse.memory import AllocationTracker

    what = getattr(fn, "__name__", "attention")
    _, _, t, _ = case.q.shape
    s = case.k.shape[2]
    with AllocationTracker() as tracker:
        got = case.call(fn)
    too_big = tracker.created(t * s, floating=False)   # a [T, S] boolean mask too: the probe from outside counts it
    if too_big:
        raise full_matrix_error(what, case, too_big, "score matrix", "Compute the scores and the mask one key tile "
                                f"at a time ([.., T, {case.kwargs.get(tile_arg)}] each) and never keep them all.")
    if recognise(got, case, case.kwargs.get(tile_arg)) is None:
        raise AssertionError(f"{what}, {case.describe()}: the output is not attention (it matches neither the "
                             "reference nor any recognised mistake), so its memory use is not graded.")


# 03's probe from outside: one sequence of one head (B = Hq = Hkv = 1), T and S grown until its float32 [T, S]
# score matrix takes PROBE_SCORE_BYTES (T = S = 16384 from a prefill case), against PROBE_ALLOWANCE. Measured in the
# jail's measured child (2-core CPU, D = 8, tile PROBE_TILE): the instructor's online_attention and every sample
# of autograder/samples peak at 82.8 MiB of address space at most (71.5 MiB resident), in 2.6 to 3.6 s; a loop
# over query blocks of 256 rows holding [256, S] strips at 66 MiB. What cannot fit: that one head's score matrix
# (1024 MiB, 4x the allowance), in bfloat16 or float16 (512 MiB, 2x), or a [T, S] boolean mask beside the work
# (256 MiB, the whole allowance). torch's fused scaled_dot_product_attention with is_causal=True (its CPU flash
# kernel) peaks at 13 MiB: memory alone does not tell it from an online loop, so the grader watches where the call
# spends its time, from outside, and refuses one found in that kernel (autograder/jail/watch.py; README, "What 03's
# memory point proves").
PROBE_SCORE_BYTES = 1 << 30      # one float32 [T, S] score matrix of the probe's one head
PROBE_ALLOWANCE = 256 << 20      # what the call may map beyond its process's start-up size: the honest peak's 3x
PROBE_TILE = 256                 # the probe's tile (06's backward probe uses it too)
PROBE_ROWS = 32                  # query rows compared with the reference at the large size (probe_rows)


def probe_rows(answer: Sequence[torch.Tensor], t: int) -> torch.Tensor:
    """PROBE_ROWS of the T query rows, drawn from a hash of the answer itself: which rows are compared is known
    only once the answer is given, so an answer right on a few rows alone cannot be aimed at them."""
    digest = hashlib.blake2b(digest_size=8)
    for tensor in answer:
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    seed = int.from_bytes(digest.digest(), "little") >> 1
    return torch.randperm(t, generator=torch.Generator().manual_seed(seed))[:PROBE_ROWS]


def unpredictable_seed() -> int:
    """A seed drawn when the check runs, for the inputs of a probe measured from outside: a fixed seed would let an
    earlier cell of the notebook compute the probe's answer with no limit on its memory, and a measured call that
    does no work hand it back."""
    return secrets.randbits(31)


def check_memory_from_outside(fn: Callable, case: Case, tile_arg: str = "tile") -> None:
    """`case` as one sequence of one head (B = Hq = Hkv = 1), scaled up until its float32 [T, S] score matrix
    takes PROBE_SCORE_BYTES, then fn called through `fn.limited_call` (flashcourse.memory's protocol): its
    process may map only PROBE_ALLOWANCE more bytes than at start-up, a quarter of that one head's matrix,
    so only a function that keeps one tile of scores at a time can answer: the whole matrix of a head, even
    in 16 bits and computed in place, does not fit. A few rows of its output must be attention or one of
    the recognised mistakes (graded elsewhere), so a function that gives up on large inputs earns nothing.
    """
    what = getattr(fn, "__name__", "attention")
    t, d = case.q.shape[2], case.q.shape[3]
    s = case.k.shape[2]
    b = hq = 1
    grow = math.ceil(math.sqrt(PROBE_SCORE_BYTES / (4 * t * s)))
    big = make_case(f"{case.name}, one head, {grow}x longer", batch=1, q_heads=1, kv_heads=1, t=t * grow,
                    s=s * grow, d=d, seed=unpredictable_seed(), **{tile_arg: PROBE_TILE})
    matrix_mib = 4 * big.q.shape[2] * big.k.shape[2] >> 20
    try:
        got = fn.limited_call(PROBE_ALLOWANCE, *(big.q, big.k, big.v), **big.kwargs)
    except MemoryError as error:
        raise AssertionError(
            f"{what}, {big.describe()}: with its memory limited to {PROBE_ALLOWANCE >> 20} MiB beyond what the "
            f"kernel held at start-up, it failed ({error}): it needed more memory than a loop over key tiles holds "
            f"(a few [T, {PROBE_TILE}] tiles, tens of MiB). The [T, S] float32 score matrix of this one head alone "
            f"takes {matrix_mib} MiB ({matrix_mib // 2} MiB in 16 bits, {matrix_mib // 4} MiB as a boolean mask): "
            "compute the scores and the mask one key tile at a time and never keep them all.") from None
    expected_shape = (b, hq, big.q.shape[2], big.v.shape[3])
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != expected_shape:
        raise AssertionError(f"{what}, {big.describe()}: expected an output of shape {list(expected_shape)}, got "
                             f"{list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}")
    rows = probe_rows([got], big.q.shape[2])
    offset = big.k.shape[2] - big.q.shape[2]
    picked = got[:, :, rows].detach().cpu()
    # Those rows as cases of their own: placed at their positions, and where "offset ignored" puts them.
    placed = Case(big.name, big.q[:, :, rows], big.k, big.v, query_positions=rows + offset)
    unshifted = Case(big.name, big.q[:, :, rows], big.k, big.v, query_positions=rows)
    if recognise(picked, placed, PROBE_TILE) is None and explain_output(picked, unshifted) is not None:
        raise AssertionError(f"{what}, {big.describe()}: within the memory limit it answered, but rows "
                             f"{rows.tolist()} of its output are neither attention nor a recognised mistake, so its "
                             "memory use earns nothing.")


def partial_states(case: Case, bounds: Iterable[tuple[int, int]], dtype: torch.dtype = torch.float32):
    """Exact (m [B,Hq,T,1], l [B,Hq,T,1], a [B,Hq,T,Dv]) of the keys [start, stop) of each bound, in dtype.

    A row that sees no key of a chunk gets the empty state m = -inf, l = 0, a = 0.
    """
    scores, v, mask = _scores_and_mask(case)
    scores = scores.masked_fill(~mask, -math.inf)
    parts = []
    for start, stop in bounds:
        s = scores[..., start:stop]
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
        parts.append(tuple(x.to(dtype) for x in (m, p.sum(-1, keepdim=True), p @ v[..., start:stop, :])))
    return parts


def _merged_output_and_lse(parts):
    """What any correct merge must give: the output a / l and log-sum-exp m + log l, in float64."""
    m = torch.stack([p[0].double() for p in parts]).amax(0)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    l = sum(torch.exp(p[0].double() - m_safe) * p[1].double() for p in parts)
    a = sum(torch.exp(p[0].double() - m_safe) * p[2].double() for p in parts)
    return a / l, m + torch.log(l)


def check_merge_partials(merge: Callable, parts, rtol: float = 1e-5, atol: float = 1e-5,
                         what: str = "merge_partials") -> None:
    """merge(parts) must return (m, l, a) with a / l and m + log(l) equal to the exact merge.

    Only a / l (the output) and m + log l (the row's log-sum-exp) are compared, so a merge that picks
    another reference than max m_i, or works with log-sum-exps or in base 2 (converted back), is accepted.
    Such a merge rounds m_i * log2(e) or m_i + log(l_i) in the parts' dtype, an error of about one ulp of the
    largest |m_i| in each weight: rtol and atol grow by four of those (3.5e-4 for float32 scores of 730,
    5e-7 for scores near 1). Rows empty in every part are skipped. A mistake is named only when the
    answer equals its output: the states added without rescaling, NaN from a reference that is -inf or from
    a_i / l_i of an empty part.
    """
    parts = [tuple(x.clone() for x in part) for part in parts]
    want_out, want_lse = _merged_output_and_lse(parts)
    finite = [p[0][torch.isfinite(p[0])] for p in parts]
    largest = max((float(x.abs().max()) for x in finite if x.numel()), default=0.0)
    slack = 4 * torch.finfo(parts[0][0].dtype).eps * largest if parts[0][0].is_floating_point() else 0.0
    rtol, atol = rtol + slack, atol + slack
    result = merge([tuple(x.clone() for x in part) for part in parts])
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        raise AssertionError(f"{what} should return the tuple (m, l, a), got {type(result).__name__}")
    m, l, a = (torch.as_tensor(x).detach().cpu().double() for x in result)
    if tuple(a.shape) != tuple(want_out.shape) or tuple(l.shape) != tuple(want_lse.shape) or \
            tuple(m.shape) != tuple(want_lse.shape):
        raise AssertionError(f"{what}: shapes m {list(m.shape)}, l {list(l.shape)}, a {list(a.shape)}; expected "
                             f"m and l {list(want_lse.shape)} ([B, Hq, T, 1]) and a {list(want_out.shape)}")
    seen = torch.isfinite(want_lse)                                   # [B, Hq, T, 1]
    got_out, got_lse = a / l, m + torch.log(l)
    nan_rows = torch.isnan(got_out).any(-1, keepdim=True) & seen      # [B, Hq, T, 1]
    if bool(nan_rows.any()):
        raise AssertionError(_merge_nan_message(parts, nan_rows, seen, got_out, want_out, rtol, atol, what))
    bad_out = ~_close(got_out, want_out, rtol, atol) & seen
    bad_lse = ~_close(got_lse, want_lse, rtol, atol) & seen
    if not bool(bad_out.any() or bad_lse.any()):
        return
    index = tuple(int(x) for x in (bad_out if bool(bad_out.any()) else bad_lse.expand_as(bad_out)).nonzero()[0])
    b, h, i = index[:3]
    naive_out = sum(p[2].double() for p in parts) / sum(p[1].double() for p in parts)
    message = (f"{what} of {len(parts)} parts: wrong at batch {b}, head {h}, query row {i}: a / l = "
               f"{_fmt(got_out[index])} (expected {_fmt(want_out[index])}), m + log(l) = "
               f"{_fmt(got_lse[b, h, i, 0])} (expected {_fmt(want_lse[b, h, i, 0])}).")
    rows = seen.expand_as(got_out)
    # Named only where the unrescaled sum gives another output than the exact merge (not where every row saw
    # keys in one part only, or the mistake is in m + log l alone).
    if bool(bad_out.any()) and not bool(_close(naive_out[rows], want_out[rows], rtol, atol).all()) and \
            bool(_close(got_out[rows], naive_out[rows], 2 * rtol, 2 * atol).all()):
        message += (" The partial l_i and a_i were added without rescaling each by exp(m_i - m), "
                    "m = the largest m_i.")
    raise AssertionError(message)


def _merge_nan_message(parts, nan_rows, seen, got_out, want_out, rtol, atol, what) -> str:
    """The message for a merge whose output a / l is NaN on rows `nan_rows` ([B, Hq, T, 1]) that saw keys.

    NaN already in a part given is said. NaN where the merge took exp(m_i - m) against an m that is -inf (the
    first part's m, or the running maximum of a merge part by part, both -inf while the row has seen no key), or
    took a_i / l_i of a part with l_i = 0, is named when the NaN rows are exactly that mistake's and the other
    rows right (both, where they coincide); other NaN names no cause."""
    b, h, i = (int(x) for x in nan_rows.nonzero()[0][:3])
    where = f"{what} of {len(parts)} parts gave NaN at batch {b}, head {h}, query row {i}, a row that saw keys"
    given = [j for j, part in enumerate(parts) if any(bool(torch.isnan(x[b, h, i]).any()) for x in part)]
    if given:
        return (f"{where}: part {given[0] + 1} given to it holds NaN in that row already. Where the parts came "
                "from the merge itself (merged groups), a row that saw no key of a group must come out of that "
                "merge finite, as m = -inf, l = 0, a = 0.")
    empty = [~torch.isfinite(p[0].double()) for p in parts]                           # [B, Hq, T, 1] each
    references = [empty[0]] + ([empty[0] & empty[1]] if len(parts) > 1 else [])      # first part's m; running max
    divided = torch.stack(empty).any(0)                                               # a_i / l_i of an empty part
    rest = (~nan_rows & seen).expand_as(got_out)
    if not bool(_close(got_out[rest], want_out[rest], 2 * rtol, 2 * atol).all()):
        references, divided = [], torch.zeros_like(divided)
    by_reference = any(bool(torch.equal(nan_rows, r & seen)) for r in references)
    by_division = bool(torch.equal(nan_rows, divided & seen))
    division = "a_i / l_i was taken of a part in which the row saw no key: l_i = 0, and 0 / 0 is NaN"
    if by_reference:
        return (f"{what} of {len(parts)} parts gave NaN: a part in which a row saw no key has m = -inf, l = 0, "
                "a = 0; exp(m_i - m) must be taken against the largest m, which is finite."
                + (f" The same NaN comes when {division}." if by_division else ""))
    if by_division:
        return f"{where}. This is exactly what happens when {division}; such a part must weigh nothing."
    return (f"{where}. A part in which a row saw no key has m = -inf, l = 0, a = 0 and must weigh nothing in the "
            "merge: check every operation on such a part (exp(-inf - -inf) and 0 / 0 are NaN).")


def single_query_case(q, k, v, s: int, d: int, tile: int) -> Case:
    """One query and one head as a Case (float64): q [d], k and v flattened [S * d], as in assignment 02."""
    q64 = torch.tensor(q, dtype=torch.float64).reshape(1, 1, 1, d)
    k64 = torch.tensor(k, dtype=torch.float64).reshape(1, 1, s, d)
    v64 = torch.tensor(v, dtype=torch.float64).reshape(1, 1, s, d)
    return Case(f"one query, S={s}, d={d}", q64, k64, v64, kwargs={"tile": tile}, masked=False)


def check_single_query(fn: Callable, cases: Iterable[tuple], rtol: float = 1e-9, atol: float = 1e-10) -> None:
    """Each case is (q, k, v, S, d, tile) of plain floats; fn(q, k, v, S, d, tile) must return the
    list of d floats softmax(q k^T / sqrt(d)) v, within rtol/atol of the float64 reference."""
    what = getattr(fn, "__name__", "attention")
    for q, k, v, s, d, tile in cases:
        where = f"{what}(S={s}, d={d}, tile={tile})"
        try:
            got = fn(list(q), list(k), list(v), s, d, tile)
        except OverflowError as error:
            largest = max(sum(x * y for x, y in zip(q, k[j * d:(j + 1) * d])) / math.sqrt(d) for j in range(s))
            raise AssertionError(f"{where} raised OverflowError ({error}). {checks.overflow_hint(largest)}") from None
        if not isinstance(got, (list, tuple)) or len(got) != d:
            raise AssertionError(f"{where} should return a list of d = {d} floats, got {got!r:.200}")
        try:
            out = torch.tensor([float(x) for x in got], dtype=torch.float64).reshape(1, 1, 1, d)
        except (TypeError, ValueError):
            raise AssertionError(f"{where} should return floats, got {got!r:.200}") from None
        case = single_query_case(q, k, v, s, d, tile)
        problem = explain_output(out, case, rtol, atol, tile, what)
        if problem:
            raise AssertionError(problem.replace(f"{what}, {case.describe()}", where)
                                 .replace("batch 0, head 0, query row 0 (position " + str(s - 1) + "), output ", ""))
