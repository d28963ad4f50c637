"""The inference server as a real process over real HTTP, and the trainer's side of the weight
update over a real gloo process group: bitwise weights, in-flight sequences that span two weight
versions, refused updates that leave the old weights serving, bad requests that get a 4xx."""

import concurrent.futures
import json
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import post_raw, save_tiny_math_with_chat_template

from lm_human_preference_details.grpo.client import ServerError, ServerProcess, request_json
from lm_human_preference_details.grpo.protocol import ParameterSpec
from lm_human_preference_details.grpo.weights import (
    WeightSender,
    buckets,
    digest,
    flatten,
    parameter_specs,
    unflatten,
)
from lm_human_preference_details.models import load_causal_lm


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_math_with_chat_template(str(tmp_path_factory.mktemp("tiny-math-chat")))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with open(tmp_path_factory.mktemp("logs") / "server.log", "wb") as log:  # the child keeps its own handle
        server = ServerProcess(["--model", model_dir, "--threads", "1", "--max-batch-size", "8"], log)
    try:
        yield server.wait_until_serving()
    finally:
        server.process.terminate()
        assert server.process.wait(timeout=30) is not None


def test_completions_return_token_ids_logprobs_and_versions(server):
    reply = request_json("POST", f"{server}/v1/completions", {"prompt": "1+2=\\boxed{", "max_tokens": 5, "n": 3})
    assert reply["object"] == "text_completion" and len(reply["choices"]) == 3
    assert reply["usage"]["prompt_tokens"] == len(reply["prompt_token_ids"]) == len("1+2=\\boxed{")
    for choice in reply["choices"]:
        n = len(choice["token_ids"])
        assert 1 <= n <= 5 and len(choice["logprobs"]["token_logprobs"]) == n == len(choice["model_versions"])
        assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"]) and set(choice["model_versions"]) == {0}
        assert choice["finish_reason"] in ("stop", "length")
    by_ids = request_json(
        "POST", f"{server}/v1/completions", {"prompt": reply["prompt_token_ids"], "max_tokens": 2, "ignore_eos": True}
    )
    assert len(by_ids["choices"][0]["token_ids"]) == 2 and by_ids["choices"][0]["finish_reason"] == "length"


def test_a_list_of_prompts_gets_n_choices_per_prompt_in_prompt_major_order(server, model_dir):
    single = request_json("POST", f"{server}/v1/completions", {"prompt": "3+4=\\boxed{", "max_tokens": 1})[
        "prompt_token_ids"
    ]
    reply = request_json(
        "POST", f"{server}/v1/completions", {"prompt": ["1+", single], "max_tokens": 3, "n": 2, "ignore_eos": True}
    )
    assert reply["prompt_token_ids"][1] == single and len(reply["prompt_token_ids"][0]) == len("1+")
    assert reply["usage"]["prompt_tokens"] == len(single) + 2
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3] and all(
        len(c["token_ids"]) == 3 for c in reply["choices"]
    )
    # prompt-major: choices 0-1 were sampled after prompt 0, choices 2-3 after prompt 1 (their first logprob says which)
    model = load_causal_lm(model_dir)
    assert request_json("GET", f"{server}/weights_digest")["digests"] == digest(
        model
    )  # the weights the server samples with
    for i, prompt_ids in enumerate(reply["prompt_token_ids"]):
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0, -1].float(), -1)
        for choice in reply["choices"][2 * i : 2 * i + 2]:
            assert choice["logprobs"]["token_logprobs"][0] == pytest.approx(
                logprobs[choice["token_ids"][0]].item(), abs=1e-4
            )


def test_chat_completions_apply_the_chat_template(server):
    reply = request_json(
        "POST", f"{server}/v1/chat/completions", {"messages": [{"role": "user", "content": "2+2"}], "max_tokens": 4}
    )
    assert reply["object"] == "chat.completion"
    assert (
        reply["prompt_token_ids"]
        == request_json("POST", f"{server}/v1/completions", {"prompt": "2+2=", "max_tokens": 1})["prompt_token_ids"]
    )
    choice = reply["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"]) == len(choice["model_versions"])


@pytest.mark.parametrize(
    "path, body, status, reason",
    [
        ("/v1/completions", b"{not json", 400, "not JSON"),
        ("/v1/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/completions", b'{"max_tokens": 3}', 400, "'prompt'"),
        ("/v1/completions", b'{"prompt": "1+1=", "max_tokens": 0}', 400, "'max_tokens'"),
        ("/v1/completions", b'{"prompt": "1+1=", "temperature": 0}', 400, "'temperature'"),
        (
            "/v1/completions",
            b'{"prompt": "1+1=", "temperature": 1e-50}',
            400,
            "'temperature'",
        ),  # 0 in float32: NaN for the batch
        ("/v1/completions", b'{"prompt": "1+1=", "n": 1000}', 400, "'n'"),
        ("/v1/completions", b'{"prompt": [1, 99999]}', 400, "outside the vocabulary"),
        ("/v1/completions", b'{"prompt": "1+1=", "max_tokens": 100000}', 400, "positions"),
        ("/v1/completions", b'{"prompt": ["1+1=", ""]}', 400, "'prompt[1]'"),
        ("/v1/completions", b'{"prompt": ["1+1=", [1, 99999]]}', 400, "prompt 1: prompt token ids"),
        ("/v1/completions", b'{"prompt": ["1+1=", "2+2="], "n": 300}', 400, "2 prompts x n=300"),
        ("/v1/chat/completions", b'{"messages": "hi"}', 400, "'messages'"),
        ("/init_process_group", b'{"init_method": "file:///x", "rank": 1, "world_size": 2}', 400, "tcp://"),
        ("/init_process_group", b'{"init_method": "tcp://127.0.0.1:1", "rank": 0, "world_size": 2}', 400, "'rank'"),
        ("/request_weight_update", b'{"version": 1, "parameters": []}', 409, "init_process_group"),
    ],
)
def test_malformed_requests_get_a_4xx_with_the_reason_and_the_server_stays_up(server, path, body, status, reason):
    got_status, reply = post_raw(server + path, body)
    assert got_status == status and reason in reply["error"]
    assert request_json("GET", f"{server}/health")["status"] == "ok"


@pytest.mark.parametrize("timeout", ["nan", "-1"])
def test_a_health_wait_without_a_usable_timeout_is_refused(server, timeout):
    """asyncio waits forever on a NaN timeout: the wait for a version that may never come is refused."""
    with pytest.raises(ServerError, match="timeout_s must be a number >= 0") as refused:
        request_json("GET", f"{server}/health?wait_for_version=1000000&timeout_s={timeout}", timeout_s=10)
    assert refused.value.status == 400


@pytest.fixture(scope="module")
def trainer_side(server, model_dir):
    """The trainer's model (the same weights as the server's) and its process group with the server."""
    model = load_causal_lm(model_dir)
    return model, WeightSender([server])


LONG = 240  # tokens: the tiny model has 256 positions


def long_completions(server: str, count: int) -> list[dict]:
    body = {"prompt": "1+1=\\boxed{", "max_tokens": LONG, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        return [
            f.result()["choices"][0]
            for f in [pool.submit(request_json, "POST", f"{server}/v1/completions", body) for _ in range(count)]
        ]


def test_weight_update_is_bitwise_and_sequences_in_flight_span_two_versions(server, trainer_side):
    model, sender = trainer_side
    assert request_json("GET", f"{server}/weights_digest")["digests"] == digest(model)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        before = request_json("GET", f"{server}/metrics")["generated_tokens"]  # earlier tests' tokens count too
        in_flight = pool.submit(long_completions, server, 4)
        while True:  # all four decoding (each has its first token) and some way into their tokens
            metrics = request_json("GET", f"{server}/metrics")
            if metrics["active"] == 4 and metrics["generated_tokens"] >= before + 4 * 30:
                break
            assert not in_flight.done(), in_flight.result()  # finished (or failed) before the update could land
            time.sleep(0.01)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        assert sender.push(model, version=1) == [] and sender.wait() == []
        choices = in_flight.result(timeout=120)
    for choice in choices:
        versions = choice["model_versions"]
        assert len(choice["token_ids"]) == LONG and choice["finish_reason"] == "length"  # none cut short by the update
        switch = versions.index(1) if 1 in versions else LONG
        assert 0 < switch and versions == [0] * switch + [1] * (LONG - switch)  # continued, not restarted
    assert any(
        set(c["model_versions"]) == {0, 1} for c in choices
    )  # generation went on across the update (all four, in practice)
    while request_json("GET", f"{server}/health")["model_version"] != 1:
        time.sleep(0.01)
    served = request_json("GET", f"{server}/weights_digest")
    assert served["model_version"] == 1 and served["digests"] == digest(model)
    metrics = request_json("GET", f"{server}/metrics")
    assert metrics["weight_updates"] == 1 and metrics["pause_s_last"] > 0


def test_buckets_group_consecutive_tensors_of_one_dtype_up_to_the_size():
    specs = [
        ParameterSpec("a", (10,), "float32"),
        ParameterSpec("b", (2, 5), "float32"),
        ParameterSpec("c", (30,), "float32"),
        ParameterSpec("d", (4,), "bfloat16"),
        ParameterSpec("e", (4,), "float32"),
    ]
    assert buckets(specs, 0) == [[0], [1], [2], [3], [4]]  # one broadcast per tensor
    assert buckets(specs, 80) == [[0, 1], [2], [3], [4]]  # 40 + 40 bytes fit; c (120 bytes) goes alone
    assert buckets(specs, 1000) == [[0, 1, 2], [3], [4]]  # a dtype change starts a new bucket


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_flatten_then_unflatten_gives_back_every_tensor(dtype):
    tensors = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2, 2), torch.randn(7)]
    specs = parameter_specs(torch.nn.ParameterList(tensors), dtype)
    plan = buckets(specs, 80 if dtype is None else 40)  # 20 floats a bucket: [0, 1], [2, 3]
    assert plan == [[0, 1], [2, 3]]
    flat = flatten(tensors, plan, dtype)
    assert [f.numel() for f in flat] == [17, 15] and all(f.dtype == (dtype or torch.float32) for f in flat)
    for tensor, back in zip(tensors, unflatten(flat, specs, plan)):
        assert torch.equal(back, tensor.to(dtype or tensor.dtype))


def test_a_bucketed_update_is_bitwise_too(server, trainer_side):
    model, sender = trainer_side
    version = request_json("GET", f"{server}/health")["model_version"] + 1
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    tensor_bytes = [p.numel() * 4 for p in model.parameters()]
    bucket_bytes = sum(tensor_bytes) // 3  # several buckets, and tensors alone where larger
    assert 1 < len(buckets(parameter_specs(model), bucket_bytes)) < len(tensor_bytes)
    assert sender.push(model, version, bucket_bytes=bucket_bytes) == [] and sender.wait() == []
    while request_json("GET", f"{server}/health")["model_version"] != version:
        time.sleep(0.01)
    assert request_json("GET", f"{server}/weights_digest")["digests"] == digest(model)


def test_a_mismatched_update_is_refused_and_the_old_weights_keep_serving(server, trainer_side):
    model, _ = trainer_side
    before = request_json("GET", f"{server}/weights_digest")
    specs = [s.to_json() for s in parameter_specs(model)]
    wrong_shape = [dict(s, shape=[s["shape"][0] + 1] + s["shape"][1:]) if i == 0 else s for i, s in enumerate(specs)]
    wrong_dtype = [dict(s, dtype="bfloat16") if i == 1 else s for i, s in enumerate(specs)]
    renamed = specs[:-1] + [dict(specs[-1], name="lm_head.not_a_weight")]
    version = before["model_version"] + 1
    for parameters, reason in [
        (wrong_shape, f"{specs[0]['name']}: shape"),
        (wrong_dtype, "dtype bfloat16"),
        (renamed, "unknown parameter lm_head.not_a_weight"),
        (specs[1:], f"missing parameter {specs[0]['name']}"),
    ]:
        status, reply = post_raw(
            f"{server}/request_weight_update", json.dumps({"version": version, "parameters": parameters}).encode()
        )
        assert status == 400 and "refused" in reply["error"] and reason in reply["error"]
    status, reply = post_raw(
        f"{server}/request_weight_update",
        json.dumps({"version": before["model_version"], "parameters": specs}).encode(),
    )
    assert status == 400 and "'version'" in reply["error"]  # not newer than what serves
    status, reply = post_raw(
        f"{server}/request_weight_update",
        json.dumps({"version": version, "parameters": specs, "bucket_bytes": -1}).encode(),
    )
    assert status == 400 and "'bucket_bytes'" in reply["error"]
    assert request_json("GET", f"{server}/weights_digest") == before
    reply = request_json("POST", f"{server}/v1/completions", {"prompt": "1+1=", "max_tokens": 3})
    assert set(reply["choices"][0]["model_versions"]) == {before["model_version"]}


def test_a_failure_in_the_sender_thread_is_raised_by_wait_and_push_not_a_hang(monkeypatch):
    sender = WeightSender([])  # no server: _send is where a broadcast would fail

    def broken_send(*_):
        raise ValueError("the broadcast broke")

    monkeypatch.setattr(sender, "_send", broken_send)
    model = torch.nn.Linear(2, 2)
    sender.push(model, version=1)
    with pytest.raises(ValueError, match="the broadcast broke"):
        sender.wait()
    sender.push(model, version=2)
    sender._queue.join()
    with pytest.raises(ValueError, match="the broadcast broke"):
        sender.push(model, version=3)


def test_a_refusal_by_one_server_still_updates_the_others_and_a_trainer_left_with_no_server_stops(model_dir, tmp_path):
    """Server B (one layer fewer) refuses what server A accepts: A still gets the update (it would wait for
    it until the gloo timeout, 300 s, and then serve stale weights), and the push fails. Once every server is
    gone, the sender says so instead of letting the trainer wait for samples that cannot come."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    config.n_layer -= 1
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "one-layer-fewer")
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp_path / "one-layer-fewer")
    servers = [
        ServerProcess(["--model", str(m), "--threads", "1"], subprocess.DEVNULL)
        for m in (model_dir, tmp_path / "one-layer-fewer")
    ]
    try:
        a, b = [server.wait_until_serving() for server in servers]
        sender, model = WeightSender([a, b], timeout_s=300), load_causal_lm(model_dir)
        with torch.no_grad():
            model.lm_head.weight.add_(1.0)
        start = time.monotonic()
        sender.push(model, version=1)
        with pytest.raises(ServerError, match="refused"):  # what a trainer waiting for samples calls, every second
            while time.monotonic() - start < 60:
                sender.check()
                time.sleep(0.01)
        assert sender.last_broadcast_s > 0  # raised once A had the update: a trainer that stops now leaves A up to date
        assert request_json("GET", f"{a}/health?wait_for_version=1&timeout_s=30")["model_version"] == 1
        assert request_json("GET", f"{a}/weights_digest")["digests"] == digest(model)
        assert request_json("GET", f"{b}/health")["model_version"] == 0  # refused: its own weights serve on

        for server in servers:
            server.process.kill()
            server.process.wait()
        dropped = sender.push(model, version=2)  # neither answers: both dropped (maybe some before push returns)
        assert sorted(dropped + sender.wait()) == sorted([a, b])
        with pytest.raises(RuntimeError, match="every server was dropped from weight updates"):
            sender.check()
        with pytest.raises(RuntimeError, match="every server was dropped from weight updates"):
            sender.push(model, version=3)
    finally:
        for server in servers:
            server.process.kill()
            server.process.wait()


def test_the_server_dtypes_are_dtypes_an_update_can_carry():
    """`protocol.ServerDtype`'s choices (but `auto`) are names of `protocol.WIRE_DTYPES`, which the weights turn into
    torch's dtypes and back: a server in any of them announces a dtype that the trainer sends in."""
    from typing import get_args

    from lm_human_preference_details.grpo.protocol import WIRE_DTYPES, ServerDtype
    from lm_human_preference_details.grpo.weights import DTYPE_NAMES, DTYPES

    assert set(get_args(ServerDtype)) - {"auto"} <= set(WIRE_DTYPES) == set(DTYPES)
    assert all(DTYPE_NAMES[DTYPES[name]] == name and DTYPES[name] == getattr(torch, name) for name in WIRE_DTYPES)
    spec = ParameterSpec("lm_head.weight", (3, 4), "bfloat16")
    assert ParameterSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec  # through the wire and back


def test_server_binds_loopback_by_default():
    from lm_human_preference_details.grpo.server import Args

    assert Args().host == "127.0.0.1"


def test_rank_0_and_only_rank_0_brings_the_store_it_listens_with():
    from lm_human_preference_details.grpo.weights import WeightGroup, listening_store

    store = listening_store("127.0.0.1", 2, timeout_s=5)
    with pytest.raises(ValueError, match="only rank 0"):
        WeightGroup("tcp://127.0.0.1:1", 0, 2)  # would bind a port chosen beforehand
    with pytest.raises(ValueError, match="only rank 0"):
        WeightGroup(f"tcp://127.0.0.1:{store.port}", 1, 2, store=store)
    with pytest.raises(ValueError, match="only rank 0"):
        WeightGroup("tcp://127.0.0.1:1", 0, 2, store=store)  # names another port than it listens on


def test_health_long_polls_until_a_version_serves(server, trainer_side):
    model, sender = trainer_side
    version = request_json("GET", f"{server}/health")["model_version"]
    start = time.monotonic()
    assert (
        request_json("GET", f"{server}/health?wait_for_version={version + 1}&timeout_s=0.5")["model_version"] == version
    )
    assert 0.4 < time.monotonic() - start < 5  # held for the timeout: no newer weights
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(request_json, "GET", f"{server}/health?wait_for_version={version + 1}&timeout_s=30")
        time.sleep(0.2)
        assert not waiting.done()
        sender.push(model, version + 1)
        assert sender.wait() == []
        assert waiting.result(timeout=30)["model_version"] == version + 1  # answered when the update applied


TRAINER_THAT_DIES = """
import sys
from lm_human_preference_details.grpo.weights import WeightGroup, listening_store
from lm_human_preference_details.grpo.client import request_json
url, specs = sys.argv[1], sys.argv[2]
store = listening_store("127.0.0.1", 2)
init_method = f"tcp://127.0.0.1:{store.port}"
import json, threading
joined = threading.Thread(target=request_json, args=("POST", url + "/init_process_group",
    {"init_method": init_method, "rank": 1, "world_size": 2, "backend": "gloo"}))
joined.start()
group = WeightGroup(init_method, 0, 2, store=store)
joined.join()
request_json("POST", url + "/request_weight_update", {"version": 1, "parameters": json.loads(specs)})
import os
os._exit(0)  # dies here, before broadcasting anything (and before a gloo teardown that can abort)
"""


def test_a_server_that_cannot_start_is_reported_not_waited_for(tmp_path):
    with open(tmp_path / "server.log", "wb") as log:
        server = ServerProcess(["--model", str(tmp_path / "no-such-model")], log)
    try:
        with pytest.raises(RuntimeError, match="exited with status 1 before listening"):
            server.wait_until_serving(timeout_s=120)
        assert "no-such-model" in (tmp_path / "server.log").read_text()
    finally:
        server.process.kill()
        server.process.wait()


def test_the_wait_for_a_loading_server_ends_when_the_callers_check_raises(model_dir):
    """How grpo.launch stops waiting for its servers when the trainer or the actor has died meanwhile."""

    class RoleDied(Exception):
        pass

    looks = []

    def check():
        looks.append(time.monotonic())
        if len(looks) == 3:
            raise RoleDied

    server = ServerProcess(["--model", model_dir, "--threads", "1"], subprocess.DEVNULL)
    try:
        with pytest.raises(RoleDied):
            server.wait_until_serving(timeout_s=120, while_waiting=check)
        assert (
            server.process.poll() is None and looks[-1] - looks[0] < 5
        )  # it was still loading: the check ended the wait
    finally:
        server.process.kill()
        server.process.wait()


def test_a_server_whose_weight_transfer_breaks_says_so_instead_of_serving_stale_weights(model_dir, tmp_path):
    server = ServerProcess(["--model", model_dir, "--threads", "1"], subprocess.DEVNULL)
    process = server.process
    try:
        url = server.wait_until_serving()
        # an actor's long-poll for the version that never comes: answered once the weights are stale, not at its end
        long_poll: list = []

        def wait_for_version_1() -> None:
            try:
                request_json("GET", f"{url}/health?wait_for_version=1&timeout_s=300", timeout_s=310)
            except ServerError as error:
                long_poll.append(error.status)

        waiting = threading.Thread(target=wait_for_version_1)
        waiting.start()
        specs = json.dumps([s.to_json() for s in parameter_specs(load_causal_lm(model_dir))])
        subprocess.run([sys.executable, "-c", TRAINER_THAT_DIES, url, specs], check=True, timeout=120)
        for _ in range(600):
            status, reply = post_raw(f"{url}/v1/completions", b'{"prompt": "1+1=", "max_tokens": 2}')
            if status == 503:
                break
            time.sleep(0.1)
        assert status == 503 and "out of date" in reply["error"]
        with pytest.raises(ServerError) as refused:
            request_json("GET", f"{url}/health")
        assert refused.value.status == 503
        waiting.join(timeout=10)
        assert not waiting.is_alive() and long_poll == [503]
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_bfloat16_server_gets_the_trainers_weights_rounded_to_bfloat16_bitwise(model_dir, tmp_path):
    """`--dtype bfloat16` (what `auto` picks on a GPU) on the CPU: the server says its dtype, the trainer sends its
    float32 weights rounded to it, and the server samples with them."""
    import copy

    with open(tmp_path / "server.log", "wb") as log:
        started = ServerProcess(
            ["--model", model_dir, "--threads", "1", "--max-batch-size", "8", "--dtype", "bfloat16"], log
        )
    try:
        url = started.wait_until_serving()
        assert request_json("GET", f"{url}/health")["dtype"] == "bfloat16"
        model = load_causal_lm(model_dir)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        sender = WeightSender([url])
        assert sender.push(model, 1, dtype=torch.bfloat16) == [] and sender.wait() == []
        request_json("GET", f"{url}/health?wait_for_version=1&timeout_s=30", timeout_s=40)
        assert request_json("GET", f"{url}/weights_digest")["digests"] == digest(
            copy.deepcopy(model).to(torch.bfloat16)
        )
        choice = request_json(
            "POST", f"{url}/v1/completions", {"prompt": "1+2=\\boxed{", "max_tokens": 4, "ignore_eos": True}
        )["choices"][0]
        assert choice["model_versions"] == [1] * 4 and all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
    finally:
        started.process.terminate()
        started.process.wait(timeout=30)
