"""OpenAI's own lm-human-preferences runs, exported to the long CSV that learning_curves.py overlays.

    python benchmarks/oai_baseline.py --task sentiment --out benchmarks/results/oai-sentiment.csv
    python benchmarks/learning_curves.py --task sentiment --seeds 1 2 3 --out-dir runs/curves-sentiment \\
        --baseline benchmarks/results/oai-sentiment.csv

Needs the internet and a wandb login (the project is public): the runs are in the wandb project
`openrlbenchmark/lm-human-preferences`, one per seed, `task_id` = sentiment or descriptiveness, the
124M (GPT-2 small) ones marked by `task.policy.initial_model` = 124M. OAI's metric names carry an
extra `ppo/` prefix and call the score `score`: `ppo/objective/score` is our `objective/scores`,
`ppo/ppo/policy/approxkl` our `ppo/policy/approxkl` (`oai_metric_name`). The x axis is wandb's
`_step`, one per PPO update as ours. docs/baselines.md shows the openrlbenchmark way too.
"""

import csv
from dataclasses import dataclass, field

import tyro

ENTITY_PROJECT = "openrlbenchmark/lm-human-preferences"
METRICS = (
    "objective/scores",
    "objective/kl",
    "objective/entropy",
    "objective/score_total",
    "objective/kl_coef",
    "ppo/policy/approxkl",
    "ppo/policy/clipfrac",
    "ppo/policy/entropy",
    "ppo/loss/policy",
    "ppo/loss/value",
    "ppo/loss/total",
    "ppo/val/clipfrac",
    "ppo/val/error",
    "ppo/val/mean",
    "ppo/val/vpred",
    "ppo/returns/mean",
    "ppo/returns/var",
)


@dataclass
class Args:
    task: str = "sentiment"
    """OAI's task_id: sentiment or descriptiveness"""
    initial_model: str = "124M"
    """OAI's policy size (task.policy.initial_model)"""
    metrics: list[str] = field(default_factory=lambda: list(METRICS))
    """our metric names to export"""
    out: str = "oai-baseline.csv"
    """the long-format CSV (step, metric, value, seed, source) to write"""


def oai_metric_name(ours: str) -> str:
    """The name OAI's runs log our metric under."""
    return "ppo/" + ("objective/score" if ours == "objective/scores" else ours)


def config_value(config: dict, dotted: str):
    """`task.policy.initial_model` from a run's config, whether or not wandb wrapped levels in `{"value": ...}`."""
    node = config
    for key in dotted.split("."):
        if isinstance(node, dict) and key not in node and "value" in node:
            node = node["value"]
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node["value"] if isinstance(node, dict) and set(node) == {"value"} else node


def export(api, args: Args) -> list[dict]:
    """Rows of the long CSV from every matching run of `api` (a `wandb.Api()`)."""
    rows = []
    names = {oai_metric_name(m): m for m in args.metrics}
    for run in api.runs(ENTITY_PROJECT):
        if (
            config_value(run.config, "task_id") != args.task
            or str(config_value(run.config, "task.policy.initial_model")) != args.initial_model
        ):
            continue
        for record in run.scan_history(keys=["_step", *names]):
            for oai_name, ours in names.items():
                if record.get(oai_name) is not None:
                    rows.append(
                        {
                            "step": int(record["_step"]),
                            "metric": ours,
                            "value": float(record[oai_name]),
                            "seed": run.name,
                            "source": f"OAI lm-human-preferences ({args.initial_model})",
                        }
                    )
    if not rows:
        raise SystemExit(f"no run of {ENTITY_PROJECT} has task_id={args.task} and initial_model={args.initial_model}")
    return rows


def main(argv: list[str] | None = None, api=None) -> None:
    args = tyro.cli(Args, args=argv)
    if api is None:
        import wandb

        api = wandb.Api()
    rows = export(api, args)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "metric", "value", "seed", "source"])
        writer.writeheader()
        writer.writerows(rows)
    print(f"{len(rows)} values from {len({r['seed'] for r in rows})} runs -> {args.out}")


if __name__ == "__main__":
    main()
