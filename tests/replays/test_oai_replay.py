"""OpenAI's own lm-human-preferences (third_party/, TF1 under tf.compat.v1) trains; this project's unmodified stage
functions replay its runs from the same weights, queries, sampled responses and shuffles, and must end every
update with the same parameters and statistics (tests/replays/oai_replay/replay.py says how): as one process, and as
two (OAI's code under `mpirun`, the port under `accelerate launch`)."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from lm_human_preference_details.tasks import LabelHParams, TaskHParams
from lm_human_preference_details.train_policy import PPOHParams, RewardHParams
from tests.replays.oai_replay.replay import (
    RanksJob,
    Shape,
    max_difference,
    prepare,
    replay_on_ranks,
    replay_policy,
    replay_reward,
    run_oai,
)

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
TWO_RANKS = [
    # sentiment with twice the batch, so that each rank's minibatch has the 8 rows OAI's whitening asks for
    # (# OAI: lm_human_preferences/train_policy.py#L459-L462): 3 updates of 2 minibatches x 3 epochs on each rank
    replace(SHAPES[0], ppo=replace(SHAPES[0].ppo, total_episodes=96, batch_size=32)),
    SHAPES[3],  # each rank trains on 4 labels of each batch of 8 and draws half of each normalization's samples
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


def assert_stats_match(oai_stats: dict, port_metrics: dict, keys, where: str) -> None:
    """The port's logged statistics `keys` (STATS's) within the replay's tolerance of OAI's."""
    for port_key in keys:
        np.testing.assert_allclose(
            port_metrics[port_key], oai_stats[STATS[port_key]], rtol=1e-4, atol=1e-5, err_msg=f"{where}: {port_key}"
        )


def assert_policy_matches(prepared, record: dict, params: list, metrics: list, name: str) -> None:
    """A replay of stage 2: every update's parameters and logged statistics as OAI's."""
    assert_updates_match([u["params"] for u in record["updates"]], params, name)
    assert_moved(params[0], params[-1])
    for update, (theirs, ours) in enumerate(zip(record["updates"], metrics), start=1):
        assert_stats_match(theirs["stats"], ours, STATS, f"{name}: update {update}")
    if prepared.shape.rewards.adaptive_kl:  # the controller moved, as OAI's did
        assert metrics[-1]["objective/kl_coef"] != prepared.shape.rewards.kl_coef


@pytest.mark.parametrize("name", ["sentiment", "descriptiveness", "tldr"])
def test_ppo_matches_oai_update_by_update(oai, tmp_path, name):
    prepared, record = oai[name]
    assert_policy_matches(prepared, record, *replay_policy(prepared, record, str(tmp_path)), name)


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


def assert_reward_matches(record: dict, params: list, final: dict, metrics: dict, name: str) -> None:
    """A replay of stage 1: every update's parameters, those after normalizing at the end, and the normalizations'
    means and stds as OAI's."""
    worst = assert_updates_match([u["params"] for u in record["updates"]], params, name)
    assert_moved(params[0], params[-1])
    difference, parameter = max_difference(record["final_params"], final)
    assert difference <= TOLERANCE, f"{name}: after normalizing: {parameter} differs by {difference:.2e}"
    print(f"{name}: after normalizing at the end, within {max(worst, difference):.1e}")
    (before_mean, before_std), (after_mean, after_std) = record["normalize_stats"]
    np.testing.assert_allclose(
        [metrics[f"norm/{w}/{s}"] for w in ("before", "after") for s in ("mean", "std")],
        [before_mean, before_std, after_mean, after_std],
        rtol=1e-5,
        atol=1e-6,
    )


def test_reward_model_matches_oai_with_normalization_before_and_after(oai, tmp_path):
    prepared, record = oai["reward"]
    assert_reward_matches(record, *replay_reward(prepared, record, str(tmp_path)), "reward")


def test_two_ranks_match_oai_under_mpi_and_whitening_over_both_is_caught(tmp_path):
    """OAI's code as the 2 ranks of `mpirun` (real MPI), the port as the 2 processes of `accelerate launch` (gloo),
    each process replaying its rank's queries, samples and shuffles: per-rank batches and minibatches, whitening
    over each rank's own rows, gradients and statistics averaged over ranks, the KL controller fed the averaged KL,
    reward normalization from sums over ranks, the label order broadcast from rank 0, each rank's share of it.
    The control whitens over both ranks' rows: the rollout is still OAI's, the first update is not."""
    prepared = [prepare(shape, str(tmp_path / shape.name)) for shape in TWO_RANKS]
    oai_ranks = run_oai(prepared, str(tmp_path), ranks=2)  # [rank][shape]
    by_rank = [[runs[i] for runs in oai_ranks] for i in range(len(prepared))]  # [shape][rank]
    policy, reward = prepared
    jobs = [
        RanksJob(policy, by_rank[0], str(tmp_path / "port_policy")),
        RanksJob(reward, by_rank[1], str(tmp_path / "port_reward")),
        RanksJob(policy, by_rank[0], str(tmp_path / "port_control"), whiten_over_all=True),
    ]
    port_ranks = replay_on_ranks(jobs, str(tmp_path))  # [rank][job]
    for rank, ((oai_policy, oai_reward), (policy_run, reward_run, control)) in enumerate(zip(oai_ranks, port_ranks)):
        assert_policy_matches(policy, oai_policy, *policy_run, f"sentiment, rank {rank}")
        assert_reward_matches(oai_reward, *reward_run, f"reward, rank {rank}")
        control_params, control_metrics = control
        with pytest.raises(AssertionError, match=f"rank {rank}: update 1: policy/"):
            assert_updates_match([u["params"] for u in oai_policy["updates"]], control_params, f"control, rank {rank}")
        first = oai_policy["updates"][0]["stats"]
        assert_stats_match(first, control_metrics[0], [k for k in STATS if k.startswith("objective/")], "control")
        with pytest.raises(AssertionError, match="ppo/returns/var"):  # built from the whitened rewards
            assert_stats_match(first, control_metrics[0], ["ppo/returns/var"], "control")
    # the ranks replayed different rollouts, and rank 0's label order on both
    assert not np.array_equal(oai_ranks[0][0]["updates"][0]["queries"], oai_ranks[1][0]["updates"][0]["queries"])
    assert not np.array_equal(oai_ranks[0][1]["permutations"][0], oai_ranks[1][1]["permutations"][0])
    assert np.array_equal(oai_ranks[0][1]["label_orders"][0], oai_ranks[1][1]["label_orders"][0])
