"""The weight-update table of benchmarks/grpo_speed.py: a server generating at full batch while the trainer side
pushes new weights, one broadcast per tensor and in buckets; the trainer's broadcast and the server's pause."""

import statistics
import threading
import time
from typing import Literal

from lm_human_preference_details.benchmarking import Device, markdown_table, served


def time_weight_updates(
    model: str, engine: Literal["home", "vllm"], updates: int, bucket_mb: float, device: Device, folder: str
) -> dict:
    """A real server of `engine` generating at full batch; the trainer side pushes 2 x `updates` new versions, in
    buckets of `bucket_mb` MiB and one broadcast per tensor by turns (the first, bucketed, warms up: medians are
    taken)."""
    import torch

    from lm_human_preference_details.grpo.client import request_json
    from lm_human_preference_details.grpo.config import GRPOArgs, ProcessArgs, ServingArgs, TaskArgs
    from lm_human_preference_details.grpo.weights import WeightSender, buckets, parameter_specs, served_dtype
    from lm_human_preference_details.models import load_causal_lm

    settings = GRPOArgs(
        task=TaskArgs(model=model), serving=ServingArgs(server_batch_size=16), processes=ProcessArgs(threads=1)
    )
    with served(settings, engine, folder, device) as url:
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


def updates_table(updates: list[dict]) -> list[str]:
    """The weight-update table's lines (none without rows): each model and engine, per tensor and bucketed."""
    if not updates:
        return []
    rows = []
    for u in updates:
        for name, count in (
            ("per_tensor", f"{u['tensors']} (one per tensor)"),
            ("bucketed", f"{u['broadcasts_bucketed']} ({u['bucket_mb']:g} MiB buckets)"),
        ):
            timed = [f"{u[name]['broadcast_s'] * 1e3:.1f}", f"{u[name]['pause_s'] * 1e3:.2f}"]
            rows.append([u["model"], u["engine"], f"{u['parameters'] / 1e6:.1f}M", count, *timed])
    header = ["model", "engine", "parameters", "broadcasts", "trainer broadcast (ms)", "server pause (ms)"]
    caption = (
        "Weight update while the server decodes (median of the timed updates; trainer broadcast = "
        "announce until received, server pause = decoding stopped for the swap):"
    )
    return ["", *markdown_table(caption, header, rows)]
