"""The home-made inference server's own cases and the trainer's side of the weight update: buckets, the sender's
failures, a server that refuses what another accepts, a server that cannot start, a bfloat16 server. The GRPO
contract itself (token ids, logprobs, versions, bad requests, updates in flight, refused updates, a broken transfer)
is tested against this server and the vLLM one alike in tests/serving/test_contract.py."""

import concurrent.futures
import itertools
import json
import subprocess
import time

import pytest
import torch

from lm_human_preference_details.grpo.client import ServerError, ServerProcess, request_json
from lm_human_preference_details.grpo.protocol import ParameterSpec
from lm_human_preference_details.grpo.weights import (
    BufferPool,
    WeightSender,
    buckets,
    digest,
    flatten,
    group_size,
    install_tensors,
    parameter_specs,
    unflatten,
)
from lm_human_preference_details.models import load_causal_lm
from tests.conftest import save_tiny_math_with_chat_template


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_math_with_chat_template(str(tmp_path_factory.mktemp("tiny-math-chat")))


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


def test_a_weight_group_has_the_trainer_and_the_ranks_a_server_says_it_takes():
    assert group_size({"status": "ok"}) == 2  # a server from before `weight_ranks`: one rank
    assert group_size({"status": "ok", "weight_ranks": 1}) == 2
    assert group_size({"status": "ok", "weight_ranks": 4}) == 5  # a vLLM server of four tensor-parallel workers


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_flatten_then_unflatten_gives_back_every_tensor(dtype):
    tensors = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2, 2), torch.randn(7)]
    specs = parameter_specs(torch.nn.ParameterList(tensors), dtype)
    plan = buckets(specs, 80 if dtype is None else 40)  # 20 floats a bucket: [0, 1], [2, 3]
    assert plan == [[0, 1], [2, 3]]
    flat = list(flatten(tensors, plan, dtype))
    assert [f.numel() for f in flat] == [17, 15] and all(f.dtype == (dtype or torch.float32) for f in flat)
    for tensor, back in zip(tensors, unflatten(flat, specs, plan)):
        assert torch.equal(back, tensor.to(dtype or tensor.dtype))


def test_a_buffer_given_back_is_taken_again_only_for_its_size_and_dtype():
    pool = BufferPool()
    given = pool.take(10, torch.float32, "cpu")
    pool.give([given])
    assert pool.take(10, torch.bfloat16, "cpu") is not given and pool.take(11, torch.float32, "cpu") is not given
    assert pool.take(10, torch.float32, "cpu") is given
    assert pool.take(10, torch.float32, "cpu") is not given  # taken: not handed out twice


@pytest.mark.parametrize("staging", ["staged", "in_place"])
def test_installed_tensors_serve_as_a_model_loaded_with_them_tied_head_included(model_dir, staging):
    """`staged` swaps each parameter's data (the objects stay, so the tied head follows), `in_place` copies."""
    served, trainer = load_causal_lm(model_dir), load_causal_lm(model_dir)
    assert served.lm_head.weight is served.get_input_embeddings().weight  # tied: one parameter, sent once
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    parameters_before = dict(served.named_parameters())
    specs = parameter_specs(trainer)
    plan = buckets(specs, 4096)
    received = unflatten(flatten([p.detach() for p in trainer.parameters()], plan), specs, plan)
    install_tensors(served, specs, received, staging)
    assert dict(served.named_parameters()) == parameters_before  # the same objects: the engine's model is intact
    assert digest(served) == digest(trainer)
    ids = torch.tensor([[3, 10, 4, 13, 7]])
    with torch.no_grad():
        assert torch.equal(served(ids).logits, trainer(ids).logits)
    shares_memory = served.lm_head.weight.data_ptr() == received[0].data_ptr()
    assert shares_memory == (staging == "staged")  # a swap, not a copy (and the head is the embedding's)


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


def test_a_snapshot_that_fails_part_way_is_raised_by_push_and_then_by_wait_not_a_hang(monkeypatch):
    from lm_human_preference_details.grpo import weights

    def flatten_then_fail(*args):
        yield from itertools.islice(weights_flatten(*args), 1)
        raise MemoryError("no memory for the second bucket")

    weights_flatten = weights.flatten
    monkeypatch.setattr(weights, "flatten", flatten_then_fail)
    sender = WeightSender([])
    with pytest.raises(MemoryError):
        sender.push(torch.nn.Linear(2, 2), version=1)
    waited = concurrent.futures.ThreadPoolExecutor(1).submit(sender.wait)
    with pytest.raises(RuntimeError, match="snapshot of the weights failed part way"):
        waited.result(timeout=30)


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

        # the same, streamed (a sharded trainer's push): raised only once every bucket was made, as the trainer
        # processes that gather with this one make them too
        with torch.no_grad():
            model.lm_head.weight.add_(1.0)
        made = []
        with pytest.raises(ServerError, match="refused"):
            sender.push_streamed(parameter_specs(model), made_buckets(model, made), version=2, bucket_bytes=2**16)
        assert made == buckets(parameter_specs(model), 2**16)
        assert request_json("GET", f"{a}/health?wait_for_version=2&timeout_s=30")["model_version"] == 2
        assert request_json("GET", f"{a}/weights_digest")["digests"] == digest(model)

        for server in servers:
            server.process.kill()
            server.process.wait()
        dropped = sender.push(model, version=3)  # neither answers: both dropped (maybe some before push returns)
        assert sorted(dropped + sender.wait()) == sorted([a, b])
        with pytest.raises(RuntimeError, match="every server was dropped from weight updates"):
            sender.check()
        with pytest.raises(RuntimeError, match="every server was dropped from weight updates"):
            sender.push(model, version=4)
        made = []
        with pytest.raises(RuntimeError, match="every server was dropped from weight updates"):
            sender.push_streamed(parameter_specs(model), made_buckets(model, made), version=4, bucket_bytes=2**16)
        assert made == buckets(parameter_specs(model), 2**16)
    finally:
        for server in servers:
            server.process.kill()
            server.process.wait()


def made_buckets(model: torch.nn.Module, made: list):
    """`model`'s flat buckets of 64 KiB, made one at a time (each bucket's indices appended to `made` as it is)."""
    tensors = [p.detach() for p in model.parameters()]
    for bucket in buckets(parameter_specs(model), 2**16):
        made.append(bucket)
        yield next(flatten(tensors, [bucket]))


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


def test_a_stream_holds_back_the_text_that_could_still_become_a_stop_string_and_cuts_at_one():
    from lm_human_preference_details.grpo.serving.replies import settled_text

    stops = ("}\n", "The end")
    assert settled_text("x = {1}", stops, last=False) == ("x = {1", False)  # "}" may begin "}\n"
    assert settled_text("x = {1}", stops, last=True) == ("x = {1}", False)  # the last text holds nothing back
    assert settled_text("So. The e", stops, last=False) == ("So. ", False)  # the longest end that begins one
    assert settled_text("So. The", stops, last=False) == ("So. ", False)
    assert settled_text("So. Then", stops, last=False) == ("So. Then", False)
    assert settled_text("x = {1}\nThe end", stops, last=False) == ("x = {1", True)  # cut at the first
    assert settled_text("caf\ufffd", (), last=False) == ("caf", False)  # a character not yet whole
    assert settled_text("caf\ufffd", (), last=True) == ("caf\ufffd", False)
    text, sent = "ab}c}\nd", ""
    for end in range(len(text) + 1):  # token by token: what is settled only grows, and ends as the reply's cut
        settled, stopped = settled_text(text[:end], stops, last=end == len(text))
        assert settled.startswith(sent)
        sent = settled
    assert (sent, stopped) == ("ab}c", True)


def test_streamed_chunks_add_up_to_the_unstreamed_text_of_random_byte_level_tokens():
    """Random tokens of a byte-level BPE (pieces of characters, leading spaces), streamed one per chunk and decoded
    a few at a time: their texts add up to the unstreamed reply's, cut at the same stop string."""
    import random

    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from lm_human_preference_details.grpo.serving.replies import ChoiceStream, Sample, completion_choices
    from lm_human_preference_details.grpo.serving.request_checks import Sampling

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        ["Hello, world! The answer is 46.\n\n\U0001f600 \u4e2d\u6587 \xfcn\xefc\xf6d\xe9  x"] * 20, 300
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
    rng = random.Random(0)
    for trial in range(100):
        ids = [rng.randrange(len(tokenizer)) for _ in range(40)]
        sampling = Sampling(40, 1.0, frozenset(), 1, ("\n\n", " is", "\U0001f600") if trial % 2 else ())
        choice = ChoiceStream(tokenizer, sampling, chat=False)
        chunks = [choice.chunk(0, Sample([t], [0.0], [0], "length" if i == 39 else "")) for i, t in enumerate(ids)]
        whole = completion_choices(tokenizer, [Sample(ids, [0.0] * 40, [0] * 40, "length")], sampling)[0]
        assert "".join(c["text"] for c in chunks) == whole["text"], trial
        assert chunks[-1]["finish_reason"] == whole["finish_reason"]


def test_an_engine_failure_after_the_first_chunk_reaches_the_sdk_as_an_error(model_dir):
    """The status went out with the first chunk: a later failure is an error event, which the OpenAI SDK raises."""
    import asyncio
    import threading

    import openai
    from aiohttp import web
    from transformers import AutoTokenizer

    from lm_human_preference_details.grpo.serving.http_contract import listen, queued_deltas
    from lm_human_preference_details.grpo.serving.replies import ChoiceStream, Sample, send_stream
    from lm_human_preference_details.grpo.serving.request_checks import Sampling

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sampling = Sampling(max_tokens=16, temperature=1.0, stop_token_ids=frozenset(), n=1)

    async def completions(request: web.Request) -> web.StreamResponse:
        steps, ended = asyncio.Queue(), asyncio.get_running_loop().create_future()
        ids = tokenizer("1+", add_special_tokens=False)["input_ids"]
        steps.put_nowait([(0, Sample(ids, [-0.5] * len(ids), [], ""))])
        ended.set_exception(RuntimeError("the engine broke"))  # after its first step
        deltas = queued_deltas(steps, ended, choices=1)
        new_choice = lambda: ChoiceStream(tokenizer, sampling, chat=False)  # noqa: E731
        return await send_stream(request, "text_completion", "m", [[1, 2]], False, deltas, new_choice, True)

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions)])
    listening, url = listen("127.0.0.1", 0)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.SockSite(runner, listening).start())
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        received = []
        with pytest.raises(openai.APIError, match="RuntimeError: the engine broke"):
            for chunk in client.completions.create(model="m", prompt="1", max_tokens=16, stream=True):
                received.append(chunk.choices[0].text)
        assert received == ["1+"]
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)


def test_server_binds_loopback_by_default():
    from lm_human_preference_details.grpo.serving.server import Args

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


def test_a_bfloat16_server_gets_the_trainers_weights_rounded_to_bfloat16_bitwise_update_after_update(
    model_dir, tmp_path
):
    """`--dtype bfloat16` (what `auto` picks on a GPU) on the CPU: the server says its dtype, the trainer sends its
    float32 weights rounded to it, and the server samples with them. From the third update on, both sides write
    into buffers an earlier update used (`BufferPool`): each must still arrive whole, none overwritten in use."""
    import copy

    with open(tmp_path / "server.log", "wb") as log:
        started = ServerProcess(
            ["--model", model_dir, "--threads", "1", "--max-batch-size", "8", "--dtype", "bfloat16"], log
        )
    try:
        url = started.wait_until_serving()
        assert request_json("GET", f"{url}/health")["dtype"] == "bfloat16"
        model = load_causal_lm(model_dir)
        sender = WeightSender([url])
        for version in (1, 2, 3, 4):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * torch.randn_like(p))
            assert sender.push(model, version, dtype=torch.bfloat16, bucket_bytes=2**16) == [] and sender.wait() == []
            request_json("GET", f"{url}/health?wait_for_version={version}&timeout_s=30", timeout_s=40)
            assert request_json("GET", f"{url}/weights_digest")["digests"] == digest(
                copy.deepcopy(model).to(torch.bfloat16)
            ), version
        choice = request_json(
            "POST", f"{url}/v1/completions", {"prompt": "1+2=\\boxed{", "max_tokens": 4, "ignore_eos": True}
        )["choices"][0]
        assert choice["model_versions"] == [4] * 4 and all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
    finally:
        started.process.terminate()
        started.process.wait(timeout=30)
