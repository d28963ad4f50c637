"""Inference server: OpenAI-style completions from the engine, plus the weight-update contract.

    python -m lm_human_preference_details.grpo.server --model tiny-math --port 8000
    python -m lm_human_preference_details.grpo.server --model tiny-math --port 0 --port-file PATH  # a port the OS picks

Endpoints (docs/DESIGN.md, "The GRPO pipeline contract"; its constants and types: `grpo.protocol`):
- `POST /v1/completions` {prompt: str | [token ids] | [str] | [[token ids]], max_tokens, temperature, n,
  stop_token_ids, ignore_eos}. A list of prompts (OpenAI's batch form) gets `n` choices per prompt,
  prompt-major (choice `index` = prompt index * n + attempt), and `prompt_token_ids` one list per prompt.
- `POST /v1/chat/completions` {messages: [{role, content}], ...same sampling fields}
  Both return per choice the token ids, per-token logprobs (at the sampling temperature) and
  `model_versions`, the weight version that sampled each token.
- `POST /init_process_group` {init_method, rank, world_size, backend}: join the trainer's group.
- `POST /request_weight_update` {version, parameters: [{name, shape, dtype}], bucket_bytes}: checked
  against the model before anything is received (a mismatch is refused with 400 and the old weights
  keep serving); on 200 a receiver thread takes the broadcast (one per tensor, or with bucket_bytes > 0
  one per flat bucket of consecutive tensors, `weights.buckets`) into fresh buffers while
  decoding goes on, then the engine swaps them all in between two decode steps: decoding pauses
  only for the copy, and sequences in flight keep their KV cache.
- `GET /health` (`?wait_for_version=N` long-polls until version N serves), `GET /metrics` (JSON counters:
  tokens, requests, updates, pause per update), `GET /weights_digest` (SHA-256 of each parameter: is this
  exactly the trainer's model?).
Malformed requests get a 4xx with the reason; the server stays up.
The HTTP side (routes, request checks, replies) is `grpo.http_contract`'s, shared with `grpo/vllm_server.py`;
this module gives it the engine's part.
"""

import asyncio
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Literal

import torch
import tyro
from aiohttp import web

from lm_human_preference_details.cli import quiet_transformers
from lm_human_preference_details.grpo.engine import Engine, Generation, GenerationRequest
from lm_human_preference_details.grpo.http_contract import BadRequest, ContractServer, Sampling, listen
from lm_human_preference_details.grpo.lifetime import exit_now, exit_with_parent
from lm_human_preference_details.grpo.protocol import ParameterSpec, ServerDtype

log = logging.getLogger(__name__)


class InferenceServer(ContractServer):
    """The contract (`grpo.http_contract`) over the home-made engine, which owns the model."""

    def __init__(self, model: torch.nn.Module, tokenizer, engine: Engine, model_name: str):
        from lm_human_preference_details.grpo.weights import DTYPE_NAMES, parameter_specs

        dtype = DTYPE_NAMES[next(model.parameters()).dtype]
        super().__init__(tokenizer, model_name, dtype, parameter_specs(model), engine.version)
        self.model, self.engine = model, engine
        self.weight_group = None
        # one receiver thread, so updates are received and swapped in the order announced (the
        # broadcasts are issued in that order); a daemon, so a stuck receive does not hold up shutdown
        self.receives: queue.Queue = queue.Queue()
        threading.Thread(target=_run_forever, args=(self.receives,), name="weights-receiver", daemon=True).start()
        self.last_pause_s = 0.0

    @property
    def version(self) -> int:
        return self.engine.version

    def app(self) -> web.Application:
        app = super().app()
        app.on_cleanup.append(lambda _: asyncio.get_running_loop().run_in_executor(None, self.engine.stop))
        return app

    def prepare(self, prompt_ids: list[int], sampling: Sampling) -> GenerationRequest:
        generation = GenerationRequest(
            prompt_ids=prompt_ids,
            max_new_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            stop_token_ids=sampling.stop_token_ids,
        )
        self.engine.check(generation)
        return generation

    async def generate(self, prepared: list[GenerationRequest], sampling: Sampling) -> list[Generation]:
        futures = self.engine.submit_many([generation for generation in prepared for _ in range(sampling.n)])
        return await _all_results(futures)

    async def join_group(self, init_method: str, rank: int, world_size: int, backend: str) -> None:
        from lm_human_preference_details.grpo.weights import WeightGroup

        loop = asyncio.get_running_loop()
        try:  # blocks until the trainer joins: off the event loop
            self.weight_group = await loop.run_in_executor(None, WeightGroup, init_method, rank, world_size, backend)
        except (ValueError, RuntimeError) as error:
            raise BadRequest(f"cannot join the process group: {error}") from None

    def start_update(self, version: int, specs: list[ParameterSpec], bucket_bytes: int) -> None:
        from lm_human_preference_details.grpo.weights import load_tensors, receive_tensors

        loop = asyncio.get_running_loop()
        device = next(self.model.parameters()).device

        def receive_then_swap() -> None:  # on a receiver thread: decoding goes on meanwhile
            try:
                tensors = receive_tensors(self.weight_group, specs, device, bucket_bytes)
            except Exception as error:  # the group is broken: no later update can arrive either
                first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                self.mark_stale(
                    f"receiving weights version {version} failed ({first_line}); this server's weights are out of date"
                )
                return

            def apply_weights() -> int:
                load_tensors(self.model, specs, tensors)
                return version

            pause = self.engine.schedule_update(apply_weights)
            pause.add_done_callback(lambda done: loop.call_soon_threadsafe(self._update_done, done))

        self.receives.put(receive_then_swap)

    def _update_done(self, pause) -> None:
        if pause.exception() is not None:
            log.error("weight update failed, the old weights keep serving: %s", pause.exception())
            return
        self.last_pause_s = pause.result()
        asyncio.ensure_future(self.announce_version())

    def load(self) -> dict[str, int]:
        return self.engine.load()

    async def metrics(self) -> dict:
        stats = self.engine.stats
        updates = stats["updates"]
        return {
            "model_version": self.engine.version,
            "dtype": self.dtype,
            "requests": self.requests,
            "uptime_s": time.time() - self.started,
            "completed_sequences": stats["completed"],
            "generated_tokens": stats["generated_tokens"],
            "prefill_tokens": stats["prefill_tokens"],
            "weight_updates": updates,
            "decode_batch_mean": stats["decode_rows"] / stats["decode_steps"] if stats["decode_steps"] else 0.0,
            "pause_s_total": stats["pause_s_total"],
            "pause_s_last": self.last_pause_s,
            "pause_s_mean": stats["pause_s_total"] / updates if updates else 0.0,
            **self.engine.load(),
        }

    async def weights_digest(self) -> dict:
        from lm_human_preference_details.grpo.weights import digest

        digests = await asyncio.wrap_future(self.engine.call_between_steps(lambda: digest(self.model)))
        return {"model_version": self.engine.version, "digests": digests}


async def _all_results(futures: list) -> list:
    """The results of these engine futures, with one wake-up of the event loop when the last is
    done (`asyncio.wrap_future` wakes it once per future: per sample, not per request)."""
    if not futures:
        return []
    loop = asyncio.get_running_loop()
    all_done = loop.create_future()
    remaining = len(futures)
    lock = threading.Lock()

    def count(_) -> None:
        nonlocal remaining
        with lock:
            remaining -= 1
            last = remaining == 0
        if last:
            loop.call_soon_threadsafe(lambda: all_done.done() or all_done.set_result(None))

    for future in futures:
        future.add_done_callback(count)
    try:
        await all_done
    except asyncio.CancelledError:  # the client went away: queued samples are dropped before they start
        for future in futures:
            future.cancel()
        raise
    return [future.result() for future in futures]


def _run_forever(calls: queue.Queue) -> None:
    while True:
        calls.get()()


@dataclass
class Args:
    """An inference server for the GRPO pipeline."""

    model: str = "tiny-math"
    """model name or folder (`tiny-math`, `smollm2-135m`, a hub name or a save_pretrained folder)"""
    host: str = "127.0.0.1"
    """address to bind (one address; a name binds the first it resolves to): loopback unless you mean to
    serve other hosts (0.0.0.0)"""
    port: int = 8000
    """port to listen on (0: one the OS picks; the log and `--port-file` say which)"""
    port_file: str = ""
    """once listening, write the port to this file (how whoever started the server learns a picked port)"""
    max_batch_size: int = 64
    """sequences decoded together; a finished one's slot is refilled from the queue"""
    seed: int = 0
    """sampling seed"""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto`: CUDA when there is a GPU"""
    dtype: ServerDtype = "auto"
    """the weights' precision: `auto` is bfloat16 on a GPU, float32 on the CPU (see grpo.launch's `--server-dtype`)"""
    threads: int = 0
    """torch CPU threads (0: torch's default, every core; grpo.launch passes each server its share)"""
    version: int = 0
    """weight version of the loaded model (a resumed run's checkpoint is at its step)"""
    exit_with_parent: bool = False
    """stop when the process that started this one dies (set by grpo.launch)"""


def load_for_inference(name_or_path: str, device: str, dtype: ServerDtype = "auto"):
    """Model and tokenizer, with SDPA attention; `dtype` `auto`: float32 on the CPU (bitwise the trainer's weights),
    bfloat16 on a GPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lm_human_preference_details.assets import resolve_model_path
    from lm_human_preference_details.grpo.weights import DTYPES
    from lm_human_preference_details.models import pretrained_config

    path = resolve_model_path(name_or_path)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    model = AutoModelForCausalLM.from_pretrained(
        path, config=pretrained_config(path), dtype=DTYPES[dtype], attn_implementation="sdpa"
    ).to(device)
    return model, AutoTokenizer.from_pretrained(path)


def main() -> None:
    args = tyro.cli(Args)
    if args.exit_with_parent:
        exit_with_parent()
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_transformers()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s server %(message)s")
    model, tokenizer = load_for_inference(args.model, args.device, args.dtype)
    engine = Engine(model, args.max_batch_size, seed=args.seed, vocab_size=len(tokenizer))
    engine.version = args.version
    engine.start()
    server = InferenceServer(model, tokenizer, engine, args.model)
    listening, url = listen(args.host, args.port, args.port_file)
    log.info("serving %s on %s (pid %d)", args.model, url, os.getpid())
    web.run_app(server.app(), sock=listening, print=None, access_log=None)  # until SIGTERM or SIGINT
    exit_now(0)  # it may have joined the trainer's gloo groups


if __name__ == "__main__":
    main()
