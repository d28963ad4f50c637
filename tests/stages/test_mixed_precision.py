"""Mixed precision (`--mixed-precision bf16`) in stages 1 and 2 through accelerate's autocast, on the tiny preset.

The matmuls run in bfloat16, the quantities OAI computes in float32 stay float32: the rollout's logprobs and the
first minibatch's are computed the same way, so the first ratio is 1; a stage learns (a bf16 checkpoint resumes
bitwise: tests/stages/test_train_policy.py).
"""

import subprocess
import sys

import pytest
import torch

from lm_human_preference_details import precision as run_precision
from lm_human_preference_details.cli import UserError
from lm_human_preference_details.tracking import read_metrics

QUIET = ("--wandb-mode", "disabled")


def stage(module: str, *args) -> list[str]:
    return [sys.executable, "-m", f"lm_human_preference_details.{module}", *map(str, args), *QUIET]


def run(cmd) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.mark.slow
def test_stage1_then_stage2_learn_under_bf16(tmp_path):
    """The tiny preset as it is: stage 1 first in the same run (OAI's train_new_model), all of it under bf16."""
    run(stage("train_policy", "--task", "tiny", "--mixed-precision", "bf16", "--output-dir", tmp_path))
    reward = read_metrics(tmp_path / "reward" / "metrics.jsonl")
    accuracy = [m["test/accuracy"] for m in reward if "test/accuracy" in m]
    assert accuracy[-1] > 0.5, accuracy  # chance is 0.25 (best of 4)
    metrics = [m for m in read_metrics(tmp_path / "metrics.jsonl") if "objective/scores" in m]
    tenth = max(1, len(metrics) // 10)
    first = sum(m["objective/scores"] for m in metrics[:tenth]) / tenth
    last = sum(m["objective/scores"] for m in metrics[-tenth:]) / tenth
    assert last > first + 0.5, (first, last)


@pytest.mark.slow
def test_the_first_ratio_is_one_under_bf16(tmp_path, tiny_reward_model):
    """One update of one epoch of one minibatch: the update's only minibatch is the rollout's batch, before any step,
    so its ratio is 1 wherever the rollout's logprobs and the minibatch's are computed alike (both under autocast, the
    logprobs in float32)."""
    one_pass = ("--ppo.noptepochs", 1, "--ppo.nminibatches", 1, "--ppo.total-episodes", 64)
    flags = ("--task", "tiny", "--rewards.trained-model", tiny_reward_model, *one_pass, "--mixed-precision", "bf16")
    run(stage("train_policy", *flags, "--output-dir", tmp_path))
    (first,) = read_metrics(tmp_path / "metrics.jsonl")
    assert first["objective/kl"] == 0.0  # the reference, the same weights, computed the same way as the policy
    assert first["ppo/policy/approxkl"] == 0.0
    assert first["ppo/policy/ratio_max"] == 1.0 and first["ppo/policy/clipfrac"] == 0.0


def test_a_bad_value_is_one_line_naming_the_flag(tmp_path):
    result = subprocess.run(
        stage("train_policy", "--task", "tiny", "--mixed-precision", "fp8", "--output-dir", tmp_path),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "--mixed-precision" in result.stderr and "fp8" in result.stderr, result.stderr


@pytest.mark.parametrize(
    "environment, precision, words",
    [
        ({"ACCELERATE_MIXED_PRECISION": "bf16"}, "no", "--mixed-precision bf16"),
        ({}, "fp16", "fp16 needs a GPU"),
    ],
)
def test_a_precision_the_run_cannot_honour_is_refused(monkeypatch, environment, precision, words):
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(UserError, match=words):
        run_precision.check_mixed_precision(precision, engine="single", device=torch.device("cpu"))


def test_mixed_precision_under_a_sharding_engine_is_refused():
    with pytest.raises(UserError, match="DDP or one process"):
        run_precision.check_mixed_precision("bf16", engine="fsdp2", device=torch.device("cpu"))


@pytest.mark.parametrize("speedup, precision", [(0.11, "no"), (3.1, "bf16")])
def test_the_quickstart_takes_bf16_only_where_it_is_faster(monkeypatch, speedup, precision):
    """0.11: this project's CPU (AMD EPYC without AVX512-BF16) emulates bfloat16; 3.1: one with AVX512-BF16."""
    monkeypatch.setattr(run_precision, "bf16_speedup", lambda device: speedup)
    chosen, reason = run_precision.fastest_precision(torch.device("cpu"))
    assert chosen == precision
    assert f"{speedup:.1f}x" in reason or f"{speedup:.2f}x" in reason


def test_the_bf16_probe_gives_one_answer_on_a_busy_machine():
    """Measured while two processes keep two cores busy (as on a shared node, or beside the suite's other
    processes), the probe takes the side it takes on its own, every time."""
    alone = run_precision.bf16_speedup(torch.device("cpu"))
    assert 0.01 < alone < 100
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        beside = [run_precision.bf16_speedup(torch.device("cpu")) for _ in range(5)]
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert all((speedup >= 1.2) == (alone >= 1.2) for speedup in beside), (alone, beside)


@pytest.mark.slow
def test_the_grpo_trainer_learns_under_bf16(tmp_path):
    """The trainer's forwards (the reference's too) under accelerate's autocast; the servers sample in float32."""
    cmd = [sys.executable, "-m", "lm_human_preference_details.grpo.launch", "--task", "tiny", "--steps", "60"]
    result = run([*cmd, "--mixed-precision", "bf16", "--output-dir", str(tmp_path), *QUIET])
    assert "bf16 autocast" in result.stdout + result.stderr
    rates = [m["success/rate"] for m in read_metrics(tmp_path / "metrics.jsonl")]
    assert sum(rates[-10:]) / 10 > sum(rates[:10]) / 10 + 0.1, rates
