"""Group-relative advantages and the off-policy policy-gradient losses of PipelineRL and TRL, as pure tensor functions.

Follows `rl_step` and `populate_rl_data` in `pipelinerl/finetune/rl/__init__.py` of `ServiceNow/PipelineRL`
(line numbers at commit 58d3934), the PipelineRL paper (arXiv 2509.19128), and `GRPOTrainer` in
`trl/trainer/grpo_trainer.py` of TRL 1.16.0 (line numbers of that release). As in `ppo.py`, every function
takes tensors and returns tensors; nothing here touches models, files, processes or the network, so
the training script owns the batching, the packing, the all-reduces and the logging.

Shapes: n = rollouts in the whole batch (groups of `group_size` consecutive rollouts of one prompt),
B = rollouts in a (micro-)batch, T = tokens per row.

One optimizer step (the project's default recipe: the PipelineRL paper's; `GRPOArgs.recipe` names the others):

    adv = group_advantages(rewards, group_size)                      # (n,), computed once per batch
    for micro_batch in split(batch):                                 # any split, packed or not
        loss, stats = policy_loss(new_lp, behaviour_lp, adv[rows], mask, num_sequences=n)
        loss.backward()                                              # gradients add up over micro-batches
    optimizer.step()

By default the loss is a sum over tokens divided by `num_sequences`, the number of sequences in the whole
optimizer batch, so the micro-batch losses add up to the full-batch loss and long answers weigh more
than short ones (no per-sequence length normalisation), as in PipelineRL; `token_weights` gives TRL's
normalisations and PipelineRL's group normalisation, computed over the whole batch so that they add up too.
"""

import torch
from torch import Tensor

from lm_human_preference_details.grpo.loss_options import Baseline, ImportanceSampling, LossType, Normalizer, StdOver


def group_advantages(
    rewards: Tensor,
    group_size: int,
    baseline: Baseline = "mean",
    divide_by_std: bool = False,
    eps: float = 1e-4,
    std_over: StdOver = "group",
) -> Tensor:
    """Advantage of each rollout relative to the other rollouts of its prompt.

    rewards: (n,) one scalar reward per rollout; consecutive blocks of `group_size` rows are the
        groups (the rollouts of one prompt), so n must be a multiple of group_size.
    baseline:
        "mean": A_i = r_i - mean_group(r) (GRPO, DeepSeekMath arXiv 2402.03300; TRL's GRPOTrainer; PipelineRL
            before its commit 4988fe8).
        "leave_one_out": A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_group(r))
            (RLOO, arXiv 2402.14740; PipelineRL's `populate_rl_data` since 4988fe8).
    divide_by_std: divide by (std + eps). The std is the sample standard deviation, with Bessel's
        correction (divide by G - 1, `torch.std`'s default): that is what TRL's GRPOTrainer (`nanstd`) and
        PipelineRL (pandas `std`, ddof=1) use. A group whose rewards are all equal has std 0 and gets
        advantage 0 either way. PipelineRL's `conf/finetune/base.yaml` leaves it off; TRL's
        `scale_rewards="group"` (its default) turns it on.
    eps: added to the std before dividing (TRL and PipelineRL use 1e-4).
    std_over: the rewards whose std divides: the group's ("group", TRL's `scale_rewards="group"`) or the whole
        batch's ("batch", TRL's `scale_rewards="batch"`, as Dr. GRPO's authors suggest for it).
    A group of one gets advantage 0 whatever the options, as in PipelineRL (its leave-one-out baseline is then
    the reward itself and its std, NaN, is taken as 0).
    Returns (n,) advantages, detached, in the dtype of `rewards`.
    Raises ValueError when rewards is not 1-D, n % group_size != 0 or group_size < 1.
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
    if std_over not in ("group", "batch"):
        raise ValueError(f"unknown std_over {std_over!r}; expected 'group' or 'batch'")

    if group_size == 1:  # PipelineRL: pipelinerl/finetune/rl/__init__.py#L516, a group of one is its own baseline
        return torch.zeros_like(rewards.detach())
    r = rewards.detach().view(n // group_size, group_size)  # (groups, G)
    mean = r.mean(dim=1, keepdim=True)
    adv = r - mean
    if baseline == "leave_one_out":
        # PipelineRL: pipelinerl/finetune/rl/__init__.py#L514, loo_mean = (group_sum - r_i) / (G - 1);
        # r_i - loo_mean = r_i - (G * mean - r_i) / (G - 1) = G / (G - 1) * (r_i - mean)
        adv = adv * (group_size / (group_size - 1))
    if divide_by_std:
        # PipelineRL: pipelinerl/finetune/rl/__init__.py#L519, (r - baseline) / (std + 1e-4)
        # TRL: trl/trainer/grpo_trainer.py#L2787, the same with std over the group or (L2777) the batch
        std = r.std(dim=1, keepdim=True, correction=1) if std_over == "group" else r.std(correction=1)
        adv = adv / (std + eps)
    return adv.reshape(n)


def policy_weights(advantages: Tensor, rewards: Tensor, use_advantages: bool = True, relu: bool = False) -> Tensor:
    """What multiplies log pi in the policy gradient, per rollout (PipelineRL's `log_p_weights`).

    advantages, rewards: (n,) per rollout. use_advantages: the advantages (default), or else the raw rewards
    (PipelineRL's `use_advantages=False`: REINFORCE without a baseline). relu: clamp below at 0, so that only
    rollouts better than the baseline are reinforced and none is pushed down (PipelineRL's `relu_log_p_weights`).
    Returns (n,), detached.
    """
    # PipelineRL: pipelinerl/finetune/rl/__init__.py#L276-L278
    weights = (advantages if use_advantages else rewards).detach()
    return torch.clamp(weights, min=0) if relu else weights


def linear_decay(step: int, steps: int, initial: float, final: float) -> float:
    """`initial` at step 0 going linearly to `final` at step `steps` (PipelineRL's `linear_decay_coef`, which
    `rl_step` is given the optimizer steps completed so far and the run's total: its KL coefficient and entropy
    bonus schedules)."""
    # PipelineRL: pipelinerl/finetune/rl/__init__.py#L119-L133
    return initial + (final - initial) * step / steps


def token_weights(
    mask: Tensor,
    normalizer: Normalizer,
    num_sequences: int,
    num_tokens: int | None = None,
    max_tokens: int | None = None,
    group_tokens: Tensor | None = None,
) -> Tensor:
    """(B, T) weight of each token's objective in the loss, which is -sum(objective * weights), for a
    (micro-)batch of the optimizer batch; the counts are the whole batch's, so micro-batch losses add up.

    mask: (B, T) 1 on the tokens that enter the loss (a completion dropped by overlong filtering is all 0:
        it counts in no token count, but in the number of sequences, as in TRL and PipelineRL).
    normalizer:
        "sequences": 1 / num_sequences (PipelineRL: tokens_weights = 1 / batch_size; `policy_loss`'s default).
        "sequence_mean": 1 / (num_sequences * the row's tokens): each sequence's mean, averaged (TRL's
            `loss_type="grpo"`, the GRPO paper's).
        "tokens": 1 / num_tokens, the tokens in the whole batch (TRL's `loss_type="dapo"`, DAPO's token-level
            loss; TRL's "bnpo" is the same over each micro-batch's tokens, so it is this with one micro-batch).
        "max_tokens": 1 / (num_sequences * max_tokens), a constant (TRL's `loss_type="dr_grpo"`, Dr. GRPO's,
            with max_tokens its `max_completion_length`).
        "group_tokens": 1 / group_tokens[row], the mean length (prompt and completion) of the row's group,
            not divided by the batch size (PipelineRL's `group_normalization`).
    Raises ValueError for an unknown normalizer or a count it needs that is missing or < 1.
    """
    m = mask if mask.is_floating_point() else mask.float()
    if normalizer == "sequences":
        return m / num_sequences
    if normalizer == "sequence_mean":
        # TRL: trl/trainer/grpo_trainer.py#L3154
        return m / (m.sum(dim=1, keepdim=True).clamp(min=1.0) * num_sequences)
    if normalizer == "tokens":
        if num_tokens is None or num_tokens < 1:
            raise ValueError(f"normalizer 'tokens' needs num_tokens >= 1, got {num_tokens}")
        # TRL: trl/trainer/grpo_trainer.py#L3170 (num_items_in_batch, one process and one accumulation step)
        return m / num_tokens
    if normalizer == "max_tokens":
        if max_tokens is None or max_tokens < 1:
            raise ValueError(f"normalizer 'max_tokens' needs max_tokens >= 1, got {max_tokens}")
        # TRL: trl/trainer/grpo_trainer.py#L3164
        return m / (num_sequences * max_tokens)
    if normalizer == "group_tokens":
        if group_tokens is None or group_tokens.shape != mask.shape[:1]:
            raise ValueError(f"normalizer 'group_tokens' needs group_tokens of shape {tuple(mask.shape[:1])}")
        # PipelineRL: pipelinerl/finetune/rl/__init__.py#L245-L248
        return m / group_tokens.to(m.dtype)[:, None]
    raise ValueError(f"unknown normalizer {normalizer!r}; expected one of {Normalizer.__args__}")


# PipelineRL: RLConfig.clamp_log_ratio_ref_new_value's default (its conf/finetune/base.yaml sets 5), the bound on
# log ref(x) - log p(x) in the KL penalty
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
    # PipelineRL: pipelinerl/finetune/rl/__init__.py#L288
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


def reinforce_weights(
    log_ratio: Tensor, mask: Tensor, ratio_cap: float, importance_sampling: ImportanceSampling = "token_truncate"
) -> tuple[Tensor, Tensor]:
    """The importance weight of `reinforce`'s gradient per token, and where the cap changed it.

    log_ratio: (B, T) log pi - log mu of the sampled tokens; mask: (B, T) 1 on the tokens that count.
    importance_sampling (TRL's `vllm_importance_sampling_mode` names, its cap `ratio_cap`):
        "token_truncate": min(pi/mu, cap) per token (PipelineRL's reinforce, with cap 1 + epsilon_high).
        "token_mask": pi/mu, or 0 where it is above the cap.
        "sequence_truncate" / "sequence_mask": the same on the sequence's ratio exp(sum of log_ratio over its
            masked tokens), one weight for all its tokens.
    Returns (weights, capped), both (B, T); weights carry gradients (the caller detaches), capped is a bool mask of
    the tokens whose weight the cap changed (whole rows for the sequence modes).
    Raises ValueError for an unknown mode.
    """
    if importance_sampling.startswith("token_"):
        ratio = torch.exp(log_ratio)
    elif importance_sampling.startswith("sequence_"):
        # TRL: trl/trainer/grpo_trainer.py#L2669, the sum of the masked per-token log ratios
        ratio = torch.exp((log_ratio * mask).sum(dim=1, keepdim=True)).expand_as(log_ratio)
    else:
        raise ValueError(
            f"unknown importance_sampling {importance_sampling!r}; expected one of {ImportanceSampling.__args__}"
        )
    capped = ratio > ratio_cap
    if importance_sampling.endswith("_truncate"):
        # PipelineRL: pipelinerl/finetune/rl/__init__.py#L308; TRL: trl/trainer/grpo_trainer.py#L2681
        return torch.clamp(ratio, 0.0, ratio_cap), capped
    # TRL: trl/trainer/grpo_trainer.py#L2698-L2702
    return ratio.masked_fill(capped, 0.0), capped


def policy_loss(
    new_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    num_sequences: int,
    loss_type: LossType = "reinforce",
    ratio_cap: float = 5.0,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_clamp: float = REF_LOG_RATIO_CLAMP,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    importance_sampling: ImportanceSampling = "token_truncate",
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance-weighted policy-gradient loss of PipelineRL (or PPO's clipped one, or GSPO's), and its stats.

    new_logprobs: (B, T) logprobs of the sampled tokens under the policy being trained (carry grads).
    behaviour_logprobs: (B, T) the same under the policy that sampled them (mu; in PipelineRL
        possibly several weight versions old). Treated as constants.
    advantages: (B,) one advantage per sequence, broadcast over its tokens (or (B, T) per token);
        treated as constants (detached), as PipelineRL does. Any `policy_weights` (rewards, relu) go here.
    mask: (B, T) 1 (or True) on the response tokens that enter the loss, 0 on prompt and padding.
    num_sequences: sequences in the whole optimizer batch (not just this micro-batch); the loss is
        the token sum divided by it (PipelineRL: tokens_weights = 1 / config.batch_size), so the
        losses of micro-batches split from one batch add up to the loss of the whole batch.
    loss_type:
        "reinforce" (PipelineRL: rl_step, case "reinforce"; arXiv 2509.19128): per-token objective
            new_logprobs * A * w.detach(), w = `reinforce_weights` (min(ratio, ratio_cap) by default), whose
            gradient is w * A * grad log pi: the importance-weighted policy gradient with the weight capped
            above. On policy (ratio = 1) it is plain REINFORCE. It is also TRL's loss with
            `vllm_importance_sampling_correction` (truncated importance sampling, cap ratio_cap, mode
            importance_sampling) at one gradient step per batch, where TRL's ratio to its own logprobs is 1.
        "ppo_clip": per-token objective min(ratio * A, clamp(ratio, 1 - clip_eps, 1 + clip_eps_high) * A)
            (PPO, arXiv 1707.06347; PipelineRL: rl_step, case "ppo", with epsilon_low and epsilon_high).
        "gspo": the same on the sequence's ratio s = exp(masked mean of log ratio) and its mean advantage, one
            value for all its tokens (GSPO, arXiv 2507.18071; PipelineRL: rl_step, case "gspo", whose loss is
            that times the sum of the sequence's token weights: what `weights` summed over its tokens gives; with
            the "sequence_mean" normaliser it is TRL's `importance_sampling_level="sequence"`). PipelineRL adds
            no KL penalty or entropy bonus to it; here they are added as to the others.
    ratio_cap: the cap of the reinforce weight (paper: 5; PipelineRL's code caps at 1 + epsilon_high, 1.02 in
        its conf/finetune/base.yaml). Unused by ppo_clip and gspo.
    clip_eps: PPO's epsilon (below 1; above too unless clip_eps_high is given). Unused by reinforce.
    clip_eps_high: the epsilon above 1 (None: clip_eps): a larger one lets unlikely tokens that did well
        grow faster (DAPO's "clip-higher", arXiv 2503.14476, uses 0.28). Unused by reinforce.
    ref_logprobs: (B, T) logprobs under a frozen reference policy, or None.
    kl_coef: weight of the k3 penalty to the reference, subtracted from the per-token objective
        (PipelineRL: loss = policy_loss - kl_coef * approx_kl); it carries gradients through
        new_logprobs. Default 0 (PipelineRL's base.yaml; TRL's beta). ValueError if nonzero without ref_logprobs.
    kl_clamp: the bound of the log ratio in the k3 penalty (`k3_kl`'s max_log_ratio; PipelineRL's
        clamp_log_ratio_ref_new_value).
    entropy: (B, T) entropy of each next-token distribution (carrying gradients), and entropy_coef its weight
        added to the per-token objective (PipelineRL: loss = ... + entropy_bonus_coef * entropy). ValueError
        if entropy_coef is nonzero without entropy.
    importance_sampling: `reinforce_weights`'s mode. Only reinforce has one (ValueError otherwise).
    weights: (B, T) `token_weights`, the weight of each token's objective in the loss: the loss is
        -(objective * mask * weights).sum(); None: 1 / num_sequences.

    ratio = exp(new_logprobs - behaviour_logprobs) per token.
    loss = -(objective * mask).sum() / num_sequences (or -(objective * mask * weights).sum()), a 0-d tensor
    carrying gradients.

    stats: detached 0-d tensors; "masked mean" = mean over the mask-1 tokens of this micro-batch.
        ratio/mean       masked mean of the raw (uncapped, unclipped) ratio pi/mu
        ratio/max        max of the raw ratio over masked tokens (0 when none is masked)
        ratio/clipfrac   fraction of masked tokens whose ratio was changed by the cap
                         (reinforce: the weight is not the raw ratio; PipelineRL's
                         clamp_log_ratio_new_old_indicator) or by the clip (ppo_clip, gspo: ratio outside
                         [1 - clip_eps, 1 + clip_eps_high]), whether or not the min picked it
        ess              effective_sample_size of the raw ratio over masked tokens
        weight/mean      reinforce only: masked mean of the capped weight w, the ratio the loss applied
                         (PipelineRL's reinforce logs this one as ratio_new_old; TRL's
                         sampling/importance_sampling_ratio/mean)
        weight/max       reinforce only: its max over masked tokens
        weight/ess       reinforce only: effective_sample_size of w (PipelineRL's ESS, from ratio_new_old_sum
                         and ratio_new_old_squared_sum)
        logprob/new_mean masked mean of new_logprobs
        kl/behaviour     masked mean of k3_kl(behaviour_logprobs, new_logprobs) =
                         exp(n - b) - (n - b) - 1: the tokens were sampled from the behaviour
                         policy, so this is the unbiased k3 estimate of KL(mu || pi)
                         (PipelineRL's approx_kl_new_old, logged as kl_new_old)
        kl/ref           masked mean of k3_kl(new_logprobs, ref_logprobs, kl_clamp), only when ref given
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
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError(f"entropy_coef = {entropy_coef} needs entropy")
    for name, tensor in (("entropy", entropy), ("weights", weights)):
        if tensor is not None and tensor.shape != new_logprobs.shape:
            raise ValueError(f"{name} {tuple(tensor.shape)} must match new_logprobs {tuple(new_logprobs.shape)}")
    if loss_type != "reinforce" and importance_sampling != "token_truncate":
        raise ValueError(f"importance_sampling {importance_sampling!r} is reinforce's; loss_type is {loss_type!r}")

    m = mask.to(new_logprobs.dtype)
    adv = advantages.detach().to(new_logprobs.dtype)
    behaviour = behaviour_logprobs.detach()
    # PipelineRL: rl_step, ratio_new_old = exp(new_logprobs - old_logprobs)
    ratio = torch.exp(new_logprobs - behaviour)  # (B, T)

    weight = None
    high = clip_eps if clip_eps_high is None else clip_eps_high
    if loss_type == "reinforce":
        # PipelineRL: pipelinerl/finetune/rl/__init__.py#L304-L309:
        #   ratio_new_old = clamp(ratio_new_old, 0, 1 + epsilon_high)
        #   policy_loss = new_logprobs * log_p_weights * ratio_new_old.detach()
        # paper (arXiv 2509.19128): the importance weight pi / mu truncated at 5
        if importance_sampling == "token_truncate":
            weight, clipped = torch.clamp(ratio, 0.0, ratio_cap).detach(), ratio > ratio_cap
        else:
            weight, clipped = reinforce_weights(new_logprobs.detach() - behaviour, m, ratio_cap, importance_sampling)
        objective = new_logprobs * adv * weight
    elif loss_type == "ppo_clip":
        # PipelineRL: rl_step, case "ppo"; ppo.py's clipped policy loss
        # OAI: lm_human_preferences/train_policy.py#L350-L355
        clamped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)
        objective = torch.minimum(ratio * adv, clamped * adv)
        clipped = (ratio < 1.0 - clip_eps) | (ratio > 1.0 + high)
    elif loss_type == "gspo":
        # PipelineRL: pipelinerl/finetune/rl/__init__.py#L310-L348; TRL: trl/trainer/grpo_trainer.py#L3087
        tokens = m.sum(dim=1, keepdim=True).clamp(min=1.0)
        sequence_ratio = torch.exp(((new_logprobs - behaviour) * m).sum(dim=1, keepdim=True) / tokens)  # (B, 1)
        sequence_adv = (adv.expand_as(m) * m).sum(dim=1, keepdim=True) / tokens
        clamped = torch.clamp(sequence_ratio, 1.0 - clip_eps, 1.0 + high)
        objective = torch.minimum(sequence_ratio * sequence_adv, clamped * sequence_adv).expand_as(m)
        clipped = ((sequence_ratio < 1.0 - clip_eps) | (sequence_ratio > 1.0 + high)).expand_as(m)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected 'reinforce', 'ppo_clip' or 'gspo'")

    kl_ref = None
    if ref_logprobs is not None:
        kl_ref = k3_kl(new_logprobs, ref_logprobs.detach(), max_log_ratio=kl_clamp)
        if kl_coef != 0.0:
            # PipelineRL: pipelinerl/finetune/rl/__init__.py#L359, loss = policy_loss - kl_coef * approx_kl
            objective = objective - kl_coef * kl_ref
    if entropy_coef != 0.0:
        # PipelineRL: pipelinerl/finetune/rl/__init__.py#L357, ... + entropy_bonus_coef * entropy
        objective = objective + entropy_coef * entropy

    if weights is None:
        # PipelineRL: rl_step, loss * tokens_weights (1 / batch_size), summed over the masked tokens
        loss = -(objective * m).sum() / num_sequences
    else:
        loss = -(objective * m * weights.to(objective.dtype)).sum()

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
        if weight is not None:
            stats["weight/mean"] = _masked_mean(weight, m)
            stats["weight/max"] = torch.where(m > 0, weight, torch.zeros_like(weight)).max()
            stats["weight/ess"] = effective_sample_size(weight, m)
        if kl_ref is not None:
            stats["kl/ref"] = _masked_mean(kl_ref.detach(), m)
    return loss, stats
