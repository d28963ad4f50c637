"""Metrics to `<output_dir>/metrics.jsonl` (one JSON object per logged step) and to wandb.

wandb runs online when WANDB_API_KEY is set and offline otherwise (`wandb sync` uploads later),
so curves can be laid over OAI's baseline runs under the same metric names.
Only the main process logs; the others get a Tracker that does nothing.
"""

import dataclasses
import json
import os
from typing import Literal

WandbMode = Literal["auto", "online", "offline", "disabled"]


class Tracker:
    def __init__(self, output_dir: str, config, *, enabled: bool, wandb_mode: WandbMode, project: str, run_name: str, resume: bool = False):
        self.enabled = enabled
        self.wandb = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        config_dict = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
        with open(os.path.join(output_dir, "args.json"), "w") as f:
            json.dump(config_dict, f, indent=2)
        self.metrics_file = open(os.path.join(output_dir, "metrics.jsonl"), "a" if resume else "w")
        self.samples_file = open(os.path.join(output_dir, "samples.jsonl"), "a" if resume else "w")
        if wandb_mode == "auto":
            wandb_mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        if wandb_mode != "disabled":
            import wandb

            self.wandb = wandb.init(
                project=project, name=run_name, config=config_dict, mode=wandb_mode, dir=output_dir,
                id=run_name.replace("/", "_"), resume="allow",
            )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        metrics = {k: float(v) for k, v in metrics.items()}
        self.metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.metrics_file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """A table of samples (query, response, score, ...): `samples.jsonl` and a wandb Table."""
        if not self.enabled:
            return
        for row in rows:
            self.samples_file.write(json.dumps({"step": step, **row}) + "\n")
        self.samples_file.flush()
        if self.wandb is not None and rows:
            import wandb

            columns = list(rows[0])
            self.wandb.log({"samples": wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])}, step=step)

    def finish(self) -> None:
        if not self.enabled:
            return
        self.metrics_file.close()
        self.samples_file.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
