"""The instructor's tooling, outside what learners install: the backward's and the ring's benchmarks on the
course's GPUs, and the small GPT trained with each attention.

bench_backward  06's backward beside cuDNN and FlashAttention-2 through SDPA, in one process
bench_ring      07's ring on P GPUs with NCCL, beside one GPU's SDPA and context_parallel
gpt             a small GPT trained once with SDPA and once with the course's kernels
"""
