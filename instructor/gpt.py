"""The small GPT of flashcourse.gpt trained on the course's GPU, once with SDPA and once with the course's kernels.

    python -m instructor.gpt --json flashcourse/bench/measured/training.json --png flashcourse/bench/measured/training.png
    python -m instructor.gpt --seeds 3 --json flashcourse/bench/measured/training_seeds.json   # the gap beside the
                                                                                                # seeds' own spread
    python -m instructor.gpt --seeds 3 --course hopper_attention_train --json ...   # 08's Gluon kernels instead

`train_both` trains two copies from one seed, on the same batches, one with torch's
scaled_dot_product_attention and one with the course's attention (06's flash_attention_train unless told), and
returns both loss curves: any difference
between them comes from the attention alone. On a GPU it runs in bf16 (autocast); on a CPU a miniature runs in
float32, the kernels in Triton's interpreter.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import torch

from flashcourse.gpt import CPU_CONFIG, GPU_CONFIG, GPTConfig, corpus, sdpa_attention, train

def sdpa_efficient_attention(q, k, v):
    """The same attention through another of torch's kernels (memory-efficient attention, where it runs): a
    second correct implementation, whose curve shows how far rounding alone moves training."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return sdpa_attention(q, k, v)


def course_attention(name: str):
    """The course's attention that autograd differentiates: 06's flash_attention_train or 08's
    hopper_attention_train (its Gluon kernels on a Hopper GPU, 06's elsewhere)."""
    if name == "hopper_attention_train":
        from flashcourse.engine.hopper_backward import hopper_attention_train

        return hopper_attention_train
    from instructor.bench_backward import engine

    return engine().flash_attention_train


def train_both(steps: int | None = None, config: GPTConfig | None = None, batch: int | None = None,
               seed: int = 0, course: str = "flash_attention_train") -> dict:
    """Train the GPT twice from one seed, with SDPA and with the course's attention `course`: both loss curves.

    Defaults: on a GPU, GPU_CONFIG, batch 32, 400 steps, bf16; on a CPU, CPU_CONFIG, batch 2, 4 steps.
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = device == "cuda"
    config = config or (GPU_CONFIG if gpu else CPU_CONFIG)
    steps = steps or (400 if gpu else 4)
    batch = batch or (32 if gpu else 2)
    curves = {name: train(attention, steps, config, batch, seed=seed, device=device)
              for name, attention in (("sdpa", sdpa_attention), (course, course_attention(course)))}
    difference = [abs(a - b) for a, b in zip(curves["sdpa"], curves[course])]
    return {"device": torch.cuda.get_device_name() if gpu else "cpu", "dtype": "bf16" if gpu else "float32",
            "config": asdict(config), "batch": batch, "steps": steps, "seed": seed, "tokens": len(corpus()),
            "course": course, **curves, "max_difference": max(difference), "worst_step": difference.index(max(difference))}


def seed_spread(seeds: int, steps: int | None = None, after: float = 0.6, course: str = "flash_attention_train") -> dict:
    """How far apart the two curves are, beside how far apart one attention's curves are from seed to seed.

    Trains both attentions from `seeds` seeds (train_both). Over the last (1 - after) of the steps, where the
    curves have flattened, it reports the mean of flash - SDPA at each seed, and the spread of SDPA's own mean
    loss across seeds, and, as the floor that rounding alone sets, the same gap between two of torch's own
    kernels (SDPA's default and its memory-efficient attention) trained from the same seed."""
    runs = [train_both(steps, seed=seed, course=course) for seed in range(seeds)]
    first = int(after * runs[0]["steps"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = GPTConfig(**runs[0]["config"])
    for seed, run in enumerate(runs):
        run["sdpa_efficient"] = train(sdpa_efficient_attention, run["steps"], config, run["batch"], seed=seed,
                                      device=device)
    tail = lambda curve: sum(curve[first:]) / len(curve[first:])  # noqa: E731
    gaps = [tail(r[course]) - tail(r["sdpa"]) for r in runs]
    rounding = [tail(r["sdpa_efficient"]) - tail(r["sdpa"]) for r in runs]
    sdpa = [tail(r["sdpa"]) for r in runs]
    return {"device": runs[0]["device"], "dtype": runs[0]["dtype"], "config": runs[0]["config"],
            "batch": runs[0]["batch"], "steps": runs[0]["steps"], "from_step": first, "seeds": seeds,
            "gap_per_seed": gaps, "torch_kernels_gap_per_seed": rounding,
            "sdpa_mean_per_seed": sdpa, "sdpa_seed_range": max(sdpa) - min(sdpa),
            "course": course, "curves": [{k: r[k] for k in ("sdpa", course, "sdpa_efficient")} for r in runs]}


def plot(result: dict, path: str | None = None):
    """Both loss curves on one plot, the largest difference in the title."""
    import matplotlib

    if path:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(result["sdpa"], label="scaled_dot_product_attention")
    course = result.get("course", "flash_attention_train")   # runs saved before --course name no course
    ax.plot(result[course], "--", label=f"{course} (the course's kernels)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    c = result["config"]
    ax.set_title(f"GPT, {c['layers']} layers, width {c['width']}, Hq/Hkv {c['q_heads']}/{c['kv_heads']}, "
                 f"T {c['context']}, {result['dtype']} on {result['device']}\n"
                 f"largest difference between the curves: {result['max_difference']:.2e} "
                 f"(step {result['worst_step']})", fontsize=10)
    ax.legend()
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=100)
    return fig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int)
    parser.add_argument("--json", help="write both loss curves as JSON to this file")
    parser.add_argument("--png", help="write the plot to this file")
    parser.add_argument("--course", choices=["flash_attention_train", "hopper_attention_train"],
                        default="flash_attention_train", help="the course's attention to train beside SDPA")
    parser.add_argument("--seeds", type=int, help="train both from this many seeds and report the gap beside the "
                                                  "spread from seed to seed (seed_spread) instead")
    args = parser.parse_args(argv)
    if args.seeds:
        spread = seed_spread(args.seeds, args.steps, course=args.course)
        print(f"from step {spread['from_step']}: {args.course} - SDPA, mean loss per seed: "
              + ", ".join(f"{g:+.4f}" for g in spread["gap_per_seed"])
              + "; between two of torch's kernels: " + ", ".join(f"{g:+.4f}" for g in spread["torch_kernels_gap_per_seed"])
              + f"; SDPA's own mean loss ranges over {spread['sdpa_seed_range']:.4f} across the seeds")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(spread, f, indent=1)
        return 0
    result = train_both(args.steps, course=args.course)
    print(f"final loss: SDPA {result['sdpa'][-1]:.4f}, {args.course} {result[args.course][-1]:.4f}; "
          f"largest difference {result['max_difference']:.2e} at step {result['worst_step']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.png:
        plot(result, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
