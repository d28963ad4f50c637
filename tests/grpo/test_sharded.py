"""The GRPO trainer sharded over two processes with FSDP2 (`--trainer-processes 2`), on the CPU over gloo.

An optimizer step on two processes is the single-process step (the same groups, every micro-batch on one process
or the other, one of them with a filler pass), and so is a step after a resume from a sharded checkpoint; each
process holds half of the policy; a push gathers the weights a bucket at a time, and the server gets them bitwise; and
`grpo.launch --trainer-processes 2` learns on the tiny preset, pushing the gathered weights to its server after every
step.
"""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lm_human_preference_details.grpo.serving.server import load_for_inference
from tests.conftest import REPO, accelerate_two_processes
from tests.grpo.test_launch import Launched, metrics, success_rise
from tests.grpo.test_trainer import sampled_groups

CONFIGS = os.path.join(REPO, "configs", "accelerate")
ON_RANKS = os.path.join(os.path.dirname(__file__), "on_ranks.py")
PUSH_ON_RANKS = os.path.join(REPO, "benchmarks", "weight_sync_on_ranks.py")
STEP_FLAGS = (
    *("--group-size", "4", "--batch-size", "12", "--temperature", "0.8", "--lr", "1e-3"),
    # the reference model (sharded too) and the entropy bonus's gradient
    *("--kl-coef", "0.05", "--entropy-coef", "0.01", "--wandb-mode", "disabled"),
)


def on_ranks(steps_file, output_dir, *flags, processes: int = 1) -> None:
    launcher = accelerate_two_processes(os.path.join(CONFIGS, "fsdp2.yaml")) if processes == 2 else (sys.executable,)
    command = [*launcher, ON_RANKS, str(steps_file), *STEP_FLAGS, "--output-dir", str(output_dir), *flags]
    if processes == 2:
        command += ["--trainer-processes", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """Two steps' groups sampled from tiny-math, rewards that differ within each group: the first step in 3
    micro-batches (2 on one process, 1 and a filler pass on the other), the second in one (the other process runs
    only a filler pass)."""
    tiny_math = load_for_inference("tiny-math", "cpu")
    prompts = ["1+2=\\boxed{", "33+44=\\boxed{", "2+2=\\boxed{"]
    steps = []
    for token_budget, max_tokens in ((30, [6, 9, 4]), (10**6, [5, 7, 3])):
        groups = sampled_groups(tiny_math, prompts, max_tokens, attempts=4)
        for i, group in enumerate(groups):
            for j, attempt in enumerate(group.attempts):
                attempt.reward = float((i + j + len(steps)) % 2)
        steps.append({"token_budget": token_budget, "groups": groups})
    from lm_human_preference_details.grpo.trainer import pack

    assert [len(pack(s["groups"], s["token_budget"])) for s in steps] == [3, 1]
    path = tmp_path_factory.mktemp("steps") / "steps.json"
    path.write_text(json.dumps([{**s, "groups": [g.to_json() for g in s["groups"]]} for s in steps]))
    return path


def assert_same_weights(expected_file, actual_file) -> None:
    expected, actual = load_file(expected_file), load_file(actual_file)
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=1e-6, msg=name)


def assert_same_stats(expected_file, actual_file) -> None:
    expected, actual = json.loads(expected_file.read_text()), json.loads(actual_file.read_text())
    assert expected.keys() == actual.keys()
    for key, value in expected.items():
        assert actual[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


@pytest.mark.slow
def test_a_sharded_step_and_a_resumed_one_are_the_single_process_steps(two_steps, tmp_path):
    """Each step's update, gradient norm and stats on two FSDP2 processes equal one process's (float64); the first
    step's checkpoint, written from the gathered weights and optimizer state, resumes the second step."""
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    on_ranks(two_steps, single, "--steps", "2")
    on_ranks(two_steps, sharded, "--steps", "1", processes=2)
    on_ranks(two_steps, sharded, "--steps", "2", "--resume", processes=2)
    for step in (1, 2):
        assert_same_weights(single / f"weights-{step}.safetensors", sharded / f"weights-{step}.safetensors")
        assert_same_stats(single / f"stats-{step}.json", sharded / f"stats-{step}.json")
    # the checkpoint's model folder holds the whole weights: what a resumed run's servers load
    saved = AutoModelForCausalLM.from_pretrained(sharded / "checkpoint" / "model", dtype=torch.float64)
    expected = load_file(single / "weights-2.safetensors")
    assert sorted(name for name, _ in saved.named_parameters()) == sorted(expected)
    for name, parameter in saved.named_parameters():
        torch.testing.assert_close(parameter.detach(), expected[name], rtol=0, atol=1e-6, msg=name)
    for rank in (0, 1):  # each process holds its half of every parameter
        held = json.loads((sharded / f"rank-{rank}.json").read_text())
        assert held["dtensors"] == 28 and 0.4 < held["local_elements"] / held["elements"] < 0.6, held
    assert json.loads((single / "rank-0.json").read_text())["dtensors"] == 0


def save_wide_model(path) -> torch.nn.Module:
    """A randomly initialised GPT-2 of tiny-math's vocabulary, 512 wide and 6 blocks deep (76 MB of float32, a
    largest tensor of 4 MiB), saved with tiny-math's tokenizer into `path` for a server to load; returns it."""
    from transformers import AutoConfig, AutoTokenizer

    from lm_human_preference_details.assets import resolve_model_path

    tiny_math = resolve_model_path("tiny-math")
    config = AutoConfig.from_pretrained(tiny_math)
    config.update(dict(n_embd=512, n_layer=6, n_head=8, n_positions=64))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_math).save_pretrained(path)
    return model


@pytest.mark.slow
def test_a_sharded_push_gathers_a_bucket_at_a_time_and_the_server_gets_the_gathered_weights(tmp_path):
    """Two FSDP2 trainer processes push a 76 MB model in 2 MiB buckets: the first process needs at most about two
    buckets and one whole tensor more than it held (`ServerUpdates.push_sharded`), far less than the model, and the
    server then holds, bitwise, the weights the trainer processes gather whole."""
    from lm_human_preference_details.grpo.client import ServerProcess, request_json
    from lm_human_preference_details.grpo.weights import digest

    model = save_wide_model(tmp_path / "model")
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    with open(tmp_path / "server.log", "wb") as log:
        server = ServerProcess(["--model", str(tmp_path / "model"), "--threads", "1"], log)
    try:
        url = server.wait_until_serving()
        launcher = accelerate_two_processes(os.path.join(CONFIGS, "fsdp2.yaml"))
        flags = ("--trainer-processes", "2", "--update-bucket-mb", "2", "--wandb-mode", "disabled")
        command = [*launcher, PUSH_ON_RANKS, str(tmp_path / "model"), url, str(tmp_path / "push.json"), *flags]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-4000:]
        request_json("GET", f"{url}/health?wait_for_version=1&timeout_s=30")  # received, then loaded
        served = request_json("GET", f"{url}/weights_digest")
    finally:
        server.process.terminate()
        server.process.wait(timeout=60)
    pushed = json.loads((tmp_path / "push.json").read_text())
    assert served == {"model_version": 1, "digests": pushed["digests"]}
    assert pushed["digests"].keys() == digest(model).keys() and pushed["digests"] != digest(model)
    # buckets of 2 MiB, or one tensor alone when larger; gathering the whole model first needed 146 MiB here
    bucket = max(2 * 2**20, largest)
    assert pushed["extra_bytes"] < 2 * bucket + largest + 4 * 2**20 < model_bytes / 4, (pushed, model_bytes)


def policy_state_bytes() -> int:
    """tiny-math's parameters and Adam's two moments, whole: what one trainer process holds."""
    from lm_human_preference_details.models import load_causal_lm

    return 3 * sum(p.numel() * p.element_size() for p in load_causal_lm("tiny-math").parameters())


@pytest.mark.slow
def test_the_tiny_preset_learns_on_two_sharded_trainer_processes_and_resumes_until_one_dies(tmp_path):
    """The tiny preset's 100 steps with the trainer in two FSDP2 processes: it learns as the single-process trainer
    does (`test_grpo_launch.success_rise`), the server gets every step's weights (gathered from the shards), each
    process holds half of the policy and its optimizer state, and the run resumes from its sharded checkpoint. The
    resumed run goes on until its second trainer process is killed: that ends the run, and every process with it."""
    run = Launched(tmp_path / "run", "--steps", "100", "--save-interval", "50", "--trainer-processes", "2")
    assert run.finish() == 0, run.output()
    rows = metrics(run.output_dir)
    assert [r["step"] for r in rows] == list(range(1, 101))
    first, last = success_rise(rows)
    assert last > first + 0.1, (first, last)
    (server,) = json.load(open(os.path.join(run.output_dir, "servers.json"))).values()
    assert server["weight_updates"] == 100 and server["model_version"] == 100
    held = rows[-1]["memory/state_gib"] * 2**30  # the larger process's shards
    assert 0.45 < held / policy_state_bytes() < 0.6, held
    assert re.search(r"started trainer \(pid \d+\), trainer-1 \(pid \d+\), actor", run.output(tail=None))
    assert run.leftovers() == []

    resumed = Launched(
        tmp_path / "run", "--steps", "100000", "--save-interval", "50", "--trainer-processes", "2", "--resume"
    )
    resumed.watch_until(lambda: len(metrics(resumed.output_dir)) >= 110)
    second = int(re.search(r"trainer-1 \(pid (\d+)\)", resumed.output(tail=None))[1])
    os.kill(second, signal.SIGKILL)
    assert resumed.finish(timeout_s=120) == 1
    assert "error: the trainer-1 exited with status -9" in resumed.output()
    rows = metrics(resumed.output_dir)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # each step once, from 101 on
    assert sum(r["success/rate"] for r in rows[100:110]) / 10 > first + 0.1  # it went on from the trained weights
    assert resumed.leftovers() == []


def test_the_trainer_processes_get_the_environment_of_the_fsdp2_config():
    """What `accelerate launch --config_file configs/accelerate/fsdp2.yaml` sets from the config's fsdp_config."""
    import yaml

    from lm_human_preference_details.grpo import world
    from lm_human_preference_details.grpo.nodes import FSDP2_ENVIRONMENT, NodePlan, trainer_environments

    with open(os.path.join(CONFIGS, "fsdp2.yaml")) as f:
        config = yaml.safe_load(f)
    from_config = {
        key.upper(): str(value).lower() if isinstance(value, bool) else str(value)
        for key, value in config["fsdp_config"].items()
    }
    assert FSDP2_ENVIRONMENT == {
        "ACCELERATE_USE_FSDP": "true",
        "ACCELERATE_MIXED_PRECISION": config["mixed_precision"],
        **from_config,
    }

    def plan(trainer_processes: int) -> NodePlan:
        the_map = world.build_world_map(1, 1, "cpu", "", 1, trainer_processes=trainer_processes)
        return NodePlan(world.Node(1, 0, "127.0.0.1", 29500, "default"), the_map, "gloo", "127.0.0.1")

    first, second = trainer_environments(plan(2), "127.0.0.1", 1234).values()
    assert (first["RANK"], second["RANK"], first["WORLD_SIZE"]) == ("0", "1", "2")
    assert first["MASTER_PORT"] == second["MASTER_PORT"] == "1234" and first.items() >= FSDP2_ENVIRONMENT.items()
    # one process: the trainer as it always was, on the CPU
    assert trainer_environments(plan(1), "127.0.0.1", 1234) == {0: {"CUDA_VISIBLE_DEVICES": ""}}


def test_a_trainer_of_several_processes_started_as_one_says_how_to_start_it():
    check = (
        "from lm_human_preference_details.grpo.config import GRPOArgs, ProcessArgs\n"
        "from lm_human_preference_details.grpo.trainer import trainer_accelerator\n"
        "trainer_accelerator(GRPOArgs(processes=ProcessArgs(trainer_processes=2)))\n"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "UserError: --trainer-processes 2: start the trainer through grpo.launch, or under `accelerate launch " in (
        result.stderr
    ), result.stderr[-2000:]
