"""Where the course runs: a CUDA GPU (compiled Triton, bf16 or fp16) or a CPU (Triton's interpreter,
float32). The choice is made once per process and announced in one line.

Triton reads TRITON_INTERPRET when a kernel is decorated with @triton.jit, so `setup()` must run
before any kernel is defined; the engine's kernel modules call it on import for that reason.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass

import torch

from flashcourse import DEVICE_ENV


@dataclass(frozen=True)
class Runtime:
    device: str            # "cuda" or "cpu"
    dtype: torch.dtype     # the dtype kernels are exercised in: bf16/fp16 on a GPU, float32 on a CPU
    interpret: bool        # True when Triton kernels run under the interpreter
    colab: bool
    description: str       # the one line printed by setup()


_chosen: Runtime | None = None


def _in_colab() -> bool:
    return "google.colab" in sys.modules


def interprets() -> bool:
    """Whether setup() will choose Triton's interpreter here (no GPU, or DEVICE_ENV=cpu), without choosing."""
    return os.environ.get(DEVICE_ENV, "auto") == "cpu" or not torch.cuda.is_available()


def import_triton() -> None:
    """Import Triton as setup() will have it, without choosing: TRITON_INTERPRET is set first where the
    interpreter will be chosen, since Triton reads it on import. The grading jail imports it before a notebook."""
    if interprets():
        os.environ["TRITON_INTERPRET"] = "1"
    import triton  # noqa: F401


def _choose() -> Runtime:
    colab = _in_colab()
    wanted = os.environ.get(DEVICE_ENV, "auto")
    if wanted == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{DEVICE_ENV}=cuda, but torch sees no CUDA GPU here")
    if not interprets():
        name = torch.cuda.get_device_name()
        major, _ = torch.cuda.get_device_capability()
        pinned = pin_hopper_ptxas() if major == 9 else None
        # bf16 tensor cores arrive with Ampere (sm_80); a T4 (sm_75) gets fp16.
        dtype = torch.bfloat16 if major >= 8 else torch.float16
        line = f"flashcourse: GPU {name}, Triton kernels compiled, dtype {str(dtype).removeprefix('torch.')}"
        if pinned:
            line += ", sm_90 assembled by the CUDA 12 ptxas Triton ships (pin_hopper_ptxas)"
        return Runtime("cuda", dtype, False, colab, line)
    os.environ["TRITON_INTERPRET"] = "1"
    _without_overflow_checks()
    why = f"{DEVICE_ENV}=cpu" if wanted == "cpu" else "no GPU found"
    line = f"flashcourse: {why}, Triton kernels run in the interpreter on the CPU, dtype float32"
    return Runtime("cpu", torch.float32, True, colab, line)


def pin_hopper_ptxas() -> str | None:
    """Have Triton assemble Hopper (sm_90) kernels with the CUDA 12 ptxas it ships where it would use CUDA 13's,
    and return that ptxas's path (None where nothing changed). Triton 3.9 assembles sm_90 with CUDA 13.4's ptxas,
    which serializes the wgmma of 08's kernel wherever items overlap, for want of registers (its warning C7512:
    each product waits for the one before); CUDA 12.9's, shipped beside it, does not serialize the same kernel.
    A ptxas named in TRITON_PTXAS_BLACKWELL_PATH, the variable this sets, is left as it is."""
    if os.environ.get("TRITON_PTXAS_BLACKWELL_PATH"):
        return None
    try:  # a Triton without knobs or get_ptxas assembles as it will
        from triton import knobs
        from triton.backends.nvidia.compiler import get_ptxas

        hopper, cuda12 = get_ptxas(90), knobs.nvidia.ptxas
    except (ImportError, RuntimeError):  # RuntimeError: a Triton that ships no CUDA 12 ptxas
        return None
    if int(hopper.version.split(".")[0]) < 13 or not cuda12.version.startswith("12."):
        return None
    knobs.nvidia.ptxas_blackwell = cuda12.path
    return cuda12.path


def _without_overflow_checks() -> None:
    """Triton's interpreter computes an overflow check of every integer +, - and * of a kernel, about a third of
    its time, and asserts it only under its own `debug` option, which is off: the answer is thrown away. Off here
    too; a Triton that keeps these options elsewhere, or has debug on, is left as it is."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and hasattr(options, "sanitize_overflow") and not options.debug:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


def setup(quiet: bool = False) -> Runtime:
    """Choose the device once, enable Colab's widget manager there, and print what was chosen."""
    global _chosen
    if _chosen is None:
        _chosen = _choose()
        if _chosen.colab:
            from google.colab import output  # type: ignore[import-not-found]

            output.enable_custom_widget_manager()
        if not quiet:
            print(_chosen.description)
    return _chosen


def current() -> Runtime:
    """The runtime chosen by setup(), choosing it silently if no notebook has yet."""
    return setup(quiet=True)
