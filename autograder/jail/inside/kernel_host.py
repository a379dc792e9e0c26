"""Runs in a kernel jail: the learner's Triton kernels, launched by the grader's own wrappers.

The grader (autograder/grading/kernel_world.py) sends this file's text, then a module of the learner's
kernels, then the instructor's launch code, to a fresh jail that holds none of the learner's other
code. `load(path)` imports the kernels; on a CPU, where they run in Triton's interpreter, every
launch is first compiled for a Hopper GPU (sm_90) by a compiler process beside this one, so a kernel
body that is Python rather than Triton (a call of torch, a loop over NumPy values) fails to compile
and never runs. That compile goes as far as Triton's GPU dialect (TTGIR), once per specialization
of the kernel: the stages after it read only the compiler's own output. On a GPU the kernels are
compiled for real, which proves the same.

Everything here runs beside the learner's kernels: the grader trusts only the answers it checks.
"""

import importlib.util
import json
import os
import subprocess
import sys

from triton.runtime.jit import KernelInterface

# The compiler process: Triton imported without the interpreter, a stand-in driver naming an sm_90 GPU
# (no GPU is needed to compile for one), the learner's kernels imported from the same file. It reads
# one launch per line and answers "ok" or the compiler's message.
COMPILER = r"""
import json, os, sys
import torch, triton
from triton.backends.compiler import GPUTarget

class Sm90:
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_active_torch_device(self): return torch.device("cpu")

triton.runtime.driver.set_active(Sm90())


class Translated(Exception):
    '''Raised where the kernel has become Triton's GPU dialect (TTGIR) for sm_90.'''


# What a learner wrote is read (Python to Triton IR) and laid out for the GPU (TTGIR) by the first two
# stages; the later ones (LLVM IR, PTX, the binary) translate the compiler's own output and take most of
# its time, so the compile stops there.
backend = triton.backends.backends["nvidia"].compiler
add_stages = backend.add_stages

def until_ttgir(self, stages, *args, **kwargs):
    add_stages(self, stages, *args, **kwargs)
    def stop(src, metadata):
        raise Translated()
    stages["llir"] = stop

backend.add_stages = until_ttgir
import importlib.util
spec = importlib.util.spec_from_file_location("learner_kernels_compiled", sys.argv[1])
kernels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kernels)
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

def value(item):
    kind = item[0]
    if kind == "tensor":
        return torch.empty_strided(item[2], item[3], dtype=getattr(torch, item[1]))
    if kind == "descriptor":
        return TensorDescriptor(value(item[1]), item[2], item[3], item[4])
    return item[1]


def compiled_as(item, fixed):
    '''What of a launch argument the compile depends on, as value() rebuilds it.

    Triton compiles an integer argument once for each answer to "is it 1?", "does 16 divide it?" and "does
    it fit in 32 bits?". Only the first changes the code the compiler reads (a 1 is a constant there), so
    every other integer is compiled as one value of its width; a tensor's shape and strides change nothing.'''
    if item[0] == "tensor":
        return ["tensor", item[1], [1] * len(item[2]), [1] * len(item[3])]
    if item[0] == "descriptor":
        return ["descriptor", compiled_as(item[1], False), *item[2:]]
    given = item[1]
    if type(given) is int and not fixed and given != 1:
        given = 17 if -2**31 <= given < 2**31 else 2**40 + 1 if -2**63 <= given < 2**63 else given
    return ["value", given]


def translate(kernel, args, kwargs, grid):
    '''"ok", or what the compiler said, named call first and then (as its cause) what failed in it.'''
    try:
        kernel.warmup(*[value(a) for a in args], grid=tuple(grid), **{k: value(v) for k, v in kwargs.items()})
        return "ok"
    except Exception as error:
        chain = []
        while error is not None and len(chain) < 8:
            if isinstance(error, Translated):
                return "ok"
            chain.append(f"{type(error).__name__}: {error}")
            error = error.__cause__
        return json.dumps("\n".join(chain)[-4000:])


answers = {}  # one translation per kernel and specialization
for line in sys.stdin:
    name, args, kwargs, grid = json.loads(line)
    kernel = getattr(kernels, name)
    fixed = {p.name for p in kernel.params if p.is_constexpr} | (set(kwargs) - {p.name for p in kernel.params})
    args = [compiled_as(a, p.name in fixed) for a, p in zip(args, kernel.params)]
    kwargs = {k: compiled_as(v, k in fixed) for k, v in kwargs.items()}
    key = json.dumps([name, args, sorted(kwargs.items())])
    if key not in answers:
        answers[key] = translate(kernel, args, kwargs, grid)
    print(answers[key], flush=True)
"""


class KernelDidNotCompile(RuntimeError):
    """A launch of the learner's kernel that Triton cannot compile for a GPU."""


def _described(item):
    """A launch argument as JSON the compiler process rebuilds: tensors by dtype, shape and strides."""
    import torch

    if isinstance(item, torch.Tensor):
        return ["tensor", str(item.dtype).removeprefix("torch."), list(item.shape), list(item.stride())]
    if type(item).__name__ == "TensorDescriptor":
        return ["descriptor", _described(item.base), list(item.shape), list(item.strides), list(item.block_shape)]
    if item is None or isinstance(item, (bool, int, float, str)):
        return ["value", item]
    return ["value", str(item)]


class Compiler:
    """The compiler process, started on the first launch and kept for the jail's life."""

    def __init__(self, path):
        self.path, self.process, self.done = path, None, {}

    def check(self, name, args, kwargs, grid):
        request = json.dumps([name, [_described(a) for a in args],
                              {k: _described(v) for k, v in kwargs.items()}, list(grid)])
        if request not in self.done:
            self.done[request] = self._ask(request)
        if self.done[request] != "ok":
            raise KernelDidNotCompile(f"{name} does not compile for a GPU (sm_90): {self.done[request]}")

    def _ask(self, request):
        if self.process is None:
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            env["TRITON_CACHE_DIR"] = os.path.join(os.path.dirname(self.path), "triton-sm90")
            self.process = subprocess.Popen([sys.executable, "-c", COMPILER, self.path], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        self.process.stdin.write(request + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline().strip()
        if not answer:
            raise KernelDidNotCompile("the compiler process ended without an answer")
        return answer if answer == "ok" else json.loads(answer)


class CompiledFirst(KernelInterface):
    """A kernel whose every launch is compiled for sm_90 before the interpreter runs it."""

    def __init__(self, name, kernel, compiler):
        self.name, self.kernel, self.compiler = name, kernel, compiler
        self.arg_names = kernel.arg_names

    def __getattr__(self, attribute):
        return getattr(self.kernel, attribute)

    def run(self, *args, grid, warmup=False, **kwargs):
        grid_now = grid(dict(zip(self.arg_names, args), **kwargs)) if callable(grid) else grid
        self.compiler.check(self.name, args, kwargs, tuple(grid_now) + (1,) * (3 - len(grid_now)))
        return self.kernel.run(*args, grid=grid, warmup=warmup, **kwargs)


def load(path, names, interpreted):
    """The learner's kernels `names` from the module at `path`, each compiled first where it is interpreted."""
    spec = importlib.util.spec_from_file_location("learner_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    compiler = Compiler(path) if interpreted else None
    kernels = {}
    for name in names:
        kernel = getattr(module, name)
        kernels[name] = CompiledFirst(name, kernel, compiler) if interpreted else kernel
    return kernels
