"""Learning curves over seeds: run a stage for each seed, then mean ± std bands per metric.

    python benchmarks/learning_curves.py --task tiny --seeds 1 2 3 --out-dir benchmarks/results/tiny
    python benchmarks/learning_curves.py --task tiny --seeds 1 2 3 --out-dir runs/curves -- --ppo.optimizer adam_torch
    python benchmarks/learning_curves.py --stage grpo.launch --task tiny --seeds 1 2 3 --out-dir runs/grpo-curves \
        -- --mode sync

Flags after `--` go to the stage script unchanged. Writes `<out-dir>/seed_<s>/` (each run),
`<out-dir>/curves.csv` in the long format (step, metric, value, seed, source) and one PNG per metric.
`--baseline CSV` overlays reference curves in the same long format (e.g. OAI's runs exported from wandb).
"""

import csv
import os
import shutil
import subprocess
import sys
import textwrap
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

import tyro

from lm_human_preference_details.cli import split_passthrough

DEFAULT_METRICS = (
    "objective/scores",
    "objective/kl",
    "objective/kl_coef",
    "objective/labeler_score",
    "ppo/policy/clipfrac",
    "ppo/policy/approxkl",
)
GRPO_METRICS = ("reward/mean", "success/rate", "eval/pass@1", "lag/mean", "entropy", "ess", "samples_per_s")


@dataclass
class Args:
    task: str = "tiny"
    """preset of tasks.py"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """one run per seed"""
    stage: Literal["train_policy", "train_reward", "grpo.launch"] = "train_policy"
    """the stage script to run"""
    metrics: list[str] = field(default_factory=list)
    """metrics to plot (those a run does not log are skipped; default: the stage's main ones)"""
    out_dir: str = "runs/curves"
    """where the runs, curves.csv and the PNGs go"""
    baseline: str | None = None
    """a long-format CSV (step, metric, value, seed[, source]) to overlay"""
    reuse: bool = False
    """keep a seed's finished run (its metrics.jsonl) instead of running it again"""


def run_seed(args: Args, seed: int, stage_flags: list[str]) -> str:
    out = os.path.join(args.out_dir, f"seed_{seed}")
    metrics = os.path.join(out, "metrics.jsonl")
    if args.reuse and os.path.exists(metrics):
        return metrics
    shutil.rmtree(out, ignore_errors=True)  # a fresh run: a stage refuses to log over an earlier one
    cmd = [
        sys.executable,
        "-m",
        f"lm_human_preference_details.{args.stage}",
        "--task",
        args.task,
        "--seed",
        str(seed),
        "--output-dir",
        out,
        "--wandb-mode",
        "disabled",
        *stage_flags,
    ]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return metrics


def long_rows(metrics_path: str, seed: int, names: list[str], source: str) -> list[dict]:
    from lm_human_preference_details.tracking import metric_step, read_metrics

    return [
        {"step": metric_step(r, name), "metric": name, "value": r[name], "seed": seed, "source": source}
        for r in read_metrics(metrics_path)
        for name in names
        if name in r
    ]


def read_long_csv(path: str, default_source: str) -> list[dict]:
    with open(path) as f:
        return [
            {
                "step": int(r["step"]),
                "metric": r["metric"],
                "value": float(r["value"]),
                "seed": r["seed"],
                "source": r.get("source") or default_source,
            }
            for r in csv.DictReader(f)
        ]


def mean_std_by_step(rows: list[dict]) -> tuple[list[int], list[float], list[float]]:
    by_step = defaultdict(list)
    for r in rows:
        by_step[r["step"]].append(r["value"])
    steps = sorted(by_step)
    means = [sum(by_step[s]) / len(by_step[s]) for s in steps]
    stds = [(sum((v - m) ** 2 for v in by_step[s]) / len(by_step[s])) ** 0.5 for s, m in zip(steps, means)]
    return steps, means, stds


def plot(rows: list[dict], metric: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6), layout="constrained")
    for source in sorted({r["source"] for r in rows}):
        steps, means, stds = mean_std_by_step([r for r in rows if r["source"] == source])
        seeds = len({r["seed"] for r in rows if r["source"] == source})
        ax.plot(
            steps, means, label=textwrap.fill(f"{source} ({seeds} seeds)", 60)
        )  # long flags would squeeze the axes away
        ax.fill_between(steps, [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)], alpha=0.25)
    ax.set_title(metric)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    own_flags, stage_flags = split_passthrough(argv)
    args = tyro.cli(Args, args=own_flags)
    args.metrics = args.metrics or list(GRPO_METRICS if args.stage == "grpo.launch" else DEFAULT_METRICS)
    os.makedirs(args.out_dir, exist_ok=True)
    source = f"{args.task} {' '.join(stage_flags)}".strip()
    rows = [
        row for seed in args.seeds for row in long_rows(run_seed(args, seed, stage_flags), seed, args.metrics, source)
    ]
    with open(os.path.join(args.out_dir, "curves.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "metric", "value", "seed", "source"])
        writer.writeheader()
        writer.writerows(rows)
    if args.baseline:
        rows += read_long_csv(args.baseline, default_source="baseline")
    for metric in args.metrics:
        metric_rows = [r for r in rows if r["metric"] == metric]
        if metric_rows:
            png = os.path.join(args.out_dir, metric.replace("/", "_") + ".png")
            plot(metric_rows, metric, png)
            print(f"{metric}: {png}")


if __name__ == "__main__":
    main()
