"""Weights from the trainer to the inference servers (PipelineRL's in-flight update).

Each server gets a process group of its own with the trainer (rank 0 = trainer, ranks 1 on = the
server's: one, or one per worker of a tensor-parallel vLLM server, as its /health's `weight_ranks`
says; each worker receives every tensor whole and loads its own shard of it), gloo by default (CPU
tensors, or GPU tensors through host memory) or NCCL between two GPUs (NCCL refuses two ranks on one
GPU, so a server that shares the trainer's GPU takes gloo). One group per server, not one for all: a
server that dies takes only its own group down, and the trainer carries on with the others. The
groups are built from a TCPStore, outside `torch.distributed`'s default group, so a trainer launched
by accelerate keeps its own. An update is announced over HTTP with every tensor's name, shape and
dtype (`protocol.ParameterSpec`); the server checks them against its model before anything is
received, then the trainer broadcasts tensor by tensor (PipelineRL's way), or, with a bucket size,
consecutive tensors concatenated into flat buckets: on gloo every broadcast has a CPU cost on each
side however small its tensor, which a small model's many small tensors pay over and over where one
bucket of them pays it once (benchmarks/README.md has the timings). One trainer process snapshots its weights and
sends them from a thread while it takes its next step (`push`); a sharded trainer gathers them a bucket at a time
and sends each as the next is gathered (`push_streamed`), never holding them whole.
"""

import collections
import contextlib
import datetime
import hashlib
import logging
import math
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from typing import get_args
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from lm_human_preference_details.grpo.client import ServerError, request_json
from lm_human_preference_details.grpo.protocol import WIRE_DTYPES, ParameterSpec, WeightBackend, WeightStaging

log = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, name) for name in WIRE_DTYPES}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def served_dtype(url: str) -> torch.dtype:
    """The dtype of a server's weights (its /health says): updates go out in it, since the server checks the
    announced dtypes against its own before receiving (bfloat16 on a GPU, where the trainer's are float32)."""
    return DTYPES[request_json("GET", f"{url}/health")["dtype"]]


def parameter_specs(model: torch.nn.Module, dtype: torch.dtype | None = None) -> list[ParameterSpec]:
    """What an update of `model` sends: every parameter (tied ones once), in `dtype` if given."""
    return tensor_specs(model.named_parameters(), dtype)


def tensor_specs(
    parameters: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
) -> list[ParameterSpec]:
    """The specs of named tensors, in `dtype` if given."""
    return [ParameterSpec(name, tuple(p.shape), DTYPE_NAMES[dtype or p.dtype]) for name, p in parameters]


def digest(model: torch.nn.Module) -> dict[str, str]:
    """SHA-256 of each parameter's bytes (equal digests: bitwise equal weights)."""
    return tensor_digests(model.named_parameters())


def tensor_digests(parameters: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """`digest` of named tensors (a sharded model's, gathered)."""
    return {
        name: hashlib.sha256(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for name, p in parameters
    }


class WeightGroup:
    """A process group of its own between the trainer (rank 0) and one or more servers."""

    def __init__(
        self,
        init_method: str,
        rank: int,
        world_size: int,
        backend: WeightBackend = "gloo",
        timeout_s: float = 300,
        store: dist.TCPStore | None = None,
    ):
        """Joins the group whose rank 0 listens at `init_method` (tcp://HOST:PORT); rank 0 passes the
        store it listens with (`listening_store`), whose port `init_method` names."""
        url = urlparse(init_method)
        if url.scheme != "tcp" or not url.hostname or not url.port:
            raise ValueError(f"init_method {init_method!r}: expected tcp://HOST:PORT")
        if backend not in get_args(WeightBackend):
            raise ValueError(f"backend {backend!r}: expected gloo or nccl")
        if (rank == 0) != (store is not None) or store is not None and store.port != url.port:
            raise ValueError(f"rank {rank}: rank 0, and only rank 0, passes the listening_store at {init_method}")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = (
            store if store is not None else dist.TCPStore(url.hostname, url.port, world_size, False, timeout=timeout)
        )
        prefixed = dist.PrefixStore("weights", self.store)
        if backend == "gloo":
            self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            self.group = dist.ProcessGroupNCCL(prefixed, rank, world_size)
        self.rank, self.world_size, self.backend = rank, world_size, backend

    def broadcast(self, tensor: torch.Tensor):
        """Start broadcasting `tensor` from rank 0 into the same-shaped tensor of every rank; returns the work."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        return self.group.broadcast([tensor], options)


def buckets(specs: list[ParameterSpec], bucket_bytes: int) -> list[list[int]]:
    """Which tensors of an update go in which broadcast (indices into `specs`, in order): consecutive
    tensors of one dtype, up to `bucket_bytes` per broadcast (a larger tensor goes alone); 0: one
    broadcast per tensor. Trainer and server both derive it from the announced specs and size."""
    plan: list[list[int]] = []
    size = 0
    for i, spec in enumerate(specs):
        nbytes = math.prod(spec.shape) * DTYPES[spec.dtype].itemsize
        if bucket_bytes and plan and size + nbytes <= bucket_bytes and specs[plan[-1][0]].dtype == spec.dtype:
            plan[-1].append(i)
            size += nbytes
        else:
            plan.append([i])
            size = nbytes
    return plan


def flatten(
    tensors: list[torch.Tensor],
    plan: list[list[int]],
    dtype: torch.dtype | None = None,
    pool: "BufferPool | None" = None,
) -> Iterator[torch.Tensor]:
    """One flat tensor per bucket of `plan` (new, or from `pool`), its tensors' values one after another (cast to
    `dtype` if given), yielded as soon as it is full: each value is copied once, cast on the way."""
    pool = pool or BufferPool()  # an empty one: fresh buffers
    for bucket in plan:
        first = tensors[bucket[0]]
        buffer = pool.take(sum(tensors[i].numel() for i in bucket), dtype or first.dtype, first.device)
        for i, piece in zip(bucket, buffer.split([tensors[i].numel() for i in bucket])):
            piece.copy_(tensors[i].reshape(-1))
        yield buffer


def unflatten(flat: list[torch.Tensor], specs: list[ParameterSpec], plan: list[list[int]]) -> list[torch.Tensor]:
    """The inverse of `flatten`: one tensor per spec, in spec order (views of the flat buffers)."""
    tensors: list[torch.Tensor | None] = [None] * len(specs)
    for bucket, buffer in zip(plan, flat):
        for i, piece in zip(bucket, buffer.split([math.prod(specs[i].shape) for i in bucket])):
            tensors[i] = piece.view(specs[i].shape)
    return tensors


_TRANSFER_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def transfer_stream(device: torch.device) -> "torch.cuda.Stream | None":
    """On a GPU, the stream that weight transfers run on (one per GPU, for the life of the process); None on a CPU.
    Broadcasts queued on the stream that computes would hold up every kernel queued after them until the
    other side sends or receives (NCCL's `wait` orders streams, it does not block the host): the server's
    decoding would stall for the whole transfer, the trainer's next step too. The cost: memory freed on this
    stream is reused only by it, so a server keeps one update's buffers aside for the next."""
    if device.type != "cuda":
        return None
    if device not in _TRANSFER_STREAMS:
        _TRANSFER_STREAMS[device] = torch.cuda.Stream(device)
    return _TRANSFER_STREAMS[device]


def on_stream(stream: "torch.cuda.Stream | None"):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _queued_before(tensor: torch.Tensor) -> "torch.cuda.Event | None":
    """On a GPU, an event after the work queued so far on the current stream (the copies that made `tensor`), for
    the transfer stream to wait for; None on a CPU."""
    if not tensor.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


class BufferPool:
    """Flat buffers kept between updates, to be written again: on a CPU a fresh buffer's pages are faulted in and
    zeroed by the kernel as they are first written, which costs more than the copy or the receive into them
    (benchmarks/README.md). A buffer is taken again only for a bucket of its very
    size and dtype, and nothing else may hold one that was given back. On a GPU the caching allocator already
    reuses memory, so the pool keeps nothing there. Safe to use from several threads."""

    def __init__(self):
        self._free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """A flat buffer of `numel` elements of `dtype` on `device`, given back earlier if one is free."""
        with self._lock:
            free = self._free.get((numel, dtype, torch.device(device)))
            if free:
                return free.pop()
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buffers: Iterable[torch.Tensor]) -> None:
        """Keep `buffers` (CPU ones) for a later `take`; the caller holds none of them any more."""
        with self._lock:
            for buffer in buffers:
                if buffer.device.type == "cpu":
                    self._free.setdefault((buffer.numel(), buffer.dtype, buffer.device), []).append(buffer)


def receive_buckets(
    group: WeightGroup, specs: list[ParameterSpec], device, bucket_bytes: int = 0, pool: BufferPool | None = None
) -> list[torch.Tensor]:
    """Server side: one broadcast per bucket (`buckets`; a bucket of one tensor when bucket_bytes is 0), each into
    a flat buffer of its own (from `pool` if given; the model is not touched); returns the flat buffers once every
    broadcast has arrived (on a GPU: on `transfer_stream`, waited for by the host). `unflatten` gives the tensors."""
    plan = buckets(specs, bucket_bytes)
    stream = transfer_stream(torch.device(device))
    pool = pool or BufferPool()  # an empty one: fresh buffers
    with on_stream(stream):
        flat = [
            pool.take(sum(math.prod(specs[i].shape) for i in bucket), DTYPES[specs[bucket[0]].dtype], device)
            for bucket in plan
        ]
        for work in [group.broadcast(buffer) for buffer in flat]:
            work.wait()
    if stream is not None:
        stream.synchronize()
    return flat


def receive_tensors(
    group: WeightGroup, specs: list[ParameterSpec], device, bucket_bytes: int = 0
) -> list[torch.Tensor]:
    """`receive_buckets` into fresh buffers; one tensor per spec (views of them)."""
    return unflatten(receive_buckets(group, specs, device, bucket_bytes), specs, buckets(specs, bucket_bytes))


def load_tensors(model: torch.nn.Module, specs: list[ParameterSpec], tensors: list[torch.Tensor]) -> None:
    """Copy received tensors into the model's parameters, all at once (between two decode steps): `in_place`
    staging. On a GPU it returns once the copies are done (so the pause a server reports includes them): the
    received buffers may be reused by the next transfer after that."""
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for spec, tensor in zip(specs, tensors):
            parameters[spec.name].copy_(tensor)
    if tensors and tensors[0].is_cuda:
        torch.cuda.current_stream(tensors[0].device).synchronize()


def install_tensors(
    model: torch.nn.Module, specs: list[ParameterSpec], tensors: list[torch.Tensor], staging: WeightStaging
) -> None:
    """Put received tensors in the model as `staging` says (`swap_tensors` or `load_tensors`)."""
    (swap_tensors if staging == "staged" else load_tensors)(model, specs, tensors)


def swap_tensors(model: torch.nn.Module, specs: list[ParameterSpec], tensors: list[torch.Tensor]) -> None:
    """Make received tensors the model's parameters' data, all at once (between two decode steps): `staged`
    staging, whose pause is a pointer swap per parameter, however large the model. The parameter objects stay (a
    tied head is the embedding's object, so it follows); the old data is freed once nothing holds it, so the
    memory is that of `load_tensors`: the received buffers, beside the weights, during the receive. On a GPU the
    buffers come from `transfer_stream`: they are marked in use by the computing stream, so that freeing them
    at a later swap does not hand their memory to a transfer while a decode step still reads it."""
    parameters = dict(model.named_parameters())
    computing = torch.cuda.current_stream(tensors[0].device) if tensors and tensors[0].is_cuda else None
    with torch.no_grad():
        for spec, tensor in zip(specs, tensors):
            if computing is not None:
                tensor.record_stream(computing)
            parameters[spec.name].data = tensor


class WeightSender:
    """Trainer side: one process group per server; `push` after every optimizer step (`push_streamed` where the
    weights are gathered from shards)."""

    def __init__(
        self, server_urls: list[str], backend: WeightBackend = "gloo", host: str = "127.0.0.1", timeout_s: float = 300
    ):
        self.groups = {url: join_server(url, backend, host, timeout_s) for url in server_urls}
        self.timeout_s = timeout_s
        self._queue: queue.Queue = queue.Queue(maxsize=1)  # snapshots waiting for the sender thread
        self._buffers = BufferPool()  # the snapshots' buckets, written again by the snapshot after next
        self._lock = threading.Lock()
        self._dropped: list[str] = []  # since push or wait last returned them
        self._ever_dropped: list[str] = []
        self._failed: Exception | None = None  # a refusal, or the sender thread's own failure: raised by push/wait
        self.last_broadcast_s = 0.0  # announce to received, of the last push that completed
        threading.Thread(target=self._send_forever, name="weight-sender", daemon=True).start()

    def push(
        self, model: torch.nn.Module, version: int, dtype: torch.dtype | None = None, bucket_bytes: int = 0
    ) -> list[str]:
        """Snapshot the parameters and hand them to the sender thread (announce to every live server,
        then one broadcast per tensor, or per bucket of at most `bucket_bytes`), so the next optimizer
        step overlaps the transfer. The thread announces while the snapshot is taken and sends each bucket
        as soon as it is copied. Blocks only while an earlier snapshot still waits its turn (one is
        sent, one may wait). Returns the servers dropped so far (unreachable); raises if a server
        refused an update (trainer and servers disagree about the model), the sender thread failed, or every
        server has been dropped."""
        return self.push_tensors(model.named_parameters(), version, dtype, bucket_bytes)

    def push_tensors(
        self,
        parameters: Iterable[tuple[str, torch.Tensor]],
        version: int,
        dtype: torch.dtype | None = None,
        bucket_bytes: int = 0,
    ) -> list[str]:
        """`push` of named whole tensors, in the order and with the names of the model's `named_parameters()`."""
        self.check()
        parameters = [(name, p.detach()) for name, p in parameters]
        specs = tensor_specs(parameters, dtype)
        copied: queue.SimpleQueue = queue.SimpleQueue()  # (bucket, its copies' event) as each is made; then None
        self._queue.put((specs, copied, version, bucket_bytes))
        try:
            with torch.no_grad():
                for bucket in flatten([p for _, p in parameters], buckets(specs, bucket_bytes), dtype, self._buffers):
                    copied.put((bucket, _queued_before(bucket)))
        except BaseException:  # the sender thread, waiting for the next bucket, would wait forever
            copied.put(_COPY_FAILED)
            raise
        copied.put(None)
        return self._take_dropped()

    def push_streamed(
        self, specs: list[ParameterSpec], flat_buckets: Iterable[torch.Tensor], version: int, bucket_bytes: int = 0
    ) -> list[str]:
        """`push` of weights made one bucket at a time (a sharded model's, gathered bucket by bucket, where a whole
        copy would not fit): `specs` are announced, then each of `flat_buckets` (the flat tensors of
        `buckets(specs, bucket_bytes)`, in order, in the specs' dtypes) is broadcast while the next one is made,
        and waited for once that one's broadcast has started: at most two buckets are held. In the caller's thread,
        after any push still in flight; returns once every server has this one. `flat_buckets` is drained even
        when nothing can be sent (a refusal, no server left), and only then is that raised: the processes that
        gather with this one are still gathering."""
        self._queue.join()  # the sender thread's push in flight reaches the servers first
        ready = ((bucket, _queued_before(bucket)) for bucket in flat_buckets)
        try:
            self.check()
            self._send(specs, ready, version, bucket_bytes, in_flight=1)
        except BaseException:
            collections.deque(ready, maxlen=0)  # the other processes still gather: they need this one in each gather
            raise
        self._raise_if_failed()
        return self._take_dropped()

    def wait(self) -> list[str]:
        """Wait until every push has reached every server; returns the servers dropped meanwhile."""
        self._queue.join()
        self._raise_if_failed()
        return self._take_dropped()

    def check(self) -> None:
        """Raise what stops the run: a refused update, the sender thread's failure, or no server left to
        update (with none, the servers' weights would never change again and the actor, held back by
        them, would wait forever: so would a trainer waiting for its samples, which calls this meanwhile)."""
        self._raise_if_failed()
        if not self.groups and self._ever_dropped:
            raise RuntimeError(
                f"every server was dropped from weight updates ({', '.join(self._ever_dropped)}): "
                "no weights can reach the servers any more; see their logs"
            )

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed

    def _take_dropped(self) -> list[str]:
        with self._lock:
            dropped, self._dropped = self._dropped, []
        return dropped

    def _send_forever(self) -> None:
        while True:
            specs, copied, version, bucket_bytes = self._queue.get()
            sent: list[torch.Tensor] = []
            try:
                if self._failed is None:  # after a failure nothing more is sent until push/wait raised it
                    dropped_before = len(self._ever_dropped)
                    self._send(specs, _as_made(copied, sent), version, bucket_bytes)
                    if len(self._ever_dropped) == dropped_before:  # a dropped server's broadcasts were not waited for
                        self._buffers.give(sent)  # sent: the next snapshot is copied into them
            except Exception as error:  # the thread lives on, so that push and wait raise it rather than block
                self._failed = error
            finally:
                self._queue.task_done()

    def _send(
        self,
        specs: list[ParameterSpec],
        flat_buckets: Iterable[tuple[torch.Tensor, "torch.cuda.Event | None"]],
        version: int,
        bucket_bytes: int,
        in_flight: int | None = None,
    ) -> None:
        """Announce `specs`, then broadcast each flat bucket (with, on a GPU, the event after its copies) to every
        server that accepted, each bucket to all of them before any is waited for. With `in_flight`, a bucket's
        broadcasts are waited for (and the bucket let go) once `in_flight` later buckets' have started; else
        all at the end. `last_broadcast_s` counts from the announce, the making of streamed buckets included."""
        start = time.perf_counter()
        announced, refusal = self._announce(specs, version, bucket_bytes)
        # (bucket, kept until its broadcasts are done; its stream; {url: work}), oldest first
        sending: collections.deque = collections.deque()
        for bucket, ready in flat_buckets:
            stream = transfer_stream(bucket.device)
            with on_stream(stream):
                if ready is not None:
                    stream.wait_event(ready)
                works = {}
                for url in announced:
                    if url not in self.groups:  # dropped by an earlier bucket
                        continue
                    try:
                        works[url] = self.groups[url].broadcast(bucket)
                    except RuntimeError as error:  # some backends fail at the call (NCCL: two ranks on one GPU)
                        self._drop(url, error)
            sending.append((bucket, stream, works))
            while in_flight is not None and len(sending) > in_flight:
                self._finish(*sending.popleft()[1:])
        while sending:
            self._finish(*sending.popleft()[1:])
        self.last_broadcast_s = time.perf_counter() - start
        if refusal is not None:
            self._failed = refusal

    def _announce(
        self, specs: list[ParameterSpec], version: int, bucket_bytes: int
    ) -> tuple[list[str], ServerError | None]:
        """Announce an update to every server in turn: the servers that accepted it, and the first refusal (the
        servers after it are not asked); a server that cannot be reached is dropped."""
        payload = {"version": version, "parameters": [s.to_json() for s in specs], "bucket_bytes": bucket_bytes}
        announced = []
        for url in list(self.groups):
            try:
                reply = request_json("POST", f"{url}/request_weight_update", payload, timeout_s=self.timeout_s)
                if reply.get("bucket_bytes", 0) != bucket_bytes:  # a server that ignores buckets waits for other
                    # broadcasts than ours: it gets none, and the run fails
                    raise ServerError(
                        f"{url} does not take weight updates in buckets ({bucket_bytes} bytes): "
                        f"update the server or use --update-bucket-mb 0",
                        status=400,
                    )
                announced.append(url)
            except ServerError as error:
                if error.status is not None:  # refused: raised by push, check and wait once the servers that
                    return announced, error  # accepted have this update (they wait for it: a trainer that
                    # stopped now would leave them stale)
                self._drop(url, error)
        return announced, None

    def _finish(self, stream: "torch.cuda.Stream | None", works: dict) -> None:
        """Wait for a bucket's broadcasts to the servers still live, dropping a server whose broadcast failed; on a
        GPU until the transfer stream has sent it, after which the bucket may be freed."""
        with on_stream(stream):
            for url, work in works.items():
                if url not in self.groups:
                    continue
                try:
                    work.wait()
                except RuntimeError as error:
                    self._drop(url, error)
        if stream is not None:
            stream.synchronize()  # sent: `wait` and the trainer's exit rely on it, and the bucket may be freed

    def _drop(self, url: str, error: Exception) -> str:
        log.warning("server %s failed (%s): no more weight updates to it", url, error)
        del self.groups[url]
        with self._lock:
            self._dropped.append(url)
            self._ever_dropped.append(url)
        return url


_COPY_FAILED = object()
"""what `push_tensors` puts after the buckets it copied when its copy failed"""


def _as_made(copied: queue.SimpleQueue, sent: list[torch.Tensor]):
    """The (bucket, event) pairs of a snapshot as `push_tensors` copies them, until its None; each bucket is also
    kept in `sent`, to be given back once sent. A failed copy raises here: the servers wait for buckets that will
    not come, and roll back after their group's timeout."""
    while (made := copied.get()) is not None:
        if made is _COPY_FAILED:
            raise RuntimeError("the trainer's snapshot of the weights failed part way; see its traceback")
        sent.append(made[0])
        yield made


def group_size(health: dict) -> int:
    """The size of the weight group with a server whose /health replied `health`: the trainer and the server's
    `weight_ranks` (a tensor-parallel vLLM server's workers, one rank each; servers that do not say have one)."""
    return 1 + health.get("weight_ranks", 1)


def join_server(url: str, backend: WeightBackend, host: str, timeout_s: float) -> WeightGroup:
    """A weight group of the trainer (rank 0) and the server at `url` (ranks 1 on), listening at `host`."""
    world_size = group_size(request_json("GET", f"{url}/health", timeout_s=timeout_s))
    store = listening_store(host, world_size, timeout_s)
    init_method = f"tcp://{host}:{store.port}"
    built: dict = {}
    # our side of the rendezvous waits for the server's: build it aside while the server is asked
    rendezvous = threading.Thread(
        target=_build_group_into, args=(built, init_method, world_size, backend, timeout_s, store), daemon=True
    )
    rendezvous.start()
    request_json(
        "POST",
        f"{url}/init_process_group",
        {"init_method": init_method, "rank": 1, "world_size": world_size, "backend": backend, "timeout_s": timeout_s},
        timeout_s=timeout_s,
    )
    rendezvous.join()
    if "error" in built:
        raise built["error"]
    return built["group"]


def _build_group_into(
    built: dict, init_method: str, world_size: int, backend: str, timeout_s: float, store: dist.TCPStore
) -> None:
    try:
        built["group"] = WeightGroup(init_method, 0, world_size, backend, timeout_s, store)
    except RuntimeError as error:
        built["error"] = error


def listening_store(host: str, world_size: int, timeout_s: float = 300) -> dist.TCPStore:
    """Rank 0's store of a new group, listening on a port the OS picks (`.port`): a port chosen
    beforehand could be taken by another process before the store binds it."""
    return dist.TCPStore(
        host, 0, world_size, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )
