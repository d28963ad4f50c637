"""Metrics to `<output_dir>/metrics.jsonl` (one JSON object per logged step) and to wandb.

wandb runs online when WANDB_API_KEY is set and offline otherwise (`wandb sync` uploads later),
so curves can be laid over OAI's baseline runs under the same metric names.
Only the main process logs; the others get a Tracker that does nothing.
"""

import dataclasses
import json
import os
import sys
import uuid
from dataclasses import dataclass
from typing import Literal

import tyro

WandbMode = Literal["auto", "online", "offline", "disabled"]


@dataclass
class RunArgs:
    """The fields every stage script shares; each script's Args extends it."""

    preset: tyro.conf.Suppress[str] = "sentiment"
    seed: int = 1
    """process r uses seed + r * 100003"""
    wandb_mode: WandbMode = "auto"
    """`auto`: online with WANDB_API_KEY, else offline; `disabled`: metrics.jsonl only"""
    wandb_project: str = "lm-human-preference-details"
    """wandb project"""
    run_name: str | None = None
    """wandb run name (None: <stage>_<preset>_<seed>)"""

    def run_name_for(self, stage: str) -> str:
        return self.run_name or f"{stage}_{self.preset}_{self.seed}"


class Tracker:
    @classmethod
    def for_run(cls, args: RunArgs, stage: str, accelerator=None, resume_after_step: int | None = None) -> "Tracker":
        """The run's tracker; under accelerate (`accelerator`) only the main process writes."""
        return cls(
            args.output_dir,
            args,
            enabled=accelerator is None or accelerator.is_main_process,
            wandb_mode=args.wandb_mode,
            project=args.wandb_project,
            run_name=args.run_name_for(stage),
            resume_after_step=resume_after_step,
        )

    def __init__(
        self,
        output_dir: str,
        config,
        *,
        enabled: bool,
        wandb_mode: WandbMode,
        project: str,
        run_name: str,
        resume_after_step: int | None = None,
    ):
        """`resume_after_step`: continue the run's files, dropping what was logged after that step
        (a run killed after its last checkpoint logged steps that the resumed run logs again)."""
        self.enabled = enabled
        self.wandb = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        config_dict = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
        with open(os.path.join(output_dir, "args.json"), "w") as f:
            json.dump(config_dict, f, indent=2)
        self.metrics_file = _open_log(os.path.join(output_dir, "metrics.jsonl"), resume_after_step)
        self.samples_file = _open_log(os.path.join(output_dir, "samples.jsonl"), resume_after_step)
        if wandb_mode == "auto":
            wandb_mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        if wandb_mode != "disabled":
            import wandb

            # a run id of its own, kept beside the checkpoint: the resumed run continues it, and a new run (another
            # output dir, or this one without --resume) gets a new one, whatever its name (runs of one preset and
            # seed share a name: with one id, the second would log into the first, whose later steps drop its own)
            id_path = os.path.join(output_dir, "wandb_run_id")
            if resume_after_step is not None and os.path.exists(id_path):
                with open(id_path) as f:
                    run_id = f.read().strip()
            else:
                run_id = uuid.uuid4().hex
                with open(id_path, "w") as f:
                    f.write(run_id + "\n")
            self.wandb = wandb.init(
                project=project,
                name=run_name,
                config=config_dict,
                mode=wandb_mode,
                dir=output_dir,
                id=run_id,
                resume="allow" if resume_after_step is not None else None,
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
            self.wandb.log(
                {"samples": wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])}, step=step
            )

    def finish(self) -> None:
        if not self.enabled:
            return
        self.metrics_file.close()
        self.samples_file.close()
        if self.wandb is not None:
            self.wandb.finish()


def progress_bar(total: int, desc: str, unit: str, *, enabled: bool = True, initial: int = 0):
    """A tqdm bar on stderr for a long phase (labels made, reward-model batches, PPO updates), as the Hugging
    Face libraries show one: only where `enabled` (the main process) and only while stderr is a terminal
    (tqdm's `disable=None`), so logs and tests get the phase's own lines and no redraws. Lines printed while it
    runs go through its `write`, which puts them above the bar (a plain print would break the bar's line)."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        disable=None if enabled else True,
        dynamic_ncols=True,
    )


def _open_log(path: str, keep_up_to_step: int | None):
    """A JSON-lines log opened for appending, keeping only records with step <= keep_up_to_step (None: a new log)."""
    if keep_up_to_step is None or not os.path.exists(path):
        return open(path, "w")
    kept = [r for r in read_metrics(path) if r["step"] <= keep_up_to_step]
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(path + ".tmp", path)
    return open(path, "a")


def read_metrics(path: str) -> list[dict]:
    """Every complete line of a metrics.jsonl (of a live run too: a line still being written has no newline yet)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


def plot_curves(metrics_path: str, panels: dict[str, list[str]], png_path: str, title: str) -> None:
    """One panel per entry of `panels` (panel title -> metric names), x axis = step; saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False, layout="constrained")
    for ax, (panel, names) in zip(axes[0], panels.items()):
        for name in names:
            points = [(r["step"], r[name]) for r in records if name in r]
            if points:
                ax.plot(*zip(*points), marker=".", label=name)
        ax.set_title(panel)
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
