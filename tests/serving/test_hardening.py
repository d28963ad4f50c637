"""The GRPO server against the official OpenAI SDK and against hostile clients (issue 22): a 400 naming every field it
would otherwise ignore; bad text, deep JSON, a huge prompt and a rendezvous that never comes answered without a 500 or
a hang, and a stop that waits for none of them; the control token; and a fuzz loop, against the home engine's server
as a real process over real HTTP. What both engines must do alike (the SDK's streaming, stop strings, top logprobs and
models; a rendezvous that never comes; a failed update rolled back; a client that hangs up) is tested against both in
tests/serving/test_contract.py."""

import collections
import concurrent.futures
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from lm_human_preference_details.grpo.client import ServerError, ServerProcess, request_json
from lm_human_preference_details.grpo.protocol import TOKEN_ENV
from tests.conftest import post_raw, save_tiny_math_with_chat_template
from tests.serving.test_contract import check_a_rendezvous_that_never_comes_is_a_clear_error, sdk

HOME_SERVER = [sys.executable, "-m", "lm_human_preference_details.grpo.serving.server"]


def start_home_server(model_dir: str, log_path, *flags: str, env: dict | None = None) -> ServerProcess:
    with open(log_path, "wb") as log:  # the child keeps its own handle
        return ServerProcess(["--model", model_dir, "--threads", "1", "--max-batch-size", "8", *flags], log, env)


def stop(server: ServerProcess) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


@pytest.fixture(scope="module")
def home(model_dir, tmp_path_factory):
    server = start_home_server(model_dir, tmp_path_factory.mktemp("logs") / "home.log")
    try:
        url = server.wait_until_serving()
        yield url, server.process.pid
    finally:
        stop(server)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_math_with_chat_template(str(tmp_path_factory.mktemp("tiny-math-chat")))


# -- the OpenAI SDK ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_p", 0.5),
        ("seed", 1),
        ("best_of", 2),
        ("echo", True),
        ("suffix", "x"),
        ("frequency_penalty", 0.5),
        ("logit_bias", {"1": 5}),
        ("response_format", {"type": "json_object"}),
        ("tools", []),
    ],
)
def test_a_parameter_the_server_would_ignore_is_a_400_naming_it(home, model_dir, field, value):
    client = sdk(home[0])
    with pytest.raises(openai.BadRequestError, match=repr(field)):
        client.completions.create(model=model_dir, prompt="1+1=", max_tokens=2, extra_body={field: value})
    with pytest.raises(openai.BadRequestError, match=repr(field)):
        client.chat.completions.create(
            model=model_dir, messages=[{"role": "user", "content": "1"}], max_tokens=2, extra_body={field: value}
        )


def test_neutral_values_max_completion_tokens_and_the_model_name_are_checked(home, model_dir):
    client = sdk(home[0])
    reply = client.completions.create(
        model=model_dir, prompt="1+1=", top_p=1, echo=False, best_of=1, extra_body={"max_completion_tokens": 3}
    )
    assert len(reply.choices[0].model_extra["token_ids"]) <= 3
    chat = client.chat.completions.create(
        model=model_dir,
        messages=[{"role": "user", "content": "1"}],
        max_completion_tokens=2,
        extra_body={"ignore_eos": True},
    )
    assert len(chat.choices[0].model_extra["token_ids"]) == 2 and chat.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="'model'"):
        client.completions.create(model="gpt-4", prompt="1+1=", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens"):
        client.completions.create(model=model_dir, prompt="1", max_tokens=2, extra_body={"max_completion_tokens": 3})
    with pytest.raises(openai.BadRequestError, match="'stop'"):
        client.completions.create(model=model_dir, prompt="1", max_tokens=2, stop=["1", "2", "3", "4", "5"])


# -- no 500s, no hangs -------------------------------------------------------------------------------------------


def test_bad_text_and_deep_json_are_400s(home):
    url = home[0]
    for endpoint, body in [
        ("/v1/completions", b'{"prompt": "1+\\ud800", "max_tokens": 2}'),
        ("/v1/completions", b'{"prompt": "1+1=", "stop": "\\udfff"}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ]:
        status, reply = post_raw(url + endpoint, body)
        assert status == 400 and "not valid Unicode" in reply["error"]["message"], reply
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for endpoint in ("/v1/completions", "/v1/chat/completions", "/init_process_group", "/request_weight_update"):
        status, reply = post_raw(url + endpoint, deep)
        assert status == 400 and "nested too deeply" in reply["error"]["message"], (endpoint, reply)
    assert request_json("GET", f"{url}/health")["status"] == "ok"


def test_a_huge_prompt_is_tokenized_while_health_answers(home):
    """4 MB of prompt takes seconds to tokenize: off the event loop, /health answers meanwhile."""
    url = home[0]
    big = json.dumps({"prompt": "1+2=3 " * (4 * 2**20 // 6), "max_tokens": 1}).encode()
    answer: list = []
    sender = threading.Thread(target=lambda: answer.append(post_raw(f"{url}/v1/completions", big, timeout_s=300)))
    sender.start()
    waits = []
    while sender.is_alive():
        start = time.monotonic()
        request_json("GET", f"{url}/health", timeout_s=120)
        waits.append(time.monotonic() - start)
        time.sleep(0.05)
    sender.join()
    status, reply = answer[0]
    assert status == 400 and "positions" in reply["error"]["message"]
    assert len(waits) >= 3 and max(waits) < 3, waits  # on the event loop, one /health waited for the whole tokenizing


def test_a_rendezvous_that_never_comes_is_a_clear_error_and_does_not_hold_up_shutdown(model_dir, tmp_path):
    server = start_home_server(model_dir, tmp_path / "server.log")
    try:
        url = server.wait_until_serving()
        body = check_a_rendezvous_that_never_comes_is_a_clear_error(url)

        # a join that waits (its default 300 s), a long completion and a long-poll: SIGTERM still stops the server
        long_completion = {"prompt": ["1+2="] * 64, "n": 8, "max_tokens": 240, "ignore_eos": True}
        pending = [
            lambda: post_raw(f"{url}/init_process_group", json.dumps({**body, "timeout_s": 300}).encode(), 400),
            lambda: post_raw(f"{url}/v1/completions", json.dumps(long_completion).encode(), 400),
            lambda: request_json("GET", f"{url}/health?wait_for_version=99&timeout_s=60", timeout_s=400),
        ]

        def wait_for(call) -> None:
            with contextlib.suppress(OSError, ServerError):  # the server hangs up when it stops
                call()

        for call in pending:
            threading.Thread(target=wait_for, args=(call,), daemon=True).start()
        time.sleep(2)
        start = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=60)
        assert time.monotonic() - start < 20
    finally:
        stop(server)


# -- the control token -------------------------------------------------------------------------------------------


def test_control_endpoints_require_the_token_the_launcher_gives(model_dir, tmp_path, monkeypatch):
    from lm_human_preference_details.grpo import config, launch, nodes

    monkeypatch.setenv(TOKEN_ENV, "")  # recorded, so that the launcher's token is gone again after the test
    monkeypatch.delenv(TOKEN_ENV)
    refused = subprocess.run(
        [*HOME_SERVER, "--model", model_dir, "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0 and "--host 0.0.0.0 listens beyond loopback" in refused.stderr
    assert TOKEN_ENV in refused.stderr and "--token-file" in refused.stderr

    args = config.get_preset("tiny")
    args.output_dir = str(tmp_path / "run")
    launch.Run(args, nodes.plan_node(args))
    token = os.environ[TOKEN_ENV]  # set by the launcher's Run for the servers and the trainer it starts
    assert len(token) >= 32
    server = start_home_server(model_dir, tmp_path / "server.log")  # inherits it, as the launcher's servers do
    try:
        url = server.wait_until_serving()
        body = json.dumps({"init_method": "tcp://10.1.2.3:5", "rank": 1, "world_size": 2}).encode()
        status, reply = post_raw(f"{url}/init_process_group", body)
        assert status == 401 and "token" in reply["error"]["message"]
        status, reply = post_raw(f"{url}/request_weight_update", b'{"version": 1, "parameters": []}')
        assert status == 401
        with pytest.raises(ServerError, match="outside the addresses"):  # let in: request_json sends the token
            request_json("POST", f"{url}/init_process_group", json.loads(body))
        assert request_json("GET", f"{url}/health")["status"] == "ok"  # the other endpoints take no token
    finally:
        stop(server)


# -- fuzz ----------------------------------------------------------------------------------------------------------

ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/init_process_group", "/request_weight_update"]
FIELDS = [
    *("prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "n", "stop", "stop_token_ids"),
    *("ignore_eos", "logprobs", "top_logprobs", "stream", "stream_options", "model", "top_p", "echo", "seed"),
    *("init_method", "rank", "world_size", "backend", "timeout_s", "version", "parameters", "bucket_bytes"),
]


def hostile_value(rng: random.Random, depth: int = 0):
    """A JSON value of a random type and size: wrong types, extremes, odd text, nesting."""
    kind = rng.randrange(12 if depth < 3 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([-1, 0, 1, 2, 3, 2**31, 2**64, -(2**63), 10**30])
    if kind == 3:
        return rng.choice([0.0, -0.5, 1e-300, 1e308, 0.5, 2.0, float("nan"), float("inf")])
    if kind == 4:
        return rng.choice(["", "1+1=", "\ud800", "\x00", "\u202e\ufeff", "😀" * 50, "tcp://127.0.0.1:1", "gloo"])
    if kind == 5:
        return "7" * rng.choice([1, 1000, 300_000])
    if kind == 6:
        return [rng.randrange(-5, 100) for _ in range(rng.choice([1, 5, 300]))]
    if kind == 7:
        return {"role": "user", "content": rng.choice(["1", "\ud800", 5])}
    if kind in (8, 9):
        return [hostile_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(FIELDS + ["", "\ud800"]): hostile_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def hostile_body(rng: random.Random) -> bytes:
    kind = rng.randrange(10)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 100, 10_000])))  # not UTF-8, not JSON
    if kind == 1:
        return b'{"prompt": "1+1=", "max_tokens": 2'  # cut short
    if kind == 2:
        depth = rng.choice([100, 5_000, 200_000])
        return b'{"prompt": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}"
    if kind == 3:
        return json.dumps(hostile_value(rng)).encode()  # maybe not an object
    body = {rng.choice(FIELDS): hostile_value(rng) for _ in range(rng.randrange(1, 6))}
    if kind < 7:  # mostly a valid request with one field gone wrong: the checks past the first
        body = {"prompt": "1+1=", "messages": [{"role": "user", "content": "1"}], "max_tokens": 2, **body}
    return json.dumps(body).encode()


def raw_exchange(url: str, data: bytes, hang_up: bool) -> int | None:
    """`data` sent as it is on a new connection; the reply's status (None when it hangs up first, or none came)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=120) as connection:
        connection.sendall(data)
        if hang_up:
            return None
        connection.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := connection.recv(65536):
            reply += chunk
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else None


def hostile_request(url: str, seed: int) -> int | None:
    rng = random.Random(seed)
    kind = rng.randrange(10)
    if kind == 0:  # the HTTP itself: a lie about the length, a bad method, a bad path, a header flood, a hang-up
        payload = rng.choice(
            [
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",
                b"BREW /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n",
                b"GET /../../etc/passwd HTTP/1.1\r\nHost: x\r\n\r\n",
                b"GET /health HTTP/1.1\r\n" + b"X-A: b\r\n" * 2000 + b"\r\n",
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS hello
            ]
        )
        return raw_exchange(url, payload, hang_up=rng.random() < 0.3)
    if kind == 1:
        query = rng.choice(
            ["wait_for_version=x", "wait_for_version=1&timeout_s=nan", "wait_for_version=99&timeout_s=0.2"]
        )
        return raw_exchange(url, f"GET /health?{query} HTTP/1.1\r\nHost: x\r\n\r\n".encode(), hang_up=False)
    if kind == 2:  # a real request whose client is gone before the reply
        body = json.dumps({"prompt": ["1+2="] * 4, "n": 8, "max_tokens": 50, "ignore_eos": True}).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        return raw_exchange(url, head + body, hang_up=True)
    status, _ = post_raw_status(url + rng.choice(ENDPOINTS), hostile_body(rng))
    return status


def post_raw_status(url: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_a_fuzz_of_hostile_requests_leaves_the_server_serving_without_growing(home, model_dir):
    url, pid = home
    rounds, per_round = 3, 150
    sizes = []
    statuses = collections.Counter()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for r in range(rounds):
            for status in pool.map(hostile_request, [url] * per_round, range(r * per_round, (r + 1) * per_round)):
                statuses[status] += 1
            sizes.append(rss_mb(pid))
    assert not [s for s in statuses if s is not None and s >= 500], statuses
    assert statuses[400] > per_round  # mostly refused by the checks, not lost earlier
    reply = sdk(url).completions.create(model=model_dir, prompt="1+1=", max_tokens=3)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert request_json("GET", f"{url}/health")["status"] == "ok"
    # the first round's peak (buffers, caches) may stay; the rounds after it add nothing that lasts
    assert sizes[-1] - sizes[0] < 100, sizes


def test_a_servers_control_access_comes_from_its_token_file_or_the_environment(tmp_path, monkeypatch):
    from lm_human_preference_details.grpo.serving.control import ControlAccess

    monkeypatch.setenv(TOKEN_ENV, "from-the-environment")
    assert ControlAccess.for_server("0.0.0.0", "", []).token == "from-the-environment"
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file\n")
    beyond = ControlAccess.for_server("0.0.0.0", str(token_file), ["10.0.0.0/8", "192.168.1.7"])
    assert beyond.token == "from-the-file" and [str(n) for n in beyond.rendezvous_networks] == [
        "10.0.0.0/8",
        "192.168.1.7/32",
    ]
    assert ControlAccess.for_server("0.0.0.0", str(token_file), []).rendezvous_networks == ()  # any: the token guards
    assert [str(n) for n in ControlAccess.for_server("localhost", "", []).rendezvous_networks] == [
        "127.0.0.0/8",
        "::1/128",
    ]
    monkeypatch.delenv(TOKEN_ENV)
    for host, file, allow, said in [
        ("0.0.0.0", "", [], "listens beyond loopback"),
        ("127.0.0.1", str(tmp_path / "missing"), [], "cannot read it"),
        ("127.0.0.1", str(tmp_path / "empty"), [], "is empty"),
        ("127.0.0.1", "", ["10.0.0.300"], "--rendezvous-allow"),
    ]:
        (tmp_path / "empty").write_text("")
        with pytest.raises(SystemExit, match=said):
            ControlAccess.for_server(host, file, allow)


def test_a_join_leaves_room_for_every_rank_of_the_server():
    """A server of two workers joins at ranks 1 and 2: a group of two (a trainer before `weight_ranks`) is refused."""
    from lm_human_preference_details.grpo.serving.control import JoinRequest
    from lm_human_preference_details.grpo.serving.request_checks import BadRequest

    body = {"init_method": "tcp://127.0.0.1:5", "rank": 1, "world_size": 2}
    assert JoinRequest.from_body(body).world_size == 2
    with pytest.raises(BadRequest, match="joins with 2 ranks: /health's weight_ranks"):
        JoinRequest.from_body(body, ranks=2)
    assert JoinRequest.from_body({**body, "world_size": 3}, ranks=2).rank == 1
