"""Batched decoding that keeps its batch full and lets the weights change between two decode steps.

One thread owns the model. Each loop iteration: apply a pending weight update (the only pause),
admit queued requests into free slots (one batched prefill, one row per distinct prompt: the n
samples of a prompt share it), take one decode step for every active
sequence, hand each watched (streamed) request its new tokens, hand finished sequences back. A
finished sequence's slot is refilled on the next iteration, so the batch stays full while
requests are queued (continuous batching).

The KV cache lives in buffers allocated once per layer ([rows, heads, columns, head dim], see
`DecodingBatch`): a decode step writes one column in place, where transformers' `DynamicCache`
would copy the whole cache twice (building the cache object, then concatenating the new column).
Rows are right-aligned: a row's valid columns are a suffix of the columns in use, the columns to
their left are masked, and a new row joins left-padded. A finished row is filled by the last row,
so only the rows that move are copied. Sequences in flight keep their cache across a weight
update (PipelineRL: the stale keys and values are not recomputed), and every token records the
weight version that sampled it.

Why not transformers' `init_continuous_batching`: it runs its own scheduler thread, so there is no
point between two decode steps where new weights can be swapped in atomically, and it does not
report which weights produced a token.
"""

import collections
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from lm_human_preference_details.grpo.protocol import MIN_TEMPERATURE
from lm_human_preference_details.models import temperature_log_softmax


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    stop_token_ids: frozenset[int] = frozenset()
    """the sequence ends after sampling one of these (the token is kept: the policy learns to stop)"""
    stops_at: Callable[[list[int]], bool] | None = None
    """called with the sequence's token ids after each sampled token: True ends it (the server's stop strings)"""
    top_logprobs: int = 0
    """also record, per token, this many most likely (token id, logprob)"""


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    """log-probability of each sampled token under the sampling distribution (logits / temperature)"""
    versions: list[int]
    """weight version that sampled each token"""
    finish_reason: str
    """`stop` (a stop token was sampled, or `stops_at` said so) or `length` (max_new_tokens reached); in a step's
    `Watch` delta, "" until the sequence's last"""
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """per token, the request's `top_logprobs` most likely (token id, logprob); empty unless it asked"""


Watch = Callable[[list[tuple[int, Generation]]], None]
"""`submit_many`'s `watch`: called on the engine thread once per step that sampled tokens of the submitted requests,
with (position in the submitted list, a `Generation` of the step's one token) for each; it must neither block nor
raise (an error fails the whole batch's step)"""


@dataclass
class _Sequence:
    request: GenerationRequest
    future: Future
    watch: Watch | None = None
    position: int = 0
    """in the list `submit_many` was given: what `watch` names it by"""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


class Engine:
    """Owns the model; `submit` from any thread, `schedule_update` to swap weights between steps. `start` starts
    its thread and `stop` ends it; `with Engine(...) as engine:` does both (requests submitted before the
    start wait in its queue)."""

    def __init__(self, model: torch.nn.Module, max_batch_size: int, seed: int = 0, vocab_size: int | None = None):
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        # the tokenizer may know fewer ids than the embedding has rows, never more
        self.vocab_size = min(vocab_size or model.config.vocab_size, model.config.vocab_size)
        self.max_positions = _max_positions(model.config)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.version = 0
        self._queue: collections.deque[_Sequence] = collections.deque()
        self._updates: collections.deque = collections.deque()
        self._wake = threading.Condition()
        self._stopped = False
        self._active: list[_Sequence] = []
        self._dropped: set[Future] = set()  # running sequences whose client went away: out at the next step
        self._batch = DecodingBatch(max_batch_size, self.device)
        self.stats = collections.Counter()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    # -- called from other threads ------------------------------------------------------------

    def start(self) -> "Engine":
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=30)

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def submit(self, request: GenerationRequest) -> Future:
        """Queue a request; the future resolves to a `Generation`. Checks it (`check`) before queueing."""
        return self.submit_many([request])[0]

    def submit_many(self, requests: list[GenerationRequest], watch: Watch | None = None) -> list[Future]:
        """Queue several requests at once (the same request object may appear several times: n samples
        of one prompt); all are checked before any is queued. `watch`, when given, gets each step's new tokens
        (a stream's) before the futures of the sequences that step finished resolve."""
        for request in {id(r): r for r in requests}.values():
            self.check(request)
        futures = [Future() for _ in requests]
        with self._wake:
            if self._stopped:
                raise RuntimeError("engine stopped")
            self._queue.extend(
                _Sequence(request, future, watch, i) for i, (request, future) in enumerate(zip(requests, futures))
            )
            self._wake.notify()
        return futures

    def drop(self, futures: list[Future]) -> None:
        """Stop generating these submitted requests (their client went away): a queued one is cancelled, a running
        one leaves the batch before the next step and its future fails with CancelledError."""
        running = [future for future in futures if not future.cancel() and not future.done()]
        with self._wake:
            self._dropped.update(running)

    def check(self, request: GenerationRequest) -> None:
        """ValueError, saying why, when the request cannot be generated (empty prompt, too long, unknown ids,
        a temperature that is not a finite number >= MIN_TEMPERATURE)."""
        if not request.prompt_ids:
            raise ValueError("prompt is empty")
        if not (math.isfinite(request.temperature) and request.temperature >= MIN_TEMPERATURE):
            raise ValueError(
                f"temperature {request.temperature!r}: expected a finite number >= {MIN_TEMPERATURE} (sampling only)"
            )
        if len(request.prompt_ids) + request.max_new_tokens > self.max_positions:
            raise ValueError(
                f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.max_new_tokens}) exceeds the "
                f"model's {self.max_positions} positions"
            )
        bad = [t for t in request.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    def schedule_update(self, apply_weights) -> Future:
        """Run `apply_weights()` on the engine thread between two decode steps; it returns the new
        version. The future resolves to the pause in seconds (decoding stopped for that long)."""
        return self._between_steps(apply_weights, is_update=True)

    def call_between_steps(self, function) -> Future:
        """Run `function()` on the engine thread between two decode steps (it sees no update half
        applied); the future resolves to its result."""
        return self._between_steps(function, is_update=False)

    def _between_steps(self, function, is_update: bool) -> Future:
        future = Future()
        with self._wake:
            self._updates.append((function, future, is_update))
            self._wake.notify()
        return future

    def load(self) -> dict[str, int]:
        with self._wake:
            return {"active": len(self._active), "queued": len(self._queue)}

    # -- the engine thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._wake:
                    while not (self._stopped or self._queue or self._updates or self._active):
                        self._wake.wait()
                    if self._stopped:
                        break
                    updates = list(self._updates)
                    self._updates.clear()
                    dropped, self._dropped = self._dropped, set()
                    free = self.max_batch_size - len(self._active)
                    admitted = []
                    while self._queue and len(admitted) < free:
                        sequence = self._queue.popleft()
                        if sequence.future.set_running_or_notify_cancel():  # False: its client gave up
                            admitted.append(sequence)
                for function, future, is_update in updates:
                    self._run_between_steps(function, future, is_update)
                if dropped:
                    self._remove([row for row, s in enumerate(self._active) if s.future in dropped], dropped=True)
                try:
                    if admitted:
                        self._prefill(admitted)
                    if self._active:
                        self._decode_step()
                except Exception as error:  # a failed step fails its requests, not the server
                    for sequence in self._active + admitted:
                        if not sequence.future.done():
                            sequence.future.set_exception(error)
                    self._reset_batch()
        for sequence in self._queue:
            sequence.future.cancel()
        for sequence in self._active:  # running: a future that cannot be cancelled any more
            sequence.future.set_exception(RuntimeError("engine stopped before the sequence finished"))
        for _, future, _ in self._updates:
            future.set_exception(RuntimeError("engine stopped before the update was applied"))

    def _run_between_steps(self, function, future: Future, is_update: bool) -> None:
        start = time.perf_counter()
        try:
            with torch.no_grad(), torch.inference_mode(False):  # parameters are not inference tensors
                result = function()
        except Exception as error:
            future.set_exception(error)
            return
        if not is_update:
            future.set_result(result)
            return
        self.version = result
        pause = time.perf_counter() - start
        self.stats["pause_s_total"] += pause  # before the count: whoever sees the update counted sees its pause
        self.stats["updates"] += 1
        future.set_result(pause)

    def _prefill(self, admitted: list[_Sequence]) -> None:
        # left-pad the distinct new prompts into one batch (the n samples of a prompt share its
        # forward pass), run them, and append one cache row per sequence
        distinct: dict[tuple[int, ...], int] = {}
        rows = [distinct.setdefault(tuple(s.request.prompt_ids), len(distinct)) for s in admitted]
        length = max(map(len, distinct))
        ids = torch.zeros(len(distinct), length, dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(distinct):
            ids[row, length - len(prompt) :] = torch.tensor(prompt, device=self.device)
            mask[row, length - len(prompt) :] = 1
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        # left-padded: every prompt ends at the last column, the only logits sampled from
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        self.stats["prefill_tokens"] += int(mask.sum())
        rows = torch.tensor(rows, device=self.device)
        first = self._batch.rows
        temperatures = torch.tensor([s.request.temperature for s in admitted], device=self.device)
        self._batch.append(
            [(layer.keys[rows], layer.values[rows]) for layer in out.cache.layers],
            mask[rows],
            mask.sum(1)[rows],
            temperatures,
        )
        self._active.extend(admitted)
        self._sample(out.logits[rows, -1], first_row=first)

    def _decode_step(self) -> None:
        batch = self._batch
        mask = batch.open_column()
        out = self.model(
            input_ids=batch.last_tokens[: batch.rows, None],
            attention_mask=mask,
            position_ids=batch.positions[: batch.rows, None],
            cache=batch.cache,
            use_cache=True,
        )
        batch.close_column()
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += len(self._active)
        self._sample(out.logits[:, -1], first_row=0)

    def _sample(self, logits: torch.Tensor, first_row: int) -> None:
        """Sample the next token of rows first_row.. of the batch from their last logits."""
        batch, sequences = self._batch, self._active[first_row:]
        temperatures = batch.temperatures[first_row : batch.rows, None]
        logprobs = temperature_log_softmax(logits[:, : self.vocab_size], temperatures)
        tokens = sample_tokens(logprobs, self.generator)
        token_logprobs = logprobs.gather(1, tokens[:, None])[:, 0]
        batch.last_tokens[first_row : batch.rows] = tokens
        wanted = max(s.request.top_logprobs for s in sequences)
        top = logprobs.topk(wanted, dim=-1) if wanted else None  # one call for the rows that ask
        finished, version = [], self.version
        watched: dict[Watch, list[tuple[int, Generation]]] = {}
        # per row only what the Generation needs; a client's going away is `drop`'s, between two steps
        for row, (sequence, token, logprob) in enumerate(
            zip(sequences, tokens.tolist(), token_logprobs.tolist()), first_row
        ):
            sequence.token_ids.append(token)
            sequence.logprobs.append(logprob)
            sequence.versions.append(version)
            if sequence.request.top_logprobs:
                k, i = sequence.request.top_logprobs, row - first_row
                sequence.top_logprobs.append(list(zip(top.indices[i, :k].tolist(), top.values[i, :k].tolist())))
            reason = ""
            if token in sequence.request.stop_token_ids:
                reason = "stop"
            elif sequence.request.stops_at is not None and sequence.request.stops_at(sequence.token_ids):
                reason = "stop"
            elif len(sequence.token_ids) >= sequence.request.max_new_tokens:
                reason = "length"
            if reason:
                finished.append((row, reason))
            if sequence.watch is not None:
                delta = Generation([token], [logprob], [version], reason, sequence.top_logprobs[-1:])
                watched.setdefault(sequence.watch, []).append((sequence.position, delta))
        self.stats["generated_tokens"] += len(sequences)
        for watch, deltas in watched.items():  # one call per request and step: a wake-up of its client's loop
            watch(deltas)
        if finished:
            self._finish(finished)

    def _finish(self, finished: list[tuple[int, str]]) -> None:
        """Hand back the sequences of these (row, reason) and free their rows."""
        for sequence, reason in zip(self._remove([row for row, _ in finished]), (reason for _, reason in finished)):
            self.stats["completed"] += 1
            sequence.future.set_result(
                Generation(sequence.token_ids, sequence.logprobs, sequence.versions, reason, sequence.top_logprobs)
            )

    def _remove(self, rows: list[int], dropped: bool = False) -> list[_Sequence]:
        """Free these rows; returns their sequences. `dropped`: their futures fail with CancelledError."""
        sequences = [self._active[row] for row in rows]
        for source, target in self._batch.remove(rows):
            self._active[target] = self._active[source]
        del self._active[self._batch.rows :]
        if dropped:
            for sequence in sequences:
                sequence.future.set_exception(CancelledError())
        return sequences

    def _reset_batch(self) -> None:
        self._active = []
        self._batch.clear()


class DecodingBatch:
    """The rows being decoded: per layer a key and a value buffer [rows, heads, columns, head dim],
    the attention mask [rows, columns], and each row's next position, last sampled token and sampling
    temperature.

    Rows 0..rows-1 are live. Every row ends at column width-1 (right-aligned); columns start..width-1
    are in use (the longest live row starts at `start`), and only they go into the attention. A
    decode step writes column `width` of every row (`open_column`, the forward, `close_column`).
    When the buffers run out of columns, the columns in use move to the left edge, into buffers of
    twice the size if they fill half of them. The first `append` allocates the buffers (its dtype
    and shapes); they are kept, so memory stays at its peak.
    """

    def __init__(self, max_rows: int, device: torch.device):
        self.max_rows, self.device = max_rows, device
        self.rows = self.start = self.width = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.mask = torch.zeros(max_rows, 0, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.last_tokens = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.temperatures = torch.ones(max_rows, device=device)
        self.cache: Cache | None = None
        """what the model's forward gets: each layer's `update` writes at column `width` (`_BufferLayer`)"""

    def append(
        self,
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor,
        positions: torch.Tensor,
        temperatures: torch.Tensor,
    ) -> None:
        """Add rows: per layer their keys and values [n, heads, length, head dim], their mask [n, length]
        (left-padded), next positions [n] and sampling temperatures [n]."""
        n, length = mask.shape
        if self.rows + n > self.max_rows:
            raise ValueError(f"{self.rows} + {n} rows exceed the batch's {self.max_rows}")
        if self.cache is None:
            columns = max(64, 2 * length)
            self.keys = [k.new_zeros(self.max_rows, k.shape[1], columns, k.shape[3]) for k, _ in layers]
            self.values = [v.new_zeros(self.max_rows, v.shape[1], columns, v.shape[3]) for _, v in layers]
            self.mask = self.mask.new_zeros(self.max_rows, columns)
            self.cache = Cache(layers=[_BufferLayer(self, i) for i in range(len(layers))])
        if not self.rows:
            self.start = self.width = 0
        if length > self.width:  # no room left of the live rows: they move right
            self._move_columns(length, capacity=length + 1)
        new, first = slice(self.rows, self.rows + n), self.width - length
        for keys, values, (k, v) in zip(self.keys, self.values, layers):
            keys[new, :, first : self.width] = k
            values[new, :, first : self.width] = v
        if self.rows and first < self.start:  # columns the live rows never wrote come into use
            self.mask[: self.rows, first : self.start] = 0
        self.start = min(self.start, first) if self.rows else first
        self.mask[new, self.start : first] = 0
        self.mask[new, first : self.width] = mask
        self.positions[new] = positions  # their last tokens: sampled from the prefill's logits next
        self.temperatures[new] = temperatures
        self.rows += n

    def remove(self, rows: list[int]) -> list[tuple[int, int]]:
        """Free these rows: the live rows past the new end move into the freed rows below it.
        Returns the moves (source row, target row)."""
        end = self.rows - len(rows)
        freed = set(rows)
        targets = sorted(r for r in freed if r < end)
        sources = [r for r in range(end, self.rows) if r not in freed]
        if targets:
            source, target = (torch.tensor(r, device=self.device) for r in (sources, targets))
            used = slice(self.start, self.width)
            for buffer in (*self.keys, *self.values):
                buffer[target, :, used] = buffer[source, :, used]
            self.mask[target, used] = self.mask[source, used]
            for per_row in (self.positions, self.last_tokens, self.temperatures):
                per_row[target] = per_row[source]
        self.rows = end
        if end:  # the columns left of the longest remaining row are no longer in use
            self.start = self.width - int(self.mask[:end, self.start : self.width].sum(1).max())
        return list(zip(sources, targets))

    def clear(self) -> None:
        """Drop every row (a failed step); the buffers stay."""
        self.rows = 0

    def open_column(self) -> torch.Tensor:
        """Make room for one more column and unmask it in the live rows; returns the step's attention mask."""
        columns = self.mask.shape[1]
        if self.width == columns:
            used = self.width - self.start
            self._move_columns(used, capacity=columns if used < columns // 2 else 2 * columns)
        self.mask[: self.rows, self.width] = 1
        return self.mask[: self.rows, self.start : self.width + 1]

    def close_column(self) -> None:
        self.width += 1
        self.positions[: self.rows] += 1

    def _move_columns(self, width: int, capacity: int) -> None:
        """Move the columns in use so that they end at column width-1, in buffers of at least
        `capacity` columns (buffers that grow at least double)."""
        used, columns = self.width - self.start, self.mask.shape[1]
        grow = capacity > columns
        if grow or (self.rows and width != self.width):
            moved = []
            for buffer in (*self.keys, *self.values, self.mask):
                axis = 2 if buffer.dim() == 4 else 1
                source = buffer[: self.rows].narrow(axis, self.start, used)
                if grow:
                    shape = list(buffer.shape)
                    shape[axis] = max(capacity, 2 * columns)
                    target = buffer.new_zeros(shape)
                else:  # in place: the source and target columns may overlap
                    target, source = buffer, source.clone()
                target[: self.rows].narrow(axis, width - used, used).copy_(source)
                moved.append(target)
            layers = len(self.keys)
            self.keys, self.values, self.mask = moved[:layers], moved[layers:-1], moved[-1]
        self.start, self.width = width - used, width


class _BufferLayer(CacheLayerMixin):
    """transformers' view of one layer of a `DecodingBatch`: `update` writes the step's keys and
    values at column `width` and returns the columns in use (start..), as views of the buffers."""

    is_initialized = True

    def __init__(self, batch: DecodingBatch, layer: int):
        self.batch, self.layer = batch, layer

    def lazy_initialization(self, key_states, value_states) -> None:
        """Nothing to allocate: `DecodingBatch.append` made the buffers."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        batch, width = self.batch, self.batch.width
        end = width + key_states.shape[2]
        keys, values = batch.keys[self.layer], batch.values[self.layer]
        keys[: batch.rows, :, width:end] = key_states
        values[: batch.rows, :, width:end] = value_states
        return keys[: batch.rows, :, batch.start : end], values[: batch.rows, :, batch.start : end]

    def get_seq_length(self) -> int:  # the columns in use: the step's queries come after them
        return self.batch.width - self.batch.start

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


def sample_tokens(logprobs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `logprobs` [rows, vocab], drawn from exp(logprobs): by inverting each row's
    cumulative distribution at one uniform draw. `torch.multinomial` draws an exponential for every
    vocabulary entry, which at a decode step of a small model's server takes several times as long as this
    (benchmarks/README.md). The draw and the sum are float64: over SmolLM2's 49152 entries float32 would
    misplace the rarest tokens' share. ValueError for a row without a distribution (NaN or every logit
    -inf: diverged weights, or a temperature that underflows), as `torch.multinomial` raised."""
    cdf = logprobs.exp().cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1:]
    if not bool(((total > 0) & total.isfinite()).all()):
        raise ValueError("cannot sample: the logits of a row are NaN or all -inf")
    draw = torch.rand(total.shape, generator=generator, device=total.device, dtype=torch.float64) * total
    # kept below the total, whatever the rounding: the first entry above it then has probability > 0
    return torch.searchsorted(cdf, torch.minimum(draw, total.nextafter(torch.zeros_like(total))), right=True)[:, 0]


def _max_positions(config) -> int:
    for name in ("n_positions", "max_position_embeddings"):
        if getattr(config, name, None):
            return getattr(config, name)
    raise ValueError(f"cannot tell the context length of {type(config).__name__}")
