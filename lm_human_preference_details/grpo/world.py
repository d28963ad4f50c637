"""Where a GRPO run's processes go: this node (from the flags or the scheduler's variables), the devices on each
node, and the world map that splits them into inference servers and trainer processes.

Every node's launcher builds the same map from the same numbers (`build_world_map` is pure; nodes compare maps
through its digest) and starts the processes that the map puts on its node. PipelineRL's `pipelinerl/world.py` is
the model: servers take devices walking the nodes from the last one back, so that node 0 keeps trainer devices
beside the actor, the stream and the rendezvous. Unlike it, a node's size is detected (not 8) and node 0's address
comes from the scheduler (not from a naming pattern of one cluster). (Imports no torch: the launcher uses it.)
"""

import hashlib
import itertools
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Literal

from lm_human_preference_details.cli import UserError

Device = Literal["auto", "cuda", "cpu"]
DEFAULT_ADDR = "127.0.0.1"
DEFAULT_PORT = 29500
NODE_RANK_VARIABLES = ("NODE_RANK", "GROUP_RANK", "RANK")
"""where torchrun (GROUP_RANK; RANK with one process per node) or a PyTorchJob (NODE_RANK, RANK) puts the node's
rank, in the order read"""
NO_URLS: Mapping[int, str] = MappingProxyType({})


@dataclass
class PlacementArgs:
    """Where a run's processes go: the nodes, the devices of each, and which devices serve inference."""

    nnodes: int = 0
    """nodes in the run, one launcher on each (0: torchrun's or a PyTorchJob's WORLD_SIZE, else Slurm's
    SLURM_NNODES, else 1)"""
    node_rank: int = -1
    """this node's rank in [0, nnodes); node 0 runs the actor, the stream and the rendezvous (-1: NODE_RANK,
    GROUP_RANK or RANK, else Slurm's SLURM_NODEID, else 0)"""
    master_addr: str = ""
    """node 0's address, which every node must reach ("": MASTER_ADDR, else the first host of Slurm's
    SLURM_JOB_NODELIST, else 127.0.0.1 for a run on one node)"""
    master_port: int = 0
    """the port of the rendezvous (a TCPStore) on node 0 (0: MASTER_PORT, else 29500)"""
    gpus_per_node: int = 0
    """devices each node uses (0: the GPUs visible, from CUDA_VISIBLE_DEVICES or /dev/nvidiaN); with `--device cpu`
    the slots standing in for GPUs, each process given its share of the node's cores (0 there: 1)"""
    inference_gpus: str = ""
    """devices over all nodes that run inference servers, the others running one trainer process each: a count
    ("4") or a fraction of all of them ("0.5"). "": half of them (rounded down to whole servers of
    --server-tensor-parallel devices, at least one) when there are several; none on a single device, which the
    servers (--num-servers) and the trainer (--trainer-processes) then share"""
    server_tensor_parallel: int = 1
    """devices per inference server (vLLM's tensor_parallel_size), all on one node"""
    device: Device = "auto"
    """`cuda`, or `cpu` (CPU slots stand in for GPUs, so the same map runs without one); `auto`: cuda where a GPU
    is visible, else cpu"""
    join_timeout_s: float = 600.0
    """how long node 0 waits for the other nodes to join (and they for node 0) before the run stops, naming the
    node missing"""


# ----------------------------------------------------------------------------- this node
@dataclass(frozen=True)
class Node:
    """Where this launcher runs, and where the run's rendezvous is."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    source: str  # what placed it: "flags", "torchrun" (also a PyTorchJob's), "slurm" or "default"


Setting = tuple[str, str]  # a value as given, and where it was given: a flag ("--nnodes") or a variable ("RANK")


def spelled(setting: Setting) -> str:
    """A setting as the user gave it: `--nnodes 2` or `SLURM_NNODES=2`."""
    value, origin = setting
    return f"{origin} {value}" if origin.startswith("--") else f"{origin}={value}"


def whole_number(setting: Setting, minimum: int, fix: str) -> int:
    """A setting's value as an int of at least `minimum`; else a UserError ending with `fix`."""
    try:
        number = int(setting[0])
    except ValueError:
        number = minimum - 1
    if number < minimum:
        raise UserError(f"{spelled(setting)} must be a whole number >= {minimum}: {fix}")
    return number


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list (what `scontrol show hostnames | head -1` prints): `gpu[03-05,9],cpu1`
    -> `gpu03`, each bracket's first number kept as written (zero padding included)."""
    first = re.split(r",(?![^\[]*\])", nodelist.strip(), maxsplit=1)[0]
    return re.sub(r"\[([^\]]*)\]", lambda brackets: re.split(r"[,-]", brackets.group(1))[0], first)


def scheduler_settings(environ: Mapping[str, str]) -> tuple[str, dict[str, Setting]]:
    """The scheduler that placed this launcher (`torchrun`, also a PyTorchJob's variables; `slurm`; or `default`)
    and what it says: `nnodes`, `node_rank`, `master_addr`. A UserError where it started several launchers per node."""
    if "WORLD_SIZE" in environ:
        local = (environ.get("LOCAL_WORLD_SIZE", "1"), "LOCAL_WORLD_SIZE")
        if whole_number(local, 1, "torchrun --nproc-per-node 1") > 1:
            raise UserError(
                f"{spelled(local)}: start one launcher per node, `torchrun --nproc-per-node 1` (the launcher starts "
                "its node's servers and trainer processes itself)"
            )
        settings = {"nnodes": (environ["WORLD_SIZE"], "WORLD_SIZE")}
        rank = next((name for name in NODE_RANK_VARIABLES if name in environ), None)
        if rank:
            settings["node_rank"] = (environ[rank], rank)
        return "torchrun", settings
    if "SLURM_NNODES" in environ:
        nnodes = (environ["SLURM_NNODES"], "SLURM_NNODES")
        # the step's tasks, which srun sets: a batch script that runs the launcher itself is one task, whatever
        # the job's allocation says
        tasks = (environ.get("SLURM_STEP_NUM_TASKS", "1"), "SLURM_STEP_NUM_TASKS")
        step_nodes = (environ.get("SLURM_STEP_NUM_NODES", "1"), "SLURM_STEP_NUM_NODES")
        fix = "start one launcher per node, `srun --ntasks-per-node 1`"
        if whole_number(tasks, 1, fix) > whole_number(step_nodes, 1, fix):
            raise UserError(f"{spelled(tasks)} tasks on {spelled(step_nodes)} nodes: {fix}")
        settings = {"nnodes": nnodes}
        if "SLURM_NODEID" in environ:
            settings["node_rank"] = (environ["SLURM_NODEID"], "SLURM_NODEID")
        if first_slurm_host(environ.get("SLURM_JOB_NODELIST", "")):
            settings["master_addr"] = (first_slurm_host(environ["SLURM_JOB_NODELIST"]), "SLURM_JOB_NODELIST")
        return "slurm", settings
    return "default", {}


def locate_node(args: PlacementArgs, environ: Mapping[str, str]) -> Node:
    """This node: each of `args`' four fields from its flag, else torchrun's (or a PyTorchJob's) variables, else
    Slurm's, else one node at 127.0.0.1:29500. A UserError, naming the flag or variable, for a node rank outside
    [0, nnodes), several launchers per node, or several nodes without a rank or node 0's address."""
    source, settings = scheduler_settings(environ)
    for variable in ("MASTER_ADDR", "MASTER_PORT"):
        if environ.get(variable):
            settings[variable.lower()] = (environ[variable], variable)
    for name in ("nnodes", "node_rank", "master_addr", "master_port"):
        if (value := getattr(args, name)) != getattr(PlacementArgs, name):  # the flag given: not its default
            settings[name] = (str(value), f"--{name.replace('_', '-')}")
    if args.nnodes != PlacementArgs.nnodes or args.node_rank != PlacementArgs.node_rank:
        source = "flags"

    nnodes_setting = settings.get("nnodes", ("1", "--nnodes"))
    nnodes = whole_number(nnodes_setting, 1, "pass --nnodes N, the nodes of the run")
    port = whole_number(settings.get("master_port", (str(DEFAULT_PORT), "--master-port")), 1, "pass --master-port")
    if port > 65535:
        raise UserError(f"{spelled(settings['master_port'])} is no TCP port: pass --master-port below 65536")
    if nnodes > 1 and "node_rank" not in settings:
        variables = ", ".join(NODE_RANK_VARIABLES)
        raise UserError(f"{spelled(nnodes_setting)} but no node rank ({variables}): pass --node-rank on each node")
    if nnodes > 1 and "master_addr" not in settings:
        raise UserError(f"{spelled(nnodes_setting)} but no address of node 0: pass --master-addr HOST on every node")
    rank_setting = settings.get("node_rank", ("0", "--node-rank"))
    rank = whole_number(rank_setting, 0, f"pass --node-rank between 0 and {nnodes - 1}")
    if rank >= nnodes:
        raise UserError(
            f"{spelled(rank_setting)} is outside [0, {nnodes}) ({spelled(nnodes_setting)}): pass --node-rank "
            f"between 0 and {nnodes - 1}, or --nnodes"
        )
    addr = settings.get("master_addr", (DEFAULT_ADDR, ""))[0]
    return Node(nnodes, rank, addr, port, source)


# ----------------------------------------------------------------------------- the devices of a node
def visible_gpus(environ: Mapping[str, str], dev_dir: str = "/dev") -> int:
    """The GPUs a process would see, without importing torch: CUDA_VISIBLE_DEVICES' entries up to the first negative
    one where it is set ("" or "-1": none), else the /dev/nvidiaN device nodes; none without such a node (no
    driver)."""
    nodes = sum(1 for name in os.listdir(dev_dir) if re.fullmatch(r"nvidia\d+", name)) if os.path.isdir(dev_dir) else 0
    if not nodes or "CUDA_VISIBLE_DEVICES" not in environ:
        return nodes
    entries = (entry.strip() for entry in environ["CUDA_VISIBLE_DEVICES"].split(","))
    return sum(1 for _ in itertools.takewhile(lambda entry: entry and not entry.startswith("-"), entries))


def node_devices(
    args: PlacementArgs, environ: Mapping[str, str], dev_dir: str = "/dev"
) -> tuple[Literal["cuda", "cpu"], int]:
    """The kind of device the run uses and how many of them each node has. A UserError for `--device cuda` where no
    GPU is visible, and for `--gpus-per-node` above the GPUs visible, or without any (CPU slots are asked for with
    `--device cpu`: a job that lost its GPUs should not run on the CPU unnoticed)."""
    asked = args.gpus_per_node
    if asked < 0:
        raise UserError(f"--gpus-per-node {asked} must be >= 0 (0: the GPUs visible)")
    if args.device == "cpu":
        return "cpu", asked or 1
    gpus = visible_gpus(environ, dev_dir)
    hidden = f" (CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r})" if "CUDA_VISIBLE_DEVICES" in environ else ""
    if not gpus and args.device == "cuda":
        raise UserError(f"--device cuda but no GPU is visible{hidden}: run where one is, or pass --device cpu")
    if not gpus and asked:
        raise UserError(
            f"--gpus-per-node {asked} but no GPU is visible{hidden}: pass --device cpu for CPU slots standing in"
        )
    if asked > gpus:
        raise UserError(f"--gpus-per-node {asked} but this node sees {gpus} GPU(s){hidden}: pass at most {gpus}")
    return ("cuda", asked or gpus) if gpus else ("cpu", 1)


def threads_per_device(cores: int, devices_per_node: int) -> int:
    """Torch threads for each process on a node of CPU slots: its share of the node's cores, at least 1."""
    return max(1, cores // devices_per_node)


# ----------------------------------------------------------------------------- the world map
@dataclass(frozen=True)
class Server:
    """An inference server: its global index, its node and its devices there (local indices)."""

    index: int
    node: int
    devices: tuple[int, ...]


@dataclass(frozen=True)
class TrainerProcess:
    """A trainer process: its global rank, its node and its device there (a local index)."""

    rank: int
    node: int
    device: int


def numbered(noun: str, numbers: list[int]) -> str:
    """`noun` with its numbers, plural for several: `server 3`, `trainer ranks 0-7`."""
    return f"{noun}{'s' if len(numbers) > 1 else ''} {span(numbers)}"


def span(numbers: Iterable[int]) -> str:
    """Distinct numbers as sorted runs: (5, 0, 1, 2) -> "0-2,5"."""
    runs: list[list[int]] = []
    for number in sorted(set(numbers)):
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in runs)


@dataclass(frozen=True)
class WorldMap:
    """Which devices of which node run an inference server and which a trainer process; the actor, the stream and
    the rendezvous run on node `actor_node`, with trainer rank 0. The same on every node (`build_world_map`)."""

    nnodes: int
    devices_per_node: int
    device: Literal["cuda", "cpu"]
    colocated: bool  # one device that the servers and the trainer's processes share (the single-device layout)
    servers: tuple[Server, ...]
    trainers: tuple[TrainerProcess, ...]
    actor_node: int = 0

    def servers_on(self, node: int) -> tuple[Server, ...]:
        return tuple(server for server in self.servers if server.node == node)

    def trainers_on(self, node: int) -> tuple[TrainerProcess, ...]:
        return tuple(trainer for trainer in self.trainers if trainer.node == node)

    def roles_of(self, node: int) -> str:
        """What `node` runs, in words (`servers 0-3`, `trainer ranks 0-7, actor, rendezvous`): the lines that name a
        lost node say it."""
        servers, trainers = self.servers_on(node), self.trainers_on(node)
        roles = [numbered("server", [s.index for s in servers])] if servers else []
        if trainers:
            roles.append(numbered("trainer rank", [t.rank for t in trainers]))
        if node == self.actor_node:
            roles.append("actor")
        if node == 0:
            roles.append("rendezvous")
        return ", ".join(roles)

    def to_json(self) -> dict:
        """The map as JSON values, tuples as lists (world.json in the run folder)."""
        return json.loads(json.dumps(asdict(self)))

    def digest(self) -> str:
        """The SHA-256 of the map's canonical JSON: equal on two nodes exactly when their maps are."""
        canonical = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def table(self, urls: Mapping[int, str] = NO_URLS) -> str:
        """The map as printed at start: a summary line, then a row per server (its URL from `urls`, by server index;
        "-" where unknown), per node's trainer processes and for the actor."""
        summary = (
            f"{self.nnodes} node(s) x {self.devices_per_node} {self.device} device(s): {len(self.servers)} inference "
            f"server(s), {len(self.trainers)} trainer process(es)" + (", sharing one device" if self.colocated else "")
        )
        rows = [("node", "devices", "role", "URL")]
        for node in range(self.nnodes):
            if node == self.actor_node:
                rows.append((str(node), "-", "actor, stream", "-"))
            for server in self.servers_on(node):
                rows.append((str(node), span(server.devices), f"server {server.index}", urls.get(server.index, "-")))
            if trainers := self.trainers_on(node):
                role = numbered("trainer rank", [trainer.rank for trainer in trainers])
                rows.append((str(node), span(trainer.device for trainer in trainers), role, "-"))
        widths = [max(len(row[column]) for row in rows) for column in range(3)]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3] for row in rows]
        return "\n".join([summary, *lines])


def parse_inference_gpus(spelling: str, total: int) -> int | None:
    """`--inference-gpus` as a count of devices: a count as given, a fraction in (0, 1) of all `total` devices
    rounded to the nearest; None where empty (the default). A UserError for any other spelling."""
    text = spelling.strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        fraction = float(text)
    except ValueError:
        fraction = math.nan
    if not 0 < fraction < 1:
        raise UserError(f"--inference-gpus {spelling!r} is no count (4) nor fraction of all devices in (0, 1) (0.5)")
    return round(fraction * total)


def inference_count(spelling: str, total: int, tensor_parallel: int) -> int:
    """The devices that serve inference out of `total`: `--inference-gpus`, or by default half of them rounded down to
    whole servers (at least one). A UserError unless they make whole servers and leave the trainer a device."""
    count = parse_inference_gpus(spelling, total)
    what = f"--inference-gpus {spelling.strip()}"
    if count is None:
        count = max(tensor_parallel, total // 2 // tensor_parallel * tensor_parallel)
        what = f"--inference-gpus (by default half the devices, in whole servers: {count})"
    if count < 1:
        raise UserError(
            f"{what} on {total} devices: at least one must serve inference (only a single device is shared by the "
            "servers and the trainer): pass --inference-gpus 1 or more"
        )
    if count > total:
        raise UserError(f"{what} asks for more devices than the run's {total}: pass --inference-gpus below {total}")
    if count == total:
        raise UserError(
            f"{what} takes all {total} devices, leaving none to train on: pass --inference-gpus below {total}"
        )
    if count % tensor_parallel:
        raise UserError(
            f"--server-tensor-parallel {tensor_parallel} does not divide the {count} devices of {what}: pass a "
            f"multiple of {tensor_parallel} to --inference-gpus, or another --server-tensor-parallel"
        )
    return count


def place_servers(nnodes: int, devices_per_node: int, count: int, tensor_parallel: int) -> tuple[Server, ...]:
    """`count` inference devices as servers of `tensor_parallel` devices, each within one node: the nodes filled from
    the last one back (PipelineRL's order: node 0, with the actor, keeps its trainer devices), each from its lowest
    device. Numbered by node, then device. A UserError where they do not fit without spanning nodes."""
    per_node = devices_per_node // tensor_parallel
    left = count // tensor_parallel
    if left > per_node * nnodes:
        raise UserError(
            f"--inference-gpus {count} makes {left} servers of --server-tensor-parallel {tensor_parallel}, but a "
            f"server never spans nodes and {nnodes} node(s) of {devices_per_node} devices hold {per_node * nnodes}: "
            f"pass --inference-gpus {per_node * nnodes * tensor_parallel} or fewer, or a --server-tensor-parallel "
            f"that divides {devices_per_node}"
        )
    on_node = {}
    for node in reversed(range(nnodes)):
        on_node[node] = min(left, per_node)
        left -= on_node[node]
    places = [
        (node, tuple(range(k * tensor_parallel, (k + 1) * tensor_parallel)))
        for node in range(nnodes)
        for k in range(on_node[node])
    ]
    return tuple(Server(index, node, devices) for index, (node, devices) in enumerate(places))


def build_world_map(
    nnodes: int,
    devices_per_node: int,
    device: Literal["cuda", "cpu"],
    inference_gpus: str,
    tensor_parallel: int,
    num_servers: int = 1,
    trainer_processes: int = 1,
) -> WorldMap:
    """The run's world map. A single device with no inference devices asked for is shared (today's layout:
    `num_servers` servers and `trainer_processes` trainer processes, all on device 0). Otherwise the map decides:
    `inference_gpus` devices serve inference (`place_servers`, `tensor_parallel` to a server) and every other device
    runs one trainer process, ranked by node then device, so rank 0 is on node 0 with the actor. A UserError, naming
    the flag and the fix, for a layout that cannot be made."""
    if tensor_parallel < 1:
        raise UserError(f"--server-tensor-parallel {tensor_parallel} must be >= 1")
    if tensor_parallel > devices_per_node:
        raise UserError(
            f"--server-tensor-parallel {tensor_parallel} exceeds the {devices_per_node} device(s) of a node (a server "
            f"stays within one): pass at most {devices_per_node}"
        )
    total = nnodes * devices_per_node
    if total == 1 and inference_gpus.strip() in ("", "0"):
        servers = tuple(Server(index, 0, (0,)) for index in range(num_servers))
        trainers = tuple(TrainerProcess(rank, 0, 0) for rank in range(trainer_processes))
        return WorldMap(nnodes, devices_per_node, device, True, servers, trainers)
    if (num_servers, trainer_processes) != (1, 1):
        raise UserError(
            f"--num-servers {num_servers} --trainer-processes {trainer_processes} on {total} devices: the map decides "
            "the servers and trainer processes on several devices; pass --inference-gpus / --server-tensor-parallel"
        )
    servers = place_servers(
        nnodes, devices_per_node, inference_count(inference_gpus, total, tensor_parallel), tensor_parallel
    )
    # node 0 is filled last, so it serves on all its devices only where every node does: rank 0 trains on node 0
    serving = {(server.node, index) for server in servers for index in server.devices}
    training = [
        (node, index) for node in range(nnodes) for index in range(devices_per_node) if (node, index) not in serving
    ]
    trainers = tuple(TrainerProcess(rank, node, index) for rank, (node, index) in enumerate(training))
    return WorldMap(nnodes, devices_per_node, device, False, servers, trainers)
