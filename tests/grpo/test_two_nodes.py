"""Stage 3 as two nodes on 127.0.0.1: two launchers that meet through node 0's TCPStore, node 1 serving on its two
CPU slots, node 0 training on its two as FSDP2 processes, the stream in the module's one Redis. A signal to both
launchers (as Slurm preempts a job) or to one stops every node at one step with a checkpoint, and the run resumes."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, alive, descendants, free_port, with_stream
from tests.grpo.test_launch import Launched, metrics, no_launcher_left_behind, success_rise  # noqa: F401

pytestmark = pytest.mark.slow

EXAMPLE = os.path.join(REPO, "examples", "grpo_two_nodes_localhost.sh")
SUMMARY = re.compile(
    r"reward/mean (\d\.\d+) -> (\d\.\d+) \(first fifth -> last fifth\), lag (\d\.\d+), nodes 2, servers 2, "
    r"trainer processes 2"
)


def run_example(output_dir, stream: str, *flags) -> tuple[subprocess.CompletedProcess, dict[int, str]]:
    """The example script to its end, and every process it started on the way (pid: command line)."""
    env = {**os.environ, "STREAM": stream, "PYTHON": sys.executable}
    script = subprocess.Popen(
        ["bash", EXAMPLE, str(output_dir), "--wandb-mode", "disabled", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    seen: dict[int, str] = {}
    deadline = time.monotonic() + 600
    while script.poll() is None and time.monotonic() < deadline:
        seen.update({pid: command for pid, command in descendants(script.pid).items() if command})
        time.sleep(0.2)
    if script.poll() is None:
        script.kill()
    output, _ = script.communicate()
    return subprocess.CompletedProcess(script.args, script.returncode, output), seen


def left_running(seen: dict[int, str], grace_s: float = 10.0) -> list[int]:
    """The processes seen that still run after a grace period (multiprocessing's helpers take a moment to end)."""
    deadline = time.monotonic() + grace_s
    while alive(seen) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(seen)


def launch_two_nodes(output_dir, stream: str, *flags: str, logs: str = "") -> tuple[Launched, Launched]:
    """Node 0's and node 1's launchers of the tiny preset, as the example starts them (`logs`: the beginning of their
    log files' names, beside the run folder)."""
    flags = (
        *("--task", "tiny", "--wandb-mode", "disabled", "--device", "cpu", "--gpus-per-node", "2"),
        *("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--inference-gpus", "2"),
        *("--stream", stream, *flags),
    )
    return tuple(
        Launched(output_dir, *flags, "--node-rank", str(rank), log_path=f"{output_dir}{logs}-node-{rank}.log")
        for rank in (0, 1)
    )


def watch_both_until(node_0: Launched, node_1: Launched, condition) -> None:
    def watched() -> bool:
        node_1.seen.update({pid: c for pid, c in descendants(node_1.process.pid).items() if c})
        return condition()

    node_0.watch_until(watched)


def assert_both_stopped_at_the_checkpoint(node_0: Launched, node_1: Launched, steps: int) -> int:
    """Both launchers exit 75 with node 0's line, the checkpoint is of the last step trained, no process is left;
    returns that step."""
    statuses = node_0.finish(timeout_s=60), node_1.finish(timeout_s=60)
    assert statuses == (75, 75), (node_0.output(), node_1.output())
    stopped_at = metrics(node_0.output_dir)[-1]["step"]
    line = f"stopped at step {stopped_at} of {steps} on SIGTERM: rerun with --resume"
    assert f"\n{line}\n" in node_0.output() and f"\n{line}\n" in node_1.output(), (node_0.output(), node_1.output())
    state = json.load(open(os.path.join(node_0.output_dir, "checkpoint", "state.json")))
    assert state["version"] == stopped_at
    assert not node_0.leftovers() and not node_1.leftovers()
    return stopped_at


def test_the_example_learns_over_two_nodes_resumes_and_leaves_no_process(tmp_path, redis_url):
    """It learns; then, resumed, the trainer processes wait for samples (the actor stopped), and SIGTERM to both
    launchers, as Slurm preempts a job, stops every node at one step with its checkpoint; resumed again (`--resume
    auto`, as a requeued job reruns its command) it runs to the end."""
    output_dir, stream = tmp_path / "run", with_stream(redis_url, "two-nodes")
    first, seen = run_example(output_dir, stream, "--save-interval", "50")
    assert first.returncode == 0, first.stdout[-4000:]
    summary = SUMMARY.fullmatch(first.stdout.strip().splitlines()[-1])
    assert summary, first.stdout[-2000:]
    before, after = success_rise(metrics(output_dir))
    assert after - before > 0.1, (before, after)  # the launchers' own tests use the same bar
    assert float(summary[1]) < float(summary[2])
    assert not left_running(seen)

    node_0, node_1 = launch_two_nodes(output_dir, stream, "--steps", "1000", "--resume", "auto", logs="-preempted")
    watch_both_until(node_0, node_1, lambda: len(metrics(output_dir)) >= 103)
    os.kill(int(re.search(r"actor \(pid (\d+)\)", node_0.output(tail=None))[1]), signal.SIGTERM)
    time.sleep(3)  # the samples already in the stream are trained on: then the trainer processes wait
    for node in (node_0, node_1):
        node.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    stopped_at = assert_both_stopped_at_the_checkpoint(node_0, node_1, steps=1000)
    assert time.monotonic() - signalled < 20, "waiting trainer processes stop without another step"

    resumed, seen = run_example(output_dir, stream, "--resume", "auto", "--steps", str(stopped_at + 10))
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert [row["step"] for row in metrics(output_dir)] == list(range(1, stopped_at + 11))
    assert SUMMARY.fullmatch(resumed.stdout.strip().splitlines()[-1]), resumed.stdout[-2000:]
    assert not left_running(seen)


def test_sigterm_to_node_1s_launcher_alone_stops_both_then_killing_it_ends_node_0_naming_node_1(tmp_path, redis_url):
    """A signal to one node's launcher stops the run on every node (the others hear it through the rendezvous).
    Killed instead, node 1 is a failure: node 0 ends within 30 s with a line naming it."""
    output_dir, stream = tmp_path / "run", with_stream(redis_url, "two-nodes-killed")
    node_0, node_1 = launch_two_nodes(output_dir, stream, "--steps", "1000", logs="-preempted")
    watch_both_until(node_0, node_1, lambda: len(metrics(output_dir)) >= 3)
    node_1.process.send_signal(signal.SIGTERM)
    stopped_at = assert_both_stopped_at_the_checkpoint(node_0, node_1, steps=1000)

    node_0, node_1 = launch_two_nodes(output_dir, stream, "--steps", "1000", "--resume", "auto", logs="-killed")
    watch_both_until(node_0, node_1, lambda: len(metrics(output_dir)) >= stopped_at + 3)
    node_1.process.kill()  # the launcher alone: its servers end with it, and node 0 must notice
    killed = time.monotonic()
    assert node_0.finish(timeout_s=60) == 1
    assert time.monotonic() - killed < 30
    assert "error: node 1 (servers 0-1) fell silent" in node_0.output().strip().splitlines()[-1], node_0.output()
    assert [row["step"] for row in metrics(output_dir)] == list(range(1, len(metrics(output_dir)) + 1))
    assert not node_0.leftovers() and not node_1.leftovers()
