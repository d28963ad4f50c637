"""Stage 3 as two nodes on 127.0.0.1: two launchers that meet through node 0's TCPStore, node 1 serving on its two
CPU slots, node 0 training on its two as FSDP2 processes, the stream in the module's one Redis."""

import os
import re
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


def test_the_example_learns_over_two_nodes_resumes_and_leaves_no_process(tmp_path, redis_url):
    output_dir, stream = tmp_path / "run", with_stream(redis_url, "two-nodes")
    first, seen = run_example(output_dir, stream, "--save-interval", "50")
    assert first.returncode == 0, first.stdout[-4000:]
    summary = SUMMARY.fullmatch(first.stdout.strip().splitlines()[-1])
    assert summary, first.stdout[-2000:]
    before, after = success_rise(metrics(output_dir))
    assert after - before > 0.1, (before, after)  # the launchers' own tests use the same bar
    assert float(summary[1]) < float(summary[2])
    assert not left_running(seen)

    resumed, seen = run_example(output_dir, stream, "--resume", "--steps", "110")
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert [row["step"] for row in metrics(output_dir)] == list(range(1, 111))
    assert SUMMARY.fullmatch(resumed.stdout.strip().splitlines()[-1]), resumed.stdout[-2000:]
    assert not left_running(seen)


def test_killing_node_1s_launcher_ends_node_0_within_30_s_naming_node_1(tmp_path, redis_url):
    output_dir = tmp_path / "run"
    flags = [
        *("--task", "tiny", "--steps", "1000", "--wandb-mode", "disabled", "--device", "cpu", "--gpus-per-node", "2"),
        *("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--inference-gpus", "2"),
        *("--stream", with_stream(redis_url, "two-nodes-killed")),
    ]
    node_0 = Launched(output_dir, *flags, "--node-rank", "0", log_path=str(tmp_path / "node-0.log"))
    node_1 = Launched(output_dir, *flags, "--node-rank", "1", log_path=str(tmp_path / "node-1.log"))

    def training_with_node_1_watched() -> bool:
        node_1.seen.update({pid: c for pid, c in descendants(node_1.process.pid).items() if c})
        return len(metrics(output_dir)) >= 3

    node_0.watch_until(training_with_node_1_watched)
    node_1.process.kill()  # the launcher alone: its servers end with it, and node 0 must notice
    killed = time.monotonic()
    assert node_0.finish(timeout_s=60) == 1
    assert time.monotonic() - killed < 30
    assert "error: node 1 (servers 0-1) fell silent" in node_0.output().strip().splitlines()[-1], node_0.output()
    assert not node_0.leftovers() and not node_1.leftovers()
