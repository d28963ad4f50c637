"""The PPO mathematics of OpenAI's lm-human-preferences, as pure tensor functions.

Follows `PPOTrainer` in `lm_human_preferences/train_policy.py` and `whiten` /
`entropy_from_logits` in `lm_human_preferences/utils/core.py` of `openai/lm-human-preferences`
(master `cbfd210`, TF1). Every function takes tensors and returns tensors (the KL controllers
hold one Python float); nothing here touches models, files, processes or the network, so the
stage scripts own the batching, the all-reduces (`reduce_across_processes` is given one) and the logging.

Shapes: B = rollouts in the (mini)batch, T = response_length, V = vocabulary size.

Order of one OAI minibatch step (the top of `PPOTrainer.loss`,
# OAI: lm_human_preferences/train_policy.py#L319-L372):

    advantages, returns = minibatch_advantages(old_values, rewards, gamma, lam, whiten_rewards)
    loss, stats = ppo_loss(logprobs, values, old_logprobs, old_values, advantages, returns, ...)

OAI whitens rewards, runs GAE and whitens advantages *inside* `loss()`, i.e. on every
minibatch of every epoch. Here those steps live in `minibatch_advantages`, which the caller runs
on each minibatch, and `ppo_loss` takes the advantages as given: the loss stays the textbook
clipped objective and the whitening is visible in the training loop. With nminibatches=1
(the OAI default for the books tasks) whitening per minibatch equals whitening the whole batch.
"""

from collections.abc import Callable

import torch
from torch import Tensor


def whiten(values: Tensor, shift_mean: bool = True) -> Tensor:
    """Normalize `values` to mean 0 and variance 1 over all of its elements.

    values: any shape, e.g. (B, T). Returns the same shape.
    Mean and variance are taken over every element, the variance is the population one
    (divide by N, as `tf.nn.moments`), and 1e-8 is added before the reciprocal square root.
    With shift_mean=False the mean is added back: only the scale changes (OAI uses this for
    rewards, so that their sign is kept: # OAI: lm_human_preferences/train_policy.py#L325).
    """
    # OAI: lm_human_preferences/utils/core.py#L336-L341
    mean = values.mean()
    var = values.var(correction=0)  # tf.nn.moments: population variance
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


class FixedKLController:
    """A constant KL coefficient: `value` never changes."""

    # OAI: lm_human_preferences/train_policy.py#L107-L112
    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current: float, n_steps: int) -> None:
        """No-op; the signature matches AdaptiveKLController.update."""


class AdaptiveKLController:
    """KL coefficient steered towards a target KL (Ziegler et al. 2019, eq. 2).

    After every PPO batch: `err = clip(current / target - 1, -0.2, 0.2)` and
    `value *= 1 + err * n_steps / horizon`, where `current` is the batch's mean summed KL
    (`objective/kl`, all-reduced over ranks) and `n_steps` the number of episodes in the batch
    (OAI passes `ppo.batch_size`: # OAI: lm_human_preferences/train_policy.py#L305). `horizon` is in episodes.
    """

    # OAI: lm_human_preferences/train_policy.py#L115-L124
    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current: float, n_steps: int) -> None:
        """current: a Python float or a 0-d tensor; n_steps: episodes since the last update."""
        proportional_error = min(max(float(current) / self.target - 1.0, -0.2), 0.2)
        mult = 1.0 + proportional_error * n_steps / self.horizon
        self.value *= mult


def compute_rewards(scores: Tensor, logprobs: Tensor, ref_logprobs: Tensor, kl_coef: float) -> tuple[Tensor, Tensor]:
    """Per-token rewards: a KL penalty on every token, the score added on the last one.

    scores: (B,) reward-model scores of the (post-processed) responses.
    logprobs, ref_logprobs: (B, T) logprobs of the sampled tokens under the policy that sampled
        them and under the reference policy, both at the sampling temperature.
    kl_coef: the KL controller's current value.
    Returns (rewards, non_score_reward), both (B, T):
        non_score_reward = -kl_coef * (logprobs - ref_logprobs)
        rewards = non_score_reward, plus scores at t = T - 1.
    """
    # OAI: lm_human_preferences/train_policy.py#L150-L153
    kl = logprobs - ref_logprobs  # (B, T)
    non_score_reward = -kl_coef * kl  # (B, T)
    rewards = non_score_reward.clone()
    rewards[:, -1] += scores
    return rewards, non_score_reward


def compute_advantages(values: Tensor, rewards: Tensor, gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over the response tokens.

    values: (B, T) value estimates of the rollout (the policy that sampled it).
    rewards: (B, T) per-token rewards (OAI's are whitened first, see `minibatch_advantages`).
    gamma, lam: discount and GAE lambda; OAI's defaults are 1 and 0.95
        (# OAI: lm_human_preferences/train_policy.py#L56-L57).
    Returns (advantages, returns), both (B, T), not whitened:
        delta_t = r_t + gamma * V_{t+1} - V_t, with V_T = 0 (the episode ends after the response)
        A_t = delta_t + gamma * lam * A_{t+1}
        returns = A + V
    """
    # OAI: lm_human_preferences/train_policy.py#L327-L336
    T = rewards.shape[1]
    lastgaelam = torch.zeros_like(rewards[:, 0])  # (B,)
    advantages_reversed = []
    for t in reversed(range(T)):
        nextvalues = values[:, t + 1] if t < T - 1 else torch.zeros_like(values[:, t])
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]  # (B,)
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)  # (B, T)
    returns = advantages + values
    return advantages, returns


def minibatch_advantages(
    values: Tensor, rewards: Tensor, gamma: float = 1.0, lam: float = 0.95, whiten_rewards: bool = True
) -> tuple[Tensor, Tensor]:
    """OAI's per-minibatch preprocessing at the top of `loss()`: whiten rewards, GAE, whiten advantages.

    values: (B, T) rollout values; rewards: (B, T) from `compute_rewards`; B is the minibatch.
    Returns (advantages, returns), both (B, T):
      1. if whiten_rewards, rewards are scaled to unit variance with their mean kept;
      2. GAE on those rewards; returns = advantages + values, so the value target
         is built from the whitened rewards but the un-whitened advantages;
      3. advantages whitened with their mean removed, and detached.
    """
    if whiten_rewards:  # OAI: lm_human_preferences/train_policy.py#L324-L325
        rewards = whiten(rewards, shift_mean=False)
    # OAI: lm_human_preferences/train_policy.py#L327-L336
    advantages, returns = compute_advantages(values, rewards, gamma, lam)
    advantages = whiten(advantages).detach()  # OAI: lm_human_preferences/train_policy.py#L338-L339
    return advantages, returns


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution given by `logits`, over the last axis.

    logits: (..., V), already divided by the temperature (# OAI: lm_human_preferences/policy.py#L121).
    Returns (...).
    Equivalent to `-(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)`.
    """
    # OAI: lm_human_preferences/utils/core.py#L290-L292
    # OAI: lm_human_preferences/policy.py#L124 (where the policy takes its entropy with it)
    pd = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (pd * logits).sum(dim=-1)


def _moments(x: Tensor) -> tuple[Tensor, Tensor]:
    """`tf.nn.moments` over all axes: (mean, population variance), both 0-d."""
    return x.mean(), x.var(correction=0)


def ratio_diagnostics(logprobs: Tensor, old_logprobs: Tensor) -> dict[str, Tensor]:
    """How far one minibatch's update moved the policy, beyond OAI's approxkl and clipfrac: mean,
    population variance, max and min of the ratio pi/pi_old and of the logprob difference over all
    B*T tokens (the N-implementation-details post compares TF-style and torch Adam with these).
    Detached 0-d tensors; over minibatches and processes they reduce as `stat_reduction` says."""
    with torch.no_grad():
        diff = logprobs - old_logprobs
        stats = {}
        for name, x in (("ratio", torch.exp(diff)), ("logprob_diff", diff)):
            mean, var = _moments(x)
            stats.update(
                {
                    f"policy/{name}_mean": mean,
                    f"policy/{name}_var": var,
                    f"policy/{name}_max": x.max(),
                    f"policy/{name}_min": x.min(),
                }
            )
        return stats


def stat_reduction(key: str) -> str:
    """How a stat combines over minibatches, epochs and processes: `max` for `*_max` keys, `min` for
    `*_min`, else OAI's `mean`."""
    return "max" if key.endswith("_max") else "min" if key.endswith("_min") else "mean"


def reduce_minibatch_stats(stats: dict[str, list[Tensor]]) -> dict[str, Tensor]:
    """One value per key over the minibatches (and epochs) of a batch (`stat_reduction`)."""
    reduce = {"max": torch.max, "min": torch.min, "mean": torch.mean}
    return {k: reduce[stat_reduction(k)](torch.stack(v)) for k, v in stats.items()}


def reduce_across_processes(stats: dict[str, Tensor], all_reduce: Callable[[Tensor, str], Tensor]) -> dict[str, float]:
    """Each process's 0-d stats combined over all processes as `stat_reduction` says; the same floats on every one.

    `all_reduce(tensor, "max" | "mean")`: elementwise over the processes, as `accelerate.Accelerator.reduce`, called
    once per reduction with the stats stacked. It has no min: a min is the negated max of the negated stats.
    """
    sign = {k: -1.0 if stat_reduction(k) == "min" else 1.0 for k in stats}
    by_reduction = {
        "max": sorted(k for k in stats if stat_reduction(k) != "mean"),
        "mean": sorted(k for k in stats if stat_reduction(k) == "mean"),
    }
    reduced = {}
    for reduction, keys in by_reduction.items():
        if keys:
            values = all_reduce(torch.stack([sign[k] * stats[k].float() for k in keys]), reduction)
            reduced.update({k: sign[k] * float(v) for k, v in zip(keys, values)})
    return reduced


# the population variances among the stats, and the means they go with
MEAN_OF_VARIANCE = {
    "returns/var": "returns/mean",
    "val/var": "val/mean",
    "policy/ratio_var": "policy/ratio_mean",
    "policy/logprob_diff_var": "policy/logprob_diff_mean",
}


def merge_micro_batch_stats(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """One minibatch's stats from those of its equal-sized micro-batches (gradient accumulation): the stats
    of the minibatch in one piece. Means and extremes reduce as `stat_reduction` says; a variance is the
    mean of the parts' variances plus the variance of their means (the mean alone would leave out how the
    micro-batches differ)."""
    merged = reduce_minibatch_stats({k: [part[k] for part in parts] for k in parts[0]})
    for variance, mean in MEAN_OF_VARIANCE.items():
        if variance in merged:
            merged[variance] = merged[variance] + torch.stack([part[mean] for part in parts]).var(correction=0)
    return merged


def ppo_loss(
    logprobs: Tensor,
    values: Tensor,
    old_logprobs: Tensor,
    old_values: Tensor,
    advantages: Tensor,
    returns: Tensor,
    cliprange: float,
    cliprange_value: float,
    vf_coef: float,
    entropy: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped PPO policy loss plus PPO2-style clipped value loss, and OAI's minibatch stats.

    logprobs: (B, T) logprobs of the rollout's tokens under the current policy (temperature-scaled).
    values: (B, T) current value predictions (OAI's `vpred`).
    old_logprobs, old_values: (B, T) the same, recorded when the rollout was sampled.
    advantages: (B, T) used as given; OAI whitens them per minibatch first, so pass the output of
        `minibatch_advantages` (see the module docstring for why the whitening lives there).
    returns: (B, T) value targets.
    cliprange, cliprange_value: PPO's epsilon for the ratio and for the value change.
    vf_coef: weight of the value loss.
    entropy: optional (B, T) per-token entropies of the current policy (`entropy_from_logits`);
        only logged, as `policy/entropy`, never part of the loss. Omitted from stats when None.

    Returns (loss, stats). loss is a 0-d tensor carrying gradients. stats maps OAI's metric names
    (log them as `ppo/{key}`; OAI averages each over all minibatches and epochs of a batch) to
    detached 0-d tensors. Means are plain means over all B*T tokens; `returns/*` and `val/mean`,
    `val/var` are `tf.nn.moments` (population variance), and `val/mean`, `val/var` describe the
    *rollout* values (old_values), while `val/vpred` and `val/error` use the current ones.
    """
    # OAI: lm_human_preferences/train_policy.py#L343-L348 (value loss, clipped as in PPO2)
    vpredclipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    vf_losses1 = (values - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    vf_loss = 0.5 * torch.maximum(vf_losses1, vf_losses2).mean()
    vf_clipfrac = (vf_losses2 > vf_losses1).to(values.dtype).mean()

    # OAI: lm_human_preferences/train_policy.py#L350-L355 (policy loss)
    ratio = torch.exp(logprobs - old_logprobs)  # (B, T)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = torch.maximum(pg_losses, pg_losses2).mean()
    pg_clipfrac = (pg_losses2 > pg_losses).to(logprobs.dtype).mean()

    # OAI: lm_human_preferences/train_policy.py#L357
    loss = pg_loss + vf_coef * vf_loss

    # OAI: lm_human_preferences/train_policy.py#L359-L371 (stats)
    with torch.no_grad():
        approxkl = 0.5 * ((logprobs - old_logprobs) ** 2).mean()
        return_mean, return_var = _moments(returns)
        value_mean, value_var = _moments(old_values)
        stats = {
            "loss/policy": pg_loss.detach(),
            "loss/value": vf_loss.detach(),
            "loss/total": loss.detach(),
        }
        if entropy is not None:
            stats["policy/entropy"] = entropy.detach().mean()
        stats.update(
            {
                "policy/approxkl": approxkl,
                "policy/clipfrac": pg_clipfrac,
                "returns/mean": return_mean,
                "returns/var": return_var,
                "val/vpred": values.detach().mean(),
                "val/error": ((values.detach() - returns) ** 2).mean(),
                "val/clipfrac": vf_clipfrac,
                "val/mean": value_mean,
                "val/var": value_var,
            }
        )
    return loss, stats
