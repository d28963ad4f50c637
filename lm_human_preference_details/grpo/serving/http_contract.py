"""The HTTP side of the GRPO pipeline contract (docs/DESIGN.md, "The GRPO pipeline contract"), one home for both
servers, `server.py` (the home-made engine) and `vllm_server.py` (vLLM): the routes, the /health long-poll, the
weight version a server announces, and the error middleware. A request's checks are `request_checks`', the replies
and their server-sent events `replies`', the control token, rendezvous and update checks `control`'s. A server
subclasses `ContractServer` and supplies its engine's part: `prepare`, `generate` and `stream` a completion,
`join_group`, `start_update`, `load`, `metrics`, `weights_digest`.

The standard library, aiohttp and `grpo.protocol` only: the vLLM environment has none of the project's other
dependencies.
"""

import abc
import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import AsyncIterator

from aiohttp import web

from lm_human_preference_details.grpo.protocol import ParameterSpec
from lm_human_preference_details.grpo.serving.control import (
    LOOPBACK_ACCESS,
    ControlAccess,
    JoinRequest,
    RendezvousTimeout,
    UpdateRequest,
)
from lm_human_preference_details.grpo.serving.replies import (
    ChoiceStream,
    Sample,
    chat_choices,
    completion_choices,
    error_body,
    reply_body,
    send_stream,
)
from lm_human_preference_details.grpo.serving.request_checks import (
    MAX_TOP_LOGPROBS,
    SAMPLING_FIELDS,
    BadRequest,
    Sampling,
    chat_prompt_ids,
    check_fields,
    json_body,
    prompt_ids,
    read_field,
    sampling_of,
    wants_stream,
    wants_usage,
)

log = logging.getLogger("grpo.server")

SHUTDOWN_S = 3.0
"""how long a stopping server waits for requests in flight (a /health long-poll, a completion) before it drops them"""

RUNNER_OPTIONS = {"handler_cancellation": True, "shutdown_timeout": SHUTDOWN_S}
"""aiohttp's options for both servers: a client that disconnects cancels its handler (and so its sequences), and a
stop does not wait out aiohttp's default minute for requests in flight"""


class ContractServer(abc.ABC):
    """The contract's routes over an engine. A subclass gives `version` (the weight version serving: an attribute
    or a property) and the abstract methods; this class keeps what the contract's checks read."""

    version: int
    weight_ranks = 1
    """the ranks this server takes in its weight group, from /init_process_group's `rank` on (/health says it)"""

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
    def stream(self, prepared: list, sampling: Sampling) -> AsyncIterator[list[tuple[int, Sample]]]:
        """`generate`'s samples as the engine decodes them: per engine step, (choice index, delta) for each choice
        with new tokens (a `Sample` of those tokens: finish reason "" until the choice's last delta), until every
        choice has had its last. Closing it early (the client went away) stops the sequences left."""

    @abc.abstractmethod
    async def join_group(self, init_method: str, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
        """Join the trainer's weight group at ranks `rank` to `rank + weight_ranks - 1` (waits until the trainer's
        side joins, at most `timeout_s`, and then waits at most that long for each broadcast); RendezvousTimeout
        when the trainer's side does not come, BadRequest if it cannot join."""

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
        body = await json_body(request)
        check_fields(body, {"prompt"} | SAMPLING_FIELDS)
        prompt = body.get("prompt")
        batched = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
        prompts = list(enumerate(prompt)) if batched else [(None, prompt)]
        prompts_ids = [
            await prompt_ids(self.tokenizer, p, "prompt" if i is None else f"prompt[{i}]") for i, p in prompts
        ]
        top = read_field(
            body,
            "logprobs",
            int,
            0,
            lambda v: 0 <= v <= MAX_TOP_LOGPROBS["completions"],
            f"an integer in [0, {MAX_TOP_LOGPROBS['completions']}] (the most likely tokens to list at each position)",
        )
        sampling = sampling_of(body, self.model_name, self.tokenizer.eos_token_id, len(prompts_ids), top)
        prepared = self._prepare(prompts_ids, sampling)
        if wants_stream(body):
            return await self._stream(request, body, "text_completion", prompts_ids, batched, prepared, sampling)
        choices = completion_choices(self.tokenizer, await self.generate(prepared, sampling), sampling)
        return web.json_response(reply_body("text_completion", self.model_name, prompts_ids, batched, choices))

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await json_body(request)
        check_fields(body, {"messages", "top_logprobs"} | SAMPLING_FIELDS)
        ids = await chat_prompt_ids(self.tokenizer, self.model_name, body)
        read_field(body, "logprobs", bool, False, need="true or false (the logprobs are always in the reply)")
        top = read_field(
            body,
            "top_logprobs",
            int,
            0,
            lambda v: 0 <= v <= MAX_TOP_LOGPROBS["chat"],
            f"an integer in [0, {MAX_TOP_LOGPROBS['chat']}]",
        )
        sampling = sampling_of(body, self.model_name, self.tokenizer.eos_token_id, 1, top)
        prepared = self._prepare([ids], sampling)
        if wants_stream(body):
            return await self._stream(request, body, "chat.completion.chunk", [ids], False, prepared, sampling)
        choices = chat_choices(self.tokenizer, await self.generate(prepared, sampling), sampling)
        return web.json_response(reply_body("chat.completion", self.model_name, [ids], False, choices))

    def _prepare(self, prompts_ids: list[list[int]], sampling: Sampling) -> list:
        """Each prompt checked and prepared for the engine, all before any is queued (and a stream's status sent)."""
        if self.stale:
            raise web.HTTPServiceUnavailable(reason=self.stale)
        prepared = []
        for i, ids in enumerate(prompts_ids):
            try:
                prepared.append(self.prepare(ids, sampling))
            except ValueError as error:
                raise BadRequest(f"prompt {i}: {error}" if len(prompts_ids) > 1 else str(error)) from None
        self.requests += 1
        return prepared

    async def _stream(
        self,
        request: web.Request,
        body: dict,
        kind: str,
        prompts_ids,
        batched: bool,
        prepared: list,
        sampling: Sampling,
    ) -> web.StreamResponse:
        """The reply as chunks while the engine decodes (`send_stream`), `kind` `text_completion` or
        `chat.completion.chunk`."""
        chat = kind == "chat.completion.chunk"
        deltas = self.stream(prepared, sampling)
        return await send_stream(
            request,
            kind,
            self.model_name,
            prompts_ids,
            batched,
            deltas,
            lambda: ChoiceStream(self.tokenizer, sampling, chat),
            wants_usage(body),
        )

    async def _models(self, request: web.Request) -> web.Response:
        """The one model this server serves, as OpenAI lists models."""
        model = {"id": self.model_name, "object": "model", "created": int(self.started), "owned_by": "grpo"}
        return web.json_response({"object": "list", "data": [model]})

    async def _init_process_group(self, request: web.Request) -> web.Response:
        self.access.authorize(request)
        join = JoinRequest.from_body(await json_body(request), self.weight_ranks)
        await asyncio.to_thread(self.access.check_rendezvous, join.init_method)
        log.info(
            "joining the weight group at %s (ranks %d to %d of %d, waiting at most %.0f s)",
            join.init_method,
            join.rank,
            join.rank + self.weight_ranks - 1,
            join.world_size,
            join.timeout_s,
        )

        async def joined() -> None:
            await self.join_group(join.init_method, join.rank, join.world_size, join.backend, join.timeout_s)
            self.has_group, self.update_error = True, None
            self.groups_joined += 1

        # shielded: a caller that hangs up does not cancel a join half made (the trainer's side may complete it)
        await asyncio.shield(joined())
        return web.json_response({"ok": True, "rank": join.rank, "world_size": join.world_size})

    async def _request_weight_update(self, request: web.Request) -> web.Response:
        self.access.authorize(request)
        body = await json_body(request)
        if not self.has_group:
            raise web.HTTPConflict(reason="no process group: POST /init_process_group first")
        update = UpdateRequest.from_body(body, max(self.version, self.announced_version), self.specs)
        self.announced_version = update.version
        self.start_update(update.version, update.specs, update.bucket_bytes)
        return web.json_response({"accepted": True, "version": update.version, "bucket_bytes": update.bucket_bytes})

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
                "weight_ranks": self.weight_ranks,
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
    return web.json_response(error_body(message, status), status=status)


async def queued_deltas(
    steps: asyncio.Queue, ended: asyncio.Future, choices: int
) -> AsyncIterator[list[tuple[int, Sample]]]:
    """A `ContractServer.stream` from an engine's queue: each step's deltas that the engine puts in `steps`, until
    each of the `choices` has had its last; raises what `ended` fails with (it is done once the engine is done with
    the request: after its last put)."""
    unfinished = choices
    while unfinished:
        next_step = asyncio.ensure_future(steps.get())
        try:
            await asyncio.wait({next_step, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            next_step.cancel()  # a no-op once done
        if not next_step.done() or next_step.cancelled():
            ended.result()  # the engine's failure
            if steps.empty():
                raise RuntimeError(f"the engine ended {unfinished} of {choices} choices without their last tokens")
            continue
        step = next_step.result()
        unfinished -= sum(bool(delta.finish_reason) for _, delta in step)
        yield step


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
