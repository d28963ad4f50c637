"""The world map of a GRPO run: this node from each scheduler's variables, the devices of a node, and the split of
all devices into inference servers and trainer processes (pure functions: no process is started)."""

import itertools
import json

import pytest

from lm_human_preference_details.cli import UserError
from lm_human_preference_details.grpo.world import (
    Node,
    PlacementArgs,
    Server,
    TrainerProcess,
    build_world_map,
    first_slurm_host,
    locate_node,
    node_devices,
    threads_per_device,
    visible_gpus,
)


# ----------------------------------------------------------------------------- the map
def servers(*places):
    """Servers numbered in order from (node, devices) places."""
    return tuple(Server(index, node, tuple(devices)) for index, (node, devices) in enumerate(places))


def trainers(*places):
    """Trainer processes ranked in order from (node, device) places."""
    return tuple(TrainerProcess(rank, node, device) for rank, (node, device) in enumerate(places))


def on(node, devices):
    return [(node, device) for device in devices]


LAYOUTS = {
    # name: (nnodes, devices_per_node, device, inference_gpus, tensor_parallel, num_servers, trainer_processes),
    #       (colocated, servers, trainers)
    "one GPU shared, today's servers and trainer processes": (
        (1, 1, "cuda", "", 1, 2, 2),
        (True, servers((0, [0]), (0, [0])), trainers((0, 0), (0, 0))),
    ),
    "one node of 8 with 4 inference GPUs": (
        (1, 8, "cuda", "4", 1, 1, 1),
        (False, servers(*[(0, [d]) for d in range(4)]), trainers(*on(0, range(4, 8)))),
    ),
    "2x8, tensor-parallel 2, half by default": (
        (2, 8, "cuda", "", 2, 1, 1),
        (False, servers((1, [0, 1]), (1, [2, 3]), (1, [4, 5]), (1, [6, 7])), trainers(*on(0, range(8)))),
    ),
    "4x8 with a fraction 0.25, tensor-parallel 2": (
        (4, 8, "cuda", "0.25", 2, 1, 1),
        (
            False,
            servers((3, [0, 1]), (3, [2, 3]), (3, [4, 5]), (3, [6, 7])),
            trainers(*on(0, range(8)), *on(1, range(8)), *on(2, range(8))),
        ),
    ),
    "2x8 with 6 inference GPUs: node 1 also trains": (
        (2, 8, "cuda", "6", 1, 1, 1),
        (False, servers(*[(1, [d]) for d in range(6)]), trainers(*on(0, range(8)), (1, 6), (1, 7))),
    ),
    "2x8 with 6 inference GPUs of tensor-parallel 2": (
        (2, 8, "cuda", "6", 2, 1, 1),
        (False, servers((1, [0, 1]), (1, [2, 3]), (1, [4, 5])), trainers(*on(0, range(8)), (1, 6), (1, 7))),
    ),
    "2x8 with 12 inference GPUs of tensor-parallel 4: servers on both nodes": (
        (2, 8, "cuda", "12", 4, 1, 1),
        (False, servers((0, [0, 1, 2, 3]), (1, [0, 1, 2, 3]), (1, [4, 5, 6, 7])), trainers(*on(0, range(4, 8)))),
    ),
    "nodes of 3 with tensor-parallel 2: a device left over on each": (
        (2, 3, "cuda", "4", 2, 1, 1),
        (False, servers((0, [0, 1]), (1, [0, 1])), trainers((0, 2), (1, 2))),
    ),
    "CPU stand-ins, 2 nodes x 2 slots: node 1 serves, node 0 trains (the two-node localhost example)": (
        (2, 2, "cpu", "2", 1, 1, 1),
        (False, servers((1, [0]), (1, [1])), trainers((0, 0), (0, 1))),
    ),
}


@pytest.mark.parametrize("layout, expected", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_the_map_places_servers_and_trainer_processes_as_the_layout_says(layout, expected):
    world = build_world_map(*layout)
    assert (world.colocated, world.servers, world.trainers) == expected
    assert (world.nnodes, world.devices_per_node, world.device, world.actor_node) == (*layout[:3], 0)


def test_every_layout_uses_each_device_once_and_trains_rank_0_on_node_0():
    for nnodes, devices in itertools.product(range(1, 5), range(1, 7)):
        for tensor_parallel, count in itertools.product(range(1, devices + 1), range(1, nnodes * devices)):
            if count % tensor_parallel:
                continue
            try:
                world = build_world_map(nnodes, devices, "cuda", str(count), tensor_parallel)
            except UserError as error:
                assert "never spans nodes" in str(error)
                continue
            used = [(s.node, d) for s in world.servers for d in s.devices] + [
                (t.node, t.device) for t in world.trainers
            ]
            assert sorted(used) == [(node, d) for node in range(nnodes) for d in range(devices)]
            assert sum(len(s.devices) for s in world.servers) == count
            assert all(len(s.devices) == tensor_parallel for s in world.servers)
            assert world.trainers[0].node == 0


def test_servers_on_and_trainers_on_select_a_nodes_share():
    world = build_world_map(2, 8, "cuda", "6", 1)
    assert [s.index for s in world.servers_on(1)] == list(range(6)) and world.servers_on(0) == ()
    assert [t.rank for t in world.trainers_on(1)] == [8, 9] and len(world.trainers_on(0)) == 8


REFUSALS = {
    "no device left to train on": ((1, 8, "cuda", "8", 1), "leaving none to train on"),
    "a fraction of all devices that leaves none": ((1, 1, "cuda", "0.9", 1), "leaving none to train on"),
    "no inference device on several": ((1, 8, "cuda", "0", 1), "at least one must serve inference"),
    "a fraction that rounds to none": ((2, 8, "cuda", "0.01", 1), "at least one must serve inference"),
    "a default that leaves no trainer": ((1, 2, "cuda", "", 2), "leaving none to train on"),
    "more devices than exist": ((2, 8, "cuda", "20", 1), "more devices than the run's 16"),
    "a tensor-parallel size that does not divide": ((1, 8, "cuda", "3", 2), "--server-tensor-parallel 2 does not"),
    "a tensor-parallel size above a node": ((2, 4, "cuda", "", 8), "exceeds the 4 device"),
    "servers that would span nodes": ((4, 3, "cuda", "10", 2), "never spans nodes"),
    "a count spelled as a float": ((1, 8, "cuda", "4.0", 1), "no count"),
    "a fraction of 1": ((1, 8, "cuda", "1.0", 1), "no count"),
    "a word": ((1, 8, "cuda", "half", 1), "no count"),
    "a tensor-parallel size below 1": ((1, 8, "cuda", "4", 0), "--server-tensor-parallel 0 must be >= 1"),
    "num_servers where the map decides": ((1, 8, "cuda", "4", 1, 2), "the map decides"),
    "trainer_processes where the map decides": ((2, 2, "cpu", "2", 1, 1, 2), "the map decides"),
}


@pytest.mark.parametrize("layout, message", REFUSALS.values(), ids=REFUSALS.keys())
def test_a_layout_that_cannot_be_made_is_refused_in_one_line_naming_the_flag(layout, message):
    with pytest.raises(UserError, match=message) as refusal:
        build_world_map(*layout)
    assert "\n" not in str(refusal.value) and "--" in str(refusal.value)


def test_equal_maps_have_one_digest_and_different_maps_different_ones():
    one = build_world_map(2, 8, "cuda", "", 2)
    assert one.digest() == build_world_map(2, 8, "cuda", "8", 2).digest()
    others = [
        build_world_map(2, 8, "cuda", "", 1),
        build_world_map(2, 8, "cpu", "", 2),
        build_world_map(2, 8, "cuda", "4", 2),
        build_world_map(4, 4, "cuda", "8", 2),
    ]
    assert len({one.digest(), *(other.digest() for other in others)}) == 5


def test_the_json_of_a_map_holds_its_servers_and_trainers_as_lists():
    saved = json.loads(json.dumps(build_world_map(2, 2, "cpu", "2", 1).to_json()))
    assert saved["servers"] == [{"index": 0, "node": 1, "devices": [0]}, {"index": 1, "node": 1, "devices": [1]}]
    assert saved["trainers"][1] == {"rank": 1, "node": 0, "device": 1}
    assert (saved["nnodes"], saved["device"], saved["colocated"], saved["actor_node"]) == (2, "cpu", False, 0)


def test_the_table_has_a_row_per_server_with_its_url_per_nodes_trainers_and_for_the_actor():
    table = build_world_map(2, 8, "cuda", "6", 2).table({0: "http://node1:8080"})
    lines = table.splitlines()
    assert lines[0] == "2 node(s) x 8 cuda device(s): 3 inference server(s), 10 trainer process(es)"
    rows = [line.split() for line in lines[1:]]
    assert rows == [
        ["node", "devices", "role", "URL"],
        ["0", "-", "actor,", "stream", "-"],
        ["0", "0-7", "trainer", "ranks", "0-7", "-"],
        ["1", "0-1", "server", "0", "http://node1:8080"],
        ["1", "2-3", "server", "1", "-"],
        ["1", "4-5", "server", "2", "-"],
        ["1", "6-7", "trainer", "ranks", "8-9", "-"],
    ]
    assert len({len(line) - len(line.split()[-1]) for line in lines[1:]}) == 1  # the URLs in one column


def test_the_table_of_a_shared_device_says_so():
    table = build_world_map(1, 1, "cpu", "", 1, 2, 1).table()
    assert table.splitlines()[0].endswith("2 inference server(s), 1 trainer process(es), sharing one device")
    assert [line.split()[:3] for line in table.splitlines()[-3:]] == [
        ["0", "0", "server"],
        ["0", "0", "server"],
        ["0", "0", "trainer"],
    ]


def test_a_cpu_stand_in_gets_its_share_of_the_cores():
    assert [threads_per_device(16, 4), threads_per_device(2, 2), threads_per_device(2, 4)] == [4, 1, 1]


# ----------------------------------------------------------------------------- this node
SLURM = {
    **{"SLURM_NNODES": "3", "SLURM_NODEID": "1", "SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "gpu[03-05]"},
    **{"SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_NUM_NODES": "3"},
}
TORCHRUN = {"WORLD_SIZE": "2", "RANK": "1", "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "n0"}
SOURCES = {
    "the flags": (
        PlacementArgs(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29600),
        {},
        Node(2, 1, "10.0.0.1", 29600, "flags"),
    ),
    "torchrun": (PlacementArgs(), {**TORCHRUN, "MASTER_PORT": "29501"}, Node(2, 1, "n0", 29501, "torchrun")),
    "a PyTorchJob's NODE_RANK before RANK": (
        PlacementArgs(),
        {"WORLD_SIZE": "3", "NODE_RANK": "2", "RANK": "0", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"},
        Node(3, 2, "job-master-0", 23456, "torchrun"),
    ),
    "Slurm": (PlacementArgs(), SLURM, Node(3, 1, "gpu03", 29500, "slurm")),
    "Slurm with MASTER_ADDR exported": (
        PlacementArgs(),
        {**SLURM, "MASTER_ADDR": "gpu05"},
        Node(3, 1, "gpu05", 29500, "slurm"),
    ),
    "Slurm with a port flag": (PlacementArgs(master_port=29700), SLURM, Node(3, 1, "gpu03", 29700, "slurm")),
    "torchrun's variables under Slurm": (
        PlacementArgs(),
        {**SLURM, **TORCHRUN},
        Node(2, 1, "n0", 29500, "torchrun"),
    ),
    "flags over torchrun's variables": (
        PlacementArgs(nnodes=4, node_rank=3),
        TORCHRUN,
        Node(4, 3, "n0", 29500, "flags"),
    ),
    "nothing: one node": (PlacementArgs(), {}, Node(1, 0, "127.0.0.1", 29500, "default")),
}


@pytest.mark.parametrize("args, environ, node", SOURCES.values(), ids=SOURCES.keys())
def test_the_node_comes_from_the_flags_then_torchrun_then_slurm_then_the_default(args, environ, node):
    assert locate_node(args, environ) == node


NODE_REFUSALS = {
    "a rank flag past the nodes": (PlacementArgs(nnodes=2, node_rank=2, master_addr="h"), {}, "--node-rank 2 is"),
    "a negative rank flag": (PlacementArgs(node_rank=-2), {}, "--node-rank -2 must be"),
    "a rank past SLURM_NNODES": (PlacementArgs(), {**SLURM, "SLURM_NODEID": "3"}, "SLURM_NODEID=3 is outside"),
    "several tasks per node under Slurm": (
        PlacementArgs(),
        {**SLURM, "SLURM_STEP_NUM_TASKS": "24"},
        "srun --ntasks-per-node 1",
    ),
    "several processes per node under torchrun": (
        PlacementArgs(),
        {**TORCHRUN, "LOCAL_WORLD_SIZE": "8"},
        "LOCAL_WORLD_SIZE=8.*--nproc-per-node 1",
    ),
    "several nodes without node 0's address": (PlacementArgs(nnodes=2, node_rank=1), {}, "--master-addr HOST"),
    "several nodes without a rank": (PlacementArgs(nnodes=2, master_addr="h"), {}, "pass --node-rank"),
    "a variable that is no number": (PlacementArgs(), {**TORCHRUN, "WORLD_SIZE": "two"}, "WORLD_SIZE=two"),
    "no nodes": (PlacementArgs(nnodes=-1), {}, "--nnodes -1 must be"),
    "a port past TCP's": (PlacementArgs(), {"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is no TCP port"),
}


@pytest.mark.parametrize("args, environ, message", NODE_REFUSALS.values(), ids=NODE_REFUSALS.keys())
def test_a_node_that_cannot_be_placed_is_refused_in_one_line(args, environ, message):
    with pytest.raises(UserError, match=message) as refusal:
        locate_node(args, environ)
    assert "\n" not in str(refusal.value)


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("node7", "node7"),
        ("gpu[03-05,9],cpu1", "gpu03"),
        ("gpu[9,03-05]", "gpu9"),
        ("a,b[1-2]", "a"),
        ("dgx-a100-[001-004]", "dgx-a100-001"),
        ("rack[2-3]-node[08-09]", "rack2-node08"),
        ("", ""),
    ],
)
def test_the_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_slurm_host(nodelist) == host


# ----------------------------------------------------------------------------- the devices of a node
@pytest.fixture
def dev_dir(tmp_path):
    """A /dev of two GPUs, with the driver's other nodes beside them."""
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-modeset", "null"):
        (tmp_path / name).touch()
    return str(tmp_path)


@pytest.mark.parametrize(
    "environ, count",
    [
        ({}, 2),
        ({"CUDA_VISIBLE_DEVICES": "1"}, 1),
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, 2),
        ({"CUDA_VISIBLE_DEVICES": "GPU-8f3c,GPU-1a2b"}, 2),
        ({"CUDA_VISIBLE_DEVICES": ""}, 0),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, 0),
        ({"CUDA_VISIBLE_DEVICES": "1,-1,0"}, 1),
    ],
)
def test_visible_gpus_counts_cuda_visible_devices_or_else_the_device_nodes(dev_dir, environ, count):
    assert visible_gpus(environ, dev_dir) == count


def test_no_gpu_is_visible_without_a_device_node(tmp_path):
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0"}, str(tmp_path)) == 0
    assert visible_gpus({}, str(tmp_path / "absent")) == 0


@pytest.mark.parametrize(
    "args, environ, devices",
    [
        (PlacementArgs(), {}, ("cuda", 2)),
        (PlacementArgs(gpus_per_node=1), {}, ("cuda", 1)),
        (PlacementArgs(device="cuda"), {"CUDA_VISIBLE_DEVICES": "1"}, ("cuda", 1)),
        (PlacementArgs(), {"CUDA_VISIBLE_DEVICES": ""}, ("cpu", 1)),
        (PlacementArgs(device="cpu"), {}, ("cpu", 1)),
        (PlacementArgs(device="cpu", gpus_per_node=4), {}, ("cpu", 4)),
    ],
)
def test_node_devices_are_the_gpus_visible_or_the_slots_asked_for(dev_dir, args, environ, devices):
    assert node_devices(args, environ, dev_dir) == devices


@pytest.mark.parametrize(
    "args, environ, message",
    [
        (PlacementArgs(device="cuda"), {"CUDA_VISIBLE_DEVICES": ""}, "--device cuda but no GPU is visible"),
        (PlacementArgs(gpus_per_node=3), {}, "--gpus-per-node 3 but this node sees 2"),
        (PlacementArgs(gpus_per_node=2), {"CUDA_VISIBLE_DEVICES": "-1"}, "pass --device cpu"),
        (PlacementArgs(device="cpu", gpus_per_node=-1), {}, "--gpus-per-node -1 must be"),
    ],
)
def test_devices_that_are_not_there_are_refused(dev_dir, args, environ, message):
    with pytest.raises(UserError, match=message):
        node_devices(args, environ, dev_dir)


def test_roles_of_a_node_in_words():
    the_map = build_world_map(2, 8, "cuda", "6", 1)  # node 1: servers 0-5 and trainer ranks 8-9
    assert the_map.roles_of(0) == "trainer ranks 0-7, actor, rendezvous"
    assert the_map.roles_of(1) == "servers 0-5, trainer ranks 8-9"


def test_a_batch_script_that_runs_the_launcher_itself_is_one_task_whatever_the_job_holds():
    node = locate_node(PlacementArgs(), {"SLURM_NNODES": "1", "SLURM_NTASKS": "8", "SLURM_NODEID": "0"})
    assert (node.nnodes, node.node_rank, node.source) == (1, 0, "slurm")
