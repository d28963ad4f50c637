"""Weight updates against the transport's limit, side by side in one run.

    python benchmarks/weight_sync.py --out-dir benchmarks/results/weight_sync

For each model, engine, server dtype and staging (`--weight-staging`): a real server of that engine generates at
full batch while the trainer's side (this process, a `WeightSender`) pushes new weights, one broadcast per tensor
and in buckets of `--bucket-mb` by turns, `--updates` times each (after one untimed update). Per update it times:
- the trainer's send: `push` (the snapshot, cast once to the server's dtype) until `wait` returns (every
  broadcast received);
- the server's receive (its /metrics `receive_s_last`: the announce until every tensor has arrived) and its pause
  (`pause_s_last`: decoding stopped for the swap);
- the end-to-end update: from the push, right after an optimizer step, until the server serves the new version
  (`/health?wait_for_version`, asked once the send has returned; the next decode step samples on it).
In the same conditions (the server still generating), between this process and a child of it, the limit: a raw
gloo `broadcast` of the same bytes, one flat tensor, until the child has it. The table gives medians and each row's
end-to-end / raw; its last line, the worst ratio of the rows it ran.

With `--sharded-push`, each model is also pushed once from a trainer of two FSDP2 processes (`accelerate launch`,
`--trainer-processes 2`, benchmarks/weight_sync_on_ranks.py) to a home server, in buckets of `--bucket-mb`: the
push gathers one bucket at a time and sends it as the next is gathered, and the table gives the first process's
extra peak memory during the push (`benchmarking.peak_rss`) next to the model's size.

tiny-math runs on the home engine only: vLLM's CPU attention takes heads 32, 64, 80, ... wide, not its 16.
"""

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

import tyro

from lm_human_preference_details.benchmarking import (
    Device,
    device_env,
    git_commit,
    machine,
    markdown_table,
    run_logged,
    served,
)
from lm_human_preference_details.cli import main_with_user_errors
from lm_human_preference_details.grpo.protocol import WeightStaging

Transfer = Literal["per_tensor", "buckets"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FSDP2_CONFIG = os.path.join(ROOT, "configs", "accelerate", "fsdp2.yaml")
ON_RANKS = os.path.join(ROOT, "benchmarks", "weight_sync_on_ranks.py")


@dataclass
class Args:
    models: list[str] = field(default_factory=lambda: ["tiny-math", "smollm2-135m"])
    """models whose updates are timed"""
    engines: list[Literal["home", "vllm"]] = field(default_factory=lambda: ["home", "vllm"])
    """server engines (vLLM in its environment: `python -m lm_human_preference_details.grpo.serving.vllm_env`)"""
    dtypes: list[Literal["float32", "bfloat16"]] = field(default_factory=lambda: ["float32", "bfloat16"])
    """the servers' weights (the trainer casts once and sends them so)"""
    stagings: list[WeightStaging] = field(default_factory=lambda: ["staged", "in_place"])
    """the servers' `--weight-staging`"""
    transfers: list[Transfer] = field(default_factory=lambda: ["per_tensor", "buckets"])
    """one broadcast per tensor, and buckets of `bucket_mb`"""
    bucket_mb: float = 16.0
    """the bucketed transfer's bucket size (MiB)"""
    updates: int = 5
    """timed updates per row (medians)"""
    raw_repeats: int = 5
    """timed raw broadcasts per limit (median)"""
    sharded_push: bool = True
    """also push each model from two FSDP2 trainer processes and give the first one's extra peak memory"""
    device: Device = "cpu"
    """where the servers and the trainer's side run"""
    out_dir: str = "runs/weight_sync"
    """results.json, results.md and the servers' logs"""


def main(argv: list[str] | None = None) -> None:
    args = tyro.cli(Args, args=argv)
    os.makedirs(args.out_dir, exist_ok=True)
    rows: list[dict] = []
    sharded: list[dict] = []
    for model in args.models:
        for engine in args.engines:
            if engine == "vllm" and model == "tiny-math" and args.device == "cpu":
                continue  # vLLM's CPU attention does not take the tiny model's heads
            for dtype in args.dtypes:
                for staging in args.stagings:
                    rows += time_updates(args, model, engine, dtype, staging)
                    save(args, rows, sharded)
        if args.sharded_push:
            sharded.append(time_sharded_push(args, model))
            save(args, rows, sharded)
    print(markdown(args, rows, sharded))


def time_updates(args: Args, model: str, engine: str, dtype: str, staging: str) -> list[dict]:
    """One server of `engine` generating at full batch; its updates each way of `args.transfers`, then the raw
    limit of the same bytes: a row per transfer."""
    import torch

    from lm_human_preference_details.grpo.client import request_json
    from lm_human_preference_details.grpo.config import GRPOArgs, ProcessArgs, ServingArgs, TaskArgs
    from lm_human_preference_details.grpo.weights import WeightSender, buckets, parameter_specs, served_dtype
    from lm_human_preference_details.models import load_causal_lm

    settings = GRPOArgs(
        task=TaskArgs(model=model),
        serving=ServingArgs(server_batch_size=16, server_dtype=dtype, weight_staging=staging),
        processes=ProcessArgs(threads=1),
    )
    folder = os.path.join(args.out_dir, f"{model}_{engine}_{dtype}_{staging}")
    torch.set_num_threads(settings.torch_threads("trainer"))  # the launcher's share: more would fight gloo's threads
    with served(settings, engine, folder, args.device) as url:
        trainer_model = load_causal_lm(model).to(args.device)
        sent_dtype = served_dtype(url)
        specs = parameter_specs(trainer_model, sent_dtype)
        nbytes = sum(torch.Size(s.shape).numel() for s in specs) * sent_dtype.itemsize
        ways = {"per_tensor": 0, "buckets": int(args.bucket_mb * 2**20)}
        sender = WeightSender([url])
        stop_load = threading.Event()
        keep_generating(url, stop_load)
        timed: dict[str, list[dict]] = {way: [] for way in args.transfers}
        version = request_json("GET", f"{url}/health")["model_version"]
        try:
            for turn in range(1 + args.updates):  # the first round warms up
                for way in args.transfers:
                    version += 1
                    with torch.no_grad():
                        next(trainer_model.parameters()).add_(1e-3)
                    update = time_one_update(url, sender, trainer_model, version, sent_dtype, ways[way])
                    if turn:
                        timed[way].append(update)
            raw_s = raw_broadcast_s(nbytes, args.raw_repeats, args.device)
        finally:
            stop_load.set()
        rows = []
        for way in args.transfers:
            medians = {key: statistics.median(u[key] for u in timed[way]) for key in timed[way][0]}
            rows.append(
                {
                    "model": model,
                    "engine": engine,
                    "dtype": dtype,
                    "staging": staging,
                    "transfer": way,
                    "broadcasts": len(buckets(specs, ways[way])),
                    "mib_sent": nbytes / 2**20,
                    **medians,
                    "raw_s": raw_s,
                    "e2e_over_raw": medians["end_to_end_s"] / raw_s,
                }
            )
        return rows


def time_one_update(url: str, sender, model, version: int, dtype, bucket_bytes: int) -> dict:
    """One update of `model` to the server at `url`, timed from the trainer's side and the server's."""
    from lm_human_preference_details.grpo.client import request_json

    start = time.perf_counter()
    sender.push(model, version, dtype=dtype, bucket_bytes=bucket_bytes)
    pushed = time.perf_counter()
    assert sender.wait() == [], "the server was dropped: see its log"
    sent = time.perf_counter()
    health = request_json("GET", f"{url}/health?wait_for_version={version}&timeout_s=120", timeout_s=130)
    serving = time.perf_counter()
    assert health["model_version"] >= version, health
    metrics = request_json("GET", f"{url}/metrics")
    return {
        "snapshot_s": pushed - start,
        "send_s": sent - start,
        "receive_s": metrics["receive_s_last"],
        "pause_s": metrics["pause_s_last"],
        "end_to_end_s": serving - start,
    }


def keep_generating(url: str, stop: threading.Event, clients: int = 4) -> None:
    """`clients` threads that keep the server decoding at full batch (4 x n=4 sequences of 64 tokens at a time)
    until `stop` is set."""
    from lm_human_preference_details.grpo.client import ServerError, request_json

    def one() -> None:
        while not stop.is_set():
            try:
                request_json(
                    "POST", f"{url}/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 64, "n": 4, "ignore_eos": True}
                )
            except ServerError:
                return

    for _ in range(clients):
        threading.Thread(target=one, daemon=True).start()


RAW_RECEIVER = """
import os, sys, torch
from lm_human_preference_details.grpo.weights import WeightGroup
init_method, nbytes, rounds, device = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
group = WeightGroup(init_method, 1, 2)
buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
for _ in range(rounds):
    group.broadcast(buffer).wait()
    group.group.barrier().wait()
os._exit(0)  # past a gloo group's teardown, which can abort
"""


def raw_broadcast_s(nbytes: int, repeats: int, device: str) -> float:
    """The median seconds of a raw gloo broadcast of `nbytes` (one flat tensor) from this process to a child, each
    until the child has it (a barrier after it): what the transport alone takes, the limit of an update's bytes."""
    import torch

    from lm_human_preference_details.grpo.weights import WeightGroup, listening_store

    store = listening_store("127.0.0.1", 2)
    init_method = f"tcp://127.0.0.1:{store.port}"
    rounds = 1 + repeats  # the first warms up
    child = subprocess.Popen(
        [sys.executable, "-c", RAW_RECEIVER, init_method, str(nbytes), str(rounds), device], env=device_env(device)
    )
    group = WeightGroup(init_method, 0, 2, store=store)
    buffer = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        group.broadcast(buffer).wait()
        group.group.barrier().wait()
        times.append(time.perf_counter() - start)
    if child.wait(timeout=60) != 0:
        raise RuntimeError(f"the raw broadcast's receiver failed ({child.returncode})")
    return statistics.median(times[1:])


def time_sharded_push(args: Args, model: str) -> dict:
    """One push of `model` from two FSDP2 trainer processes to a home server (benchmarks/weight_sync_on_ranks.py):
    the first process's extra peak memory and the push's seconds."""
    from lm_human_preference_details.grpo.config import GRPOArgs, ProcessArgs, TaskArgs
    from lm_human_preference_details.grpo.launch import free_port
    from lm_human_preference_details.models import load_causal_lm

    settings = GRPOArgs(task=TaskArgs(model=model), processes=ProcessArgs(threads=1))
    folder = os.path.join(args.out_dir, f"{model}_sharded_push")
    with served(settings, "home", folder, args.device) as url:
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", FSDP2_CONFIG]
        launcher += ["--num_processes", "2", "--num_machines", "1", "--main_process_port", str(free_port())]
        launcher += ["--mixed_precision", "no", "--dynamo_backend", "no"]
        output = os.path.join(folder, "push.json")
        flags = ["--trainer-processes", "2", "--update-bucket-mb", f"{args.bucket_mb:g}", "--threads", "1"]
        command = [*launcher, ON_RANKS, model, url, output, *flags, "--wandb-mode", "disabled"]
        run_logged(command, os.path.join(folder, "push.log"), device_env(args.device))
    with open(output) as f:
        pushed = json.load(f)
    parameters = list(load_causal_lm(model).parameters())
    return {
        "model": model,
        "processes": 2,
        "model_mib": sum(p.numel() * p.element_size() for p in parameters) / 2**20,
        "largest_tensor_mib": max(p.numel() * p.element_size() for p in parameters) / 2**20,
        "extra_mib": pushed["extra_bytes"] / 2**20,
        "push_s": pushed["push_s"],
    }


def markdown(args: Args, rows: list[dict], sharded: list[dict] = ()) -> str:
    """results.md: the update table, the sharded push's (where it ran), and last, the worst end-to-end / raw."""
    cells = [
        [
            r["model"],
            r["engine"],
            r["dtype"],
            r["staging"],
            f"{r['broadcasts']} ({'one per tensor' if r['transfer'] == 'per_tensor' else f'{args.bucket_mb:g} MiB'})",
            f"{r['mib_sent']:.1f}",
            *(f"{r[key] * 1e3:.1f}" for key in ("send_s", "receive_s", "pause_s", "end_to_end_s", "raw_s")),
            f"{r['e2e_over_raw']:.2f}x",
        ]
        for r in rows
    ]
    header = ["model", "engine", "dtype", "staging", "broadcasts", "MiB sent", "trainer send (ms)"]
    header += ["server receive (ms)", "server pause (ms)", "end to end (ms)", "raw broadcast (ms)", "end to end / raw"]
    caption = (
        f"Weight updates while the server decodes, on {machine(args.device)}: medians of {args.updates} updates "
        f"each way; raw = one gloo broadcast of the same bytes, same conditions:"
    )
    lines = markdown_table(caption, header, cells)
    if sharded:
        caption = (
            f"A push from two FSDP2 trainer processes, gathered a bucket ({args.bucket_mb:g} MiB, or one larger "
            "tensor) at a time: the first process's extra peak memory during the push:"
        )
        header = ["model", "model (MiB)", "largest tensor (MiB)", "first process's extra peak (MiB)", "push (ms)"]
        cells = [
            [r["model"], f"{r['model_mib']:.1f}", f"{r['largest_tensor_mib']:.1f}", f"{r['extra_mib']:.1f}"]
            + [f"{r['push_s'] * 1e3:.0f}"]
            for r in sharded
        ]
        lines += ["", *markdown_table(caption, header, cells)]
    if rows:
        worst = max(rows, key=lambda r: r["e2e_over_raw"])
        lines += [
            "",
            f"worst end to end / raw: {worst['e2e_over_raw']:.2f}x ({worst['model']}, {worst['engine']}, "
            f"{worst['dtype']}, {worst['staging']}, {worst['transfer']})",
        ]
    return "\n".join(lines) + "\n"


def save(args: Args, rows: list[dict], sharded: list[dict]) -> None:
    """results.json and results.md as they stand (a benchmark stopped midway keeps its rows)."""
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump(
            {"args": dataclasses.asdict(args), "commit": git_commit(), "rows": rows, "sharded": sharded}, f, indent=2
        )
    with open(os.path.join(args.out_dir, "results.md"), "w") as f:
        f.write(markdown(args, rows, sharded))


if __name__ == "__main__":
    main_with_user_errors(main)()
