"""The shared command-line mechanics, in the processes a user's `accelerate launch` starts."""

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import accelerate_two_processes

# one DDP step through the stage scripts' own accelerator and entry-point wrapper, then the native threads left
DDP_STEP_THEN_LIST_THREADS = """
import json, os, sys, time, torch
from lm_human_preference_details import cli, sharding

@cli.main_with_user_errors
def main():
    accelerator = sharding.make_accelerator()
    model = torch.nn.Linear(4, 4)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.backward(model(torch.ones(2, 4)).sum())
    optimizer.step()

main()

def native_threads():
    return [open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")]

# gloo's tcp loop thread now and then ends a moment after destroy_process_group returns:
# a group kept alive keeps it for good, so the list is taken once no gloo thread is left, or after 5 s
deadline = time.monotonic() + 5
threads = native_threads()
while any("gloo" in name for name in threads) and time.monotonic() < deadline:
    time.sleep(0.01)
    threads = native_threads()
with open(os.path.join(sys.argv[1], f"threads{os.environ['RANK']}.json"), "w") as f:
    json.dump(threads, f)
"""


def test_ctrl_c_ends_a_stage_with_one_line_and_status_130(capsys):
    from lm_human_preference_details import cli

    @cli.main_with_user_errors
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_info:
        interrupted()
    assert exit_info.value.code == 130 and capsys.readouterr().err == "interrupted\n"


@pytest.mark.parametrize(
    "flags, resume",
    [
        ([], False),
        (["--resume"], True),
        (["--resume", "--seed", "3"], True),
        (["--no-resume"], False),
        (["--resume", "auto"], "auto"),
        (["--resume=auto"], "auto"),
    ],
)
def test_resume_alone_means_yes_as_before_and_takes_auto(flags, resume):
    """`--resume` alone and `--no-resume`, from before it took `auto`, keep their meaning (tyro alone refuses
    `--resume` without a value)."""
    from lm_human_preference_details import cli, train_policy, train_reward

    for stage in (train_policy, train_reward):
        args = cli.parse(stage.Args, stage.defaults_for_task, default_task="tiny", argv=flags)
        assert args.resume == resume, (stage.__name__, args.resume)
    if resume != "auto":  # GRPO's `--resume` is a plain flag still
        from lm_human_preference_details.grpo.config import GRPOArgs, get_preset

        assert cli.parse(GRPOArgs, get_preset, "tiny", argv=flags).resume is resume


def test_a_preempted_stage_prints_its_line_and_exits_with_the_preempted_status(capsys):
    from lm_human_preference_details import cli, preemption

    @cli.main_with_user_errors
    def preempted():
        raise preemption.stopped(8, 30, "update", "SIGTERM")

    with pytest.raises(SystemExit) as exit_info:
        preempted()
    assert exit_info.value.code == cli.PREEMPTED == 75
    assert capsys.readouterr().err == "stopped at update 8 of 30 on SIGTERM: rerun with --resume\n"


LISTEN_THEN_SPIN = """
import sys, time
from lm_human_preference_details import preemption

with preemption.listening() as stop:
    print("listening", flush=True)
    while not stop.received:
        time.sleep(0.01)
    print(f"received {stop.received}", flush=True)
    time.sleep(60)  # a second signal ends it before this does
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_the_first_signal_asks_to_stop_and_the_second_ends_the_process(tmp_path, signum):
    from lm_human_preference_details import preemption

    script = tmp_path / "listen.py"
    script.write_text(LISTEN_THEN_SPIN)
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "listening\n"
    process.send_signal(signum)
    assert process.stdout.readline() == f"received {int(signum)}\n"  # alive: it only took note
    signalled_at = time.monotonic()
    process.send_signal(signum)  # the same request again, as a launcher forwards it to a rank that had it
    time.sleep(0.2)
    assert process.poll() is None
    time.sleep(max(0.0, signalled_at + preemption.SAME_REQUEST_S - time.monotonic()))
    process.send_signal(signum)
    process.wait(timeout=30)
    assert process.returncode == -signum  # as the signal ends a process without handlers
    err = process.stderr.read()
    assert f"{signum.name} again: exiting now, without a checkpoint" in err, err


def test_listening_puts_the_previous_handlers_back():
    from lm_human_preference_details import preemption

    before = {signum: signal.getsignal(signum) for signum in preemption.SIGNALS}
    with preemption.listening() as outer, preemption.listening() as inner:
        assert inner is outer  # stage 1 inside stage 2 shares its handlers
        assert signal.getsignal(signal.SIGTERM) == outer._handle
    assert {signum: signal.getsignal(signum) for signum in preemption.SIGNALS} == before


# rank 1 alone receives the signal, between two questions that both ranks ask
AGREE_ON_A_SIGNAL_ONE_RANK_RECEIVED = """
import os, signal
from lm_human_preference_details import cli, preemption, sharding

@cli.main_with_user_errors
def main():
    accelerator = sharding.make_accelerator()
    with preemption.listening() as stop:
        before = stop.agreed(accelerator)
        if accelerator.process_index == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        after = stop.agreed(accelerator)
    # one write of the whole line: print's two (text, then newline) can interleave with the other rank's
    os.write(1, f"rank {accelerator.process_index}: {before} then {after}\\n".encode())

main()
cli.exit_finished_rank()
"""


def test_every_rank_stops_on_a_signal_that_only_one_received(tmp_path):
    """torch's launcher forwards its signal to the ranks one after another and Slurm's may reach only some: every
    rank must stop after the same update, or the others would wait in the next update's collectives for good."""
    script = tmp_path / "agree.py"
    script.write_text(AGREE_ON_A_SIGNAL_ONE_RANK_RECEIVED)
    result = subprocess.run([*accelerate_two_processes(), str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-5000:]
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
    assert lines == ["rank 0: None then SIGUSR1", "rank 1: None then SIGUSR1"], result.stdout[-3000:]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="lists native threads through Linux's /proc")
def test_a_finished_two_process_run_leaves_no_gloo_thread_to_the_interpreter_teardown(tmp_path):
    """gloo threads alive in the teardown can abort a finished run (SIGABRT) once in many runs; none may be left."""
    script = tmp_path / "ddp_step.py"
    script.write_text(DDP_STEP_THEN_LIST_THREADS)
    result = subprocess.run(
        [*accelerate_two_processes(), str(script), str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-5000:]
    for rank in (0, 1):
        threads = json.loads((tmp_path / f"threads{rank}.json").read_text())
        assert not [name for name in threads if "gloo" in name], (rank, threads)


QUIET_THEN_REPORT = """
import sys
from lm_human_preference_details import cli

if sys.argv[1] == "after":
    import transformers
cli.quiet_transformers()
imported_for_it = "transformers" in sys.modules
import transformers

print(imported_for_it, transformers.utils.logging.get_verbosity(), transformers.utils.logging.is_progress_bar_enabled())
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_quiet_transformers_works_before_and_after_transformers_is_imported_and_imports_nothing(when):
    env = {k: v for k, v in os.environ.items() if k not in ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS")}
    out = subprocess.run(
        [sys.executable, "-c", QUIET_THEN_REPORT, when], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.split() == [str(when == "after"), str(logging.ERROR), "False"]


@pytest.mark.parametrize(
    "module, purpose, flag",
    [
        ("quickstart", "The whole OAI pipeline in miniature", "--ppo.total-episodes"),
        ("grpo.trainer", "The GRPO trainer: reads groups from the stream", "--sync-steps"),
        ("grpo.actor", "The actor: keeps the inference servers busy", "--sync-steps"),
    ],
)
def test_a_script_that_takes_another_stages_flags_describes_itself_in_help(monkeypatch, capsys, module, purpose, flag):
    """quickstart takes train_policy's flags and the GRPO roles the launcher's: --help still says what the script
    does."""
    import importlib

    script = importlib.import_module(f"lm_human_preference_details.{module}")
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        script.main()
    help_text = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert purpose in help_text and "Stage 2" not in help_text and "trained the PipelineRL way" not in help_text
    assert flag in help_text


@pytest.mark.parametrize(
    "module, default_task",
    [
        ("train_policy", "sentiment"),
        ("train_reward", "sentiment"),
        ("make_labels", "sentiment"),
        ("quickstart", "sentiment-smollm2"),
    ],
)
def test_help_shows_the_command_as_typed_and_the_task_presets(monkeypatch, capsys, module, default_task):
    """`python -m lm_human_preference_details.X --help` names that command (argparse would show the script's
    absolute path, which `python -m` puts in argv[0]) and lists the names `--task` takes, with its default."""
    import importlib

    from lm_human_preference_details.tasks import PRESETS

    script = importlib.import_module(f"lm_human_preference_details.{module}")
    monkeypatch.setattr(sys, "argv", [script.__file__, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        script.main()
    help_text = " ".join(capsys.readouterr().out.split())  # as one line, however the terminal wraps it
    assert exit_info.value.code == 0
    assert help_text.startswith(f"usage: python -m lm_human_preference_details.{module} [-h]")
    assert script.__file__ not in help_text
    assert f"--task {{{','.join(PRESETS)}}}` (default: {default_task})" in help_text
    assert "{sentiment,descriptiveness,tldr,tiny,sentiment-smollm2}" in help_text
