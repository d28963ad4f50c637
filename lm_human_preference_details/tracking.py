"""Metrics to `<output_dir>/metrics.jsonl` (one JSON object per logged step) and to wandb.

wandb runs online when WANDB_API_KEY is set and offline otherwise (`wandb sync` uploads later),
so curves can be laid over OAI's baseline runs under the same metric names.
Only the main process logs; the others get a Tracker that does nothing. No logged line is lost: a new run refuses
a folder whose logs hold an earlier run's steps, a resumed run appends, after moving what the killed run logged past
its checkpoint to a file of its own (`_open_log`).
"""

import dataclasses
import itertools
import json
import math
import os
import uuid
from dataclasses import dataclass
from typing import Literal

import tyro

from .cli import UserError

WandbMode = Literal["auto", "online", "offline", "disabled"]
MixedPrecision = Literal["no", "bf16", "fp16"]

OWN_AXES = {"eval/": "eval/step"}
"""metrics drawn over a step of their own (name prefix: the metric that holds it): GRPO's evaluations are logged
when they arrive, a few steps after the step whose weights they measure"""


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
    mixed_precision: MixedPrecision = "no"
    """`no`: float32 throughout, OAI's numerics (every preset's default); `bf16` (or `fp16`, on a GPU): the models'
    matmuls under accelerate's autocast, while the quantities OAI computes in float32 (logprobs, values, rewards,
    advantages, KL, the losses) and the parameters and optimizer state stay float32; recorded in args.json and the
    checkpoint, which a resume must match"""

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
            resumable=hasattr(args, "resume"),
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
        resumable: bool = False,
    ):
        """`resume_after_step`: continue the run's logs, setting aside what was logged after that step (a run killed
        after its last checkpoint logged steps that the resumed run logs again). A new run (None) refuses an
        `output_dir` whose logs hold an earlier run's steps, naming `--resume` if the stage has it (`resumable`)."""
        self.enabled = enabled
        self.wandb = None
        if not enabled:
            return
        if resume_after_step is None:
            refuse_to_overwrite(output_dir, resumable)
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
            for prefix, axis in OWN_AXES.items():
                self.wandb.define_metric(axis)
                self.wandb.define_metric(f"{prefix}*", step_metric=axis)

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


LOGS = ("metrics.jsonl", "samples.jsonl")
"""a run's JSON-lines logs, one record per line, each with its step"""


def earlier_logs(output_dir: str) -> list[str]:
    """The logs (`LOGS`) in `output_dir` that hold anything: an earlier run's, which a new run must not overwrite."""
    paths = [os.path.join(output_dir, name) for name in LOGS]
    return [path for path in paths if os.path.exists(path) and os.path.getsize(path) > 0]


def refuse_to_overwrite(output_dir: str, resumable: bool) -> None:
    """UserError when a new run in `output_dir` would overwrite an earlier run's logs (`earlier_logs`), naming
    `--resume` if the stage has it (`resumable`)."""
    if logs := earlier_logs(output_dir):
        way_out = "continue that run with --resume, or start" if resumable else "start"
        raise UserError(
            f"{output_dir} holds an earlier run's logs ({', '.join(logs)}), which a new run would overwrite: "
            f"{way_out} this one in another --output-dir (or move those files away)"
        )


def _open_log(path: str, resume_after_step: int | None):
    """A JSON-lines log opened for appending. Resuming after a step, the lines after it (logged by the killed run
    past its checkpoint, the last maybe cut short) are first moved, as they were, to a file of their own named
    after that step, and the log's earlier lines replace it whole (written beside it, then renamed)."""
    if resume_after_step is None or not os.path.exists(path):
        return open(path, "a")
    with open(path) as f:
        lines = f.readlines()
    kept = 0
    while kept < len(lines) and lines[kept].endswith("\n") and _step_of(lines[kept]) <= resume_after_step:
        kept += 1
    if kept < len(lines):
        aside = _free_name(f"{path.removesuffix('.jsonl')}.after-step-{resume_after_step}", ".jsonl")
        with open(aside, "x") as f:
            f.writelines(lines[kept:])
            _flush(f)
        with open(path + ".tmp", "w") as f:
            f.writelines(lines[:kept])
            _flush(f)
        os.replace(path + ".tmp", path)
        print(
            f"--resume: {path}: the {len(lines) - kept} lines logged after step {resume_after_step}, the checkpoint's "
            f"(this run logs those steps again), are moved to {aside}",
            flush=True,
        )
    return open(path, "a")


def _step_of(line: str) -> float:
    """A log line's step; a blank line counts as before every step (it stays where it is)."""
    return json.loads(line)["step"] if line.strip() else -math.inf


def _free_name(stem: str, suffix: str) -> str:
    """`stem + suffix`, or with -2, -3, ... after the stem: the first that names no file (a run killed twice
    after one checkpoint sets lines aside twice)."""
    candidates = (f"{stem}{'' if n == 1 else f'-{n}'}{suffix}" for n in itertools.count(1))
    return next(path for path in candidates if not os.path.exists(path))


def _flush(f) -> None:
    """A file's data to the disk before a rename relies on it (a power cut could keep the rename, not the data)."""
    f.flush()
    os.fsync(f.fileno())


def read_metrics(path: str) -> list[dict]:
    """Every complete line of a metrics.jsonl (of a live run too: a line still being written has no newline yet)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


def metric_step(record: dict, name: str) -> int:
    """The step metric `name` of a logged line is drawn at: the line's, or its own (`OWN_AXES`; logged as a float)."""
    axis = next((axis for prefix, axis in OWN_AXES.items() if name.startswith(prefix)), "step")
    return int(record[axis])


def plot_curves(
    metrics_path: str,
    panels: dict[str, list[str]],
    png_path: str,
    title: str,
) -> None:
    """One panel per entry of `panels` (panel title -> metric names), x axis = step (`metric_step`: the evaluations'
    own, drawn as large markers); saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False, layout="constrained")
    for ax, (panel, names) in zip(axes[0], panels.items()):
        for name in names:
            series = [(metric_step(r, name), r[name]) for r in records if name in r]
            if series:
                own_axis = any(name.startswith(prefix) for prefix in OWN_AXES)
                ax.plot(*zip(*series), marker="o" if own_axis else ".", label=name)
        ax.set_title(panel)
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
