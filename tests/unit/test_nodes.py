"""What each node's launcher runs and tells its processes (`grpo.nodes`), from maps built by `grpo.world`."""

import json

import pytest

from lm_human_preference_details.cli import UserError
from lm_human_preference_details.grpo import nodes, world
from lm_human_preference_details.grpo.protocol import TOKEN_ENV
from tests.grpo.args import grpo_args


def plan_of(nnodes, per_node, device, inference, rank=0, master="127.0.0.1", backend="gloo") -> nodes.NodePlan:
    the_map = world.build_world_map(nnodes, per_node, device, inference, 1)
    return nodes.NodePlan(world.Node(nnodes, rank, master, 29500, "flags"), the_map, backend, "127.0.0.1")


def test_the_two_node_localhost_layout_from_flags():
    args = grpo_args(nnodes=2, node_rank=1, master_addr="127.0.0.1", device="cpu", gpus_per_node=2, inference_gpus="2")
    plan = nodes.plan_node(args, environ={})
    assert (plan.rank, plan.multi_node, plan.runs_trainer(), plan.weight_backend) == (1, True, False, "gloo")
    assert [s.index for s in plan.map.servers_on(1)] == [0, 1] and plan.address == "127.0.0.1"


@pytest.mark.parametrize(
    "device, inference, asked, expected",
    [
        ("cuda", "4", "auto", "nccl"),  # servers on GPUs of their own
        ("cuda", "", "auto", "gloo"),  # one GPU that the servers share
        ("cpu", "2", "auto", "gloo"),
        ("cuda", "4", "gloo", "gloo"),
    ],
)
def test_the_weight_backend_follows_the_map(device, inference, asked, expected):
    per_node = 8 if inference else 1
    the_map = world.build_world_map(1, per_node, device, inference, 1)
    assert nodes.weight_backend_for(grpo_args(weight_backend=asked), the_map) == expected


@pytest.mark.parametrize(
    "device, inference, message",
    [
        ("cpu", "2", "--weight-backend nccl sends GPU tensors and this run is on CPUs"),
        ("cuda", "", "--weight-backend nccl: the servers this launcher starts share the trainer's GPU"),
    ],
)
def test_nccl_where_it_cannot_run_is_refused(device, inference, message):
    the_map = world.build_world_map(1, 4 if inference else 1, device, inference, 1)
    with pytest.raises(UserError, match=message):
        nodes.weight_backend_for(grpo_args(weight_backend="nccl"), the_map)


def test_servers_by_hand_only_with_the_colocated_layout():
    args = grpo_args(device="cpu", gpus_per_node=2)
    args.serving.servers = ["http://127.0.0.1:1"]
    with pytest.raises(UserError, match="--servers: servers started by hand serve one node's colocated layout"):
        nodes.plan_node(args, environ={})


def test_trainers_on_other_nodes_read_a_redis_stream_they_reach():
    plan = plan_of(2, 2, "cpu", "1", master="10.0.0.1")  # node 1: a server and trainer rank 2
    assert [t.rank for t in plan.map.trainers_on(1)] == [2]
    with pytest.raises(UserError, match="trainer processes on other nodes than 0 read the stream; give them a Redis"):
        nodes.check_stream(grpo_args(), plan)  # the default: a file in the run folder
    loopback = grpo_args(stream="redis://127.0.0.1:6379/0?stream=s")
    with pytest.raises(UserError, match="trainer processes on other nodes read the stream, and 127.0.0.1 is"):
        nodes.check_stream(loopback, plan)
    nodes.check_stream(grpo_args(stream="redis://10.0.0.1:6379/0?stream=s"), plan)
    nodes.check_stream(grpo_args(), plan_of(2, 2, "cpu", "2"))  # node 1 only serves: only node 0 reads the stream


def test_a_node_that_does_not_see_node_0s_folder_is_refused_where_it_needs_it(tmp_path):
    node_1 = plan_of(2, 2, "cpu", "1", rank=1)  # a trainer process on node 1, which writes its checkpoint shards
    args = grpo_args(output_dir=str(tmp_path))
    with pytest.raises(UserError, match="node 1 does not see node 0's run folder, which holds the trainer's check"):
        nodes.check_shared_folder(args, node_1, run_id="abc")
    (tmp_path / "world.json").write_text(json.dumps({"run_id": "abc"}))
    nodes.check_shared_folder(args, node_1, run_id="abc")
    serving_only = plan_of(2, 2, "cpu", "2", rank=1)
    nodes.check_shared_folder(grpo_args(output_dir=str(tmp_path / "elsewhere")), serving_only, run_id="abc")


def test_trainer_processes_across_nodes_are_one_group_at_node_0():
    plan = plan_of(2, 2, "cpu", "1", rank=1)
    environments = nodes.trainer_environments(plan, "10.0.0.1", 4321)
    assert list(environments) == [2]  # node 1's only trainer process: global rank 2
    mine = environments[2]
    assert (mine["RANK"], mine["LOCAL_RANK"], mine["WORLD_SIZE"], mine["LOCAL_WORLD_SIZE"]) == ("2", "0", "3", "1")
    assert (mine["MASTER_ADDR"], mine["MASTER_PORT"], mine["CUDA_VISIBLE_DEVICES"]) == ("10.0.0.1", "4321", "")
    assert mine.items() >= nodes.FSDP2_ENVIRONMENT.items()


def test_a_process_on_gpus_sees_only_its_own_through_the_launchers_numbering(monkeypatch):
    the_map = world.build_world_map(1, 4, "cuda", "2", 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert nodes.device_environment(the_map, [2, 3]) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert nodes.device_environment(the_map, [1]) == {"CUDA_VISIBLE_DEVICES": "1"}


def test_the_roles_run_with_the_maps_counts_and_node_0s_address(monkeypatch):
    monkeypatch.setattr(nodes, "usable_cores", lambda: 8)
    plan = plan_of(2, 2, "cpu", "2")
    resolved = nodes.role_args(grpo_args(), plan, trainer_host="10.0.0.1")
    processes = resolved.processes
    assert (resolved.serving.num_servers, processes.trainer_processes, processes.trainer_host) == (2, 2, "10.0.0.1")
    assert (processes.weight_backend, processes.threads) == ("gloo", 4)  # a slot's share of 8 cores
    colocated = nodes.role_args(grpo_args(num_servers=3), plan_of(1, 1, "cpu", ""), trainer_host="10.0.0.1")
    processes = colocated.processes
    assert (colocated.serving.num_servers, processes.trainer_host, processes.threads) == (3, "127.0.0.1", 0)


def test_the_launchers_placement_is_not_passed_on_to_its_children():
    environ = {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True", "SLURM_NODEID": "1", "A": "b"}
    environ["TORCHELASTIC_RESTART_COUNT"] = "2"
    assert nodes.forget_placement_variables(environ) == "2"  # torchrun's agent holds the store: this attempt's keys
    assert environ == {"A": "b"}
    assert nodes.forget_placement_variables({"WORLD_SIZE": "2"}) is None


def test_the_control_token_travels_through_the_store_only_on_loopback(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    across = plan_of(2, 2, "cpu", "2", master="10.0.0.1")
    with pytest.raises(UserError, match=f"{TOKEN_ENV} is not set: on a run over several machines, set it"):
        nodes.check_control_token(across)
    nodes.check_control_token(plan_of(2, 2, "cpu", "2"))  # loopback: node 0 makes one and announces it
    assert len(nodes.node0_control_token()) == 64
    assert nodes.shared_control_token("secret", "127.0.0.1") == "secret"
    assert nodes.shared_control_token("secret", "10.0.0.1") == ""
    sha = nodes.token_sha256("secret")
    assert nodes.control_token_of("secret", sha) == "secret"
    monkeypatch.setenv(TOKEN_ENV, "other")
    with pytest.raises(UserError, match=f"{TOKEN_ENV} differs from node 0's"):
        nodes.control_token_of("", sha)
    monkeypatch.setenv(TOKEN_ENV, "secret")
    assert nodes.control_token_of("", sha) == "secret"


def test_a_server_gets_a_devices_share_of_the_cores_per_worker(monkeypatch):
    monkeypatch.setattr(nodes, "usable_cores", lambda: 16)
    the_map = world.build_world_map(1, 8, "cuda", "4", 2)  # 2 servers of 2 GPUs, 4 trainer processes
    assert nodes.server_threads(grpo_args(), the_map) == 2
    assert nodes.server_threads(grpo_args(threads=3), the_map) == 3
