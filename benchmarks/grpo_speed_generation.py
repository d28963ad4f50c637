"""The generation table of benchmarks/grpo_speed.py: generation alone, a server per preset and engine getting
requests shaped as the actor's, and with vLLM its offline `LLM.generate` as the limit."""

import json
import os
import time
from typing import Literal

from grpo_speed_args import ROOT, Args

from lm_human_preference_details.benchmarking import device_env, markdown_table, run_logged, served

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
        "model": settings.task.model,
        "requests": args.generation_requests,
        "prompts_per_request": settings.request_problems(),
        "n": settings.sampling.group_size,
        "max_tokens": args.generation_tokens,
        "in_flight": args.generation_in_flight or settings.serving.max_in_flight,
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
            sampling = {"max_tokens": args.generation_tokens, "temperature": settings.sampling.temperature}
            payload = {"prompt": prompts, **sampling, "n": settings.sampling.group_size, "ignore_eos": True}
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
    from lm_human_preference_details.grpo.server_processes import ServerEngine, server_flags
    from lm_human_preference_details.grpo.serving import vllm_env

    settings = generation_settings(task)
    shape = generation_shape(args, task, settings)
    python = vllm_env.server_command()[0]  # a RuntimeError naming the command that makes the environment
    warm_up, *timed = generation_prompts(settings, 1 + args.generation_requests)
    folder = os.path.join(args.out_dir, "generation", task, "vllm_limit")
    os.makedirs(folder, exist_ok=True)
    prompts, result = os.path.join(folder, "prompts.json"), os.path.join(folder, "result.json")
    with open(prompts, "w") as f:
        json.dump({"warm_up": warm_up, "timed": [p for request in timed for p in request]}, f)
    flags = server_flags(settings, ServerEngine("vllm", folder).model_for_servers(settings.task.model), version=0, i=0)
    sampling = ["--n", str(settings.sampling.group_size), "--max-tokens", str(args.generation_tokens)]
    cmd = [python, os.path.join(ROOT, "benchmarks", "vllm_generate.py"), "--prompts", prompts, *sampling]
    cmd += ["--temperature", f"{settings.sampling.temperature!r}", "--out", result, "--", *flags]
    run_logged(cmd, os.path.join(folder, "vllm_generate.log"), dict(device_env(args.device), PYTHONPATH=ROOT), ROOT)
    with open(result) as f:
        limit = json.load(f)
    return {**shape, "engine": "vllm offline generate (limit)", **limit}


def generation_table(generation: list[dict]) -> list[str]:
    """The generation table's lines (none without rows): each row's samples/s, tokens/s, and the limit's tokens/s
    over its own where the task has a limit row."""
    if not generation:
        return []
    limits = {row["task"]: row for row in generation if row["engine"].endswith("(limit)")}
    rows = []
    for row in generation:
        limit = limits.get(row["task"])
        versus = f"{limit['tokens_per_s'] / row['tokens_per_s']:.2f}x" if limit else "-"
        shape = f"{row['requests']} x {row['prompts_per_request']} x {row['n']}"
        speed = [f"{row['samples_per_s']:.1f}", f"{row['tokens_per_s']:.0f}", versus]
        rows.append(
            [row["task"], row["model"], row["engine"], shape, str(row["max_tokens"]), str(row["in_flight"]), *speed]
        )
    header = ["preset", "model", "engine", "requests x prompts x n", "tokens", "in flight", "samples/s", "tokens/s"]
    caption = (
        "Generation alone: one server with every core gets completion requests shaped as the actor's (a request: "
        "its prompts x n samples, each `max_tokens` long past EOS), `in flight` at a time over HTTP, after one untimed "
        "request; the limit is vLLM's offline `LLM.generate` of the same prompts at once (the server's engine "
        "arguments and sampling, after an untimed generate):"
    )
    return ["", *markdown_table(caption, [*header, "limit / this (tokens/s)"], rows)]
