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
        loss = policy_loss(new_lp, behaviour_lp, adv[rows], mask, num_sequences=n).loss
        loss.backward()                                              # gradients add up over micro-batches
    optimizer.step()

By default the loss is a sum over tokens divided by `num_sequences`, the number of sequences in the whole
optimizer batch, so the micro-batch losses add up to the full-batch loss and long answers weigh more
than short ones (no per-sequence length normalisation), as in PipelineRL; `token_weights` gives TRL's
normalisations and PipelineRL's group normalisation, computed over the whole batch so that they add up too.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

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


@dataclass(frozen=True)
class LossSettings:
    """How `policy_loss` makes its loss, the same for every micro-batch of an optimizer step (the trainer's
    `loss_settings` takes them from `GRPOArgs`, the KL coefficient and the entropy bonus at the step's point of
    their schedules).

    loss_type: the per-token objective, one of `POLICY_OBJECTIVES` (its function's docstring says what it is).
    ratio_cap: the cap of the reinforce weight (paper: 5; PipelineRL's code caps at 1 + epsilon_high, 1.02 in
        its conf/finetune/base.yaml). Unused by ppo_clip and gspo.
    importance_sampling: `reinforce_weights`'s mode. Only reinforce has one (ValueError otherwise).
    clip_eps: PPO's epsilon (below 1; above too unless clip_eps_high is given). Unused by reinforce.
    clip_eps_high: the epsilon above 1 (None: clip_eps): a larger one lets unlikely tokens that did well
        grow faster (DAPO's "clip-higher", arXiv 2503.14476, uses 0.28). Unused by reinforce.
    kl_coef: weight of the k3 penalty to the reference, subtracted from the per-token objective
        (PipelineRL: loss = policy_loss - kl_coef * approx_kl); it carries gradients through
        new_logprobs. Default 0 (PipelineRL's base.yaml; TRL's beta). Nonzero, `policy_loss` needs ref_logprobs.
    kl_clamp: the bound of the log ratio in the k3 penalty (`k3_kl`'s max_log_ratio; PipelineRL's
        clamp_log_ratio_ref_new_value).
    entropy_coef: the weight of the entropy added to the per-token objective (PipelineRL: loss = ... +
        entropy_bonus_coef * entropy). Nonzero, `policy_loss` needs entropy.
    """

    loss_type: LossType = "reinforce"
    ratio_cap: float = 5.0
    importance_sampling: ImportanceSampling = "token_truncate"
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_coef: float = 0.0
    kl_clamp: float = REF_LOG_RATIO_CLAMP
    entropy_coef: float = 0.0

    def __post_init__(self):
        if self.loss_type not in POLICY_OBJECTIVES:
            raise ValueError(f"unknown loss_type {self.loss_type!r}; expected one of {tuple(POLICY_OBJECTIVES)}")
        if self.loss_type != "reinforce" and self.importance_sampling != "token_truncate":
            raise ValueError(
                f"importance_sampling {self.importance_sampling!r} is reinforce's; loss_type is {self.loss_type!r}"
            )

    @property
    def clip_range(self) -> tuple[float, float]:
        """PPO's clip range of the ratio, [1 - clip_eps, 1 + clip_eps_high]."""
        return 1.0 - self.clip_eps, 1.0 + (self.clip_eps if self.clip_eps_high is None else self.clip_eps_high)


@dataclass(frozen=True)
class TokenTerms:
    """A micro-batch as every loss kind reads it, (B, T) tensors."""

    new_logprobs: Tensor  # log pi of the sampled tokens, carrying gradients
    log_ratio: Tensor  # log pi - log mu, carrying gradients through log pi
    ratio: Tensor  # pi / mu = exp(log_ratio), the same
    advantages: Tensor  # detached, (B, 1) (broadcast over the tokens) or (B, T)
    mask: Tensor  # 1.0 on the tokens in the loss
    sequence_mask: Tensor  # 1.0 on each sequence's tokens: `mask`'s and those of the rows left out of the loss


class Objective(NamedTuple):
    """A loss kind's per-token objective (to maximise), where the ratio was capped or clipped (bool), and the importance
    weight it applied (detached; None when the ratio enters otherwise), all (B, T)."""

    objective: Tensor
    clipped: Tensor
    weight: Tensor | None = None


def reinforce_objective(terms: TokenTerms, settings: LossSettings) -> Objective:
    """PipelineRL's (rl_step, case "reinforce"; arXiv 2509.19128): log pi * A * w, w = `reinforce_weights`
    (min(ratio, ratio_cap) by default), detached, so that its gradient is w * A * grad log pi: the importance-weighted
    policy gradient with the weight capped above. On policy (ratio = 1) it is plain REINFORCE. It is also TRL's loss
    with `vllm_importance_sampling_correction` (truncated importance sampling, cap ratio_cap, mode
    importance_sampling) at one gradient step per batch, where TRL's ratio to its own logprobs is 1. A sequence mode
    takes a row's ratio over its tokens (`sequence_mask`), also where the row is out of the loss (for the statistics).
    """
    # PipelineRL: pipelinerl/finetune/rl/__init__.py#L304-L309:
    #   ratio_new_old = clamp(ratio_new_old, 0, 1 + epsilon_high)
    #   policy_loss = new_logprobs * log_p_weights * ratio_new_old.detach()
    # paper (arXiv 2509.19128): the importance weight pi / mu truncated at 5
    weight, capped = reinforce_weights(
        terms.log_ratio.detach(), terms.sequence_mask, settings.ratio_cap, settings.importance_sampling
    )
    return Objective(terms.new_logprobs * terms.advantages * weight, capped, weight)


def ppo_clip_objective(terms: TokenTerms, settings: LossSettings) -> Objective:
    """PPO's (arXiv 1707.06347; PipelineRL: rl_step, case "ppo", with epsilon_low and epsilon_high):
    min(ratio * A, clamp(ratio, 1 - clip_eps, 1 + clip_eps_high) * A); clipped: the ratio outside that range, whether
    or not the min picked the clipped term."""
    # PipelineRL: rl_step, case "ppo"; ppo.py's clipped policy loss
    # OAI: lm_human_preferences/train_policy.py#L350-L355
    low, high = settings.clip_range
    ratio, adv = terms.ratio, terms.advantages
    clamped = torch.clamp(ratio, low, high)
    return Objective(torch.minimum(ratio * adv, clamped * adv), (ratio < low) | (ratio > high))


def gspo_objective(terms: TokenTerms, settings: LossSettings) -> Objective:
    """GSPO's (arXiv 2507.18071; PipelineRL: rl_step, case "gspo"): PPO's clipped objective on the sequence's ratio
    s = exp(masked mean of log ratio) and its mean advantage, one value for all its tokens. PipelineRL's loss is that
    times the sum of the sequence's token weights: what `policy_loss`'s weights summed over its tokens give; with the
    "sequence_mean" normaliser it is TRL's `importance_sampling_level="sequence"`. PipelineRL adds no KL penalty or
    entropy bonus to it; `policy_loss` adds them as to the others."""
    # PipelineRL: pipelinerl/finetune/rl/__init__.py#L310-L348; TRL: trl/trainer/grpo_trainer.py#L3087
    low, high = settings.clip_range
    m = terms.mask
    tokens = m.sum(dim=1, keepdim=True).clamp(min=1.0)
    sequence_ratio = torch.exp((terms.log_ratio * m).sum(dim=1, keepdim=True) / tokens)  # (B, 1)
    sequence_adv = (terms.advantages.expand_as(m) * m).sum(dim=1, keepdim=True) / tokens
    clamped = torch.clamp(sequence_ratio, low, high)
    objective = torch.minimum(sequence_ratio * sequence_adv, clamped * sequence_adv).expand_as(m)
    return Objective(objective, ((sequence_ratio < low) | (sequence_ratio > high)).expand_as(m))


POLICY_OBJECTIVES: dict[str, Callable[[TokenTerms, LossSettings], Objective]] = {
    "reinforce": reinforce_objective,
    "ppo_clip": ppo_clip_objective,
    "gspo": gspo_objective,
}
"""each loss kind's per-token objective, by the name `LossSettings.loss_type` gives (verl's `register_policy_loss`)"""

DEFAULT_SETTINGS = LossSettings()


class PolicyLoss(NamedTuple):
    """`policy_loss`'s loss (0-d, carrying gradients) and stats (`loss_stats`), and for the caller's own statistics
    the raw ratio pi/mu and reinforce's capped weight (None for the other kinds) of every token, (B, T), detached."""

    loss: Tensor
    stats: dict[str, Tensor]
    ratio: Tensor
    weight: Tensor | None


def policy_loss(
    new_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    num_sequences: int,
    settings: LossSettings = DEFAULT_SETTINGS,
    *,
    kept: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    weights: Tensor | None = None,
) -> PolicyLoss:
    """PipelineRL's importance-weighted policy-gradient loss (or PPO's, or GSPO's: `settings.loss_type`), its stats.

    new_logprobs: (B, T) logprobs of the sampled tokens under the policy being trained (carry grads).
    behaviour_logprobs: (B, T) the same under the policy that sampled them (mu; in PipelineRL
        possibly several weight versions old). Treated as constants.
    advantages: (B,) one advantage per sequence, broadcast over its tokens (or (B, T) per token);
        treated as constants (detached), as PipelineRL does. Any `policy_weights` (rewards, relu) go here.
    mask: (B, T) 1 (or True) on the response tokens that enter the loss, 0 on prompt and padding.
    num_sequences: sequences in the whole optimizer batch (not just this micro-batch); the loss is the token sum
        divided by it (PipelineRL: tokens_weights = 1 / config.batch_size), so micro-batch losses add up.
    kept: (B,) 1 on the rows in the loss, 0 on those left out (overlong filtering); None: all. A row left out is out
        of `mask` (no gradient, no stats), but its sequence's reinforce weight is still over its tokens.
    ref_logprobs: (B, T) logprobs under a frozen reference policy, or None.
    entropy: (B, T) entropy of each next-token distribution (carrying gradients), for `settings.entropy_coef`.
    weights: (B, T) `token_weights`, the weight of each token's objective in the loss; None: 1 / num_sequences.

    objective = the kind's (`POLICY_OBJECTIVES`) - kl_coef * k3_kl(new, ref) + entropy_coef * entropy, per token;
    loss = -(objective * mask).sum() / num_sequences (or -(objective * mask * weights).sum()); a ValueError where
    the tensors' shapes do not fit, or a coefficient lacks its tensor.
    """
    _check_inputs(
        new_logprobs, advantages, num_sequences, settings, kept, behaviour_logprobs=behaviour_logprobs, mask=mask,
        ref_logprobs=ref_logprobs, entropy=entropy, weights=weights,
    )  # fmt: skip
    sequence_mask = mask.to(new_logprobs.dtype)
    m = sequence_mask if kept is None else sequence_mask * kept.to(new_logprobs.dtype)[:, None]
    adv = advantages.detach().to(new_logprobs.dtype)
    behaviour = behaviour_logprobs.detach()
    # PipelineRL: rl_step, ratio_new_old = exp(new_logprobs - old_logprobs)
    log_ratio = new_logprobs - behaviour
    terms = TokenTerms(
        new_logprobs, log_ratio, torch.exp(log_ratio), adv[:, None] if adv.dim() == 1 else adv, m, sequence_mask
    )
    objective, clipped, weight = POLICY_OBJECTIVES[settings.loss_type](terms, settings)
    kl_ref = None
    if ref_logprobs is not None:
        kl_ref = k3_kl(new_logprobs, ref_logprobs.detach(), max_log_ratio=settings.kl_clamp)
        if settings.kl_coef != 0.0:
            # PipelineRL: pipelinerl/finetune/rl/__init__.py#L359, loss = policy_loss - kl_coef * approx_kl
            objective = objective - settings.kl_coef * kl_ref
    if settings.entropy_coef != 0.0:
        # PipelineRL: pipelinerl/finetune/rl/__init__.py#L357, ... + entropy_bonus_coef * entropy
        objective = objective + settings.entropy_coef * entropy
    if weights is None:
        # PipelineRL: rl_step, loss * tokens_weights (1 / batch_size), summed over the masked tokens
        loss = -(objective * m).sum() / num_sequences
    else:
        loss = -(objective * m * weights.to(objective.dtype)).sum()
    return PolicyLoss(loss, loss_stats(terms, behaviour, clipped, weight, kl_ref), terms.ratio.detach(), weight)


def _check_inputs(
    new_logprobs: Tensor,
    advantages: Tensor,
    num_sequences: int,
    settings: LossSettings,
    kept: Tensor | None,
    **tokens: Tensor | None,
) -> None:
    """ValueError unless `policy_loss`'s inputs fit together: `tokens` (B, T) like new_logprobs (or None), one
    advantage per row or per token, one `kept` per row, a tensor for each nonzero coefficient."""
    if new_logprobs.dim() != 2:
        raise ValueError(f"token tensors must be (B, T), got shape {tuple(new_logprobs.shape)}")
    for name, tensor in tokens.items():
        if tensor is not None and tensor.shape != new_logprobs.shape:
            raise ValueError(f"{name} {tuple(tensor.shape)} must match new_logprobs {tuple(new_logprobs.shape)}")
    if advantages.shape not in (new_logprobs.shape[:1], new_logprobs.shape):
        raise ValueError(
            f"advantages must be (B,) or (B, T) = {tuple(new_logprobs.shape)}, got {tuple(advantages.shape)}"
        )
    if kept is not None and kept.shape != new_logprobs.shape[:1]:
        raise ValueError(f"kept {tuple(kept.shape)} needs one entry per row of {tuple(new_logprobs.shape)}")
    if num_sequences < 1:
        raise ValueError(f"num_sequences must be >= 1, got {num_sequences}")
    if settings.kl_coef != 0.0 and tokens["ref_logprobs"] is None:
        raise ValueError(f"kl_coef = {settings.kl_coef} needs ref_logprobs")
    if settings.entropy_coef != 0.0 and tokens["entropy"] is None:
        raise ValueError(f"entropy_coef = {settings.entropy_coef} needs entropy")


def loss_stats(
    terms: TokenTerms, behaviour: Tensor, clipped: Tensor, weight: Tensor | None, kl_ref: Tensor | None
) -> dict[str, Tensor]:
    """`policy_loss`'s stats: detached 0-d tensors; "masked mean" = mean over the mask-1 tokens of this micro-batch.
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
    with torch.no_grad():
        m, r, new = terms.mask, terms.ratio.detach(), terms.new_logprobs.detach()
        stats = {
            "ratio/mean": _masked_mean(r, m),
            "ratio/max": torch.where(m > 0, r, torch.zeros_like(r)).max(),
            "ratio/clipfrac": _masked_mean(clipped.to(r.dtype), m),
            "ess": effective_sample_size(r, m),
            "logprob/new_mean": _masked_mean(new, m),
            "kl/behaviour": _masked_mean(k3_kl(behaviour, new), m),
        }
        if weight is not None:
            stats["weight/mean"] = _masked_mean(weight, m)
            stats["weight/max"] = torch.where(m > 0, weight, torch.zeros_like(weight)).max()
            stats["weight/ess"] = effective_sample_size(weight, m)
        if kl_ref is not None:
            stats["kl/ref"] = _masked_mean(kl_ref.detach(), m)
    return stats
