"""07's checks: the (o, lse) merge, the zigzag layout and ring attention on a real process group.

Each check compares with float64 ground truth (flashcourse.checks.reference) and, when a result is wrong,
says where (which rank, which query position) and names a classic mistake only when the learner's
result equals what that mistake computes on the same inputs (`RING_MISTAKES`, `MERGE_MISTAKES`, `GROUP_MISTAKES`),
or when its ranks did what only that mistake does (a receive buffer gloo says was short, a ring that finishes on
every rank but waits on a sub-group), never by reading the learner's code. Ring attention runs on P processes
through flashcourse.distributed, so a ring that deadlocks fails after a timeout instead of hanging.
"""

from __future__ import annotations

import math
import re
from typing import Callable

import torch

from flashcourse.checks import core as ac
from flashcourse import distributed
from flashcourse.checks import reference

RING_TIMEOUT_S = 30.0      # per group of ranks; the shapes are small, so only a deadlock takes this long
                           # (one that leaves every rank idle is stopped after distributed.STALL_S)
# A ring's memory, measured from outside each rank when graded (autograder/jail/sandbox.py, Jail.call_on_ranks): MHA,
# H = 128, D = 256, 32 positions per rank, so that one shard of q, k or v is 4 MiB while a step's scores are 0.5 MiB.
# A ring holds its own q, k and v, the K and V in flight and, if it merges at the end (as alt_correct does), one
# partial output per step: at most about P + 7 shards. all_gather holds every rank's K and V: 2P shards and its
# own q at least. The allowance, P + 11 shards, lies between them from P = 11 on.
# Measured on 2 shared CPU cores (peak resident memory per rank beyond what it had before its shards came, every
# rank; repeated runs gave the same MiB): at P = 8, honest rings 28-42 MiB (batch_isend_irecv overlapped and
# double-buffered 42, isend/irecv 28-42, blocking send/recv by parity 34), alt_correct's ring that keeps every
# partial output 62, all_gather 90; at P = 12 (2 runs each, every rank; 8 to 15 s a group on a loaded machine):
# honest rings 34-46, alt_correct 82, all_gather 122-123, against an allowance of 92 MiB (23 shards): 10 MiB to spare
# for alt_correct, 46 for the others, all_gather 30 MiB over (P = 12 measured again once ranks were made
# non-dumpable: engine 46, isend/irecv 46, send/recv by parity 38, alt_correct 82).
MEMORY_HEADS, MEMORY_D, MEMORY_POSITIONS_PER_RANK = 128, 256, 32
MEMORY_SHARDS_BEYOND_P = 11
MERGE_TOL = 1e-4           # merges of float32 parts, on o and lse (lse reaches the hundreds: its float32 ulp is 3e-5)
LAYOUTS = ("zigzag", "contiguous")


# --- the layouts, written here independently of the exercise -------------------------------------

def chunk_sizes(length: int, pieces: int) -> list[int]:
    """torch.tensor_split's sizes: `pieces` chunks, the first length % pieces one longer."""
    return [length // pieces + (i < length % pieces) for i in range(pieces)]


def layout_positions(length: int, rank: int, world_size: int, layout: str) -> torch.Tensor:
    """The absolute positions [~length / P] rank holds: chunks r and 2P - 1 - r (zigzag) or chunk r of P.
    ("zigzag, chunks swapped", chunk 2P - 1 - r first, is a mistake's layout, for diagnoses.)"""
    if layout == "contiguous":
        sizes = chunk_sizes(length, world_size)
        return torch.arange(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    sizes = chunk_sizes(length, 2 * world_size)
    starts = [sum(sizes[:i]) for i in range(2 * world_size)]
    first, second = rank, 2 * world_size - 1 - rank
    if layout == "zigzag, chunks swapped":
        first, second = second, first
    return torch.cat([torch.arange(starts[first], starts[first] + sizes[first]),
                      torch.arange(starts[second], starts[second] + sizes[second])])


def shard(x: torch.Tensor, rank: int, world_size: int, layout: str, dim: int = 2) -> torch.Tensor:
    """rank's shard of x along dim, in the given layout."""
    return x.index_select(dim, layout_positions(x.shape[dim], rank, world_size, layout).to(x.device))


def unshard(shards: list, layout: str, dim: int = 2) -> torch.Tensor:
    """The whole tensor back from every rank's shard."""
    length = sum(s.shape[dim] for s in shards)
    order = torch.cat([layout_positions(length, r, len(shards), layout) for r in range(len(shards))])
    return torch.cat(shards, dim=dim).index_select(dim, torch.argsort(order).to(shards[0].device))


# --- float64 partial attention and the ring, with the classic mistakes injectable ----------------

def partial_attention(q, k, v, query_positions, key_positions, causal=True):
    """(o [B, Hq, T, Dv], lse [B, Hq, T]) in float64 of q attending to these keys only; o = 0, lse = -inf
    for a row that sees none of them."""
    group = q.shape[1] // k.shape[1]
    k64 = k.double().repeat_interleave(group, dim=1)                       # [B, Hq, S, D]
    v64 = v.double().repeat_interleave(group, dim=1)
    scores = q.double() @ k64.transpose(-2, -1) / math.sqrt(q.shape[-1])   # [B, Hq, T, S]
    if causal:
        scores = scores.masked_fill(key_positions[None, :] > query_positions[:, None], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)                                  # [B, Hq, T]
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(scores - safe[..., None]) @ v64, lse


def merge_reference(o1, lse1, o2, lse2):
    """The exact merge of two (o, lse) parts (float64 in, float64 out)."""
    lse = torch.logaddexp(lse1, lse2)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(lse1 - safe)[..., None] * o1 + torch.exp(lse2 - safe)[..., None] * o2, lse


def _added(o1, lse1, o2, lse2):
    return o1 + o2, torch.logaddexp(lse1, lse2)


MERGE_MISTAKES = {
    "outputs added without weights (o1 + o2): each part must be weighted by exp(lse_i - lse)": _added,
    "outputs averaged ((o1 + o2) / 2): each part must be weighted by exp(lse_i - lse), its share of the softmax sum":
        lambda o1, l1, o2, l2: ((o1 + o2) / 2, torch.logaddexp(l1, l2)),
    "weights taken in base 2 (2 ** (lse_i - lse)) while lse is a natural log: use exp":
        lambda o1, l1, o2, l2: _weighted(o1, l1, o2, l2, torch.logaddexp(l1, l2), base=2.0),
}


def _weighted(o1, lse1, o2, lse2, lse, base=math.e):
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w1, w2 = base ** (lse1 - safe), base ** (lse2 - safe)
    return w1[..., None] * o1 + w2[..., None] * o2, lse


RING_MISTAKES = {
    "causal mask by local index: the mask must compare absolute positions (the layout's), not indices within the shards":
        dict(local_positions=True),
    "positions of the contiguous layout used for zigzag shards: the layout decides which positions a shard holds":
        dict(positions_layout="contiguous"),
    "the positions of a zigzag whose two chunks are swapped: check zigzag_shard (its test above)":
        dict(positions_layout="zigzag, chunks swapped"),
    "the ring stops one step early: P ranks need P steps (the own shard and P - 1 received ones)":
        dict(steps=-1),
    "the held shard is labelled with the wrong owner: after s steps rank r holds the shard of rank (r - s) % P, "
    "received from rank (r - 1) % P":
        dict(owner_sign=+1),
    "the own K/V shard is used at every step: the received shard must replace the held one":
        dict(own_every_step=True),
    "only the own shard is masked: a received shard can hold keys after some of the queries (zigzag), so the "
    "causal mask applies to every shard":
        dict(mask_own_only=True),
    "shards of later ranks are skipped: with the zigzag layout every rank's shard holds keys every rank needs; skip "
    "a shard only when all its positions come after all the rank's queries":
        dict(skip_later_ranks=True),
    "the partial results are merged without rescaling: check merge_lse":
        dict(merge=_added),
}


# A step's partial result that is NaN where a row sees none of the shard's keys (a softmax over scores that are all
# -inf), merged rightly: the one NaN a ring's output can show that merge_lse's own check lets through (a merge without
# a safe reference meets two empty parts only where a ring's first step is not its own shard).
NAN_PARTIAL = ("a row that sees none of a shard's keys got NaN from that step's attention (a softmax over scores that "
               "are all -inf), and the merge kept it: such a step must give o = 0 and lse = -inf for the row, as "
               "shard_attention does, so that the merge weighs it exp(-inf) = 0")


def simulate_ring(q, k, v, world_size: int, causal: bool = True, layout: str = "zigzag", steps: int = 0,
                  local_positions=False, positions_layout=None, owner_sign=-1, own_every_step=False,
                  mask_own_only=False, skip_later_ranks=False, merge=merge_reference,
                  nan_unseen=False) -> torch.Tensor:
    """Ring attention's whole output [B, Hq, T, Dv] in float64, computed in one process, rank after rank;
    the keyword arguments inject RING_MISTAKES (nan_unseen: NAN_PARTIAL)."""
    length = q.shape[2]
    outputs = []
    for rank in range(world_size):
        positions = [layout_positions(length, r, world_size, positions_layout or layout) for r in range(world_size)]
        if local_positions:
            positions = [torch.arange(p.numel()) for p in positions]
        q_r = shard(q, rank, world_size, layout)
        o = torch.zeros(*q_r.shape[:3], v.shape[-1], dtype=torch.float64)
        lse = torch.full(q_r.shape[:3], -math.inf, dtype=torch.float64)
        for step in range(world_size + steps):
            owner = rank if own_every_step else (rank + owner_sign * step) % world_size
            data_owner = rank if own_every_step else (rank - step) % world_size
            if skip_later_ranks and owner > rank:
                continue
            if causal and positions[owner].min() > positions[rank].max():
                continue
            held = shard(k, data_owner, world_size, layout).shape[2]
            if positions[owner].numel() != held or positions[rank].numel() != q_r.shape[2]:
                raise ValueError("this mistake cannot happen with these shard lengths")
            masked = causal and (not mask_own_only or owner == rank)
            part = partial_attention(q_r, shard(k, data_owner, world_size, layout),
                                     shard(v, data_owner, world_size, layout), positions[rank], positions[owner], masked)
            if nan_unseen:
                part = (part[0].masked_fill(torch.isinf(part[1])[..., None], math.nan), part[1])
            o, lse = merge(o, lse, *part)
        outputs.append(o)
    return unshard(outputs, layout)


# --- checks ---------------------------------------------------------------------------------------

def _first_bad(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float):
    """Index of the first element of got that is NaN or not within tolerance of want, else None."""
    bad = ~torch.isclose(got.double(), want.double(), rtol=rtol, atol=atol, equal_nan=False)
    if not bool(bad.any()):
        return None
    return tuple(int(i) for i in bad.nonzero()[0])


def _named(got, candidates: dict, want, rtol, atol) -> str | None:
    """The mistake whose result got equals (and the correct result does not), or None."""
    for name, result in candidates.items():
        if result.shape == got.shape and _first_bad(result, want, rtol, atol) is not None \
                and _first_bad(got, result, rtol, atol) is None:
            return name
    return None


def merge_cases():
    """(name, o1, lse1, o2, lse2, o, lse): two parts of one sequence's keys and their exact merge, float32 inputs."""
    cases = []
    chunked = ac.make_case("chunked prefill: early rows see nothing of the second part", batch=2, q_heads=4,
                           kv_heads=2, t=6, s=14, seed=70)
    padded = ac.make_case("rows that see no key in either part", batch=1, q_heads=2, kv_heads=1, t=4, s=8, seed=71,
                          query_positions=torch.tensor([-5, -1, 3, 7]))
    large = ac.make_case("scores in the hundreds", batch=1, q_heads=2, kv_heads=2, t=5, s=10, seed=72,
                         score_scale=300.0)
    for case, split in ((chunked, 9), (padded, 4), (large, 3)):
        qp = case.query_positions if case.query_positions is not None else torch.arange(case.q.shape[2]) + \
            case.k.shape[2] - case.q.shape[2]
        kp = torch.arange(case.k.shape[2])
        first = partial_attention(case.q, case.k[:, :, :split], case.v[:, :, :split], qp, kp[:split])
        second = partial_attention(case.q, case.k[:, :, split:], case.v[:, :, split:], qp, kp[split:])
        parts = [x.float() for x in (*first, *second)]
        cases.append((case.name, *parts, *merge_reference(*(x.double() for x in parts))))
    return cases


def check_merge_lse(merge_lse: Callable) -> None:
    """merge_lse(o1, lse1, o2, lse2) is the exact merge, in either order, with rows empty in both parts."""
    for name, o1, lse1, o2, lse2, o_want, lse_want in merge_cases():
        for order, args in (("", (o1, lse1, o2, lse2)), (" (parts swapped)", (o2, lse2, o1, lse1))):
            got = merge_lse(*args)
            assert isinstance(got, tuple) and len(got) == 2, \
                f"merge_lse should return a pair (o, lse), got {type(got).__name__}"
            o, lse = got
            assert tuple(o.shape) == tuple(o_want.shape) and tuple(lse.shape) == tuple(lse_want.shape), \
                f"{name}: o should be {list(o_want.shape)} and lse {list(lse_want.shape)}, got {list(o.shape)} and {list(lse.shape)}"
            empty = torch.isinf(lse_want) & (lse_want < 0)                   # [B, Hq, T]: rows that saw no key
            if bool(torch.isnan(o[empty]).any()) or bool(torch.isnan(lse[empty]).any()):
                raise AssertionError(f"{name}{order}: NaN in a row that saw no key in either part (lse1 = lse2 = "
                                     "-inf): exp(-inf - (-inf)) is NaN; where the merged lse is -inf, measure the "
                                     "weights against 0 instead (such a row keeps o = 0, lse = -inf)")
            bad_lse = _first_bad(lse, lse_want, MERGE_TOL, MERGE_TOL)
            if bad_lse is not None:
                i = bad_lse
                hint = ""
                if torch.allclose(lse.double(), torch.maximum(args[1], args[3]).double(), atol=MERGE_TOL):
                    hint = ": it is max(lse1, lse2); the merged lse is log(exp(lse1) + exp(lse2)) (torch.logaddexp)"
                raise AssertionError(f"{name}{order}: lse wrong at [b, h, t] = {list(i)}: got {float(lse[i]):.6g}, "
                                     f"want {float(lse_want[i]):.6g}{hint}")
            bad = _first_bad(o, o_want, MERGE_TOL, MERGE_TOL)
            if bad is not None:
                mistakes = {text: fn(*(a.double() for a in args))[0] for text, fn in MERGE_MISTAKES.items()}
                named = _named(o.double(), mistakes, o_want, MERGE_TOL, MERGE_TOL)
                raise AssertionError(f"{name}{order}: o wrong at [b, h, t, d] = {list(bad)}: got {float(o[bad]):.6g}, "
                                     f"want {float(o_want[bad]):.6g}" + (f": {named}" if named else ""))


def check_zigzag(zigzag_shard: Callable, zigzag_unshard: Callable) -> None:
    """zigzag_shard gives rank r the chunks r and 2P - 1 - r of torch.tensor_split's 2P chunks, in that order,
    along any dim; zigzag_unshard puts every rank's shard back."""
    for world_size in (1, 2, 3, 4):
        for length in (4 * world_size, 4 * world_size + 3):
            x = torch.arange(length).reshape(1, 1, length, 1).expand(2, 3, length, 2).float()   # [B, H, T, D]
            shards = []
            for rank in range(world_size):
                got = zigzag_shard(x, rank, world_size)
                want = layout_positions(length, rank, world_size, "zigzag")
                where = f"T = {length}, P = {world_size}, rank {rank}"
                assert tuple(got.shape[:2]) == (2, 3) and got.shape[3] == 2, \
                    f"{where}: the shard should keep every dim but dim 2, got shape {list(got.shape)}"
                held = got[0, 0, :, 0].long()
                if held.shape != want.shape or not torch.equal(held, want):
                    raise AssertionError(f"{where}: the shard holds positions {held.tolist()}, want "
                                         f"{want.tolist()}{_zigzag_hint(held, length, rank, world_size)}")
                shards.append(got)
            back = zigzag_unshard([shard(x, r, world_size, "zigzag") for r in range(world_size)])
            if tuple(back.shape) != tuple(x.shape) or not torch.equal(back, x):
                raise AssertionError(f"T = {length}, P = {world_size}: zigzag_unshard of the ranks' zigzag shards "
                                     f"gives positions {back[0, 0, :, 0].long().tolist()}, want 0 .. {length - 1} in order")
    line = torch.arange(10)                                                     # dim is honoured: a 1-D sequence
    got = zigzag_shard(line, 1, 2, dim=0)
    want = layout_positions(10, 1, 2, "zigzag")
    assert torch.equal(got, want), f"zigzag_shard(torch.arange(10), 1, 2, dim=0) should be {want.tolist()}, got {got.tolist()}"
    assert torch.equal(zigzag_unshard([zigzag_shard(line, r, 2, dim=0) for r in range(2)], dim=0), line), \
        "zigzag_unshard(..., dim=0) does not put a 1-D sequence back"


def _zigzag_hint(held: torch.Tensor, length: int, rank: int, world_size: int) -> str:
    mirror = 2 * world_size - 1 - rank
    swapped = layout_positions(length, rank, world_size, "zigzag, chunks swapped")
    if held.shape == swapped.shape and torch.equal(held, swapped):
        return f": the two chunks are swapped; rank r holds chunk r first, then chunk 2P - 1 - r"
    contiguous = layout_positions(length, rank, world_size, "contiguous")
    if held.shape == contiguous.shape and torch.equal(held, contiguous):
        return ": that is the contiguous layout (chunk r of P), not the zigzag"
    equal_chunks = [min(i * math.ceil(length / (2 * world_size)), length) for i in range(2 * world_size + 1)]
    chunked = torch.cat([torch.arange(equal_chunks[rank], equal_chunks[rank + 1]),
                         torch.arange(equal_chunks[mirror], equal_chunks[mirror + 1])])
    if held.shape == chunked.shape and torch.equal(held, chunked):
        return (": these are torch.chunk's chunks (all but the last of size ceil(T / 2P)); the exercise uses "
                "torch.tensor_split's (the first T % 2P one longer), so every rank's shard differs by at most one")
    return ""


DEADLOCK_ADVICE = ("Every rank must start its send to (rank + 1) % P and its receive from (rank - 1) % P (isend and "
                   "irecv, or batch_isend_irecv) before waiting on either, the same number of times on every rank")


def run_ring(ring_attention: Callable, q, k, v, world_size: int, causal: bool = True, layout: str = "zigzag",
             timeout_s: float = RING_TIMEOUT_S, group_ranks=None, world: int | None = None, where: str | None = None,
             never_finished: str = DEADLOCK_ADVICE) -> list:
    """ring_attention on every rank of a fresh group of world_size processes; the ranks' outputs. With group_ranks,
    on the group new_group(group_ranks, sort_ranks=False) of a world of `world` ranks: group rank r is global rank
    group_ranks[r], holds the shards of rank r and is called with group= it; the outputs in group order. A ring
    that never finishes is said with never_finished."""
    rank_args = [tuple(shard(x, r, world_size, layout) for x in (q, k, v)) for r in range(world_size)]
    where = where or f"P = {world_size}, layout={layout!r}, causal={causal}"
    grouped = {} if group_ranks is None else {"group_ranks": list(group_ranks), "world_size": world}
    try:
        return distributed.call_on_ranks(ring_attention, rank_args, causal=causal, layout=layout,
                                         timeout_s=timeout_s, **grouped)
    except RuntimeError as error:  # in grading, the jail's RanksTimedOut arrives as a RuntimeError that names it
        too_long = _buffer_too_short(str(error), [a[1] for a in rank_args], layout)
        if too_long is not None and group_ranks is None:
            raise AssertionError(f"{where}: {too_long}") from None
        if not (isinstance(error, distributed.RanksTimedOut) or str(error).startswith("RanksTimedOut")):
            raise AssertionError(f"{where}: ring_attention failed {error}") from None
        detail = str(error).removeprefix("RanksTimedOut: ")
        raise AssertionError(f"{where}: ring_attention never finished: {detail}. {never_finished}") from None


def _buffer_too_short(error: str, ks: list, layout: str) -> str | None:
    """What a rank that gloo aborted for a message longer than its receive buffer did (the sizes gloo gave, read by
    flashcourse.distributed), in keys of the ring's shards ks (every rank's k): None unless gloo said so.

    The mistake is named only when the sizes are exactly it: the message is a shard that rank receives in the ring
    (the shard of rank (r - s - 1) % P at step s) and the buffer is as long as its own shard, or as the one it held."""
    sizes, dead = distributed.TOO_LONG.search(error), re.search(r"on rank (\d+) of (\d+)", error)
    if sizes is None:
        return None
    sent, room = int(sizes.group(1)), int(sizes.group(2))
    said = f"a message of {sent} bytes arrived for a receive buffer of {room} bytes"
    if dead is None or int(dead.group(2)) != len(ks) or int(dead.group(1)) not in range(len(ks)):
        return f"gloo aborted a rank: {said}; a receive must be as long as the message it gets"
    rank, world_size = int(dead.group(1)), len(ks)
    lengths = [k.shape[2] for k in ks]
    per_key = ks[0][:, :, :1].numel() * ks[0].element_size()          # B * Hkv * D elements of one key
    for step in range(world_size - 1):
        held, coming = (rank - step) % world_size, (rank - step - 1) % world_size
        for buffer, like in ((lengths[rank], "its own shard"), (lengths[held], f"the shard it held (rank {held}'s)")):
            if lengths[coming] > buffer and sent * buffer == room * lengths[coming] and sent % (lengths[coming] * per_key) == 0:
                multiple = "2P" if layout == "zigzag" else "P"
                return (f"rank {rank} received rank {coming}'s shard of {lengths[coming]} keys into a buffer of {buffer} "
                        f"keys, the length of {like}, and gloo aborted it ({said}): when T is not a multiple of "
                        f"{multiple} the shards differ in length, so size each receive like the shard being sent "
                        "(its owner's positions), not like the one held")
    return f"gloo aborted rank {rank}: {said}; a receive must be as long as the message it gets"


def check_ring_memory(ring_attention: Callable, world_size: int, layout: str = "zigzag", causal: bool = True,
                      seed: int = 0) -> None:
    """ring_attention on world_size ranks with shards of 4 MiB is exact and, when the ranks are measured (in
    grading), no rank holds more than P + MEMORY_SHARDS_BEYOND_P shards at once: a ring holds its own shards and
    those in flight, never every rank's K and V."""
    length = MEMORY_POSITIONS_PER_RANK * world_size
    case = ac.make_case("4 MiB shards", batch=1, q_heads=MEMORY_HEADS, kv_heads=MEMORY_HEADS, t=length, d=MEMORY_D,
                        seed=seed)
    rank_args = [tuple(shard(x, r, world_size, layout) for x in (case.q, case.k, case.v)) for r in range(world_size)]
    shard_bytes = rank_args[0][0].numel() * rank_args[0][0].element_size()
    where = (f"memory: P = {world_size}, layout={layout!r}, causal={causal}, MHA {MEMORY_HEADS} heads, "
             f"T = {length}, D = {MEMORY_D} ({shard_bytes >> 20} MiB shards)")
    try:
        outputs = distributed.call_on_ranks(ring_attention, rank_args, causal=causal, layout=layout,
                                            timeout_s=RING_TIMEOUT_S,
                                            allowance=(world_size + MEMORY_SHARDS_BEYOND_P) * shard_bytes)
    except AssertionError as error:
        raise AssertionError(f"{where}: {error}") from None
    except RuntimeError as error:
        raise AssertionError(f"{where}: {error}") from None
    got = unshard(list(outputs), layout).double()
    want = reference.attention(case.q, case.k, case.v, causal=causal)
    rtol, atol = ac.tolerance(case.q.dtype)
    bad = _first_bad(got, want, rtol, atol)
    if bad is not None:
        raise AssertionError(f"{where}: the output of the query at position {bad[2]} (head {bad[1]}) is "
                             f"{_fmt(got[bad])}, want {_fmt(want[bad])}")


def check_ring_attention(ring_attention: Callable, cases, world_sizes=(2,), layouts=LAYOUTS,
                         causal_options=(True, False)) -> None:
    """ring_attention on P processes, unsharded, equals the reference for each case, P, layout and causal."""
    for case in cases:
        q, k, v = case.q, case.k, case.v
        rtol, atol = ac.tolerance(q.dtype)
        for world_size in world_sizes:
            for layout in layouts:
                for causal in causal_options:
                    where = f"{case.name} {case.shape_text}, P = {world_size}, layout={layout!r}, causal={causal}"
                    outputs = run_ring(ring_attention, q, k, v, world_size, causal, layout)
                    _check_shapes(outputs, q, v, world_size, layout, where)
                    got = unshard(outputs, layout).double()
                    want = reference.attention(q, k, v, causal=causal)
                    bad = _first_bad(got, want, rtol, atol)
                    if bad is not None:
                        raise AssertionError(explain_ring(got, want, q, k, v, world_size, causal, layout, bad,
                                                          rtol, atol, where))


def explain_ring(got, want, q, k, v, world_size, causal, layout, bad, rtol, atol, where) -> str:
    """Where the unsharded output is wrong (rank, position, how many rows) and the mistake it equals, if any."""
    b, h, t, _ = bad
    owner = next(r for r in range(world_size) if t in layout_positions(q.shape[2], r, world_size, layout).tolist())
    rows = (~torch.isclose(got, want, rtol=rtol, atol=atol)).any(-1).any(1).any(0)       # [T]
    wrong_ranks = sorted({r for r in range(world_size)
                          if bool(rows[layout_positions(q.shape[2], r, world_size, layout)].any())})
    text = (f"{where}: the output of the query at position {t} (rank {owner}, head {h}, batch {b}) is "
            f"{_fmt(got[bad])}, want {_fmt(want[bad])}; {int(rows.sum())} of {q.shape[2]} positions are wrong, "
            f"on rank(s) {wrong_ranks}")
    if bool(torch.isnan(got).any()):
        nan_ring = simulate_ring(q, k, v, world_size, causal, layout, nan_unseen=True)
        rest = ~torch.isnan(nan_ring)
        if torch.equal(torch.isnan(got), ~rest) and _first_bad(got[rest], nan_ring[rest], rtol, atol) is None:
            return text + f"; NaN appears. It equals the result of this mistake: {NAN_PARTIAL}"
        return text + ("; NaN appears: see what each step gives a row that sees none of the shard's keys (o = 0, "
                       "lse = -inf) and what the merge makes of it")
    simulated = {}
    for name, mistake in RING_MISTAKES.items():
        try:
            simulated[name] = simulate_ring(q, k, v, world_size, causal, layout, **mistake)
        except ValueError:  # a mistake these shard lengths rule out
            pass
    named = _named(got, simulated, want, rtol, atol)
    return text + (f". It equals the result of this mistake: {named}" if named else "")


# --- a ring given group= ---------------------------------------------------------------------------

GROUP_WORLD = 4
GROUP_ORDER = (2, 3, 0, 1)   # new_group(GROUP_ORDER, sort_ranks=False): group rank r is global rank (r + 2) % 4
SUBGROUP = (1, 2)            # new_group([1, 2]) of a world of 4: ranks 0 and 3 take no part
GROUP_MISTAKES = {
    "the peers are given in the wrong numbering: P2POp's peer (isend's dst, irecv's src) is a global rank, "
    "dist.get_global_rank(group, (rank + 1) % P); group_peer= takes a group rank":
        dict(place="group", peers="as global"),
    "the ring's place is the rank in the default group (dist.get_rank()), not in group: use dist.get_rank(group)":
        dict(place="global", peers="global"),
    "group is not used: the ring runs on the default group's numbering (dist.get_rank(), peers (rank +- 1) % P), so "
    "each rank computes as another: pass group to get_rank, get_world_size, all_reduce and P2POp":
        dict(place="global", peers="as global"),
}


def simulate_group_ring(q, k, v, order, causal: bool = True, layout: str = "zigzag", place: str = "group",
                        peers: str = "global") -> torch.Tensor:
    """The whole output [B, Hq, T, Dv] in float64 of a ring on the group of every rank whose group rank r is global
    rank order[r] (and holds rank r's shards), as a ring computes it that takes for its place in the ring its rank
    in the group (place="group") or in the default group ("global"), and addresses its peers, its place +- 1, as
    global ranks of the group (peers="global", dist.get_global_rank) or as they are ("as global": a group rank
    given where torch takes a global one). ValueError where its sends and receives do not pair up (it would wait
    forever) or the shards' lengths rule the mistake out."""
    world_size, length = len(order), q.shape[2]
    group_rank = {rank: r for r, rank in enumerate(order)}
    positions = [layout_positions(length, r, world_size, layout) for r in range(world_size)]
    believed = [r if place == "group" else order[r] for r in range(world_size)]
    addressed = (lambda i: order[i % world_size]) if peers == "global" else (lambda i: i % world_size)
    receive_from = [group_rank[addressed(believed[r] - 1)] for r in range(world_size)]
    send_to = [group_rank[addressed(believed[r] + 1)] for r in range(world_size)]
    if any(send_to[receive_from[r]] != r for r in range(world_size)):
        raise ValueError("this mistake's sends and receives do not pair up")
    qs = [shard(q, r, world_size, layout) for r in range(world_size)]
    outputs = [torch.zeros(*x.shape[:3], v.shape[-1], dtype=torch.float64) for x in qs]
    lses = [torch.full(x.shape[:3], -math.inf, dtype=torch.float64) for x in qs]
    held = list(range(world_size))
    for step in range(world_size):
        for r in range(world_size):
            mine, label = positions[believed[r]], positions[(believed[r] - step) % world_size]
            if causal and label.min() > mine.max():
                continue
            k_held, v_held = shard(k, held[r], world_size, layout), shard(v, held[r], world_size, layout)
            if label.numel() != k_held.shape[2] or mine.numel() != qs[r].shape[2]:
                raise ValueError("this mistake cannot happen with these shard lengths")
            part = partial_attention(qs[r], k_held, v_held, mine, label, causal)
            outputs[r], lses[r] = merge_reference(outputs[r], lses[r], *part)
        held = [held[receive_from[r]] for r in range(world_size)]
    return unshard(outputs, layout)


def check_ring_on_groups(ring_attention: Callable, seed: int = 120) -> None:
    """ring_attention given group=, after it is exact on the default group (check_ring_attention, P = 4): on the
    group of every rank of 4 in another order, GROUP_ORDER (group rank r is global rank (r + 2) % 4, so no rank keeps
    its number), and on ranks SUBGROUP = 1 and 2 of 4, where ranks 0 and 3 take no part. Zigzag, causal, shards of
    equal length. A wrong output is named when it equals a GROUP_MISTAKES ring's; a ring that finishes on the first
    group but not on the second waits for ranks outside its group, which is said."""
    case = ac.make_case("GQA 4 : 2, T = 16", batch=1, q_heads=4, kv_heads=2, t=16, d=8, seed=seed)
    q, k, v = case.q, case.k, case.v
    rtol, atol = ac.tolerance(q.dtype)
    check_ring_attention(ring_attention, [case], world_sizes=(GROUP_WORLD,), layouts=("zigzag",),
                         causal_options=(True,))
    where = (f"{case.name}, zigzag, causal, on group = dist.new_group({list(GROUP_ORDER)}, sort_ranks=False) "
             f"(group rank r is global rank (r + 2) % {GROUP_WORLD})")
    outputs = run_ring(ring_attention, q, k, v, GROUP_WORLD, group_ranks=GROUP_ORDER, world=GROUP_WORLD, where=where)
    _check_shapes(outputs, q, v, GROUP_WORLD, "zigzag", where, "group rank")
    got, want = unshard(outputs, "zigzag").double(), reference.attention(q, k, v, causal=True)
    bad = _first_bad(got, want, rtol, atol)
    if bad is not None:
        t = bad[2]
        owner = next(r for r in range(GROUP_WORLD) if t in layout_positions(q.shape[2], r, GROUP_WORLD, "zigzag").tolist())
        simulated = {}
        for name, mistake in GROUP_MISTAKES.items():
            try:
                simulated[name] = simulate_group_ring(q, k, v, GROUP_ORDER, True, "zigzag", **mistake)
            except ValueError:
                pass
        named = _named(got, simulated, want, rtol, atol)
        raise AssertionError(f"{where}: the output of the query at position {t} (group rank {owner}, global rank "
                             f"{GROUP_ORDER[owner]}, head {bad[1]}) is {_fmt(got[bad])}, want {_fmt(want[bad])}, "
                             "though the ring is exact on the default group" + (f": {named}" if named else ""))
    sub = ac.make_case("MHA, T = 12", batch=1, q_heads=2, kv_heads=2, t=12, d=8, seed=seed + 1)
    left_out = sorted(set(range(GROUP_WORLD)) - set(SUBGROUP))
    where = (f"{sub.name}, zigzag, causal, on group = dist.new_group({list(SUBGROUP)}) of {GROUP_WORLD} ranks "
             f"(ranks {left_out} take no part)")
    outputs = run_ring(ring_attention, sub.q, sub.k, sub.v, len(SUBGROUP), group_ranks=SUBGROUP, world=GROUP_WORLD,
                       where=where, never_finished=(
                           f"It finishes on a group of every rank, so it waits for ranks outside its group ({left_out}"
                           "), which take part in nothing: a call on the default group (all_reduce or a barrier "
                           "without group=group, or a send to a rank outside the group); pass group=group to every "
                           "collective and P2POp, and address peers as dist.get_global_rank(group, r)"))
    _check_shapes(outputs, sub.q, sub.v, len(SUBGROUP), "zigzag", where, "group rank")
    got, want = unshard(outputs, "zigzag").double(), reference.attention(sub.q, sub.k, sub.v, causal=True)
    bad = _first_bad(got, want, *ac.tolerance(sub.q.dtype))
    if bad is not None:
        raise AssertionError(f"{where}: the output of the query at position {bad[2]} (head {bad[1]}) is "
                             f"{_fmt(got[bad])}, want {_fmt(want[bad])}, though the ring is exact on a group of every "
                             "rank: is something of the default group used (dist.get_world_size() without group)?")


def _check_shapes(outputs, q, v, world_size: int, layout: str, where: str, rank_word: str = "rank") -> None:
    """Every rank returned its queries' output, as a tensor of q's dtype."""
    assert isinstance(outputs, list) and len(outputs) == world_size and \
        all(isinstance(o, torch.Tensor) for o in outputs), f"{where}: every rank should return its output shard as a tensor"
    for rank, out in enumerate(outputs):
        want_shape = (*shard(q, rank, world_size, layout).shape[:3], v.shape[-1])
        assert tuple(out.shape) == want_shape, \
            f"{where}: {rank_word} {rank} returned shape {list(out.shape)}, want {list(want_shape)} (its queries' output)"
        assert out.dtype == q.dtype, f"{where}: {rank_word} {rank} returned {out.dtype}, want q's dtype {q.dtype}"


def _fmt(x) -> str:
    return f"{float(x):.6g}"
