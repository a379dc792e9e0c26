"""Checks for attention's backward pass and its saved log-sum-exp, naming the learner's likely mistake.

The functions under test follow the course's shapes: q [B, Hq, T, D], k and v [B, Hkv, S, D].

    forward(q, k, v, **kwargs) -> (o [B, Hq, T, Dv], lse [B, Hq, T] float32, natural log)
    backward(q, k, v, o, lse, do, **kwargs) -> (dq like q, dk like k, dv like v)

The ground truth is torch.autograd through `flashcourse.checks.reference.attention` in float64. A row that
sees no key has o = 0 and lse = -inf, and contributes nothing to any gradient (the reference raises
on such rows, so there the same masked softmax is differentiated with those rows set to zero).

When an answer is wrong, it is compared with the answers of deliberately wrong versions, one per
classic mistake, and the message names the mistake only when the answer matches it:

    delta_missing        dS = P * dP, without subtracting Delta
    delta_from_do        Delta = rowsum(dO) instead of rowsum(dO * O)
    delta_from_o         Delta = rowsum(O)
    p_from_max           P rebuilt as exp(S - m), the row maximum saved instead of the log-sum-exp
    lse_read_as_base2    a natural-log lse used as if it were base 2 (exp2(S log2 e - lse))
    base2_lse_with_exp   a base-2 lse used with exp (exp(S - lse2))
    dq_no_scale, dk_no_scale, dq_dk_no_scale                  the scale 1/sqrt(D) missing
    dq_scale_twice, dk_scale_twice, dq_dk_scale_twice         the scale applied twice
    no_causal_backward   the causal mask left out when P is rebuilt
    gqa_last_head        dk, dv written per query head, so the last head of each group wins
    dk_delta_missing, dq_delta_missing                         Delta left out of one gradient only
    dq_heads_modulo, dkdv_heads_modulo                         query head h paired with KV head h % Hkv
    dq_heads_no_batch, dkdv_heads_no_batch                     the batch left out of a kernel's head index
    offset_ignored_backward, dkdv_offset_ignored, dq_offset_ignored   query row i masked as if at position i

and, for the saved lse: lse_is_max (m saved, without log l), lse_base2 (log2 instead of ln), lse_log_l
(log l without m). NaN gradients on rows that see no key are named as exp(-inf - -inf). Each variant is
`gradient_formulas` with one of its arguments changed (BUG_FORMULAS); it computes dQ apart from dK and dV, as
the two Triton kernels do, so a mistake can sit in one of them only. Some mistakes belong to the Triton
kernels' loops and depend on their blocks: a dK/dV loop that starts one query block late
(`dkdv_start_variant`) drops from dK and dV the queries of the first query block that sees each key block, and
a kernel whose diagonal tiles are not masked counts the pairs it visits past the diagonal (`visited_pairs`);
each is tried for the case's blocks, or for every pair of KERNEL_BLOCKS, and named with the blocks that give it
(never for check_backward's PyTorch backward, which has no blocks).

A training step (forward through autograd, then loss.backward()) is checked by `check_train_step`. The Triton
kernels of 06's Exercise 3 are checked one at a time, each given exact inputs (`kernel_inputs`), so a mistake
in one never shows in another, against its own mistakes (DELTA_BUGS, DKDV_BUGS, DQ_BUGS and the block-dependent
ones), with causal=False and explicit blocks as the case's keyword arguments say:

    delta = backward_delta(o, do, **kwargs)                      check_delta
    dk, dv = backward_dkdv(q, k, v, do, lse, delta, **kwargs)    check_dkdv
    dq = backward_dq(q, k, v, do, lse, delta, **kwargs)          check_dq (check_dq_repeated names a race)

    from flashcourse.checks import core as ac, backward as bc
    bc.check_forward_lse(online_attention_lse, [c.with_kwargs(tile=4) for c in ac.standard_cases()])
    bc.check_backward(attention_backward, ac.standard_cases())
    bc.check_dkdv(backward_dkdv, [ac.make_case("GQA", batch=2, q_heads=4, kv_heads=2, t=37, blocks=(16, 32))])

References: Dao et al. (2022), FlashAttention, appendix B (the backward pass); Dao (2023),
FlashAttention-2, section 3.1.
"""

from __future__ import annotations

import itertools
import math
import zlib
from dataclasses import replace
from typing import Callable, Iterable

import torch

from flashcourse.checks import core as ac
from flashcourse.checks import reference
from flashcourse.checks.core import Case, full_matrix_error
from flashcourse.positions import positions

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2
GRADIENTS = ("dq", "dk", "dv")

BACKWARD_BUGS = {
    "delta_missing": "Delta was left out: dS = P * dP instead of P * (dP - Delta), Delta = rowsum(dO * O)",
    "delta_from_do": "Delta was computed as rowsum(dO) instead of rowsum(dO * O)",
    "delta_from_o": "Delta was computed as rowsum(O) instead of rowsum(dO * O)",
    "p_from_max": "P was rebuilt as exp(S - m) with the row maximum m, without dividing by l: the saved "
                  "statistic must be the log-sum-exp m + log(l)",
    "lse_read_as_base2": "the natural-log lse was used as a base-2 one (exp2(S * log2(e) - lse)): convert it, "
                         "exp2(S * log2(e) - lse * log2(e)), or use exp(S - lse)",
    "base2_lse_with_exp": "a base-2 lse was used with exp (exp(S - lse2)): use exp2(S * log2(e) - lse2), or save "
                          "the natural log lse2 * ln(2)",
    "dq_no_scale": "dQ is missing the scale: dQ = scale * dS K",
    "dk_no_scale": "dK is missing the scale: dK = scale * dS^T Q",
    "dq_dk_no_scale": "dQ and dK are both missing the scale: dQ = scale * dS K and dK = scale * dS^T Q",
    "dq_scale_twice": "dQ got the scale twice (once in S, once more in dQ = scale * dS K, with Q already scaled)",
    "dk_scale_twice": "dK got the scale twice (dK = scale * dS^T Q with Q already scaled, or the scale applied twice)",
    "dq_dk_scale_twice": "dQ and dK both got the scale twice",
    "no_causal_backward": "the causal mask was left out of the backward pass: P = exp(S - lse) was rebuilt for keys "
                          "the query may not see",
    "gqa_last_head": "dK and dV were written per query head, so the last query head of each group overwrote the "
                     "others: sum them over the query heads that share the KV head",
    "dk_delta_missing": "Delta was left out of dK only: its dS = P * dP, where dQ's is P * (dP - Delta)",
    "dq_delta_missing": "Delta was left out of dQ only: its dS = P * dP, where dK's is P * (dP - Delta)",
    "dq_heads_modulo": "dQ of query head h read KV head h % Hkv: with Hq/Hkv = g it reads KV head h // g",
    "dkdv_heads_modulo": "dK and dV of KV head j summed query heads j, j + Hkv, ...: with Hq/Hkv = g they are "
                         "j*g .. j*g + g - 1 (query head h reads KV head h // g)",
    "dq_heads_no_batch": "dQ read the keys and values of batch 0 in every batch: the KV head index leaves out the "
                         "batch",
    "dkdv_heads_no_batch": "dK and dV summed the query rows of batch 0 in every batch: the query head index leaves out "
                           "the batch",
    "offset_ignored_backward": "the backward left out the query offset: query row i counted the keys up to position i "
                               "(its mask, or its loop over the keys, placed it at i), where it sees those up to "
                               "offset + i (offset = S - T unless positions are given)",
    "dkdv_offset_ignored": "dK and dV left out the query offset: query row i counted the keys up to position i "
                           "(their mask placed it at i, or their loop over the queries of a key started at the key's "
                           "index), where it sees those up to offset + i (offset = S - T unless positions are given); "
                           "dQ is right",
    "dq_offset_ignored": "dQ left out the query offset: query row i counted the keys up to position i (its mask "
                         "placed it at i, or its loop over the keys stopped there), where it sees those up to "
                         "offset + i (offset = S - T unless positions are given); dK and dV are right",
}
LSE_BUGS = {
    "lse_is_max": "the saved lse is the row maximum m: the log-sum-exp is m + log(l)",
    "lse_base2": "the saved lse is in base 2 (log2 of the sum of exponentials): the course saves the natural "
                 "log, lse2 * ln(2)",
    "lse_log_l": "the saved lse is log(l) without m: the log-sum-exp is m + log(l)",
}
NAN_HINT = ("a query row that sees no key has lse = -inf, and exp(S - lse) is exp(-inf - (-inf)) = NaN there: "
            "give such rows P = 0 (for example, rebuild P against 0 where lse is -inf)")


def upstream(case: Case) -> torch.Tensor:
    """The seeded upstream gradient dO [B, Hq, T, Dv] of a case, in its dtype and on its device."""
    b, hq, t, _ = case.q.shape
    seed = zlib.crc32(f"{case.name} {list(case.q.shape)} {list(case.k.shape)}".encode())
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, hq, t, case.v.shape[-1], generator=gen, dtype=torch.float64).to(case.q.device, case.q.dtype)


def _masked_scores(case: Case, dtype: torch.dtype = torch.float64):
    """Scaled scores with -inf where a key is invisible [B, Hq, T, S], values [B, Hq, S, Dv], mask; in dtype."""
    scores, v, mask = ac._scores_and_mask(case, dtype=dtype)
    return scores.masked_fill_(~mask, -math.inf), v, mask


def reference_forward(case: Case, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, Hq, T, Dv], lse [B, Hq, T]) computed in dtype (float64 unless said); a row that sees no key has
    o = 0 and lse = -inf. In place: one [T, S] matrix, one exp per score (the probes are large)."""
    p, v, _ = _masked_scores(case.to("cpu"), dtype)                     # the scores, then the weights
    m = p.amax(-1, keepdim=True)                                        # -inf where every score is -inf
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    l = p.sub_(safe).exp_().sum(-1, keepdim=True)                       # 0 where no key is seen
    return (p @ v) / torch.where(l > 0, l, torch.ones_like(l)), (safe + torch.log(l)).squeeze(-1)


def saved(case: Case, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """What a correct forward saves for the backward, computed in dtype: o in the case's dtype, lse in float32,
    on its device."""
    o, lse = reference_forward(case, dtype)
    return o.to(case.q.device, case.q.dtype), lse.to(case.q.device, torch.float32)


def reference_gradients(case: Case, do: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 (dq, dk, dv) by torch.autograd through flashcourse.checks.reference.attention.

    Rows that see no key are left out of the loss: their output is zero whatever q, k, v are.
    """
    cpu = case.to("cpu")
    q, k, v = (x.detach().double().requires_grad_() for x in (cpu.q, cpu.k, cpu.v))
    mask = reference.visible_mask(q, k, cpu.query_positions, cpu.key_positions)    # [B, 1, T, S]
    seen = mask.any(-1)                                                             # [B, 1, T]
    if bool(seen.all()):
        out = reference.attention(q, k, v, cpu.query_positions, cpu.key_positions)
    else:
        # The same masked softmax, with the empty rows' scores replaced by zeros and their weights dropped.
        group = q.shape[1] // k.shape[1]
        scores = q @ k.repeat_interleave(group, 1).transpose(-2, -1) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~mask, -math.inf).masked_fill(~seen[..., None], 0.0)
        out = (torch.softmax(scores, -1) * seen[..., None]) @ v.repeat_interleave(group, 1)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do.detach().cpu().double())
    return dq, dk, dv


# How each mistake of BACKWARD_BUGS changes the formulas: gradient_formulas' arguments.
BUG_FORMULAS = {
    "delta_missing": dict(delta_dq="zero", delta_dk="zero"),
    "dk_delta_missing": dict(delta_dk="zero"),
    "dq_delta_missing": dict(delta_dq="zero"),
    "delta_from_do": dict(delta_dq="rowsum_do", delta_dk="rowsum_do"),
    "delta_from_o": dict(delta_dq="rowsum_o", delta_dk="rowsum_o"),
    "p_from_max": dict(p_from="row_max"),
    "lse_read_as_base2": dict(p_from="lse_as_base2"),
    "base2_lse_with_exp": dict(p_from="base2_with_exp"),
    "dq_no_scale": dict(dq_scale=0),
    "dk_no_scale": dict(dk_scale=0),
    "dq_dk_no_scale": dict(dq_scale=0, dk_scale=0),
    "dq_scale_twice": dict(dq_scale=2),
    "dk_scale_twice": dict(dk_scale=2),
    "dq_dk_scale_twice": dict(dq_scale=2, dk_scale=2),
    "no_causal_backward": dict(dq_pairs="all", kv_pairs="all"),
    "gqa_last_head": dict(last_head_only=True),
    "dq_heads_modulo": dict(dq_reads="modulo"),
    "dkdv_heads_modulo": dict(kv_reads="modulo"),
    "dq_heads_no_batch": dict(dq_reads="no_batch"),
    "dkdv_heads_no_batch": dict(kv_reads="no_batch"),
    "offset_ignored_backward": dict(dq_pairs="row_index", kv_pairs="row_index"),
    "dkdv_offset_ignored": dict(kv_pairs="row_index"),
    "dq_offset_ignored": dict(dq_pairs="row_index"),
}


def _read_maps(b: int, hq: int, hkv: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Ways of pairing query heads with KV heads, as (dq_reads [B * Hq], kv_reads [B * Hkv, group]): the flat
    (batch, KV head) row of k and v that each query head's dQ reads, and the flat (batch, query head) rows of q,
    do, lse and Δ that each KV head's dK and dV sum. "right": h // group; "modulo": h % Hkv (KV head j sums
    j, j + Hkv, ...); "no_batch": the batch left out of the index (batch 0's rows everywhere)."""
    group = hq // hkv
    batch, heads, kv, slot = torch.arange(b)[:, None], torch.arange(hq)[None, :], torch.arange(hkv), torch.arange(group)
    return {
        "right": ((batch * hkv + heads // group).reshape(-1),
                  ((batch * hkv + kv[None, :])[..., None] * group + slot).reshape(-1, group)),
        "modulo": ((batch * hkv + heads % hkv).reshape(-1),
                   (batch[..., None] * hq + slot[None, None, :] * hkv + kv[None, :, None]).reshape(-1, group)),
        "no_batch": ((heads // group).expand(b, hq).reshape(-1),
                     (kv[:, None] * group + slot).expand(b, hkv, group).reshape(-1, group)),
    }


def gradient_formulas(case: Case, do: torch.Tensor, *, p_from: str = "lse", delta_dq: str = "exact",
                      delta_dk: str = "exact", dq_scale: int = 1, dk_scale: int = 1, dq_pairs=None, kv_pairs=None,
                      dq_reads: str = "right", kv_reads: str = "right", last_head_only: bool = False):
    """float64 (dq, dk, dv) from the backward formulas, each argument one way of getting a part of them wrong;
    the defaults are the right ways. The forward is always right: o and lse exact. dQ and dK/dV are computed
    apart, as the two kernels do, so a mistake can be on one side only.

    p_from           how P is rebuilt: "lse" exp(S - L); "row_max" exp(S - m); "lse_as_base2" exp2(S log2 e - L);
                     "base2_with_exp" exp(S - L log2 e)
    delta_dq, delta_dk  the Δ that dS = P (dP - Δ) subtracts on the dQ side, on the dK side: "exact"
                     rowsum(dO O), "zero", "rowsum_do", "rowsum_o"
    dq_scale, dk_scale  the power of the scale 1/sqrt(D) in dQ = scale dS K and dK = scale dS^T Q: 1, 0 or 2
    dq_pairs, kv_pairs  the (query, key) pairs whose P counts on each side, [B, 1, T, S] booleans: None the visible
                     ones, "all" every pair, "row_index" those visible to query row i placed at position i (the
                     query offset left out; where the queries sit at no offset, the visible ones)
    dq_reads, kv_reads  how query heads and KV heads are paired on each side (_read_maps): "right", "modulo",
                     "no_batch"
    last_head_only   dK and dV keep the last query head of each group alone (written, not summed)
    """
    cpu = case.to("cpu")
    q, k, v = (x.double() for x in (cpu.q, cpu.k, cpu.v))
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d)
    do = do.detach().cpu().double()
    o, lse = reference_forward(cpu)                                     # [B, Hq, T, Dv], [B, Hq, T]
    scores, _, mask = ac._scores_and_mask(cpu)                          # [B, Hq, T, S], -, [B, 1, T, S]
    seen = torch.isfinite(lse)                                          # [B, Hq, T]: rows that see a key
    ref = {"lse": lse, "lse_as_base2": lse * LN2, "base2_with_exp": lse * LOG2E,
           "row_max": scores.masked_fill(~mask, -math.inf).amax(-1)}[p_from]
    ref = torch.where(seen, ref, torch.zeros_like(ref))
    deltas = {"exact": (do * o).sum(-1), "zero": torch.zeros_like(lse), "rowsum_do": do.sum(-1), "rowsum_o": o.sum(-1)}
    flat = lambda x: x.reshape(b * hq, t, *x.shape[3:])                 # noqa: E731  [B * Hq, T, ...]
    qf, dof, reff, seenf = flat(q), flat(do), flat(ref), flat(seen)
    kf, vf = k.reshape(b * hkv, s, d), v.reshape(b * hkv, s, -1)
    pairs = {None: mask, "all": torch.ones_like(mask)}
    if "row_index" in (dq_pairs, kv_pairs):
        at_index = replace(cpu, query_positions=torch.arange(t)) if _offsets(cpu) is not None else cpu
        pairs["row_index"] = ac._scores_and_mask(at_index)[2]
    dq_mask = (pairs[dq_pairs] if dq_pairs is None or isinstance(dq_pairs, str) else dq_pairs)[:, 0]   # [B, T, S]
    kv_mask = (pairs[kv_pairs] if kv_pairs is None or isinstance(kv_pairs, str) else kv_pairs)[:, 0]
    dq_rows, kv_rows = _read_maps(b, hq, hkv)[dq_reads][0], _read_maps(b, hq, hkv)[kv_reads][1]

    def side(qs, dos, refs, seens, deltas_, ks, vs, visible):
        """P and dS of queries qs [.., T, D] against keys ks [.., S, D]."""
        p = torch.exp(qs @ ks.transpose(-2, -1) * scale - refs[..., None]).masked_fill(~visible, 0.0)
        p = p * seens[..., None]                                        # a row that sees no key: P = 0
        return p, p * (dos @ vs.transpose(-2, -1) - deltas_[..., None])

    keys, values = kf[dq_rows], vf[dq_rows]                             # [B * Hq, S, D]: what each query head reads
    _, ds = side(qf, dof, reff, seenf, flat(deltas[delta_dq]), keys, values, dq_mask.repeat_interleave(hq, 0))
    dq = (scale ** dq_scale * ds @ keys).reshape(q.shape)
    rows = (qf[kv_rows], dof[kv_rows], reff[kv_rows], seenf[kv_rows], flat(deltas[delta_dk])[kv_rows])  # [B*Hkv, g, T..]
    p, ds = side(*rows, kf[:, None], vf[:, None], kv_mask.repeat_interleave(hkv, 0)[:, None])
    dk_heads = (scale ** dk_scale * ds.transpose(-2, -1) @ rows[0]).reshape(b, hkv, group, s, d)
    dv_heads = (p.transpose(-2, -1) @ rows[1]).reshape(b, hkv, group, s, -1)
    if last_head_only:
        return dq, dk_heads[:, :, -1], dv_heads[:, :, -1]
    return dq, dk_heads.sum(2), dv_heads.sum(2)


def backward_variant(case: Case, do: torch.Tensor, bug: str | None = None, kv_dropped: torch.Tensor | None = None):
    """float64 (dq, dk, dv) from the backward formulas, with one of BACKWARD_BUGS injected (or none).

    The forward is always the correct one (o and lse exact): only the backward pass goes wrong.
    kv_dropped ([B, 1, T, S] booleans) leaves those (query, key) pairs out of dK and dV only, as a dK/dV
    kernel whose loop skips some queries does.
    """
    if bug is not None and bug not in BACKWARD_BUGS:
        raise ValueError(f"unknown backward bug {bug!r}; choose one of {tuple(BACKWARD_BUGS)}")
    formulas = dict(BUG_FORMULAS.get(bug, {}))
    if kv_dropped is not None:
        _, _, mask = ac._scores_and_mask(case.to("cpu"))
        formulas["kv_pairs"] = mask & ~kv_dropped
    return gradient_formulas(case, do, **formulas)


def lse_variant(case: Case, bug: str) -> torch.Tensor:
    """The float64 lse [B, Hq, T] a forward with one of LSE_BUGS saves."""
    scores, _, _ = _masked_scores(case.to("cpu"))
    _, lse = reference_forward(case)
    row_max = scores.amax(-1)
    if bug == "lse_is_max":
        return row_max
    if bug == "lse_base2":
        return lse * LOG2E
    if bug == "lse_log_l":
        return torch.where(torch.isfinite(lse), lse - row_max, lse)
    raise ValueError(f"unknown lse bug {bug!r}; choose one of {tuple(LSE_BUGS)}")


def _where_row(case: Case, index: tuple[int, ...]) -> str:
    return ac._where(case.to("cpu"), index)


def _first_wrong(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> tuple[int, ...] | None:
    ok = ac._close(got, want, rtol, atol)
    if bool(ok.all()):
        return None
    error = ((got - want).abs() - rtol * want.abs()).nan_to_num(math.inf).masked_fill(ok, -math.inf)
    return tuple(int(x) for x in torch.unravel_index(error.argmax(), error.shape))


def _wrong_gradients(got, want, names, case: Case, where: str, rtol: float, atol: float
                     ) -> tuple[str, set[str]] | None:
    """None when each gradient in `got` (called by `names`) is within tolerance of `want`; else the message that
    names the wrong ones and where the first of them is first wrong, and the set of their names."""
    wrong = [(name, g, w) for name, g, w in zip(names, got, want) if _first_wrong(g, w, rtol, atol)]
    if not wrong:
        return None
    name, g, w = wrong[0]
    index = _first_wrong(g, w, rtol, atol)
    if name == "dq":
        place = f"{_where_row(case, index)}, element {index[3]}"
    else:
        place = f"batch {index[0]}, KV head {index[1]}, key {index[2]}, element {index[3]}"
    message = (f"{where}: {', '.join(n for n, _, _ in wrong)} wrong; {name} at {place}: got {ac._fmt(g[index])}, "
               f"expected {ac._fmt(w[index])} (tolerance rtol={rtol:g}, atol={atol:g}).")
    return message, {n for n, _, _ in wrong}


def _empty_rows(case: Case) -> torch.Tensor:
    """[B, T] booleans: query rows that see no key at all."""
    _, _, mask = ac._scores_and_mask(case.to("cpu"))
    return ~mask[:, 0].any(-1)


def explain_lse(got, case: Case, what: str = "lse") -> str | None:
    """None when `got` is the natural-log log-sum-exp [B, Hq, T] in float32 (-inf on rows that see no key)."""
    where = f"{what}, {case.describe()}"
    _, want = reference_forward(case)
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
        shape = list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        return f"{where}: lse should be a tensor [B, Hq, T] = {list(want.shape)}, got {shape}"
    if got.dtype != torch.float32:
        return f"{where}: lse should be float32 whatever the inputs' dtype (it feeds exp), got {got.dtype}"
    got = got.detach().cpu().double()
    empty = torch.isinf(want)
    if bool(torch.isnan(got).any()):
        index = tuple(int(x) for x in torch.isnan(got).nonzero()[0])
        cause = (" That row sees no key: its lse is log(0) = -inf, not log(0 / 0)." if bool(empty[index]) else "")
        return f"{where}: NaN at {_where_row(case, index)}.{cause}"
    if bool((got[empty] != -math.inf).any()):
        index = tuple(int(x) for x in (empty & (got != -math.inf)).nonzero()[0])
        return (f"{where}: {_where_row(case, index)} sees no key, so its lse must be -inf (log of an empty sum), "
                f"got {ac._fmt(got[index])}")
    rtol, atol = ac.tolerance(case.q.dtype)
    index = _first_wrong(got.masked_fill(empty, 0.0), want.masked_fill(empty, 0.0), rtol, atol)
    if index is None:
        return None
    message = (f"{where}: wrong at {_where_row(case, index)}: got {ac._fmt(got[index])}, expected "
               f"{ac._fmt(want[index])} = log of the sum of exp(s) over the keys the row sees "
               f"(tolerance rtol={rtol:g}, atol={atol:g}).")
    for bug, words in LSE_BUGS.items():
        wrong = lse_variant(case, bug).masked_fill(empty, 0.0)
        if not bool(ac._close(wrong, want.masked_fill(empty, 0.0), rtol, atol).all()) and \
                bool(ac._close(got.masked_fill(empty, 0.0), wrong, 2 * rtol, 2 * atol).all()):
            return f"{message} This is exactly what happens when {words}."
    return message + " Save m + log(l), the final state's maximum plus the log of its sum."


def explain_forward(result, case: Case, tile: int | None = None, what: str = "forward") -> str | None:
    """None when `result` is (o, lse) for `case`, else a message naming which one is wrong and how."""
    where = f"{what}, {case.describe()}"
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        return f"{where}: should return the pair (o, lse), got {type(result).__name__}"
    o, lse = result
    empty = _empty_rows(case)
    if not bool(empty.any()):
        problem = ac.explain_output(o, case, tile=tile, what=f"{what} (its output o)")
    else:
        problem = _explain_output_with_empty_rows(o, case, empty, where, tile)
    return problem or explain_lse(lse, case, f"{what} (its lse)")


def _explain_output_with_empty_rows(o, case: Case, empty: torch.Tensor, where: str,
                                    tile: int | None = None) -> str | None:
    want, _ = reference_forward(case)
    if not isinstance(o, torch.Tensor) or tuple(o.shape) != tuple(want.shape):
        return f"{where}: o should be a tensor {list(want.shape)} ([B, Hq, T, Dv])"
    got = o.detach().cpu().double()
    rtol, atol = ac.tolerance(case.q.dtype)
    if bool(torch.isnan(got).any()):
        nan_rows = torch.isnan(got).any(-1)                                              # [B, Hq, T]
        index = tuple(int(x) for x in torch.isnan(got).nonzero()[0])
        divided = " the rows that see no key have l = 0 and a = 0, and a / l there is 0 / 0: divide only where l > 0"
        in_empty_rows_only = not bool((nan_rows & ~empty[:, None, :]).any())
        if ac._empty_first_tile_nan(got, case, want, rtol, atol, tile, chunked=False):   # that mistake's output
            hint = f" Likely cause: {ac.NAN_HINT}" + (f"; or, the same NaN,{divided}." if in_empty_rows_only else ".")
        elif in_empty_rows_only:
            hint = f" That row sees no key:{divided}."
        else:
            hint = f" {ac.NAN_CHECKLIST}."
        return f"{where}: NaN in o at {_where_row(case, index)}.{hint}"
    index = _first_wrong(got, want, rtol, atol)
    if index is None:
        return None
    row = "which sees no key, so its output must be 0" if bool(empty[index[0], index[2]]) else "which sees keys"
    return (f"{where}: o wrong at {_where_row(case, index)} ({row}), element {index[3]}: got "
            f"{ac._fmt(got[index])}, expected {ac._fmt(want[index])}.")


def check_forward_lse(fn: Callable, cases: Iterable[Case], tile_arg: str | None = "tile") -> None:
    """fn(q, k, v, **kwargs) must return (o, lse) equal to the reference's; AssertionError naming the mistake."""
    what = getattr(fn, "__name__", "forward")
    for case in cases:
        try:
            result = case.call(fn)
        except ValueError as error:
            why = (" A row that sees no key is not an error here: its o is 0 and its lse -inf."
                   if bool(_empty_rows(case).any()) else "")
            raise AssertionError(f"{what}, {case.describe()}: raised ValueError({str(error)!r}) on valid "
                                 f"arguments.{why}") from None
        problem = explain_forward(result, case, case.kwargs.get(tile_arg) if tile_arg else None, what)
        if problem:
            raise AssertionError(problem)


def _as_gradients(result, case: Case, where: str):
    """The three gradients as float64 CPU tensors, or a message saying what is wrong with their form."""
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        return f"{where}: should return the tuple (dq, dk, dv), got {type(result).__name__}"
    for name, x, like in zip(GRADIENTS, result, (case.q, case.k, case.v)):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(like.shape):
            shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            return (f"{where}: {name} should have the shape of {name[1]} {list(like.shape)}, got {shape}"
                    + (" (GQA: sum the query heads of each KV head)" if name != "dq" and isinstance(x, torch.Tensor)
                       and x.shape[1] == case.q.shape[1] != case.k.shape[1] else ""))
    return tuple(x.detach().cpu().double() for x in result)


def matching_bugs(got, case: Case, do: torch.Tensor, want, rtol: float, atol: float) -> list[str]:
    """The names of the backward mistakes whose (dq, dk, dv) on `case` equal `got` (and differ from `want`)."""
    found = []
    for bug in BACKWARD_BUGS:
        wrong = backward_variant(case, do, bug)
        if all(bool(ac._close(w, r, rtol, atol).all()) for w, r in zip(wrong, want)):
            continue                         # this mistake changes nothing on this case
        if all(bool(ac._close(g, w, 2 * rtol, 2 * atol).all()) for g, w in zip(got, wrong)):
            found.append(bug)
    return found


def explain_gradients(result, case: Case, do: torch.Tensor, what: str = "backward", blocks: bool = True) -> str | None:
    """None when `result` is (dq, dk, dv) of `case` with upstream gradient `do`, else what is wrong.

    blocks: the gradients come from the Triton kernels, whose loops run over blocks (BLOCK_M, BLOCK_N), so the
    mistakes of those loops are tried too; a PyTorch backward (check_backward's, with a key tile) has none."""
    where = f"{what}, {case.describe()}"
    got = _as_gradients(result, case, where)
    if isinstance(got, str):
        return got
    want = reference_gradients(case, do)
    empty = _empty_rows(case)
    nan_rows = torch.isnan(got[0]).any(-1)                             # [B, Hq, T]: rows of dq with a NaN
    for name, g in zip(GRADIENTS, got):
        if bool(torch.isnan(g).any()):
            # A row that sees no key turns NaN in its own dq first (dS of that row); dk and dv follow.
            if bool(nan_rows.any()) and bool(empty[:, None, :].expand_as(nan_rows)[nan_rows].all()):
                return f"{where}: NaN in {name}, from the rows that see no key. This is what happens when {NAN_HINT}."
            return (f"{where}: NaN in {name}" + (", although every query row sees a key" if not bool(empty.any())
                                                 else "") + ": look for inf - inf or 0 / 0 (is P rebuilt as "
                    "exp(S - lse) only for visible keys? In a kernel, rows past T load lse = -inf as well: they need "
                    "P = 0 too)")
    rtol, atol = ac.tolerance(case.q.dtype)
    wrong = _wrong_gradients(got, want, GRADIENTS, case, where, rtol, atol)
    if wrong is None:
        return None
    message, wrong_names = wrong
    bugs = matching_bugs(got, case, do, want, rtol, atol)
    if bugs:
        return f"{message} This is exactly what happens when " + ", or when ".join(BACKWARD_BUGS[b] for b in bugs) + "."
    # A kernel's loop bounds or diagonal mask wrong: one side only (dQ's kernel, or dK/dV's), for some blocks.
    side = "dq" if wrong_names == {"dq"} else "dkdv" if "dq" not in wrong_names else None
    named = _named(got[:1] if side == "dq" else got[1:], case, do, want[:1] if side == "dq" else want[1:], side,
                   rtol, atol, blocks_only=True) if side and blocks else []
    if named:
        return f"{message} This is exactly what happens when " + ", or when ".join(named) + "."
    return message + (" Check Delta = rowsum(dO * O), P = exp(S - lse) on visible keys only, the scale in dQ and "
                      "dK, and that dK and dV sum over the query heads of each KV head.")


# (BLOCK_M, BLOCK_N) pairs of the dK/dV kernel tried when its loop may start a query block late.
KERNEL_BLOCKS = tuple((m, n) for m in (16, 32, 64, 128) for n in (16, 32, 64, 128))
START_LATE = ("the dK/dV loop starts one query block late: key block n is first seen by query first = n * BLOCK_N "
              "- offset, and the loop must start at the block that holds it, (first // BLOCK_M) * BLOCK_M, so dK and "
              "dV miss the queries from first to the next block boundary")


def _offsets(case: Case) -> torch.Tensor | None:
    """[B] the position of query 0 when the queries sit at offset + i (as a kernel's query_offset places
    them) and the keys at 0, 1, ...; None for other positions."""
    b, _, t, _ = case.q.shape
    s = case.k.shape[2]
    if case.key_positions is not None and not torch.equal(torch.as_tensor(case.key_positions).cpu(), torch.arange(s)):
        return None
    qp = positions(case.query_positions, b, t, s - t, "cpu")                        # [B, T]
    if not torch.equal(qp, qp[:, :1] + torch.arange(t)):
        return None
    return qp[:, 0]


def dkdv_start_variant(case: Case, do: torch.Tensor, block_m: int, block_n: int, rounded_up: bool = False):
    """float64 (dq, dk, dv) of a kernel whose dK/dV loop starts one query block late (dq right), or None when
    the case's positions are not those of a query offset or the mistake changes nothing on it.

    The loop starts at the block after the one holding `first` ((first // BLOCK_M + 1) * BLOCK_M), or, with
    rounded_up, at first rounded up to a block boundary (late only where first is not on one).
    """
    offsets = _offsets(case)
    if offsets is None:
        return None
    t, s = case.q.shape[2], case.k.shape[2]
    first = ((torch.arange(s) // block_n * block_n)[None, :] - offsets[:, None]).clamp(min=0)   # [B, S]
    late = (first + block_m - 1) // block_m * block_m if rounded_up else (first // block_m + 1) * block_m
    rows = torch.arange(t)[None, :, None]                                           # [1, T, 1]
    dropped = ((rows >= first[:, None, :]) & (rows < late[:, None, :]))[:, None]    # [B, 1, T, S]
    _, _, mask = ac._scores_and_mask(case.to("cpu"))
    if not bool((dropped & mask).any()):
        return None
    return backward_variant(case, do, kv_dropped=dropped)


# --- Exercise 3 part by part: each kernel alone (Δ; dK and dV; dQ), its mistakes named ---
#
# The launchers of the parts take what the kernel before them would give, exact: o and do for Δ; q, k, v, do,
# lse and Δ for dK/dV and for dQ. So each part is checked alone, and a mistake in one never shows in another.
#
#     delta = backward_delta(o, do, **kwargs)                                      # [B, Hq, T] FP32
#     dk, dv = backward_dkdv(q, k, v, do, lse, delta, **kwargs)                    # like k, v
#     dq = backward_dq(q, k, v, do, lse, delta, **kwargs)                          # like q
#
# kwargs come from the case: query_offset (queries at offset + i), causal (False: every query sees every key),
# blocks ((BLOCK_M, BLOCK_N) to launch, or the launcher's own choice), block_m (Δ's rows per program).

DELTA_BUGS = {
    "rowsum_do": "Δ was computed as rowsum(dO) instead of rowsum(dO ∘ O): multiply the row's O and dO elementwise "
                 "before the sum over D",
    "rowsum_o": "Δ was computed as rowsum(O) instead of rowsum(dO ∘ O): multiply the row's O and dO elementwise "
                "before the sum over D",
    "store_unmasked": "the store of Δ is not masked: the last block of a (batch, head) runs past T, and its padding "
                      "rows (Δ = 0) were written over the first rows of the next head; store with mask=rows < T",
}
DKDV_BUGS = {
    "dk_delta_missing": "Δ was left out of dK: dS = P ∘ (dP − Δ), with Δ = rowsum(dO ∘ O) of each query row (the "
                        "tile's delta), not dS = P ∘ dP (dV = Pᵀ dO needs no Δ, which is why dv is right)",
    "lse_read_as_base2": BACKWARD_BUGS["lse_read_as_base2"],
    "base2_lse_with_exp": BACKWARD_BUGS["base2_lse_with_exp"],
    "dk_no_scale": BACKWARD_BUGS["dk_no_scale"],
    "dk_scale_twice": BACKWARD_BUGS["dk_scale_twice"],
    "no_causal_backward": "the causal mask was left out of dK and dV: every query tile from query 0 on counted every "
                          "key of the block, also the keys after the query",
    "gqa_last_head": BACKWARD_BUGS["gqa_last_head"],
    "dkdv_heads_modulo": "the query heads summed into a KV head are wrong: with Hq/Hkv = g, query head h reads KV head "
                         "h // g, so KV head j sums query heads j·g … j·g + g − 1 (bh = (b·Hkv + j)·g + i for the "
                         "i-th), not j, j + Hkv, j + 2·Hkv, … (h % Hkv = j)",
    "dkdv_heads_no_batch": "the (batch, query head) index bh leaves out the batch: the query rows of batch 0 were "
                           "summed into the keys of every batch (bh = (b·Hkv + kv_h)·g + i)",
}
DQ_BUGS = {
    "dq_delta_missing": "Δ was left out of dQ: dS = P ∘ (dP − Δ), with Δ = rowsum(dO ∘ O) of each query row (the "
                        "program's delta), not dS = P ∘ dP",
    "lse_read_as_base2": BACKWARD_BUGS["lse_read_as_base2"],
    "base2_lse_with_exp": BACKWARD_BUGS["base2_lse_with_exp"],
    "dq_no_scale": BACKWARD_BUGS["dq_no_scale"],
    "dq_scale_twice": BACKWARD_BUGS["dq_scale_twice"],
    "no_causal_backward": "the causal mask was left out of dQ: every key of every tile counted, also the keys after "
                          "the query",
    "dq_heads_modulo": "the KV head index of program bh is wrong: with Hq/Hkv = g, query head h reads KV head h // g, "
                       "not h % Hkv",
    "dq_heads_no_batch": "the (batch, KV head) index leaves out the batch: every batch read the keys and values of "
                         "batch 0 (bkv = b·Hkv + h // g)",
}
# Mistakes whose gradients depend on the kernel's blocks: tried for the case's blocks, or every KERNEL_BLOCKS pair.
DKDV_DIAGONAL = ("the diagonal of dK and dV is not masked: the query tiles that hold queries placed before some of "
                 "the block's keys counted those keys too (those tiles need MASKED=True: Pᵀ = 0 where key > query "
                 "position)")
DQ_DIAGONAL = ("the diagonal block of dQ is not masked: keys after the query were counted (the key tiles from the one "
               "holding the block's first query position on need MASKED=True: P = 0 where key > query position)")
CAUSAL_WHEN_NOT = ("causal=False, but the causal mask was applied: with CAUSAL False every query sees every key, so "
                   "no mask and no causal loop bounds")
KERNEL_NAN_HINT = ("a query row past T (padding: its lse loads as -inf) or a row that sees no key has lse = -inf, and "
                  "exp2(s·log2(e) − lse·log2(e)) = exp2(+inf) = inf there, times a 0 gives NaN: give such rows P = 0 "
                  "(lse2 = +inf where lse is -inf)")


def _reference_case(case: Case) -> Case:
    """The case as the reference sees it: with causal=False, queries placed after every key."""
    if case.kwargs.get("causal", True):
        return case
    t, s = case.q.shape[2], case.k.shape[2]
    return replace(case, query_positions=torch.arange(t) + s, key_positions=None)


def kernel_inputs(case: Case):
    """(q, k, v, do, lse, delta) for the gradient kernels of `case`, exact: lse and Δ = rowsum(dO ∘ O) in FP32,
    do the case's upstream gradient, all on the case's device."""
    ref = _reference_case(case)
    o, lse = saved(ref)
    do = upstream(case)
    delta = (do.double() * o.double()).sum(-1).float()
    return case.q, case.k, case.v, do, lse, delta


def _blocks_of(case: Case) -> tuple[tuple[int, int], ...]:
    """The (BLOCK_M, BLOCK_N) a kernel of `case` may run with: the case's own, or every KERNEL_BLOCKS pair."""
    return (tuple(case.kwargs["blocks"]),) if case.kwargs.get("blocks") else KERNEL_BLOCKS


def visited_pairs(case: Case, block_m: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (query, key) pairs the causal kernels visit with these blocks, [B, 1, T, S] each, or None where the
    queries do not sit at an offset: the dK/dV program of key block n visits the queries from its start,
    (first // BLOCK_M) * BLOCK_M, on; the dQ program of query block m the keys below its stop (one past the key
    its last query sees) rounded up to BLOCK_N. Pairs visited but not visible are the diagonal's."""
    offsets = _offsets(case)
    if offsets is None:
        return None
    t, s = case.q.shape[2], case.k.shape[2]
    rows, keys = torch.arange(t), torch.arange(s)
    first = ((keys // block_n * block_n)[None, :] - offsets[:, None]).clamp(min=0)             # [B, S]
    start = (first // block_m * block_m).clamp(max=t)
    dkdv = rows[None, :, None] >= start[:, None, :]                                              # [B, T, S]
    last_row = ((rows // block_m + 1) * block_m).clamp(max=t) - 1                                # [T]
    stop = (offsets[:, None] + last_row[None, :] + 1).clamp(min=0, max=s)                        # [B, T]
    dq = keys[None, None, :] < ((stop + block_n - 1) // block_n * block_n)[..., None]               # [B, T, S]
    return dkdv[:, None], dq[:, None]


def _variants(case: Case, do: torch.Tensor, side: str):
    """(words, float64 answer of `side`: (dk, dv) for "dkdv", (dq,) for "dq") for each mistake of that side that
    needs no block sizes; with causal=False, also the causal gradients."""
    pick = (lambda g: g[1:]) if side == "dkdv" else (lambda g: g[:1])               # noqa: E731
    causal = case.kwargs.get("causal", True)
    for name, words in (DKDV_BUGS if side == "dkdv" else DQ_BUGS).items():
        if causal or name != "no_causal_backward":
            yield words, pick(gradient_formulas(_reference_case(case), do, **BUG_FORMULAS[name]))
    if not causal:  # the causal mask applied all the same, to P rebuilt from the (not causal) lse
        _, _, mask = ac._scores_and_mask(case.to("cpu"))
        yield CAUSAL_WHEN_NOT, pick(gradient_formulas(_reference_case(case), do, dq_pairs=mask, kv_pairs=mask))


def _block_variants(case: Case, do: torch.Tensor, side: str):
    """(words, (BLOCK_M, BLOCK_N), float64 answer of `side`) for each mistake whose gradients depend on the
    kernel's blocks, for each pair of blocks the case's kernel may run with (causal cases only)."""
    if not case.kwargs.get("causal", True):
        return
    for block_m, block_n in _blocks_of(case):
        pairs = visited_pairs(case, block_m, block_n)
        if pairs is None:
            return
        if side == "dq":
            yield DQ_DIAGONAL, (block_m, block_n), gradient_formulas(case, do, dq_pairs=pairs[1])[:1]
            continue
        yield DKDV_DIAGONAL, (block_m, block_n), gradient_formulas(case, do, kv_pairs=pairs[0])[1:]
        for rounded_up in (False, True):
            late = dkdv_start_variant(case, do, block_m, block_n, rounded_up)
            if late is not None:
                yield START_LATE, (block_m, block_n), late[1:]


def _named(got, case: Case, do: torch.Tensor, want, side: str, rtol: float, atol: float,
           blocks_only: bool = False) -> list[str]:
    """The words of every mistake of `side` whose answer `got` equals (where it differs from `want`); a mistake
    that depends on the blocks is named with every pair of blocks that gives it."""
    same = lambda a, b, r, t: all(bool(ac._close(x, y, r, t).all()) for x, y in zip(a, b))   # noqa: E731
    found, sizes = [], {}
    for words, wrong in ([] if blocks_only else _variants(case, do, side)):
        if not same(wrong, want, rtol, atol) and same(got, wrong, 2 * rtol, 2 * atol) and words not in found:
            found.append(words)
    for words, blocks, wrong in _block_variants(case, do, side):
        if blocks not in sizes.get(words, []) and not same(wrong, want, rtol, atol) and \
                same(got, wrong, 2 * rtol, 2 * atol):
            sizes.setdefault(words, []).append(blocks)
    found += [f"{words} (with (BLOCK_M, BLOCK_N) = {_block_list(blocks)})" for words, blocks in sizes.items()]
    return found


def _block_list(blocks: list[tuple[int, int]], shown: int = 4) -> str:
    """"(16, 32) or (32, 16)"; past `shown` pairs, the first ones and how many more."""
    pairs = [f"({m}, {n})" for m, n in blocks]
    if len(pairs) <= shown:
        return " or ".join(pairs)
    return f"{', '.join(pairs[:shown])} or {len(pairs) - shown} other pairs"


def _as_tensors(result, likes: dict[str, torch.Tensor], where: str):
    """The answer as float64 CPU tensors shaped like `likes` (name -> tensor), or what is wrong with its form."""
    names = list(likes)
    items = [result] if len(names) == 1 else result
    if len(names) > 1 and (not isinstance(result, (tuple, list)) or len(result) != len(names)):
        return f"{where}: should return ({', '.join(names)}), got {type(result).__name__}"
    for name, x in zip(names, items):
        like = likes[name]
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(like.shape):
            shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            return f"{where}: {name} should be shaped {list(like.shape)}, got {shape}"
        if x.dtype != like.dtype:
            return f"{where}: {name} should be {like.dtype}, got {x.dtype}"
    return tuple(x.detach().cpu().double() for x in items)


def _explain_kernel_gradients(result, case: Case, do: torch.Tensor, side: str, what: str) -> str | None:
    where = f"{what}, {case.describe()}"
    likes = {"dk": case.k, "dv": case.v} if side == "dkdv" else {"dq": case.q}
    got = _as_tensors(result, likes, where)
    if isinstance(got, str):
        return got
    full = reference_gradients(_reference_case(case), do)
    want = full[1:] if side == "dkdv" else full[:1]
    for name, g in zip(likes, got):
        if bool(torch.isnan(g).any()):
            return f"{where}: NaN in {name}. This is what happens when {KERNEL_NAN_HINT}."
    rtol, atol = ac.tolerance(case.q.dtype)
    wrong = _wrong_gradients(got, want, likes, case, where, rtol, atol)
    if wrong is None:
        return None
    message, _ = wrong
    found = _named(got, case, do, want, side, rtol, atol)
    if found:
        return f"{message} This is exactly what happens when " + ", or when ".join(found) + "."
    if side == "dkdv":
        return message + (" Check, in _dkdv_tile, Pᵀ = exp2(s·qk_scale − lse·log2 e) with P = 0 for lse = -inf, the "
                          "mask on the diagonal, dS = P ∘ (dP − Δ) and dK += dSᵀ Q; in the kernel, the first query "
                          "block the loop visits, the query heads of the KV head (bh), and the scale of dK.")
    return message + (" Check, in _dq_tile, P = exp2(s·qk_scale − lse·log2 e) with P = 0 for lse = -inf, the mask "
                      "on the diagonal, dS = P ∘ (dP − Δ) and dQ += dS K; in the kernel, the KV head the query head "
                      "reads (bkv), the last key the block sees, and the scale of dQ.")


def _check_kernel(fn: Callable, cases: Iterable[Case], side: str, unnamed: str) -> None:
    """fn(q, k, v, do, lse, delta, **kwargs) checked on each case as the `side` kernel ("dkdv" or "dq"), called by
    its name in the messages, `unnamed` when it has none."""
    what = getattr(fn, "__name__", unnamed)
    for case in cases:
        q, k, v, do, lse, delta = kernel_inputs(case)
        problem = _explain_kernel_gradients(fn(q, k, v, do, lse, delta, **case.kwargs), case, do, side, what)
        if problem:
            raise AssertionError(problem)


def check_dkdv(fn: Callable, cases: Iterable[Case]) -> None:
    """fn(q, k, v, do, lse, delta, **kwargs) -> (dk, dv) must be autograd's, given exact lse and Δ; AssertionError
    naming the mistake (Δ, P, the mask, the loop's start, the heads summed, the scale)."""
    _check_kernel(fn, cases, "dkdv", "dK/dV kernel")


def check_dq(fn: Callable, cases: Iterable[Case]) -> None:
    """fn(q, k, v, do, lse, delta, **kwargs) -> dq must be autograd's, given exact lse and Δ; AssertionError
    naming the mistake (Δ, P, the mask on the diagonal, the KV head read, the scale)."""
    _check_kernel(fn, cases, "dq", "dQ kernel")


def check_dq_repeated(fn: Callable, case: Case, runs: int = 5) -> None:
    """check_dq, `runs` times on one case; a wrong dq that differs between runs is named as a race."""
    what = getattr(fn, "__name__", "dQ kernel")
    q, k, v, do, lse, delta = kernel_inputs(case)
    answers = [fn(q, k, v, do, lse, delta, **case.kwargs) for _ in range(runs)]
    for run, answer in enumerate(answers):
        problem = _explain_kernel_gradients(answer, case, do, "dq", what)
        if problem is None:
            continue
        if all(isinstance(a, torch.Tensor) for a in answers) and any(not torch.equal(a, answers[0]) for a in answers):
            raise AssertionError(f"{what}, {case.describe()}, run {run + 1} of {runs}: {RACE_HINT}. ({problem})")
        raise AssertionError(f"run {run + 1} of {runs}: {problem}")


def delta_variant(case: Case, bug: str, block_m: int = 64) -> torch.Tensor:
    """The float64 Δ [B, Hq, T] of a Δ kernel with one of DELTA_BUGS (store_unmasked: in the order where each
    head's padding rows land after the next head's first block was written)."""
    o, _ = saved(case)
    o, do = o.double().cpu(), upstream(case).double().cpu()
    if bug == "rowsum_do":
        return do.sum(-1)
    if bug == "rowsum_o":
        return o.sum(-1)
    if bug == "store_unmasked":
        delta = (do * o).sum(-1).reshape(-1)                                # [B * Hq * T], flat as in memory
        b, hq, t = o.shape[:3]
        pad = -t % block_m
        for bh in range(1, b * hq):                                         # head bh - 1's padding rows
            delta[bh * t: bh * t + min(pad, t)] = 0.0
        return delta.reshape(b, hq, t)
    raise ValueError(f"unknown Δ bug {bug!r}; choose one of {tuple(DELTA_BUGS)}")


def explain_delta(got, case: Case, what: str = "Δ kernel") -> str | None:
    """None when `got` is Δ = rowsum(dO ∘ O) [B, Hq, T] in FP32 for the case's o and do, else what is wrong."""
    where = f"{what}, {case.describe()}"
    o, _ = saved(case)
    got = _as_tensors(got, {"delta": torch.empty(o.shape[:3], dtype=torch.float32)}, where)
    if isinstance(got, str):
        return got
    got = got[0]
    want = (upstream(case).double().cpu() * o.double().cpu()).sum(-1)
    if bool(torch.isnan(got).any()):
        index = tuple(int(x) for x in torch.isnan(got).nonzero()[0])
        return (f"{where}: NaN in Δ at batch {index[0]}, head {index[1]}, row {index[2]}: do the loads of o and do "
                "read only rows < T (mask, other=0.0)?")
    rtol, atol = ac.tolerance(case.q.dtype)
    index = _first_wrong(got, want, rtol, atol)
    if index is None:
        return None
    message = (f"{where}: Δ wrong at batch {index[0]}, head {index[1]}, row {index[2]}: got {ac._fmt(got[index])}, "
               f"expected rowsum(dO ∘ O) = {ac._fmt(want[index])} (tolerance rtol={rtol:g}, atol={atol:g}).")
    for bug, words in DELTA_BUGS.items():
        wrong = delta_variant(case, bug, case.kwargs.get("block_m", 64))
        if not bool(ac._close(wrong, want, rtol, atol).all()) and bool(ac._close(got, wrong, 2 * rtol, 2 * atol).all()):
            return f"{message} This is exactly what happens when {words}."
    return message + (" Δ_i = Σ_d dO_id O_id: load row i of o and of do (mask rows < T), multiply them, sum over D "
                      "(axis=1) in FP32, and store at delta_ptr + bh * T + rows (mask rows < T).")


def check_delta(fn: Callable, cases: Iterable[Case]) -> None:
    """fn(o, do, **kwargs) -> Δ [B, Hq, T] FP32, with o the case's exact output and do its upstream gradient, must
    be rowsum(dO ∘ O); AssertionError naming the mistake."""
    what = getattr(fn, "__name__", "Δ kernel")
    for case in cases:
        o, _ = saved(case)
        problem = explain_delta(fn(o, upstream(case), **case.kwargs), case, what)
        if problem:
            raise AssertionError(problem)


def call_backward(fn: Callable, case: Case, do: torch.Tensor | None = None):
    """fn(q, k, v, o, lse, do, **kwargs) with the exact saved o and lse; returns (result, do)."""
    do = upstream(case) if do is None else do
    o, lse = saved(case)
    return fn(case.q, case.k, case.v, o, lse, do, **case.kwargs), do


def check_backward(fn: Callable, cases: Iterable[Case]) -> None:
    """fn(q, k, v, o, lse, do, **kwargs) must return autograd's (dq, dk, dv); AssertionError naming the mistake.

    fn is a PyTorch backward over key tiles (06's attention_backward): the mistakes of the Triton kernels' loops
    over blocks (BLOCK_M, BLOCK_N) are not its own, and are not named."""
    what = getattr(fn, "__name__", "backward")
    for case in cases:
        result, do = call_backward(fn, case)
        problem = explain_gradients(result, case, do, what, blocks=False)
        if problem:
            raise AssertionError(problem)


RACE_HINT = ("dq changes from run to run on the same inputs, and is wrong: several programs add into the same rows "
             "of dQ without tl.atomic_add (a plain load-add-store loses an addition whenever two programs race), or "
             "dQ is accumulated into memory that was not zeroed first. Use tl.atomic_add into a zeroed FP32 dq, or "
             "compute dQ in a kernel of its own that writes each row once")


def check_backward_repeated(fn: Callable, case: Case, runs: int = 5) -> None:
    """check_backward, `runs` times on one case: a race on dQ (wrong only sometimes, worse with more programs
    writing the same rows) fails on a GPU. A wrong answer whose dq differs between runs is named as a race."""
    what = getattr(fn, "__name__", "backward")
    do = upstream(case)
    answers = [call_backward(fn, case, do)[0] for _ in range(runs)]
    for run, result in enumerate(answers):
        problem = explain_gradients(result, case, do, what)
        if problem is None:
            continue
        got = [_as_gradients(r, case, "") for r in answers]
        if not any(isinstance(g, str) for g in got) and \
                any(not torch.equal(g[0], got[0][0]) for g in got[1:]):
            raise AssertionError(f"{what}, {case.describe()}, run {run + 1} of {runs}: {RACE_HINT}. ({problem})")
        raise AssertionError(f"run {run + 1} of {runs}: {problem}")


def recognise_gradients(result, case: Case, do: torch.Tensor) -> str | None:
    """"correct", the name of the backward mistake `result` matches on `case`, or None."""
    if explain_gradients(result, case, do) is None:
        return "correct"
    got = _as_gradients(result, case, "")
    if isinstance(got, str):
        return None
    rtol, atol = ac.tolerance(case.q.dtype)
    bugs = matching_bugs(got, case, do, reference_gradients(case, do), rtol, atol)
    return bugs[0] if bugs else None


def _rows(case: Case, rows: torch.Tensor) -> Case:
    """The query rows `rows` of a case as a case of their own, at their absolute positions."""
    b, _, t, _ = case.q.shape
    qp = positions(case.query_positions, b, t, case.k.shape[2] - t, "cpu")[:, rows]
    return Case(f"{case.name}, rows {rows.tolist()}", case.q[:, :, rows], case.k, case.v, qp, case.key_positions)


def _saved_by_rows(case: Case, chunk: int = 512):
    """saved(case) for a probe of some 10^8 scores, `chunk` query rows at a time (never a whole [T, S] matrix), in
    float32: more than twice as fast as float64, within 1e-6 of it. These are the call's inputs o and lse; its
    answer is judged against float64 autograd on a few rows."""
    parts = [saved(_rows(case, torch.arange(start, min(start + chunk, case.q.shape[2]))), torch.float32)
             for start in range(0, case.q.shape[2], chunk)]
    return torch.cat([o for o, _ in parts], 2), torch.cat([lse for _, lse in parts], 2)


def check_backward_memory(fn: Callable, case: Case, tile_arg: str = "tile") -> None:
    """fn(q, k, v, o, lse, do, **kwargs) must not create a floating-point tensor of T * S elements or more.

    Measured with flashcourse.memory's tracker when fn runs here; through `fn.limited_call` (the
    address space limited from outside, as checks.core.check_memory_from_outside does for the
    forward) when it runs in another process. Its answer must be the gradients or a recognised
    mistake (graded elsewhere), so a function that gives up earns nothing.
    """
    if hasattr(fn, "limited_call"):
        return _check_backward_memory_from_outside(fn, case, tile_arg)
    from flashcourse.memory import AllocationTracker

    what = getattr(fn, "__name__", "backward")
    t, s = case.q.shape[2], case.k.shape[2]
    do = upstream(case)
    o, lse = saved(case)
    with AllocationTracker() as tracker:
        result = fn(case.q, case.k, case.v, o, lse, do, **case.kwargs)
    too_big = tracker.created(t * s)
    if too_big:
        raise full_matrix_error(what, case, too_big, "matrix of P", "Rebuild P = exp(S - lse) one key tile at a time "
                                f"([.., {case.kwargs.get(tile_arg)}] keys) and never keep it whole.")
    if recognise_gradients(result, case, do) is None:
        raise AssertionError(f"{what}, {case.describe()}: the gradients are neither autograd's nor a recognised "
                             "mistake's, so their memory use is not graded.")


# The backward's probe, like 03's (checks.core.PROBE_SCORE_BYTES): one sequence of one head (B = Hq = Hkv = 1),
# T and S grown until its float32 [T, S] matrix of P takes PROBE_MATRIX_BYTES (T = 9472, S = 14208 from 06's memory
# cell), against PROBE_ALLOWANCE. Smaller than the forward's because the backward does about 2.5 times its work per
# score and its reference (o, lse and a few rows' gradients) is computed here too. Measured in the jail's measured
# child (2-core CPU shared with other work, D = 8, tile PROBE_TILE): the instructor's attention_backward and every
# 06 sample of autograder/samples that earns the memory point peak at 101.2 MiB of address space at most (90.1 MiB
# resident; alt_correct's query-by-key tiles 46 MiB), the call in 2.0 to 3.8 s, the whole check in 8 to 16 s; a loop
# over strips of 256 query rows against all S keys holds 107 MiB and passes. What cannot fit: that one head's P (or
# dP) as a whole (513 MiB, 2.7x the allowance), or in bfloat16 or float16 (257 MiB); a per-head backward that
# turns each head's whole P into dS in place, which held 188 MiB and passed the former probe (all heads' matrices
# 256 MiB against 192 MiB, so with Hq = 2 one head's 128 MiB fit), is refused at its first [T, S] allocation.
PROBE_MATRIX_BYTES = 512 << 20   # one float32 [T, S] matrix of P of the probe's one head
PROBE_ALLOWANCE = 192 << 20      # what the call may map beyond its process's start-up size: the honest peak's 1.9x


def _check_backward_memory_from_outside(fn: Callable, case: Case, tile_arg: str) -> None:
    what = getattr(fn, "__name__", "backward")
    t, d = case.q.shape[2], case.q.shape[3]
    s = case.k.shape[2]
    grow = math.ceil(math.sqrt(PROBE_MATRIX_BYTES / (4 * t * s)))
    big = ac.make_case(f"{case.name}, one head, {grow}x longer", batch=1, q_heads=1, kv_heads=1, t=t * grow,
                       s=s * grow, d=d, seed=ac.unpredictable_seed(), **{tile_arg: ac.PROBE_TILE})
    do = upstream(big)
    o, lse = _saved_by_rows(big)
    matrix_mib = 4 * big.q.shape[2] * big.k.shape[2] >> 20
    try:
        result = fn.limited_call(PROBE_ALLOWANCE, big.q, big.k, big.v, o, lse, do, **big.kwargs)
    except MemoryError as error:
        raise AssertionError(
            f"{what}, {big.describe()}: with its memory limited to {PROBE_ALLOWANCE >> 20} MiB beyond what the "
            f"kernel held at start-up, it failed ({error}): it needed more memory than a loop over key tiles holds "
            f"(a few [T, {ac.PROBE_TILE}] tiles, about 100 MiB). The [T, S] float32 matrix of P of this one head alone "
            f"takes {matrix_mib} MiB ({matrix_mib // 2} MiB in 16 bits), and so does dP: rebuild P one key tile at a "
            "time and never keep it whole, not even one head's.") from None
    got = _as_gradients(result, big, f"{what}, {big.describe()}")
    if isinstance(got, str):
        raise AssertionError(got)
    # dQ of a row depends on that row alone: a few rows are checked against the reference and the mistakes.
    rows = ac.probe_rows(got, big.q.shape[2])
    few = _rows(big, rows)
    few_do = do[:, :, rows]
    rtol, atol = ac.tolerance(big.q.dtype)
    # Computed one at a time until one matches: the gradient first, the mistakes only for an answer that is not it.
    answers = itertools.chain([lambda: reference_gradients(few, few_do)[0]],
                              (lambda bug=bug: backward_variant(few, few_do, bug)[0] for bug in BACKWARD_BUGS))
    if not any(bool(ac._close(got[0][:, :, rows], dq(), 2 * rtol, 2 * atol).all()) for dq in answers):
        raise AssertionError(f"{what}, {big.describe()}: within the memory limit it answered, but dq of rows "
                             f"{rows.tolist()} is neither the gradient nor a recognised mistake's, so its memory use "
                             "earns nothing.")


def check_train_step(fn: Callable, cases: Iterable[Case]) -> None:
    """fn(q, k, v, do, **kwargs) -> (o, dq, dk, dv), a forward and loss.backward() with the output's gradient do,
    must return the reference output and autograd's gradients; AssertionError naming the mistake."""
    what = getattr(fn, "__name__", "train step")
    for case in cases:
        do = upstream(case)
        result = fn(case.q, case.k, case.v, do, **case.kwargs)
        where = f"{what}, {case.describe()}"
        if not isinstance(result, (tuple, list)) or len(result) != 4:
            raise AssertionError(f"{where}: should return (o, dq, dk, dv), got {type(result).__name__}")
        problem = (_explain_output_with_empty_rows(result[0], case, _empty_rows(case), f"{where} (the forward)")
                   or explain_gradients(tuple(result[1:]), case, do, f"{what} (loss.backward())"))
        if problem:
            if all(g is None for g in result[1:]):
                problem += " No gradient reached q, k or v: does FlashAttention.backward return them?"
            raise AssertionError(problem)
