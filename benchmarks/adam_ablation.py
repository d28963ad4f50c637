"""TF-style Adam against torch Adam in the first PPO updates, side by side (the ablation of the
N-implementation-details post: TF1's Adam adds epsilon outside the bias correction, torch inside it,
and with OAI's eps=1e-5 torch's early steps are larger).

    python benchmarks/adam_ablation.py --task tiny --seeds 1 2 3 --updates 5 --out-dir benchmarks/results/adam_ablation

Trains one reward model (stage 1), then for each seed runs stage 2 twice on it, `--ppo.optimizer
adam_tf` and `adam_torch`, for `--updates` PPO updates: same seed, same reward model, same first
rollout, so the first update differs only by the optimizer. Prints, per optimizer, the mean over
seeds of the first update's `ppo/policy/approxkl`, `clipfrac` and the ratio / logprob-difference
statistics, the same over the first `--updates` updates, and the ratio torch / TF. Writes
`results.md` and `results.json` to `--out-dir`. Flags after `--` go to every stage-2 run.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field

import tyro

from lm_human_preference_details.cli import split_passthrough

OPTIMIZERS = ("adam_tf", "adam_torch")
METRICS = (
    "ppo/policy/approxkl",
    "ppo/policy/clipfrac",
    "ppo/policy/ratio_mean",
    "ppo/policy/ratio_var",
    "ppo/policy/ratio_max",
    "ppo/policy/ratio_min",
    "ppo/policy/logprob_diff_mean",
    "ppo/policy/logprob_diff_var",
    "ppo/policy/logprob_diff_max",
    "ppo/policy/logprob_diff_min",
)


@dataclass
class Args:
    task: str = "tiny"
    """preset of tasks.py"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """one pair of runs (TF-style and torch Adam) per seed"""
    updates: int = 5
    """PPO updates per run (the ablation is about the first ones)"""
    out_dir: str = "runs/adam_ablation"
    """the runs, results.json and results.md go here"""
    extra: tyro.conf.Suppress[list[str]] = field(default_factory=list)
    """the flags after `--`, passed to every stage-2 run unchanged (e.g. `-- --ppo.lr 1e-4`)"""


def stage(module: str, *flags: str) -> None:
    cmd = [sys.executable, "-m", f"lm_human_preference_details.{module}", "--wandb-mode", "disabled", *flags]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def run_pair(args: Args, seed: int, reward_model: str, batch_size: int) -> dict[str, list[dict]]:
    from lm_human_preference_details.tracking import read_metrics

    runs = {}
    for optimizer in OPTIMIZERS:
        out = os.path.join(args.out_dir, f"{optimizer}_seed_{seed}")
        shutil.rmtree(out, ignore_errors=True)  # a fresh run: a stage refuses to log over an earlier one
        stage(
            "train_policy",
            "--task",
            args.task,
            "--seed",
            str(seed),
            "--output-dir",
            out,
            "--rewards.trained-model",
            reward_model,
            "--ppo.optimizer",
            optimizer,
            "--ppo.total-episodes",
            str(args.updates * batch_size),
            *args.extra,
        )
        runs[optimizer] = read_metrics(os.path.join(out, "metrics.jsonl"))
    return runs


def summarize(runs: dict[int, dict[str, list[dict]]], updates: int) -> dict[str, dict[str, dict[str, float]]]:
    """window ("first update", "first N updates") -> optimizer -> metric -> mean over seeds."""
    windows = {"first update": 1, f"first {updates} updates": updates}
    return {
        window: {
            optimizer: {
                m: statistics.fmean(statistics.fmean(r[m] for r in pair[optimizer][:n]) for pair in runs.values())
                for m in METRICS
            }
            for optimizer in OPTIMIZERS
        }
        for window, n in windows.items()
    }


def markdown(args: Args, summary: dict) -> str:
    lines = [
        f"TF-style vs torch Adam, `{args.task}` preset, stage 2 on one reward model, "
        f"seeds {' '.join(map(str, args.seeds))} (mean over seeds).",
        "",
    ]
    for window, by_optimizer in summary.items():
        lines += [f"**{window}**", "", "| metric | adam_tf (OAI) | adam_torch | torch / tf |", "|---|---|---|---|"]
        for m in METRICS:
            tf, torch_ = by_optimizer["adam_tf"][m], by_optimizer["adam_torch"][m]
            ratio = f"{torch_ / tf:.2f}x" if tf else "-"
            lines.append(f"| {m.removeprefix('ppo/policy/')} | {tf:.6g} | {torch_:.6g} | {ratio} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    own_flags, stage_flags = split_passthrough(argv)
    args = tyro.cli(Args, args=own_flags)
    args.extra = stage_flags
    from lm_human_preference_details.train_policy import defaults_for_task

    os.makedirs(args.out_dir, exist_ok=True)
    batch_size = defaults_for_task(args.task).ppo.batch_size
    reward_dir = os.path.join(args.out_dir, "reward")
    reward_model = os.path.join(reward_dir, "reward_model")
    if not os.path.isdir(reward_model):
        stage("train_reward", "--task", args.task, "--seed", str(args.seeds[0]), "--output-dir", reward_dir)
    runs = {seed: run_pair(args, seed, reward_model, batch_size) for seed in args.seeds}
    summary = summarize(runs, args.updates)
    table = markdown(args, summary)
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump({"args": vars(args), "summary": summary, "runs": {str(s): r for s, r in runs.items()}}, f, indent=2)
    with open(os.path.join(args.out_dir, "results.md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
