"""Stage 2 end to end, through the real command line and real processes, on the offline `tiny` preset."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from lm_human_preference_details import cli, sharding, train_policy
from lm_human_preference_details.models import PolicyAndValue, RewardModel, load_causal_lm
from lm_human_preference_details.text import load_tokenizer
from lm_human_preference_details.tracking import read_metrics
from tests.conftest import (
    LOG_SILENCE_LIMIT_S,
    accelerate_two_processes,
    alive,
    command_line,
    run_into_log,
    signal_once_logged,
)

QUIET = ("--wandb-mode", "disabled")


def policy_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "lm_human_preference_details.train_policy", *args, *QUIET]


def run(cmd, timeout=600) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.mark.slow
def test_tiny_preset_end_to_end_score_rises_and_kl_tracks_target(tmp_path):
    """The public command: trains its own reward model first, then PPO."""
    run(policy_cmd("--task", "tiny", "--output-dir", str(tmp_path)))
    metrics = [m for m in read_metrics(tmp_path / "metrics.jsonl") if "objective/scores" in m]
    tenth = max(1, len(metrics) // 10)
    first = sum(m["objective/scores"] for m in metrics[:tenth]) / tenth
    last = sum(m["objective/scores"] for m in metrics[-tenth:]) / tenth
    assert last > first + 0.5, (first, last)
    labeler_first = sum(m["objective/labeler_score"] for m in metrics[:tenth]) / tenth
    labeler_last = sum(m["objective/labeler_score"] for m in metrics[-tenth:]) / tenth
    assert labeler_last > labeler_first, (labeler_first, labeler_last)  # the labeler itself agrees
    target = train_policy.defaults_for_task("tiny").rewards.target_kl
    final_kl = sum(m["objective/kl"] for m in metrics[-5:]) / 5
    assert 0.5 * target < final_kl < 1.5 * target, final_kl
    for name in (
        "ppo/policy/approxkl",
        "ppo/policy/clipfrac",
        "ppo/val/clipfrac",
        "ppo/loss/policy",
        "ppo/loss/value",
        "ppo/returns/mean",
        "objective/entropy",
        "objective/score_total",
        "objective/kl_coef",
        "ppo/val/var_explained",
    ):
        assert name in metrics[-1]
    assert (tmp_path / "policy" / "config.json").exists() and (tmp_path / "reward" / "reward_model").is_dir()


@pytest.mark.slow
def test_two_processes_keep_weights_and_kl_coef_identical(tmp_path, tiny_reward_model):
    """Two DDP processes end with the same weights and KL coefficient. SIGTERM to the launcher (which forwards it to
    each rank) stops both after the same update with one checkpoint, and the run resumes to them bitwise on each
    process (each CPU process's device under accelerate is `cpu:<rank>`, which torch.load could not restore a
    checkpoint onto)."""
    script = os.path.join(os.path.dirname(__file__), "policy_on_ranks.py")
    flags = ["--task", "tiny", "--rewards.trained-model", tiny_reward_model, "--ppo.total-episodes", str(64 * 4)]
    flags += ["--save-interval", "1", *QUIET]

    def launch(out, output_dir, *more: str) -> list[str]:
        os.makedirs(out, exist_ok=True)
        return [*accelerate_two_processes(), script, str(out), *flags, "--output-dir", str(output_dir), *more]

    run(launch(tmp_path / "straight", tmp_path / "straight_run"))
    rank0, rank1 = (load_file(tmp_path / "straight" / f"rank{rank}.safetensors") for rank in (0, 1))
    initial_kl_coef = train_policy.defaults_for_task("tiny").rewards.kl_coef
    assert rank0["kl_coef"].item() != initial_kl_coef  # the adaptive controller moved ...
    assert rank0["kl_coef"].item() == rank1["kl_coef"].item()  # ... identically on both ranks
    assert rank0.keys() == rank1.keys()
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name

    killed = tmp_path / "killed_run"
    process = subprocess.Popen(
        launch(tmp_path / "killed", killed), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    signalled_after, ranks = signal_once_logged(process, killed / "metrics.jsonl", 1)
    _, err = process.communicate(timeout=120)
    stopped_at = assert_stopped_on_sigterm(err, killed, signalled_after, num_updates=4)
    assert process.returncode == 1, err[-3000:]  # torch's launcher re-raises the signal it forwarded
    assert not alive(ranks), [command_line(pid) for pid in alive(ranks)]  # both ranks ended on their own

    resumed = run(launch(tmp_path / "killed", killed, "--resume", "auto"))
    assert re.search(f"^resumed after update {stopped_at}$", resumed.stdout, re.MULTILINE), resumed.stdout[-2000:]
    for rank, straight in enumerate((rank0, rank1)):
        after_resume = load_file(tmp_path / "killed" / f"rank{rank}.safetensors")
        assert straight.keys() == after_resume.keys()
        for name in straight:
            assert torch.equal(straight[name], after_resume[name]), (rank, name)
    assert [m["step"] for m in read_metrics(killed / "metrics.jsonl")] == [1, 2, 3, 4]


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_weights(tmp_path, tiny_reward_model, monkeypatch, capsys):
    """Under bf16 autocast: the one single-process resume test for both precisions (float32's run differs only in
    autocast being off, and resumes bitwise on two processes in the test above)."""
    common = [
        "--task",
        "tiny",
        "--rewards.trained-model",
        tiny_reward_model,
        "--ppo.total-episodes",
        str(64 * 4),
        "--save-interval",
        "2",
        "--mixed-precision",
        "bf16",
    ]
    run(policy_cmd(*common, "--output-dir", str(tmp_path / "straight")))

    # SIGTERM after update 1: the run stops after the update in flight, with a checkpoint of it
    killed = tmp_path / "killed"
    metrics_path = killed / "metrics.jsonl"
    process = subprocess.Popen(
        policy_cmd(*common, "--output-dir", str(killed)), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    signalled_after, _ = signal_once_logged(process, metrics_path, 1)
    _, err = process.communicate(timeout=120)
    assert process.returncode == cli.PREEMPTED, err[-3000:]
    assert_stopped_on_sigterm(err, killed, signalled_after, num_updates=4)

    # the same command with --resume auto continues it; SIGKILL after update 3 leaves update 2's checkpoint
    process = subprocess.Popen(
        policy_cmd(*common, "--output-dir", str(killed), "--resume", "auto"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        if metrics_path.exists() and any(m["step"] == 3 for m in read_metrics(metrics_path)):
            process.send_signal(signal.SIGKILL)  # after update 3, the last checkpoint is update 2
            break
        time.sleep(0.05)
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (killed / "policy").exists()

    run(policy_cmd(*common, "--output-dir", str(killed), "--resume"))
    straight = load_file(tmp_path / "straight" / "policy" / "model.safetensors")
    resumed = load_file(killed / "policy" / "model.safetensors")
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    steps = [m["step"] for m in read_metrics(metrics_path)]
    assert steps == [1, 2, 3, 4], steps  # every update logged exactly once
    straight_scores = [m["objective/scores"] for m in read_metrics(tmp_path / "straight" / "metrics.jsonl")]
    assert [m["objective/scores"] for m in read_metrics(metrics_path)] == straight_scores

    # a save killed between its two renames leaves only checkpoint.old, which a resume takes; a resume with other
    # settings is refused, naming each but those that may change (its LR schedule, query position and optimizer
    # state belong to the old ones)
    os.rename(killed / "checkpoint", killed / "checkpoint.old")
    other = ["--ppo.lr", "0.123", "--sample-interval", "3", "--mixed-precision", "no"]
    assert_one_line_error(
        monkeypatch,
        capsys,
        [*common, *other, "--output-dir", str(killed), "--resume"],
        f"--resume: {killed}/checkpoint was saved with other settings (mixed_precision: 'bf16' then, 'no' now; "
        "ppo.lr: 0.0003 then, 0.123 now); ",
    )
    assert (killed / "checkpoint").exists()


def test_gradient_accumulation_does_not_change_the_update(tmp_path, tiny_reward_model):
    """A minibatch of 16 in one piece or in 4 micro-batches of 4: the same weights after 2 updates, and the
    same logged stats (variances included)."""

    weights, ppo_metrics = [], []
    for steps in (1, 4):
        args = train_policy.defaults_for_task("tiny")
        args.rewards.trained_model, args.output_dir, args.wandb_mode = (
            tiny_reward_model,
            str(tmp_path / f"accum{steps}"),
            "disabled",
        )
        args.ppo.batch_size, args.ppo.total_episodes, args.ppo.gradient_accumulation_steps = 16, 32, steps
        policy, _ = train_policy.train(args, sharding.make_accelerator())
        weights.append({k: v.detach().clone() for k, v in policy.state_dict().items()})
        ppo_metrics.append(
            [
                {k: v for k, v in m.items() if k.startswith("ppo/") and k != "ppo/lr"}
                for m in read_metrics(tmp_path / f"accum{steps}" / "metrics.jsonl")
            ]
        )
    initial = PolicyAndValue(load_causal_lm("tiny")).state_dict()
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=1e-4, atol=1e-6)
    assert any(not torch.equal(weights[0][name], initial[name]) for name in initial)  # the updates did move the weights
    assert len(ppo_metrics[0]) == 2 and "ppo/returns/var" in ppo_metrics[0][0]
    for whole, accumulated in zip(*ppo_metrics):
        assert accumulated.keys() == whole.keys()
        for key, value in whole.items():
            assert accumulated[key] == pytest.approx(value, rel=1e-3, abs=1e-6), key


def test_resume_without_checkpoint_is_one_clear_line(tmp_path, tiny_reward_model, monkeypatch, capsys):
    assert_one_line_error(
        monkeypatch,
        capsys,
        ["--task", "tiny", "--rewards.trained-model", tiny_reward_model, "--output-dir", str(tmp_path), "--resume"],
        "--resume: no checkpoint in",
    )


def test_a_run_killed_in_or_after_its_own_stage_1_resumes_where_it_can(
    tmp_path, tiny_reward_model, monkeypatch, capsys
):
    """Nothing saved yet: --resume says so before training a reward model. A reward model saved but no policy
    checkpoint (killed after stage 1): stage 2 starts over with that reward model, which is not trained again."""
    assert_one_line_error(
        monkeypatch,
        capsys,
        ["--task", "tiny", "--output-dir", str(tmp_path), "--resume"],
        f"--resume: no reward model in {tmp_path}/reward/reward_model and no checkpoint in {tmp_path}/checkpoint",
    )
    shutil.copytree(tiny_reward_model, tmp_path / "reward" / "reward_model")
    result = run(policy_cmd("--task", "tiny", "--output-dir", str(tmp_path), "--resume", "--ppo.total-episodes", "128"))
    assert (
        "stage 2 saved no checkpoint: it starts over" in result.stdout and "held-out accuracy" not in result.stdout
    )  # no stage 1
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2] and (tmp_path / "policy").exists()


@pytest.mark.parametrize("resume", [True, "auto"])
def test_a_resume_continues_its_own_stage_1_from_the_checkpoint_a_signal_left(tmp_path, monkeypatch, resume):
    """Stage 1 inside stage 2, stopped by a signal, left its checkpoint and no reward model: --resume (and
    --resume auto) continues stage 1 from it, where an empty folder starts it afresh. Stage 1 itself is left out
    here (its tiny preset trains for a minute; test_train_reward resumes it bitwise)."""
    resumed_stage_1 = []

    def stage_1(reward_args, accelerator):
        resumed_stage_1.append(reward_args.resume)
        return os.path.join(reward_args.output_dir, "reward_model")

    monkeypatch.setattr(train_policy.train_reward, "train", stage_1)
    args = train_policy.defaults_for_task("tiny")
    args.output_dir, args.resume = str(tmp_path), resume
    accelerator = sharding.make_accelerator()
    if resume == "auto":
        assert train_policy.reward_model_and_resume(args, accelerator) == (f"{tmp_path}/reward/reward_model", False)
    (tmp_path / "reward" / "checkpoint").mkdir(parents=True)
    (tmp_path / "reward" / "checkpoint" / "state.pt").write_bytes(b"")
    assert train_policy.reward_model_and_resume(args, accelerator) == (f"{tmp_path}/reward/reward_model", False)
    assert resumed_stage_1 == ([False, True] if resume == "auto" else [True])


def test_reward_model_from_another_tokenizer_is_refused(tmp_path, tiny_reward_model, monkeypatch, capsys):
    foreign = tmp_path / "foreign"
    RewardModel.load(tiny_reward_model).save(str(foreign))
    load_tokenizer("gpt2").save_pretrained(str(foreign))  # as if trained on GPT-2's vocabulary
    assert_one_line_error(
        monkeypatch,
        capsys,
        ["--task", "tiny", "--rewards.trained-model", str(foreign), "--output-dir", str(tmp_path / "out")],
        "was trained with another tokenizer",
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--ppo.batch-size", "60", "--ppo.nminibatches", "8"],
            "ppo.batch_size / processes = 60 must be divisible by ppo.nminibatches=8",
        ),
        (["--ppo.gradient-accumulation-steps", "5"], "must be divisible by ppo.gradient_accumulation_steps=5"),
        (["--ppo.total-episodes", "10"], "ppo.total_episodes=10 is less than one batch"),
        (["--rewards.trained-model", "/no/such/folder"], "rewards.trained_model=/no/such/folder: no such folder"),
        (["--rewards.trained-model", "/"], "rewards.trained_model=/ is not a reward model folder"),
        (["--ppo.nminibatches", "0"], "--ppo.nminibatches must be > 0, got 0"),
        (["--ppo.batch-size", "-64"], "--ppo.batch-size must be > 0, got -64"),
        (["--sample-interval", "0"], "--sample-interval must be > 0, got 0"),
        (["--rewards.horizon", "0"], "--rewards.horizon must be > 0, got 0"),
        (["--task.query-length", "0"], "--task.query-length must be > 0, got 0"),
        (
            ["--task.truncate-token", "27", "--task.truncate-after", "12"],
            "--task.truncate-after 12 must be in [0, task.response_length=12)",
        ),
        (["--task.truncate-token", "999"], "--task.truncate-token 999 is outside the tokenizer's vocabulary [0, 34)"),
        (["--eval-labeler", "no_such_module:f"], "no_such_module"),
    ],
)
def test_bad_arguments_are_one_clear_line(tmp_path, monkeypatch, capsys, flags, message):
    assert_one_line_error(monkeypatch, capsys, ["--task", "tiny", *flags, "--output-dir", str(tmp_path)], message)


def assert_stopped_on_sigterm(err: str, output_dir, signalled_after: int, num_updates: int) -> int:
    """The run stopped after the update in flight when it was signalled (or the one logged just before), saying so
    in its last line, with its logs and checkpoint at that update; that update."""
    found = re.search(r"^stopped at update (\d+) of (\d+) on SIGTERM: rerun with --resume$", err, re.MULTILINE)
    assert found and int(found[2]) == num_updates, err[-3000:]
    stopped_at = int(found[1])
    assert signalled_after <= stopped_at <= signalled_after + 1 and stopped_at < num_updates, (
        signalled_after,
        err[-300:],
    )
    assert [m["step"] for m in read_metrics(output_dir / "metrics.jsonl")] == list(range(1, stopped_at + 1))
    state = torch.load(output_dir / "checkpoint" / "state.pt", weights_only=False)
    assert state["loop"]["update"] == stopped_at and not (output_dir / "policy").exists()
    return stopped_at


def test_resume_auto_starts_an_empty_folder_continues_a_saved_one_and_refuses_logs_alone(
    tmp_path, tiny_reward_model, monkeypatch, capsys
):
    """What a requeued job's unchanged command meets: nothing yet, its own checkpoint, or logs whose checkpoint is
    gone (refused, as a new run would overwrite them)."""
    argv = ["--task", "tiny", "--rewards.trained-model", tiny_reward_model, "--ppo.total-episodes", "64"]
    argv += ["--output-dir", str(tmp_path), "--resume", "auto", *QUIET]
    monkeypatch.setattr(sys, "argv", ["train_policy", *argv])
    train_policy.main()
    out = capsys.readouterr().out
    assert "resumed" not in out and [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1]
    train_policy.main()
    assert re.search(r"^resumed after update 1$", capsys.readouterr().out, re.MULTILINE)
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1]

    shutil.rmtree(tmp_path / "checkpoint")
    assert_one_line_error(
        monkeypatch,
        capsys,
        argv[:-2],
        f"--resume auto: {tmp_path} holds an earlier run's logs ({tmp_path}/metrics.jsonl, {tmp_path}/samples.jsonl) "
        "but no checkpoint",
    )


def assert_one_line_error(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(sys, "argv", ["train_policy", *argv, *QUIET])
    with pytest.raises(SystemExit) as exit_info:
        train_policy.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


@pytest.mark.slow
def test_quickstart_runs_through_on_the_tiny_preset(tmp_path):
    """The quickstart's own code path (labels, reward model, PPO, plot, before/after) on the tiny preset, its output
    into a pipe as into a cluster job's log file: never a minute without a line."""
    cmd = [
        sys.executable,
        "-m",
        "lm_human_preference_details.quickstart",
        "--task",
        "tiny",
        "--output-dir",
        str(tmp_path),
        "--ppo.total-episodes",
        str(64 * 4),
        *QUIET,
    ]
    printed, longest_silence_s = run_into_log(cmd)
    assert "the same queries, before and after PPO" in printed
    assert "vowels score of the policy's samples" in printed
    assert longest_silence_s < LOG_SILENCE_LIMIT_S, printed
    png = tmp_path / "learning_curves.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
