"""OpenAI's own lm-human-preferences (third_party/, TF1 under tf.compat.v1) trains; this project's unmodified stage
functions replay its runs from the same weights, queries, sampled responses and shuffles, and must end every
update with the same parameters and statistics (tests/replays/oai_replay/replay.py says how)."""

import numpy as np
import pytest
import torch

from lm_human_preference_details.tasks import LabelHParams, TaskHParams
from lm_human_preference_details.train_policy import PPOHParams, RewardHParams
from tests.replays.oai_replay.replay import Shape, max_difference, prepare, replay_policy, replay_reward, run_oai

pytestmark = pytest.mark.slow  # TensorFlow trains OpenAI's code first: a minute and more

TOLERANCE = 1e-5
"""the largest absolute difference of any parameter after any update, in float32"""

# OAI's books task at the test model's size: a query from after the first `.` to the last `.`, responses cut
# after the first `.` from index 4 (# OAI: launch.py#L8-L19)
BOOKS = TaskHParams(
    query_length=6,
    response_length=8,
    start_text=".",
    end_text=".",
    truncate_token=26,
    truncate_after=4,
    temperature=0.7,
)
ADAPTIVE_KL = RewardHParams(kl_coef=0.15, adaptive_kl=True, target_kl=0.5, horizon=100)
SHAPES = [
    # 10 updates of 2 minibatches x 3 epochs
    Shape(
        "sentiment",
        BOOKS,
        seed=1,
        ppo=PPOHParams(total_episodes=160, batch_size=16, nminibatches=2, noptepochs=3, lr=1e-3),
        rewards=ADAPTIVE_KL,
    ),
    Shape(
        "descriptiveness",
        BOOKS,
        seed=2,
        ppo=PPOHParams(total_episodes=48, batch_size=16, nminibatches=1, noptepochs=4, lr=1e-3),
        rewards=ADAPTIVE_KL,
    ),
    # OAI's tldr task at the test model's size: a query suffix, no start or end text, truncation from an index
    # with the penalty reward, a fixed KL coefficient, no reward whitening (# OAI: launch.py#L36-L47, L171-L187)
    Shape(
        "tldr",
        TaskHParams(
            query_length=10,
            response_length=10,
            query_suffix="tldr",
            start_text=None,
            end_text=None,
            truncate_token=26,
            truncate_after=3,
            penalty_reward_value=-1.0,
            temperature=0.7,
        ),
        seed=3,
        ppo=PPOHParams(total_episodes=24, batch_size=8, nminibatches=1, noptepochs=2, lr=1e-3, whiten_rewards=False),
        rewards=RewardHParams(kl_coef=0.05, adaptive_kl=False),
    ),
    Shape(
        "reward",
        BOOKS,
        seed=4,
        reward=dict(
            labels=LabelHParams(type="best_of_4", num_train=32, num_test=0),
            batch_size=8,
            lr=1e-3,
            rollout_batch_size=8,
            normalize_samples=16,
            normalize_before=True,
            normalize_after=True,
        ),
    ),
]
STATS = {  # the port's name: OAI's (# OAI: lm_human_preferences/train_policy.py#L217-L262)
    "objective/kl": "objective/kl",
    "objective/kl_coef": "objective/kl_coef",
    "objective/entropy": "objective/entropy",
    "objective/scores": "objective/score",
    "objective/score_total": "objective/score_total",
    **{
        f"ppo/{k}": f"ppo/{k}"
        for k in (
            "loss/policy",
            "loss/value",
            "loss/total",
            "policy/entropy",
            "policy/approxkl",
            "policy/clipfrac",
            "returns/mean",
            "returns/var",
            "val/vpred",
            "val/error",
            "val/clipfrac",
            "val/mean",
            "val/var",
            "val/var_explained",
        )
    },
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The test model's matrices are tiny: torch's threads would spend longer waiting on each other (and, on a
    busy machine, on other processes) than computing (10x the time on 2 busy cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def oai(tmp_path_factory):
    """Each shape's files and OAI's record of its run (one TensorFlow subprocess for all)."""
    folder = tmp_path_factory.mktemp("oai_replay")
    prepared = [prepare(shape, str(folder / shape.name)) for shape in SHAPES]
    return {p.shape.name: (p, record) for p, record in zip(prepared, run_oai(prepared, str(folder))[0])}


def assert_updates_match(oai_params: list[dict], port_params: list[dict], name: str) -> float:
    """Every update's parameters within TOLERANCE; returns the worst difference."""
    assert len(port_params) == len(oai_params)
    worst = 0.0
    for update, (theirs, ours) in enumerate(zip(oai_params, port_params), start=1):
        difference, parameter = max_difference(theirs, ours)
        assert difference <= TOLERANCE, f"{name}: update {update}: {parameter} differs by {difference:.2e}"
        worst = max(worst, difference)
    print(f"{name}: {len(oai_params)} updates, parameters within {worst:.1e} of OAI's")
    return worst


def assert_moved(first: dict, last: dict) -> None:
    """Training changed the parameters (a replay of nothing would match trivially)."""
    assert max_difference(first, last)[0] > 100 * TOLERANCE


@pytest.mark.parametrize("name", ["sentiment", "descriptiveness", "tldr"])
def test_ppo_matches_oai_update_by_update(oai, tmp_path, name):
    prepared, record = oai[name]
    params, metrics = replay_policy(prepared, record, str(tmp_path))
    assert_updates_match([u["params"] for u in record["updates"]], params, name)
    assert_moved(params[0], params[-1])
    for update, (theirs, ours) in enumerate(zip(record["updates"], metrics), start=1):
        for port_key, oai_key in STATS.items():
            np.testing.assert_allclose(
                ours[port_key], theirs["stats"][oai_key], rtol=1e-4, atol=1e-5, err_msg=f"update {update}: {port_key}"
            )
    if prepared.shape.rewards.adaptive_kl:  # the controller moved, as OAI's did
        assert metrics[-1]["objective/kl_coef"] != prepared.shape.rewards.kl_coef


def test_gradient_accumulation_matches_oais_single_step(oai, tmp_path):
    prepared, record = oai["descriptiveness"]
    params, _ = replay_policy(prepared, record, str(tmp_path), gradient_accumulation_steps=2)
    assert_updates_match([u["params"] for u in record["updates"]], params, "descriptiveness, 2 micro-batches")


def test_torch_adam_is_caught(oai, tmp_path):
    """The control: the same replay with torch's Adam (eps inside the bias correction) ends far outside the
    tolerance, so the replay can tell."""
    prepared, record = oai["descriptiveness"]
    params, _ = replay_policy(prepared, record, str(tmp_path), optimizer="adam_torch")
    difference, _ = max_difference(record["updates"][-1]["params"], params[-1])
    print(f"descriptiveness with torch's Adam: {difference:.1e} from OAI's")
    assert difference > 100 * TOLERANCE


def test_reward_model_matches_oai_with_normalization_before_and_after(oai, tmp_path):
    prepared, record = oai["reward"]
    params, final, metrics = replay_reward(prepared, record, str(tmp_path))
    worst = assert_updates_match([u["params"] for u in record["updates"]], params, "reward")
    assert_moved(params[0], params[-1])
    difference, parameter = max_difference(record["final_params"], final)
    assert difference <= TOLERANCE, f"after normalizing: {parameter} differs by {difference:.2e}"
    print(f"reward: after normalizing at the end, within {max(worst, difference):.1e}")
    (before_mean, before_std), (after_mean, after_std) = record["normalize_stats"]
    np.testing.assert_allclose(
        [metrics[f"norm/{w}/{s}"] for w in ("before", "after") for s in ("mean", "std")],
        [before_mean, before_std, after_mean, after_std],
        rtol=1e-5,
        atol=1e-6,
    )
