"""Pipelined vs synchronous GRPO, side by side in one run: same model, task and sample budget.

    python benchmarks/grpo_speed.py --task tiny --steps 200 --repeats 2 --out-dir benchmarks/results/grpo_speed
    python benchmarks/grpo_speed.py ... -- --max-tokens 24 --ignore-eos    # flags after `--` go to every launch

Runs `grpo.launch` in `pipeline` mode and in `sync` mode for each G of `--sync-steps`, `--repeats`
times in interleaved order (so that a slow spell of the machine hits every schedule alike), and
prints per schedule the median samples/s, tokens/s, tokens per sample, mean lag, the machine's cores
busy and CPU time per sample over the steady state (`SteadyCpu`), and the ratio pipeline / sync.
When the preset sends its weight updates in buckets (`--update-bucket-mb`), the pipeline also runs
with one broadcast per tensor (PipelineRL's way), as a row of its own. The pipeline also runs at the
`--steps-ahead` of `--pipeline-steps-ahead` (how far the actor may run ahead of the trainer sets its
lag), and a second table compares each sync schedule with the fastest pipeline row whose mean lag
(steps after the first fifth) is no larger: the speed-up at the same on-policyness or better.
The weight update itself is benchmarks/weight_sync.py's.
With `--engines home vllm`, vLLM's servers (`grpo.launch --engine vllm`) join: a `pipeline, vLLM` row and a
`sync G=<first>, vLLM` row (the home rows then pass `--engine home`: on a GPU `auto` would pick vLLM).

`--generation-tasks tiny arith` adds a table of generation alone, per preset and engine: one server with every core
(the preset's model and server batch) gets `--generation-requests` completion requests shaped as the actor's (the
preset's prompts, `request_problems()` of them per request, n = group size, `--generation-tokens` tokens each past
EOS, the preset's temperature), `--generation-in-flight` at a time over HTTP, after one untimed request: samples/s
and tokens/s. With vLLM compared, a limit row: vLLM's offline `LLM.generate` of the same prompts, all at once
(benchmarks/vllm_generate.py, its engine built from the server's own engine arguments, environment and sampling),
and each row's limit / this: what the HTTP server, its request handling and the client's feeding cost.

Throughput is samples trained / trainer wall time from its first wait for data to its last step.
A row `raw compute (one process)` times what a step must compute, alone: sampling the step's
completions (a prefill, then one cached forward per token for the whole batch), scoring them, one
forward and backward with the run's loss, one optimizer step (`raw_step_times`). With `--trl-python`
(an environment with trl==1.16.0) a row for TRL's GRPOTrainer (no vLLM) at the same settings joins
the table. For both, samples/s = batch size / median seconds per optimizer step.
Threads: every schedule runs with the launcher's default (`--threads 0`: in `pipeline` mode the servers
and the trainer share the cores; in `sync` mode they take turns, so the trainer gets every core and the
servers share them); the raw and TRL rows, one process each, use torch's default (every core).
`--device cuda` runs every process on the GPU (benchmarks/gpu.sh); `cpu`, the default, hides any GPU.
"""

import dataclasses
import json
import os
import sys

import tyro
from grpo_speed_args import Args
from grpo_speed_compute import ROLES
from grpo_speed_generation import generation_table, time_generation, time_generation_limit
from grpo_speed_schedules import ROLE_ROWS, run_role, run_schedule, scaling, scaling_table, schedules, schedules_table

from lm_human_preference_details.benchmarking import git_commit
from lm_human_preference_details.cli import main_with_user_errors, split_passthrough


def markdown(args: Args, runs: dict[str, list[dict]], scaled: list[dict], generation: list[dict] = ()) -> str:
    """results.md: the schedules table (and the one at matched lag), then those of `--scaling` and generation
    alone, each where it has rows."""
    lines = schedules_table(args, runs) + scaling_table(args, scaled)
    return "\n".join(lines + generation_table(generation)) + "\n"


def main(argv: list[str] | None = None) -> None:
    own_flags, launch_flags = split_passthrough(argv)
    args = tyro.cli(Args, args=own_flags)
    args.extra = launch_flags
    if args.role != "main":
        with open(args.result, "w") as f:
            json.dump(ROLES[args.role](args), f)
        return
    os.makedirs(args.out_dir, exist_ok=True)
    roles = {"raw": sys.executable} if args.raw_row else {}
    if args.trl_python:
        roles["trl"] = args.trl_python
    runs: dict[str, list[dict]] = {name: [] for name, _ in schedules(args)} | {ROLE_ROWS[role]: [] for role in roles}
    scaled: list[dict] = []
    generation: list[dict] = []
    for repeat in range(args.repeats):
        for name, flags in schedules(args):
            runs[name].append(run_schedule(args, name, flags, repeat))
            save(args, runs, scaled, generation)
        for role, python in roles.items():
            runs[ROLE_ROWS[role]].append(run_role(args, role, python, repeat))
            save(args, runs, scaled, generation)
    if args.scaling:
        scaled += scaling(args)
        save(args, runs, scaled, generation)
    for task in args.generation_tasks:
        for engine in args.engines:
            generation.append(time_generation(args, task, engine))
            save(args, runs, scaled, generation)
        if "vllm" in args.engines:
            generation.append(time_generation_limit(args, task))
            save(args, runs, scaled, generation)
    print(markdown(args, runs, scaled, generation))


def save(args: Args, runs: dict[str, list[dict]], scaled: list[dict], generation: list[dict]) -> None:
    """results.json and results.md as they stand (after every run: a benchmark stopped midway keeps its rows)."""
    runs = {name: rs for name, rs in runs.items() if rs}  # the first run is the pipeline's
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump(
            {
                "args": dataclasses.asdict(args),
                "commit": git_commit(),
                "runs": runs,
                "scaling": scaled,
                "generation": generation,
            },
            f,
            indent=2,
        )
    with open(os.path.join(args.out_dir, "results.md"), "w") as f:
        f.write(markdown(args, runs, scaled, generation))


if __name__ == "__main__":
    main_with_user_errors(main)()
