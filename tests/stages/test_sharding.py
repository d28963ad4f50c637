"""Stages 1 and 2 under the sharding engines of configs/accelerate/, against DDP, in two real processes over gloo.

Each engine's run is killed in stage 2 and resumed, and must still give DDP's metrics and weights (a straight run's),
hold less per process than DDP (measured on the ranks: `memory/state_gib` is the largest process's parameters and
optimizer state, from its own shards), and save a policy that transformers loads.
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lm_human_preference_details import sharding
from lm_human_preference_details.assets import resolve_model_path
from lm_human_preference_details.cli import UserError
from lm_human_preference_details.models import RewardModel
from lm_human_preference_details.tracking import read_metrics
from tests.conftest import REPO, accelerate_two_processes, kill_with_descendants

CONFIGS = os.path.join(REPO, "configs", "accelerate")
ENGINES = ["fsdp2", "zero2", "zero3"]


def engine_configs() -> dict[str, str]:
    """The repository's accelerate config of each engine, its DeepSpeed JSON by absolute path and, for ZeRO-3, with
    every tensor sharded: DeepSpeed keeps tensors below `stage3_param_persistence_threshold` elements (1e5 by
    default: all of the tiny model's) whole on every process."""
    folder = tempfile.mkdtemp(prefix="lmhpd-accelerate-configs-")
    configs = {"fsdp2": os.path.join(CONFIGS, "fsdp2.yaml")}
    for engine in ("zero2", "zero3"):
        with open(os.path.join(CONFIGS, f"{engine}.yaml")) as f:
            config = yaml.safe_load(f)
        with open(os.path.join(CONFIGS, f"{engine}.json")) as f:
            deepspeed = json.load(f)
        if engine == "zero3":
            deepspeed["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        config["deepspeed_config"]["deepspeed_config_file"] = os.path.join(folder, f"{engine}.json")
        with open(config["deepspeed_config"]["deepspeed_config_file"], "w") as f:
            json.dump(deepspeed, f)
        configs[engine] = os.path.join(folder, f"{engine}.yaml")
        with open(configs[engine], "w") as f:
            yaml.safe_dump(config, f)
    return configs


TEST_CONFIGS = engine_configs()
QUIET = ("--wandb-mode", "disabled")
STAGE2 = ("--task", "tiny", "--ppo.total-episodes", str(64 * 10), "--ppo.gradient-accumulation-steps", "2")
"""10 updates, each minibatch in two micro-batches: accumulation is the same update as without it"""
NOT_COMPARED = ("time/", "memory/")


def launch(engine: str, module: str, *args) -> list[str]:
    config = None if engine == "ddp" else TEST_CONFIGS[engine]
    return [*accelerate_two_processes(config), "-m", f"lm_human_preference_details.{module}", *map(str, args), *QUIET]


def run(cmd) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def assert_same_metrics(expected_path, actual_path) -> None:
    """Every metric of every step the same (but times and memory) within 1e-6: an engine that reduces each micro-batch's
    gradients on its own (ZeRO) rounds otherwise than DDP, which reduces their sum."""
    expected, actual = read_metrics(expected_path), read_metrics(actual_path)
    assert [m["step"] for m in expected] == [m["step"] for m in actual]
    for e, a in zip(expected, actual):
        for key, value in e.items():
            if not key.startswith(NOT_COMPARED):
                assert a[key] == pytest.approx(value, rel=1e-6, abs=1e-6), (e["step"], key)


def assert_same_tensors(expected_file, actual_file) -> None:
    expected, actual = load_file(expected_file), load_file(actual_file)
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=1e-6, msg=name)


def stages_1_and_2(engine: str, root: Path) -> Path:
    """Stage 1 into `root`/reward, then stage 2 into `root`, in one start of the two processes (the tiny preset
    trains its reward model first); stage 2 reseeds after stage 1, so a run given that reward model trains alike."""
    # built here, not by the ranks: under torch.distributed transformers saves a model on rank 0 only, and rank 1's
    # tokenizer-only folder can win the race to the cache
    resolve_model_path("tiny")
    run(launch(engine, "train_policy", *STAGE2, "--output-dir", root))
    return root


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """Stage 1 and stage 2 under DDP: what every engine must reproduce."""
    return stages_1_and_2("ddp", tmp_path_factory.mktemp("ddp"))


def killed_in_stage_2_and_resumed(engine: str, root: Path) -> Path:
    """`stages_1_and_2` killed after stage 2's update 3 (its last checkpoint is update 2's), then resumed: stage 2
    goes on from the checkpoint on stage 1's reward model, which is not trained again."""
    resolve_model_path("tiny")  # as in stages_1_and_2
    args = (*STAGE2, "--output-dir", root, "--save-interval", 2)
    process = subprocess.Popen(
        launch(engine, "train_policy", *args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    metrics = root / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and process.poll() is None:
        if metrics.exists() and any(m["step"] == 3 for m in read_metrics(metrics)):
            kill_with_descendants(process)  # the launcher and both ranks
            break
        time.sleep(0.05)
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    resumed = run(launch(engine, "train_policy", *args, "--resume"))
    assert re.search(r"^resumed after update [2468]$", resumed.stdout, re.MULTILINE), resumed.stdout[-2000:]
    assert "held-out accuracy" not in resumed.stdout  # no stage 1 again
    return root


@pytest.fixture(scope="module", params=ENGINES)
def engine_run(request, tmp_path_factory):
    """Stage 1 and stage 2 under an engine, as `ddp_runs` ran them, but killed in stage 2 and resumed: a run that
    equals DDP's straight one both trains as DDP does and resumes to the same weights."""
    engine = request.param
    return engine, killed_in_stage_2_and_resumed(engine, tmp_path_factory.mktemp(engine))


@pytest.mark.slow
def test_stage2_under_the_engine_trains_as_ddp_does(engine_run, ddp_runs):
    engine, root = engine_run
    assert_same_metrics(ddp_runs / "metrics.jsonl", root / "metrics.jsonl")
    assert_same_tensors(ddp_runs / "policy" / "model.safetensors", root / "policy" / "model.safetensors")
    assert_same_tensors(ddp_runs / "policy" / "value_head.safetensors", root / "policy" / "value_head.safetensors")
    # an ordinary transformers folder
    AutoModelForCausalLM.from_pretrained(root / "policy")


@pytest.mark.slow
def test_the_engine_holds_a_share_of_ddps_state_per_process(engine_run, ddp_runs):
    """Parameters (the frozen reference and reward model's too) and optimizer state held by the largest process,
    from the shards on the ranks, as a share of DDP's, where DDP holds 5 model sizes (the policy, Adam's two
    moments, the two frozen models): FSDP2 half of each; ZeRO-2 the parameters whole, half of Adam's moments and of
    its float32 master copy (4.5 / 5); ZeRO-3 half of everything, the master copy included (3 / 5). Give or take a
    few elements: FSDP2 splits each tensor along its first dimension, and a single row (a scalar head's weight) lies
    whole on one process; DeepSpeed pads its partitions."""
    expected = {"fsdp2": 0.5, "zero2": 0.9, "zero3": 0.6}
    engine, root = engine_run
    ddp = read_metrics(ddp_runs / "metrics.jsonl")[-1]["memory/state_gib"]
    sharded = read_metrics(root / "metrics.jsonl")[-1]["memory/state_gib"]
    assert sharded / ddp == pytest.approx(expected[engine], abs=0.04), (engine, sharded, ddp)


@pytest.mark.slow
def test_frozen_models_kept_whole_train_the_same_and_hold_more(ddp_runs, tmp_path):
    """`--no-shard-frozen` under ZeRO-3: the reference policy and reward model whole on each process, beside the
    sharded policy; stage 2 only, on DDP's reward model."""
    reward = ("--rewards.trained-model", ddp_runs / "reward" / "reward_model")
    run(launch("zero3", "train_policy", *STAGE2, *reward, "--no-shard-frozen", "--output-dir", tmp_path))
    assert_same_metrics(ddp_runs / "metrics.jsonl", tmp_path / "metrics.jsonl")
    ddp = read_metrics(ddp_runs / "metrics.jsonl")[-1]["memory/state_gib"]
    whole_frozen = read_metrics(tmp_path / "metrics.jsonl")[-1]["memory/state_gib"]
    assert 0.6 * ddp < whole_frozen < ddp  # the policy's state halved, the two frozen models whole


@pytest.mark.slow
def test_stage1_under_the_engine_trains_as_ddp_does(engine_run, ddp_runs):
    """Training, the normalizations after it (gain and bias written into a sharded model) and the saved folder."""
    engine, root = engine_run
    assert_same_metrics(ddp_runs / "reward" / "metrics.jsonl", root / "reward" / "metrics.jsonl")
    for name in ("model.safetensors", RewardModel.HEAD_FILE):
        assert_same_tensors(ddp_runs / "reward" / "reward_model" / name, root / "reward" / "reward_model" / name)


@pytest.mark.slow
def test_the_resumed_run_logs_each_update_once_from_the_engines_checkpoint(engine_run):
    engine, root = engine_run
    assert [m["step"] for m in read_metrics(root / "metrics.jsonl")] == list(range(1, 11))
    assert torch.load(root / "checkpoint" / "state.pt", weights_only=False)["engine"] == engine


@pytest.mark.parametrize(
    "environment, words",
    [
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "fsdp_version: 2"),
        (
            {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"},
            "fsdp_state_dict_type: FULL_STATE_DICT",
        ),
        (
            {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"},
            "fsdp_cpu_ram_efficient_loading",
        ),
        ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1"}, "zero_stage: 2"),
        (
            {
                "ACCELERATE_USE_DEEPSPEED": "true",
                "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
                "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true",
            },
            "zero3_init_flag",
        ),
        (
            {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "no/such/zero3.json"},
            "is not there from",
        ),
    ],
)
def test_a_config_the_library_cannot_honour_is_refused_by_name(monkeypatch, environment, words):
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(UserError, match=words):
        sharding.requested_engine()


def test_a_single_process_run_with_a_sharding_config_is_refused(tmp_path):
    """Sharding over one process shards nothing: the run says so rather than training as if it did."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            os.path.join(CONFIGS, "fsdp2.yaml"),
            "--num_processes",
            "1",
            "-m",
            "lm_human_preference_details.train_policy",
            "--task",
            "tiny",
            "--output-dir",
            str(tmp_path),
            *QUIET,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "error: the accelerate config asks for FSDP2" in result.stderr, result.stderr[-2000:]
    assert "--num_processes 2 or more" in result.stderr


def test_a_reward_model_saved_with_scalar_gain_and_bias_still_loads(tmp_path):
    """Folders saved before gain and bias had shape (1,) (a sharding engine splits along the first dimension)."""
    from safetensors.torch import save_file

    model = RewardModel.from_pretrained_lm("tiny")
    with torch.no_grad():
        model.gain.fill_(1.5)
        model.bias.fill_(-0.25)
    model.save(tmp_path)
    head = load_file(tmp_path / RewardModel.HEAD_FILE)
    head["gain"], head["bias"] = head["gain"].reshape(()), head["bias"].reshape(())  # as the older folders hold them
    save_file(head, tmp_path / RewardModel.HEAD_FILE)
    loaded = RewardModel.load(str(tmp_path))
    assert loaded.gain_and_bias() == (1.5, -0.25)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(loaded(ids, pad_id=-1), model(ids, pad_id=-1))
