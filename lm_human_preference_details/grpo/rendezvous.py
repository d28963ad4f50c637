"""How the launchers of a multi-node run meet and part: a `TCPStore` on node 0.

torch.distributed's key-value store at `MASTER_ADDR:MASTER_PORT` needs no service of its own: node 0's launcher
holds it, the others connect. Through it the launchers
- compare their world maps (`meet`): nodes started with other flags are refused before anything starts;
- hear node 0's decisions (`RunStart`): the weights version, the model, the servers' control token, the port of
  the trainer's process group;
- publish the URLs of the servers they start, and read everyone's (`publish_servers`, `server_urls`);
- hear of each other's end (`watch`, `check`): a node that fails says so, a node that is killed falls silent, and
  node 0 going away closes the store; within `SILENCE_LIMIT_S` every launcher knows and stops its processes;
- stop together on a cluster's signal (`request_stop`, `stopped`): a launcher that receives one asks every node to
  stop, node 0 says where the run stopped once its trainer checkpointed, and every node ends with that line.

Every value in the store is a typed record with a schema version (`NodeHello`, `RunStart`) or a line of text.
"""

import contextlib
import datetime
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from lm_human_preference_details import preemption

log = logging.getLogger(__name__)

SCHEMA = 1
HEARTBEAT_S = 1.0
"""how often each launcher says it is alive"""
SILENCE_LIMIT_S = 10.0
"""a node silent this long is taken as gone (a killed launcher cannot say so)"""
PARTING_S = 10.0
"""how long node 0 keeps the store up at the end, for the others to hear how the run ended"""


class NodeLost(RuntimeError):
    """Another node failed or went away; the message names it and what it ran."""


class RendezvousError(RuntimeError):
    """The nodes could not meet (one never joined, or their maps differ); the message names the node."""


def _record(cls, text: bytes):
    data = json.loads(text)
    if data.get("schema") != SCHEMA:
        raise RendezvousError(
            f"a launcher wrote a {cls.__name__} of schema {data.get('schema')!r}, this one reads {SCHEMA}: "
            "run the same version of the package on every node"
        )
    del data["schema"]
    return cls(**data)


@dataclass(frozen=True)
class NodeHello:
    """What a launcher says when it joins: its map's digest and the address its servers listen at."""

    node_rank: int
    map_digest: str
    address: str

    def to_json(self) -> str:
        return json.dumps({"schema": SCHEMA, **asdict(self)})


@dataclass(frozen=True)
class RunStart:
    """Node 0's decisions, which every node starts from."""

    version: int  # the weights the servers start with (a resumed run's checkpoint)
    model: str  # what the servers load, as each node resolves it: the model, or a resumed run's checkpoint folder
    control_token: str  # the servers' control token, only where the store is this machine's loopback; else ""
    control_token_sha256: str  # beyond loopback each node has the token from its environment: they compare
    trainer_port: int  # MASTER_PORT of the trainer's process group, at node 0's address
    run_id: str  # also in node 0's world.json: a node that reads it there sees node 0's run folder

    def to_json(self) -> str:
        return json.dumps({"schema": SCHEMA, **asdict(self)})


class Rendezvous:
    """This launcher's side of the meeting; node 0's holds the store."""

    def __init__(
        self,
        node_rank: int,
        nnodes: int,
        master_addr: str,
        master_port: int,
        roles: dict[int, str],
        timeout_s: float,
        agent_store: str | None = None,
    ):
        """`roles`: what each node runs, in words, for the lines that name a lost node (`WorldMap.roles_of`).
        `agent_store`: torchrun's agent on node 0 already holds a store at the address, which every launcher then
        joins, its keys under this prefix (torchrun's restart count: a restarted run does not read the last one's)."""
        self.node_rank, self.nnodes, self.roles = node_rank, nnodes, roles
        self.host, self.port, self.where = master_addr, master_port, f"{master_addr}:{master_port}"
        self.timeout_s = timeout_s
        self.prefix = f"grpo/{agent_store}" if agent_store is not None else "grpo"
        self._failure: str | None = None
        self._node0_done = False
        self._stop_requested = 0  # the signal a launcher asked every node to stop on (`request_stop`)
        self._stop_posted = False
        self._stopped: str | None = None  # node 0's line, once the run stopped on that signal
        self._stop = threading.Event()
        self.hellos: dict[int, NodeHello] = {}  # once met: node 0's (every node's, on node 0)
        self.store = self._connect(is_master=node_rank == 0 and agent_store is None, timeout_s=timeout_s)

    def _connect(self, is_master: bool, timeout_s: float):
        """A connection to the store (node 0's launcher: the store itself), its keys under `prefix`; each operation
        waits at most `timeout_s`."""
        import torch.distributed as dist  # torch: only for a run over several nodes

        try:
            store = dist.TCPStore(
                self.host,
                self.port,
                self.nnodes,
                is_master,
                timeout=datetime.timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as error:  # DistNetworkError, DistStoreError: both RuntimeErrors
            if is_master:
                raise RendezvousError(
                    f"node 0 cannot listen at {self.where} for the other nodes ({error}): pass a free --master-port"
                ) from None
            raise RendezvousError(
                f"node 0's rendezvous at {self.where} did not answer within {timeout_s:.0f} s "
                f"({error}): start node 0 with the same --master-addr and --master-port"
            ) from None
        return dist.PrefixStore(self.prefix, store)

    def meet(self, hello: NodeHello) -> dict[int, NodeHello]:
        """Say hello and wait for every node's; RendezvousError naming a node that did not join within the timeout,
        a rank two launchers claim, or a map that differs from node 0's (every node checks its own against node 0's,
        node 0 checks them all; node 0 tells the others why it stops)."""
        if self.store.add(f"joined/{self.node_rank}", 1) != 1:
            raise RendezvousError(
                f"node rank {self.node_rank} joined twice: give each node's launcher its own --node-rank"
            )
        self.store.set(f"hello/{self.node_rank}", hello.to_json())
        others = range(self.nnodes) if self.node_rank == 0 else [0]
        try:
            raws = self._wait_all([f"hello/{r}" for r in others])
            self.hellos = {rank: _record(NodeHello, raw) for rank, raw in raws.items()}
            for rank, theirs in self.hellos.items():
                if theirs.map_digest != hello.map_digest:
                    raise RendezvousError(
                        f"node {rank if self.node_rank == 0 else self.node_rank}'s world map differs from node 0's "
                        "(other flags, or other GPUs on that node): start every node with the same command and "
                        "--gpus-per-node"
                    )
        except RendezvousError as error:
            self.fail(f"node {self.node_rank} ({self.roles.get(self.node_rank, '')}): {error}")
            raise
        return self.hellos

    def _wait_all(self, keys: list[str]) -> dict[int, bytes]:
        deadline = time.monotonic() + self.timeout_s
        while not all(self._has(key) for key in keys):
            if time.monotonic() > deadline:
                missing = [key.rsplit("/", 1)[1] for key in keys if not self._has(key)]
                raise RendezvousError(
                    f"node {', '.join(missing)} did not join within {self.timeout_s:.0f} s "
                    f"({'; '.join(self.roles.get(int(r), '') for r in missing)}): start it with the same command, "
                    f"rendezvous at {self.where}"
                )
            time.sleep(0.05)
        return {int(key.rsplit("/", 1)[1]): self.store.get(key) for key in keys}

    def _has(self, key: str) -> bool:
        """Whether the store holds `key`; NodeLost naming the failure a node posted, or node 0 once its store is
        gone."""
        try:
            failed = self.store.get("failed").decode() if self.store.check(["failed"]) else None
            present = self.store.check([key])
        except RuntimeError as error:
            raise NodeLost(self._node0_gone(error)) from None
        if failed is not None:
            raise NodeLost(failed)
        return present

    def _node0_gone(self, error: Exception) -> str:
        return f"node 0 ({self.roles.get(0, '')}) is gone: its rendezvous at {self.where} stopped answering ({error})"

    def announce(self, start: RunStart) -> None:
        """Node 0: the decisions the others wait for."""
        self.store.set("start", start.to_json())

    def run_start(self) -> RunStart:
        """Node 0's decisions, waiting for them (node 0 checks the folder and the stream first)."""
        return _record(RunStart, self._wait_until("start", lambda: None, deadline=time.monotonic() + self.timeout_s))

    def publish_servers(self, urls: dict[int, str]) -> None:
        """The URLs of the servers this node started, by their index in the map."""
        for index, url in urls.items():
            self.store.set(f"server/{index}", url)

    def server_urls(self, count: int, while_waiting: Callable[[], None]) -> dict[int, str]:
        """Every server's URL, once every node has published its own (servers take their time to load: no limit,
        as a node that fails or goes away ends the wait); `while_waiting()` is called between looks (the launcher
        checks its own processes; what it raises ends the wait), and so is `check`."""
        return {index: self._wait_until(f"server/{index}", while_waiting).decode() for index in range(count)}

    def _wait_until(self, key: str, while_waiting: Callable[[], None], deadline: float = float("inf")) -> bytes:
        """The key's value once set, waiting until `deadline` (time.monotonic's)."""
        while not self._has(key):
            while_waiting()
            self.check()
            if time.monotonic() > deadline:
                raise RendezvousError(f"node 0 did not write {key!r} in the store within {self.timeout_s:.0f} s")
            time.sleep(0.1)
        return self.store.get(key)

    def watch(self) -> None:
        """Start saying that this node is alive, and listening for the others' end (`check` raises it): node 0
        listens for every node's heartbeat, the others for node 0's."""
        threading.Thread(target=self._watch_forever, name="rendezvous-watch", daemon=True).start()

    def _watch_forever(self) -> None:
        # a connection of its own, whose operations give up as soon as a silent node would be taken as gone
        store = self._connect(is_master=False, timeout_s=SILENCE_LIMIT_S)
        watched = range(1, self.nnodes) if self.node_rank == 0 else [0]
        seen = {rank: (-1, time.monotonic()) for rank in watched}
        while not self._stop.wait(HEARTBEAT_S):
            try:
                store.add(f"alive/{self.node_rank}", 1)
                if store.check(["failed"]):
                    self._failure = store.get("failed").decode()
                    return
                if self.node_rank != 0 and store.check(["done"]):
                    self._node0_done = True
                    return
                if not self._stop_requested and store.check(["stop"]):
                    self._stop_requested = int(store.get("stop"))
                if self.node_rank != 0 and store.check(["stopped"]):
                    self._stopped = store.get("stopped").decode()
                    return
                for rank, (count, since) in seen.items():
                    now = store.add(f"alive/{rank}", 0)
                    if now != count:
                        seen[rank] = (now, time.monotonic())
                    elif time.monotonic() - since > SILENCE_LIMIT_S:
                        line = f"node {rank} ({self.roles.get(rank, '')}) fell silent for {SILENCE_LIMIT_S:.0f} s"
                        store.compare_set("failed", "", line)  # the first failure told is the one every node prints
                        self._failure = store.get("failed").decode()
                        return
            except RuntimeError as error:  # the store is node 0's: it is gone, or cannot be reached
                self._failure = self._node0_gone(error)
                return

    def check(self) -> None:
        """NodeLost if another node failed or went away; `preemption.Preempted`, with node 0's line, once node 0
        said the run stopped on a signal (`stopped`)."""
        if self._failure is not None:
            raise NodeLost(self._failure)
        if self._stopped is not None:
            raise preemption.Preempted(self._stopped)

    def request_stop(self, signum: int) -> None:
        """Ask every node to stop the run (this launcher received `signum`, a cluster's "stop soon"; the first
        request is the one all hear); best effort: the store may be gone."""
        if not self._stop_posted:
            with contextlib.suppress(RuntimeError):
                self.store.compare_set("stop", "", str(signum))
            self._stop_posted = True

    @property
    def stop_requested(self) -> int:
        """The signal some launcher asked every node to stop on, as heard within a heartbeat; 0: none."""
        return self._stop_requested

    def stopped(self, line: str) -> None:
        """Node 0: the run stopped on a signal, with a checkpoint; `line` (where it stopped) is every node's last."""
        with contextlib.suppress(RuntimeError):
            self.store.set("stopped", line)

    @property
    def node0_done(self) -> bool:
        """Whether node 0 said the run is over (its trainer finished)."""
        return self._node0_done

    def fail(self, line: str) -> None:
        """Tell every node that the run failed, and why (first one wins); best effort: the store may be gone."""
        with contextlib.suppress(RuntimeError):
            self.store.compare_set("failed", "", line)

    def part(self, ok: bool) -> None:
        """The end: node 0 says the run is over (`ok`) and waits up to `PARTING_S` for every node to have heard
        it before its store goes; the others say they heard it."""
        self._stop.set()
        with contextlib.suppress(RuntimeError):  # the store may be gone: nothing left to tell
            if self.node_rank != 0:
                self.store.set(f"parted/{self.node_rank}", "1")
                return
            if ok:
                self.store.set("done", "1")
            deadline = time.monotonic() + PARTING_S
            keys = [f"parted/{rank}" for rank in range(1, self.nnodes)]
            while not all(self.store.check([key]) for key in keys) and time.monotonic() < deadline:
                time.sleep(0.1)
