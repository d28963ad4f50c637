"""Group-relative advantages and PipelineRL's off-policy policy-gradient losses, as pure tensor functions.

Follows `rl_step` and `populate_rl_data` in `pipelinerl/finetune/rl/__init__.py` of
`ServiceNow/PipelineRL` and the PipelineRL paper (arXiv 2509.19128). As in `ppo.py`, every function
takes tensors and returns tensors; nothing here touches models, files, processes or the network, so
the training script owns the batching, the packing, the all-reduces and the logging.

Shapes: n = rollouts in the whole batch (groups of `group_size` consecutive rollouts of one prompt),
B = rollouts in a (micro-)batch, T = tokens per row.

One optimizer step of PipelineRL's recipe:

    adv = group_advantages(rewards, group_size)                      # (n,), computed once per batch
    for micro_batch in split(batch):                                 # any split, packed or not
        loss, stats = policy_loss(new_lp, behaviour_lp, adv[rows], mask, num_sequences=n)
        loss.backward()                                              # gradients add up over micro-batches
    optimizer.step()

The loss is a sum over tokens divided by `num_sequences`, the number of sequences in the whole
optimizer batch, so the micro-batch losses add up to the full-batch loss and long answers weigh more
than short ones (no per-sequence length normalisation), as in PipelineRL.
"""

from typing import Literal

import torch
from torch import Tensor


def group_advantages(
    rewards: Tensor,
    group_size: int,
    baseline: Literal["mean", "leave_one_out"] = "mean",
    divide_by_std: bool = False,
    eps: float = 1e-4,
) -> Tensor:
    """Advantage of each rollout relative to the other rollouts of its prompt.

    rewards: (n,) one scalar reward per rollout; consecutive blocks of `group_size` rows are the
        groups (the rollouts of one prompt), so n must be a multiple of group_size.
    baseline:
        "mean": A_i = r_i - mean_group(r) (GRPO, DeepSeekMath arXiv 2402.03300; PipelineRL paper).
        "leave_one_out": A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_group(r))
            (RLOO, arXiv 2402.14740; PipelineRL's `populate_rl_data`). Needs group_size >= 2.
    divide_by_std: divide by (std_group(r) + eps). The std is the sample standard deviation, with
        Bessel's correction (divide by G - 1, `torch.std`'s default): that is what TRL's
        GRPOTrainer (`rewards.view(-1, G).std(dim=1)`) and PipelineRL (pandas `std`, ddof=1) use, so
        the numbers match the published implementations. Needs group_size >= 2. A group whose
        rewards are all equal has std 0 and gets advantage 0 either way. PipelineRL's default is
        no std division (REFERENCE.md, "PipelineRL facts").
    eps: added to the std before dividing (TRL and PipelineRL use 1e-4).
    Returns (n,) advantages, detached, in the dtype of `rewards`.
    Raises ValueError when rewards is not 1-D, n % group_size != 0, group_size < 1, or
    group_size < 2 for leave_one_out or divide_by_std.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (one reward per rollout), got shape {tuple(rewards.shape)}")
    n = rewards.shape[0]
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if n % group_size != 0:
        raise ValueError(
            f"{n} rewards do not split into groups of {group_size} ({n} % {group_size} = {n % group_size})"
        )
    if baseline not in ("mean", "leave_one_out"):
        raise ValueError(f"unknown baseline {baseline!r}; expected 'mean' or 'leave_one_out'")
    if baseline == "leave_one_out" and group_size < 2:
        raise ValueError(f"leave_one_out needs group_size >= 2, got {group_size}")
    if divide_by_std and group_size < 2:
        raise ValueError(f"divide_by_std needs group_size >= 2 for a sample std, got {group_size}")

    r = rewards.detach().view(n // group_size, group_size)  # (groups, G)
    mean = r.mean(dim=1, keepdim=True)
    adv = r - mean
    if baseline == "leave_one_out":
        # PipelineRL: populate_rl_data, loo_mean = (group_sum - r_i) / (G - 1);
        # r_i - loo_mean = r_i - (G * mean - r_i) / (G - 1) = G / (G - 1) * (r_i - mean)
        adv = adv * (group_size / (group_size - 1))
    if divide_by_std:
        # TRL GRPOTrainer / PipelineRL: (A) / (std + eps), std with Bessel's correction
        adv = adv / (r.std(dim=1, keepdim=True, correction=1) + eps)
    return adv.reshape(n)


# PipelineRL: RLConfig.clamp_log_ratio_ref_new_value, the bound on log ref(x) - log p(x) in the KL penalty
REF_LOG_RATIO_CLAMP = 10.0


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor, max_log_ratio: float | None = None) -> Tensor:
    """Schulman's k3 estimator of KL(p || ref), elementwise: exp(ref - p) - (ref - p) - 1.

    logprobs: log p(x) of tokens x sampled from p; ref_logprobs: log ref(x) of the same tokens, same
        shape. Returns the same shape, >= 0 everywhere, 0 where the two are equal; its mean over
        x ~ p is an unbiased estimate of KL(p || ref) (http://joschu.net/blog/kl-approx.html).
    max_log_ratio: clamp ref - p to [-max, max] first (no gradient beyond): a token the policy has made far
        less likely than ref would give exp(ref - p) = inf, or an exp that swamps the loss.
    Carries gradients through both arguments.
    """
    # PipelineRL: rl_step, approx_kl = exp(log_ratio_ref_new_clamp) - log_ratio_ref_new_clamp - 1
    log_ratio = ref_logprobs - logprobs
    if max_log_ratio is not None:
        log_ratio = log_ratio.clamp(-max_log_ratio, max_log_ratio)
    return torch.exp(log_ratio) - log_ratio - 1.0


def effective_sample_size(weights: Tensor, mask: Tensor) -> Tensor:
    """Normalised effective sample size of importance weights: (sum w)^2 / (N * sum w^2).

    weights: non-negative importance weights, any shape; mask: same shape, 1 (or True) where the
        weight counts, 0 elsewhere; N = number of masked elements.
    Returns a detached 0-d tensor in (0, 1]: 1 when all masked weights are equal, 1/N when a single
    one is nonzero (Kish's ESS divided by N). 0 when no element is masked or all are zero.
    """
    # PipelineRL logs ratio_new_old_sum and ratio_new_old_squared_sum "useful to estimate the ESS"
    with torch.no_grad():
        m = mask.to(weights.dtype)
        w = weights.detach() * m
        n = m.sum()
        denom = n * (w * w).sum()
        num = w.sum() ** 2
        safe = torch.where(denom > 0, denom, torch.ones_like(denom))
        return torch.where(denom > 0, num / safe, torch.zeros_like(denom))


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over the elements where mask is 1 (0 when none is)."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def policy_loss(
    new_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    num_sequences: int,
    loss_type: Literal["reinforce", "ppo_clip"] = "reinforce",
    ratio_cap: float = 5.0,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance-weighted policy-gradient loss of PipelineRL (or PPO's clipped one), and its stats.

    new_logprobs: (B, T) logprobs of the sampled tokens under the policy being trained (carry grads).
    behaviour_logprobs: (B, T) the same under the policy that sampled them (mu; in PipelineRL
        possibly several weight versions old). Treated as constants.
    advantages: (B,) one advantage per sequence, broadcast over its tokens (or (B, T) per token);
        treated as constants (detached), as PipelineRL does.
    mask: (B, T) 1 (or True) on the response tokens that enter the loss, 0 on prompt and padding.
    num_sequences: sequences in the whole optimizer batch (not just this micro-batch); the loss is
        the token sum divided by it (PipelineRL: tokens_weights = 1 / config.batch_size), so the
        losses of micro-batches split from one batch add up to the loss of the whole batch.
    loss_type:
        "reinforce" (PipelineRL: rl_step, case "reinforce"; arXiv 2509.19128): per-token objective
            new_logprobs * A * clamp(ratio, 0, ratio_cap).detach(), whose gradient is
            min(ratio, ratio_cap) * A * grad log pi: the importance-weighted policy gradient with
            the weight capped above. On policy (ratio = 1) it is plain REINFORCE.
        "ppo_clip": per-token objective min(ratio * A, clamp(ratio, 1 - clip_eps, 1 + clip_eps_high) * A)
            (PPO, arXiv 1707.06347; PipelineRL: rl_step, case "ppo", with epsilon_low and epsilon_high).
    ratio_cap: the cap of the reinforce weight (paper: 5; the current PipelineRL code caps at
        1 + epsilon_high instead). Unused by ppo_clip.
    clip_eps: PPO's epsilon (below 1; above too unless clip_eps_high is given). Unused by reinforce.
    clip_eps_high: the epsilon above 1 (None: clip_eps): a larger one lets unlikely tokens that did well
        grow faster (DAPO's "clip-higher", arXiv 2503.14476, uses 0.28). Unused by reinforce.
    ref_logprobs: (B, T) logprobs under a frozen reference policy, or None.
    kl_coef: weight of the k3 penalty to the reference, subtracted from the per-token objective
        (PipelineRL: loss = policy_loss - kl_coef * approx_kl); it carries gradients through
        new_logprobs. Default 0 (PipelineRL's recipe). ValueError if nonzero without ref_logprobs.

    ratio = exp(new_logprobs - behaviour_logprobs) per token.
    loss = -(objective * mask).sum() / num_sequences, a 0-d tensor carrying gradients.

    stats: detached 0-d tensors; "masked mean" = mean over the mask-1 tokens of this micro-batch.
        ratio/mean       masked mean of the raw (uncapped, unclipped) ratio
        ratio/max        max of the raw ratio over masked tokens (0 when none is masked)
        ratio/clipfrac   fraction of masked tokens whose ratio was changed by the cap
                         (reinforce: ratio > ratio_cap) or by the clip
                         (ppo_clip: ratio outside [1 - clip_eps, 1 + clip_eps_high]; PipelineRL's
                         clamp_log_ratio_new_old_indicator), whether or not the min picked it
        ess              effective_sample_size of the raw ratio over masked tokens
        logprob/new_mean masked mean of new_logprobs
        kl/behaviour     masked mean of k3_kl(behaviour_logprobs, new_logprobs) =
                         exp(n - b) - (n - b) - 1: the tokens were sampled from the behaviour
                         policy, so this is the unbiased k3 estimate of KL(mu || pi)
                         (PipelineRL's approx_kl_new_old, logged as kl_new_old)
        kl/ref           masked mean of k3_kl(new_logprobs, ref_logprobs, REF_LOG_RATIO_CLAMP), only when ref given
    """
    if new_logprobs.shape != behaviour_logprobs.shape or new_logprobs.shape != mask.shape:
        raise ValueError(
            f"new_logprobs {tuple(new_logprobs.shape)}, behaviour_logprobs {tuple(behaviour_logprobs.shape)} "
            f"and mask {tuple(mask.shape)} must have the same (B, T) shape"
        )
    if new_logprobs.dim() != 2:
        raise ValueError(f"token tensors must be (B, T), got shape {tuple(new_logprobs.shape)}")
    if advantages.dim() == 1:
        if advantages.shape[0] != new_logprobs.shape[0]:
            raise ValueError(
                f"advantages {tuple(advantages.shape)} need one entry per row of {tuple(new_logprobs.shape)}"
            )
        advantages = advantages[:, None]  # (B, 1), broadcast over tokens
    elif advantages.shape != new_logprobs.shape:
        raise ValueError(
            f"advantages must be (B,) or (B, T) = {tuple(new_logprobs.shape)}, got {tuple(advantages.shape)}"
        )
    if num_sequences < 1:
        raise ValueError(f"num_sequences must be >= 1, got {num_sequences}")
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError(f"kl_coef = {kl_coef} needs ref_logprobs")
    if ref_logprobs is not None and ref_logprobs.shape != new_logprobs.shape:
        raise ValueError(
            f"ref_logprobs {tuple(ref_logprobs.shape)} must match new_logprobs {tuple(new_logprobs.shape)}"
        )

    m = mask.to(new_logprobs.dtype)
    adv = advantages.detach().to(new_logprobs.dtype)
    behaviour = behaviour_logprobs.detach()
    # PipelineRL: rl_step, ratio_new_old = exp(new_logprobs - old_logprobs)
    ratio = torch.exp(new_logprobs - behaviour)  # (B, T)

    if loss_type == "reinforce":
        # PipelineRL: rl_step, case "reinforce":
        #   ratio_new_old = clamp(ratio_new_old, 0, 1 + epsilon_high)
        #   policy_loss = new_logprobs * log_p_weights * ratio_new_old.detach()
        # paper (arXiv 2509.19128): the importance weight pi / mu truncated at 5
        weight = torch.clamp(ratio, 0.0, ratio_cap).detach()
        objective = new_logprobs * adv * weight
        clipped = ratio > ratio_cap
    elif loss_type == "ppo_clip":
        # PipelineRL: rl_step, case "ppo"; ppo.py's clipped policy loss
        # OAI: lm_human_preferences/train_policy.py#L350-L355
        high = clip_eps if clip_eps_high is None else clip_eps_high
        clamped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)
        objective = torch.minimum(ratio * adv, clamped * adv)
        clipped = (ratio < 1.0 - clip_eps) | (ratio > 1.0 + high)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected 'reinforce' or 'ppo_clip'")

    kl_ref = None
    if ref_logprobs is not None:
        kl_ref = k3_kl(new_logprobs, ref_logprobs.detach(), max_log_ratio=REF_LOG_RATIO_CLAMP)
        if kl_coef != 0.0:
            # PipelineRL: rl_step, loss = policy_loss - kl_coef * approx_kl + ...
            objective = objective - kl_coef * kl_ref

    # PipelineRL: rl_step, loss * tokens_weights (1 / batch_size), summed over the masked tokens
    loss = -(objective * m).sum() / num_sequences

    with torch.no_grad():
        r = ratio.detach()
        stats = {
            "ratio/mean": _masked_mean(r, m),
            "ratio/max": torch.where(m > 0, r, torch.zeros_like(r)).max(),
            "ratio/clipfrac": _masked_mean(clipped.to(r.dtype), m),
            "ess": effective_sample_size(r, m),
            "logprob/new_mean": _masked_mean(new_logprobs.detach(), m),
            "kl/behaviour": _masked_mean(k3_kl(behaviour, new_logprobs.detach()), m),
        }
        if kl_ref is not None:
            stats["kl/ref"] = _masked_mean(kl_ref.detach(), m)
    return loss, stats
