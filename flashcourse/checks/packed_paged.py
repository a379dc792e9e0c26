"""09's checks: packed variable-length attention, the paged KV cache, and attention read through its pages.

Layouts are flash-attn's (`flash_attn_varlen_func`, `flash_attn_with_kvcache`):

    q                [total_q, Hq, D]      the queries of every sequence, one after another
    k, v             [total_k, Hkv, D]     likewise for keys and values
    cu_seqlens_q/_k  [B + 1] integers      sequence b's rows are cu[b] .. cu[b + 1] - 1 (cu[0] = 0)
    k_cache, v_cache [num_pages, page_size, Hkv, D]
    block_table      [B, max_pages] integers: page j of sequence b is cache[block_table[b, j]]
    cache_seqlens    [B] integers: sequence b's keys are its positions 0 .. cache_seqlens[b] - 1

Query i of a sequence with len_q queries and len_k keys sits at position len_k - len_q + i (the causal mask is
aligned bottom-right, as flash-attn aligns it); key j at position j. A row that sees no key gives 0.

Each check compares with float64 ground truth (`packed_reference`, `gather_reference`) and, when the answer is
wrong, says where (which sequence, head, query row and position) and names a mistake only when the answer equals
what that mistake computes on the same inputs (`MISTAKES`), never from a symptom several mistakes share. The
paged cases fill every slot no sequence owns (the tail of each last page, the spare pages) with other data, as a
serving engine's cache holds other requests' keys there, so reading one is never harmless.

References: flash-attn's varlen and KV-cache interfaces (Dao, 2023); vLLM's PagedAttention (Kwon et al., 2023).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from flashcourse.checks.core import tolerance

# What each mistake does, in the learner's terms; its output on a case is computed by the functions below.
MISTAKES = {
    "whole_batch": "the packed rows were treated as one long sequence: each query also saw the keys of the other "
                   "sequences in the batch (its neighbours'). Bound each sequence's keys by cu_seqlens_k[b] and "
                   "cu_seqlens_k[b + 1]",
    "earlier_sequences": "each sequence's keys started at row 0 instead of cu_seqlens_k[b]: a query also saw the keys "
                         "of every sequence packed before its own",
    "last_key_dropped": "each sequence stopped one key short: cu_seqlens_k[b + 1] is already one past the last key, "
                        "so the keys are rows cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1 with the end excluded once",
    "top_left": "the causal mask was aligned top-left (query i at position i); with len_q queries and len_k keys "
                "query i sits at position len_k - len_q + i (bottom-right, the newest query sees every key)",
    "mask_off_by_one": "a key was visible when its position < the query's instead of <=",
    "gqa_modulo": "query head h read KV head h % Hkv instead of h // (Hq // Hkv)",
    "no_scale": "the scores were not multiplied by 1/sqrt(D)",
    "nan_for_no_key": "a query row that sees no key returned NaN (l = 0, so a / l = 0 / 0) instead of 0",
    "page_off_by_one": "key j was read from page block_table[b, j // page_size + 1], one entry of the block table "
                       "too far, instead of block_table[b, j // page_size]",
    "whole_last_page": "the last page was read whole: its slots after the sequence's last key hold other data (or "
                       "nothing yet), and were read as keys. Only length - (pages - 1) * page_size slots of the "
                       "last page are the sequence's",
    "contiguous_cache": "the cache was read as if it were contiguous (key j at row j of the flattened cache), "
                        "without the block table",
    "l_not_rescaled": "l was not multiplied by alpha = exp(m_old - m_new) when a later page raised the maximum",
    "a_not_rescaled": "the accumulator a was not multiplied by alpha = exp(m_old - m_new) when a later page raised the "
                      "maximum",
    "per_page_softmax": "each page was normalised by itself (a softmax per page) and the pages' outputs added, instead of "
                        "one running (m, l, a) over every page",
    "next_sequences_pages": "sequence b read the block table's row b + 1, the next sequence's pages",
    "first_sequences_pages": "every sequence read the block table's row 0, the first sequence's pages",
}
PACKED_MISTAKES = ("whole_batch", "earlier_sequences", "last_key_dropped", "top_left", "mask_off_by_one",
                   "gqa_modulo", "no_scale", "nan_for_no_key")
PAGE_MISTAKES = ("page_off_by_one", "whole_last_page", "contiguous_cache")
TABLE_MISTAKES = ("next_sequences_pages", "first_sequences_pages")
PAGE_TILE_MISTAKES = ("l_not_rescaled", "a_not_rescaled", "per_page_softmax")   # a loop over pages, 01's recurrence
OTHER_DATA = 4.0             # the scale of what fills the slots no sequence owns: keys there win the softmax


def spans(cu: torch.Tensor) -> list[tuple[int, int]]:
    """[B + 1] cumulative lengths -> [(start, end)] of each sequence's rows, end excluded."""
    cu = [int(x) for x in cu]
    return list(zip(cu[:-1], cu[1:]))


def cumulative(lengths: Iterable[int]) -> torch.Tensor:
    """Lengths [B] -> cu_seqlens [B + 1], int32, starting at 0 (flash-attn's form)."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int32)


# ----------------------------------------------------------------------------------------------------------------
# Packed attention: the reference and each mistake's output
# ----------------------------------------------------------------------------------------------------------------

def packed_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool = True, mistake: str | None = None):
    """Attention of every packed sequence over its own keys, float64 [total_q, Hq, Dv]; with `mistake`, what that
    mistake of PACKED_MISTAKES computes instead (NaN where it is undefined)."""
    total_q, q_heads, d = q.shape
    total_k, kv_heads, _ = k.shape
    group = q_heads // kv_heads
    heads = (torch.arange(q_heads) % kv_heads) if mistake == "gqa_modulo" else torch.arange(q_heads) // group
    scale = 1.0 if mistake == "no_scale" else 1.0 / math.sqrt(d)
    out = torch.zeros(total_q, q_heads, v.shape[-1], dtype=torch.float64)
    for (qs, qe), (ks, ke) in zip(spans(cu_seqlens_q), spans(cu_seqlens_k)):
        if qe == qs:
            continue
        len_q, len_k = qe - qs, ke - ks
        q_pos = torch.arange(len_q) + len_k - len_q                            # bottom-right, within the sequence
        if mistake == "whole_batch":                                           # one sequence of every row
            qs_all = torch.arange(qs, qe)
            ks, ke, q_pos = 0, total_k, qs_all + total_k - total_q
        elif mistake == "earlier_sequences":
            q_pos, ks = q_pos + ks, 0
        elif mistake == "last_key_dropped" and len_k:
            ke, q_pos = ke - 1, q_pos - 1
        elif mistake == "top_left":
            q_pos = torch.arange(len_q)
        k_pos = torch.arange(ke - ks)
        kb = k[ks:ke].double()[:, heads]                                       # [len_k, Hq, D]
        vb = v[ks:ke].double()[:, heads]                                       # [len_k, Hq, Dv]
        scores = torch.einsum("thd,shd->hts", q[qs:qe].double(), kb) * scale   # [Hq, len_q, len_k]
        visible = torch.ones(len_q, ke - ks, dtype=torch.bool)
        if causal:
            visible = k_pos[None] < q_pos[:, None] if mistake == "mask_off_by_one" else k_pos[None] <= q_pos[:, None]
        scores = scores.masked_fill(~visible, -math.inf)
        seen = visible.any(-1)                                                 # [len_q]
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)                # rows that see nothing: 0
        rows = torch.einsum("hts,shd->thd", weights, vb)
        if mistake == "nan_for_no_key":
            rows[~seen] = math.nan
        out[qs:qe] = rows
    return out


# ----------------------------------------------------------------------------------------------------------------
# The paged cache: the reference gather and each mistake's
# ----------------------------------------------------------------------------------------------------------------

def gather_reference(cache, pages, length: int, mistake: str | None = None):
    """The keys (or values) of one sequence, [length, Hkv, D]: key j is cache[pages[j // page_size], j % page_size].
    With `mistake`, what that mistake of PAGE_MISTAKES reads instead (None where it cannot be read)."""
    page_size = cache.shape[1]
    used = -(-length // page_size)                                              # pages the sequence fills
    pages = [int(p) for p in pages]
    if mistake == "page_off_by_one":
        if used + 1 > len(pages):
            return None
        chosen = pages[1:used + 1]
    else:
        chosen = pages[:used]
    if mistake == "contiguous_cache":
        return cache.reshape(-1, *cache.shape[2:])[:length].clone()
    rows = cache[chosen].reshape(-1, *cache.shape[2:]) if chosen else cache[:0, 0]
    return rows.clone() if mistake == "whole_last_page" else rows[:length].clone()


def gather_sequences(cache, block_table, cache_seqlens, mistake: str | None = None):
    """Every sequence's keys (or values) gathered through its row of the block table and packed, with their
    cu_seqlens; with a mistake of PAGE_MISTAKES or TABLE_MISTAKES, what it reads instead (None if it cannot)."""
    batch = block_table.shape[0]
    parts = []
    for b in range(batch):
        row = {"next_sequences_pages": (b + 1) % batch, "first_sequences_pages": 0}.get(mistake, b)
        part = gather_reference(cache, block_table[row], int(cache_seqlens[b]),
                                mistake if mistake in PAGE_MISTAKES else None)
        if part is None:
            return None
        parts.append(part)
    return torch.cat(parts), cumulative(len(p) for p in parts)


def paged_reference(case: "PagedCase", mistake: str | None = None):
    """float64 [total_q, Hq, Dv]: each sequence's new queries over its cached keys; with `mistake`, what that
    mistake computes (None when it cannot be computed on this case)."""
    if mistake in PAGE_TILE_MISTAKES:
        return _page_loop(case, mistake)
    read = mistake if mistake in PAGE_MISTAKES + TABLE_MISTAKES else None
    gathered = [gather_sequences(c, case.block_table, case.cache_seqlens, read) for c in (case.k_cache, case.v_cache)]
    if gathered[0] is None:
        return None
    (k, cu_k), (v, _) = gathered
    return packed_reference(case.q, k, v, case.cu_seqlens_q, cu_k, case.causal,
                            mistake if mistake in PACKED_MISTAKES else None)


def _page_loop(case: "PagedCase", mistake: str):
    """What a loop over the pages computes with one of PAGE_TILE_MISTAKES in its recurrence, float64."""
    q_heads, d = case.q.shape[1:]
    page_size, kv_heads = case.k_cache.shape[1:3]
    heads = torch.arange(q_heads) // (q_heads // kv_heads)
    out = torch.zeros(case.q.shape[0], q_heads, case.v_cache.shape[-1], dtype=torch.float64)
    for b, (qs, qe) in enumerate(spans(case.cu_seqlens_q)):
        length = int(case.cache_seqlens[b])
        query_pos = torch.arange(qe - qs) + length - (qe - qs)
        qb = case.q[qs:qe].double()                                              # [len_q, Hq, D]
        m = torch.full((qe - qs, q_heads, 1), -math.inf, dtype=torch.float64)
        l = torch.zeros(qe - qs, q_heads, 1, dtype=torch.float64)
        acc = torch.zeros(qe - qs, q_heads, case.v_cache.shape[-1], dtype=torch.float64)
        for j in range(-(-length // page_size)):
            page, n = int(case.block_table[b, j]), min(page_size, length - j * page_size)
            kp = case.k_cache[page, :n].double()[:, heads]                       # [n, Hq, D]
            vp = case.v_cache[page, :n].double()[:, heads]
            s = torch.einsum("thd,nhd->thn", qb, kp) / math.sqrt(d)              # [len_q, Hq, n]
            if case.causal:
                s = s.masked_fill((j * page_size + torch.arange(n))[None, None] > query_pos[:, None, None], -math.inf)
            if mistake == "per_page_softmax":
                acc = acc + torch.einsum("thn,nhd->thd", torch.softmax(s, -1).nan_to_num(0.0), vp)
                continue
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            safe = torch.where(m_new.isfinite(), m_new, torch.zeros_like(m_new))
            alpha, p = torch.exp(m - safe), torch.exp(s - safe)
            l = (l if mistake == "l_not_rescaled" else l * alpha) + p.sum(-1, keepdim=True)
            acc = (acc if mistake == "a_not_rescaled" else acc * alpha) + torch.einsum("thn,nhd->thd", p, vp)
            m = m_new
        out[qs:qe] = acc if mistake == "per_page_softmax" else acc / torch.where(l > 0, l, torch.ones_like(l))
    return out


# ----------------------------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PackedCase:
    """One call of packed_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=...)."""

    name: str
    q: torch.Tensor              # [total_q, Hq, D]
    k: torch.Tensor              # [total_k, Hkv, D]
    v: torch.Tensor              # [total_k, Hkv, D]
    cu_seqlens_q: torch.Tensor   # [B + 1]
    cu_seqlens_k: torch.Tensor   # [B + 1]
    causal: bool = True

    def describe(self) -> str:
        lengths = [(e - s, f - g) for (s, e), (g, f) in zip(spans(self.cu_seqlens_q), spans(self.cu_seqlens_k))]
        return (f"case '{self.name}' [(len_q, len_k) per sequence {lengths}, Hq={self.q.shape[1]}, "
                f"Hkv={self.k.shape[1]}, D={self.q.shape[2]}, causal={self.causal}, {str(self.q.dtype)[6:]}]")

    def call(self, fn: Callable):
        return fn(self.q, self.k, self.v, self.cu_seqlens_q, self.cu_seqlens_k, causal=self.causal)

    def expected(self, mistake: str | None = None):
        return packed_reference(self.q, self.k, self.v, self.cu_seqlens_q, self.cu_seqlens_k, self.causal, mistake)

    def position(self, row: int) -> str:
        """Where packed query row `row` sits: its sequence, its row within it, its position."""
        for b, ((qs, qe), (ks, ke)) in enumerate(zip(spans(self.cu_seqlens_q), spans(self.cu_seqlens_k))):
            if qs <= row < qe:
                return f"sequence {b}, its query row {row - qs} (packed row {row}, position {ke - ks - (qe - qs) + row - qs})"
        return f"packed row {row}"


@dataclass(frozen=True)
class PagedCase:
    """One call of paged_attention(q, k_cache, v_cache, block_table, cache_seqlens, cu_seqlens_q, causal=...)."""

    name: str
    q: torch.Tensor              # [total_q, Hq, D]: each sequence's newest len_q tokens
    k_cache: torch.Tensor        # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor        # [num_pages, page_size, Hkv, D]
    block_table: torch.Tensor    # [B, max_pages]
    cache_seqlens: torch.Tensor  # [B]
    cu_seqlens_q: torch.Tensor   # [B + 1]
    causal: bool = True

    def describe(self) -> str:
        lengths = [(e - s, int(n)) for (s, e), n in zip(spans(self.cu_seqlens_q), self.cache_seqlens)]
        return (f"case '{self.name}' [(new queries, cached keys) per sequence {lengths}, "
                f"page_size={self.k_cache.shape[1]}, Hq={self.q.shape[1]}, Hkv={self.k_cache.shape[2]}, "
                f"D={self.q.shape[2]}, causal={self.causal}, {str(self.q.dtype)[6:]}]")

    def call(self, fn: Callable):
        return fn(self.q, self.k_cache, self.v_cache, self.block_table, self.cache_seqlens, self.cu_seqlens_q,
                  causal=self.causal)

    def expected(self, mistake: str | None = None):
        return paged_reference(self, mistake)

    def position(self, row: int) -> str:
        for b, (qs, qe) in enumerate(spans(self.cu_seqlens_q)):
            if qs <= row < qe:
                return (f"sequence {b}, its query row {row - qs} (packed row {row}, position "
                        f"{int(self.cache_seqlens[b]) - (qe - qs) + row - qs})")
        return f"packed row {row}"


def packed_case(name: str, lengths: list[tuple[int, int]], q_heads: int = 4, kv_heads: int = 2, d: int = 16,
                causal: bool = True, seed: int = 0, dtype: torch.dtype = torch.float32) -> PackedCase:
    """Seeded packed inputs; `lengths` holds (len_q, len_k) of each sequence."""
    gen = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(a for a, _ in lengths), sum(b for _, b in lengths)
    q = torch.randn(total_q, q_heads, d, generator=gen)
    k = torch.randn(total_k, kv_heads, d, generator=gen)
    v = torch.randn(total_k, kv_heads, d, generator=gen)
    return PackedCase(name, q.to(dtype), k.to(dtype), v.to(dtype), cumulative(a for a, _ in lengths),
                      cumulative(b for _, b in lengths), causal)


def paged_cache(lengths: list[int], page_size: int, kv_heads: int, d: int, gen: torch.Generator,
                spare_pages: int = 3, dtype: torch.dtype = torch.float32):
    """A shuffled paged cache holding `lengths` keys and values per sequence: (k_cache, v_cache, block_table).

    Pages are handed out in a random order, every slot no sequence owns (the tail of a last page, the spare pages)
    holds other data, and each row of the block table has one more entry than its longest sequence needs, pointing
    at a spare page as an engine's table points at whatever it reserved next."""
    used = [-(-n // page_size) for n in lengths]
    num_pages = sum(used) + spare_pages
    order = torch.randperm(num_pages, generator=gen)
    k_cache = OTHER_DATA * torch.randn(num_pages, page_size, kv_heads, d, generator=gen)
    v_cache = OTHER_DATA * torch.randn(num_pages, page_size, kv_heads, d, generator=gen)
    width = max(used, default=0) + 1
    spare = order[sum(used):]
    table = torch.empty(len(lengths), width, dtype=torch.int32)
    start = 0
    for b, (n, pages) in enumerate(zip(lengths, used)):
        mine = order[start:start + pages]
        start += pages
        table[b] = torch.cat([mine, spare[torch.randint(len(spare), (width - pages,), generator=gen)]])
        for j in range(n):                                              # the sequence's own keys: ordinary data
            slot = (int(mine[j // page_size]), j % page_size)
            k_cache[slot] = torch.randn(kv_heads, d, generator=gen)
            v_cache[slot] = torch.randn(kv_heads, d, generator=gen)
    return k_cache.to(dtype), v_cache.to(dtype), table


def paged_case(name: str, lengths: list[tuple[int, int]], page_size: int = 4, q_heads: int = 4, kv_heads: int = 2,
               d: int = 16, causal: bool = True, seed: int = 0, dtype: torch.dtype = torch.float32) -> PagedCase:
    """Seeded inputs; `lengths` holds (new queries, cached keys) of each sequence, the new queries' own keys among
    the cached ones (the cache is written before attention reads it)."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, table = paged_cache([n for _, n in lengths], page_size, kv_heads, d, gen, dtype=dtype)
    q = torch.randn(sum(t for t, _ in lengths), q_heads, d, generator=gen).to(dtype)
    return PagedCase(name, q, k_cache, v_cache, table, torch.tensor([n for _, n in lengths], dtype=torch.int32),
                     cumulative(t for t, _ in lengths), causal)


# ----------------------------------------------------------------------------------------------------------------
# Explanations
# ----------------------------------------------------------------------------------------------------------------

def _close(got, want, rtol, atol):
    """Elementwise closeness where NaN matches NaN (a mistake's NaN rows are part of its output)."""
    both_nan = got.isnan() & want.isnan()
    return ((got - want).abs() <= atol + rtol * want.abs()) | both_nan


def _matching(got, case, want, candidates, rtol, atol) -> list[str]:
    """The mistakes whose output on `case` differs from the right answer and equals `got`."""
    found = []
    for mistake in candidates:
        wrong = case.expected(mistake)
        if wrong is None or bool(_close(wrong, want, rtol, atol).all()):
            continue                      # this mistake cannot be computed here, or gives the right answer
        if bool(_close(got, wrong, 2 * rtol, 2 * atol).all()):
            found.append(mistake)
    return found


def _fits(got, case, mistake: str) -> bool:
    """Whether the answer `got` on `case` may be what `mistake` computes: it equals that output within twice the
    tolerance, or the mistake cannot be computed on this case (no evidence against it)."""
    wrong = case.expected(mistake)
    if wrong is None:
        return True
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(wrong.shape):
        return False
    rtol, atol = tolerance(case.q.dtype)
    return bool(_close(got.detach().cpu().double(), wrong, 2 * rtol, 2 * atol).all())


def diagnose(got, case, what: str, candidates: tuple[str, ...]) -> tuple[str, list[str]] | None:
    """None when `got` is the right answer for `case`, else (where it is wrong, the mistakes of `candidates` whose
    output on this case it equals)."""
    where = f"{what}, {case.describe()}"
    want = case.expected()                                                      # [total_q, Hq, Dv] float64
    if not isinstance(got, torch.Tensor):
        return f"{where}: should return a torch.Tensor, got {type(got).__name__}", []
    if tuple(got.shape) != tuple(want.shape):
        return f"{where}: output shape {list(got.shape)}, expected [total_q, Hq, D] = {list(want.shape)}", []
    if got.dtype != case.q.dtype:
        return f"{where}: output dtype {got.dtype}, expected q's dtype {case.q.dtype}", []
    rtol, atol = tolerance(case.q.dtype)
    got = got.detach().cpu().double()
    ok = _close(got, want, rtol, atol)
    if bool(ok.all()):
        return None
    bad = (~ok).any(-1)                                                         # [total_q, Hq]
    row, head = (int(x) for x in bad.nonzero()[0])
    message = (f"{where}: wrong at {case.position(row)}, head {head}: output element 0 is {got[row, head, 0].item():.6g}, "
               f"expected {want[row, head, 0].item():.6g} (tolerance rtol={rtol:g}, atol={atol:g}); "
               f"{int(bad.any(-1).sum())} of {want.shape[0]} query rows differ.")
    return message, _matching(got, case, want, candidates, rtol, atol)


def _checked(fn: Callable, cases, what: str, candidates: tuple[str, ...]) -> None:
    """Call fn on every case; at the first wrong answer raise AssertionError saying where, and naming the mistakes
    whose output it equals there and on every other case (a mistake that would have answered another case
    differently from fn is not fn's, however well it fits the first)."""
    cases = list(cases)
    answers: dict[int, object] = {}
    answer = lambda i: answers[i] if i in answers else answers.setdefault(i, cases[i].call(fn))  # noqa: E731
    for i, case in enumerate(cases):
        found = diagnose(answer(i), case, what, candidates)
        if found is None:
            continue
        message, mistakes = found
        mistakes = [m for m in mistakes if all(_fits(answer(j), other, m) for j, other in enumerate(cases) if j != i)]
        if mistakes:
            message += " This is exactly what happens when " + ", or when ".join(MISTAKES[m] for m in mistakes) + "."
        elif bool(torch.as_tensor(answer(i)).isnan().any()):
            message += " NaN where the answer is finite: a row whose scores are all -inf so far needs a safe maximum."
        raise AssertionError(message)


def check_packed_attention(fn: Callable, cases: Iterable[PackedCase]) -> None:
    """fn(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=...) on every case; AssertionError at the first wrong one."""
    _checked(fn, cases, getattr(fn, "__name__", "packed_attention"), PACKED_MISTAKES)


def check_paged_attention(fn: Callable, cases: Iterable[PagedCase]) -> None:
    """fn(q, k_cache, v_cache, block_table, cache_seqlens, cu_seqlens_q, causal=...) on every case."""
    _checked(fn, cases, getattr(fn, "__name__", "paged_attention"),
             PACKED_MISTAKES + PAGE_MISTAKES + TABLE_MISTAKES + PAGE_TILE_MISTAKES)


def check_gather_pages(fn: Callable, cache: torch.Tensor, pages: torch.Tensor, lengths: Iterable[int]) -> None:
    """fn(cache, pages, length) must give the sequence's keys exactly, [length, Hkv, D], for every length. A mistake
    is named only when fn's answer is what it reads at every length."""
    what = getattr(fn, "__name__", "gather_pages")
    lengths = list(lengths)
    answers = {n: fn(cache, pages, n) for n in lengths}
    for length in lengths:
        got, want = answers[length], gather_reference(cache, pages, length)
        where = (f"{what}(cache, pages, length={length}) with page_size={cache.shape[1]}, "
                 f"pages={[int(p) for p in pages]}")
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{where}: should return a torch.Tensor, got {type(got).__name__}")
        if tuple(got.shape) == tuple(want.shape) and got.dtype == cache.dtype and torch.equal(got.cpu(), want):
            continue
        named = [m for m in PAGE_MISTAKES if not _read_equal(gather_reference(cache, pages, length, m), want)
                 and all(_read_equal(answers[n], gather_reference(cache, pages, n, m)) for n in lengths)]
        because = f" This is exactly what happens when {' or when '.join(MISTAKES[m] for m in named)}." if named else ""
        if tuple(got.shape) != tuple(want.shape):
            raise AssertionError(f"{where}: shape {list(got.shape)}, expected [length, Hkv, D] = {list(want.shape)}."
                                 + because)
        if got.dtype != cache.dtype:
            raise AssertionError(f"{where}: dtype {got.dtype}, expected the cache's {cache.dtype}")
        key = int((got.cpu() != want).flatten(1).any(-1).nonzero()[0])
        page_size = cache.shape[1]
        raise AssertionError(f"{where}: key {key} is wrong; it lives in slot {key % page_size} of page "
                             f"pages[{key // page_size}] = {int(pages[key // page_size])}." + because)


def _read_equal(got, want) -> bool:
    """Two reads of the cache are the same keys (None, what a mistake cannot read, equals nothing)."""
    return (isinstance(got, torch.Tensor) and want is not None and tuple(got.shape) == tuple(want.shape)
            and torch.equal(got.detach().cpu().to(want.dtype), want))
