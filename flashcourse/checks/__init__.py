"""The recognisers of mistakes: what the test cells call, and what names a mistake in the learner's terms.

core            the shared core: attention cases, the reference outputs of the classic bugs, the explanation
                of a wrong tensor (GQA mapping, offsets, masks, scale, NaN rows), the memory probe, the merge
                of partial states (02, 03 and 05 use it directly)
online_softmax  01's checks: the tile, the statistic (m, l or a) and the likely mistake
triton_flash    04's and 05's kernel checks: block skipping, windows, dtypes, validation
triton_warmup   04's warm-up: the PyTorch specs of four small kernels and the checks that name their mistakes
backward        06's checks: o and lse, gradients against autograd, Delta, P, the scale, GQA sums, NaN rows
ring_attention  07's checks: the (o, lse) merge, the zigzag layout, rings run on real process groups
packed_paged    09's checks: packed attention over cu_seqlens, the paged cache's address arithmetic, attention
                read page by page (decode and chunked prefill)
reference       the unfused attention every check compares with (float64 ground truth)
recurrence      the online-softmax recurrence as data, tile by tile, with the classic bugs injectable
"""

import importlib


def __getattr__(name: str):
    # One release: `from flashcourse import checks` was 01's module, now checks.online_softmax.
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(importlib.import_module("flashcourse.checks.online_softmax"), name)
