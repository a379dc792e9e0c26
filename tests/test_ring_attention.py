"""07 on real process groups: the launcher (flashcourse.distributed), ring attention over gloo with 2 and 3
processes, the diagnosing checks (each classic mistake named, none named for a correct ring), and a ring
started from a grading jail. Small shapes, float32, seeded; outputs at ring_checks' tolerances (1e-4)."""

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autograder.jail import sandbox as jail
from flashcourse.checks import core as ac
from flashcourse import distributed
from flashcourse.checks import reference
from flashcourse.checks import ring_attention as rc
from flashcourse.engine import ring_attention as engine


def _pass_right(rank, world_size):
    mine, theirs = torch.tensor([float(rank)]), torch.empty(1)
    for transfer in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, (rank + 1) % world_size),
                                            dist.P2POp(dist.irecv, theirs, (rank - 1) % world_size)]):
        transfer.wait()
    return {"rank": dist.get_rank(), "received": int(theirs)}


@pytest.fixture
def no_process_left():
    """Asserts after the test that it left no process behind; processes already running (a grading test's
    warm server, say) are not the test's."""
    before = set(jail.descendants(os.getpid()))
    yield
    assert sorted(set(jail.descendants(os.getpid())) - before) == []


@pytest.mark.parametrize("world_size", [2, 3])
def test_run_joins_a_group_and_returns_in_rank_order(world_size, no_process_left):
    """Every rank is in one group of world_size, messages go around the ring, answers come back in rank order."""
    got = distributed.run(_pass_right, world_size)
    assert got == [{"rank": r, "received": (r - 1) % world_size} for r in range(world_size)]


def test_a_failing_rank_raises_its_own_exception_with_its_rank(no_process_left):
    """A ValueError on rank 1 is a ValueError here, naming rank 1; a non-builtin one becomes a RuntimeError."""
    def fails_on_one(rank, world_size):
        if rank == 1:
            raise ValueError("bad shard")
        dist.barrier()                                  # rank 0 would wait forever for rank 1
    started = time.monotonic()
    with pytest.raises(ValueError, match="on rank 1 of 2: bad shard"):
        distributed.run(fails_on_one, 2, timeout_s=20)
    assert time.monotonic() - started < 15, "the other rank should be stopped as soon as one fails"

    class Custom(Exception):
        pass

    def custom(rank, world_size):
        raise Custom("own kind")
    with pytest.raises(RuntimeError, match="Custom: own kind"):
        distributed.run(custom, 2)


def _both_receive(rank, world_size):
    dist.recv(torch.empty(1), (rank + 1) % world_size)


@pytest.mark.parametrize("timeout_s, message, least, most", [
    (2, r"rank\(s\) \[0, 1\] of 2 did not finish within 2 s", 2, 10),                  # the deadline comes first
    (60, r"\[0, 1\] of 2 all waited 5 s without using the CPU", distributed.STALL_S, 3 * distributed.STALL_S)])
def test_a_deadlock_ends_and_leaves_no_process(no_process_left, timeout_s, message, least, most):
    """Two ranks receiving from each other never finish: RanksTimedOut at timeout_s, or sooner once both have
    waited STALL_S without using the CPU; every process reaped."""
    started = time.monotonic()
    with pytest.raises(distributed.RanksTimedOut, match=message):
        distributed.run(_both_receive, 2, timeout_s=timeout_s)
    assert least <= time.monotonic() - started < most


def _learner_ring(code: str):
    """ring_attention as a learner's cell defines it (tests/ring_variants.py), after the engine's helpers."""
    namespace = {name: getattr(engine, name) for name in ("merge_lse", "shard_attention", "shard_positions")}
    namespace.update(torch=torch, dist=dist)
    exec(code, namespace)
    return namespace["ring_attention"]


SHORT_BUFFER = r"rank 1 received rank 0's shard of 7 keys into a buffer of 6 keys, the length of its own shard"


@pytest.mark.parametrize("layout", rc.LAYOUTS)
def test_a_receive_buffer_as_long_as_the_held_shard_is_named(no_process_left, layout):
    """T = 13 on 2 ranks: shards of 7 and 6 keys. A ring that receives into buffers as long as the shard it holds
    gets a 7-key shard in a 6-key buffer on rank 1, and gloo aborts that rank (SIGABRT): the check says so, from
    the sizes gloo gave, not the other rank's error that follows from it."""
    import ring_variants

    case = ac.make_case("MHA, T = 13", batch=1, q_heads=2, kv_heads=2, t=13, d=8, seed=1)
    with pytest.raises(AssertionError, match=SHORT_BUFFER):
        rc.run_ring(_learner_ring(ring_variants.RECEIVES_INTO_THE_HELD_LENGTH), case.q, case.k, case.v, 2,
                    layout=layout)


def test_a_rank_that_aborts_otherwise_is_not_said_to_have_a_short_buffer(no_process_left):
    """A rank that aborts for its own reasons is named as the one that died, and no buffer is blamed."""
    def aborts(q, k, v, group=None, causal=True, layout="zigzag"):
        if dist.get_rank() == 1:
            os.abort()
        dist.barrier()
        return q
    case = ac.make_case("MHA, T = 13", batch=1, q_heads=2, kv_heads=2, t=13, d=8, seed=1)
    with pytest.raises(AssertionError) as failure:
        rc.run_ring(aborts, case.q, case.k, case.v, 2)
    assert "on rank 1 of 2: died without an answer (killed by SIGABRT: the process aborted itself)" in \
        str(failure.value) and "buffer" not in str(failure.value), str(failure.value)


def test_a_rank_that_computes_while_the_other_waits_is_not_a_stall(no_process_left):
    """One rank busy for longer than STALL_S while its partner waits for it: the group finishes."""
    def one_computes(rank, world_size):
        tensor = torch.zeros(1)
        if rank == 0:
            until = time.monotonic() + 1.5 * distributed.STALL_S
            while time.monotonic() < until:
                tensor += 1
            dist.send(tensor, 1)
        else:
            dist.recv(tensor, 0)
        return tensor.item() > 0
    assert distributed.run(one_computes, 2, timeout_s=60) == [True, True]


def test_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        distributed.run(_pass_right, 2, backend="mpi")
    with pytest.raises(ValueError, match="world_size"):
        distributed.run(_pass_right, 0)


@pytest.mark.parametrize("world_size", [2, 3])
def test_engine_ring_attention_is_exact(world_size):
    """The exported ring_attention on gloo equals the reference: both layouts, causal or not, GQA, uneven T."""
    cases = [ac.make_case("GQA 4 : 2, T = 13", batch=2, q_heads=4, kv_heads=2, t=13, d=8, seed=1),
             ac.make_case(f"MHA, T = {4 * world_size}", batch=1, q_heads=2, kv_heads=2, t=4 * world_size, d=16, seed=2)]
    rc.check_ring_attention(engine.ring_attention, cases, world_sizes=(world_size,))


def test_engine_ring_attention_on_a_subgroup():
    """group= is honoured: ranks 1 and 2 of a group of 3 run a ring of 2 with global peers."""
    case = ac.make_case("subgroup", batch=1, q_heads=2, kv_heads=1, t=10, d=8, seed=3)
    shards = [rc.shard(x, r, 2, "zigzag") for x in (case.q, case.k, case.v) for r in range(2)]

    def on_ranks_one_and_two(rank, world_size):
        pair = dist.new_group([1, 2])
        if rank == 0:
            return None
        q, k, v = shards[rank - 1], shards[2 + rank - 1], shards[4 + rank - 1]
        return engine.ring_attention(q, k, v, group=pair)
    outputs = distributed.run(on_ranks_one_and_two, 3)
    got = rc.unshard(outputs[1:], "zigzag")
    torch.testing.assert_close(got.double(), reference.attention(case.q, case.k, case.v), rtol=1e-4, atol=1e-4)


def test_call_on_ranks_calls_a_group_in_its_order():
    """group_ranks: every rank of the world makes the group in that order, its members are called with group= it,
    in group order, and the others take no part."""
    def who(x, group=None):
        return [x, dist.get_rank(), dist.get_rank(group), dist.get_world_size(group)]
    assert distributed.call_on_ranks(who, [("a",), ("b",)], group_ranks=[3, 1], world_size=4) == \
        [["a", 3, 0, 2], ["b", 1, 1, 2]]
    with pytest.raises(ValueError, match="distinct ranks of a world of 4"):
        distributed.call_on_ranks(who, [("a",), ("b",)], group_ranks=[1, 1], world_size=4)


def test_engine_ring_attention_on_other_groups():
    """The exported ring passes the group checks: every rank of 4 in another order, and ranks 1 and 2 of 4."""
    rc.check_ring_on_groups(engine.ring_attention)


@pytest.mark.parametrize("world_size", [3, 4])
def test_every_group_mistake_changes_the_output_and_pairs_up(world_size):
    """simulate_group_ring without a mistake is the reference on a group in another order; each GROUP_MISTAKES ring
    is a ring whose sends and receives pair up on GROUP_ORDER, and changes the output there."""
    case = ac.make_case("sim", batch=1, q_heads=4, kv_heads=2, t=4 * world_size, d=8, seed=5)
    order = tuple((r + 2) % world_size for r in range(world_size))
    want = reference.attention(case.q, case.k, case.v)
    torch.testing.assert_close(rc.simulate_group_ring(case.q, case.k, case.v, order), want, rtol=1e-10, atol=1e-10)
    if world_size == rc.GROUP_WORLD:
        for name, mistake in rc.GROUP_MISTAKES.items():
            got = rc.simulate_group_ring(case.q, case.k, case.v, rc.GROUP_ORDER, **mistake)
            assert not torch.allclose(got, want, atol=1e-4), name


GROUP_BUGS = {"PEERS_AS_GROUP_RANKS": "the peers are given in the wrong numbering",
              "PLACE_IN_THE_DEFAULT_GROUP": "the ring's place is the rank in the default group",
              "GROUP_UNUSED": "group is not used",
              "LENGTH_ON_THE_DEFAULT_GROUP": "it waits for ranks outside its group ([0, 3])"}


@pytest.mark.parametrize("bug", list(GROUP_BUGS))
def test_group_mistakes_are_named(bug):
    """Rings exact on the default group that mistake group= (tests/ring_variants.py) fail the group checks, each
    named: the three that compute another ring's answer by the answer, the default group's all_reduce by the wait
    on a sub-group (stopped after distributed.STALL_S)."""
    import ring_variants

    with pytest.raises(AssertionError) as failure:
        rc.check_ring_on_groups(_learner_ring(getattr(ring_variants, bug)))
    assert GROUP_BUGS[bug] in str(failure.value), str(failure.value)
    assert sum(name.split(":")[0] in str(failure.value) for name in rc.GROUP_MISTAKES) <= 1


def test_position_runs():
    """A zigzag shard is two runs of consecutive positions (one when its chunks meet), a contiguous shard one."""
    assert engine.position_runs(rc.layout_positions(13, 0, 2, "zigzag")) == [(0, 0, 4), (4, 10, 3)]
    assert engine.position_runs(rc.layout_positions(13, 1, 2, "zigzag")) == [(0, 4, 6)]
    assert engine.position_runs(rc.layout_positions(12, 0, 1, "zigzag")) == [(0, 0, 12)]
    assert engine.position_runs(rc.layout_positions(10, 2, 3, "contiguous")) == [(0, 7, 3)]


def test_kernel_step_equals_the_pytorch_step():
    """shard_attention_kernel (06's Triton kernel on each pair of runs, here under the interpreter) gives the
    (o, lse) of shard_attention's PyTorch path for every pair of shards of P = 3 (T = 37: uneven chunks), both
    layouts, causal: runs before, overlapping and after the queries; and one pair without the mask."""
    case = ac.make_case("GQA 4 : 2, T = 37", batch=1, q_heads=4, kv_heads=2, t=37, d=16, seed=6)
    pairs = [(layout, rank, owner, True) for layout in rc.LAYOUTS for rank in range(3) for owner in range(3)]
    for layout, rank, owner, causal in pairs + [("zigzag", 0, 2, False)]:
        qp, kp = (rc.layout_positions(37, r, 3, layout) for r in (rank, owner))
        q = rc.shard(case.q, rank, 3, layout)
        k, v = (rc.shard(x, owner, 3, layout) for x in (case.k, case.v))
        want = engine.shard_attention(q, k, v, qp, kp, causal)
        got = engine.shard_attention_kernel(q, k, v, qp, kp, causal)
        where = f"{layout}, queries of rank {rank}, keys of rank {owner}, causal={causal}"
        for name, g, w in zip(("o", "lse"), got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=lambda m: f"{where}: {name}: {m}")


def test_layouts_and_zigzag_helpers():
    """The checks' own layouts: zigzag rank r holds chunks r and 2P - 1 - r; unshard inverts shard; the engine agrees."""
    assert rc.layout_positions(12, 0, 3, "zigzag").tolist() == [0, 1, 10, 11]
    assert rc.layout_positions(13, 1, 2, "zigzag").tolist() == [4, 5, 6, 7, 8, 9]   # chunks 4, 3, 3, 3
    assert rc.layout_positions(10, 2, 3, "contiguous").tolist() == [7, 8, 9]
    x = torch.randn(2, 3, 17, 4, generator=torch.Generator().manual_seed(5))
    for layout in rc.LAYOUTS:
        assert torch.equal(rc.unshard([rc.shard(x, r, 3, layout) for r in range(3)], layout), x)
    rc.check_zigzag(engine.zigzag_shard, engine.zigzag_unshard)
    rc.check_merge_lse(engine.merge_lse)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_simulated_ring_is_exact_and_every_mistake_changes_it(world_size):
    """simulate_ring without a mistake is the reference; each mistake it can inject changes the output of a
    causal ring in some layout (the wrong owner only from P = 3 on), so a diagnosis naming it can speak."""
    case = ac.make_case("sim", batch=1, q_heads=4, kv_heads=2, t=8 * world_size, d=8, seed=4)
    for layout in rc.LAYOUTS:
        for causal in (True, False):
            want = reference.attention(case.q, case.k, case.v, causal=causal)
            got = rc.simulate_ring(case.q, case.k, case.v, world_size, causal, layout)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for name, mistake in rc.RING_MISTAKES.items():
        if world_size == 1 or (world_size == 2 and mistake == {"owner_sign": +1}):  # on 2 ranks, r + s = r - s mod 2
            continue
        changed = False
        for layout in rc.LAYOUTS:
            want = reference.attention(case.q, case.k, case.v)
            got = rc.simulate_ring(case.q, case.k, case.v, world_size, True, layout, **mistake)
            changed |= not torch.allclose(got, want, atol=1e-4)
        assert changed, f"P = {world_size}: {name!r} never changes the output"


def _planted(**change):
    """The engine's ring_attention with one classic mistake planted (by wrapping its helpers)."""
    def ring(q, k, v, group=None, causal=True, layout="zigzag"):
        saved = {name: getattr(engine, name) for name in change}
        for name, replacement in change.items():
            setattr(engine, name, replacement(saved[name]))
        try:
            return engine.ring_attention(q, k, v, group=group, causal=causal, layout=layout)
        finally:
            for name, original in saved.items():
                setattr(engine, name, original)
    return ring


PLANTED = {
    "causal mask by local index": dict(shard_positions=lambda f: lambda *a: torch.arange(f(*a).numel())),
    "positions of the contiguous layout": dict(shard_positions=lambda f: lambda t, r, p, layout: f(t, r, p, "contiguous")),
    "merged without rescaling": dict(merge_lse=lambda f: lambda o1, l1, o2, l2: (o1 + o2, torch.logaddexp(l1, l2))),
    "only the own shard is masked": dict(shard_attention=lambda f: lambda q, k, v, qp, kp, causal: f(
        q, k, v, qp, kp, causal and bool(torch.equal(kp, qp)))),
}


@pytest.mark.parametrize("expected", list(PLANTED))
def test_planted_ring_mistakes_are_named(expected):
    """A ring with a planted mistake fails on 2 processes, and the message names that mistake."""
    case = ac.make_case("GQA 4 : 2, T = 12", batch=1, q_heads=4, kv_heads=2, t=12, d=8, seed=6)
    with pytest.raises(AssertionError) as failure:
        rc.check_ring_attention(_planted(**PLANTED[expected]), [case], world_sizes=(2,), causal_options=(True,))
    assert expected in str(failure.value), str(failure.value)


def test_a_correct_ring_names_no_mistake_on_a_close_miss():
    """A result off by more than the tolerance but equal to no mistake is described without a named mistake."""
    case = ac.make_case("GQA 4 : 2, T = 12", batch=1, q_heads=4, kv_heads=2, t=12, d=8, seed=6)
    want = reference.attention(case.q, case.k, case.v)
    text = rc.explain_ring(want + 1e-2, want, case.q, case.k, case.v, 2, True, "zigzag", (0, 0, 0, 0), 1e-4, 1e-4, "here")
    assert "12 of 12 positions are wrong" in text and "mistake" not in text


def test_merge_mistakes_are_named():
    """check_merge_lse names unweighted sums, NaN for rows empty in both parts, and lse = max."""
    def nan_for_empty(o1, l1, o2, l2):
        lse = torch.logaddexp(l1, l2)
        return torch.exp(l1 - lse)[..., None] * o1 + torch.exp(l2 - lse)[..., None] * o2, lse

    def lse_is_max(o1, l1, o2, l2):
        return engine.merge_lse(o1, l1, o2, l2)[0], torch.maximum(l1, l2)

    for merge, expected in ((lambda o1, l1, o2, l2: (o1 + o2, torch.logaddexp(l1, l2)), "added without weights"),
                            (nan_for_empty, "NaN in a row that saw no key"), (lse_is_max, r"it is max\(lse1, lse2\)")):
        with pytest.raises(AssertionError, match=expected):
            rc.check_merge_lse(merge)


def test_zigzag_mistakes_are_named():
    """Swapped chunks, the contiguous layout and torch.chunk's sizes are each named."""
    def swapped(x, rank, world_size, dim=2):
        chunks = torch.tensor_split(x, 2 * world_size, dim=dim)
        return torch.cat([chunks[2 * world_size - 1 - rank], chunks[rank]], dim=dim)

    def contiguous(x, rank, world_size, dim=2):
        return torch.tensor_split(x, world_size, dim=dim)[rank]

    for shard, expected in ((swapped, "the two chunks are swapped"), (contiguous, "that is the contiguous layout")):
        with pytest.raises(AssertionError, match=expected):
            rc.check_zigzag(shard, engine.zigzag_unshard)
    hint = rc._zigzag_hint(torch.tensor([0, 1, 2, 12, 13]), 14, 0, 2)   # torch.chunk: sizes 4, 4, 4, 2
    assert hint == "", "a shard that is neither mistake is not given a name"
    assert "torch.chunk" in rc._zigzag_hint(torch.tensor([0, 1, 2, 3, 12, 13]), 14, 0, 2)


@pytest.mark.skipif(jail.why_no_jail() is not None, reason=f"no jail here: {jail.why_no_jail()}")
def test_a_ring_runs_inside_the_grading_jail():
    """The grader's stand-in for a learner's function starts the ranks in the jail (gloo on its loopback only),
    a deadlocked ring there comes back as a timeout, not a hang, and a rank gloo aborts for a short receive
    buffer is named as locally."""
    import ring_variants
    from autograder.grading import execute

    session = execute.Session(jailed=True, cell_timeout=120, max_restarts=0)
    try:
        learner_cells = Path(engine.__file__).read_text().split('"""', 2)[2]   # the engine, less its docstring
        learner_cells += "\n\ndef stuck(x):\n    dist.recv(torch.empty(1), (dist.get_rank() + 1) % 2)\n"
        learner_cells += ring_variants.RECEIVES_INTO_THE_HELD_LENGTH.replace("def ring_attention(", "def short_buffer(")
        outputs = session.run_cell(learner_cells, "the engine's functions and a deadlock, as a learner's cells")
        assert not [o for o in outputs if o.output_type == "error"], outputs
        session.deadline = time.monotonic() + 120
        case = ac.make_case("jail", batch=1, q_heads=4, kv_heads=2, t=9, d=8, seed=9)
        rc.check_ring_attention(execute.Remote("ring_attention", session), [case], world_sizes=(3,),
                                causal_options=(True,))
        with pytest.raises(RuntimeError, match="RanksTimedOut"):
            execute.Remote("stuck", session).call_on_ranks([(torch.ones(1),), (torch.ones(1),)], timeout_s=2)
        uneven = ac.make_case("MHA, T = 13", batch=1, q_heads=2, kv_heads=2, t=13, d=8, seed=1)
        with pytest.raises(AssertionError, match=SHORT_BUFFER):   # what gloo said, read from the jail's log
            rc.run_ring(execute.Remote("short_buffer", session), uneven.q, uneven.k, uneven.v, 2)
        rc.check_ring_on_groups(execute.Remote("ring_attention", session))       # group= reaches the jail's ranks
        assert session.anomalies == []
    finally:
        session.close()


def _nan_where_unseen(shard_attention):
    """A step's attention written without shard_attention's care: NaN for a row that sees none of the shard's keys."""
    def step(q, k, v, qp, kp, causal=True):
        o, lse = shard_attention(q, k, v, qp, kp, causal)
        return o.masked_fill(torch.isinf(lse)[..., None], float("nan")), lse
    return step


def test_nan_in_a_ring_is_named_only_as_what_it_equals():
    """A ring whose step gives NaN for a row that sees none of the shard's keys is named so (before, the message
    asked whether a merge of two empty parts was to blame, which a ring whose first step is its own shard never
    meets); other NaN is described without a cause."""
    case = ac.make_case("GQA 4 : 2, T = 12", batch=1, q_heads=4, kv_heads=2, t=12, d=8, seed=6)
    with pytest.raises(AssertionError) as failure:
        rc.check_ring_attention(_planted(shard_attention=_nan_where_unseen), [case], world_sizes=(2,),
                                layouts=("zigzag",), causal_options=(True,))
    assert rc.NAN_PARTIAL in str(failure.value) and "merge_lse" not in str(failure.value), str(failure.value)
    want = reference.attention(case.q, case.k, case.v)
    got = rc.simulate_ring(case.q, case.k, case.v, 2, True, "zigzag", nan_unseen=True)
    got[0, 0, 5, 0] = float("nan")                                    # and one more, in a row that sees keys 0..5
    text = rc.explain_ring(got, want, case.q, case.k, case.v, 2, True, "zigzag", (0, 0, 0, 0), 1e-4, 1e-4, "here")
    assert "NaN appears" in text and rc.NAN_PARTIAL not in text and "mistake" not in text and "merge_lse" not in text


LOG2E = 1.4426950408889634


def _base2_merge_lse(convert_back=True, weights_base2=True, lse_of_natural=False):
    """merge_lse in base 2: lse2_i = lse_i log2(e), lse2 = log2(2^lse2_1 + 2^lse2_2), weights 2^(lse2_i - lse2);
    lse2 converted back (lse2 ln 2) or not. weights_base2=False: weights exp(lse2_i - lse2) (bases mixed);
    lse_of_natural: the natural lse_i taken as base-2 ones (no log2(e))."""
    def merge(o1, l1, o2, l2):
        a1, a2 = (l1, l2) if lse_of_natural else (l1 * LOG2E, l2 * LOG2E)
        lse2 = torch.logaddexp2(a1, a2)
        safe = torch.where(torch.isfinite(lse2), lse2, torch.zeros_like(lse2))
        power = torch.exp2 if weights_base2 else torch.exp
        o = power(a1 - safe)[..., None] * o1 + power(a2 - safe)[..., None] * o2
        return o, (lse2 / LOG2E if convert_back and not lse_of_natural else lse2)
    return merge


def test_merges_in_base_2_pass_and_mixed_bases_are_named_only_as_what_they_equal():
    """A merge_lse that works in base 2 and converts back is exact; one that mixes bases fails and is named only
    where it equals a named mistake (weights 2 ** (lse_i - lse) with a natural lse), never as an unweighted sum; a
    ring that merges so is not said to merge without rescaling."""
    rc.check_merge_lse(_base2_merge_lse())
    mixed = {"lse left in base 2": _base2_merge_lse(convert_back=False),
             "exp of base-2 differences": _base2_merge_lse(weights_base2=False),
             "natural lse taken as base 2": _base2_merge_lse(lse_of_natural=True)}
    for name, merge in mixed.items():
        with pytest.raises(AssertionError) as failure:
            rc.check_merge_lse(merge)
        assert not any(words in str(failure.value) for words in rc.MERGE_MISTAKES), (name, str(failure.value))
    case = ac.make_case("ring", batch=1, q_heads=2, kv_heads=1, t=12, d=8, seed=3)
    want = reference.attention(case.q, case.k, case.v)
    for name, merge in mixed.items():
        for layout in rc.LAYOUTS:
            got = rc.simulate_ring(case.q, case.k, case.v, 3, True, layout,
                                   merge=lambda *parts: tuple(x.double() for x in merge(*parts)))
            bad = rc._first_bad(got, want, 1e-4, 1e-4)
            assert bad is not None, (name, layout)
            text = rc.explain_ring(got, want, case.q, case.k, case.v, 3, True, layout, bad, 1e-4, 1e-4, "here")
            assert "It equals" not in text, (name, layout, text)
