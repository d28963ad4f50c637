"""The reasoning quickstart's code path on the tiny preset: held-out problems answered before and after a real
pipelined GRPO run, a PNG, the answers printed."""

import io
import json
import re
import subprocess
import sys

import pytest

from lm_human_preference_details.cli import UserError
from lm_human_preference_details.grpo import quickstart
from lm_human_preference_details.grpo.config import get_preset
from lm_human_preference_details.grpo.rewards import Problem, held_out_problems, problem_family


def test_held_out_answering_logs_its_progress_where_stderr_is_not_a_terminal(monkeypatch):
    """Answering 100 problems takes minutes before and after training: a log file gets lines saying how far it is
    (answered here by the untrained `tiny` model, built in a second where `tiny-math` trains for minutes)."""
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    args = get_preset("tiny")
    problems = held_out_problems(args)[:2]
    assert len(quickstart.answers("tiny", args, problems, seed=0)) == 2  # a model built in a second
    lines = [line for line in stderr.getvalue().splitlines() if line.startswith("held-out answers")]
    assert lines[0] == "held-out answers: 0/2 (0%), ?problem/s, 00:00 elapsed, ? left", lines
    assert lines[-1].startswith("held-out answers: 2/2 (100%), "), lines


def test_integer_answers_score_a_boxed_expression_zero():
    """math_verify evaluates `\\boxed{6-1}` to 5: a policy learns to box the question. With integer answers only a
    boxed integer counts."""
    problem = [Problem(prompt="What is 6-1?", answer="5", id="arith-6-1")]
    args = get_preset("arith-chat")
    assert quickstart.success(args, problem, ["6-1 is \\boxed{6-1}"]) == [0.0]
    assert quickstart.success(args, problem, ["6 - 1 = \\boxed{5}"]) == [1.0]
    args.task.integer_answers = False
    assert quickstart.success(args, problem, ["6-1 is \\boxed{6-1}"]) == [1.0]


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
        (["--save-interval", "0"], "--save-interval 0: the held-out answers after training come from the last"),
        (["--ignore-eos"], "--ignore-eos: the held-out answers stop at EOS"),
        (["--problems", "gsm8k"], "--problems gsm8k: a fixed set.*--problems arith or tiny-sums"),
        (["--arith-digits", "3"], "--arith-digits 3: its 2,430,000 problems are too many"),
        (
            ["--task", "tiny", "--num-problems", "0"],
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


def test_held_out_points_are_drawn_on_their_panel(tmp_path):
    from PIL import Image

    from lm_human_preference_details.tracking import plot_curves

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "success/rate": s / 10}) + "\n" for s in range(1, 11)))
    plain, marked = tmp_path / "plain.png", tmp_path / "marked.png"
    plot_curves(str(metrics), {"success rate": ["success/rate"]}, str(plain), title="t")
    points = {"success rate": {"held out": [(0, 0.0), (10, 0.9)]}}
    plot_curves(str(metrics), {"success rate": ["success/rate"]}, str(marked), title="t", points=points)
    assert Image.open(plain).tobytes() != Image.open(marked).tobytes()


@pytest.mark.slow
def test_the_quickstart_runs_end_to_end_on_the_tiny_preset(tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_human_preference_details.grpo.quickstart",
            "--task",
            "tiny",
            "--num-problems",
            "20",
            "--steps",
            "30",
            "--output-dir",
            str(out),
            "--wandb-mode",
            "disabled",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    printed = result.stdout
    assert "held-out success before training:" in printed
    assert "=== held-out problems, before and after training ===" in printed
    assert printed.count("  before: ") == 5 and printed.count("  after:  ") == 5
    assert "held out: " in printed and "success on the training stream" in printed
    assert "servers: " in printed and "trainer: " in printed  # the engine and precision it chose, and why
    held_out = [json.loads(line) for line in (out / "held_out.jsonl").open()]
    assert len(held_out) == 5 and {"before", "after", "reward_before", "reward_after"} <= set(held_out[0])
    png = out / "learning_curves.png"
    assert png.stat().st_size > 10_000
    assert len([json.loads(line) for line in (out / "metrics.jsonl").open()]) == 30
