"""flashcourse: the library behind the FlashAttention course notebooks.

runtime           decides once between a GPU and the Triton interpreter (every notebook starts with it)
reference         the unfused attention spec every check compares with (float64 ground truth)
positions         the absolute positions of queries and keys (answers no exercise: graded notebooks import it)
recurrence        the online-softmax recurrence as data, tile by tile, with the classic bugs injectable
checks            01's checks: failure messages name the tile, the statistic and the likely mistake
attention_checks  the same for tensors (03 onwards): GQA mapping, offsets, masks, scale, NaN rows
kernel_checks     the same for Triton kernels (04 onwards): block skipping, windows, dtypes
warmup_checks     04's Triton warm-up: the PyTorch specs of four small kernels and checks that name masks,
                  strides, an unsubtracted maximum or counted masked lanes
backward_checks   06's checks: o and lse, and gradients against autograd, naming Delta left out or wrong, P rebuilt
                  without l or in the wrong base, the scale, the mask, dk/dv not summed over a GQA group, NaN rows
ring_checks       07's checks: the (o, lse) merge, the zigzag layout, rings run on real process groups
distributed       runs a function on P local ranks of a torch.distributed group (answers no exercise)
memory            an allocation tracker, to show what the unfused and tiled versions keep alive
widgets           the tile explorer and the causal block picture
selfcheck         `python -m flashcourse.selfcheck NOTEBOOK`: run a notebook's visible tests
bench             GPU benchmarks against torch's scaled_dot_product_attention
bench_ring        07's ring on P GPUs with NCCL, timed beside one GPU's SDPA
engine            the finished implementations, generated from the solution cells of source/
"""

__version__ = "0.1.0"
DEVICE_ENV = "FLASHCOURSE_DEVICE"  # "cpu" or "cuda" overrides runtime's choice of device ("auto", or unset, does not)
