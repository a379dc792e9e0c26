"""Where a measured call spent its time, seen from outside (autograder/jail/watch.py and sampler.py).

Each test starts a Python process that waits for a line, then runs attention one way (torch's fused kernel,
or a loop over key tiles), watched as the grader watches a measured call.
"""

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest

from autograder.jail import watch

WORK = textwrap.dedent('''
    import math, os, sys, torch
    torch.set_num_threads(1)
    T, D = int(sys.argv[2]), 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, T, D, generator=g) for _ in range(3))

    def fused():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fused_backward():
        x = q.clone().requires_grad_()
        torch.nn.functional.scaled_dot_product_attention(x, k, v, is_causal=True).sum().backward()

    def loop(tile=256):
        m, l, a = torch.full((T, 1), -math.inf), torch.zeros(T, 1), torch.zeros(T, D)
        rows = torch.arange(T)[:, None]
        for start in range(0, T, tile):
            s = (q[0, 0] @ k[0, 0, start:start + tile].T) * D ** -0.5
            s = s.masked_fill(torch.arange(start, min(start + tile, T))[None, :] > rows, -math.inf)
            new = torch.maximum(m, s.amax(-1, keepdim=True))
            p, alpha = torch.exp(s - new), torch.exp(m - new)
            l, a, m = l * alpha + p.sum(-1, keepdim=True), a * alpha + p @ v[0, 0, start:start + tile], new
        return a / l

    what = sys.argv[1]
    if what == "fused_earlier_then_loop":   # the kernel ran before: a child of this process then runs the loop
        fused_backward()
        if os.fork():
            os.wait()
            os._exit(0)
        what = "loop"
    if what == "traced":                    # traced already, by its parent (PTRACE_TRACEME)
        ctypes = __import__("ctypes")
        ctypes.CDLL(None).ptrace(0, 0, None, None)
    print(os.getpid(), flush=True)
    sys.stdin.readline()
    {"fused": fused, "fused_backward": fused_backward, "loop": loop, "traced": loop}[what]()
    print("done", flush=True)
    sys.stdin.readline()
''')


def _watched(what: str, t: int) -> watch.Report:
    """Run `what` in a process of its own, watched from its first line to its last: the report."""
    process = subprocess.Popen([sys.executable, "-c", WORK, what, str(t)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    try:
        watching = watch.Watch(int(process.stdout.readline()))
        try:
            process.stdin.write("\n")
            process.stdin.flush()
            assert process.stdout.readline().strip() == "done"
            return watching.finish()
        finally:
            watching.close()
    finally:
        process.stdin.close()   # a process forked from it reads the end of its input and ends too
        process.kill()
        process.wait()


@pytest.fixture(scope="module", autouse=True)
def ptrace_allowed():
    try:
        _watched("loop", 256)
    except watch.Unwatched as failed:
        pytest.skip(f"this machine lets no process be traced: {failed}")


@pytest.mark.parametrize("what", ["fused", "fused_backward"])
def test_torch_fused_attention_is_seen(what):
    """Forward or backward, the call is seen inside scaled_dot_product_attention's CPU flash kernel. T = 16384 both
    ways: the backward at 8192 ran in 0.14 s, 17 samples, too few to be sure that one lands in the kernel's own code."""
    report = _watched(what, 16384)
    assert report.ran_fused(), report
    assert report.fused >= report.samples // 3 and report.fused_here > 0, report


def test_a_loop_over_key_tiles_is_not():
    report = _watched("loop", 8192)
    assert report.samples > 20 and report.fused == 0, report


def test_what_an_earlier_call_left_on_the_stack_is_not_counted():
    """The kernel ran in the process this one was forked from: its return addresses, left on the stack, are
    cleared before the call (else an honest loop would be seen inside the kernel)."""
    report = _watched("fused_earlier_then_loop", 8192)
    assert report.cleared > 0 and report.fused == 0 and report.samples > 20, report


def test_a_process_traced_already_cannot_hide():
    """A process that made itself traced (by its parent) cannot be watched, and the grader knows it did."""
    with pytest.raises(watch.Unwatched) as refused:
        _watched("traced", 256)
    assert refused.value.learner


def test_a_copy_of_the_kernel_is_recognised_by_its_bytes():
    """Code running in memory the process made itself is the kernel's when its bytes are the kernel's."""
    library = watch._fused_library_elf()
    start, end = library.fused[len(library.fused) // 2]
    offset = library.offsets([(start, end)])[0][0]
    code = library.bytes_at(offset + 16, 32)
    maps = "7f0000000000-7f0000100000 r-xp 00000000 00:00 0 \n"
    copied = watch.classify([[0x7F0000000010, code.hex(), []]], [maps])
    assert copied.fused == 1 and copied.copied, copied
    other = watch.classify([[0x7F0000000010, bytes(range(32)).hex(), []]], [maps])
    assert other.fused == 0 and other.own == 1, other


def test_a_pointer_is_a_return_address_only_after_a_call():
    """A word on the stack counts only where the code before it is a call (x86-64 forms)."""
    class Code:
        machine = 62

        def __init__(self, before):
            self.before = before

        def bytes_at(self, offset, count):
            return self.before[-count:]

    assert watch._after_call(Code(b"\x90\x90\xe8\x01\x02\x03\x04"), 7)          # call rel32
    assert watch._after_call(Code(b"\x90\x90\x90\x90\x90\xff\xd0"), 7)          # call *%rax
    assert watch._after_call(Code(b"\x90\xff\x15\x01\x02\x03\x04"), 7)          # call *disp32(%rip)
    assert not watch._after_call(Code(b"\x90\x90\x90\x90\x90\x90\x90"), 7)
    assert ctypes.sizeof(ctypes.c_void_p) == 8
