"""Tests of lm_human_preference_details.ppo against TensorFlow and plain float64 loops.

The TensorFlow references below are written for this test from OAI's TF1 code (cited per
function) and run in `tf.compat.v1` graph mode with placeholders, each in its own `tf.Graph`, so
nothing here switches TensorFlow's global eager mode off for other test files.
"""

import os
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # TensorFlow: errors only

import numpy as np
import pytest
import tensorflow as tf
import torch

from lm_human_preference_details import ppo

tf1 = tf.compat.v1

B, T, V = 8, 24, 16
# OAI: lm_human_preferences/train_policy.py#L53-L57
HP = dict(gamma=1.0, lam=0.95, cliprange=0.2, cliprange_value=0.2, vf_coef=0.1)
OAI_STAT_KEYS = {  # OAI: lm_human_preferences/train_policy.py#L201-L206
    "loss/policy", "loss/value", "loss/total",
    "policy/entropy", "policy/approxkl", "policy/clipfrac",
    "returns/mean", "returns/var",
    "val/vpred", "val/error", "val/clipfrac", "val/mean", "val/var",
}  # fmt: skip
TF_DTYPE = {np.float32: tf.float32, np.float64: tf.float64}
TORCH_DTYPE = {np.float32: torch.float32, np.float64: torch.float64}
TOL = {np.float32: dict(rtol=1e-5, atol=1e-5), np.float64: dict(rtol=1e-10, atol=1e-10)}


# ----------------------------------------------------------------------------- TF references
def tf_whiten(x, shift_mean=True):
    """TF's whiten (# OAI: lm_human_preferences/utils/core.py#L336-L341)."""
    mean, var = tf.nn.moments(x, axes=list(range(x.shape.rank)))
    out = (x - mean) * tf.math.rsqrt(var + 1e-8)
    return out + mean if not shift_mean else out


def tf_entropy_from_logits(logits):
    """TF's entropy_from_logits (# OAI: lm_human_preferences/utils/core.py#L290-L292)."""
    probs = tf.nn.softmax(logits, axis=-1)
    return tf.math.reduce_logsumexp(logits, axis=-1) - tf.reduce_sum(probs * logits, axis=-1)


def tf_oai_loss(values, old_logprob, rewards, logprob, vpred, entropies, *, whiten_rewards, n_tokens):
    """`PPOTrainer.loss` (# OAI: lm_human_preferences/train_policy.py#L319-L372), in TF graph ops.

    The policy's forward pass (`analyze_responses_op`) is replaced by the fed tensors `logprob`,
    `vpred` and `entropies` (B, T), so only the loss arithmetic is compared.
    """
    if whiten_rewards:
        rewards = tf_whiten(rewards, shift_mean=False)
    gae, adv_rev = 0.0, []
    for t in range(n_tokens - 1, -1, -1):
        v_next = values[:, t + 1] if t + 1 < n_tokens else 0.0
        gae = rewards[:, t] + HP["gamma"] * v_next - values[:, t] + HP["gamma"] * HP["lam"] * gae
        adv_rev.append(gae)
    advantages = tf.stack(adv_rev[::-1], axis=1)
    returns = advantages + values
    advantages = tf.stop_gradient(tf_whiten(advantages))

    vclip = tf.clip_by_value(vpred, values - HP["cliprange_value"], values + HP["cliprange_value"])
    vf1, vf2 = tf.square(vpred - returns), tf.square(vclip - returns)
    vf_loss = 0.5 * tf.reduce_mean(tf.maximum(vf1, vf2))
    vf_clipfrac = tf.reduce_mean(tf.cast(tf.greater(vf2, vf1), values.dtype))

    ratio = tf.exp(logprob - old_logprob)
    pg1 = -advantages * ratio
    pg2 = -advantages * tf.clip_by_value(ratio, 1.0 - HP["cliprange"], 1.0 + HP["cliprange"])
    pg_loss = tf.reduce_mean(tf.maximum(pg1, pg2))
    pg_clipfrac = tf.reduce_mean(tf.cast(tf.greater(pg2, pg1), values.dtype))
    loss = pg_loss + HP["vf_coef"] * vf_loss

    ret_mean, ret_var = tf.nn.moments(returns, axes=[0, 1])
    val_mean, val_var = tf.nn.moments(values, axes=[0, 1])
    stats = {
        "loss/policy": pg_loss, "loss/value": vf_loss, "loss/total": loss,
        "policy/entropy": tf.reduce_mean(entropies),
        "policy/approxkl": 0.5 * tf.reduce_mean(tf.square(logprob - old_logprob)),
        "policy/clipfrac": pg_clipfrac,
        "returns/mean": ret_mean, "returns/var": ret_var,
        "val/vpred": tf.reduce_mean(vpred), "val/error": tf.reduce_mean(tf.square(vpred - returns)),
        "val/clipfrac": vf_clipfrac, "val/mean": val_mean, "val/var": val_var,
    }  # fmt: skip
    return loss, stats


def run_tf(build, feeds, dtype):
    """Build `build(*placeholders)` in a fresh graph, run it on `feeds` (numpy arrays), return numpy."""
    with tf.Graph().as_default():
        phs = [tf1.placeholder(TF_DTYPE[dtype], shape=a.shape) for a in feeds]
        fetches = build(*phs)
        with tf1.Session() as sess:
            return sess.run(fetches, feed_dict=dict(zip(phs, feeds)))


def rollouts(dtype, seed=0):
    """Seeded random rollouts shaped like OAI's: (B, T) tensors, rewards from compute_rewards."""
    rng = np.random.default_rng(seed)
    old_logprobs = -np.abs(rng.normal(0.0, 2.0, (B, T)))
    ref_logprobs = old_logprobs + rng.normal(0.0, 0.3, (B, T))
    scores = rng.normal(0.0, 1.0, (B,))
    rewards, _ = ppo.compute_rewards(
        torch.from_numpy(scores), torch.from_numpy(old_logprobs), torch.from_numpy(ref_logprobs), 0.15
    )
    data = dict(
        values=rng.normal(0.5, 1.0, (B, T)),
        old_logprobs=old_logprobs,
        rewards=rewards.numpy(),
        logprobs=old_logprobs + rng.normal(0.0, 0.2, (B, T)),  # enough drift that the ratio clips
        vpred=rng.normal(0.5, 1.0, (B, T)),  # far from the rollout values: the value clip bites
        logits=rng.normal(0.0, 2.0, (B, T, V)),
    )
    return {k: v.astype(dtype) for k, v in data.items()}


# ----------------------------------------------------------------------------- whiten
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(B, T), (3, 4, 5), (7,)])
@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_matches_tf_moments(shift_mean, shape, dtype):
    x = np.random.default_rng(1).normal(3.0, 2.0, shape).astype(dtype)
    expected = run_tf(lambda p: tf_whiten(p, shift_mean=shift_mean), [x], dtype)
    got = ppo.whiten(torch.from_numpy(x), shift_mean=shift_mean)
    assert got.dtype == TORCH_DTYPE[dtype]
    np.testing.assert_allclose(got.numpy(), expected, **TOL[dtype])
    # population variance: the result has variance 1 when divided by N (not N - 1)
    assert abs(got.double().var(correction=0).item() - 1.0) < 1e-5
    assert abs(got.double().mean().item() - (0.0 if shift_mean else x.astype(np.float64).mean())) < 1e-5


# ----------------------------------------------------------------------------- KL controllers
def test_fixed_kl_controller_never_moves():
    ctl = ppo.FixedKLController(0.15)
    for kl in [0.0, 6.0, 100.0, torch.tensor(3.0)]:
        ctl.update(kl, 512)
        assert ctl.value == 0.15


def test_adaptive_kl_controller_sequence():
    # OAI's sentiment run, and its default horizon:
    # OAI: launch.py#L116-L138
    # OAI: lm_human_preferences/train_policy.py#L28
    target, horizon, n_steps, init = 6.0, 10000, 512, 0.15
    kls = [6.0, 9.0, 3.0, 7.0, 5.5, 100.0, 0.0, 6.6, 4.8, 7.2, 6.3]
    # kl / target - 1, clipped to [-0.2, 0.2], worked out by hand for each kl above
    errors = np.array([0.0, 0.2, -0.2, 1 / 6, -1 / 12, 0.2, -0.2, 0.1, -0.2, 0.2, 0.05])
    expected = init * np.cumprod(1.0 + errors * n_steps / horizon)

    ctl = ppo.AdaptiveKLController(init, target=target, horizon=horizon)
    got = []
    for i, kl in enumerate(kls):
        ctl.update(torch.tensor(kl, dtype=torch.float64) if i % 2 else kl, n_steps)  # floats or 0-d tensors
        assert isinstance(ctl.value, float)
        got.append(ctl.value)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)
    assert got[1] / got[0] == pytest.approx(1 + 0.2 * 512 / 10000)  # kl 9 -> +50%, clipped to +20%
    assert got[6] / got[5] == pytest.approx(1 - 0.2 * 512 / 10000)  # kl 0 -> -100%, clipped to -20%


# ----------------------------------------------------------------------------- rewards
def test_compute_rewards_hand_example():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]])
    ref_logprobs = torch.tensor([[-1.5, -2.0, -2.0], [-1.0, 0.0, -0.5]])  # kl = [[.5, 0, -1], [.5, -.5, 0]]
    scores = torch.tensor([1.0, -2.0])
    rewards, non_score = ppo.compute_rewards(scores, logprobs, ref_logprobs, kl_coef=0.2)
    torch.testing.assert_close(non_score, torch.tensor([[-0.1, 0.0, 0.2], [-0.1, 0.1, 0.0]]))
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, 0.0, 1.2], [-0.1, 0.1, -2.0]]))
    assert rewards.data_ptr() != non_score.data_ptr()  # the score is not added into non_score_reward


# ----------------------------------------------------------------------------- GAE
def gae_loop(values, rewards, gamma, lam):
    """GAE as a plain float64 Python loop over rows and tokens."""
    values, rewards = np.asarray(values, np.float64), np.asarray(rewards, np.float64)
    adv = np.zeros_like(values)
    for b in range(values.shape[0]):
        running = 0.0
        for t in reversed(range(values.shape[1])):
            next_value = values[b, t + 1] if t + 1 < values.shape[1] else 0.0
            running = rewards[b, t] + gamma * next_value - values[b, t] + gamma * lam * running
            adv[b, t] = running
    return adv, adv + values


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.95), (0.9, 0.5), (1.0, 1.0), (1.0, 0.0)])
def test_gae_matches_float64_loop(gamma, lam, dtype):
    data = rollouts(dtype)
    adv, ret = ppo.compute_advantages(
        torch.from_numpy(data["values"]), torch.from_numpy(data["rewards"]), gamma=gamma, lam=lam
    )
    exp_adv, exp_ret = gae_loop(data["values"], data["rewards"], gamma, lam)
    assert adv.dtype == ret.dtype == TORCH_DTYPE[dtype]
    np.testing.assert_allclose(adv.numpy(), exp_adv, **TOL[dtype])
    np.testing.assert_allclose(ret.numpy(), exp_ret, **TOL[dtype])


def test_gae_properties():
    data = rollouts(np.float64)
    values, rewards = torch.from_numpy(data["values"]), torch.from_numpy(data["rewards"])
    # the defaults are OAI's gamma = 1, lam = 0.95, and they matter
    # OAI: lm_human_preferences/train_policy.py#L56-L57
    default = ppo.compute_advantages(values, rewards)
    torch.testing.assert_close(default, ppo.compute_advantages(values, rewards, 1.0, 0.95))
    assert not torch.allclose(default[0], ppo.compute_advantages(values, rewards, 0.99, 0.95)[0])
    assert not torch.allclose(default[0], ppo.compute_advantages(values, rewards, 1.0, 0.9)[0])
    # gamma = lam = 1: returns are the reward-to-go, whatever the values
    _, ret = ppo.compute_advantages(values, rewards, 1.0, 1.0)
    torch.testing.assert_close(ret, rewards.flip(1).cumsum(1).flip(1))
    # lam = 0: one-step TD errors, with a value of 0 after the last token
    adv, _ = ppo.compute_advantages(values, rewards, 0.9, 0.0)
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    torch.testing.assert_close(adv, rewards + 0.9 * next_values - values)
    # causality: a reward at token k changes no advantage after k
    k, bumped = 10, rewards.clone()
    bumped[:, k] += 5.0
    adv2, _ = ppo.compute_advantages(values, bumped)
    torch.testing.assert_close(adv2[:, k + 1 :], default[0][:, k + 1 :])
    assert (adv2[:, : k + 1] > default[0][:, : k + 1]).all()


# ----------------------------------------------------------------------------- entropy
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_entropy_from_logits_matches_tf(dtype):
    logits = rollouts(dtype)["logits"]
    expected = run_tf(tf_entropy_from_logits, [logits], dtype)
    got = ppo.entropy_from_logits(torch.from_numpy(logits))
    assert got.shape == (B, T)
    np.testing.assert_allclose(got.numpy(), expected, **TOL[dtype])
    naive = -(torch.from_numpy(logits).softmax(-1) * torch.from_numpy(logits).log_softmax(-1)).sum(-1)
    np.testing.assert_allclose(got.numpy(), naive.numpy(), **TOL[dtype])


# ----------------------------------------------------------------------------- the PPO loss vs OAI's loss()
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("whiten_rewards", [True, False])
def test_ppo_loss_matches_oai_tf(whiten_rewards, dtype):
    data = rollouts(dtype, seed=2)
    feeds = [data[k] for k in ["values", "old_logprobs", "rewards", "logprobs", "vpred", "logits"]]

    def build(values, old_logprob, rewards, logprob, vpred, logits):
        loss, stats = tf_oai_loss(
            values, old_logprob, rewards, logprob, vpred, tf_entropy_from_logits(logits),
            whiten_rewards=whiten_rewards, n_tokens=T,
        )  # fmt: skip
        return loss, stats, tf.gradients(loss, [logprob, vpred])

    tf_loss, tf_stats, (tf_dlogprob, tf_dvpred) = run_tf(build, feeds, dtype)

    t = {k: torch.from_numpy(v) for k, v in data.items()}
    logprobs, vpred = t["logprobs"].requires_grad_(), t["vpred"].requires_grad_()
    advantages, returns = ppo.minibatch_advantages(
        t["values"], t["rewards"], HP["gamma"], HP["lam"], whiten_rewards=whiten_rewards
    )
    loss, stats = ppo.ppo_loss(
        logprobs, vpred, t["old_logprobs"], t["values"], advantages, returns,
        cliprange=HP["cliprange"], cliprange_value=HP["cliprange_value"], vf_coef=HP["vf_coef"],
        entropy=ppo.entropy_from_logits(t["logits"]),
    )  # fmt: skip
    loss.backward()

    assert set(stats) == OAI_STAT_KEYS == set(tf_stats)
    for key, value in stats.items():
        assert value.dim() == 0 and value.dtype == TORCH_DTYPE[dtype] and not value.requires_grad, key
        np.testing.assert_allclose(value.numpy(), tf_stats[key], **TOL[dtype], err_msg=key)
    np.testing.assert_allclose(loss.detach().numpy(), tf_loss, **TOL[dtype])
    np.testing.assert_allclose(logprobs.grad.numpy(), tf_dlogprob, **TOL[dtype])
    np.testing.assert_allclose(vpred.grad.numpy(), tf_dvpred, **TOL[dtype])
    # the data exercises both clips, so a wrong clip direction or bound would show
    for key in ["policy/clipfrac", "val/clipfrac"]:
        assert 0.05 < stats[key].item() < 0.95, (key, stats[key].item())


def test_ppo_loss_without_entropy_and_at_ratio_one():
    data = {k: torch.from_numpy(v) for k, v in rollouts(np.float32, seed=3).items()}
    advantages, returns = ppo.minibatch_advantages(data["values"], data["rewards"])
    # first minibatch of an epoch: the policy and values are the rollout's own
    loss, stats = ppo.ppo_loss(
        data["old_logprobs"], data["values"], data["old_logprobs"], data["values"], advantages, returns,
        cliprange=0.2, cliprange_value=0.2, vf_coef=0.1,
    )  # fmt: skip
    assert set(stats) == OAI_STAT_KEYS - {"policy/entropy"}
    assert stats["policy/approxkl"].item() == 0.0
    assert stats["policy/clipfrac"].item() == 0.0 and stats["val/clipfrac"].item() == 0.0
    # whitened advantages have mean 0, so at ratio 1 the policy loss is ~0
    assert abs(stats["loss/policy"].item()) < 1e-6
    expected_vf = 0.5 * ((data["values"] - returns) ** 2).mean()
    torch.testing.assert_close(stats["loss/value"], expected_vf)
    torch.testing.assert_close(loss, stats["loss/policy"] + 0.1 * expected_vf)


def test_ratio_diagnostics_and_their_reduction_over_minibatches():
    new = torch.tensor([[0.0, -1.0], [-2.0, -0.5]])
    old = torch.tensor([[0.0, -1.5], [-1.0, -0.5]])
    stats = ppo.ratio_diagnostics(new, old)
    diff = torch.tensor([0.0, 0.5, -1.0, 0.0])
    torch.testing.assert_close(stats["policy/logprob_diff_mean"], diff.mean())
    torch.testing.assert_close(stats["policy/logprob_diff_var"], diff.var(correction=0))
    torch.testing.assert_close(stats["policy/ratio_max"], torch.exp(torch.tensor(0.5)))
    torch.testing.assert_close(stats["policy/ratio_min"], torch.exp(torch.tensor(-1.0)))
    torch.testing.assert_close(stats["policy/ratio_mean"], diff.exp().mean())
    reduced = ppo.reduce_minibatch_stats(
        {
            "policy/ratio_max": [torch.tensor(1.2), torch.tensor(1.5)],
            "policy/ratio_min": [torch.tensor(0.9), torch.tensor(0.7)],
            "policy/approxkl": [torch.tensor(0.1), torch.tensor(0.3)],
        }
    )
    assert reduced["policy/ratio_max"].item() == pytest.approx(1.5) and reduced[
        "policy/ratio_min"
    ].item() == pytest.approx(0.7)
    assert reduced["policy/approxkl"].item() == pytest.approx(0.2)  # OAI's mean for everything else


def test_micro_batch_stats_merge_into_the_stats_of_the_whole_minibatch():
    """Gradient accumulation splits a minibatch in 4: its merged stats are those of the minibatch in one piece
    (a mean of the parts' variances would leave out how the parts differ)."""
    generator = torch.Generator().manual_seed(0)
    data = {
        name: torch.randn(8, 5, generator=generator) + shift
        for name, shift in (
            ("logprobs", -1.0),
            ("values", 0.0),
            ("old_logprobs", -1.0),
            ("old_values", 3.0),
            ("advantages", 0.0),
            ("returns", 1.0),
        )
    }
    data["old_values"][4:] += 2.0  # parts that differ: their variances alone miss that

    def stats_of(rows):
        _, stats = ppo.ppo_loss(
            *(
                data[name][rows]
                for name in ("logprobs", "values", "old_logprobs", "old_values", "advantages", "returns")
            ),
            cliprange=0.2,
            cliprange_value=0.2,
            vf_coef=0.1,
        )
        return {**stats, **ppo.ratio_diagnostics(data["logprobs"][rows], data["old_logprobs"][rows])}

    whole = stats_of(slice(0, 8))
    merged = ppo.merge_micro_batch_stats([stats_of(slice(i, i + 2)) for i in range(0, 8, 2)])
    assert merged.keys() == whole.keys()
    for key, value in whole.items():
        torch.testing.assert_close(merged[key], value, msg=key)
    assert set(ppo.MEAN_OF_VARIANCE) <= whole.keys() and set(ppo.MEAN_OF_VARIANCE.values()) <= whole.keys()


def test_stats_reduce_across_processes_as_stat_reduction_says_though_the_all_reduce_has_no_min():
    """Two processes (threads here) combine their stats through an all-reduce with accelerate's semantics (`mean`:
    the sum over processes divided by their number; `max`): means average, maxima and minima are the extremes."""
    keys = ("objective/kl", "ppo/policy/ratio_max", "ppo/policy/ratio_min", "ppo/policy/logprob_diff_min")
    local = [dict(zip(keys, (1.0, 1.5, 0.5, -2.0))), dict(zip(keys, (4.0, 1.25, 0.75, -3.0)))]
    barrier, posted, results = threading.Barrier(2, timeout=30), [None, None], [None, None]

    def all_reduce_of(rank):
        def all_reduce(tensor, reduction):
            posted[rank] = tensor
            barrier.wait()  # both processes have posted theirs
            stacked = torch.stack(posted)
            reduced = stacked.max(0).values if reduction == "max" else stacked.sum(0) / len(stacked)
            barrier.wait()  # both have read the other's before either posts again
            return reduced

        return all_reduce

    def process(rank):
        stats = {k: torch.tensor(v) for k, v in local[rank].items()}
        results[rank] = ppo.reduce_across_processes(stats, all_reduce_of(rank))

    threads = [threading.Thread(target=process, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    expected = dict(zip(keys, (2.5, 1.5, 0.5, -3.0)))
    assert results[0] == expected and results[1] == expected
