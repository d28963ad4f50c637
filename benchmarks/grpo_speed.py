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
Then the weight update itself for each of `--update-models`: a server generating at full batch, the
trainer's broadcast (announce, then one broadcast per tensor or per bucket, until received) and the
server's pause (decoding stopped for the swap), median over `--updates` updates each way.
With `--engines home vllm`, vLLM's servers (`grpo.launch --engine vllm`) join: a `pipeline, vLLM` row and a
`sync G=<first>, vLLM` row (the home rows then pass `--engine home`: on a GPU `auto` would pick vLLM), and each
model's weight update on a vLLM server.

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

import contextlib
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import tyro

from lm_human_preference_details.benchmarking import (
    Device,
    busy_cpu_s,
    device_env,
    git_commit,
    machine,
    run_logged,
    synchronize,
)
from lm_human_preference_details.cli import UserError, main_with_user_errors, split_passthrough

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
    update_models: list[str] = field(default_factory=lambda: ["tiny-math", "smollm2-135m"])
    """models whose weight update is timed (empty: skip)"""
    updates: int = 10
    """weight updates timed per model"""
    update_bucket_mb: float = 16.0
    """the weight update is timed one broadcast per tensor and with buckets of this many MiB"""
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
    G) on vLLM's servers, vLLM's weight updates and, in the generation table, vLLM's server and its offline limit"""
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


def schedules(args: Args) -> list[tuple[str, list[str]]]:
    settings = run_settings(args)
    pipeline = [("pipeline", ["--mode", "pipeline"])]
    if args.per_tensor_row and settings.update_bucket_mb:
        pipeline.append(("pipeline, per-tensor updates", ["--mode", "pipeline", "--update-bucket-mb", "0"]))
    # after the established rows: a run that is stopped early keeps those
    ahead = [pipeline_ahead(settings, n) for n in args.pipeline_steps_ahead if n != settings.steps_ahead]
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
        dataclasses.replace(settings, mode="pipeline", steps_ahead=steps_ahead, problems_per_request=problems).check()
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


class SteadyCpu(threading.Thread):
    """The machine's CPU over a run's steady state: busy cores and CPU time per sample, from when
    metrics.jsonl has `first_row` rows to when it has `last_row` (a thread polling the file). Every process
    counts, so that a schedule's whole cost is there (servers, actor, verifier, trainer); over the window,
    samples/s = cores busy / CPU seconds per sample: the two ways one schedule can be faster than another."""

    def __init__(self, metrics_path: str, first_row: int, last_row: int):
        super().__init__(daemon=True)
        self.path, self.rows_at = metrics_path, (first_row, last_row)
        self.marks: list[tuple[float | None, float, int]] = []  # (busy CPU s, wall s, rows) at each
        self.done = threading.Event()

    def run(self) -> None:
        rows, metrics = 0, None
        while True:  # a last look after stop(): a starved thread still sees the last row (late, not never)
            stopping = self.done.is_set()
            if metrics is None and os.path.exists(self.path):
                metrics = open(self.path)
            if metrics is not None:
                rows += metrics.read().count("\n")  # whole lines only: a line being written counts once it ends
            while len(self.marks) < 2 and rows >= self.rows_at[len(self.marks)]:
                self.marks.append((busy_cpu_s(), time.perf_counter(), rows))
            if stopping or len(self.marks) == 2:
                break
            self.done.wait(0.01)
        if metrics is not None:
            metrics.close()

    def stop(self) -> None:
        self.done.set()
        self.join()

    def result(self, samples_per_row: float) -> dict:
        """cores_busy and cpu_ms_per_sample; nothing when the window was not seen or there is no /proc/stat."""
        if len(self.marks) < 2 or self.marks[0][0] is None or self.marks[1][2] == self.marks[0][2]:
            return {}
        (cpu0, wall0, rows0), (cpu1, wall1, rows1) = self.marks
        return {
            "cores_busy": (cpu1 - cpu0) / (wall1 - wall0),
            "cpu_ms_per_sample": (cpu1 - cpu0) * 1e3 / ((rows1 - rows0) * samples_per_row),
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


@contextlib.contextmanager
def served(settings, engine: Literal["home", "vllm"], folder: str, device: Device) -> Iterator[str]:
    """A server of `engine` for `settings` (`GRPOArgs`), started as the launcher starts one (`ServerEngine`, with
    `server_flags`), its log and vLLM's caches in `folder`: its URL, until the block ends."""
    from lm_human_preference_details.grpo.launch import ServerEngine, server_flags

    starter = ServerEngine(engine, folder)
    flags = server_flags(settings, starter.model_for_servers(settings.model), version=0, i=0)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "server.log"), "wb") as log:  # the child keeps its own handle
        server_process = starter.start(0, flags, log, device_env(device))
    try:
        yield server_process.wait_until_serving()
    finally:
        server_process.process.terminate()
        server_process.process.wait(timeout=60)
        starter.cleanup()


def time_weight_updates(
    model: str, engine: Literal["home", "vllm"], updates: int, bucket_mb: float, device: Device, folder: str
) -> dict:
    """A real server of `engine` generating at full batch; the trainer side pushes 2 x `updates` new versions, in
    buckets of `bucket_mb` MiB and one broadcast per tensor by turns (the first, bucketed, warms up: medians are
    taken)."""
    import torch

    from lm_human_preference_details.grpo.client import request_json
    from lm_human_preference_details.grpo.config import GRPOArgs
    from lm_human_preference_details.grpo.weights import WeightSender, buckets, parameter_specs, served_dtype
    from lm_human_preference_details.models import load_causal_lm

    with served(GRPOArgs(model=model, threads=1, server_batch_size=16), engine, folder, device) as url:
        trainer_model = load_causal_lm(model).to(device)
        server_dtype = served_dtype(url)  # bf16 on a GPU; the trainer sends it so too
        sender = WeightSender([url])
        busy = threading.Event()
        load = threading.Thread(target=_keep_generating, args=(url, busy), daemon=True)
        load.start()
        ways = {"per_tensor": 0, "bucketed": int(bucket_mb * 2**20)}
        broadcast: dict[str, list[float]] = {name: [] for name in ways}
        pauses: dict[str, list[float]] = {name: [] for name in ways}
        for version in range(1, 2 * updates + 1):  # the two ways alternate
            name = list(ways)[version % 2]
            with torch.no_grad():
                next(trainer_model.parameters()).add_(1e-3)
            paused_before = request_json("GET", f"{url}/metrics")["pause_s_total"]
            start = time.perf_counter()
            sender.push(trainer_model, version, dtype=server_dtype, bucket_bytes=ways[name])
            sender.wait()
            broadcast[name].append(time.perf_counter() - start)
            while (metrics := request_json("GET", f"{url}/metrics"))["weight_updates"] != version:
                time.sleep(0.001)
            pauses[name].append(metrics["pause_s_total"] - paused_before)
        timed = {
            name: {"broadcast_s": statistics.median(broadcast[name]), "pause_s": statistics.median(pauses[name])}
            for name in ways
        }
        metrics = request_json("GET", f"{url}/metrics")
        busy.set()
        parameters = sum(p.numel() for p in trainer_model.parameters())
        specs = parameter_specs(trainer_model, server_dtype)  # as sent: bf16 buckets hold twice the tensors
        return {
            "model": model,
            "parameters": parameters,
            "tensors": len(specs),
            "bucket_mb": bucket_mb,
            "broadcasts_bucketed": len(buckets(specs, int(bucket_mb * 2**20))),
            **timed,
            "engine": engine,
            "generated_tokens_meanwhile": metrics["generated_tokens"],
        }


def _keep_generating(url: str, stop: threading.Event) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from lm_human_preference_details.grpo.client import ServerError, request_json

    def one():
        while not stop.is_set():
            try:
                request_json(
                    "POST", f"{url}/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 64, "n": 4, "ignore_eos": True}
                )
            except ServerError:
                return

    with ThreadPoolExecutor(4) as pool:
        for _ in range(4):
            pool.submit(one)


GENERATION_REQUEST_TIMEOUT_S = 600  # a 135M model's requests took over 2 minutes on the busy 2-core CPU


def generation_settings(task: str):
    """The `GRPOArgs` of a generation row: the preset's, in `sync` mode, whose share of the cores for a server is
    all of them (the launcher's thread setting for a server that has the machine to itself)."""
    from lm_human_preference_details import cli
    from lm_human_preference_details.grpo.config import GRPOArgs, get_preset

    return cli.parse(GRPOArgs, get_preset, task, argv=["--task", task, "--mode", "sync"])


def generation_prompts(settings, requests: int) -> list[list[str]]:
    """The prompts of `requests` completion requests as the actor makes them (`actor._complete`): the preset's
    problems in order, `request_problems()` per request."""
    from lm_human_preference_details.grpo.rewards import load_task_problems

    problems, per_request = load_task_problems(settings), settings.request_problems()
    return [
        [problems[k % len(problems)].prompt for k in range(first, first + per_request)]
        for first in range(0, requests * per_request, per_request)
    ]


def generation_shape(args: Args, task: str, settings) -> dict:
    """What every row of `task` in the generation table generates (the limit's too)."""
    return {
        "task": task,
        "model": settings.model,
        "requests": args.generation_requests,
        "prompts_per_request": settings.request_problems(),
        "n": settings.group_size,
        "max_tokens": args.generation_tokens,
        "in_flight": args.generation_in_flight or settings.max_in_flight,
    }


def time_generation(args: Args, task: str, engine: Literal["home", "vllm"]) -> dict:
    """Generation alone: a server of `engine` for `task`'s preset gets `generation_requests` completion requests
    shaped as the actor's, `in_flight` at a time over HTTP, after one untimed request (the first prompts; the timed
    requests take the ones after); samples/s and tokens/s from the first timed request sent to the last answered."""
    from concurrent.futures import ThreadPoolExecutor

    from lm_human_preference_details.grpo.client import request_json

    settings = generation_settings(task)
    shape = generation_shape(args, task, settings)
    warm_up, *timed = generation_prompts(settings, 1 + args.generation_requests)
    folder = os.path.join(args.out_dir, "generation", task, engine)
    with served(settings, engine, folder, args.device) as url:

        def complete(prompts: list[str]) -> dict:  # the actor's request (`actor._complete`), every sample full length
            sampling = {"max_tokens": args.generation_tokens, "temperature": settings.temperature}
            payload = {"prompt": prompts, **sampling, "n": settings.group_size, "ignore_eos": True}
            return request_json("POST", f"{url}/v1/completions", payload, timeout_s=GENERATION_REQUEST_TIMEOUT_S)

        complete(warm_up)
        start = time.perf_counter()
        with ThreadPoolExecutor(shape["in_flight"]) as pool:
            replies = list(pool.map(complete, timed))
        seconds = time.perf_counter() - start
        metrics = request_json("GET", f"{url}/metrics")
    choices = [choice for reply in replies for choice in reply["choices"]]
    tokens = sum(len(c["token_ids"]) for c in choices)
    return {
        **shape,
        "engine": engine,
        "sequences": len(choices),
        "tokens": tokens,
        "seconds": seconds,
        "samples_per_s": len(choices) / seconds,
        "tokens_per_s": tokens / seconds,
        "decode_batch_mean": metrics["decode_batch_mean"],  # the warm-up's steps too
    }


def time_generation_limit(args: Args, task: str) -> dict:
    """The generation table's limit: vLLM's offline `LLM.generate` (benchmarks/vllm_generate.py, in the vLLM
    environment) with the server flags the launcher gives vLLM's server, of the same warm-up and timed prompts as
    `time_generation`'s requests, all at once."""
    from lm_human_preference_details.grpo import vllm_env
    from lm_human_preference_details.grpo.launch import ServerEngine, server_flags

    settings = generation_settings(task)
    shape = generation_shape(args, task, settings)
    python = vllm_env.server_command()[0]  # a RuntimeError naming the command that makes the environment
    warm_up, *timed = generation_prompts(settings, 1 + args.generation_requests)
    folder = os.path.join(args.out_dir, "generation", task, "vllm_limit")
    os.makedirs(folder, exist_ok=True)
    prompts, result = os.path.join(folder, "prompts.json"), os.path.join(folder, "result.json")
    with open(prompts, "w") as f:
        json.dump({"warm_up": warm_up, "timed": [p for request in timed for p in request]}, f)
    flags = server_flags(settings, ServerEngine("vllm", folder).model_for_servers(settings.model), version=0, i=0)
    sampling = ["--n", str(settings.group_size), "--max-tokens", str(args.generation_tokens)]
    cmd = [python, os.path.join(ROOT, "benchmarks", "vllm_generate.py"), "--prompts", prompts, *sampling]
    cmd += ["--temperature", f"{settings.temperature!r}", "--out", result, "--", *flags]
    run_logged(cmd, os.path.join(folder, "vllm_generate.log"), dict(device_env(args.device), PYTHONPATH=ROOT), ROOT)
    with open(result) as f:
        limit = json.load(f)
    return {**shape, "engine": "vllm offline generate (limit)", **limit}


def run_settings(args: Args):
    """The GRPOArgs every launch of this benchmark runs with (the preset and the flags after `--`)."""
    from lm_human_preference_details import cli
    from lm_human_preference_details.grpo.config import GRPOArgs, get_preset

    return cli.parse(GRPOArgs, get_preset, args.task, argv=["--task", args.task, *args.extra])


def raw_step_times(args: Args) -> list[float]:
    """The compute of an optimizer step alone, one process, nothing overlapped or sent anywhere:
    sample the step's completions (a prefill of every row, each prompt group_size times where the
    servers prefill it once, then one cached forward per token for the whole batch), score them, one forward and
    backward of the policy over prompt + completion with the run's loss (on policy: ratio 1), clip, one optimizer
    step. Seconds per step."""
    import torch
    from transformers import AutoTokenizer

    from lm_human_preference_details.assets import resolve_model_path
    from lm_human_preference_details.grpo.engine import sample_tokens
    from lm_human_preference_details.grpo.loss import group_advantages, policy_loss
    from lm_human_preference_details.grpo.rewards import integer_reward, load_task_problems, math_reward
    from lm_human_preference_details.models import load_causal_lm, logprobs_of
    from lm_human_preference_details.optim import make_optimizer

    settings = run_settings(args)
    torch.manual_seed(settings.seed)
    device = torch.device(args.device)
    generator = torch.Generator(device=device).manual_seed(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(settings.model))
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    model = load_causal_lm(settings.model).to(device)
    optimizer = make_optimizer(settings.optimizer, model.parameters(), lr=settings.lr, eps=settings.adam_eps)
    problems = load_task_problems(settings)
    groups, n = settings.groups_per_step(), settings.group_size
    times = []
    for step in range(args.steps + 1):  # the first step warms up, untimed
        start = time.perf_counter()
        batch = [problems[(step * groups + i) % len(problems)] for i in range(groups) for _ in range(n)]
        prompts = [tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in batch]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
        prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        with torch.no_grad():
            mask, positions = prompt_mask, (prompt_mask.cumsum(1) - 1).clamp(min=0)
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
            tokens = []
            for t in range(settings.max_tokens):
                logprobs = torch.log_softmax(out.logits[:, -1, :vocab].float() / settings.temperature, -1)
                tokens.append(sample_tokens(logprobs, generator)[:, None])  # the servers' sampler
                if (
                    t + 1 == settings.max_tokens
                    or not settings.ignore_eos
                    and (torch.cat(tokens, 1) == eos).any(1).all()
                ):
                    break
                mask, positions = torch.cat([mask, torch.ones_like(tokens[-1])], 1), positions[:, -1:] + 1
                out = model(
                    input_ids=tokens[-1], attention_mask=mask, position_ids=positions, cache=out.cache, use_cache=True
                )
        completions = torch.cat(tokens, 1)
        after_eos = (completions == eos).long().cumsum(1) - (completions == eos).long()  # EOS itself is kept
        valid = torch.ones_like(completions) if settings.ignore_eos else (after_eos == 0).long()
        texts = [
            tokenizer.decode(row[:length], skip_special_tokens=True)
            for row, length in zip(completions.tolist(), valid.sum(1).tolist())
        ]
        rewards = []
        for problem, text in zip(batch, texts):
            reward = integer_reward(settings.answer_prefix + text, problem.answer)
            rewards.append(math_reward(settings.answer_prefix + text, problem.answer) if reward is None else reward)
        advantages = group_advantages(
            torch.tensor(rewards, device=device), n, settings.baseline, settings.divide_by_std
        )
        full_mask = torch.cat([prompt_mask, valid], 1)
        predicting = torch.arange(
            width - 1, full_mask.shape[1] - 1, device=device
        )  # the positions before each completion token
        logits = model(
            input_ids=torch.cat([ids, completions], 1),
            attention_mask=full_mask,
            position_ids=(full_mask.cumsum(1) - 1).clamp(min=0),
            logits_to_keep=predicting,
        ).logits[..., :vocab]
        logprobs = logprobs_of(logits, completions, settings.temperature)
        loss, _ = policy_loss(
            logprobs,
            logprobs.detach(),
            advantages,
            valid,
            num_sequences=len(batch),
            loss_type=settings.loss_type,
            ratio_cap=settings.ratio_cap,
            clip_eps=settings.clip_eps,
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times[1:]


def trl_step_times(args: Args) -> list[float]:
    """TRL's GRPOTrainer at the run's settings, seconds per optimizer step (all but the first)."""
    import tempfile

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lm_human_preference_details.assets import resolve_model_path
    from lm_human_preference_details.grpo.rewards import load_task_problems, math_reward

    settings = run_settings(args)
    problems = load_task_problems(settings)
    path = resolve_model_path(settings.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = tokenizer.eos_token

    def reward(completions, answer, **_):  # the actor's reward: the answer prefix, then the last box
        return [math_reward(settings.answer_prefix + c, a) for c, a in zip(completions, answer)]

    ends: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_end(self, *_, **__):
            ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=settings.batch_size,
            num_generations=settings.group_size,
            steps_per_generation=1,
            gradient_accumulation_steps=1,
            max_completion_length=settings.max_tokens,
            max_steps=args.steps,
            learning_rate=settings.lr,
            temperature=settings.temperature,
            beta=0.0,
            # --ignore-eos: every completion max_tokens long, as the servers sample them
            generation_kwargs={"min_new_tokens": settings.max_tokens} if settings.ignore_eos else None,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            use_cpu=args.device == "cpu",
            seed=0,
            disable_tqdm=True,
            bf16=False,  # TRL's default is bf16 autocast (also on a CPU); every other row computes in fp32
            gradient_checkpointing=False,  # TRL's default recomputes the forward in the backward; no other row does
        )
        dataset = Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(path),
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[StepTimer()],
        )
        trainer.train()
    return [b - a for a, b in zip(ends, ends[1:])]


ROLES = {"raw": raw_step_times, "trl": trl_step_times}
ROLE_ROWS = {"raw": "raw compute (one process)", "trl": "trl GRPOTrainer"}


def run_role(args: Args, role: str, python: str, repeat: int) -> dict:
    """`role` in a process of its own (with `python`): its seconds per step and samples/s."""
    result = os.path.join(args.out_dir, role, f"run_{repeat}.json")
    os.makedirs(os.path.dirname(result), exist_ok=True)
    cmd = [
        python,
        os.path.abspath(__file__),
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
        "samples_per_s": run_settings(args).batch_size / statistics.fmean(step_s[len(step_s) // 5 :]),
        "lag_mean": 0.0,
        "lag_steady": 0.0,
        "step_s": step_s,
    }


def markdown(
    args: Args, runs: dict[str, list[dict]], updates: list[dict], scaled: list[dict], generation: list[dict] = ()
) -> str:
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
    lines = [
        f"GRPO `{args.task}` preset{flags}, {args.steps} optimizer steps per run, median of {args.repeats} runs per "
        f"schedule, {machine(args.device)}. Every column is over the steps after the first fifth (start-up is no "
        "schedule's); cores busy and CPU per sample are the whole machine's, so that samples/s = 1000 x cores busy / "
        "CPU ms per sample (a schedule is faster by keeping more cores busy or by spending less CPU on a sample).",
        "",
        "| schedule | samples/s | tokens/s | tokens/sample | mean lag (steps) | success, last 20 steps | cores busy | "
        f"CPU ms/sample | {reference} / this (samples/s) | per round |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
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
        lines.append(
            f"| {name} | {m['samples_per_s']:.0f} | {tokens} | {per_sample} | {m['lag_steady']:.2f} | {success} | "
            f"{cores} | {cpu} | {med[reference]['samples_per_s'] / m['samples_per_s']:.2f}x | {per_round} |"
        )
    lines += matched_lag(runs, med)
    if updates:
        lines += [
            "",
            "Weight update while the server decodes (median of the timed updates; trainer broadcast = "
            "announce until received, server pause = decoding stopped for the swap):",
            "",
            "| model | engine | parameters | broadcasts | trainer broadcast (ms) | server pause (ms) |",
            "|---|---|---|---|---|---|",
        ]
        for u in updates:
            for name, count in (
                ("per_tensor", f"{u['tensors']} (one per tensor)"),
                ("bucketed", f"{u['broadcasts_bucketed']} ({u['bucket_mb']:g} MiB buckets)"),
            ):
                lines.append(
                    f"| {u['model']} | {u['engine']} | {u['parameters'] / 1e6:.1f}M | {count} | "
                    f"{u[name]['broadcast_s'] * 1e3:.1f} | {u[name]['pause_s'] * 1e3:.2f} |"
                )
    if scaled:
        pipeline, sync = [k for k in scaled[0] if k not in ("batch", "tokens")]
        lines += [
            "",
            f"Seconds per optimizer step ({args.scaling_steps} steps per run, the first fifth not timed; every "
            "completion as long as the limit):",
            "",
            f"| batch | completion tokens | {pipeline} (s) | {sync} (s) | {sync} / {pipeline} |",
            "|---|---|---|---|---|",
        ]
        for row in scaled:
            lines.append(
                f"| {row['batch']} | {row['tokens']} | {row[pipeline]:.3f} | {row[sync]:.3f} | "
                f"{row[sync] / row[pipeline]:.2f}x |"
            )
    lines += generation_table(generation)
    return "\n".join(lines) + "\n"


def generation_table(generation: list[dict]) -> list[str]:
    """The generation table's lines (none without rows): each row's samples/s, tokens/s, and the limit's tokens/s
    over its own where the task has a limit row."""
    if not generation:
        return []
    limits = {row["task"]: row for row in generation if row["engine"].endswith("(limit)")}
    lines = [
        "",
        "Generation alone: one server with every core gets completion requests shaped as the actor's (a request: "
        "its prompts x n samples, each `max_tokens` long past EOS), `in flight` at a time over HTTP, after one untimed "
        "request; the limit is vLLM's offline `LLM.generate` of the same prompts at once (the server's engine "
        "arguments and sampling, after an untimed generate):",
        "",
        "| preset | model | engine | requests x prompts x n | tokens | in flight | samples/s | tokens/s | "
        "limit / this (tokens/s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in generation:
        limit = limits.get(row["task"])
        versus = f"{limit['tokens_per_s'] / row['tokens_per_s']:.2f}x" if limit else "-"
        lines.append(
            f"| {row['task']} | {row['model']} | {row['engine']} | {row['requests']} x {row['prompts_per_request']} x "
            f"{row['n']} | {row['max_tokens']} | {row['in_flight']} | {row['samples_per_s']:.1f} | "
            f"{row['tokens_per_s']:.0f} | {versus} |"
        )
    return lines


def matched_lag(runs: dict[str, list[dict]], med: dict[str, dict]) -> list[str]:
    """Each sync schedule against the fastest pipeline row of its engine whose steady-state mean lag is no larger:
    the speed-up at the same on-policyness (or better)."""
    syncs = [name for name in med if name.startswith("sync")]
    if not syncs:
        return []
    lines = [
        "",
        "At matched on-policyness: each sync schedule against the fastest pipeline row of its engine whose mean lag, "
        "steps after the first fifth, is no larger:",
        "",
        "| sync schedule | sync lag | pipeline row | pipeline lag | pipeline / sync (samples/s) | per round |",
        "|---|---|---|---|---|---|",
    ]
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
            lines.append(f"| {sync} | {lag:.2f} | none is as on-policy | - | - | - |")
            continue
        best = max(candidates, key=lambda name: med[name]["samples_per_s"])
        per_round = " / ".join(f"{p['samples_per_s'] / r['samples_per_s']:.2f}" for p, r in zip(runs[best], runs[sync]))
        lines.append(
            f"| {sync} | {lag:.2f} | {best} | {med[best]['lag_steady']:.2f} | "
            f"{med[best]['samples_per_s'] / med[sync]['samples_per_s']:.2f}x | {per_round} |"
        )
    return lines


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
    updates: list[dict] = []
    scaled: list[dict] = []
    generation: list[dict] = []
    for repeat in range(args.repeats):
        for name, flags in schedules(args):
            runs[name].append(run_schedule(args, name, flags, repeat))
            save(args, runs, updates, scaled, generation)
        for role, python in roles.items():
            runs[ROLE_ROWS[role]].append(run_role(args, role, python, repeat))
            save(args, runs, updates, scaled, generation)
    for model in args.update_models:
        for engine in args.engines:
            folder = os.path.join(args.out_dir, "updates", f"{model}_{engine}")
            updates.append(time_weight_updates(model, engine, args.updates, args.update_bucket_mb, args.device, folder))
            save(args, runs, updates, scaled, generation)
    if args.scaling:
        scaled += scaling(args)
        save(args, runs, updates, scaled, generation)
    for task in args.generation_tasks:
        for engine in args.engines:
            generation.append(time_generation(args, task, engine))
            save(args, runs, updates, scaled, generation)
        if "vllm" in args.engines:
            generation.append(time_generation_limit(args, task))
            save(args, runs, updates, scaled, generation)
    print(markdown(args, runs, updates, scaled, generation))


def save(
    args: Args, runs: dict[str, list[dict]], updates: list[dict], scaled: list[dict], generation: list[dict]
) -> None:
    """results.json and results.md as they stand (after every run: a benchmark stopped midway keeps its rows)."""
    runs = {name: rs for name, rs in runs.items() if rs}  # the first run is the pipeline's
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump(
            {
                "args": dataclasses.asdict(args),
                "commit": git_commit(),
                "runs": runs,
                "updates": updates,
                "scaling": scaled,
                "generation": generation,
            },
            f,
            indent=2,
        )
    with open(os.path.join(args.out_dir, "results.md"), "w") as f:
        f.write(markdown(args, runs, updates, scaled, generation))


if __name__ == "__main__":
    main_with_user_errors(main)()
