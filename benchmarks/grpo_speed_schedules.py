"""The schedules table of benchmarks/grpo_speed.py: each schedule (`grpo.launch` in `pipeline` or `sync` mode, and
their flag variants) run to the end, its steady state, the table at matched lag, and with `--scaling` seconds per
step at each shape; the rows of one process each (the raw compute of a step, TRL) run through `run_role`."""

import dataclasses
import json
import math
import os
import shutil
import statistics
import sys

from grpo_speed_args import ROOT, Args, run_settings

from lm_human_preference_details.benchmarking import SteadyCpu, device_env, machine, markdown_table, run_logged
from lm_human_preference_details.cli import UserError


def schedules(args: Args) -> list[tuple[str, list[str]]]:
    settings = run_settings(args)
    pipeline = [("pipeline", ["--mode", "pipeline"])]
    if args.per_tensor_row and settings.processes.update_bucket_mb:
        pipeline.append(("pipeline, per-tensor updates", ["--mode", "pipeline", "--update-bucket-mb", "0"]))
    # after the established rows: a run that is stopped early keeps those
    ahead = [pipeline_ahead(settings, n) for n in args.pipeline_steps_ahead if n != settings.schedule.steps_ahead]
    sync = [(f"sync G={g}", ["--mode", "sync", "--sync-steps", str(g)]) for g in args.sync_steps]
    vllm = [(f"{name}, vLLM", [*flags, "--engine", "vllm"]) for name, flags in (pipeline[0], sync[0])]
    if args.one_thread_row:
        sync.append((f"sync G={args.sync_steps[0]}, one thread per process", [*sync[0][1], "--threads", "1"]))
    if "vllm" not in args.engines:
        return pipeline + sync + ahead
    # the home rows say so: on a GPU `auto` picks vLLM
    return [(name, [*flags, "--engine", "home"]) for name, flags in pipeline + sync + ahead] + vllm


def row_engine(name: str) -> str:
    """The engine of a schedule's row (`schedules` names vLLM's)."""
    return "vllm" if name.endswith(", vLLM") else "home"


def pipeline_ahead(settings, steps_ahead: float) -> tuple[str, list[str]]:
    """The pipeline row at `steps_ahead`; a fraction of a step's problems needs requests of no more problems than
    that (the largest that divides both it and the run's own requests)."""
    if not math.isfinite(steps_ahead):
        raise UserError(f"--pipeline-steps-ahead {steps_ahead}: pass a number of steps, e.g. 2.5")
    name, flags = (
        f"pipeline, {steps_ahead:.12g} steps ahead",
        ["--mode", "pipeline", "--steps-ahead", f"{steps_ahead:.12g}"],
    )
    problems = math.gcd(settings.request_problems(), round(steps_ahead * settings.groups_per_step()))
    if problems != settings.request_problems():
        name, flags = f"{name}, requests of {problems} problems", [*flags, "--problems-per-request", str(problems)]
    try:
        schedule = dataclasses.replace(settings.schedule, mode="pipeline", steps_ahead=steps_ahead)
        serving = dataclasses.replace(settings.serving, problems_per_request=problems)
        dataclasses.replace(settings, schedule=schedule, serving=serving).check()
    except UserError as error:
        raise UserError(f"--pipeline-steps-ahead {steps_ahead:.12g}: {error}") from None
    return name, flags


def run_schedule(args: Args, name: str, flags: list[str], repeat: int) -> dict:
    out = os.path.join(args.out_dir, name.replace(" ", "_").replace("=", ""), f"run_{repeat}")
    cmd = [
        sys.executable,
        "-m",
        "lm_human_preference_details.grpo.launch",
        "--task",
        args.task,
        "--steps",
        str(args.steps),
        "--output-dir",
        out,
        "--wandb-mode",
        "disabled",
        "--save-interval",
        "0",
        *args.extra,
        *flags,
    ]  # the row's flags win
    shutil.rmtree(out, ignore_errors=True)  # a fresh run: SteadyCpu must not count an earlier run's metrics
    os.makedirs(os.path.dirname(out), exist_ok=True)
    # steps before the steady state (first requests, first updates), whole sync rounds
    round_steps = int(flags[flags.index("--sync-steps") + 1]) if "--sync-steps" in flags else 1
    warm = -(-(args.steps // 5) // round_steps) * round_steps
    cpu = SteadyCpu(os.path.join(out, "metrics.jsonl"), first_row=max(warm, 1), last_row=args.steps)  # after start-up
    cpu.start()
    try:
        run_logged(cmd, out + ".log", device_env(args.device))  # the launcher's log; the servers' are in out/logs
    finally:
        cpu.stop()
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {**steady_state(rows, warm, round_steps), **cpu.result(rows[-1]["samples"] / len(rows))}


def steady_state(rows: list[dict], warm: int, round_steps: int) -> dict:
    """A run's numbers from its metrics.jsonl rows: samples/s, tokens/s, seconds per step and lag over the steps
    after the first `warm` (the window of the CPU columns; start-up is no schedule's), and the whole run's."""
    elapsed = rows[-1]["time/elapsed_s"]
    samples_per_row = rows[-1]["samples"] / len(rows)
    window_s = elapsed - (rows[warm - 1]["time/elapsed_s"] if warm else 0.0)
    return {
        "samples_per_s": samples_per_row * (len(rows) - warm) / window_s,
        "tokens_per_s": sum(r["completion/length"] for r in rows[warm:]) * samples_per_row / window_s,
        "s_per_step": window_s / (len(rows) - warm),
        "samples_per_s_whole_run": rows[-1]["samples"] / elapsed,
        "lag_mean": statistics.fmean(r["lag/mean"] for r in rows),
        # what the schedule holds once under way, over whole sync rounds (a round's last steps lag most);
        # a run shorter than that: its steps after the warm-up
        "lag_steady": statistics.fmean(
            r["lag/mean"] for r in rows[warm : len(rows) - (len(rows) - warm) % round_steps] or rows[warm:]
        ),
        "success_last_20": statistics.fmean(r["success/rate"] for r in rows[-20:]),
        "wait_data_s": sum(r["time/wait_data_s"] for r in rows),
        "elapsed_s": elapsed,
    }


def scaling(args: Args) -> list[dict]:
    """Seconds per optimizer step of the pipeline and the first sync schedule at each shape."""
    g = args.sync_steps[0]
    compared = [("pipeline", ["--mode", "pipeline"]), (f"sync G={g}", ["--mode", "sync", "--sync-steps", str(g)])]
    rows = []
    for batch, tokens in [(batch, tokens) for batch in args.scaling_batches for tokens in args.scaling_tokens]:
        shape_args = dataclasses.replace(
            args,
            steps=args.scaling_steps,
            out_dir=os.path.join(args.out_dir, "scaling", f"batch{batch}_tokens{tokens}"),
        )
        shape = ["--batch-size", str(batch), "--max-tokens", str(tokens), "--ignore-eos"]
        rows.append(
            {
                "batch": batch,
                "tokens": tokens,
                **{name: run_schedule(shape_args, name, flags + shape, 0)["s_per_step"] for name, flags in compared},
            }
        )
    return rows


ROLE_ROWS = {"raw": "raw compute (one process)", "trl": "trl GRPOTrainer"}


def run_role(args: Args, role: str, python: str, repeat: int) -> dict:
    """`role` in a process of its own (with `python`): its seconds per step and samples/s."""
    result = os.path.join(args.out_dir, role, f"run_{repeat}.json")
    os.makedirs(os.path.dirname(result), exist_ok=True)
    cmd = [
        python,
        os.path.join(ROOT, "benchmarks", "grpo_speed.py"),
        "--role",
        role,
        "--result",
        result,
        "--task",
        args.task,
        "--steps",
        str(args.steps),
        "--device",
        args.device,
        "--",
        *args.extra,
    ]
    run_logged(
        cmd,
        result.replace(".json", ".log"),
        device_env(args.device, python_path=ROOT, TRL_EXPERIMENTAL_SILENCE="1"),
        ROOT,
    )
    with open(result) as f:
        step_s = json.load(f)
    # the steps after the first fifth, as the schedules' rows; on-policy: it generates, then trains
    return {
        "samples_per_s": run_settings(args).optim.batch_size / statistics.fmean(step_s[len(step_s) // 5 :]),
        "lag_mean": 0.0,
        "lag_steady": 0.0,
        "step_s": step_s,
    }


def matched_lag(runs: dict[str, list[dict]], med: dict[str, dict]) -> list[str]:
    """Each sync schedule against the fastest pipeline row of its engine whose steady-state mean lag is no larger:
    the speed-up at the same on-policyness (or better)."""
    syncs = [name for name in med if name.startswith("sync")]
    if not syncs:
        return []
    rows = []
    for sync in syncs:
        lag = med[sync]["lag_steady"]
        # (1e-9: medians of float lags that print equal count as equal)
        candidates = [
            name
            for name in med
            if name.startswith("pipeline")
            and row_engine(name) == row_engine(sync)
            and med[name]["lag_steady"] <= lag + 1e-9
        ]
        if not candidates:
            rows.append([sync, f"{lag:.2f}", "none is as on-policy", "-", "-", "-"])
            continue
        best = max(candidates, key=lambda name: med[name]["samples_per_s"])
        per_round = " / ".join(f"{p['samples_per_s'] / r['samples_per_s']:.2f}" for p, r in zip(runs[best], runs[sync]))
        speedup = f"{med[best]['samples_per_s'] / med[sync]['samples_per_s']:.2f}x"
        rows.append([sync, f"{lag:.2f}", best, f"{med[best]['lag_steady']:.2f}", speedup, per_round])
    header = ["sync schedule", "sync lag", "pipeline row", "pipeline lag", "pipeline / sync (samples/s)", "per round"]
    caption = (
        "At matched on-policyness: each sync schedule against the fastest pipeline row of its engine whose mean lag, "
        "steps after the first fifth, is no larger:"
    )
    return ["", *markdown_table(caption, header, rows)]


def schedules_table(args: Args, runs: dict[str, list[dict]]) -> list[str]:
    """The schedules table's lines (each row's medians over its runs; every row against the first, the pipeline on
    the first engine), then the table at matched lag."""
    med = {
        name: {
            k: statistics.median(r[k] for r in rs if k in r)
            for k in dict.fromkeys(k for r in rs for k in r)
            if k != "step_s"
        }
        for name, rs in runs.items()
    }
    reference = next(iter(runs))  # the pipeline on the first engine
    flags = f", every launch with `{' '.join(args.extra)}`" if args.extra else ""
    rows = []
    for name, m in med.items():
        tokens, success, cores, cpu = (
            f"{m[k]:{fmt}}" if k in m else "-"
            for k, fmt in (
                ("tokens_per_s", ".0f"),
                ("success_last_20", ".2f"),
                ("cores_busy", ".2f"),
                ("cpu_ms_per_sample", ".2f"),
            )
        )
        # the work a sample cost (completion tokens; runs that learn different lengths do different work),
        # and the ratio within each round of interleaved runs (a round on a slowed machine slows both)
        per_sample = (
            "-"
            if "tokens_per_s" not in m
            else f"{statistics.median(r['tokens_per_s'] / r['samples_per_s'] for r in runs[name]):.1f}"
        )
        per_round = " / ".join(
            f"{p['samples_per_s'] / r['samples_per_s']:.2f}" for p, r in zip(runs[reference], runs[name])
        )
        versus = f"{med[reference]['samples_per_s'] / m['samples_per_s']:.2f}x"
        rows.append(
            [name, f"{m['samples_per_s']:.0f}", tokens, per_sample, f"{m['lag_steady']:.2f}", success, cores, cpu]
            + [versus, per_round]
        )
    header = ["schedule", "samples/s", "tokens/s", "tokens/sample", "mean lag (steps)", "success, last 20 steps"]
    header += ["cores busy", "CPU ms/sample", f"{reference} / this (samples/s)", "per round"]
    caption = (
        f"GRPO `{args.task}` preset{flags}, {args.steps} optimizer steps per run, median of {args.repeats} runs per "
        f"schedule, {machine(args.device)}. Every column is over the steps after the first fifth (start-up is no "
        "schedule's); cores busy and CPU per sample are the whole machine's, so that samples/s = 1000 x cores busy / "
        "CPU ms per sample (a schedule is faster by keeping more cores busy or by spending less CPU on a sample)."
    )
    return markdown_table(caption, header, rows) + matched_lag(runs, med)


def scaling_table(args: Args, scaled: list[dict]) -> list[str]:
    """The lines of `--scaling`'s table (none without rows): seconds per step of each schedule at each shape."""
    if not scaled:
        return []
    pipeline, sync = [k for k in scaled[0] if k not in ("batch", "tokens")]
    rows = [
        [str(r["batch"]), str(r["tokens"]), f"{r[pipeline]:.3f}", f"{r[sync]:.3f}", f"{r[sync] / r[pipeline]:.2f}x"]
        for r in scaled
    ]
    caption = (
        f"Seconds per optimizer step ({args.scaling_steps} steps per run, the first fifth not timed; every "
        "completion as long as the limit):"
    )
    header = ["batch", "completion tokens", f"{pipeline} (s)", f"{sync} (s)", f"{sync} / {pipeline}"]
    return ["", *markdown_table(caption, header, rows)]
