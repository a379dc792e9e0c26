"""The engine's packed variable-length and paged-KV-cache kernels against the course's contiguous kernels and torch's
SDPA, on a CUDA GPU.

    python -m instructor.bench_packed_paged --out benchmarks/results/DATE-GPU-packed-paged.md \
        --json benchmarks/results/DATE-GPU-packed-paged.json [--sweep]

Every number from one process, side by side:

- varlen: varlen_attention on one packed batch of 16 sequences of mixed lengths (drawn between 256 and 8192,
  seeded), bf16, D = 128, against SDPA's cuDNN and flash backends on the same sequences padded on the right to
  the longest (B x max_len, is_causal on the padded batch: a real row sees only real keys). TFLOP/s of useful
  work only, the real tokens' FLOPs (the FlashAttention papers' convention: 2 Hq L^2 D per causal sequence,
  4 Hq L^2 D not causal), for every implementation; times by triton.testing.do_bench, as flashcourse.bench.fast.
- decode: paged_decode over shuffled pages of 16, 64 and 256 keys against fast_decode (assignment 05) on the same
  keys in a contiguous cache and SDPA's backends, S = 8k to 64k, Hq = 32, Hkv = 8, D = 128, bf16; TB/s of K and
  V read. As in flashcourse.bench.fast, each implementation is captured in one CUDA graph that calls it on
  several copies of the cache (together more than the L2 holds), replayed, the time divided by the calls.
- --sweep: paged_decode's tile (BLOCK_N), stages and split count, one at a time; varlen_attention's blocks
  (what paged_launch, paged_splits and varlen_launch were chosen from).
"""

from __future__ import annotations

import functools
import math

import torch

from flashcourse.bench import GPU_NEEDED, environment
from flashcourse.bench.fast import L2_FLUSH_BYTES, _graph_ms, _inputs, _ms, _or_nan, _sdpa, max_error
from flashcourse.bench.reports import report_opening, report_parser, save_json, show_report

VARLEN = [  # (Hq, Hkv, causal): 16 sequences each, lengths drawn between 256 and 8192
    (32, 8, True), (32, 32, True), (32, 8, False),
]
VARLEN_SEQUENCES, VARLEN_SHORTEST, VARLEN_LONGEST = 16, 256, 8192
DECODE = [(8, 8192), (8, 16384), (8, 32768), (8, 65536), (16, 16384), (32, 8192), (32, 16384), (32, 32768)]
PAGE_SIZES = (16, 64, 256)
Q_HEADS, KV_HEADS, D = 32, 8, 128
VARLEN_CONFIGS = [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4)]
SWEEP_DECODE = [(8, 8192), (8, 32768), (32, 16384)]
SWEEP_TILES = [(16, 3), (32, 3), (64, 3), (128, 3), (16, 6), (32, 4)]   # (BLOCK_N, stages), 4 warps
SWEEP_SPLIT_FACTORS = (1, 2, 4)                                          # times decode_splits' count


@functools.cache
def engine():
    """The kernels measured here: flashcourse.engine.packed_paged."""
    from flashcourse.engine import packed_paged

    return packed_paged


def _launch_as(fn, name, launch):
    """Have `fn` (a wrapper of the engine) use `launch` for its module-level `name` (varlen_launch, paged_launch)
    until the returned restore() is called: the global is looked up in the module that defines `fn`."""
    module_globals = fn.__globals__
    given = module_globals[name]
    module_globals[name] = lambda *args, **kwargs: dict(launch)

    def restore():
        module_globals[name] = given
    return restore


# --- varlen ----------------------------------------------------------------------------------------------------


def mixed_lengths(seed=0):
    """VARLEN_SEQUENCES lengths drawn uniformly between VARLEN_SHORTEST and VARLEN_LONGEST, seeded."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(VARLEN_SHORTEST, VARLEN_LONGEST + 1, (VARLEN_SEQUENCES,), generator=gen).tolist()


def varlen_case(lengths, q_heads, kv_heads, d=D, dtype=torch.bfloat16):
    """The packed batch (q [total, Hq, D], k, v [total, Hkv, D], cu_seqlens int32 [B + 1]) and the same sequences
    padded on the right to the longest, [B, H, max_len, D] (zeros past each length)."""
    total, longest = sum(lengths), max(lengths)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(total, q_heads, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(total, kv_heads, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(total, kv_heads, d, device="cuda", dtype=dtype, generator=gen)
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    padded = []
    for x in (q, k, v):
        out = torch.zeros(len(lengths), x.shape[1], longest, d, device="cuda", dtype=dtype)
        for b, n in enumerate(lengths):
            out[b, :, :n] = x[cu[b]:cu[b] + n].transpose(0, 1)
        padded.append(out)
    return (q, k, v, cu), padded


def _sequence_error(o, q, k, v, cu, b, causal):
    """max |o - FP32 reference| over sequence b's heads 0-1 (flashcourse.bench.fast.max_error on it as a batch)."""
    rows = slice(int(cu[b]), int(cu[b + 1]))
    as_batch = lambda x: x[rows].transpose(0, 1)[None]  # noqa: E731  [L, H, D] -> [1, H, L, D]
    return max_error(as_batch(o), as_batch(q), as_batch(k), as_batch(v), causal)


def varlen(grid=VARLEN, rows=None, done=lambda: None) -> list[dict]:
    """varlen_attention against padded SDPA (cuDNN, flash) on one mixed batch: useful TFLOP/s and errors."""
    from torch.nn.attention import SDPBackend

    varlen_attention = engine().varlen_attention
    rows = [] if rows is None else rows
    lengths = mixed_lengths()
    for q_heads, kv_heads, causal in grid:
        (q, k, v, cu), (pq, pk, pv) = varlen_case(lengths, q_heads, kv_heads)
        useful = (2.0 if causal else 4.0) * q_heads * D * sum(n * n for n in lengths)
        padded_flops = (2.0 if causal else 4.0) * q_heads * D * len(lengths) * max(lengths) ** 2
        gqa = q_heads != kv_heads
        impls = {
            "varlen_attention": lambda: varlen_attention(q, k, v, cu, cu, max_seqlen_q=max(lengths), causal=causal),
            "padded SDPA cuDNN": lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, causal, gqa)(pq, pk, pv),
            "padded SDPA flash": lambda: _sdpa(SDPBackend.FLASH_ATTENTION, causal, gqa)(pq, pk, pv),
        }
        row = dict(q_heads=q_heads, kv_heads=kv_heads, causal=causal, lengths=lengths, tokens=sum(lengths),
                   padded_tokens=len(lengths) * max(lengths), padded_share=padded_flops / useful)
        for name, fn in impls.items():
            row[f"{name} ms"] = _or_nan(_ms, fn)
            row[name] = useful / row[f"{name} ms"] / 1e9
        o, _ = impls["varlen_attention"]()
        shortest, longest = lengths.index(min(lengths)), lengths.index(max(lengths))
        row["varlen error"] = max(_sequence_error(o, q, k, v, cu, b, causal) for b in (shortest, longest))
        n, real = lengths[longest], slice(longest, longest + 1)
        row["cuDNN error"] = _or_nan(lambda fn: max_error(fn()[real, :, :n], pq[real, :, :n], pk[real, :, :n],
                                                          pv[real, :, :n], causal), impls["padded SDPA cuDNN"])
        rows.append(row)
        done()
        print(f"  varlen Hq/Hkv {q_heads}/{kv_heads} {'causal' if causal else 'full'}: "
              + ", ".join(f"{name} {row[name]:.1f}" for name in impls) + " TFLOP/s (useful)", flush=True)
        del q, k, v, pq, pk, pv, o
        torch.cuda.empty_cache()
    return rows


def varlen_sweep(grid=VARLEN[:2]) -> list[dict]:
    """varlen_attention's TFLOP/s with each of VARLEN_CONFIGS (BLOCK_M, BLOCK_N, warps, stages) on the mixed batch."""
    rows = []
    lengths = mixed_lengths()
    varlen_attention = engine().varlen_attention
    for q_heads, kv_heads, causal in grid:
        (q, k, v, cu), _ = varlen_case(lengths, q_heads, kv_heads)
        useful = (2.0 if causal else 4.0) * q_heads * D * sum(n * n for n in lengths)
        row = dict(q_heads=q_heads, kv_heads=kv_heads, causal=causal, configs={})
        for bm, bn, warps, stages in VARLEN_CONFIGS:
            restore = _launch_as(varlen_attention, "varlen_launch",
                                 dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages))
            try:
                ms = _or_nan(_ms, lambda: varlen_attention(q, k, v, cu, cu, max_seqlen_q=max(lengths), causal=causal))
            finally:
                restore()
            row["configs"][f"{bm}x{bn} w{warps} s{stages}"] = useful / ms / 1e9
        rows.append(row)
        print(f"  varlen sweep {q_heads}/{kv_heads}: " + ", ".join(f"{c} {t:.1f}" for c, t in row["configs"].items()),
              flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    return rows


# --- paged decode ----------------------------------------------------------------------------------------------


def paged_copy(q, k, v, page_size, seed=0):
    """The contiguous cache k, v [B, Hkv, S, D] as a shuffled paged pool: (q [B, Hq, D], k_cache, v_cache
    [B * S / page_size, page_size, Hkv, D], block_table int32 [B, S / page_size], cache_seqlens int32 [B])."""
    batch, kv_heads, s, d = k.shape
    pages = s // page_size
    physical = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(seed)).cuda()
    pools = []
    for x in (k, v):
        pool = torch.empty(batch * pages, page_size, kv_heads, d, device="cuda", dtype=x.dtype)
        pool[physical] = x.view(batch, kv_heads, pages, page_size, d).permute(0, 2, 3, 1, 4).reshape(
            batch * pages, page_size, kv_heads, d)
        pools.append(pool)
    table = physical.view(batch, pages).to(torch.int32)
    seqlens = torch.full((batch,), s, device="cuda", dtype=torch.int32)
    return q[:, :, 0].contiguous(), *pools, table, seqlens


def _decode_caches(batch, s):
    """Enough contiguous caches (q, k, v) for one graph to read more than the L2 holds, and the bytes of K and V."""
    kv_bytes = 2 * batch * KV_HEADS * s * D * 2
    copies = max(2, math.ceil(L2_FLUSH_BYTES / kv_bytes))
    return [_inputs(batch, Q_HEADS, KV_HEADS, 1, s, D, torch.bfloat16, seed=i) for i in range(copies)], kv_bytes


def decode(grid=DECODE, page_sizes=PAGE_SIZES, rows=None, done=lambda: None) -> list[dict]:
    """TB/s of paged_decode (each page size), fast_decode on the contiguous cache and SDPA's backends."""
    from torch.nn.attention import SDPBackend

    from flashcourse.engine.decode import fast_decode

    paged_decode = engine().paged_decode
    rows = [] if rows is None else rows
    for batch, s in grid:
        caches, kv_bytes = _decode_caches(batch, s)
        row = dict(batch=batch, s=s, copies=len(caches), page_sizes=list(page_sizes),
                   splits=engine().paged_splits(batch, KV_HEADS, s, "cuda"))
        impls = {"fast_decode": fast_decode, "SDPA cuDNN": _sdpa(SDPBackend.CUDNN_ATTENTION, False, True),
                 "SDPA flash": _sdpa(SDPBackend.FLASH_ATTENTION, False, True)}
        for name, fn in impls.items():
            row[name] = kv_bytes / _or_nan(_graph_ms, [functools.partial(fn, *cache) for cache in caches]) / 1e9
        q, k, v = caches[0]
        row["fast_decode error"] = max_error(fast_decode(q, k, v), q, k, v, False)
        for page_size in page_sizes:
            paged = [paged_copy(*cache, page_size, seed=i) for i, cache in enumerate(caches)]
            name = f"paged {page_size}"
            row[name] = kv_bytes / _or_nan(_graph_ms, [functools.partial(paged_decode, *p) for p in paged]) / 1e9
            row[f"{name} error"] = max_error(paged_decode(*paged[0])[:, :, None], q, k, v, False)
            row[f"{name} / fast_decode"] = row[name] / row["fast_decode"]
            del paged
            torch.cuda.empty_cache()
        rows.append(row)
        done()
        print(f"  decode B={batch} S={s:6d}: " + ", ".join(
            f"{n} {row[n]:.2f}" for n in ["fast_decode", "SDPA cuDNN", "SDPA flash"] +
            [f"paged {p}" for p in page_sizes]) + " TB/s", flush=True)
        del caches, q, k, v
        torch.cuda.empty_cache()
    return rows


def decode_sweep(grid=SWEEP_DECODE, page_sizes=(16, 64)) -> list[dict]:
    """paged_decode's TB/s for each (BLOCK_N, stages) of SWEEP_TILES (tiles longer than a page included: the kernel
    looks up every key's page) and each multiple of decode_splits' count, next to fast_decode."""
    from flashcourse.engine.decode import decode_splits, fast_decode

    paged_decode = engine().paged_decode
    rows = []
    for batch, s in grid:
        caches, kv_bytes = _decode_caches(batch, s)
        base = decode_splits(batch, KV_HEADS, s, "cuda")
        row = dict(batch=batch, s=s, base_splits=base, configs={},
                   fast_decode=kv_bytes / _graph_ms([functools.partial(fast_decode, *c) for c in caches]) / 1e9)
        for page_size in page_sizes:
            paged = [paged_copy(*cache, page_size, seed=i) for i, cache in enumerate(caches)]
            for block_n, stages in SWEEP_TILES:
                launch = dict(BLOCK_N=block_n, num_warps=4, num_stages=stages)
                restore = _launch_as(paged_decode, "paged_launch", launch)
                try:
                    for factor in SWEEP_SPLIT_FACTORS:
                        calls = [functools.partial(paged_decode, *p, splits=base * factor) for p in paged]
                        row["configs"][f"page {page_size}, {block_n} keys s{stages}, {base * factor} splits"] = (
                            kv_bytes / _or_nan(_graph_ms, calls) / 1e9)
                finally:
                    restore()
            del paged
            torch.cuda.empty_cache()
        rows.append(row)
        for page_size in page_sizes:
            mine = {c: t for c, t in row["configs"].items() if c.startswith(f"page {page_size},")}
            best = max(mine, key=lambda c: mine[c] if mine[c] == mine[c] else -1)
            print(f"  sweep B={batch} S={s}: fast_decode {row['fast_decode']:.2f}; best {best} {mine[best]:.2f} TB/s",
                  flush=True)
        del caches
        torch.cuda.empty_cache()
    return rows


# --- report ----------------------------------------------------------------------------------------------------


def report(result: dict) -> str:
    """The measurements as markdown tables."""
    lines = report_opening(
        "# Packed variable-length attention and paged decode", result["environment"],
        "Every number from one process. Varlen: times by triton.testing.do_bench; TFLOP/s of useful work, the real "
        "tokens' FLOPs only (2 Hq L^2 D per causal sequence, 4 Hq L^2 D not causal), for every column, so padded "
        "SDPA pays for its padding. Decode: TB/s of K and V read, per call of a replayed CUDA graph that reads "
        "several copies of the cache in turn (more than the L2 holds); paged caches hold the same keys as the "
        "contiguous one, in shuffled pages. Errors: max |o - reference| over heads 0-1 (varlen: of the shortest "
        "and longest sequences; decode: batch 0), the reference in FP32.")
    v = result["varlen"]
    if v:
        lines += [f"## Varlen prefill: bf16, D = {D}, {len(v[0]['lengths'])} sequences, lengths "
                  f"{sorted(v[0]['lengths'])} ({v[0]['tokens']} tokens; padded: {v[0]['padded_tokens']})", "",
                  "| Hq/Hkv | causal | varlen_attention | padded SDPA cuDNN | padded SDPA flash | varlen / cuDNN | "
                  "varlen / flash | varlen ms | cuDNN ms | padded FLOPs / useful | varlen error | cuDNN error |",
                  "|---" * 12 + "|"]
        for r in v:
            lines.append(f"| {r['q_heads']}/{r['kv_heads']} | {'yes' if r['causal'] else 'no'} | "
                         f"{r['varlen_attention']:.1f} | {r['padded SDPA cuDNN']:.1f} | {r['padded SDPA flash']:.1f} | "
                         f"{r['varlen_attention'] / r['padded SDPA cuDNN']:.2f} | "
                         f"{r['varlen_attention'] / r['padded SDPA flash']:.2f} | {r['varlen_attention ms']:.3f} | "
                         f"{r['padded SDPA cuDNN ms']:.3f} | {r['padded_share']:.2f} | {r['varlen error']:.1e} | "
                         f"{r['cuDNN error']:.1e} |")
    if result["decode"]:
        pages = result["decode"][0]["page_sizes"]
        names = ["fast_decode", "SDPA cuDNN", "SDPA flash"] + [f"paged {p}" for p in pages]
        lines += ["", f"## Decode: bf16, Hq = {Q_HEADS}, Hkv = {KV_HEADS}, D = {D}, one query per sequence "
                  "(TB/s; paged N: paged_decode with pages of N keys, its default tiles and splits)", "",
                  "| B | S | paged splits | " + " | ".join(names) + " | "
                  + " | ".join(f"paged {p} / fast_decode" for p in pages) + " | fast_decode error | "
                  + " | ".join(f"paged {p} error" for p in pages) + " |",
                  "|---" * (3 + len(names) + 2 * len(pages) + 1) + "|"]
        for r in result["decode"]:
            lines.append(f"| {r['batch']} | {r['s']} | {r['splits']} | " + " | ".join(f"{r[n]:.2f}" for n in names)
                         + " | " + " | ".join(f"{r[f'paged {p} / fast_decode']:.2f}" for p in pages)
                         + f" | {r['fast_decode error']:.1e} | "
                         + " | ".join(f"{r[f'paged {p} error']:.1e}" for p in pages) + " |")
    for r in result.get("varlen_sweep", []):
        lines += ["", f"### varlen_attention's blocks, Hq/Hkv {r['q_heads']}/{r['kv_heads']}, "
                  f"{'causal' if r['causal'] else 'full'} (TFLOP/s, useful)", "",
                  "| BLOCK_M x BLOCK_N, warps, stages | TFLOP/s |", "|---|---|"]
        lines += [f"| {c} | {t:.1f} |" for c, t in r["configs"].items()]
    for r in result.get("decode_sweep", []):
        lines += ["", f"### paged_decode's tiles and splits, B = {r['batch']}, S = {r['s']} (TB/s; fast_decode "
                  f"{r['fast_decode']:.2f}; decode_splits: {r['base_splits']})", "",
                  "| page, tile, stages, splits | TB/s | / fast_decode |", "|---|---|---|"]
        lines += [f"| {c} | {t:.2f} | {t / r['fast_decode']:.2f} |" for c, t in r["configs"].items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = report_parser(__doc__)
    parser.add_argument("--sweep", action="store_true", help="also paged_decode's tiles and splits and "
                        "varlen_attention's blocks, one at a time")
    parser.add_argument("--only", choices=["varlen", "decode"], help="measure one half only")
    args = parser.parse_args(argv)
    if args.from_json:
        import json

        with open(args.from_json) as f:
            show_report(report(json.load(f)), args.out)
        return 0
    if not torch.cuda.is_available():
        print(GPU_NEEDED)
        return 1
    result = {"environment": environment(), "varlen": [], "decode": []}

    def save():
        save_json(result, args.json)
    if args.only != "decode":
        print("varlen", flush=True)
        varlen(rows=result["varlen"], done=save)
    if args.only != "varlen":
        print("decode", flush=True)
        decode(rows=result["decode"], done=save)
    if args.sweep:
        print("sweeps", flush=True)
        if args.only != "decode":
            result["varlen_sweep"] = varlen_sweep()
            save()
        if args.only != "varlen":
            result["decode_sweep"] = decode_sweep()
            save()
    show_report(report(result), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
