"""Points only for the work: full marks without writing the algorithm are out of reach, by measurement.

03's memory points are measured from outside the learner's process, so a score matrix built in
numpy, or kept in a buffer allocated ahead of time, costs them, and so does one head's matrix at a
time, or torch's fused attention given a [T, S] mask. torch's fused attention with is_causal=True holds
none, but the grader samples where the measured call spends its time, from outside, and refuses a call
that ran it (03 and 06); run in another process, it cannot start. 04's kernel points need the wrapper
to launch a @triton.jit kernel written in the notebook, so correct attention in plain PyTorch earns
none. Each submission is alt_correct's notebook with one function replaced.
"""

import copy
import json
import re

import pytest

from autograder.grading import batch as grade, submission
from autograder.jail import sandbox as jail
from flashcourse import DEVICE_ENV
from conftest import SAMPLES, assert_auto_points, expected_scores, feedback_page, grade_submissions

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(jail.why_no_jail() is not None, reason=f"no jail here: {jail.why_no_jail()}")]
EXPECTED = expected_scores()

def _online_attention(docstring: str, body: str) -> str:
    """An online_attention that checks its arguments as alt_correct's does, finds the positions of the queries
    (qp [B, T]) and of the keys (kp [B, S]), then runs `body`."""
    return f'''def online_attention(q, k, v, query_positions=None, key_positions=None, tile=16):
    """{docstring}"""
    if tile < 1:
        raise ValueError("tile must be >= 1")
    if q.shape[1] % k.shape[1]:
        raise ValueError("Hq % Hkv != 0")
    b, hq, t, d = q.shape
    s = k.shape[2]
    qp = positions(query_positions, b, t, s - t, q.device)
    kp = positions(key_positions, b, s, 0, q.device)
''' + body


NUMPY_SCORES = 'import numpy as np\n\n\n' + _online_attention(
    "Exact attention with the whole score matrix, computed in numpy where torch cannot see it.", '''\
    qp, kp = qp.numpy(), kp.numpy()
    group = hq // k.shape[1]
    kk = np.repeat(k.double().numpy(), group, axis=1)
    vv = np.repeat(v.double().numpy(), group, axis=1)
    scores = q.double().numpy() @ kk.transpose(0, 1, 3, 2) / np.sqrt(d)
    visible = (kp[:, None, None, :] <= qp[:, None, :, None])
    if not visible.any(-1).all():
        raise ValueError("some query sees no key")
    scores = np.where(visible, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    out = (weights / weights.sum(-1, keepdims=True)) @ vv
    return torch.from_numpy(out).to(q.dtype)
''')

# A buffer bigger than any score matrix the check could use, allocated before the tests run.
PREALLOCATED = '''import torch

_scratch = torch.empty(1 << 29)   # 2 GiB of float32, reused for every score matrix


''' + _online_attention("Exact attention, the score matrix written into the preallocated buffer.", '''\
    group = hq // k.shape[1]
    kk = k.float().repeat_interleave(group, dim=1)
    vv = v.float().repeat_interleave(group, dim=1)
    scores = _scratch[: b * hq * t * s].view(b, hq, t, s)
    torch.matmul(q.float(), kk.transpose(-2, -1), out=scores)
    scores.mul_(d ** -0.5)
    visible = (kp[:, None, None, :] <= qp[:, None, :, None])
    if not visible.any(-1).all():
        raise ValueError("some query sees no key")
    scores.masked_fill_(~visible, float("-inf"))
    scores.sub_(scores.amax(-1, keepdim=True)).exp_()
    scores.div_(scores.sum(-1, keepdim=True))
    return (scores @ vv).to(q.dtype)
''')

# The attack that once scored full marks: one (batch, head) at a time, each head's whole score matrix
# softmaxed in place, so no more than one head's [T, S] matrix is ever held.
PER_HEAD_SCORES = 'import math\n\n\n' + _online_attention(
    "Exact attention, one head at a time, each with its whole [T, S] score matrix.", '''\
    group = hq // k.shape[1]
    out = torch.empty(b, hq, t, v.shape[-1])
    for i in range(b):
        if (kp[i].min() > qp[i]).any():
            raise ValueError("some query sees no key")
        for h in range(hq):
            scores = q[i, h].float() @ k[i, h // group].float().T
            scores.mul_(1 / math.sqrt(d))
            for r in range(0, t, 1024):   # masked 1024 rows at a time: the scores are its only [T, S] tensor
                scores[r:r + 1024].masked_fill_(kp[i][None, :] > qp[i][r:r + 1024, None], float("-inf"))
            scores.sub_(scores.amax(-1, keepdim=True)).exp_()
            scores.div_(scores.sum(-1, keepdim=True))
            out[i, h] = scores @ v[i, h // group].float()
            del scores   # freed before the next head's: one head's matrix at a time
    return out.to(q.dtype)
''')

# torch's fused attention, the positions given to it as a boolean [B, 1, T, S] mask.
FUSED_WITH_MASK = _online_attention("Exact attention by torch's scaled_dot_product_attention with a [T, S] mask.", '''\
    visible = kp[:, None, None, :] <= qp[:, None, :, None]
    if not visible.any(-1).all():
        raise ValueError("some query sees no key")
    group = hq // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1), attn_mask=visible)
    return out.to(q.dtype)
''')

# 06's attack of the same kind: one (batch, query head) at a time, each head's whole P = exp(S - lse) in one float32
# [T, S] buffer turned into dS in place (dP made 512 rows at a time), so no more than one head's matrix is ever held.
PER_HEAD_BACKWARD = '''def attention_backward(q, k, v, o, lse, do, query_positions=None, key_positions=None, tile=16):
    """dq, dk, dv, one head at a time, each with its whole [T, S] matrix of P."""
    if tile < 1 or q.shape[1] % k.shape[1]:
        raise ValueError("need tile >= 1 and Hq a multiple of Hkv")
    b, hq, t, d = q.shape
    s = k.shape[2]
    group = hq // k.shape[1]
    scale = d ** -0.5
    qp = positions(query_positions, b, t, s - t, q.device)
    kp = positions(key_positions, b, s, 0, q.device)
    dq, dk, dv = torch.zeros(q.shape), torch.zeros(k.shape), torch.zeros(v.shape)
    for i in range(b):
        for h in range(hq):
            kv = h // group
            qh, kh, vh, doh = (x.float() for x in (q[i, h], k[i, kv], v[i, kv], do[i, h]))
            lse_h = lse[i, h, :, None].float()
            lse_h = torch.where(torch.isfinite(lse_h), lse_h, torch.zeros_like(lse_h))   # rows with no key: P = 0
            delta = (doh * o[i, h].float()).sum(-1, keepdim=True)
            p = qh @ kh.T                                   # the head's whole [T, S] matrix, its only one
            for r in range(0, t, 512):
                rows = p[r:r + 512]
                rows.mul_(scale).sub_(lse_h[r:r + 512]).exp_()
                rows.masked_fill_(kp[i][None, :] > qp[i][r:r + 512, None], 0.0)
            dv[i, kv] += (doh.T @ p).T
            for r in range(0, t, 512):                      # P becomes dS = P * (dP - delta), in place
                p[r:r + 512].mul_(doh[r:r + 512] @ vh.T - delta[r:r + 512])
            dq[i, h] = scale * (p @ kh)
            dk[i, kv] += scale * (qh.T @ p).T
            del p, rows   # freed before the next head's: one head's matrix at a time
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
'''

# torch's fused attention with is_causal=True, where it answers alone (default positions, T == S, Hq == Hkv): its
# CPU flash kernel holds no [T, S] matrix either, so it fits the probe; the grader sees where the call's time went.
FUSED_CAUSAL = '''_own_online_attention = online_attention   # the notebook's loop, for what torch's kernel cannot do


def online_attention(q, k, v, query_positions=None, key_positions=None, tile=16):
    """torch's fused attention where it answers alone, the notebook's loop elsewhere."""
    if query_positions is None and key_positions is None and q.shape == k.shape == v.shape and tile >= 1:
        return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                                is_causal=True).to(q.dtype)
    return _own_online_attention(q, k, v, query_positions, key_positions, tile)
'''

# The same kernel run by another Python process at the probe's lengths: the measured call may start none.
FUSED_IN_A_SUBPROCESS = '''import io
import subprocess
import sys

_own_online_attention = online_attention
_FUSED = ("import io, sys, torch; q, k, v = torch.load(io.BytesIO(sys.stdin.buffer.read())); "
          "o = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True); "
          "out = io.BytesIO(); torch.save(o, out); sys.stdout.buffer.write(out.getvalue())")


def online_attention(q, k, v, query_positions=None, key_positions=None, tile=16):
    """At long lengths, torch's fused attention in a process of its own; the notebook's loop elsewhere."""
    if query_positions is None and key_positions is None and q.shape == k.shape == v.shape and q.shape[2] >= 4096:
        sent = io.BytesIO()
        torch.save((q, k, v), sent)
        done = subprocess.run([sys.executable, "-c", _FUSED], input=sent.getvalue(), capture_output=True, check=True)
        return torch.load(io.BytesIO(done.stdout)).to(q.dtype)
    return _own_online_attention(q, k, v, query_positions, key_positions, tile)
'''

# Honest: the notebook's own loop, after a cell ran torch's fused attention forward and backward, whose return
# addresses that run left on the kernel's stack: they are not the measured call's.
FUSED_BEFORE = '''_x = torch.randn(1, 1, 4096, 8, requires_grad=True)
torch.nn.functional.scaled_dot_product_attention(_x, _x, _x, is_causal=True).sum().backward()
del _x
'''

# 06's: dq, dk, dv by autograd through torch's fused attention (its CPU flash forward and backward kernels), the
# queries padded in front so that is_causal's square mask places them at the end of the keys.
FUSED_BACKWARD = '''_own_attention_backward = attention_backward


def attention_backward(q, k, v, o, lse, do, query_positions=None, key_positions=None, tile=16):
    """Gradients by autograd through torch's fused attention where it answers alone, the notebook's loop elsewhere."""
    if query_positions is None and key_positions is None and q.shape[1] == k.shape[1] and tile >= 1 \\
            and q.shape[2] <= k.shape[2]:
        pad = k.shape[2] - q.shape[2]
        qq = torch.cat([q.new_zeros(*q.shape[:2], pad, q.shape[3]), q], 2).float().requires_grad_()
        kk, vv = k.float().requires_grad_(), v.float().requires_grad_()
        with torch.enable_grad():
            out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
            out.backward(torch.cat([do.new_zeros(*do.shape[:2], pad, do.shape[3]), do], 2).float())
        return qq.grad[:, :, pad:].to(q.dtype), kk.grad.to(k.dtype), vv.grad.to(v.dtype)
    return _own_attention_backward(q, k, v, o, lse, do, query_positions, key_positions, tile)
'''

PLAIN_PYTORCH = '''def flash_attention(q, k, v, query_offset=None, block_m=32, block_n=32, window=None, **launch):
    """Causal attention in plain PyTorch: correct, but no Triton kernel."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if len({q.device, k.device, v.device}) > 1:
        raise ValueError("q, k and v live on different devices")
    if H % Hkv != 0:
        raise ValueError("Hq must be a multiple of Hkv")
    if D < 16 or (D & (D - 1)) != 0:
        raise ValueError("D must be a power of two, at least 16")
    start = S - T if query_offset is None else query_offset
    kk = k.float().repeat_interleave(H // Hkv, dim=1)
    vv = v.float().repeat_interleave(H // Hkv, dim=1)
    scores = q.float() @ kk.transpose(-2, -1) * D ** -0.5
    qpos = torch.arange(T, device=q.device)[:, None] + start
    kpos = torch.arange(S, device=q.device)[None, :]
    visible = kpos <= qpos
    if window is not None:
        visible &= kpos > qpos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.nan_to_num(scores.softmax(-1)).matmul(torch.nan_to_num(vv)).to(q.dtype)
'''


def _replacing(assignment: str, grade_id: str, code: str) -> dict:
    """alt_correct's notebook with `code` appended to a solution cell: its function replaced, helpers kept."""
    nb = json.loads((SAMPLES / "submitted" / "alt_correct" / assignment / f"{assignment}.ipynb").read_text())
    nb = copy.deepcopy(nb)
    cell = next(c for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") == grade_id)
    cell["source"] = "".join(cell["source"]) + "\n\n" + code
    return nb


def _without(assignment: str, *questions: str) -> dict:
    full = dict(EXPECTED[assignment]["alt_correct"])
    return {**full, **dict.fromkeys(questions, 0)}


CASES = {  # student -> (assignment, notebook, expected points)
    "numpy_scores": ("03_online_attention", _replacing("03_online_attention", "online_attention", NUMPY_SCORES),
                     _without("03_online_attention", "test_online_attention_memory")),
    "preallocated_scores": ("03_online_attention",
                            _replacing("03_online_attention", "online_attention", PREALLOCATED),
                            _without("03_online_attention", "test_online_attention_memory")),
    "per_head_scores": ("03_online_attention", _replacing("03_online_attention", "online_attention", PER_HEAD_SCORES),
                        _without("03_online_attention", "test_online_attention_memory")),
    "fused_with_mask": ("03_online_attention", _replacing("03_online_attention", "online_attention", FUSED_WITH_MASK),
                        _without("03_online_attention", "test_online_attention_memory")),
    "per_head_backward": ("06_backward", _replacing("06_backward", "attention_backward", PER_HEAD_BACKWARD),
                          _without("06_backward", "test_attention_backward_memory")),
    "fused_causal": ("03_online_attention", _replacing("03_online_attention", "online_attention", FUSED_CAUSAL),
                     _without("03_online_attention", "test_online_attention_memory")),
    "fused_in_a_subprocess": ("03_online_attention",
                              _replacing("03_online_attention", "online_attention", FUSED_IN_A_SUBPROCESS),
                              _without("03_online_attention", "test_online_attention_memory")),
    "fused_before_own_loop": ("03_online_attention",
                              _replacing("03_online_attention", "online_attention", FUSED_BEFORE),
                              EXPECTED["03_online_attention"]["alt_correct"]),
    "fused_backward": ("06_backward", _replacing("06_backward", "attention_backward", FUSED_BACKWARD),
                       _without("06_backward", "test_attention_backward_memory")),
    "plain_pytorch": ("04_triton_flash", _replacing("04_triton_flash", "flash_attention", PLAIN_PYTORCH),
                      _without("04_triton_flash", "test_validation", "test_prefill", "test_offset", "test_query_offset",
                               "test_gqa", "test_block_skipping", "test_window", "test_window_skipping")),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    return grade_submissions(tmp_path_factory.mktemp("work"), {s: (a, nb) for s, (a, nb, _) in CASES.items()})


@pytest.mark.parametrize("student", CASES)
def test_no_points_without_the_work(graded, student):
    """Each shortcut loses exactly the points of what it did not do, and nothing else."""
    outcomes, _ = graded
    assert_auto_points(outcomes[student], CASES[student][2])


def test_the_feedback_says_why(graded):
    """The feedback names the cause: the memory limit with the matrix's size, or the missing kernel launch."""
    _, out = graded
    numpy_page = feedback_page(out, "numpy_scores")
    assert "memory limited to" in numpy_page and "score matrix" in numpy_page
    per_head_page = feedback_page(out, "per_head_scores")
    assert "memory limited to 256 MiB" in per_head_page and "needed more memory than a loop over key tiles" in \
        per_head_page and re.search(r"score matrix of this one head alone takes 10\d\d MiB", per_head_page)
    torch_page = feedback_page(out, "plain_pytorch")
    assert "launches no @triton.jit kernel" in torch_page


FUSED_STUDENTS = ("fused_causal", "fused_backward")   # those whose measured call ran torch's fused attention


@pytest.mark.parametrize("student", FUSED_STUDENTS)
def test_the_fused_kernel_is_named(graded, student):
    """A call that ran torch's fused attention is told so in its feedback, and the summary names it."""
    outcomes, out = graded
    page = feedback_page(out, student)
    assert "ran torch&#x27;s fused attention" in page or "ran torch's fused attention" in page, page[-3000:]
    assert "CPU flash kernel" in page and "your own loop over key tiles" in page
    summary = (out / "summary.txt").read_text()
    assert re.search(rf"- {student}, \S+: a measured call of \w+ ran torch's fused attention, so its memory point "
                     r"was refused: \d+ of the \d+ samples", summary), summary
    assert not any("fused attention" in a for s in ("fused_before_own_loop", "fused_in_a_subprocess")
                   for a in outcomes[s].anomalies)


import ring_variants  # noqa: E402  (tests/ is on the path, as conftest is)

RING = "07_ring_attention"
RING_CELLS = ("test_ring_attention", "test_ring_attention_odd")
RING_CASES = {  # student -> (notebook, expected points): 07's ring points need a ring, measured per rank
    "ring_all_gather": (_replacing(RING, "ring_attention", ring_variants.ALL_GATHER), _without(RING, *RING_CELLS)),
    "ring_reads_every_ranks_args": (_replacing(RING, "ring_attention", ring_variants.READS_EVERY_RANKS_ARGS),
                                    _without(RING, *RING_CELLS)),
    "ring_reads_other_ranks_memory": (_replacing(RING, "ring_attention", ring_variants.READS_OTHER_RANKS_MEMORY),
                                      _without(RING, *RING_CELLS)),
    "ring_all_gather_forgets_its_peak": (_replacing(RING, "ring_attention", ring_variants.ALL_GATHER_FORGETS_ITS_PEAK),
                                         _without(RING, *RING_CELLS)),
    "ring_peers_as_group_ranks": (_replacing(RING, "ring_attention", ring_variants.PEERS_AS_GROUP_RANKS),
                                  _without(RING, "test_ring_attention")),   # exact on the default group only
    "ring_isend_irecv": (_replacing(RING, "ring_attention", ring_variants.ISEND_IRECV), EXPECTED[RING]["alt_correct"]),
    "ring_sendrecv_parity": (_replacing(RING, "ring_attention", ring_variants.SENDRECV_PARITY),
                             EXPECTED[RING]["alt_correct"]),
}


@pytest.fixture(scope="module")
def graded_rings(tmp_path_factory):
    return grade_submissions(tmp_path_factory.mktemp("rings"), {s: (RING, nb) for s, (nb, _) in RING_CASES.items()})


@pytest.mark.parametrize("student", RING_CASES)
def test_ring_points_need_a_ring(graded_rings, student):
    """all_gather (even one that tells the kernel to forget its peak), or reading other ranks' shards (where the
    caller keeps them, or out of the other ranks' memory), loses the ring cells; rings written other ways keep them."""
    outcomes, _ = graded_rings
    assert_auto_points(outcomes[student], RING_CASES[student][1])


def test_the_ring_feedback_says_why(graded_rings):
    """all_gather's feedback says a rank held more than a ring needs; a ring given group ranks as peers is told so."""
    _, out = graded_rings
    page = feedback_page(out, "ring_all_gather")
    assert "more than a ring" in page and "needs" in page
    page = feedback_page(out, "ring_peers_as_group_ranks")
    assert "the peers are given in the wrong numbering" in page


def test_auto_grades_only_the_kernel_assignments_on_a_gpu(monkeypatch):
    """--device auto sends the PyTorch assignments to the CPU; an explicit --device applies to every one."""
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    assert submission.device_for("03_online_attention") == {DEVICE_ENV: "cpu"}
    assert submission.device_for("07_ring_attention") == {DEVICE_ENV: "cpu"}
    assert submission.device_for("05_fast_kernel") == {}
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    assert submission.device_for("03_online_attention") == {}
