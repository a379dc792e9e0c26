"""Whether a measured call ran torch's own fused attention, seen from outside the process that made it.

03's and 06's memory points prove that the learner's loop held no [T, S] matrix of one head. torch's
`scaled_dot_product_attention` with `is_causal=True` takes, on the CPU, a fused flash kernel that holds none
either, so memory alone cannot tell a call of it from the learner's loop. While a measured call runs (its
process can start no process or thread, and the rest of the jail is stopped), the grader samples where its
threads are (autograder/jail/sampler.py: ptrace, from outside the jail, at random moments), and each sample
is attributed here:
- "fused": inside torch's fused attention (FUSED_NAMES, from the .symtab of torch's libtorch_cpu.so: the CPU
  flash kernel and its backward, their lambdas and helpers, oneDNN's sdpa): its instruction pointer is in that
  code, or a return address on its stack is (the kernel was calling a matrix product), or the code running
  lies in memory the process made itself and its 32 bytes are found among the kernels' own (a copy).
- "system": code of a file the jail shares with the grader (the Python environment, the system's
  libraries), read back from that file: the bytes at the address are the file's bytes at its offset, so a
  remapped or patched copy does not pass for it.
- "own": anything else: code the process generated or loaded itself (a compiled extension, torch.compile's
  or oneDNN's generated code), which the grader cannot name.
A return address counts only where the code before it is a call, and only one pushed during the call: the
sampler clears what earlier calls left below the stack pointer before the call starts. Nothing here trusts
what the process says about itself: only its registers, its memory and its maps, read by the sampler, and
files outside the jail.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from autograder.jail.sampler import merged_ranges

SAMPLER = Path(__file__).resolve().parent / "sampler.py"
MEAN_INTERVAL_S = 0.005      # the sampler's mean interval: 200 samples a second of the call
START_TIMEOUT_S = 30
# A call is said to have run torch's fused attention when at least this many samples found it there (at the mean
# interval, some 15 ms of it). The honest loops of autograder/samples never do: their time is in GEMMs,
# elementwise kernels and the interpreter. torch's fused kernel answers 03's probe in about 0.15 s (some 30
# samples), 06's forward and backward in about 1 s.
FUSED_SAMPLES = 3
# Mangled-name parts of the functions that are torch's fused attention on the CPU (ATen's FlashAttentionKernel.cpp:
# the kernels, their lambdas and OpenMP bodies, their fused helpers) and oneDNN's sdpa.
FUSED_NAMES = (b"cpu_flash_attention", b"flash_attention_kernel_impl", b"flash_attention_backward_kernel_impl",
               b"_exp_reduce_sum_fusion_kernel", b"_mul_reduce_max_fusion_kernel", b"_scale_attn_mask_fusion_kernel",
               b"sdpa")
SEARCHED = (b"attention", b"_fusion_kernel", b"sdpa")   # parts of FUSED_NAMES that each of them holds
FUSED_LIBRARY = "libtorch_cpu.so"   # where they are: the bytes of the fused kernels are read from it


class Unwatched(Exception):
    """The call's process could not be watched. `learner` is True when the process itself prevented it."""

    def __init__(self, why: str, learner: bool):
        super().__init__(why)
        self.learner = learner


@dataclass
class Report:
    """Where a call's samples fell."""
    samples: int = 0
    fused: int = 0            # inside torch's fused attention: its code running, or a function it called
    fused_here: int = 0       # of which its own code was running (not a GEMM or helper it called)
    copied: bool = False      # some of it was a copy of that code, in memory the process made
    system: int = 0
    own: int = 0
    seconds: float = 0.0      # the call's time, as the grader saw it
    stopped_s: float = 0.0    # of which its threads spent stopped to be sampled
    cleared: int = 0          # words into the kernels that earlier calls had left on its stack, cleared first
    sampler_cpu_s: float = 0.0   # the sampler's own time on a CPU

    def ran_fused(self) -> bool:
        return self.fused >= FUSED_SAMPLES

    def mostly_own(self) -> bool:
        return self.samples >= 20 and 2 * self.own > self.samples

    def text(self) -> str:
        share = self.fused / max(self.samples, 1)
        return (f"{self.fused} of the {self.samples} samples taken of its process while it ran ({share:.0%} of its "
                f"{self.seconds:.1f} s) were inside scaled_dot_product_attention's CPU flash kernel (its own code, or "
                "a matrix product it called)"
                + (", some of them in a copy of its code" if self.copied else ""))

    def own_text(self) -> str:
        return (f"{self.own} of the {self.samples} samples taken of its process while it ran were in code that the "
                "process made or loaded itself (a compiled extension, or code generated by torch.compile or oneDNN), "
                "which the grader cannot name: whether that code is the learner's own loop is for a reader of the "
                "notebook to say")


class Watch:
    """The sampler attached to a process; `finish` stops it and says where the samples fell."""

    def __init__(self, pid: int):
        self.pid = pid
        import numpy

        argv = [sys.executable, "-I", "-S", str(SAMPLER), str(pid), repr(MEAN_INTERVAL_S), FUSED_LIBRARY,
                str(Path(numpy.__file__).resolve().parent.parent)]
        library = _fused_library_elf()
        watched = library.offsets(library.fused) if library is not None else []
        try:
            self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=subprocess.DEVNULL, close_fds=True)
        except OSError as error:
            raise Unwatched(f"the sampler could not start: {error}", learner=False) from None
        try:
            self.process.stdin.write(json.dumps({"watched": watched}).encode() + b"\n")
            self.process.stdin.flush()
        except OSError:
            pass
        line = _read_line(self.process, START_TIMEOUT_S)
        if line.get("ready") is not True:
            self.close()
            why = str(line.get("failed") or "the sampler did not start")
            learner = _traced_by_another(pid)
            if not learner and _root_without_ptrace():
                why += ("; the grader is root without CAP_SYS_PTRACE, which may not trace the jail's processes "
                        "(another uid's, undumpable): give it CAP_SYS_PTRACE (docker run --cap-add SYS_PTRACE), or "
                        "grade as an ordinary user")
            raise Unwatched(why, learner=learner)
        self.began = time.monotonic()

    def finish(self, timeout_s: float = 60.0) -> Report:
        """Stop sampling (the process goes on, detached) and attribute the samples."""
        seconds = time.monotonic() - self.began
        try:
            self.process.stdin.write(b"stop\n")
            self.process.stdin.flush()
        except OSError:
            pass
        result = _read_line(self.process, timeout_s)
        self.close()
        if "samples" not in result:
            raise Unwatched("the sampler ended without its samples", learner=False)
        report = classify(result["samples"], result.get("maps") or [])
        report.seconds, report.stopped_s = seconds, float(result.get("stopped_s") or 0.0)
        report.cleared = int(result.get("cleared") or 0)
        report.sampler_cpu_s = float(result.get("cpu_s") or 0.0)
        return report

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass


def _read_line(process: subprocess.Popen, timeout_s: float) -> dict:
    import select

    deadline, data = time.monotonic() + timeout_s, b""
    fd = process.stdout.fileno()
    while not data.endswith(b"\n") and time.monotonic() < deadline:
        if select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            data += chunk
    try:
        line = json.loads(data)
    except ValueError:
        return {}
    return line if isinstance(line, dict) else {}


CAP_SYS_PTRACE = 19


def _root_without_ptrace() -> bool:
    """Whether this grader is root without CAP_SYS_PTRACE (as in a container by default), which cannot trace
    another uid's undumpable process; an ordinary user traces its jails' processes through their user namespace."""
    if os.geteuid() != 0:
        return False
    try:
        status = Path("/proc/self/status").read_text().splitlines()
        effective = int(next(line.split()[1] for line in status if line.startswith("CapEff:")), 16)
    except (OSError, StopIteration, ValueError):
        return False
    return not effective >> CAP_SYS_PTRACE & 1


def _traced_by_another(pid: int) -> bool:
    """Whether pid already has a tracer (one of the jail's processes: the grader's sampler is not attached)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("TracerPid:"):
                return int(line.split()[1]) != 0
    except (OSError, ValueError, IndexError):
        pass
    return False


# --- attribution ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    offset: int
    path: str       # "" for anonymous memory; the kernel's "(deleted)" suffix kept


def parse_maps(text: str) -> list[Mapping]:
    """The executable mappings of a /proc/PID/maps text."""
    found = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5 or "x" not in parts[1]:
            continue
        try:
            start, end = (int(x, 16) for x in parts[0].split("-"))
            offset = int(parts[2], 16)
        except ValueError:
            continue
        found.append(Mapping(start, end, offset, parts[5] if len(parts) == 6 else ""))
    return found


class Elf:
    """What is needed of an ELF file: its loadable segments and the address ranges of its fused-attention
    functions (from .symtab, else .dynsym)."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:   # 64-bit little-endian only
                raise ValueError("not a 64-bit little-endian ELF file")
            self.machine = struct.unpack_from("<H", head, 0x12)[0]
            phoff, shoff = struct.unpack_from("<QQ", head, 0x20)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 0x36)
            f.seek(phoff)
            table = f.read(phentsize * phnum)
            self.segments = []   # (file offset, virtual address, size in the file) of each PT_LOAD
            for i in range(phnum):
                kind, _, offset, vaddr, _, filesz = struct.unpack_from("<IIQQQQ", table, i * phentsize)
                if kind == 1:
                    self.segments.append((offset, vaddr, filesz))
            f.seek(shoff)
            sections = [struct.unpack_from("<IIQQQQIIQQ", f.read(shentsize)) for _ in range(shnum)]
            self.fused = self._fused_ranges(f, sections)

    @staticmethod
    def _fused_ranges(f, sections) -> list[tuple[int, int]]:
        import numpy as np

        for kind in (2, 11):   # SHT_SYMTAB, else SHT_DYNSYM
            table = next((s for s in sections if s[1] == kind), None)
            if table is not None:
                break
        else:
            return []
        strings = sections[table[6]]
        f.seek(strings[4])
        names = f.read(strings[5])
        # Every place a fused name occurs, as the span of string offsets a symbol's name may start at to hold it
        # (a name may be the tail of a longer string). Found by a few short parts first: bytes.find is fast.
        spans = set()
        for part in SEARCHED:
            at = names.find(part)
            while at >= 0:
                begin = names.rfind(b"\0", 0, at) + 1
                string = names[begin:names.find(b"\0", at)]
                for name in FUSED_NAMES:
                    where = string.find(name)
                    if where >= 0:
                        spans.add((begin, begin + where))
                at = names.find(part, at + len(part))
        if not spans:
            return []
        spans = sorted(spans)
        f.seek(table[4])
        data = f.read(table[5])
        symbols = np.frombuffer(data, count=len(data) // 24, dtype=np.dtype([
            ("name", "<u4"), ("info", "u1"), ("other", "u1"), ("section", "<u2"), ("value", "<u8"), ("size", "<u8")]))
        functions = symbols[((symbols["info"] & 0xF) == 2) & (symbols["size"] > 0)]   # STT_FUNC
        starts = np.array([s for s, _ in spans], dtype=np.int64)
        ends = np.array([e for _, e in spans], dtype=np.int64)
        at = np.searchsorted(starts, functions["name"].astype(np.int64), side="right") - 1
        fused = (at >= 0) & (functions["name"].astype(np.int64) <= ends[np.maximum(at, 0)])
        # A function the linker folded with another of the same code has both names: it is not the kernels' own.
        others = set(functions["value"][~fused].tolist())
        return merged_ranges([(int(v), int(v) + int(n)) for v, n in zip(functions["value"][fused], functions["size"][fused])
                        if int(v) not in others])

    def offsets(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Address ranges as ranges of offsets in the file (those within its loadable segments)."""
        out = []
        for start, end in ranges:
            for offset, vaddr, size in self.segments:
                low, high = max(start, vaddr), min(end, vaddr + size)
                if low < high:
                    out.append((offset + low - vaddr, offset + high - vaddr))
        return merged_ranges(out)

    def address(self, offset: int) -> int | None:
        """The virtual address of a file offset, within a loadable segment."""
        for start, vaddr, size in self.segments:
            if start <= offset < start + size:
                return vaddr + offset - start
        return None

    def bytes_at(self, offset: int, count: int) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(offset)
            return f.read(count)


def _in(ranges: list[tuple[int, int]], address: int) -> bool:
    i = bisect_right(ranges, (address, float("inf"))) - 1
    return i >= 0 and ranges[i][0] <= address < ranges[i][1]


@lru_cache(maxsize=64)
def _elf(path: str, identity: tuple) -> Elf | None:
    try:
        return Elf(path)
    except (OSError, ValueError, struct.error):
        return None


def _elf_of(path: str) -> Elf | None:
    """The ELF file at path as the grader sees it (the jail shows the same files at the same paths)."""
    if not path.startswith("/") or path.endswith(" (deleted)"):
        return None
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return _elf(path, (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns))


def fused_library() -> Path | None:
    """torch's libtorch_cpu.so, the one the jail's processes load."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent / "lib" / FUSED_LIBRARY
    return path if path.exists() else None


@lru_cache(maxsize=4)
def _fused_code(path: str, identity: tuple) -> bytes:
    """The bytes of every fused-attention function of the library, each range apart (separated by a byte
    sequence no sample of CODE_BYTES can span)."""
    elf = _elf(path, identity)
    if elf is None:
        return b""
    parts = []
    with open(path, "rb") as f:
        for start, end in elf.fused:
            for offset, vaddr, size in elf.segments:
                if vaddr <= start < vaddr + size:
                    f.seek(offset + start - vaddr)
                    parts.append(f.read(min(end, vaddr + size) - start))
    return b"\0\xff\0\xff".join(parts)


def _fused_bytes() -> bytes:
    library = fused_library()
    if library is None:
        return b""
    stat = library.stat()
    return _fused_code(str(library), (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns))


def _fused_library_elf() -> Elf | None:
    library = fused_library()
    return _elf_of(str(library)) if library is not None else None


def _after_call(elf: Elf, offset: int) -> bool:
    """Whether the code just before file offset `offset` ends with a call instruction: a return address."""
    before = elf.bytes_at(max(0, offset - 7), min(7, offset))
    if len(before) < 7:
        return False
    if elf.machine == 183:   # aarch64: bl or blr
        insn = int.from_bytes(before[-4:], "little")
        return insn & 0xFC000000 == 0x94000000 or insn & 0xFFFFFC1F == 0xD63F0000
    if before[-5] == 0xE8:   # call rel32
        return True
    for length in (2, 3, 4, 6, 7):   # call through a register or memory: ff /2, its ModRM `length - 1` bytes back
        opcode, modrm = before[-length], before[-length + 1]
        if opcode != 0xFF or (modrm >> 3) & 7 != 2:
            continue
        mod, rm = modrm >> 6, modrm & 7
        size = 2 + (rm == 4 and mod != 3) + {0: 4 if rm == 5 else 0, 1: 1, 2: 4, 3: 0}[mod]
        if size == length:
            return True
    return False


def _locate(snapshots: list[list[Mapping]], address: int):
    """(mapping, ELF file, file offset) of each mapping of the snapshots that holds address, in order."""
    for maps in snapshots:
        for mapping in maps:
            if mapping.start <= address < mapping.end:
                elf = _elf_of(mapping.path)
                if elf is not None:
                    yield mapping, elf, mapping.offset + address - mapping.start


def classify(samples: list, maps_texts: list[str]) -> Report:
    """Attribute each [ip, hex of the code there, [words of its stack]] sample (see the module's docstring)."""
    snapshots = [parse_maps(text) for text in maps_texts if isinstance(text, str)]
    report = Report()
    unnamed: dict[bytes, int] = {}
    returns: dict[int, bool] = {}   # word -> whether it is a return address into the fused kernels

    def returns_into_fused(word: int) -> bool:
        if word not in returns:
            returns[word] = any(
                (address := elf.address(offset)) is not None and _in(elf.fused, address) and _after_call(elf, offset)
                for _, elf, offset in _locate(snapshots[:1], word))
        return returns[word]

    for sample in samples:
        try:
            ip, code = int(sample[0]), bytes.fromhex(sample[1])
            words = [int(w) for w in (sample[2] if len(sample) > 2 else [])][:256]
        except (TypeError, ValueError, IndexError):
            continue
        report.samples += 1
        kind = None
        for _, elf, offset in _locate(snapshots, ip):
            if not code or elf.bytes_at(offset, len(code)) != code:
                continue     # not that file's code any more (remapped, or written over)
            address = elf.address(offset)
            kind = "fused" if address is not None and _in(elf.fused, address) else "system"
            break
        if kind == "fused":
            report.fused_here += 1
        elif any(returns_into_fused(w) for w in words):
            kind = "fused"
        if kind is None:
            unnamed[code] = unnamed.get(code, 0) + 1
            continue
        setattr(report, kind, getattr(report, kind) + 1)
    if unnamed:
        fused = _fused_bytes()
        for code, count in unnamed.items():
            if len(code) >= 16 and fused.find(code) >= 0:
                report.fused += count
                report.fused_here += count
                report.copied = True
            else:
                report.own += count
    return report
