"""Inference server: OpenAI-style completions from the engine, plus the weight-update contract.

    python -m lm_human_preference_details.grpo.serving.server --model tiny-math --port 8000
    python -m lm_human_preference_details.grpo.serving.server --model tiny-math --port 0 --port-file PATH  # OS's port

Endpoints (docs/DESIGN.md, "The GRPO pipeline contract"; its constants and types: `grpo.protocol`):
- `POST /v1/completions` {prompt: str | [token ids] | [str] | [[token ids]], max_tokens, temperature, n,
  stop, stop_token_ids, ignore_eos, logprobs, stream, ...}. A list of prompts (OpenAI's batch form) gets `n`
  choices per prompt, prompt-major (choice `index` = prompt index * n + attempt), and `prompt_token_ids` one
  list per prompt.
- `POST /v1/chat/completions` {messages: [{role, content}], ...same sampling fields, top_logprobs}
  Both return per choice the token ids, per-token logprobs (at the sampling temperature) and
  `model_versions`, the weight version that sampled each token; the fields they take, and the 400 for any
  other, are `request_checks`' (the OpenAI SDK works against them). With `stream: true` the engine hands each
  request its new tokens after every decode step and they go out as chunks (`replies.send_stream`).
  `GET /v1/models` lists the model.
- `POST /init_process_group` {init_method, rank, world_size, backend, timeout_s}: join the trainer's group
  (with the control token, `--token-file` or $GRPO_SERVER_TOKEN, when the server has one).
- `POST /request_weight_update` {version, parameters: [{name, shape, dtype}], bucket_bytes}: checked
  against the model before anything is received (a mismatch is refused with 400 and the old weights
  keep serving, as when the broadcast does not all arrive); on 200 a receiver thread takes the broadcast
  (one per tensor, or with bucket_bytes > 0 one per flat bucket of consecutive tensors, `weights.buckets`)
  into buffers of its own while decoding goes on, then the engine swaps them all in between two decode steps:
  decoding pauses only for a pointer swap per parameter (`--weight-staging in_place`: for a copy of each),
  and sequences in flight keep their KV cache.
- `GET /health` (`?wait_for_version=N` long-polls until version N serves), `GET /metrics` (JSON counters:
  tokens, requests, updates, pause per update), `GET /weights_digest` (SHA-256 of each parameter: is this
  exactly the trainer's model?).
Malformed requests get a 4xx with the reason; the server stays up.
The HTTP side (routes, request checks, replies) is `http_contract`'s, shared with `vllm_server.py`; this module gives
it the engine's part.
"""

import asyncio
import contextlib
import dataclasses
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

from lm_human_preference_details.cli import main_with_user_errors, quiet_transformers
from lm_human_preference_details.grpo.lifetime import exit_now, exit_with_parent
from lm_human_preference_details.grpo.protocol import ParameterSpec, ServerDtype, WeightStaging
from lm_human_preference_details.grpo.serving.control import LOOPBACK_ACCESS, ControlAccess, RendezvousTimeout
from lm_human_preference_details.grpo.serving.engine import Engine, Generation, GenerationRequest
from lm_human_preference_details.grpo.serving.http_contract import (
    RUNNER_OPTIONS,
    ContractServer,
    first_line,
    listen,
    queued_deltas,
)
from lm_human_preference_details.grpo.serving.replies import StopStrings
from lm_human_preference_details.grpo.serving.request_checks import BadRequest, Sampling

log = logging.getLogger(__name__)


class InferenceServer(ContractServer):
    """The contract (`grpo.serving.http_contract`) over the home-made engine, which owns the model."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        engine: Engine,
        model_name: str,
        access: ControlAccess = LOOPBACK_ACCESS,
        staging: WeightStaging = "staged",
    ):
        from lm_human_preference_details.grpo.weights import DTYPE_NAMES, BufferPool, parameter_specs

        dtype = DTYPE_NAMES[next(model.parameters()).dtype]
        super().__init__(tokenizer, model_name, dtype, parameter_specs(model), engine.version, access)
        self.model, self.engine, self.staging = model, engine, staging
        self.weight_group = None
        # the flat buffers that the parameters' data are views of (staged, after an update), and those free to
        # receive the next update into: on a CPU, writing fresh memory costs more than the transfer
        self.serving_buffers: list[torch.Tensor] = []
        self.buffers = BufferPool()
        # one receiver thread, so updates are received and swapped in the order announced (the
        # broadcasts are issued in that order); a daemon, so a stuck receive does not hold up shutdown
        self.receives: queue.Queue = queue.Queue()
        threading.Thread(target=_run_forever, args=(self.receives,), name="weights-receiver", daemon=True).start()
        self.last_pause_s = self.last_receive_s = 0.0

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
            stops_at=StopStrings(self.tokenizer, sampling.stop) if sampling.stop else None,
            top_logprobs=sampling.top_logprobs,
        )
        self.engine.check(generation)
        return generation

    async def generate(self, prepared: list[GenerationRequest], sampling: Sampling) -> list[Generation]:
        futures = self.engine.submit_many([generation for generation in prepared for _ in range(sampling.n)])
        try:
            return await _all_results(futures)
        except asyncio.CancelledError:  # the client went away: its sequences stop, running ones too
            self.engine.drop(futures)
            raise

    async def stream(self, prepared: list[GenerationRequest], sampling: Sampling):
        loop = asyncio.get_running_loop()
        steps: asyncio.Queue = asyncio.Queue()

        def watch(deltas: list[tuple[int, Generation]]) -> None:  # on the engine thread, once per step
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody reads on
                loop.call_soon_threadsafe(steps.put_nowait, deltas)

        futures = self.engine.submit_many([generation for generation in prepared for _ in range(sampling.n)], watch)
        ended = asyncio.ensure_future(_all_results(futures))  # after the last step's put: `watch` comes first
        try:
            async for step in queued_deltas(steps, ended, len(futures)):
                yield step
        finally:  # finished ones are left alone; a client that went away has its sequences stopped
            self.engine.drop(futures)
            ended.cancel()

    async def join_group(self, init_method: str, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
        import torch.distributed as dist

        from lm_human_preference_details.grpo.weights import WeightGroup

        try:  # waits for the trainer's side: on a thread that a stopping server does not wait for
            self.weight_group = await _in_daemon_thread(WeightGroup, init_method, rank, world_size, backend, timeout_s)
        except (dist.DistNetworkError, dist.DistStoreError) as error:
            raise RendezvousTimeout(
                f"no weight group formed at {init_method} within {timeout_s:g} s ({first_line(error)}): is the "
                f"trainer's side listening there? (/init_process_group's timeout_s sets the wait)"
            ) from None
        except (ValueError, RuntimeError) as error:
            raise BadRequest(f"cannot join the process group: {first_line(error)}") from None

    def start_update(self, version: int, specs: list[ParameterSpec], bucket_bytes: int) -> None:
        from lm_human_preference_details.grpo.weights import buckets, install_tensors, receive_buckets, unflatten

        loop = asyncio.get_running_loop()
        device = next(self.model.parameters()).device
        group = self.weight_group

        def receive_then_swap() -> None:  # on a receiver thread: decoding goes on meanwhile
            if self.weight_group is not group:
                self.roll_back(version, "an earlier update broke its weight group")
                return
            start = time.perf_counter()
            try:  # into buffers of their own: the model is untouched until every tensor has arrived
                flat = receive_buckets(group, specs, device, bucket_bytes, self.buffers)
            except Exception as error:  # the sender died or never sent (the group's timeout): no later update of
                if self.weight_group is group:  # this group can arrive either
                    self.weight_group = None
                self.roll_back(version, f"receiving failed: {first_line(error)}")
                return
            self.last_receive_s = time.perf_counter() - start
            tensors = unflatten(flat, specs, buckets(specs, bucket_bytes))

            def apply_weights() -> int:
                install_tensors(self.model, specs, tensors, self.staging)
                if self.staging == "staged":  # the received buffers serve now; those they replace are free
                    retired, self.serving_buffers = self.serving_buffers, flat
                else:
                    retired = flat
                self.buffers.give(retired)
                return version

            pause = self.engine.schedule_update(apply_weights)
            pause.add_done_callback(lambda done: loop.call_soon_threadsafe(self._update_done, done))

        self.receives.put(receive_then_swap)

    def _update_done(self, pause) -> None:
        if pause.exception() is not None:  # failed within the swap or the copy: some parameters may be new
            self.mark_stale(
                f"a weight update failed while loading ({first_line(pause.exception())}); this server's "
                "weights are out of date"
            )
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
            "receive_s_last": self.last_receive_s,
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
    await all_done
    return [future.result() for future in futures]


async def _in_daemon_thread(function, *args):
    """`function(*args)` on a thread of its own that a stopping server does not wait for (asyncio joins its default
    executor's threads at exit: a rendezvous that never comes would hold the exit up for its whole timeout)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(set_outcome, outcome) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
            loop.call_soon_threadsafe(lambda: done.done() or set_outcome(outcome))

    def run() -> None:
        try:
            result = function(*args)
        except Exception as error:
            settle(done.set_exception, error)
        else:
            settle(done.set_result, result)

    threading.Thread(target=run, name=f"{getattr(function, '__name__', 'call')}-thread", daemon=True).start()
    return await done


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
    token_file: str = ""
    """a file holding the control token that /init_process_group and /request_weight_update require (default:
    $GRPO_SERVER_TOKEN; one of them is required with a --host beyond loopback)"""
    rendezvous_allow: list[str] = dataclasses.field(default_factory=list)
    """addresses or networks (10.0.0.0/8) that /init_process_group may name (default: loopback when --host is
    loopback, else any)"""
    weight_staging: WeightStaging = "staged"
    """`staged`: the paused decoder only swaps each parameter's data for the received tensor; `in_place`: it copies
    the received tensors into the model (the pause grows with the model; the memory is the same on this engine)"""


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


@main_with_user_errors  # one `error:` line, the last of its log, which the launcher repeats
def main() -> None:
    args = tyro.cli(Args)
    access = ControlAccess.for_server(args.host, args.token_file, args.rendezvous_allow)
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
    server = InferenceServer(model, tokenizer, engine, args.model, access, args.weight_staging)
    listening, url = listen(args.host, args.port, args.port_file)
    log.info("serving %s on %s (pid %d)", args.model, url, os.getpid())
    web.run_app(server.app(), sock=listening, print=None, access_log=None, **RUNNER_OPTIONS)  # until SIGTERM/SIGINT
    exit_now(0)  # it may have joined the trainer's gloo groups


if __name__ == "__main__":
    main()
