"""Stage 2: fine-tune the policy with PPO against the reward model, as OAI's `train_policy.py` does.

    reward model: `rewards.trained_model`, or stage 1 first in this run (OAI's train_new_model)
    for update = 1 .. num_updates (from the last checkpoint's with --resume):
        anneal the LR linearly to 0
        rollout:  queries -> responses of exactly `response_length` tokens at the temperature
        score:    truncate after `truncate_token`, reward model on query + truncated response,
                  `penalty_reward_value` for responses without the token
        rewards:  -kl_coef * (logprob - ref_logprob) per token, score added on the last token
        for each of `noptepochs` epochs, for each of `nminibatches` shuffled minibatches:
            whiten rewards (scale only), GAE, whiten advantages
            clipped policy loss + vf_coef * clipped value loss, over `gradient_accumulation_steps`
            micro-batches, one optimizer step (TF-style Adam)
        KL coefficient updated from the KL averaged over all processes
        log OAI's metrics; checkpoint every `save_interval` updates and after the last
        on SIGTERM or SIGUSR1: a checkpoint after the update in flight, then stop (preemption.py)
    save the policy (LM, value head, tokenizer) under `output_dir`/policy

`python -m lm_human_preference_details.train_policy --task tiny --output-dir runs/ppo-tiny`
`accelerate launch lm_human_preference_details/train_policy.py --task sentiment`
"""

import contextlib
import os
import time
from dataclasses import dataclass, field

import torch
from accelerate.utils import broadcast_object_list, set_seed

from lm_human_preference_details import (
    checkpoint,
    cli,
    labelers,
    ppo,
    precision,
    preemption,
    sharding,
    tasks,
    train_reward,
)
from lm_human_preference_details.data import format_queries
from lm_human_preference_details.models import PolicyAndValue, RewardModel, load_causal_lm, logprobs_of
from lm_human_preference_details.optim import OptimizerName, make_optimizer
from lm_human_preference_details.progress import progress_bar
from lm_human_preference_details.sampling import StageHooks
from lm_human_preference_details.tasks import TaskHParams
from lm_human_preference_details.text import contains_truncate_token, load_tokenizer, strip_pad, truncate_after_token
from lm_human_preference_details.tracking import RunArgs, Tracker, earlier_logs, refuse_to_overwrite


@dataclass
class RewardHParams:
    """The reward: a trained model and the KL penalty (# OAI: lm_human_preferences/train_policy.py#L25-L43)."""

    trained_model: str | None = None
    """folder written by train_reward.py; None: train one first in this run (OAI's train_new_model), with the
    preset's stage-1 settings and this run's task, seed and mixed precision (for others, run train_reward.py with
    them and pass its folder here)"""
    kl_coef: float = 0.15
    """the KL coefficient (the initial one when adaptive)"""
    adaptive_kl: bool = True
    """steer the KL coefficient towards `target_kl`"""
    target_kl: float = 6.0
    """target of the summed per-response KL, in nats"""
    horizon: float = 10000
    """episodes over which the adaptive controller corrects its error"""

    def kl_controller(self) -> ppo.AdaptiveKLController | ppo.FixedKLController:
        """The KL coefficient's controller (# OAI: lm_human_preferences/train_policy.py#L107-L124)."""
        if self.adaptive_kl:
            return ppo.AdaptiveKLController(self.kl_coef, self.target_kl, self.horizon)
        return ppo.FixedKLController(self.kl_coef)


@dataclass
class PPOHParams:
    """# OAI: lm_human_preferences/train_policy.py#L46-L58"""

    total_episodes: int = 1_000_000
    """responses sampled over the whole run"""
    batch_size: int = 512
    """responses per update, over all processes (OAI's ppo.batch_size)"""
    nminibatches: int = 1
    """minibatches per epoch; each is one optimizer step"""
    noptepochs: int = 4
    """passes over each batch"""
    gradient_accumulation_steps: int = 1
    """micro-batches per minibatch, to fit memory; does not change the math"""
    lr: float = 1e-5
    """learning rate at the start; annealed linearly to 0"""
    adam_eps: float = 1e-5
    """Adam epsilon (TF1 placement with `optimizer=adam_tf`)"""
    optimizer: OptimizerName = "adam_tf"
    """`adam_tf`: TensorFlow 1's Adam as OAI; `adam_torch`: torch.optim.Adam (eps inside the bias correction)"""
    vf_coef: float = 0.1
    """weight of the value loss"""
    cliprange: float = 0.2
    """PPO clip range of the probability ratio"""
    cliprange_value: float = 0.2
    """clip range of the value change"""
    gamma: float = 1.0
    """discount"""
    lam: float = 0.95
    """GAE lambda"""
    whiten_rewards: bool = True
    """scale rewards to unit variance (mean kept) per minibatch before GAE"""


@dataclass
class Args(RunArgs):
    """Stage 2: PPO against a trained reward model (trained first when none is given)."""

    task: TaskHParams = field(default_factory=TaskHParams)
    rewards: RewardHParams = field(default_factory=RewardHParams)
    ppo: PPOHParams = field(default_factory=PPOHParams)
    eval_labeler: str | None = None
    """also score samples with this labeler (`vader`, `vowels`, module:function) and log objective/labeler_score"""
    output_dir: str = "runs/policy"
    """metrics.jsonl, samples.jsonl, args.json, checkpoint/, and the final policy under policy/"""
    save_interval: int = 10
    """updates between checkpoints (0: only at the end)"""
    sample_interval: int = 10
    """updates between sample tables"""
    resume: cli.Resume = False
    """continue the run in output_dir from its last checkpoint; `auto`: if it has one, else start it (cli.Resume)"""
    shard_frozen: bool = True
    """under an engine that shards parameters (FSDP2, ZeRO-3: the accelerate config), shard the frozen reference
    policy and reward model as the policy is (each forward gathers them); False: every process holds them whole"""


MAY_CHANGE_ON_RESUME = {
    "resume",
    "shard_frozen",
    "save_interval",
    "sample_interval",
    "eval_labeler",
    "output_dir",
    "wandb_mode",
    "wandb_project",
    "run_name",
}
"""what a resumed run may set otherwise; the rest of its settings must be the checkpoint's
(`checkpoint.check_same_settings`)"""


def defaults_for_task(name: str) -> Args:
    preset = tasks.get_preset(name)
    overrides = dict(preset.policy)
    rewards = RewardHParams(**overrides.pop("rewards", {}))
    ppo_hparams = PPOHParams(**overrides.pop("ppo", {}))
    return Args(preset=name, task=preset.task, rewards=rewards, ppo=ppo_hparams, **overrides)


def validate(args: Args, world_size: int) -> None:
    """Fail before any work on sizes that do not divide (# OAI: lm_human_preferences/train_policy.py#L69-L75)."""
    p = args.ppo
    tasks.check_task(args.task)
    cli.require(
        0,
        {
            "ppo.total_episodes": p.total_episodes,
            "ppo.batch_size": p.batch_size,
            "ppo.nminibatches": p.nminibatches,
            "ppo.noptepochs": p.noptepochs,
            "ppo.gradient_accumulation_steps": p.gradient_accumulation_steps,
            "ppo.lr": p.lr,
            "ppo.adam_eps": p.adam_eps,
            "sample_interval": args.sample_interval,
        },
    )
    cli.require(0, {"save_interval": args.save_interval, "rewards.kl_coef": args.rewards.kl_coef}, strictly=False)
    if args.rewards.adaptive_kl:  # (a coefficient of 0 stays 0 however it adapts)
        cli.require(
            0,
            {
                "rewards.kl_coef": args.rewards.kl_coef,
                "rewards.target_kl": args.rewards.target_kl,
                "rewards.horizon": args.rewards.horizon,
            },
        )
    if p.batch_size % world_size:
        raise cli.UserError(f"ppo.batch_size={p.batch_size} must divide evenly over {world_size} processes")
    per_process = p.batch_size // world_size
    if per_process % p.nminibatches:
        raise cli.UserError(
            f"ppo.batch_size / processes = {per_process} must be divisible by ppo.nminibatches={p.nminibatches}"
        )
    if (per_process // p.nminibatches) % p.gradient_accumulation_steps:
        raise cli.UserError(
            f"a minibatch of {per_process // p.nminibatches} per process must be divisible by "
            f"ppo.gradient_accumulation_steps={p.gradient_accumulation_steps}"
        )
    if p.total_episodes < p.batch_size:
        raise cli.UserError(
            f"ppo.total_episodes={p.total_episodes} is less than one batch (ppo.batch_size={p.batch_size})"
        )
    if p.whiten_rewards and per_process // p.nminibatches < 8:
        raise cli.UserError(
            f"a minibatch of {per_process // p.nminibatches} per process is too small to whiten rewards over "
            "(at least 8): raise ppo.batch_size, lower ppo.nminibatches, or set --ppo.no-whiten-rewards"
        )


def load_reward_model(path: str, tokenizer) -> RewardModel:
    """The frozen reward model; it must read text with the policy's tokenizer."""
    if not os.path.isdir(path):
        raise cli.UserError(f"rewards.trained_model={path}: no such folder; train one with train_reward.py")
    if not os.path.exists(os.path.join(path, RewardModel.HEAD_FILE)):
        inside = os.path.join(path, "reward_model")
        hint = (
            f"pass {inside}, where train_reward.py saved it"
            if os.path.isdir(inside)
            else "train one with train_reward.py"
        )
        raise cli.UserError(
            f"rewards.trained_model={path} is not a reward model folder (no {RewardModel.HEAD_FILE}): {hint}"
        )
    fix = "put back a copy of the reward model, or train it again with train_reward.py"
    checkpoint.check_weights(path, fix)
    meta = os.path.join(path, RewardModel.META_FILE)  # read again by RewardModel.load: checked here, as one line
    checkpoint.load_or_explain(meta, lambda file: checkpoint.read_json(file)["base_model"], fix)
    reward_tokenizer = load_tokenizer(path)
    if reward_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise cli.UserError(
            f"rewards.trained_model={path} was trained with another tokenizer ({len(reward_tokenizer)} tokens) "
            f"than the policy's task.base_model ({len(tokenizer)} tokens)"
        )
    return RewardModel.load(path)


def forward_responses(model, contexts: torch.Tensor, responses: torch.Tensor, pad_id: int, temperature: float):
    """Logits (B, R, V) at the temperature and values (B, R) that predict each response token.

    Position t of the response is predicted from position Q-1+t (# OAI: lm_human_preferences/policy.py#L114-L124).
    """
    context_length = contexts.shape[1]
    logits, values = model(torch.cat([contexts, responses], dim=1), pad_id, positions=slice(context_length - 1, -1))
    return logits.float() / temperature, values  # OAI: lm_human_preferences/policy.py#L121


def reward_model_and_resume(args: Args, accelerator) -> tuple[str, bool]:
    """The reward model's folder, and whether stage 2 resumes from a checkpoint (`args.resume` and one saved;
    `--resume auto` resumes when the run saved anything: `checkpoint.resolve_resume`).

    Without `rewards.trained_model`, stage 1 runs first (OAI's train_new_model), in `output_dir`/reward with the
    preset's stage-1 settings and this run's task, seed and mixed precision. A resumed run takes the reward model
    that its stage 1 saved: after a kill in stage 2 the checkpoint's policy was trained against it, after a kill
    between the stages stage 2 starts over with it; a stage 1 stopped with a checkpoint of its own (preempted)
    continues from it; a resume with none of these is refused. All processes take the path the main process finds.
    """
    reward_args = train_reward.defaults_for_task(args.preset)  # OAI: launch.py#L116-L138
    reward_args.task, reward_args.seed, reward_args.mixed_precision = args.task, args.seed, args.mixed_precision
    reward_args.output_dir, reward_args.wandb_mode = os.path.join(args.output_dir, "reward"), args.wandb_mode
    reward_args.run_name = f"{args.run_name_for('policy')}_reward"
    reward_path = os.path.join(reward_args.output_dir, "reward_model")
    own_stage_1 = args.rewards.trained_model is None
    # stage 2's checkpoint; stage 1's reward model; stage 1's checkpoint (rank 0 decides, so that all processes
    # take the same path)
    found = [False, False, False]
    if accelerator.is_main_process:
        found[0] = checkpoint.state_file(checkpoint.folder(args.output_dir), "state.pt") is not None
        if own_stage_1:
            checkpoint.recover(reward_path)  # a swap killed between its renames
            found[1] = os.path.isdir(reward_path)  # complete: train_reward swaps it in whole
            found[2] = checkpoint.state_file(checkpoint.folder(reward_args.output_dir), "state.pt") is not None
    broadcast_object_list(found)
    saved_policy, trained, stage_1_saved = found
    resume = checkpoint.resolve_resume(args.resume, any(found), args.output_dir)
    resume_from_checkpoint = resume and saved_policy
    if not resume:  # before stage 1 trains, not after
        refuse_to_overwrite(args.output_dir, resumable=True)
    if not own_stage_1:
        return args.rewards.trained_model, resume
    if resume and not trained and not stage_1_saved:
        raise cli.UserError(
            f"--resume: no reward model in {reward_path}"
            + (
                ", which the checkpoint's policy was trained against; resume with --rewards.trained-model, "
                "or start over"
                if resume_from_checkpoint
                else f" and no checkpoint in {args.output_dir}/checkpoint; run without --resume, "
                "or point --output-dir at the run to resume"
            )
        )
    if not (resume and trained):
        reward_args.resume = resume and stage_1_saved
        path = train_reward.train(reward_args, accelerator)
        # stage 1's model and engine leave the accelerator: its checkpoints (accelerate's `save_state` under
        # DeepSpeed) then hold stage 2's models in the places a resumed run, which skips stage 1, has them
        accelerator.free_memory()
        return path, resume_from_checkpoint
    if not resume_from_checkpoint:  # killed after stage 1, before stage 2's first checkpoint
        if logs := earlier_logs(args.output_dir):  # logged by a stage 2 whose checkpoint is gone: kept, not restarted
            raise cli.UserError(
                f"--resume: no checkpoint in {checkpoint.folder(args.output_dir)} to continue {', '.join(logs)} "
                "from (deleted, or killed before its first save?); put it back, or move those files away to start "
                "stage 2 over"
            )
        accelerator.print(
            f"--resume: the reward model in {reward_path} is done and stage 2 saved no checkpoint: it starts over"
        )
    return reward_path, resume_from_checkpoint


def score_responses(
    reward_model, queries: torch.Tensor, responses: torch.Tensor, task: TaskHParams, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The responses as scored, truncated after `task.truncate_token` (B, R), and their scores (B,): the reward
    model's on the bare query + truncated response, `task.penalty_reward_value` for a response without the token.

    # OAI: lm_human_preferences/train_policy.py#L375-L404
    """
    scored = responses
    if task.truncate_token is not None:
        scored = truncate_after_token(responses, task.truncate_token, task.truncate_after, pad_id)
    scores = reward_model(torch.cat([queries, scored], dim=1), pad_id)  # (B,)
    if task.truncate_token is not None:
        passes = contains_truncate_token(responses, task.truncate_token, task.truncate_after)
        scores = torch.where(passes, scores, torch.full_like(scores, task.penalty_reward_value))
    return scored, scores


def decoded(tokenizer, rows: torch.Tensor, pad_id: int) -> list[str]:
    """The text of each row of token ids, without its pads."""
    return [tokenizer.decode(strip_pad(row, pad_id)) for row in rows]


def save_policy(path: str, model, tokenizer, accelerator) -> None:
    """The trained policy (LM, value head, tokenizer: `PolicyAndValue.save`), written by the main process from the
    whole tensors, which every process helps gather under a sharding engine."""
    state_dict = sharding.full_state_dict(accelerator, model)
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save(path, state_dict)
        tokenizer.save_pretrained(path)
        accelerator.print(f"saved the policy to {path}")
    accelerator.wait_for_everyone()


@dataclass(frozen=True)
class BatchSizes:
    """How a batch splits on each process (`validate` checks that they divide), and the run's number of updates."""

    per_process: int
    minibatch: int
    micro_batch: int
    num_updates: int

    @classmethod
    def of(cls, p: PPOHParams, world_size: int) -> "BatchSizes":
        per_process = p.batch_size // world_size
        minibatch = per_process // p.nminibatches
        num_updates = -(-p.total_episodes // p.batch_size)  # ceil: # OAI: lm_human_preferences/train_policy.py#L78-L79
        return cls(per_process, minibatch, minibatch // p.gradient_accumulation_steps, num_updates)


def load_models(args: Args, tokenizer, accelerator) -> tuple[RewardModel, PolicyAndValue, PolicyAndValue]:
    """The frozen reward model and reference policy, prepared for the engine (`Args.shard_frozen`), and the policy
    to train, in this order (each value head's initialisation draws from the seeded RNG)."""
    reward_model = load_reward_model(args.rewards.trained_model, tokenizer)
    reward_model = sharding.prepare_frozen(accelerator, reward_model, args.shard_frozen)
    ref_policy = PolicyAndValue(load_causal_lm(args.task.base_model), len(tokenizer))
    ref_policy = sharding.prepare_frozen(accelerator, ref_policy, args.shard_frozen)
    policy = PolicyAndValue(load_causal_lm(args.task.base_model), len(tokenizer)).to(accelerator.device)
    return reward_model, ref_policy, policy


def resume_loop(args: Args, accelerator, model, optimizer, kl_ctl, sampler, requested: dict) -> int:
    """Restore the last checkpoint into the model, optimizer, KL controller and query sampler (its settings must be
    `requested`, but for `MAY_CHANGE_ON_RESUME`); the update to continue from."""
    loop = checkpoint.load(args.output_dir, accelerator, model, optimizer)
    where = f"{args.output_dir}/checkpoint"
    checkpoint.check_same_settings(loop.get("settings"), requested, MAY_CHANGE_ON_RESUME, where)
    kl_ctl.value = loop["kl_coef"]
    sampler.skip(loop["sampler_batches"])
    accelerator.print(f"resumed after update {loop['update']}")
    return loop["update"] + 1


def save_loop(args: Args, accelerator, model, optimizer, update: int, kl_ctl, sampler, requested: dict) -> None:
    """A checkpoint after `update`, with what `resume_loop` restores."""
    loop_state = {
        "update": update,
        "kl_coef": kl_ctl.value,
        "sampler_batches": sampler.batches_drawn,
        "world_size": accelerator.num_processes,
        "settings": requested,
    }
    checkpoint.save(args.output_dir, accelerator, model, optimizer, loop_state)


@dataclass
class Rollout:
    """One update's batch on this process, as sampled, scored and rewarded; B rows, responses of R tokens."""

    queries: torch.Tensor  # (B, Q) bare queries: what the reward model reads
    contexts: torch.Tensor  # (B, Q'): what the policy reads
    responses: torch.Tensor  # (B, R)
    scored: torch.Tensor  # (B, R) the responses as scored (truncated)
    scores: torch.Tensor  # (B,)
    logprobs: torch.Tensor  # (B, R) at the temperature
    values: torch.Tensor  # (B, R)
    ref_logprobs: torch.Tensor  # (B, R)
    rewards: torch.Tensor  # (B, R) the KL penalty per token, the score added on the last
    non_score_reward: torch.Tensor  # (B, R) the KL penalty alone


def rollout(
    model,
    ref_policy,
    reward_model,
    queries: torch.Tensor,
    kl_coef: float,
    task: TaskHParams,
    tokenizer,
    hooks,
    accelerator,
) -> Rollout:
    """Responses to `queries` (`hooks.sample`), their logprobs and values, the reference's logprobs, the scores
    (`score_responses`) and the rewards (`ppo.compute_rewards`)."""
    pad_id = tokenizer.oai_pad_token_id
    # under mixed precision the rollout's forwards autocast as the PPO epochs' do (the prepared model's forward
    # does): the first minibatch's logprobs are the rollout's, its ratio 1
    with torch.no_grad(), accelerator.autocast():
        queries = queries.to(accelerator.device)
        contexts = format_queries(queries, tokenizer, task)
        with sharding.gathered(accelerator, model):
            responses, _ = accelerator.unwrap_model(model).sample(
                hooks.sample, contexts, pad_id, task.response_length, task.temperature, vocab_size=len(tokenizer)
            )
        logits, values = forward_responses(model, contexts, responses, pad_id, task.temperature)
        logprobs = logprobs_of(logits, responses, 1.0)  # (B, R), logits already at the temperature
        del logits
        ref_logits, _ = forward_responses(ref_policy, contexts, responses, pad_id, task.temperature)
        ref_logprobs = logprobs_of(ref_logits, responses, 1.0)
        del ref_logits
        scored, scores = score_responses(reward_model, queries, responses, task, pad_id)
        rewards, non_score_reward = ppo.compute_rewards(scores, logprobs, ref_logprobs, kl_coef)
    return Rollout(
        queries, contexts, responses, scored, scores, logprobs, values, ref_logprobs, rewards, non_score_reward
    )


def ppo_epochs(
    model,
    optimizer,
    batch: Rollout,
    p: PPOHParams,
    sizes: BatchSizes,
    temperature: float,
    pad_id: int,
    hooks,
    accelerator,
) -> dict[str, list[torch.Tensor]]:
    """`noptepochs` passes over the batch in shuffled minibatches (`hooks.permutation`), each one optimizer step over
    `gradient_accumulation_steps` micro-batches; each minibatch's stats, as OAI logs them."""
    ppo_stats: dict[str, list[torch.Tensor]] = {}
    for _ in range(p.noptepochs):  # OAI: lm_human_preferences/train_policy.py#L184-L192
        order = hooks.permutation(sizes.per_process, device=accelerator.device)
        for mb in order.split(sizes.minibatch):
            advantages, returns = ppo.minibatch_advantages(
                batch.values[mb], batch.rewards[mb], p.gamma, p.lam, p.whiten_rewards
            )
            micro_stats = []
            for micro_start in range(0, sizes.minibatch, sizes.micro_batch):
                micro = slice(micro_start, micro_start + sizes.micro_batch)
                idx = mb[micro]
                last_micro = micro_start + sizes.micro_batch == sizes.minibatch
                with contextlib.nullcontext() if last_micro else accelerator.no_sync(model):
                    new_logits, new_values = forward_responses(
                        model, batch.contexts[idx], batch.responses[idx], pad_id, temperature
                    )
                    new_logprobs = logprobs_of(new_logits, batch.responses[idx], 1.0)
                    loss, stats = ppo.ppo_loss(
                        new_logprobs,
                        new_values,
                        batch.logprobs[idx],
                        batch.values[idx],
                        advantages[micro],
                        returns[micro],
                        p.cliprange,
                        p.cliprange_value,
                        p.vf_coef,
                        entropy=ppo.entropy_from_logits(new_logits.detach()),
                    )
                    accelerator.backward(loss / p.gradient_accumulation_steps)
                stats.update(ppo.ratio_diagnostics(new_logprobs.detach(), batch.logprobs[idx]))
                micro_stats.append(stats)
            for k, v in ppo.merge_micro_batch_stats(micro_stats).items():  # the minibatch's, as OAI logs them
                ppo_stats.setdefault(k, []).append(v)
            optimizer.step()
            optimizer.zero_grad()
    return ppo_stats


def update_metrics(
    batch: Rollout, ppo_stats: dict, kl_coef: float, eval_labeler, tokenizer, accelerator, memory: dict
) -> dict[str, float]:
    """OAI's metrics of an update over all processes, `memory` (`sharding.memory_stats`) and, with an `eval_labeler`,
    its score of the samples."""
    device, pad_id = accelerator.device, tokenizer.oai_pad_token_id
    with torch.no_grad():
        kl = (batch.logprobs - batch.ref_logprobs).sum(1)  # (B,), # OAI: lm_human_preferences/train_policy.py#L217-L262
        local = {
            "objective/kl": kl.mean(),
            # OAI: lm_human_preferences/train_policy.py#L222 (the summed -logprobs)
            "objective/entropy": (-batch.logprobs).sum(1).mean(),
            "objective/scores": batch.scores.mean(),
            "objective/score_total": (batch.scores + batch.non_score_reward.sum(1)).mean(),
            "objective/kl_coef": torch.tensor(kl_coef, device=device),
            **{f"ppo/{k}": v for k, v in ppo.reduce_minibatch_stats(ppo_stats).items()},
        }
        if eval_labeler is not None:
            score = eval_labeler(decoded(tokenizer, batch.queries, pad_id), decoded(tokenizer, batch.scored, pad_id))
            local["objective/labeler_score"] = torch.tensor(score, dtype=torch.float32, device=device).mean()
        metrics = ppo.reduce_across_processes(local, accelerator.reduce) | memory
    # OAI: lm_human_preferences/train_policy.py#L241
    metrics["ppo/val/var_explained"] = 1 - metrics["ppo/val/error"] / max(metrics["ppo/returns/var"], 1e-12)
    return metrics


def log_samples(tracker: Tracker, update: int, batch: Rollout, tokenizer) -> None:
    """The first 8 queries, responses (as scored) and scores of the batch."""
    pad_id = tokenizer.oai_pad_token_id
    rows = zip(
        decoded(tokenizer, batch.queries[:8], pad_id), decoded(tokenizer, batch.scored[:8], pad_id), batch.scores[:8]
    )
    tracker.log_samples(update, [{"query": q, "response": r, "score": float(s)} for q, r, s in rows])


def train(
    args: Args, accelerator, hooks: StageHooks | None = None
) -> tuple[PolicyAndValue, ppo.AdaptiveKLController | ppo.FixedKLController]:
    """Run stage 2 (and stage 1 first when no reward model is given); returns the policy and its KL controller.
    On SIGTERM or SIGUSR1 it stops after the update in flight, with a checkpoint, and raises `preemption.Preempted`.

    `hooks`: where queries, responses and minibatch orders come from (`StageHooks`; None: this stage's own).
    """
    with preemption.listening() as stop:
        return train_until_stopped(args, accelerator, hooks or StageHooks(), stop)


def train_until_stopped(
    args: Args, accelerator, hooks: StageHooks, stop: preemption.StopSignals
) -> tuple[PolicyAndValue, ppo.AdaptiveKLController | ppo.FixedKLController]:
    """`train`, asking `stop` after each update (all processes agree) whether a signal asks the run to stop."""
    validate(args, accelerator.num_processes)
    precision.check_accelerator(accelerator, args.mixed_precision)
    requested = checkpoint.settings(args)  # as given: the reward model's path, filled in below, follows output_dir
    rank, world = accelerator.process_index, accelerator.num_processes
    tokenizer = load_tokenizer(args.task.base_model)
    tasks.check_truncate_token(args.task, len(tokenizer))  # like a bad labeler name: an error before stage 1, not after
    eval_labeler = labelers.load_labeler(args.eval_labeler) if args.eval_labeler else None
    args.rewards.trained_model, args.resume = reward_model_and_resume(args, accelerator)
    set_seed(args.seed + rank * 100003)  # OAI: lm_human_preferences/utils/core.py#L108-L111
    pad_id = tokenizer.oai_pad_token_id
    reward_model, ref_policy, policy = load_models(args, tokenizer, accelerator)
    p, sizes = args.ppo, BatchSizes.of(args.ppo, world)
    optimizer = make_optimizer(p.optimizer, policy.parameters(), p.lr, p.adam_eps)
    kl_ctl = args.rewards.kl_controller()
    sampler = hooks.query_sampler(
        args.task, tokenizer, batch_size=sizes.per_process, seed=args.task.query_seed, rank=rank, world_size=world
    )
    model, optimizer = sharding.prepare(
        accelerator, policy, optimizer, sizes.micro_batch, p.gradient_accumulation_steps
    )
    start_update = resume_loop(args, accelerator, model, optimizer, kl_ctl, sampler, requested) if args.resume else 1
    tracker = Tracker.for_run(args, "policy", accelerator, resume_after_step=start_update - 1 if args.resume else None)
    num_updates = sizes.num_updates
    if signal_name := stop.agreed(accelerator):  # received while stage 1 ran or the models loaded
        save_loop(args, accelerator, model, optimizer, start_update - 1, kl_ctl, sampler, requested)
        tracker.finish()
        raise preemption.stopped(start_update - 1, num_updates, "update", signal_name)
    bar = progress_bar(
        num_updates, "PPO updates", "update", enabled=accelerator.is_main_process, initial=start_update - 1
    )
    started = time.time()
    for update in range(start_update, num_updates + 1):
        update_started = time.time()
        lr = (1.0 - (update - 1.0) / num_updates) * p.lr  # OAI: lm_human_preferences/train_policy.py#L172-L173
        for group in optimizer.param_groups:
            group["lr"] = lr

        # ---------------------------------------------------------------- rollout, score, rewards
        queries = next(sampler)
        batch = rollout(
            model, ref_policy, reward_model, queries, kl_ctl.value, args.task, tokenizer, hooks, accelerator
        )

        # ---------------------------------------------------------------- PPO epochs
        ppo_stats = ppo_epochs(model, optimizer, batch, p, sizes, args.task.temperature, pad_id, hooks, accelerator)

        # ---------------------------------------------------------------- stats, KL controller
        memory = sharding.memory_stats(accelerator, model, optimizer, ref_policy, reward_model)  # largest of ranks
        metrics = update_metrics(batch, ppo_stats, kl_ctl.value, eval_labeler, tokenizer, accelerator, memory)
        kl_ctl.update(metrics["objective/kl"], p.batch_size)  # OAI: lm_human_preferences/train_policy.py#L305
        hooks.after_update(update, accelerator.unwrap_model(model))

        # ---------------------------------------------------------------- log, checkpoint
        metrics |= {"ppo/lr": lr, "episodes": update * p.batch_size, "time/update_s": time.time() - update_started}
        metrics["time/episodes_per_s"] = (update - start_update + 1) * p.batch_size / (time.time() - started)
        tracker.log(update, metrics)
        bar.update()
        if accelerator.is_local_main_process:  # as accelerator.print, above the progress bar
            bar.write(
                f"update {update}/{num_updates}  score {metrics['objective/scores']:+.3f}  "
                f"kl {metrics['objective/kl']:.3f}  kl_coef {kl_ctl.value:.4f}  "
                f"approxkl {metrics['ppo/policy/approxkl']:.4f}  {metrics['time/update_s']:.1f}s"
            )
        if update % args.sample_interval == 0 or update in (1, num_updates):
            log_samples(tracker, update, batch, tokenizer)
        signal_name = stop.agreed(accelerator)
        if (args.save_interval and update % args.save_interval == 0) or update == num_updates or signal_name:
            save_loop(args, accelerator, model, optimizer, update, kl_ctl, sampler, requested)
        if signal_name and update < num_updates:
            bar.close()
            tracker.finish()
            raise preemption.stopped(update, num_updates, "update", signal_name)
    bar.close()

    save_policy(os.path.join(args.output_dir, "policy"), model, tokenizer, accelerator)
    tracker.finish()
    return accelerator.unwrap_model(model), kl_ctl


@cli.main_with_user_errors
def main() -> None:
    args = cli.parse(Args, defaults_for_task, default_task="sentiment", presets=tasks.PRESETS)
    train(args, sharding.make_accelerator(args.mixed_precision))


if __name__ == "__main__":
    main()
    cli.exit_finished_rank()
