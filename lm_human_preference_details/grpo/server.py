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
"""

import asyncio
import contextlib
import json
import logging
import math
import os
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import tyro
from aiohttp import web

from lm_human_preference_details.cli import quiet_transformers
from lm_human_preference_details.grpo.engine import Engine, GenerationRequest
from lm_human_preference_details.grpo.lifetime import exit_now, exit_with_parent
from lm_human_preference_details.grpo.protocol import (
    MAX_CHOICES,
    MIN_TEMPERATURE,
    ParameterSpec,
    ServerDtype,
    WeightBackend,
)

log = logging.getLogger(__name__)


class BadRequest(ValueError):
    """A malformed request: answered with 400 and the reason."""


def _field(body: dict, name: str, kind: type, default, check=lambda v: True, need: str = ""):
    value = body.get(name, default)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool or not check(value):
        raise BadRequest(f"field {name!r}: expected {need or kind.__name__}, got {value!r}")
    return value


class InferenceServer:
    def __init__(self, model: torch.nn.Module, tokenizer, engine: Engine, model_name: str):
        from lm_human_preference_details.grpo.weights import DTYPE_NAMES, parameter_specs

        self.model, self.tokenizer, self.engine, self.model_name = model, tokenizer, engine, model_name
        self.specs = parameter_specs(model)
        self.dtype = DTYPE_NAMES[next(model.parameters()).dtype]
        self.weight_group = None
        self.announced_version = 0
        self.stale: str | None = None  # why the weights can no longer be updated, once they cannot
        # one receiver thread, so updates are received and swapped in the order announced (the
        # broadcasts are issued in that order); a daemon, so a stuck receive does not hold up shutdown
        self.receives: queue.Queue = queue.Queue()
        threading.Thread(target=_run_forever, args=(self.receives,), name="weights-receiver", daemon=True).start()
        self.requests = 0
        self.last_pause_s = 0.0
        self.started = time.time()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors_as_json], client_max_size=64 * 2**20)
        app.on_startup.append(self._on_startup)
        app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.post("/init_process_group", self.init_process_group),
                web.post("/request_weight_update", self.request_weight_update),
                web.get("/health", self.health),
                web.get("/metrics", self.metrics),
                web.get("/weights_digest", self.weights_digest),
            ]
        )
        app.on_cleanup.append(lambda _: asyncio.get_running_loop().run_in_executor(None, self.engine.stop))
        return app

    async def _on_startup(self, app) -> None:
        self.version_changed = asyncio.Condition()  # made on the serving loop

    async def completions(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        prompt = body.get("prompt")
        batched = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
        prompts_ids = (
            [self._prompt_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
            if batched
            else [self._prompt_ids(prompt, "prompt")]
        )
        choices = await self._generate(prompts_ids, body)
        return web.json_response(
            self._response(
                "text_completion",
                prompts_ids,
                batched,
                [
                    {
                        "index": i,
                        "text": self._text(g.token_ids),
                        "token_ids": g.token_ids,
                        "logprobs": {"tokens": self._pieces(g.token_ids), "token_logprobs": g.logprobs},
                        "model_versions": g.versions,
                        "finish_reason": g.finish_reason,
                    }
                    for i, g in enumerate(choices)
                ],
            )
        )

    def _prompt_ids(self, prompt, name: str) -> list[int]:
        if isinstance(prompt, str) and prompt:
            return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        raise BadRequest(
            f"field {name!r}: expected a non-empty string or a non-empty list of token ids"
            + (" (or a non-empty list of those)" if name == "prompt" else "")
        )

    async def chat_completions(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        messages = body.get("messages")
        if not (
            isinstance(messages, list)
            and messages
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
        ):
            raise BadRequest("field 'messages': expected a non-empty list of {role, content} strings")
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRequest(f"model {self.model_name} has no chat template: use /v1/completions")
        prompt_ids = list(
            self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        choices = await self._generate([prompt_ids], body)
        return web.json_response(
            self._response(
                "chat.completion",
                [prompt_ids],
                False,
                [
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": self._text(g.token_ids)},
                        "token_ids": g.token_ids,
                        "logprobs": {
                            "content": [
                                {"token": t, "logprob": lp} for t, lp in zip(self._pieces(g.token_ids), g.logprobs)
                            ]
                        },
                        "model_versions": g.versions,
                        "finish_reason": g.finish_reason,
                    }
                    for i, g in enumerate(choices)
                ],
            )
        )

    async def _generate(self, prompts_ids: list[list[int]], body: dict):
        """`n` generations of each prompt, prompt-major."""
        if self.stale:
            raise web.HTTPServiceUnavailable(reason=self.stale)
        stop = set(
            _field(
                body, "stop_token_ids", list, [], lambda v: all(isinstance(t, int) for t in v), "a list of token ids"
            )
        )
        if not _field(body, "ignore_eos", bool, False) and self.tokenizer.eos_token_id is not None:
            stop.add(self.tokenizer.eos_token_id)
        sampling = dict(
            max_new_tokens=_field(body, "max_tokens", int, 16, lambda v: v >= 1, "an integer >= 1"),
            temperature=_field(
                body,
                "temperature",
                float,
                1.0,
                lambda v: math.isfinite(v) and v >= MIN_TEMPERATURE,
                f"a finite number >= {MIN_TEMPERATURE} (sampling only)",
            ),
            stop_token_ids=frozenset(stop),
        )
        n = _field(body, "n", int, 1, lambda v: 1 <= v <= MAX_CHOICES, f"an integer in [1, {MAX_CHOICES}]")
        if n * len(prompts_ids) > MAX_CHOICES:
            raise BadRequest(
                f"fields 'prompt' and 'n': {len(prompts_ids)} prompts x n={n} exceeds {MAX_CHOICES} choices per request"
            )
        generations = [GenerationRequest(prompt_ids=ids, **sampling) for ids in prompts_ids]
        for i, generation in enumerate(generations):  # every prompt is checked before any is queued
            try:
                self.engine.check(generation)
            except ValueError as error:
                raise BadRequest(f"prompt {i}: {error}" if len(generations) > 1 else str(error)) from None
        futures = self.engine.submit_many([generation for generation in generations for _ in range(n)])
        self.requests += 1
        return await _all_results(futures)

    def _response(self, kind: str, prompts_ids: list[list[int]], batched: bool, choices: list[dict]) -> dict:
        completion_tokens = sum(len(c["token_ids"]) for c in choices)
        prompt_tokens = sum(len(p) for p in prompts_ids)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "prompt_token_ids": prompts_ids if batched else prompts_ids[0],
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def _text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _pieces(self, token_ids: list[int]) -> list[str]:
        """Each token as its vocabulary entry (one call, not a decode per token)."""
        return self.tokenizer.convert_ids_to_tokens(token_ids)

    async def init_process_group(self, request: web.Request) -> web.Response:
        from lm_human_preference_details.grpo.weights import WeightGroup

        body = await _json_body(request)
        init_method = _field(body, "init_method", str, None, need="a string tcp://HOST:PORT")
        rank = _field(body, "rank", int, None, lambda v: v >= 1, "an integer >= 1 (rank 0 is the trainer)")
        world_size = _field(body, "world_size", int, None, lambda v: v > rank, "an integer > rank")
        backend = _field(body, "backend", str, "gloo", lambda v: v in get_args(WeightBackend), "gloo or nccl")
        loop = asyncio.get_running_loop()
        try:  # blocks until the trainer joins: off the event loop
            self.weight_group = await loop.run_in_executor(None, WeightGroup, init_method, rank, world_size, backend)
        except (ValueError, RuntimeError) as error:
            raise BadRequest(f"cannot join the process group: {error}") from None
        return web.json_response({"ok": True, "rank": rank, "world_size": world_size})

    async def request_weight_update(self, request: web.Request) -> web.Response:
        from lm_human_preference_details.grpo.weights import load_tensors, mismatches, receive_tensors

        body = await _json_body(request)
        if self.weight_group is None:
            raise web.HTTPConflict(reason="no process group: POST /init_process_group first")
        latest = max(self.engine.version, self.announced_version)
        version = _field(
            body, "version", int, None, lambda v: v > latest, f"an integer above the latest version {latest}"
        )
        try:
            specs = [ParameterSpec.from_json(p) for p in _field(body, "parameters", list, None, need="a list")]
        except (KeyError, TypeError, ValueError) as error:
            raise BadRequest(f"field 'parameters': each entry needs name, shape and dtype ({error})") from None
        bucket_bytes = _field(
            body, "bucket_bytes", int, 0, lambda v: v >= 0, "an integer >= 0 (0: one broadcast per tensor)"
        )
        reasons = mismatches(self.specs, specs)
        if reasons:
            raise BadRequest(
                f"update refused, the old weights keep serving: {'; '.join(reasons[:10])}"
                + (f" (and {len(reasons) - 10} more)" if len(reasons) > 10 else "")
            )

        loop = asyncio.get_running_loop()
        device = next(self.model.parameters()).device

        def receive_then_swap() -> None:  # on a receiver thread: decoding goes on meanwhile
            try:
                tensors = receive_tensors(self.weight_group, specs, device, bucket_bytes)
            except Exception as error:  # the group is broken: no later update can arrive either
                first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                self.stale = (
                    f"receiving weights version {version} failed ({first_line}); this server's weights are out of date"
                )
                log.error(self.stale)
                return

            def apply_weights() -> int:
                load_tensors(self.model, specs, tensors)
                return version

            pause = self.engine.schedule_update(apply_weights)
            pause.add_done_callback(lambda done: loop.call_soon_threadsafe(self._update_done, done))

        self.announced_version = version
        self.receives.put(receive_then_swap)
        return web.json_response({"accepted": True, "version": version, "bucket_bytes": bucket_bytes})

    def _update_done(self, pause) -> None:
        if pause.exception() is not None:
            log.error("weight update failed, the old weights keep serving: %s", pause.exception())
            return
        self.last_pause_s = pause.result()

        async def announce():
            async with self.version_changed:
                self.version_changed.notify_all()

        asyncio.ensure_future(announce())

    async def health(self, request: web.Request) -> web.Response:
        """`?wait_for_version=N&timeout_s=T` holds the answer until version N serves (or T passes):
        an actor learns of new weights at once without polling in a tight loop."""
        if "wait_for_version" in request.query:
            try:
                version, timeout = int(request.query["wait_for_version"]), float(request.query.get("timeout_s", 10))
            except ValueError:
                raise BadRequest("wait_for_version must be an integer and timeout_s a number") from None
            if not timeout >= 0:  # nan too: asyncio would wait forever
                raise BadRequest(f"timeout_s must be a number >= 0, got {request.query['timeout_s']}")
            async with self.version_changed:
                with contextlib.suppress(asyncio.TimeoutError):  # then answer with the version serving
                    await asyncio.wait_for(
                        self.version_changed.wait_for(lambda: self.engine.version >= version), min(timeout, 60)
                    )
        if self.stale:
            return web.json_response(
                {"status": "stale", "error": self.stale, "model_version": self.engine.version}, status=503
            )
        return web.json_response(
            {
                "status": "ok",
                "model": self.model_name,
                "model_version": self.engine.version,
                "dtype": self.dtype,
                **self.engine.load(),
            }
        )

    async def metrics(self, request: web.Request) -> web.Response:
        stats = self.engine.stats
        updates = stats["updates"]
        return web.json_response(
            {
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
        )

    async def weights_digest(self, request: web.Request) -> web.Response:
        """SHA-256 of every parameter's bytes: to check that a server holds exactly the trainer's weights."""
        from lm_human_preference_details.grpo.weights import digest

        digests = await asyncio.wrap_future(self.engine.call_between_steps(lambda: digest(self.model)))
        return web.json_response({"model_version": self.engine.version, "digests": digests})


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


async def _json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("the body is not JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


@web.middleware
async def _errors_as_json(request: web.Request, handler):
    try:
        return await handler(request)
    except BadRequest as error:
        return web.json_response({"error": str(error)}, status=400)
    except web.HTTPException as error:
        return web.json_response({"error": error.reason}, status=error.status)


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
    family = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)[0][0]
    listening = socket.create_server((args.host, args.port), family=family)  # bound here: port 0 can be read back
    port = listening.getsockname()[1]
    if args.port_file:  # written whole, then renamed: a reader never sees half of it
        with open(args.port_file + ".tmp", "w") as f:
            f.write(str(port))
        os.replace(args.port_file + ".tmp", args.port_file)
    host = f"[{args.host}]" if ":" in args.host else args.host  # an IPv6 address goes in brackets in a URL
    log.info("serving %s on http://%s:%d (pid %d)", args.model, host, port, os.getpid())
    web.run_app(server.app(), sock=listening, print=None, access_log=None)  # until SIGTERM or SIGINT
    exit_now(0)  # it may have joined the trainer's gloo groups


if __name__ == "__main__":
    main()
