"""A tensor-parallel vLLM server (`--tensor-parallel-size 2`, two CPU workers, each holding half of every layer): each
worker joins the trainer's weight group at a rank of its own (PipelineRL's layout), so an update reaches both, and
the guarantees of tests/serving/test_contract.py's updates hold for the pair, with each `--weight-staging` (staged,
the default that test_contract.py's server runs: each worker prepares its shard in a shadow of its model before the
pause; in_place: each reloads its shard inside the pause). Slow: vLLM starts in minutes here."""

import json
import time

import pytest

from lm_human_preference_details.grpo.client import request_json
from lm_human_preference_details.grpo.serving.vllm_server import FAIL_PREPARE_ENV
from lm_human_preference_details.grpo.weights import WeightSender, digest
from lm_human_preference_details.models import load_causal_lm
from tests.conftest import post_raw, save_tiny_math_with_chat_template
from tests.serving.test_contract import (
    EngineServer,
    check_a_failed_weight_update_rolls_back,
    check_a_killed_server_leaves_no_process_behind,
    perturb,
    prompt_ids,
    sampled,
    sequence_logprobs,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_math_with_chat_template(str(tmp_path_factory.mktemp("tiny-math-chat")))


FAIL_PREPARE_AT = 1000
"""the weight version whose staged prepare the workers fail (`vllm_server.FAIL_PREPARE_ENV`)"""


@pytest.fixture(scope="module", params=["staged", "in_place"])
def engine_server(request, model_dir, tmp_path_factory):
    """tiny-math's two attention heads, one per worker; `--threads 1`: vLLM's own binding of two workers' threads
    fails on this machine's one NUMA node."""
    server = EngineServer(
        "vllm",
        tmp_path_factory.mktemp(f"tp2-{request.param}"),
        ("--tensor-parallel-size", "2", "--weight-staging", request.param),
        {FAIL_PREPARE_ENV: str(FAIL_PREPARE_AT)},
    )
    try:
        server.start(model_dir)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def staging(engine_server) -> str:
    """The server's `--weight-staging`."""
    return engine_server.flags[engine_server.flags.index("--weight-staging") + 1]


def test_a_server_of_two_workers_takes_two_ranks_and_refuses_a_group_without_room(engine_server):
    url = engine_server.url
    assert request_json("GET", f"{url}/health")["weight_ranks"] == 2
    old_trainers = json.dumps({"init_method": "tcp://127.0.0.1:1", "rank": 1, "world_size": 2}).encode()
    status, reply = post_raw(f"{url}/init_process_group", old_trainers)
    assert status == 400 and "weight_ranks" in reply["error"]["message"]


def test_an_update_reaches_both_workers(engine_server, model_dir, staging):
    """Each worker holds half of every layer's weights: tokens of the new weights' logprobs need both halves new."""
    url = engine_server.url
    model = load_causal_lm(model_dir)
    prompt = prompt_ids(url, "12+34=")
    before = sampled(url, prompt, 16)  # at temperature 1: the logprobs are the model's own
    perturb(model, scale=0.2)
    assert before["logprobs"]["token_logprobs"] != pytest.approx(
        sequence_logprobs(model, prompt, before["token_ids"]), abs=1e-2
    )  # the new weights give other logprobs: the check below can fail
    sender = WeightSender([url])
    assert sender.groups[url].world_size == 3  # the trainer and two workers
    assert sender.push(model, version=1) == [] and sender.wait() == []
    assert request_json("GET", f"{url}/health?wait_for_version=1&timeout_s=60")["model_version"] == 1
    after = sampled(url, prompt, 16)
    assert after["model_versions"] == [1] * 16
    assert after["logprobs"]["token_logprobs"] == pytest.approx(
        sequence_logprobs(model, prompt, after["token_ids"]), abs=2e-4
    )
    assert request_json("GET", f"{url}/weights_digest")["digests"] == digest(model)  # the workers agree
    metrics = request_json("GET", f"{url}/metrics")
    assert metrics["weight_staging"] == staging
    assert (metrics["swap_s_last"] > 0) == (staging == "staged")  # the workers swapped, or reloaded


def test_a_failed_prepare_rolls_back_on_both_workers(engine_server, model_dir, staging):
    """Staged: the workers fail halfway through loading an update into their shadows; the old weights keep serving
    (its logprobs, its digest), and the next update, into new shadows, serves. In place nothing is prepared before
    the pause, so the same update loads and serves."""
    url = engine_server.url
    serving, failing = load_causal_lm(model_dir), load_causal_lm(model_dir)
    perturb(serving, scale=0.1)
    perturb(failing, scale=0.2)
    version = request_json("GET", f"{url}/health")["model_version"] + 1
    sender = WeightSender([url])
    assert sender.push(serving, version) == [] and sender.wait() == []
    request_json("GET", f"{url}/health?wait_for_version={version}&timeout_s=60")
    assert sender.push(failing, FAIL_PREPARE_AT) == [] and sender.wait() == []  # received: the prepare fails after
    prompt = prompt_ids(url, "12+34=")
    if staging == "in_place":
        request_json("GET", f"{url}/health?wait_for_version={FAIL_PREPARE_AT}&timeout_s=60")
        choice = sampled(url, prompt, 16)
        assert choice["model_versions"] == [FAIL_PREPARE_AT] * 16
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(
            sequence_logprobs(failing, prompt, choice["token_ids"]), abs=2e-4
        )
        return
    for _ in range(600):
        health = request_json("GET", f"{url}/health")
        if health["update_error"]:
            break
        time.sleep(0.1)
    assert health["model_version"] == version and "preparing failed" in health["update_error"]
    choice = sampled(url, prompt, 16)
    assert choice["model_versions"] == [version] * 16
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(
        sequence_logprobs(serving, prompt, choice["token_ids"]), abs=2e-4
    )
    assert request_json("GET", f"{url}/weights_digest")["digests"] == digest(serving)
    sender = WeightSender([url])  # the failure dropped the group, as a failed receive does
    assert sender.push(failing, FAIL_PREPARE_AT + 1) == [] and sender.wait() == []
    request_json("GET", f"{url}/health?wait_for_version={FAIL_PREPARE_AT + 1}&timeout_s=60")
    choice = sampled(url, prompt, 16)
    assert choice["model_versions"] == [FAIL_PREPARE_AT + 1] * 16
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(
        sequence_logprobs(failing, prompt, choice["token_ids"]), abs=2e-4
    )


def test_a_failed_weight_update_rolls_back_on_both_workers(engine_server, model_dir):
    check_a_failed_weight_update_rolls_back(engine_server.url, load_causal_lm(model_dir))


def test_a_killed_server_leaves_no_worker_behind(engine_server):
    """Last."""
    check_a_killed_server_leaves_no_process_behind(engine_server, 3)  # the engine core and two workers at least
