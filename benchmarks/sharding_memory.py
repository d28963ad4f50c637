"""Stage 2 under each sharding engine, side by side with DDP: what a process holds and how long an update takes.

    python benchmarks/sharding_memory.py --out-dir benchmarks/results/sharding_memory
    python benchmarks/sharding_memory.py --task tiny --engines ddp fsdp2 --zero3-persistence-threshold 0   # smoke
    python benchmarks/sharding_memory.py --engines ddp ddp-bf16 --out-dir runs/precision   # float32 against bf16

For each engine of `--engines` (DDP: `accelerate launch --multi_gpu`; the others: configs/accelerate/<engine>.yaml,
as a user launches them) `train_policy.py` runs on `--processes` processes (on the CPU over gloo, one thread
each), each run in a fresh folder, at one fixed shape: `--batch-size` episodes per update over all processes,
`--query-length` + `--response-length` tokens, `--epochs` PPO epochs of one minibatch, `--updates` updates. The
reward model is an untrained head on the task's LM (made once, seeded): what a process holds and how long an
update takes do not depend on what it learned. From each run's metrics.jsonl:
- state per rank: `memory/state_gib` of the last update, the largest process's parameters and optimizer state
  (the trained policy's, the frozen reference policy's and reward model's too), counted from its own shards;
- peak per rank: `memory/peak_gib`, the largest process's peak resident set (on the CPU it counts the
  interpreter, the libraries and activations too);
- seconds per update: the median of `time/update_s` over the updates after the first.
The table gives each engine's value and its ratio to DDP's (DDP always runs, first), and whether the engines that
shard parameters (FSDP2, ZeRO-3) hold at most 0.6x DDP's state per rank. `--repeats` runs the engines that many
times, interleaved (ddp, fsdp2, ..., ddp, fsdp2, ...). An engine whose run fails gets a row saying so and the
others still run.

ZeRO-3 keeps every tensor below `stage3_param_persistence_threshold` elements (DeepSpeed's default 1e5) whole on
every process: all of the `tiny` model's. `--zero3-persistence-threshold 0` runs a copy of configs/accelerate/
zero3.json that shards them all (as tests/stages/test_sharding.py does); without it the repository's config runs as is.
"""

import json
import os
import shutil
import socket
import statistics
import sys
from dataclasses import dataclass, field
from typing import Literal

import tyro

from lm_human_preference_details.benchmarking import device_env, git_commit, machine, run_logged

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs", "accelerate")
Engine = Literal["ddp", "fsdp2", "zero2", "zero3", "ddp-bf16"]
MIXED_PRECISION = {"ddp-bf16": "bf16"}
"""rows that run under `--mixed-precision` (DDP with the matmuls under accelerate's bf16 autocast); the rest float32"""
SHARDS_PARAMETERS = ("fsdp2", "zero3")
LIMIT = 0.6
"""what an engine that shards parameters may hold per rank, as a fraction of DDP's, on 2 processes"""


@dataclass
class Args:
    engines: list[Engine] = field(default_factory=lambda: ["ddp", "fsdp2", "zero2", "zero3"])
    """engines to run; DDP, the reference, runs first whether listed or not; `ddp-bf16`: DDP under bf16 autocast"""
    task: str = "sentiment-smollm2"
    """the stage's preset (`tiny` for a smoke test)"""
    model: str | None = None
    """the LM of the policy, reference and reward model (None: the task's; e.g. `smollm2-135m`, `tiny`)"""
    processes: int = 2
    """processes per run"""
    batch_size: int = 8
    """episodes per update, over all processes"""
    query_length: int = 16
    """query tokens"""
    response_length: int = 16
    """response tokens"""
    epochs: int = 1
    """PPO epochs per update (one minibatch each)"""
    updates: int = 3
    """updates per run; the first is not timed"""
    repeats: int = 1
    """runs per engine, interleaved; seconds per update are the median over all of them"""
    zero3_persistence_threshold: int | None = None
    """ZeRO-3's `stage3_param_persistence_threshold` (None: configs/accelerate/zero3.json's)"""
    keep_checkpoints: bool = False
    """keep each run's checkpoint/ and policy/ (deleted once read: GiBs per run on a real model)"""
    out_dir: str = "runs/sharding_memory"
    """results.json, results.md, the reward model and the runs go here"""


def model_of(args: Args) -> str:
    if args.model is not None:
        return args.model
    from lm_human_preference_details.train_policy import defaults_for_task

    return defaults_for_task(args.task).task.base_model


def make_reward_model(model: str, path: str) -> str:
    """An untrained reward model on `model`'s trunk (a seeded head), saved as train_reward.py saves one."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import torch

    from lm_human_preference_details.models import RewardModel
    from lm_human_preference_details.text import load_tokenizer

    with torch.random.fork_rng():
        torch.manual_seed(0)
        RewardModel.from_pretrained_lm(model).save(path)
    load_tokenizer(model).save_pretrained(path)
    return path


def accelerate_configs(args: Args) -> dict[str, str]:
    """Each engine's accelerate config: the repository's, or for ZeRO-3 with `--zero3-persistence-threshold` a copy
    (its DeepSpeed JSON by absolute path) that sets it."""
    configs = {engine: os.path.join(CONFIGS, f"{engine}.yaml") for engine in ("fsdp2", "zero2", "zero3")}
    if args.zero3_persistence_threshold is not None and os.path.isfile(configs["zero3"]):
        import yaml

        with open(configs["zero3"]) as f:
            config = yaml.safe_load(f)
        with open(os.path.join(ROOT, config["deepspeed_config"]["deepspeed_config_file"])) as f:
            deepspeed = json.load(f)
        deepspeed["zero_optimization"]["stage3_param_persistence_threshold"] = args.zero3_persistence_threshold
        folder = os.path.join(os.path.abspath(args.out_dir), "configs")
        os.makedirs(folder, exist_ok=True)
        config["deepspeed_config"]["deepspeed_config_file"] = os.path.join(folder, "zero3.json")
        with open(config["deepspeed_config"]["deepspeed_config_file"], "w") as f:
            json.dump(deepspeed, f, indent=2)
        configs["zero3"] = os.path.join(folder, "zero3.yaml")
        with open(configs["zero3"], "w") as f:
            yaml.safe_dump(config, f)
    return configs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(args: Args, engine: str, config: str | None, reward_model: str, run_dir: str) -> list[str]:
    launcher = ("--config_file", config) if config else ("--multi_gpu",)
    stage = [
        "--task",
        args.task,
        *(("--task.base-model", args.model) if args.model else ()),
        "--task.query-length",
        str(args.query_length),
        "--task.response-length",
        str(args.response_length),
        "--rewards.trained-model",
        reward_model,
        "--ppo.batch-size",
        str(args.batch_size),
        "--ppo.total-episodes",
        str(args.batch_size * args.updates),
        "--ppo.noptepochs",
        str(args.epochs),
        "--ppo.nminibatches",
        "1",
        "--ppo.gradient-accumulation-steps",
        "1",
        *(("--ppo.no-whiten-rewards",) if args.batch_size // args.processes < 8 else ()),  # too few to whiten over
        "--mixed-precision",
        MIXED_PRECISION.get(engine, "no"),
        "--save-interval",
        "0",
        "--output-dir",
        run_dir,
        "--wandb-mode",
        "disabled",
    ]
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *launcher,
        "--num_processes",
        str(args.processes),
        "--num_machines",
        "1",
        "--main_process_port",
        str(free_port()),  # not accelerate's default 29500, which a user's own run may hold
        "--mixed_precision",
        MIXED_PRECISION.get(engine, "no"),
        "--dynamo_backend",
        "no",
        "-m",
        "lm_human_preference_details.train_policy",
        *stage,
    ]


def measure(args: Args, engine: str, config: str | None, reward_model: str, run_dir: str) -> dict:
    """One run of the stage under `engine`; what its metrics.jsonl says (or why it failed)."""
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh folder: a stage refuses to log over an earlier run
    os.makedirs(run_dir)
    if config is not None and not os.path.isfile(config):
        return {"error": f"no accelerate config {os.path.relpath(config, ROOT)}"}
    try:
        launcher_peak_mib = run_logged(
            command(args, engine, config, reward_model, run_dir),
            os.path.join(run_dir, "log.txt"),
            device_env("cpu"),
            ROOT,  # the repository's configs name their DeepSpeed JSON relative to it
        )
    except RuntimeError as error:
        print(error, flush=True)
        return {"error": f"failed: see {os.path.join(run_dir, 'log.txt')}"}
    finally:
        if not args.keep_checkpoints:
            for name in ("checkpoint", "policy"):
                shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    assert len(metrics) == args.updates, (run_dir, len(metrics))
    return {
        "state_gib": metrics[-1]["memory/state_gib"],
        "peak_gib": max(m["memory/peak_gib"] for m in metrics),
        "times": [m["time/update_s"] for m in metrics][1:],  # the first update warms up
        "launcher_peak_mib": launcher_peak_mib,  # the largest process's peak RSS, the final save included
    }


def summarize(runs: list[dict]) -> dict:
    done = [r for r in runs if "error" not in r]
    if not done:
        return {"error": runs[0]["error"], "runs": runs}
    return {
        "state_gib": max(r["state_gib"] for r in done),
        "peak_gib": max(r["peak_gib"] for r in done),
        "s_per_update": statistics.median(t for r in done for t in r["times"]),
        "runs": runs,
    }


def engines_of(args: Args) -> list[str]:
    return ["ddp", *dict.fromkeys(e for e in args.engines if e != "ddp")]


def within_limit(results: dict) -> dict[str, bool]:
    """Per engine that shards parameters and ran: whether it holds at most LIMIT x DDP's state per rank."""
    if "error" in results.get("ddp", {"error": ""}):
        return {}
    ddp = results["ddp"]["state_gib"]
    return {e: r["state_gib"] <= LIMIT * ddp for e, r in results.items() if e in SHARDS_PARAMETERS and "error" not in r}


def markdown(args: Args, results: dict) -> str:
    per_process = args.batch_size // args.processes
    lines = [
        f"Stage 2 (`train_policy`, task `{args.task}`, model `{model_of(args)}`) on {args.processes} processes "
        f"(CPU, gloo, one thread each): batch {args.batch_size} ({per_process} per process), {args.query_length} "
        f"query + {args.response_length} response tokens, {args.epochs} PPO epoch(s) of 1 minibatch, "
        f"{args.updates} updates x {args.repeats} run(s) per engine; {machine('cpu')}. State: parameters and "
        "optimizer state of the largest process (policy, reference policy and reward model); peak: the largest "
        "process's peak RSS; s / update: median over the updates after each run's first.",
        "",
        "| engine | state per rank (GiB) | state / DDP | peak per rank (GiB) | peak / DDP | s / update | time / DDP |",
        "|---|---|---|---|---|---|---|",
    ]
    ddp = results.get("ddp", {})
    for engine, r in results.items():
        if "error" in r:
            lines.append(f"| {engine} | {r['error']} | | | | | |")
            continue

        def ratio(key: str, r=r, digits: int = 2) -> str:
            return f"{r[key] / ddp[key]:.{digits}f}x" if key in ddp else "-"

        lines.append(
            f"| {engine} | {r['state_gib']:.3f} | {ratio('state_gib', digits=3)} | {r['peak_gib']:.2f} "
            f"| {ratio('peak_gib')} | {r['s_per_update']:.2f} | {ratio('s_per_update')} |"
        )
    checks = within_limit(results)
    if checks:
        ddp_state = results["ddp"]["state_gib"]
        verdicts = ", ".join(
            f"{e} {results[e]['state_gib'] / ddp_state:.4f}x {'yes' if ok else 'NO'}" for e, ok in checks.items()
        )
        lines += ["", f"Parameters + optimizer state per rank at most {LIMIT}x DDP's (FSDP2, ZeRO-3): {verdicts}."]
    return "\n".join(lines) + "\n"


def save(args: Args, results: dict) -> None:
    """results.json and results.md as they stand (after each run: a benchmark stopped midway keeps what it has)."""
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump({"args": vars(args), "commit": git_commit(), "results": results}, f, indent=2)
    with open(os.path.join(args.out_dir, "results.md"), "w") as f:
        f.write(markdown(args, results))


def main(argv: list[str] | None = None) -> dict:
    args = tyro.cli(Args, args=argv)
    if args.updates < 2:
        raise SystemExit("--updates must be at least 2: the first update is not timed")
    os.makedirs(args.out_dir, exist_ok=True)
    reward_model = make_reward_model(model_of(args), os.path.join(os.path.abspath(args.out_dir), "reward_model"))
    configs = accelerate_configs(args)
    engines = engines_of(args)
    runs: dict[str, list[dict]] = {engine: [] for engine in engines}
    results: dict[str, dict] = {}
    for repeat in range(args.repeats):
        for engine in engines:
            run_dir = os.path.join(os.path.abspath(args.out_dir), "runs", f"{engine}_{repeat}")
            runs[engine].append(measure(args, engine, configs.get(engine), reward_model, run_dir))
            results = {e: summarize(rs) for e, rs in runs.items() if rs}
            save(args, results)
    print(markdown(args, results), flush=True)
    return results


if __name__ == "__main__":
    main()
