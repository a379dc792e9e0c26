"""ring_attention written other ways, as a learner's cells would define them (after the engine's helpers
merge_lse, shard_attention and shard_positions): honest rings that must keep full marks, and shortcuts
that hold every rank's K and V (all_gather) or look for other ranks' shards where the caller keeps them."""

_RING_START = '''
def _ring_setup(q, k, group, layout):
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    length = torch.tensor([q.shape[2]])
    dist.all_reduce(length, group=group)
    positions = [shard_positions(int(length), r, world_size, layout) for r in range(world_size)]
    peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    return rank, world_size, positions, peer((rank + 1) % world_size), peer((rank - 1) % world_size)


def _ring_step(q, k, v, positions, rank, owner, causal, o, lse):
    if not causal or positions[owner].min() <= positions[rank].max():
        o_step, lse_step = shard_attention(q, k, v, positions[rank], positions[owner], causal)
        o, lse = merge_lse(o, lse, o_step, lse_step)
    return o, lse


def _nothing_attended(q, v):
    """o and lse before any shard: zeros, and an lse of -inf, which merge_lse gives no weight."""
    B, Hq, T, _ = q.shape
    return torch.zeros(B, Hq, T, v.shape[-1]), torch.full((B, Hq, T), float("-inf"))
'''

ISEND_IRECV = _RING_START + '''

def ring_attention(q, k, v, group=None, causal=True, layout="zigzag"):
    """isend and irecv, one step at a time: compute on the held shard, then pass it on."""
    rank, world_size, positions, send_to, receive_from = _ring_setup(q, k, group, layout)
    o, lse = _nothing_attended(q, v)
    held_k, held_v = k.contiguous(), v.contiguous()
    for step in range(world_size):
        owner = (rank - step) % world_size
        o, lse = _ring_step(q, held_k, held_v, positions, rank, owner, causal, o, lse)
        if step == world_size - 1:
            break
        n = positions[(owner - 1) % world_size].numel()
        next_k = torch.empty(k.shape[0], k.shape[1], n, k.shape[3])
        next_v = torch.empty(v.shape[0], v.shape[1], n, v.shape[3])
        works = [dist.isend(held_k, send_to, group), dist.isend(held_v, send_to, group),
                 dist.irecv(next_k, receive_from, group), dist.irecv(next_v, receive_from, group)]
        for work in works:
            work.wait()
        held_k, held_v = next_k, next_v
    return o.to(q.dtype)
'''

SENDRECV_PARITY = _RING_START + '''

def ring_attention(q, k, v, group=None, causal=True, layout="zigzag"):
    """Blocking send and recv, even ranks sending first and odd ranks receiving first."""
    rank, world_size, positions, send_to, receive_from = _ring_setup(q, k, group, layout)
    o, lse = _nothing_attended(q, v)
    held = torch.cat([k, v], dim=-1).contiguous()          # K and V travel together
    dk = k.shape[-1]
    for step in range(world_size):
        owner = (rank - step) % world_size
        o, lse = _ring_step(q, held[..., :dk], held[..., dk:], positions, rank, owner, causal, o, lse)
        if step == world_size - 1:
            break
        incoming = held.new_empty(k.shape[0], k.shape[1], positions[(owner - 1) % world_size].numel(), held.shape[-1])
        if world_size % 2 == 0 and rank % 2 == 0 or world_size % 2 and rank % 2 == 0 and rank != world_size - 1:
            dist.send(held, send_to, group)
            dist.recv(incoming, receive_from, group)
        else:
            dist.recv(incoming, receive_from, group)
            dist.send(held, send_to, group)
        held = incoming
    return o.to(q.dtype)
'''

ALL_GATHER = '''

def ring_attention(q, k, v, group=None, causal=True, layout="zigzag"):
    """Not a ring: every rank gathers every rank's K and V, then attends to them one shard at a time."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    length = torch.tensor([q.shape[2]])
    dist.all_reduce(length, group=group)
    positions = [shard_positions(int(length), r, world_size, layout) for r in range(world_size)]
    sizes = [p.numel() for p in positions]
    ks = [k.new_empty(k.shape[0], k.shape[1], n, k.shape[3]) for n in sizes]
    vs = [v.new_empty(v.shape[0], v.shape[1], n, v.shape[3]) for n in sizes]
    for owner in range(world_size):            # all_gather of uneven shards: one broadcast per owner
        if owner == rank:
            ks[owner].copy_(k)
            vs[owner].copy_(v)
        dist.broadcast(ks[owner], owner, group)
        dist.broadcast(vs[owner], owner, group)
    B, Hq, T, D = q.shape
    o = torch.zeros(B, Hq, T, v.shape[-1])
    lse = torch.full((B, Hq, T), float("-inf"))
    for owner in range(world_size):
        if not causal or positions[owner].min() <= positions[rank].max():
            o_step, lse_step = shard_attention(q, ks[owner], vs[owner], positions[rank], positions[owner], causal)
            o, lse = merge_lse(o, lse, o_step, lse_step)
    return o.to(q.dtype)
'''

READS_EVERY_RANKS_ARGS = '''
import gc as _gc
import sys as _sys


def _every_shard():
    """Every rank's (q, k, v), wherever the caller keeps them: a list of tuples of three tensors."""
    frame = _sys._getframe(1)
    while frame is not None:
        for value in frame.f_locals.values():
            if isinstance(value, list) and len(value) > 1 and all(
                    isinstance(a, tuple) and len(a) == 3 and all(isinstance(x, torch.Tensor) for x in a) for a in value):
                return value
        frame = frame.f_back
    for value in _gc.get_objects():
        if isinstance(value, list) and len(value) > 1 and all(
                isinstance(a, tuple) and len(a) == 3 and all(isinstance(x, torch.Tensor) for x in a) for a in value):
            return value
    raise RuntimeError("no other rank's shards in this process")


def ring_attention(q, k, v, group=None, causal=True, layout="zigzag"):
    """Not a ring: every rank's shards read from the caller's arguments, then plain attention."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    shards = _every_shard()
    length = sum(a[0].shape[2] for a in shards)
    positions = [shard_positions(length, r, world_size, layout) for r in range(world_size)]
    o, lse = None, None
    for owner, (_, k_other, v_other) in enumerate(shards):
        o_step, lse_step = shard_attention(q, k_other, v_other, positions[rank], positions[owner], causal)
        o, lse = (o_step, lse_step) if o is None else merge_lse(o, lse, o_step, lse_step)
    return o.to(q.dtype)
'''

HONEST = {"batch_isend_irecv, overlapped": "", "isend/irecv": ISEND_IRECV, "sendrecv by parity": SENDRECV_PARITY}

# Not a ring: no rank sends K or V. Every rank makes itself readable (PR_SET_DUMPABLE, and PR_SET_PTRACER for Yama),
# writes where its K and V lie (addresses, not data) to a file, finds the other ranks in /proc (the processes with
# its parent) and reads their shards out of their memory, one at a time (/proc/PID/mem, else process_vm_readv), so
# that it holds no more than a ring would. The jail's processes are non-dumpable and cannot undo it, so the reads fail.
READS_OTHER_RANKS_MEMORY = '''
import ctypes as _ctypes
import json as _json
import os as _os
import time as _time

_libc = _ctypes.CDLL(None, use_errno=True)


class _IoVec(_ctypes.Structure):
    _fields_ = [("base", _ctypes.c_void_p), ("length", _ctypes.c_size_t)]


def _other_ranks():
    """pid -> (rank, k's address, v's address, shape) of every other process with this one's parent."""
    mine, parent, found = _os.getpid(), _os.getppid(), {}
    for name in _os.listdir("/proc"):
        if not name.isdigit() or int(name) == mine:
            continue
        try:
            with open(f"/proc/{name}/stat") as stat:
                if int(stat.read().rsplit(")", 1)[1].split()[1]) != parent:
                    continue
            with open(f"/tmp/where-{name}.json") as note:
                found[int(name)] = _json.load(note)
        except (OSError, ValueError, IndexError):
            pass
    return found


def _read(pid, address, nbytes):
    """nbytes of another process's memory at address."""
    try:
        fd = _os.open(f"/proc/{pid}/mem", _os.O_RDONLY)
        try:
            data = _os.pread(fd, nbytes, address)
        finally:
            _os.close(fd)
        if len(data) == nbytes:
            return data
    except OSError:
        pass
    buffer = _ctypes.create_string_buffer(nbytes)
    local, remote = _IoVec(_ctypes.addressof(buffer), nbytes), _IoVec(address, nbytes)
    if _libc.process_vm_readv(pid, _ctypes.byref(local), 1, _ctypes.byref(remote), 1, 0) != nbytes:
        raise OSError(_ctypes.get_errno(), f"the memory of process {pid}: {_os.strerror(_ctypes.get_errno())}")
    return buffer.raw


def ring_attention(q, k, v, group=None, causal=True, layout="zigzag"):
    """Not a ring: each rank reads the other ranks' K and V out of their memory."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    k, v = k.contiguous(), v.contiguous()
    _libc.prctl(4, 1, 0, 0, 0)                                    # PR_SET_DUMPABLE
    _libc.prctl(0x59616D61, _ctypes.c_ulong(-1), 0, 0, 0)          # PR_SET_PTRACER, any process
    with open(f"/tmp/where-{_os.getpid()}.json", "w") as note:
        _json.dump([rank, k.data_ptr(), v.data_ptr(), list(k.shape)], note)
    deadline = _time.monotonic() + 20
    others = _other_ranks()
    while len(others) < world_size - 1 and _time.monotonic() < deadline:
        _time.sleep(0.01)
        others = _other_ranks()
    where = {owner: (pid, k_at, v_at, shape) for pid, (owner, k_at, v_at, shape) in others.items()}
    length = q.shape[2] + sum(shape[2] for _, _, _, shape in where.values())
    positions = [shard_positions(length, r, world_size, layout) for r in range(world_size)]
    B, Hq, T, D = q.shape
    o = torch.zeros(B, Hq, T, v.shape[-1])
    lse = torch.full((B, Hq, T), float("-inf"))
    for owner in range(world_size):
        if causal and positions[owner].min() > positions[rank].max():
            continue
        if owner == rank:
            k_owner, v_owner = k, v
        else:
            pid, k_at, v_at, shape = where[owner]
            nbytes = k.element_size() * shape[0] * shape[1] * shape[2] * shape[3]
            k_owner, v_owner = (torch.frombuffer(bytearray(_read(pid, at, nbytes)), dtype=k.dtype).reshape(shape)
                                for at in (k_at, v_at))
        o_step, lse_step = shard_attention(q, k_owner, v_owner, positions[rank], positions[owner], causal)
        o, lse = merge_lse(o, lse, o_step, lse_step)
    dist.barrier(group)       # no rank lets its shards go before every rank has read them
    return o.to(q.dtype)
'''

# all_gather, after which each rank tells the kernel to forget its memory's peak (clear_refs), so that what the
# grader reads from outside is what it holds at the end. Its /proc files are root's: the write fails.
ALL_GATHER_FORGETS_ITS_PEAK = ALL_GATHER.replace('''    return o.to(q.dtype)
''', '''    del ks, vs
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")                    # the peak of resident memory becomes what is resident now
    except OSError:
        pass
    return o.to(q.dtype)
''')

# A bug, not a shortcut: each receive buffer is as long as the shard held, so when the shards differ in length (T not
# a multiple of 2P, or of P for contiguous) a longer shard arrives in a shorter buffer and gloo aborts the rank.
RECEIVES_INTO_THE_HELD_LENGTH = ISEND_IRECV.replace('''        n = positions[(owner - 1) % world_size].numel()
        next_k = torch.empty(k.shape[0], k.shape[1], n, k.shape[3])
        next_v = torch.empty(v.shape[0], v.shape[1], n, v.shape[3])''', '''        next_k = torch.empty_like(held_k)
        next_v = torch.empty_like(held_v)''')
assert RECEIVES_INTO_THE_HELD_LENGTH != ISEND_IRECV

# Bugs with group=, each exact on the default group (tests/test_ring_attention.py: named by the group checks).
PEERS_AS_GROUP_RANKS = ISEND_IRECV.replace(
    "    peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))",
    "    peer = lambda r: r                      # a group rank, where P2POp takes a global one")
PLACE_IN_THE_DEFAULT_GROUP = ISEND_IRECV.replace(
    "    rank, world_size = dist.get_rank(group), dist.get_world_size(group)",
    "    rank, world_size = dist.get_rank(), dist.get_world_size(group)")
GROUP_UNUSED = ISEND_IRECV.replace(
    "    rank, world_size, positions, send_to, receive_from = _ring_setup(q, k, group, layout)",
    "    group = None                            # the group given is not used\n"
    "    rank, world_size, positions, send_to, receive_from = _ring_setup(q, k, group, layout)")
LENGTH_ON_THE_DEFAULT_GROUP = ISEND_IRECV.replace(
    "    dist.all_reduce(length, group=group)", "    dist.all_reduce(length)")
for _bug in (PEERS_AS_GROUP_RANKS, PLACE_IN_THE_DEFAULT_GROUP, GROUP_UNUSED, LENGTH_ON_THE_DEFAULT_GROUP):
    assert _bug != ISEND_IRECV
