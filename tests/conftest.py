"""Every test runs offline, with caches and logs in a temporary folder; a real redis-server for the stream tests."""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from urllib.parse import parse_qsl, urlencode, urlsplit

import pytest

_root = tempfile.mkdtemp(prefix="lmhpd-tests-")
os.environ.update(
    HF_HUB_OFFLINE="1",
    HF_DATASETS_OFFLINE="1",
    HF_HOME=os.path.join(_root, "hf"),
    WANDB_DIR=os.path.join(_root, "wandb"),
    WANDB_MODE="offline",
    WANDB_SILENT="true",
    MPLCONFIGDIR=os.path.join(_root, "matplotlib"),
    LMHPD_CACHE=os.path.join(_root, "assets"),
    TF_CPP_MIN_LOG_LEVEL="3",
    TOKENIZERS_PARALLELISM="false",
)
os.environ.pop("WANDB_API_KEY", None)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""the repository's root: tests in folders of their own reach its files from here"""

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"


def save_tiny_math_with_chat_template(path: str) -> str:
    """tiny-math saved to `path` with a chat template (the real tokenizer has none), for /v1/chat/completions."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lm_human_preference_details.assets import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny-math"))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-math")).save_pretrained(path)
    return path


def with_stream(url: str, name: str) -> str:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query)) | {"stream": name}
    return parts._replace(query=urlencode(query)).geturl()


def redis_client(url: str, decode_responses: bool = False):
    """A redis-py client for the server of a stream URL, to look at the stream behind the library's back."""
    import redis

    from lm_human_preference_details.grpo.streams import parse_stream_url

    where = parse_stream_url(url)
    return redis.Redis(host=where.host, port=where.port, db=where.db, decode_responses=decode_responses)


@pytest.fixture(autouse=True)
def seeded():
    """Every test starts from the same random state, whatever ran before it: a failure reproduces."""
    import random

    import numpy as np
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


def free_port() -> int:
    """A port nothing listens on now (the OS handed it out and it was closed again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command_line(pid: int) -> str:
    """The process's command line from /proc ("" once it is gone, or while it exits)."""
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except OSError:
        return ""


def descendants(pid: int) -> dict[int, str]:
    """Every live process below `pid`, with its command line (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = {}, list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found[child] = command_line(child)
        todo += children.get(child, [])
    return found


def alive(pids) -> list[int]:
    living = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    living.append(pid)
        except OSError:
            pass
    return living


def kill_with_descendants(process: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGKILL a launcher and every process below it, as a crash would, and wait until none of them runs: the ranks of
    `accelerate launch` run in sessions of their own (torch's elastic agent starts them so), out of reach of a signal
    to the launcher's process group, and would otherwise go on to the end of the run."""
    pids = [process.pid, *descendants(process.pid)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait(timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while alive(pids):
        assert time.monotonic() < deadline, f"still running after SIGKILL: {alive(pids)}"
        time.sleep(0.05)


def signal_once_logged(process: subprocess.Popen, metrics_path, step: int) -> tuple[int, dict[int, str]]:
    """SIGTERM to a stage's `process` once its metrics.jsonl (`metrics_path`) holds `step`; the last step logged then,
    and the processes below it (a launcher's ranks) as they were."""
    from lm_human_preference_details.tracking import read_metrics

    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        logged = [m["step"] for m in read_metrics(metrics_path)] if metrics_path.exists() else []
        if logged and logged[-1] >= step:
            below = descendants(process.pid)
            process.send_signal(signal.SIGTERM)
            return logged[-1], below
        time.sleep(0.02)
    raise AssertionError(f"the run ended before step {step} (status {process.poll()})")


LOG_SILENCE_LIMIT_S = 60.0
"""the longest a run's log file may go without a line: a cluster user takes a longer silence for a hang"""


def run_into_log(cmd: list[str], timeout_s: float = 600) -> tuple[str, float]:
    """`cmd` with stdout and stderr into one pipe, as a cluster job's log file gets them (not a terminal: progress bars
    print lines); its output, and the longest it went without a line (from its start to its end). AssertionError
    with the output's tail if it fails."""
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killer = threading.Timer(timeout_s, process.kill)  # a run that hangs silent ends too
    killer.start()
    lines, last, longest = [], time.monotonic(), 0.0
    for line in process.stdout:  # a line at a time: each stamped as it comes
        now = time.monotonic()
        longest, last = max(longest, now - last), now
        lines.append(line)
    status = process.wait()
    killer.cancel()
    longest = max(longest, time.monotonic() - last)
    output = "".join(lines)
    assert status == 0, f"exit status {status}:\n{output[-4000:]}"
    return output, longest


def accelerate_two_processes(config_file: str | None = None) -> tuple[str, ...]:
    """`accelerate launch` of two processes as a user runs it without a GPU (they train on the CPU over gloo): DDP,
    or the engine of an accelerate config (`config_file`, one of configs/accelerate/).

    On a free port: a run of the user's own on accelerate's default port (29500) would take the rendezvous.
    """
    engine = ("--config_file", config_file) if config_file else ("--multi_gpu",)
    return (
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *engine,
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--main_process_port",
        str(free_port()),
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    )


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """CI's server from LMHPD_REDIS_URL, else a redis-server of our own on a free port, stopped at the end."""
    redis = pytest.importorskip("redis")
    if "LMHPD_REDIS_URL" in os.environ:
        yield os.environ["LMHPD_REDIS_URL"]
        return
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH (apt-get install redis-server, or set LMHPD_REDIS_URL)")
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        cwd=tmp_path_factory.mktemp("redis"),
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis_client(url)
    try:
        for _ in range(500):
            try:
                # ours, not another redis-server that had the port: ours exits when it cannot bind
                assert client.info("server")["process_id"] == server.pid, f"port {port} is another Redis's"
                break
            except redis.ConnectionError:
                assert server.poll() is None, "redis-server exited at start"
                time.sleep(0.01)
        else:
            raise TimeoutError("redis-server did not answer PING within 5 s")
        yield url
    finally:
        client.close()
        server.terminate()
        server.wait(timeout=10)


def post_raw(url: str, body: bytes, timeout_s: float = 60) -> tuple[int, dict]:
    """POST `body` as it is (malformed JSON too) to a GRPO server; its status and JSON reply, errors included."""
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def tiny_reward_model(tmp_path_factory) -> str:
    """A reward model folder as train_reward.py saves one, on the tiny preset, untrained (a seeded head): the tests
    that take it check stage 2's mechanics, none of them what a trained reward model teaches."""
    import torch

    from lm_human_preference_details.models import RewardModel
    from lm_human_preference_details.text import load_tokenizer

    path = str(tmp_path_factory.mktemp("reward") / "reward_model")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        RewardModel.from_pretrained_lm("tiny").save(path)
    load_tokenizer("tiny").save_pretrained(path)
    return path
