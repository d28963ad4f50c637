"""What this node's launcher runs, from the world map (`grpo.world`), and the environment of each process it starts.

One node with one device keeps the colocated layout (servers and trainer share it). Otherwise the map gives each
inference server its devices and each trainer process one device; a process on a GPU sees only its own
(`CUDA_VISIBLE_DEVICES`), a CPU stand-in gets its slot's share of the node's cores. The trainer's processes form one
torch.distributed group across the nodes, at node 0's address, as torchrun would describe it to them.
"""

import hashlib
import json
import os
import secrets
import socket
from dataclasses import dataclass, replace

from lm_human_preference_details.cli import UserError
from lm_human_preference_details.grpo import streams, world
from lm_human_preference_details.grpo.config import GRPOArgs
from lm_human_preference_details.grpo.protocol import TOKEN_ENV, WeightBackend, is_loopback

FSDP2_ENVIRONMENT = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
    "FSDP_OFFLOAD_PARAMS": "false",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
    "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT",
    "FSDP_ACTIVATION_CHECKPOINTING": "false",
    "ACCELERATE_MIXED_PRECISION": "no",
}
"""what `accelerate launch --config_file configs/accelerate/fsdp2.yaml` gives each process of the trainer (a test
keeps the two equal)"""


@dataclass(frozen=True)
class NodePlan:
    """This node's place in the run, and what every process of the run will be told."""

    node: world.Node
    map: world.WorldMap
    weight_backend: WeightBackend
    address: str  # where this node's servers listen, as the other nodes reach it

    @property
    def rank(self) -> int:
        return self.node.node_rank

    @property
    def multi_node(self) -> bool:
        return self.node.nnodes > 1

    def runs_trainer(self) -> bool:
        return bool(self.map.trainers_on(self.rank))


def plan_node(args: GRPOArgs, environ=os.environ) -> NodePlan:
    """This node's plan, or a UserError naming the flag and the fix, before anything starts."""
    placement = args.placement
    node = world.locate_node(placement, environ)
    device, per_node = world.node_devices(placement, environ)
    the_map = world.build_world_map(
        node.nnodes,
        per_node,
        device,
        placement.inference_gpus,
        placement.server_tensor_parallel,
        args.serving.num_servers,
        args.processes.trainer_processes,
    )
    if args.serving.servers and not the_map.colocated:
        raise UserError(
            "--servers: servers started by hand serve one node's colocated layout; with several devices or nodes "
            "the launcher starts the servers the map places (leave --servers out)"
        )
    plan = NodePlan(node, the_map, weight_backend_for(args, the_map), address_toward(node.master_addr))
    check_stream(args, plan)
    return plan


PLACEMENT_VARIABLES = (
    *("RANK", "NODE_RANK", "GROUP_RANK", "LOCAL_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"),
    *("GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT"),
)
"""what torchrun or a PyTorchJob tells the launcher of its place, which no child may take for its own"""


def forget_placement_variables(environ=os.environ) -> str | None:
    """Drop the variables that placed this launcher (`PLACEMENT_VARIABLES`, torchrun's `TORCHELASTIC_*`, Slurm's
    `SLURM_*`): a trainer process is given its own (`trainer_environments`), and a server or the actor none. Returns,
    where torchrun's agent holds a store at MASTER_PORT already (which the rendezvous then uses), its restart count
    (the rendezvous's keys are of this attempt); None elsewhere."""
    agent_store = None
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        agent_store = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    scheduler = [name for name in environ if name.startswith(("TORCHELASTIC_", "SLURM_"))]
    for name in [*PLACEMENT_VARIABLES, *scheduler]:
        environ.pop(name, None)
    return agent_store


def weight_backend_for(args: GRPOArgs, the_map: world.WorldMap) -> WeightBackend:
    """`--weight-backend` with `auto` resolved: NCCL from the trainer's GPU to servers on GPUs of their own, gloo on
    CPUs and on a shared GPU (NCCL refuses two ranks on one GPU). A UserError for NCCL where it cannot run."""
    if args.processes.weight_backend == "auto":
        return "nccl" if the_map.device == "cuda" and not the_map.colocated else "gloo"
    if args.processes.weight_backend == "nccl" and the_map.device == "cpu":
        raise UserError("--weight-backend nccl sends GPU tensors and this run is on CPUs: use --weight-backend gloo")
    if args.processes.weight_backend == "nccl" and the_map.colocated and not args.serving.servers:
        raise UserError(
            "--weight-backend nccl: the servers this launcher starts share the trainer's GPU, where NCCL refuses two "
            "ranks; use --weight-backend gloo, or give the run more GPUs (--inference-gpus) or --servers on others"
        )
    return args.processes.weight_backend


def check_stream(args: GRPOArgs, plan: NodePlan) -> None:
    """A stream every trainer process can read: with trainer processes on other nodes than 0, a Redis stream at an
    address they reach (a file on a shared filesystem shows new lines late, or half written)."""
    if not any(t.node != 0 for t in plan.map.trainers):
        return
    where = streams.parse_stream_url(args.stream_url())
    if not isinstance(where, streams.RedisStreamUrl):
        raise UserError(
            f"--stream {args.stream_url()}: trainer processes on other nodes than 0 read the stream; give them a "
            "Redis stream on node 0, --stream redis://NODE0:6379/0?stream=NAME"
        )
    if is_loopback(where.host) and not is_loopback(plan.node.master_addr):
        raise UserError(
            f"--stream {args.stream}: trainer processes on other nodes read the stream, and {where.host} is this "
            "node's loopback: give node 0's address"
        )


def check_shared_folder(args: GRPOArgs, plan: NodePlan, run_id: str) -> None:
    """On a node beyond 0: a UserError unless this node sees node 0's run folder where it needs it (its trainer
    processes' checkpoints, the checkpoint a resumed run's servers load); node 0 wrote `world.json` with `run_id`
    there."""
    if world_file_run_id(args.output_dir) == run_id or not (plan.runs_trainer() or args.resume):
        return
    why = "the checkpoint to resume from" if args.resume else "the trainer's checkpoints"
    raise UserError(
        f"--output-dir {args.output_dir}: node {plan.rank} does not see node 0's run folder, which holds {why}: give "
        "every node the same shared folder"
    )


def world_file_run_id(output_dir: str) -> str | None:
    """The run id in a run folder's `world.json` (None where there is none to read)."""
    try:
        with open(os.path.join(output_dir, "world.json")) as f:
            return json.load(f).get("run_id")
    except (OSError, ValueError):
        return None


def check_control_token(plan: NodePlan) -> None:
    """Across machines every node needs the servers' control token from its environment, before anything starts:
    servers there listen beyond loopback, and the rendezvous store, which anyone who reaches it can read, is no place
    for a secret."""
    if plan.multi_node and not is_loopback(plan.node.master_addr) and not os.environ.get(TOKEN_ENV):
        raise UserError(
            f"{TOKEN_ENV} is not set: on a run over several machines, set it to one secret on every node (e.g. "
            f"`export {TOKEN_ENV}=$(openssl rand -hex 32)` before srun, as examples/slurm/grpo.sbatch does); the "
            "servers' control endpoints require it"
        )


def node0_control_token() -> str:
    """The servers' control token, on node 0: $GRPO_SERVER_TOKEN, or else one made here (`check_control_token`
    allowed it: no other machine needs it)."""
    return os.environ.get(TOKEN_ENV) or secrets.token_hex(32)


def shared_control_token(token: str, master_addr: str) -> str:
    """What node 0 announces of the token: the token itself only where the store is this machine's loopback."""
    return token if is_loopback(master_addr) else ""


def control_token_of(announced: str, sha256: str) -> str:
    """A node's control token: the one announced, or its own $GRPO_SERVER_TOKEN, which must be node 0's."""
    token = announced or os.environ.get(TOKEN_ENV, "")
    if token_sha256(token) != sha256:
        raise UserError(f"{TOKEN_ENV} differs from node 0's (or is not set): set the same secret on every node")
    return token


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def address_toward(master_addr: str) -> str:
    """This node's address on the way to node 0 (where its servers listen for the others): the source address the
    kernel picks for a packet to `master_addr` (no packet is sent); loopback when node 0 is this machine's loopback."""
    if is_loopback(master_addr):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((master_addr, 9))
        except OSError as error:
            raise UserError(f"--master-addr {master_addr}: no route to it from this node ({error})") from None
        return probe.getsockname()[0]


def role_args(args: GRPOArgs, plan: NodePlan, trainer_host: str) -> GRPOArgs:
    """The arguments the trainer's processes and the actor run with: the map's counts of servers and trainer
    processes, the resolved weight backend, node 0's address for the weight groups, and a CPU stand-in's threads."""
    the_map = plan.map
    if the_map.colocated:
        return replace(args, processes=replace(args.processes, weight_backend=plan.weight_backend))
    threads = args.processes.threads
    if the_map.device == "cpu" and not threads:
        threads = world.threads_per_device(usable_cores(), the_map.devices_per_node)
    processes = replace(
        args.processes,
        weight_backend=plan.weight_backend,
        trainer_processes=len(the_map.trainers),
        trainer_host=trainer_host,
        threads=threads,
    )
    return replace(args, processes=processes, serving=replace(args.serving, num_servers=len(the_map.servers)))


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def trainer_environments(plan: NodePlan, master_addr: str, master_port: int) -> dict[int, dict[str, str]]:
    """Each of this node's trainer processes' environment beyond the launcher's, by global rank: none for a trainer
    of one process; for more, FSDP2's (`FSDP2_ENVIRONMENT`) and its place in the group, as torchrun sets it."""
    the_map = plan.map
    mine = plan.map.trainers_on(plan.rank)
    devices = device_environment(the_map, [t.device for t in mine])
    if len(the_map.trainers) == 1:
        return {t.rank: devices for t in mine}
    group = {"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "WORLD_SIZE": str(len(the_map.trainers))}
    local = {"LOCAL_WORLD_SIZE": str(len(mine)), "GROUP_RANK": str(plan.rank)}
    return {
        t.rank: {**FSDP2_ENVIRONMENT, **group, **local, **devices, "RANK": str(t.rank), "LOCAL_RANK": str(i)}
        for i, t in enumerate(mine)
    }


def device_environment(the_map: world.WorldMap, devices: list[int]) -> dict[str, str]:
    """Which GPUs a process sees: its own (the map's), none on CPUs, and all of them in the colocated layout."""
    if the_map.device == "cpu":
        return {"CUDA_VISIBLE_DEVICES": ""}
    if the_map.colocated:
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # the map's indices count the GPUs this launcher was given
    physical = visible.split(",") if visible else [str(i) for i in range(the_map.devices_per_node)]
    return {"CUDA_VISIBLE_DEVICES": ",".join(physical[d] for d in devices)}


def server_threads(args: GRPOArgs, the_map: world.WorldMap) -> int:
    """A server's CPU threads (a vLLM server's per worker): `--threads`, the colocated layout's share, or else a
    device's share of the node's cores (each GPU's server processes, each CPU slot's)."""
    if args.processes.threads or the_map.colocated:
        return args.torch_threads("server")
    return world.threads_per_device(usable_cores(), the_map.devices_per_node)
