"""Pipelined vs synchronous GRPO, side by side in one run: same model, task and sample budget.

    python benchmarks/grpo_speed.py --task tiny --steps 200 --repeats 2 --out-dir benchmarks/results/grpo_speed

Runs `grpo.launch` in `pipeline` mode and in `sync` mode for each G of `--sync-steps`, `--repeats`
times in interleaved order (so that a slow spell of the machine hits every schedule alike), and
prints per schedule the median samples/s, tokens/s and mean lag, and the ratio pipeline / sync.
Then the weight update itself for each of `--update-models`: a server generating at full batch, the
trainer's broadcast (announce, one broadcast per tensor, until received) and the server's pause
(decoding stopped for the swap), median over `--updates` updates.

Throughput is samples trained / trainer wall time from its first wait for data to its last step.
"""

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import tyro

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
    out_dir: str = "runs/grpo_speed"
    """runs, results.json and results.md go here"""
    extra: list[str] = field(default_factory=list)
    """flags passed to every launch unchanged (e.g. --extra=--max-tokens --extra=32)"""


def schedules(args: Args) -> list[tuple[str, list[str]]]:
    return [("pipeline", ["--mode", "pipeline"])] + [(f"sync G={g}", ["--mode", "sync", "--sync-steps", str(g)]) for g in args.sync_steps]


def run_schedule(args: Args, name: str, flags: list[str], repeat: int) -> dict:
    out = os.path.join(args.out_dir, name.replace(" ", "_").replace("=", ""), f"run_{repeat}")
    cmd = [sys.executable, "-m", "lm_human_preference_details.grpo.launch", "--task", args.task, "--steps", str(args.steps),
           "--output-dir", out, "--wandb-mode", "disabled", "--save-interval", "0", *flags, *args.extra]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    elapsed = rows[-1]["time/elapsed_s"]
    tokens = sum(r["completion/length"] for r in rows) * rows[-1]["samples"] / len(rows)
    return {
        "samples_per_s": rows[-1]["samples"] / elapsed, "tokens_per_s": tokens / elapsed,
        "lag_mean": statistics.fmean(r["lag/mean"] for r in rows), "success_last_20": statistics.fmean(r["success/rate"] for r in rows[-20:]),
        "wait_data_s": sum(r["time/wait_data_s"] for r in rows), "elapsed_s": elapsed,
    }


def time_weight_updates(model: str, updates: int) -> dict:
    """A real server generating at full batch; the trainer side pushes `updates` new versions."""
    import torch

    from lm_human_preference_details.grpo.server import request_json, wait_until_serving
    from lm_human_preference_details.grpo.weights import WeightSender, free_port
    from lm_human_preference_details.models import load_causal_lm

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "lm_human_preference_details.grpo.server", "--model", model,
                               "--port", str(port), "--threads", "1", "--max-batch-size", "16"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(url, server)
        trainer_model = load_causal_lm(model)
        sender = WeightSender([url])
        busy = threading.Event()
        load = threading.Thread(target=_keep_generating, args=(url, busy), daemon=True)
        load.start()
        broadcast = []
        for version in range(1, updates + 1):
            with torch.no_grad():
                next(trainer_model.parameters()).add_(1e-3)
            start = time.perf_counter()
            sender.push(trainer_model, version)
            sender.wait()
            broadcast.append(time.perf_counter() - start)
        while request_json("GET", f"{url}/health")["model_version"] != updates:
            time.sleep(0.01)
        metrics = request_json("GET", f"{url}/metrics")
        busy.set()
        parameters = sum(p.numel() for p in trainer_model.parameters())
        return {"model": model, "parameters": parameters, "tensors": len(list(trainer_model.parameters())),
                "broadcast_s": statistics.median(broadcast), "pause_s": metrics["pause_s_mean"],
                "generated_tokens_meanwhile": metrics["generated_tokens"]}
    finally:
        server.terminate()
        server.wait(timeout=60)


def _keep_generating(url: str, stop: threading.Event) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from lm_human_preference_details.grpo.server import ServerError, request_json

    def one():
        while not stop.is_set():
            try:
                request_json("POST", f"{url}/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 64, "n": 4, "ignore_eos": True})
            except ServerError:
                return

    with ThreadPoolExecutor(4) as pool:
        for _ in range(4):
            pool.submit(one)


def markdown(args: Args, runs: dict[str, list[dict]], updates: list[dict]) -> str:
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    pipeline = med["pipeline"]
    lines = [f"GRPO `{args.task}` preset, {args.steps} optimizer steps per run, median of {args.repeats} runs per schedule, "
             f"{os.cpu_count()} CPU cores.", "",
             "| schedule | samples/s | tokens/s | mean lag (steps) | success, last 20 steps | pipeline / this (samples/s) |",
             "|---|---|---|---|---|---|"]
    for name, m in med.items():
        lines.append(f"| {name} | {m['samples_per_s']:.0f} | {m['tokens_per_s']:.0f} | {m['lag_mean']:.2f} | "
                     f"{m['success_last_20']:.2f} | {pipeline['samples_per_s'] / m['samples_per_s']:.2f}x |")
    if updates:
        lines += ["", "Weight update while the server decodes (median of the timed updates):", "",
                  "| model | parameters | tensors | trainer broadcast (s) | server pause (ms) |", "|---|---|---|---|---|"]
        for u in updates:
            lines.append(f"| {u['model']} | {u['parameters'] / 1e6:.1f}M | {u['tensors']} | {u['broadcast_s']:.3f} | {u['pause_s'] * 1e3:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = tyro.cli(Args, args=argv)
    os.makedirs(args.out_dir, exist_ok=True)
    runs: dict[str, list[dict]] = {name: [] for name, _ in schedules(args)}
    for repeat in range(args.repeats):
        for name, flags in schedules(args):
            runs[name].append(run_schedule(args, name, flags, repeat))
    updates = [time_weight_updates(model, args.updates) for model in args.update_models]
    table = markdown(args, runs, updates)
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump({"runs": runs, "updates": updates}, f, indent=2)
    with open(os.path.join(args.out_dir, "results.md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
