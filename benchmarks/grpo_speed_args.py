"""The flags of benchmarks/grpo_speed.py, which every one of its tables reads, and the GRPO settings its launches
run with."""

import os
from dataclasses import dataclass, field
from typing import Literal

import tyro

from lm_human_preference_details.benchmarking import Device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Args:
    task: str = "tiny"
    """GRPO preset (lm_human_preference_details/grpo/config.py)"""
    steps: int = 200
    """optimizer steps per run (the sample budget is steps x batch size)"""
    sync_steps: list[int] = field(default_factory=lambda: [4, 8])
    """the G of each sync schedule compared"""
    repeats: int = 2
    """runs per schedule; the table shows medians"""
    per_tensor_row: bool = True
    """when the preset sends its updates in buckets, also run the pipeline with one broadcast per tensor"""
    pipeline_steps_ahead: list[float] = field(default_factory=lambda: [2, 2.5, 6])
    """also run the pipeline at these `--steps-ahead` (the run's own, the preset's or one after `--`, is the
    `pipeline` row): how far the actor runs ahead sets the pipeline's lag, so that each sync schedule is
    compared with the fastest pipeline that is at least as on-policy (the table at matched lag). A fraction
    runs with requests small enough for it (`--problems-per-request`), named in the row"""
    one_thread_row: bool = True
    """also run the first sync schedule with one torch thread per process (the default before a2ae5e3,
    which leaves a core idle in each of its phases): what sync mode's threads are worth"""
    out_dir: str = "runs/grpo_speed"
    """runs, results.json and results.md go here"""
    extra: tyro.conf.Suppress[list[str]] = field(default_factory=list)
    """the flags after `--`, passed to every launch unchanged (e.g. `-- --max-tokens 24 --ignore-eos`)"""
    trl_python: str | None = None
    """python of an environment with trl==1.16.0 (`bash benchmarks/trl_env.sh .venv-trl116 1.16.0` makes one):
    adds a row for TRL's GRPOTrainer (no vLLM) on the same model, problems, batch, group size and completion
    limit; None: no TRL row"""
    scaling: bool = False
    """also time seconds per optimizer step of `pipeline` and `sync` (the first G) at each batch size
    and completion length below (`--ignore-eos`: every completion that long)"""
    scaling_batches: list[int] = field(default_factory=lambda: [16, 64, 256])
    """`--scaling`: batch sizes (samples per optimizer step)"""
    scaling_tokens: list[int] = field(default_factory=lambda: [24, 96])
    """`--scaling`: completion lengths"""
    scaling_steps: int = 32
    """optimizer steps per scaling run (the first fifth, rounded up to whole sync rounds, are not timed)"""
    device: Device = "cpu"
    """where every process runs: `cuda` puts the servers (bf16), the trainer, the raw row and TRL on the
    GPU; `cpu`, the default, hides any GPU from them"""
    raw_row: bool = True
    """also time the raw compute of a step (`raw_step_times`: sampling, scoring, forward, backward and
    optimizer step in one process, nothing else) as a row"""
    engines: list[Literal["home", "vllm"]] = field(default_factory=lambda: ["home"])
    """the inference engines compared (`grpo.launch --engine`): `vllm` adds a pipeline row and a sync row (the first
    G) on vLLM's servers and, in the generation table, vLLM's server and its offline limit"""
    generation_tasks: list[str] = field(default_factory=list)
    """presets whose model and prompts the generation table serves (e.g. `tiny arith`: arith's model is
    SmolLM2-135M-Instruct); empty: no generation table"""
    generation_tokens: int = 24
    """generation table: tokens of each completion (sampled past EOS)"""
    generation_requests: int = 8
    """generation table: completion requests timed per row, after one untimed request"""
    generation_in_flight: int = 0
    """generation table: requests in flight at a time; 0: the preset's `max_in_flight`, as the actor keeps them (fewer
    than fill the server's batch would time the client's feeding, not the server)"""
    role: str = "main"
    """internal: `raw` or `trl` runs that row in this process and writes --result"""
    result: str = ""
    """internal: where a role writes its seconds per step"""


def run_settings(args: Args):
    """The GRPOArgs every launch of this benchmark runs with (the preset and the flags after `--`)."""
    from lm_human_preference_details import cli
    from lm_human_preference_details.grpo.config import GRPOArgs, get_preset

    return cli.parse(GRPOArgs, get_preset, args.task, argv=["--task", args.task, *args.extra])
