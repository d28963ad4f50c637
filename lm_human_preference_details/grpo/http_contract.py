"""The HTTP side of the GRPO pipeline contract (docs/DESIGN.md, "The GRPO pipeline contract"), one home for both
servers, `grpo/server.py` (the home-made engine) and `grpo/vllm_server.py` (vLLM): the routes, JSON bodies and
their 400s, the checks of every request field, the replies of /v1/completions and /v1/chat/completions (choices,
token ids, logprobs, `model_versions`, usage), the /health long-poll, /init_process_group's and
/request_weight_update's checks, and the error middleware. A server subclasses `ContractServer` and supplies its
engine's part: `prepare` and `generate` a completion, `join_group`, `start_update`, `load`, `metrics`,
`weights_digest`.

The standard library, aiohttp and `grpo.protocol` only: the vLLM environment has none of the project's other
dependencies (grpo.weights, torch's, is imported where an update is checked: both servers have torch).
"""

import abc
import asyncio
import contextlib
import json
import logging
import math
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import get_args

from aiohttp import web

from lm_human_preference_details.grpo.protocol import MAX_CHOICES, MIN_TEMPERATURE, ParameterSpec, WeightBackend


class BadRequest(ValueError):
    """A malformed request: answered with 400 and the reason."""


@dataclass(frozen=True)
class Sampling:
    """A completion request's sampling fields, checked."""

    max_tokens: int
    temperature: float
    stop_token_ids: frozenset[int]
    """the request's, plus EOS unless it says `ignore_eos` (the stop token is kept in the output)"""
    n: int
    """samples of each prompt"""


@dataclass
class Sample:
    """One sampled sequence, as `ContractServer.generate` gives it back (`engine.Generation` has these fields)."""

    token_ids: list[int]
    logprobs: list[float]
    """of each sampled token, at the sampling temperature"""
    versions: list[int]
    """the weight version that sampled each token"""
    finish_reason: str
    """`stop` or `length`"""


class ContractServer(abc.ABC):
    """The contract's routes over an engine. A subclass gives `version` (the weight version serving: an attribute
    or a property) and the abstract methods; this class keeps what the contract's checks read."""

    version: int

    def __init__(self, tokenizer, model_name: str, dtype: str, specs: list[ParameterSpec], version: int):
        self.tokenizer, self.model_name, self.dtype = tokenizer, model_name, dtype
        self.specs = specs
        """the parameters an update must name, with their shapes and dtypes"""
        self.announced_version = version
        self.has_group = False
        self.stale: str | None = None  # why the weights can no longer be updated, once they cannot
        self.requests = 0
        self.started = time.time()
        self.version_changed = asyncio.Condition()  # bound to the serving loop at its first use
        self._loop: asyncio.AbstractEventLoop | None = None  # the serving loop, once the app starts

    # -- the engine's part ----------------------------------------------------------------------------------------

    @abc.abstractmethod
    def prepare(self, prompt_ids: list[int], sampling: Sampling):
        """The engine's checks of one prompt (ValueError, saying why) and what `generate` takes for it."""

    @abc.abstractmethod
    async def generate(self, prepared: list, sampling: Sampling) -> list[Sample]:
        """`sampling.n` samples of each prepared prompt, prompt-major."""

    @abc.abstractmethod
    async def join_group(self, init_method: str, rank: int, world_size: int, backend: str) -> None:
        """Join the trainer's weight group (blocks until the trainer's side joins); BadRequest if it cannot."""

    @abc.abstractmethod
    def start_update(self, version: int, specs: list[ParameterSpec], bucket_bytes: int) -> None:
        """Receive and apply an accepted update after those announced before it (the trainer broadcasts in that
        order), then `announce_version`; set `stale` if it fails."""

    @abc.abstractmethod
    def load(self) -> dict[str, int]:
        """`active` and `queued` sequences, for /health and /metrics."""

    @abc.abstractmethod
    async def metrics(self) -> dict:
        """/metrics' JSON counters."""

    @abc.abstractmethod
    async def weights_digest(self) -> dict:
        """/weights_digest's `{model_version, digests}`."""

    def engine_error(self) -> str | None:
        """Why the engine cannot serve any more (/health answers 503), if it cannot."""
        return None

    async def announce_version(self) -> None:
        """Wake the /health long-polls: call it on the serving loop when a new version serves."""
        async with self.version_changed:
            self.version_changed.notify_all()

    def mark_stale(self, reason: str) -> None:
        """The weights can no longer be updated: /health and completions say `reason` with 503 from now on, and
        the /health long-polls answer at once. Safe from any thread (the home server's receiver is one)."""
        self.stale = reason
        logging.getLogger("grpo.server").error(reason)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self.announce_version()))

    # -- the routes -------------------------------------------------------------------------------------------------

    async def _remember_loop(self, app: web.Application) -> None:
        self._loop = asyncio.get_running_loop()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors_as_json], client_max_size=64 * 2**20)
        app.on_startup.append(self._remember_loop)
        app.add_routes(
            [
                web.post("/v1/completions", self._completions),
                web.post("/v1/chat/completions", self._chat_completions),
                web.post("/init_process_group", self._init_process_group),
                web.post("/request_weight_update", self._request_weight_update),
                web.get("/health", self._health),
                web.get("/metrics", self._metrics),
                web.get("/weights_digest", self._weights_digest),
            ]
        )
        return app

    async def _completions(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        prompt = body.get("prompt")
        batched = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
        prompts_ids = (
            [self._prompt_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
            if batched
            else [self._prompt_ids(prompt, "prompt")]
        )
        samples = await self._sample(prompts_ids, body)
        choices = [
            {
                "index": i,
                "text": self._text(s.token_ids),
                "token_ids": s.token_ids,
                "logprobs": {"tokens": self._pieces(s.token_ids), "token_logprobs": s.logprobs},
                "model_versions": s.versions,
                "finish_reason": s.finish_reason,
            }
            for i, s in enumerate(samples)
        ]
        return web.json_response(self._response("text_completion", prompts_ids, batched, choices))

    def _prompt_ids(self, prompt, name: str) -> list[int]:
        if isinstance(prompt, str) and prompt:
            return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        raise BadRequest(
            f"field {name!r}: expected a non-empty string or a non-empty list of token ids"
            + (" (or a non-empty list of those)" if name == "prompt" else "")
        )

    async def _chat_completions(self, request: web.Request) -> web.Response:
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
        samples = await self._sample([prompt_ids], body)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": self._text(s.token_ids)},
                "token_ids": s.token_ids,
                "logprobs": {
                    "content": [{"token": t, "logprob": lp} for t, lp in zip(self._pieces(s.token_ids), s.logprobs)]
                },
                "model_versions": s.versions,
                "finish_reason": s.finish_reason,
            }
            for i, s in enumerate(samples)
        ]
        return web.json_response(self._response("chat.completion", [prompt_ids], False, choices))

    async def _sample(self, prompts_ids: list[list[int]], body: dict) -> list[Sample]:
        """`n` samples of each prompt, prompt-major."""
        if self.stale:
            raise web.HTTPServiceUnavailable(reason=self.stale)
        stop = set(
            _field(
                body, "stop_token_ids", list, [], lambda v: all(isinstance(t, int) for t in v), "a list of token ids"
            )
        )
        if not _field(body, "ignore_eos", bool, False) and self.tokenizer.eos_token_id is not None:
            stop.add(self.tokenizer.eos_token_id)
        max_tokens = _field(body, "max_tokens", int, 16, lambda v: v >= 1, "an integer >= 1")
        temperature = _field(
            body,
            "temperature",
            float,
            1.0,
            lambda v: math.isfinite(v) and v >= MIN_TEMPERATURE,
            f"a finite number >= {MIN_TEMPERATURE} (sampling only)",
        )
        n = _field(body, "n", int, 1, lambda v: 1 <= v <= MAX_CHOICES, f"an integer in [1, {MAX_CHOICES}]")
        if n * len(prompts_ids) > MAX_CHOICES:
            raise BadRequest(
                f"fields 'prompt' and 'n': {len(prompts_ids)} prompts x n={n} exceeds {MAX_CHOICES} choices per request"
            )
        sampling = Sampling(max_tokens, temperature, frozenset(stop), n)
        prepared = []
        for i, ids in enumerate(prompts_ids):  # every prompt is checked before any is queued
            try:
                prepared.append(self.prepare(ids, sampling))
            except ValueError as error:
                raise BadRequest(f"prompt {i}: {error}" if len(prompts_ids) > 1 else str(error)) from None
        self.requests += 1
        return await self.generate(prepared, sampling)

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

    async def _init_process_group(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        init_method = _field(body, "init_method", str, None, need="a string tcp://HOST:PORT")
        rank = _field(body, "rank", int, None, lambda v: v >= 1, "an integer >= 1 (rank 0 is the trainer)")
        world_size = _field(body, "world_size", int, None, lambda v: v > rank, "an integer > rank")
        backend = _field(body, "backend", str, "gloo", lambda v: v in get_args(WeightBackend), "gloo or nccl")
        await self.join_group(init_method, rank, world_size, backend)
        self.has_group = True
        return web.json_response({"ok": True, "rank": rank, "world_size": world_size})

    async def _request_weight_update(self, request: web.Request) -> web.Response:
        from lm_human_preference_details.grpo.weights import mismatches

        body = await _json_body(request)
        if not self.has_group:
            raise web.HTTPConflict(reason="no process group: POST /init_process_group first")
        latest = max(self.version, self.announced_version)
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
        self.announced_version = version
        self.start_update(version, specs, bucket_bytes)
        return web.json_response({"accepted": True, "version": version, "bucket_bytes": bucket_bytes})

    async def _health(self, request: web.Request) -> web.Response:
        """`?wait_for_version=N&timeout_s=T` holds the answer until version N serves (or T passes, or the weights
        go stale): an actor learns of new weights at once without polling in a tight loop."""
        if "wait_for_version" in request.query:
            try:
                version, timeout = int(request.query["wait_for_version"]), float(request.query.get("timeout_s", 10))
            except ValueError:
                raise BadRequest("wait_for_version must be an integer and timeout_s a number") from None
            if not timeout >= 0:  # nan too: asyncio would wait forever
                raise BadRequest(f"timeout_s must be a number >= 0, got {request.query['timeout_s']}")
            async with self.version_changed:
                with contextlib.suppress(TimeoutError):  # then answer with the version serving
                    await asyncio.wait_for(
                        self.version_changed.wait_for(lambda: self.version >= version or self.stale),
                        min(timeout, 60),
                    )
        if self.stale:
            return web.json_response(
                {"status": "stale", "error": self.stale, "model_version": self.version}, status=503
            )
        error = self.engine_error()
        if error:
            return web.json_response({"status": "dead", "error": error}, status=503)
        return web.json_response(
            {
                "status": "ok",
                "model": self.model_name,
                "model_version": self.version,
                "dtype": self.dtype,
                **self.load(),
            }
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.json_response(await self.metrics())

    async def _weights_digest(self, request: web.Request) -> web.Response:
        """SHA-256 of every parameter's bytes: to check that a server holds exactly the trainer's weights."""
        return web.json_response(await self.weights_digest())


def _field(body: dict, name: str, kind: type, default, check=lambda v: True, need: str = ""):
    value = body.get(name, default)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool or not check(value):
        raise BadRequest(f"field {name!r}: expected {need or kind.__name__}, got {value!r}")
    return value


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


def listen(host: str, port: int, port_file: str = "") -> tuple[socket.socket, str]:
    """A socket listening on `host` (one address; a name binds the first it resolves to) and `port` (0: one the
    OS picks), and the URL it serves. Bound here so that a picked port can be read back and written to
    `port_file` (whole, then renamed: a reader never sees half of it)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    listening = socket.create_server((host, port), family=family)
    port = listening.getsockname()[1]
    if port_file:
        with open(port_file + ".tmp", "w") as f:
            f.write(str(port))
        os.replace(port_file + ".tmp", port_file)
    bracketed = f"[{host}]" if ":" in host else host  # an IPv6 address goes in brackets in a URL
    return listening, f"http://{bracketed}:{port}"
