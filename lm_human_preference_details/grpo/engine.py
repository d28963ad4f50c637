"""Batched decoding that keeps its batch full and lets the weights change between two decode steps.

One thread owns the model. Each loop iteration: apply a pending weight update (the only pause),
admit queued requests into free slots (one batched prefill, one row per distinct prompt: the n
samples of a prompt share it), take one decode step for every active
sequence, hand finished sequences back. A finished sequence's slot is refilled on the next
iteration, so the batch stays full while requests are queued (continuous batching).

The KV cache is one tensor per layer, rows right-aligned: a row's valid columns are a suffix, the
columns to their left are masked, and a new row joins left-padded. Sequences in flight keep their
cache across a weight update (PipelineRL: the stale keys and values are not recomputed), and every
token records the weight version that sampled it.

Why not transformers' `init_continuous_batching`: it runs its own scheduler thread, so there is no
point between two decode steps where new weights can be swapped in atomically, and it does not
report which weights produced a token.
"""

import collections
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    stop_token_ids: frozenset[int] = frozenset()
    """the sequence ends after sampling one of these (the token is kept: the policy learns to stop)"""


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    """log-probability of each sampled token under the sampling distribution (logits / temperature)"""
    versions: list[int]
    """weight version that sampled each token"""
    finish_reason: str
    """`stop` (a stop token was sampled) or `length` (max_new_tokens reached)"""


@dataclass
class _Sequence:
    request: GenerationRequest
    future: Future
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class Engine:
    """Owns the model; `submit` from any thread, `schedule_update` to swap weights between steps."""

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
        self._cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self._positions = torch.zeros(0, dtype=torch.long, device=self.device)
        self._last_tokens = torch.zeros(0, dtype=torch.long, device=self.device)
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

    def submit(self, request: GenerationRequest) -> Future:
        """Queue a request; the future resolves to a `Generation`. Checks it (`check`) before queueing."""
        return self.submit_many([request])[0]

    def submit_many(self, requests: list[GenerationRequest]) -> list[Future]:
        """Queue several requests at once (the same request object may appear several times: n samples
        of one prompt); all are checked before any is queued."""
        for request in {id(r): r for r in requests}.values():
            self.check(request)
        futures = [Future() for _ in requests]
        with self._wake:
            if self._stopped:
                raise RuntimeError("engine stopped")
            self._queue.extend(_Sequence(request, future) for request, future in zip(requests, futures))
            self._wake.notify()
        return futures

    def check(self, request: GenerationRequest) -> None:
        """ValueError, saying why, when the request cannot be generated (empty prompt, too long, unknown ids)."""
        if not request.prompt_ids:
            raise ValueError("prompt is empty")
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
                    free = self.max_batch_size - len(self._active)
                    admitted = []
                    while self._queue and len(admitted) < free:
                        sequence = self._queue.popleft()
                        if sequence.future.set_running_or_notify_cancel():  # False: its client gave up
                            admitted.append(sequence)
                for function, future, is_update in updates:
                    self._run_between_steps(function, future, is_update)
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
        for sequence in self._active + list(self._queue):
            sequence.future.cancel()
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
            ids[row, length - len(prompt):] = torch.tensor(prompt, device=self.device)
            mask[row, length - len(prompt):] = 1
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        self.stats["prefill_tokens"] += int(mask.sum())
        rows = torch.tensor(rows, device=self.device)
        new_cache = [(layer.keys[rows], layer.values[rows]) for layer in out.cache.layers]
        self._append_rows(admitted, new_cache, mask[rows], mask.sum(1)[rows])
        self._sample(out.logits[rows, -1], rows=slice(len(self._active) - len(admitted), None))

    def _decode_step(self) -> None:
        mask = torch.cat([self._mask, torch.ones_like(self._mask[:, :1])], dim=1)
        cache = DynamicCache(ddp_cache_data=self._cache)
        out = self.model(
            input_ids=self._last_tokens[:, None], attention_mask=mask, position_ids=self._positions[:, None],
            cache=cache, use_cache=True,
        )
        self._cache = [(layer.keys, layer.values) for layer in out.cache.layers]
        self._mask = mask
        self._positions = self._positions + 1
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += len(self._active)
        self._sample(out.logits[:, -1], rows=slice(None))

    def _sample(self, logits: torch.Tensor, rows: slice) -> None:
        sequences = self._active[rows]
        temperatures = torch.tensor([s.request.temperature for s in sequences], device=self.device)
        logprobs = torch.log_softmax(logits[:, : self.vocab_size].float() / temperatures[:, None], dim=-1)
        tokens = torch.multinomial(logprobs.exp(), 1, generator=self.generator)[:, 0]
        token_logprobs = logprobs.gather(1, tokens[:, None])[:, 0]
        self._last_tokens[rows] = tokens
        finished = []
        for sequence, token, logprob in zip(sequences, tokens.tolist(), token_logprobs.tolist()):
            sequence.token_ids.append(token)
            sequence.logprobs.append(logprob)
            sequence.versions.append(self.version)
            if sequence.future.cancelled():
                finished.append((sequence, "cancelled"))
            elif token in sequence.request.stop_token_ids:
                finished.append((sequence, "stop"))
            elif len(sequence.token_ids) >= sequence.request.max_new_tokens:
                finished.append((sequence, "length"))
        self.stats["generated_tokens"] += len(sequences)
        if finished:
            self._finish([s for s, _ in finished], [reason for _, reason in finished])

    def _finish(self, sequences: list[_Sequence], reasons: list[str]) -> None:
        done = {id(s) for s in sequences}
        keep = torch.tensor([id(s) not in done for s in self._active], device=self.device)
        self._active = [s for s in self._active if id(s) not in done]
        self._cache = [(k[keep], v[keep]) for k, v in self._cache]
        self._mask, self._positions, self._last_tokens = self._mask[keep], self._positions[keep], self._last_tokens[keep]
        self._trim_columns()
        for sequence, reason in zip(sequences, reasons):
            if reason != "cancelled":
                self.stats["completed"] += 1
                sequence.future.set_result(Generation(sequence.token_ids, sequence.logprobs, sequence.versions, reason))

    def _append_rows(self, sequences, cache, mask, positions) -> None:
        if not self._active:
            self._cache, self._mask = cache, mask
        else:
            width = max(self._mask.shape[1], mask.shape[1])
            old = [(_left_pad(k, width), _left_pad(v, width)) for k, v in self._cache]
            new = [(_left_pad(k, width), _left_pad(v, width)) for k, v in cache]
            self._cache = [(torch.cat([ok, nk]), torch.cat([ov, nv])) for (ok, ov), (nk, nv) in zip(old, new)]
            self._mask = torch.cat([_left_pad(self._mask, width), _left_pad(mask, width)])
        self._positions = torch.cat([self._positions, positions])
        self._last_tokens = torch.cat([self._last_tokens, torch.zeros_like(positions)])
        self._active.extend(sequences)

    def _trim_columns(self) -> None:
        # rows are right-aligned, so the columns no row uses are a prefix
        if not self._active:
            self._reset_batch()
            return
        width = int(self._mask.sum(1).max())
        if width < self._mask.shape[1]:
            self._cache = [(k[:, :, -width:], v[:, :, -width:]) for k, v in self._cache]
            self._mask = self._mask[:, -width:]

    def _reset_batch(self) -> None:
        self._active, self._cache = [], []
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self._positions = torch.zeros(0, dtype=torch.long, device=self.device)
        self._last_tokens = torch.zeros(0, dtype=torch.long, device=self.device)


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Pad the sequence axis (dim 2 of a cache tensor [B, heads, T, d], dim 1 of a mask [B, T]) on the left."""
    axis = 2 if tensor.dim() == 4 else 1
    missing = width - tensor.shape[axis]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[axis] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=axis)


def _max_positions(config) -> int:
    for name in ("n_positions", "max_position_embeddings"):
        if getattr(config, name, None):
            return getattr(config, name)
    raise ValueError(f"cannot tell the context length of {type(config).__name__}")
