"""The HTTP side of the GRPO pipeline contract (docs/DESIGN.md, "The GRPO pipeline contract"), one home for both
servers, `server.py` (the home-made engine) and `vllm_server.py` (vLLM): the routes, JSON bodies and their 400s, the
checks of every request field, the replies of /v1/completions and /v1/chat/completions (choices, token ids, logprobs,
`model_versions`, usage), the /health long-poll, /init_process_group's and /request_weight_update's checks, and the
error middleware. A server subclasses `ContractServer` and supplies its engine's part: `prepare` and `generate` a
completion, `join_group`, `start_update`, `load`, `metrics`, `weights_digest`.

The standard library, aiohttp and `grpo.protocol` only: the vLLM environment has none of the project's other
dependencies.
"""

import abc
import asyncio
import contextlib
import hmac
import http
import ipaddress
import json
import logging
import math
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import get_args
from urllib.parse import urlparse

from aiohttp import web

from lm_human_preference_details.grpo.protocol import (
    MAX_CHOICES,
    MIN_TEMPERATURE,
    TOKEN_ENV,
    ParameterSpec,
    WeightBackend,
    mismatches,
)

log = logging.getLogger("grpo.server")

SHUTDOWN_S = 3.0
"""how long a stopping server waits for requests in flight (a /health long-poll, a completion) before it drops them"""

RUNNER_OPTIONS = {"handler_cancellation": True, "shutdown_timeout": SHUTDOWN_S}
"""aiohttp's options for both servers: a client that disconnects cancels its handler (and so its sequences), and a
stop does not wait out aiohttp's default minute for requests in flight"""

DEFAULT_JOIN_TIMEOUT_S = 300.0
"""/init_process_group's `timeout_s` unless it says: the rendezvous, and then each broadcast of an update"""

SAMPLING_FIELDS = {
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "n",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "stream",
    "stream_options",
    "user",
}
"""the fields a completion request may carry (with `prompt`, or `messages` and `top_logprobs` for chat)"""

NEUTRAL_FIELDS = {"top_p": 1, "frequency_penalty": 0, "presence_penalty": 0, "echo": False, "best_of": 1}
"""OpenAI fields the servers do not implement, taken only at the value that changes nothing"""

MAX_STOP_STRINGS = 4
"""OpenAI's limit on `stop`"""

MAX_TOP_LOGPROBS = {"completions": 5, "chat": 20}
"""OpenAI's limits on `logprobs` (completions) and `top_logprobs` (chat)"""


class BadRequest(ValueError):
    """A malformed request: answered with 400 and the reason."""


class RendezvousTimeout(RuntimeError):
    """/init_process_group's rendezvous did not come within its `timeout_s`: answered with 504."""


@dataclass(frozen=True)
class ControlAccess:
    """Who may call the control endpoints (/init_process_group, /request_weight_update) and where a server will
    connect to join a weight group."""

    token: str = ""
    """the shared secret a control request carries as `Authorization: Bearer TOKEN` ("" takes none: loopback only)"""
    rendezvous_networks: tuple = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
    """the addresses an `init_method` may name (ipaddress networks); empty: any"""

    @classmethod
    def for_server(cls, host: str, token_file: str, rendezvous_allow: list[str]) -> "ControlAccess":
        """The access of a server that binds `host`: the token from `token_file`, else from $GRPO_SERVER_TOKEN
        (required beyond loopback: SystemExit without one); rendezvous within `rendezvous_allow` (addresses or
        networks), by default loopback on loopback and any address beyond it (where the token guards the group)."""
        token = os.environ.get(TOKEN_ENV, "")
        if token_file:
            try:
                with open(token_file) as f:
                    token = f.read().strip()
            except (OSError, UnicodeDecodeError) as error:
                raise SystemExit(f"error: --token-file {token_file}: cannot read it ({error})") from None
            if not token:
                raise SystemExit(f"error: --token-file {token_file} is empty: write the control token in it")
        loopback = _is_loopback(host)
        if not token and not loopback:
            raise SystemExit(
                f"error: --host {host} listens beyond loopback, where anyone who reaches the port could push weights: "
                f"give a control token in ${TOKEN_ENV} or a file named by --token-file (and the same to the trainer)"
            )
        try:
            networks = tuple(ipaddress.ip_network(a, strict=False) for a in rendezvous_allow)
        except ValueError as error:
            raise SystemExit(
                f"error: --rendezvous-allow: {error} (expected addresses or networks, e.g. 10.0.0.0/8)"
            ) from None
        return cls(token, networks if rendezvous_allow else cls.rendezvous_networks if loopback else ())


LOOPBACK_ACCESS = ControlAccess()
"""no token, groups joined on loopback only: a server in a test, or one that only its own machine reaches"""


def _is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class Sampling:
    """A completion request's sampling fields, checked."""

    max_tokens: int
    temperature: float
    stop_token_ids: frozenset[int]
    """the request's, plus EOS unless it says `ignore_eos` (the stop token is kept in the output)"""
    n: int
    """samples of each prompt"""
    stop: tuple[str, ...] = ()
    """stop strings: a sequence ends once its text holds one, and the reply's text is cut before it (its tokens
    and logprobs keep every token sampled)"""
    top_logprobs: int = 0
    """the most likely tokens to give at each position, with their logprobs"""


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
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """per token, the `Sampling.top_logprobs` most likely (token id, logprob), when asked for"""


class StopStrings:
    """Whether a sequence's text, decoded from its token ids, holds a stop string yet: called after every token, it
    decodes only the tail that can hold a stop string completed by the last token (a token is at least a byte)."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer, self.stops = tokenizer, stops
        self.window = max(len(s.encode()) for s in stops) + 1  # +1: the token that starts mid-character

    def __call__(self, token_ids: list[int]) -> bool:
        tail = self.tokenizer.decode(token_ids[-self.window :], skip_special_tokens=True)
        return any(s in tail for s in self.stops)


def cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    """`text` up to the first stop string in it (OpenAI's: the stop string itself is not returned)."""
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(ends)] if ends else text


class ContractServer(abc.ABC):
    """The contract's routes over an engine. A subclass gives `version` (the weight version serving: an attribute
    or a property) and the abstract methods; this class keeps what the contract's checks read."""

    version: int

    def __init__(
        self,
        tokenizer,
        model_name: str,
        dtype: str,
        specs: list[ParameterSpec],
        version: int,
        access: ControlAccess = LOOPBACK_ACCESS,
    ):
        self.tokenizer, self.model_name, self.dtype = tokenizer, model_name, dtype
        self.specs = specs
        """the parameters an update must name, with their shapes and dtypes"""
        self.access = access
        self.announced_version = version
        self.has_group = False
        self.groups_joined = 0  # which group an accepted update travels in: one that broke delivers no more
        self.stale: str | None = None  # why the weights can no longer be updated, once they cannot
        self.update_error: str | None = None  # why the last update was rolled back, until one succeeds
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
    async def join_group(self, init_method: str, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
        """Join the trainer's weight group (waits until the trainer's side joins, at most `timeout_s`, and then
        waits at most that long for each broadcast); RendezvousTimeout when the trainer's side does not come,
        BadRequest if it cannot join."""

    @abc.abstractmethod
    def start_update(self, version: int, specs: list[ParameterSpec], bucket_bytes: int) -> None:
        """Receive an accepted update into buffers of its own, after those announced before it (the trainer
        broadcasts in that order), then load it and `announce_version`; `roll_back` if the receive fails (the model
        is untouched), set `stale` if loading fails half way."""

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

    def roll_back(self, version: int, reason: str) -> None:
        """An update failed before anything was loaded: the weights serving keep serving, /health says `reason`,
        the group is dropped (a broken group delivers no later update: the trainer joins again) and the next
        update may take any version above the serving one. Safe from any thread."""
        self.update_error = f"weights version {version} were not loaded ({reason}); version {self.version} serves"
        log.error(self.update_error)
        self.has_group = False
        if self._loop is not None:

            def on_loop() -> None:
                self.announced_version = self.version
                self._loop.create_task(self.announce_version())

            self._loop.call_soon_threadsafe(on_loop)
        else:
            self.announced_version = self.version

    def mark_stale(self, reason: str) -> None:
        """The weights can no longer be updated: /health and completions say `reason` with 503 from now on, and
        the /health long-polls answer at once. Safe from any thread (the home server's receiver is one)."""
        self.stale = reason
        log.error(reason)
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
                web.get("/v1/models", self._models),
                web.post("/init_process_group", self._init_process_group),
                web.post("/request_weight_update", self._request_weight_update),
                web.get("/health", self._health),
                web.get("/metrics", self._metrics),
                web.get("/weights_digest", self._weights_digest),
            ]
        )
        return app

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        _check_fields(body, {"prompt"} | SAMPLING_FIELDS)
        prompt = body.get("prompt")
        batched = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
        prompts = list(enumerate(prompt)) if batched else [(None, prompt)]
        prompts_ids = [await self._prompt_ids(p, "prompt" if i is None else f"prompt[{i}]") for i, p in prompts]
        top = _field(
            body,
            "logprobs",
            int,
            0,
            lambda v: 0 <= v <= MAX_TOP_LOGPROBS["completions"],
            f"an integer in [0, {MAX_TOP_LOGPROBS['completions']}] (the most likely tokens to list at each position)",
        )
        sampling = self._sampling(body, len(prompts_ids), top)
        samples = await self._sample(prompts_ids, sampling)
        choices = []
        for i, s in enumerate(samples):
            text, finish_reason = self._text(s, sampling)
            logprobs = {"tokens": self._pieces(s.token_ids), "token_logprobs": s.logprobs}
            if top:
                logprobs["top_logprobs"] = [
                    dict(zip(self._pieces([t for t, _ in k]), [lp for _, lp in k])) for k in s.top_logprobs
                ]
            choices.append(
                {
                    "index": i,
                    "text": text,
                    "token_ids": s.token_ids,
                    "logprobs": logprobs,
                    "model_versions": s.versions,
                    "finish_reason": finish_reason,
                }
            )
        reply = self._response("text_completion", prompts_ids, batched, choices)
        if not _stream(body):
            return web.json_response(reply)
        return await _send_events(request, reply, choices, body)

    async def _prompt_ids(self, prompt, name: str) -> list[int]:
        if isinstance(prompt, str) and prompt:
            # off the event loop: a long prompt takes seconds, and /health and the other requests would wait
            return (await asyncio.to_thread(self.tokenizer, prompt, add_special_tokens=False))["input_ids"]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        raise BadRequest(
            f"field {name!r}: expected a non-empty string or a non-empty list of token ids"
            + (" (or a non-empty list of those)" if name == "prompt" else "")
        )

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        _check_fields(body, {"messages", "top_logprobs"} | SAMPLING_FIELDS)
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
            await asyncio.to_thread(
                self.tokenizer.apply_chat_template,
                messages,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        _field(body, "logprobs", bool, False, need="true or false (the logprobs are always in the reply)")
        top = _field(
            body,
            "top_logprobs",
            int,
            0,
            lambda v: 0 <= v <= MAX_TOP_LOGPROBS["chat"],
            f"an integer in [0, {MAX_TOP_LOGPROBS['chat']}]",
        )
        sampling = self._sampling(body, 1, top)
        samples = await self._sample([prompt_ids], sampling)
        choices = []
        for i, s in enumerate(samples):
            text, finish_reason = self._text(s, sampling)
            content = [{"token": t, "logprob": lp} for t, lp in zip(self._pieces(s.token_ids), s.logprobs)]
            for entry, k in zip(content, s.top_logprobs if top else []):
                entry["top_logprobs"] = [
                    {"token": t, "logprob": lp} for t, (_, lp) in zip(self._pieces([t for t, _ in k]), k)
                ]
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "token_ids": s.token_ids,
                    "logprobs": {"content": content},
                    "model_versions": s.versions,
                    "finish_reason": finish_reason,
                }
            )
        reply = self._response("chat.completion", [prompt_ids], False, choices)
        if not _stream(body):
            return web.json_response(reply)
        # a streamed choice carries its message as a `delta`
        deltas = [{**{k: v for k, v in c.items() if k != "message"}, "delta": c["message"]} for c in choices]
        return await _send_events(request, {**reply, "object": "chat.completion.chunk"}, deltas, body)

    def _sampling(self, body: dict, prompts: int, top_logprobs: int) -> Sampling:
        """A completion request's sampling fields, checked (BadRequest naming the field)."""
        _field(
            body, "model", str, self.model_name, lambda v: v == self.model_name, f"{self.model_name!r} (GET /v1/models)"
        )
        _field(body, "user", str, "", need="a string")
        stop = set(
            _field(
                body, "stop_token_ids", list, [], lambda v: all(isinstance(t, int) for t in v), "a list of token ids"
            )
        )
        if not _field(body, "ignore_eos", bool, False) and self.tokenizer.eos_token_id is not None:
            stop.add(self.tokenizer.eos_token_id)
        stop_strings = body.get("stop") or []
        stop_strings = [stop_strings] if isinstance(stop_strings, str) else stop_strings
        if not (
            isinstance(stop_strings, list)
            and len(stop_strings) <= MAX_STOP_STRINGS
            and all(isinstance(s, str) and s for s in stop_strings)
        ):
            raise BadRequest(f"field 'stop': expected a non-empty string or a list of up to {MAX_STOP_STRINGS} of them")
        if (
            "max_tokens" in body
            and "max_completion_tokens" in body
            and body["max_tokens"] != body["max_completion_tokens"]
        ):
            raise BadRequest("fields 'max_tokens' and 'max_completion_tokens' disagree: give one of them")
        length_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        max_tokens = _field(body, length_field, int, 16, lambda v: v >= 1, "an integer >= 1")
        temperature = _field(
            body,
            "temperature",
            float,
            1.0,
            lambda v: math.isfinite(v) and v >= MIN_TEMPERATURE,
            f"a finite number >= {MIN_TEMPERATURE} (sampling only)",
        )
        n = _field(body, "n", int, 1, lambda v: 1 <= v <= MAX_CHOICES, f"an integer in [1, {MAX_CHOICES}]")
        if n * prompts > MAX_CHOICES:
            raise BadRequest(
                f"fields 'prompt' and 'n': {prompts} prompts x n={n} exceeds {MAX_CHOICES} choices per request"
            )
        _field(body, "stream", bool, False, need="true or false")
        options = _field(body, "stream_options", dict, {}, lambda v: set(v) <= {"include_usage"}, "{include_usage}")
        _field(options, "include_usage", bool, False, need="true or false (field 'stream_options')")
        if options and not _stream(body):
            raise BadRequest("field 'stream_options': only with stream: true")
        return Sampling(max_tokens, temperature, frozenset(stop), n, tuple(stop_strings), top_logprobs)

    async def _sample(self, prompts_ids: list[list[int]], sampling: Sampling) -> list[Sample]:
        """`n` samples of each prompt, prompt-major."""
        if self.stale:
            raise web.HTTPServiceUnavailable(reason=self.stale)
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

    def _text(self, sample: Sample, sampling: Sampling) -> tuple[str, str]:
        """The sample's text, cut before a stop string, and its finish reason."""
        text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        cut = cut_at_stop(text, sampling.stop)
        return cut, "stop" if len(cut) < len(text) else sample.finish_reason

    def _pieces(self, token_ids: list[int]) -> list[str]:
        """Each token as its vocabulary entry (one call, not a decode per token)."""
        return self.tokenizer.convert_ids_to_tokens(token_ids)

    async def _models(self, request: web.Request) -> web.Response:
        """The one model this server serves, as OpenAI lists models."""
        model = {"id": self.model_name, "object": "model", "created": int(self.started), "owned_by": "grpo"}
        return web.json_response({"object": "list", "data": [model]})

    def _authorize(self, request: web.Request) -> None:
        """A control request must carry the server's token, when it has one (401 otherwise)."""
        if not self.access.token:
            return
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.access.token}".encode()):
            raise web.HTTPUnauthorized(
                reason=f"control endpoints need the server's token: send `Authorization: Bearer TOKEN` "
                f"(grpo.client sends ${TOKEN_ENV})"
            )

    async def _init_process_group(self, request: web.Request) -> web.Response:
        self._authorize(request)
        body = await _json_body(request)
        init_method = _field(body, "init_method", str, None, need="a string tcp://HOST:PORT")
        rank = _field(body, "rank", int, None, lambda v: v >= 1, "an integer >= 1 (rank 0 is the trainer)")
        world_size = _field(body, "world_size", int, None, lambda v: v > rank, "an integer > rank")
        backend = _field(body, "backend", str, "gloo", lambda v: v in get_args(WeightBackend), "gloo or nccl")
        timeout_s = _field(
            body,
            "timeout_s",
            float,
            DEFAULT_JOIN_TIMEOUT_S,
            lambda v: 0 < v <= 24 * 3600,
            "a number of seconds in (0, 86400]: how long to wait for the trainer's side, then for each broadcast",
        )
        await asyncio.to_thread(self._check_rendezvous, init_method)
        log.info("joining the weight group at %s (rank %d, waiting at most %.0f s)", init_method, rank, timeout_s)

        async def join() -> None:
            await self.join_group(init_method, rank, world_size, backend, timeout_s)
            self.has_group, self.update_error = True, None
            self.groups_joined += 1

        # shielded: a caller that hangs up does not cancel a join half made (the trainer's side may complete it)
        await asyncio.shield(join())
        return web.json_response({"ok": True, "rank": rank, "world_size": world_size})

    def _check_rendezvous(self, init_method: str) -> None:
        """BadRequest unless `init_method` is tcp://HOST:PORT and HOST is within the server's rendezvous networks
        (a name: every address it resolves to)."""
        url = urlparse(init_method)
        try:
            port = url.port
        except ValueError:
            port = None
        if url.scheme != "tcp" or not url.hostname or not port:
            raise BadRequest(f"field 'init_method': {init_method!r}: expected tcp://HOST:PORT")
        if not self.access.rendezvous_networks:
            return
        try:
            addresses = {ipaddress.ip_address(info[4][0]) for info in socket.getaddrinfo(url.hostname, port)}
        except (OSError, ValueError) as error:
            raise BadRequest(f"field 'init_method': cannot resolve {url.hostname} ({error})") from None
        outside = [a for a in addresses if not any(a in n for n in self.access.rendezvous_networks)]
        if outside:
            raise BadRequest(
                f"field 'init_method': {url.hostname} ({outside[0]}) is outside the addresses this server joins "
                f"groups at ({', '.join(map(str, self.access.rendezvous_networks))}): start it with "
                f"--rendezvous-allow to add them"
            )

    async def _request_weight_update(self, request: web.Request) -> web.Response:
        self._authorize(request)
        body = await _json_body(request)
        if not self.has_group:
            raise web.HTTPConflict(reason="no process group: POST /init_process_group first")
        latest = max(self.version, self.announced_version)
        version = _field(
            body, "version", int, None, lambda v: v > latest, f"an integer above the latest version {latest}"
        )
        try:
            specs = [ParameterSpec.from_json(p) for p in _field(body, "parameters", list, None, need="a list")]
        except (KeyError, TypeError, ValueError, OverflowError) as error:
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
                "update_error": self.update_error,
                **self.load(),
            }
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.json_response(await self.metrics())

    async def _weights_digest(self, request: web.Request) -> web.Response:
        """SHA-256 of every parameter's bytes: to check that a server holds exactly the trainer's weights."""
        return web.json_response(await self.weights_digest())


def first_line(error: Exception) -> str:
    """The first line of an error's message (torch's run on with a C++ stack), or its type when it has none."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _field(body: dict, name: str, kind: type, default, check=lambda v: True, need: str = ""):
    value = body.get(name, default)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool or not check(value):
        raise BadRequest(f"field {name!r}: expected {need or kind.__name__}, got {_short(value)}")
    return value


def _short(value) -> str:
    """`repr(value)`, at most 200 characters: an error message does not echo a megabyte back."""
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text)} characters)"


def _check_fields(body: dict, allowed: set[str]) -> None:
    """BadRequest for a field the server would otherwise ignore: one it does not know, or an OpenAI one it does
    not implement at any but its neutral value."""
    for name in body:
        if name in allowed:
            continue
        if name in NEUTRAL_FIELDS:
            neutral = NEUTRAL_FIELDS[name]
            if body[name] == neutral and isinstance(body[name], bool) == isinstance(neutral, bool):
                continue
            raise BadRequest(
                f"field {name!r}: this server implements only {name}={json.dumps(NEUTRAL_FIELDS[name])}: remove it"
            )
        raise BadRequest(
            f"field {_short(name)}: not supported by this server, which would ignore it: remove it "
            f"(it takes {', '.join(sorted(allowed | set(NEUTRAL_FIELDS)))})"
        )


def _check_unicode(body: dict) -> None:
    """BadRequest naming the first string of `body` (a key too) that is not valid Unicode. Iterative: the body is
    as deep as JSON's parser allowed."""
    todo: list[tuple[str, object]] = [("", body)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, f"a key of {path or 'the body'}")
                todo.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            todo.extend((f"{path}[{i}]", item) for i, item in enumerate(value))


def _check_text(text: str, name: str) -> None:
    """BadRequest for text that is not valid Unicode (a lone surrogate, as JSON's \\ud800 gives): no tokenizer
    takes it."""
    try:
        text.encode()
    except UnicodeEncodeError as error:
        raise BadRequest(
            f"field {name!r}: not valid Unicode ({text[error.start]!r} at character {error.start}, a lone surrogate "
            f"half): send whole characters"
        ) from None


def _stream(body: dict) -> bool:
    return body.get("stream") is True


async def _send_events(request: web.Request, reply: dict, choices: list[dict], body: dict) -> web.StreamResponse:
    """`reply` as server-sent events, the form the OpenAI SDK reads with `stream=True`: one chunk per choice (the
    engines hand back whole sequences: the chunks come once they are done), then the usage when
    `stream_options.include_usage` asks for it, then `[DONE]`."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    head = {k: v for k, v in reply.items() if k not in ("choices", "usage")}
    for choice in choices:
        await response.write(_event({**head, "choices": [choice]}))
    if body.get("stream_options", {}).get("include_usage"):
        await response.write(_event({**head, "choices": [], "usage": reply["usage"]}))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _event(data: dict) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


async def _json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("the body is not JSON") from None
    except RecursionError:
        raise BadRequest("the body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    _check_unicode(body)
    return body


@web.middleware
async def _errors_as_json(request: web.Request, handler):
    try:
        return await handler(request)
    except BadRequest as error:
        return _error_reply(str(error), 400)
    except RendezvousTimeout as error:
        return _error_reply(str(error), 504)
    except web.HTTPException as error:
        return _error_reply(error.reason, error.status)


def _error_reply(message: str, status: int) -> web.Response:
    """OpenAI's error body, whose `message` the SDK puts in the exception it raises."""
    kind = http.HTTPStatus(status).phrase.lower().replace(" ", "_")
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


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
