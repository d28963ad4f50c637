"""The reasoning quickstart's code path on the tiny preset: a real pipelined GRPO run that evaluates held-out problems
as it trains, a PNG, the answers at the first and last evaluation printed."""

import json
import re
import sys

import pytest

from lm_human_preference_details.cli import UserError
from lm_human_preference_details.grpo import quickstart
from lm_human_preference_details.grpo.config import get_preset
from lm_human_preference_details.grpo.rewards import problem_family
from tests.conftest import LOG_SILENCE_LIMIT_S, run_into_log


def test_the_quickstart_says_which_engine_serves_and_why(monkeypatch):
    args = get_preset("arith-chat")
    monkeypatch.setattr(type(args.serving), "server_engine", lambda self: "home")  # what `auto` gives without a GPU
    assert "vLLM is taken where a GPU is visible" in quickstart.engine_choice(args)
    args.serving.engine = "home"
    assert quickstart.engine_choice(args) == "the home engine (grpo/serving/server.py), as --engine says"
    monkeypatch.setattr(type(args.serving), "server_engine", lambda self: "vllm")
    assert quickstart.engine_choice(args).startswith("vLLM")
    args.serving.servers = ["http://10.0.0.1:8000"]
    assert quickstart.engine_choice(args) == "the servers at http://10.0.0.1:8000, as --servers says"


def test_the_worked_example_comes_before_the_problem_in_the_chat():
    args = get_preset("arith-chat")
    question, answer = args.task.chat_example
    assert args.task.chat_messages("What is 3+4?") == [
        {"role": "user", "content": question},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "What is 3+4?"},
    ]
    assert not any(question == p.prompt for p in problem_family(args))  # the example is none of the task's problems
    args.task.chat_example = []
    assert args.task.chat_messages("What is 3+4?") == [{"role": "user", "content": "What is 3+4?"}]
    args.task.chat_example = ["only a question"]
    with pytest.raises(UserError, match="--chat-example: give two texts"):
        args.check()
    args.task.chat_example, args.task.chat = ["Q", "A"], False
    with pytest.raises(UserError, match="without --chat"):
        args.check()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--resume"], "--resume: the quickstart starts over"),
        (["--eval-every", "0"], "--eval-every 0: the quickstart's held-out success comes from the run's evaluations"),
        (["--problems", "gsm8k"], "--problems gsm8k: a fixed set.*--problems arith or tiny-sums"),
        (["--arith-digits", "3"], "--arith-digits 3: its 2,430,000 problems are too many"),
        (
            ["--task", "tiny", "--eval-every", "5", "--num-problems", "0"],
            "--num-problems 0: the training stream shows all 25 problems.*below 25",
        ),
        (["--batch-size", "30"], "--batch-size 30 must be a multiple of --group-size 8"),
    ],
)
def test_the_quickstart_refuses_what_it_cannot_do_before_any_model_loads(monkeypatch, capsys, tmp_path, flags, message):
    monkeypatch.setattr(sys, "argv", ["quickstart", *flags, "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as exit:
        quickstart.main()
    printed = capsys.readouterr()
    assert exit.value.code == 2 and "held out:" not in printed.out
    assert re.search(message, printed.err), printed.err[-2000:]


def test_evaluations_are_drawn_at_the_step_whose_weights_they_measured(tmp_path):
    """An evaluation arrives a few steps after its step: its line is logged then, and drawn at `eval/step`."""
    from PIL import Image

    from lm_human_preference_details.tracking import metric_step, plot_curves

    lines = [{"step": s, "success/rate": s / 10} for s in range(1, 11)]
    lines.insert(3, {"step": 3, "eval/step": 0.0, "eval/pass@1": 0.1})
    lines.append({"step": 10, "eval/step": 10.0, "eval/pass@1": 0.9})
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert [metric_step(line, "eval/pass@1") for line in lines if "eval/step" in line] == [0, 10]
    assert metric_step(lines[0], "success/rate") == 1
    plain, marked = tmp_path / "plain.png", tmp_path / "marked.png"
    plot_curves(str(metrics), {"success rate": ["success/rate"]}, str(plain), title="t")
    plot_curves(str(metrics), {"success rate": ["success/rate", "eval/pass@1"]}, str(marked), title="t")
    assert Image.open(plain).tobytes() != Image.open(marked).tobytes()


@pytest.mark.slow
def test_the_quickstart_runs_end_to_end_on_the_tiny_preset(tmp_path):
    out = tmp_path / "run"
    printed, longest_silence_s = run_into_log(
        [
            sys.executable,
            "-m",
            "lm_human_preference_details.grpo.quickstart",
            "--task",
            "tiny",
            "--eval-every",
            "10",
            "--steps",
            "30",
            "--output-dir",
            str(out),
            "--wandb-mode",
            "disabled",
        ],
    )
    assert longest_silence_s < LOG_SILENCE_LIMIT_S, printed  # its output in a log file: never a minute silent
    assert "held out: 5 problems the training stream never shows" in printed
    assert "=== held-out problems at step 0 and step 30 ===" in printed
    assert printed.count("  step 0: ") == 5 and printed.count("  step 30: ") == 5
    assert re.search(r"held-out pass@1: (\d\.\d+ -> ){3}\d\.\d+\n", printed), printed
    assert "success on the training stream" in printed
    assert "servers: " in printed and "trainer: " in printed  # the engine and precision it chose, and why
    held_out = [json.loads(line) for line in (out / "held_out.jsonl").open()]
    assert len(held_out) == 5 and {"before", "after", "reward_before", "reward_after"} <= set(held_out[0])
    png = out / "learning_curves.png"
    assert png.stat().st_size > 10_000
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [r["step"] for r in rows if "reward/mean" in r] == list(range(1, 31))
    assert [r["eval/step"] for r in rows if "eval/step" in r] == [0, 10, 20, 30]
