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
        # bf16 tensor cores arrive with Ampere (sm_80); a T4 (sm_75) gets fp16.
        dtype = torch.bfloat16 if major >= 8 else torch.float16
        line = f"flashcourse: GPU {name}, Triton kernels compiled, dtype {str(dtype).removeprefix('torch.')}"
        return Runtime("cuda", dtype, False, colab, line)
    os.environ["TRITON_INTERPRET"] = "1"
    _without_overflow_checks()
    why = f"{DEVICE_ENV}=cpu" if wanted == "cpu" else "no GPU found"
    line = f"flashcourse: {why}, Triton kernels run in the interpreter on the CPU, dtype float32"
    return Runtime("cpu", torch.float32, True, colab, line)


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
