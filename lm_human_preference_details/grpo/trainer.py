"""The GRPO trainer: reads groups from the stream, one optimizer step per `batch_size` samples,
then pushes the new weights into the inference servers.

    for step = 1 .. steps:
        read batch_size / group_size groups from the stream (waiting if the actor is behind;
        sync mode waits for the whole round of `sync_steps` batches, as conventional RL does)
        advantages: reward - group mean (options: leave-one-out, / std of the group or the batch; the raw
        rewards instead, relu)
        pack the groups into micro-batches of at most `token_budget` tokens (a group's prompt
        goes through the model once, its attempts share its keys and values)
        loss: REINFORCE with the importance ratio pi/mu capped above (or PPO-clip, or GSPO), optional k3 KL
              and entropy bonus (their coefficients on a linear schedule), summed over tokens and divided by the
              number of sequences (or TRL's and PipelineRL's other normalisers; `--recipe` sets them all);
              completions cut by the length limit optionally left out; backward per micro-batch
        clip the gradient norm, optimizer step, version += 1
        pipeline: push the weights to every server now (sent while the next step runs); sync: every
        `sync_steps` steps
        log reward, success rate, lag (trainer version - token version), throughput, entropy, ESS, and the actor's
        evaluations that arrived (`--eval-every`; the last one is waited for after the last step)
        every `save_interval` steps: checkpoint (model folder, optimizer, version, stream position)
        on SIGTERM or SIGUSR1 (the launcher forwards its own): a checkpoint after the step in flight (at once while
        waiting for the stream), then stop

`train` is that loop; `GroupReader`, `optimizer_step` (`accumulate_gradients`), `ServerUpdates`, `step_metrics` /
`log_step`, `EvaluationLog` and `checkpoints.save_checkpoint` are its lines, `load_learner` what it starts from.

`--trainer-processes N` (N > 1): N processes run that loop, with the policy, its gradients and optimizer state and
the reference sharded over them by FSDP2 (`sharding`). Each reads every group of a step from the stream and runs
the forward and backward passes of every N-th micro-batch, all of them as many passes (the collectives need every
process); the gradients are reduced once, after the last pass, and the stats over every process. For a push the
weights are gathered a bucket at a time (every process joins) and the first process sends each bucket while the next
is gathered, never holding the whole weights; it alone logs, and it writes the checkpoint from the gathered weights
and optimizer state (whole tensors, which a resume shards again).

Run alone against servers and an actor already running:
`python -m lm_human_preference_details.grpo.trainer --task tiny --servers http://127.0.0.1:8000 --output-dir DIR`
(sharded: under `accelerate launch --config_file configs/accelerate/fsdp2.yaml --num_processes N`, with
`--trainer-processes N`)
"""

import collections
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from lm_human_preference_details import cli, preemption, sharding
from lm_human_preference_details.grpo import checkpoints
from lm_human_preference_details.grpo.client import check_serving
from lm_human_preference_details.grpo.config import PRESETS, GRPOArgs, get_preset
from lm_human_preference_details.grpo.lifetime import exit_now
from lm_human_preference_details.grpo.loss import (
    LossSettings,
    PolicyLoss,
    group_advantages,
    linear_decay,
    policy_loss,
    policy_weights,
    token_weights,
)
from lm_human_preference_details.grpo.records import Attempt, Evaluation, Group
from lm_human_preference_details.grpo.rewards import pass_at_k
from lm_human_preference_details.grpo.streams import open_reader
from lm_human_preference_details.grpo.weights import WeightSender, buckets, served_dtype, tensor_specs
from lm_human_preference_details.models import load_causal_lm, temperature_log_softmax
from lm_human_preference_details.optim import make_optimizer
from lm_human_preference_details.progress import LOG_INTERVAL_S
from lm_human_preference_details.tracking import Tracker

log = logging.getLogger(__name__)

Part = tuple[int, int, int]
"""attempts first..end-1 of group i: (i, first, end)"""


def pack(groups: list[Group], token_budget: int) -> list[list[Part]]:
    """The groups' attempts packed into micro-batches whose padded tokens fit the budget: each part's
    prompt once (see `token_logprobs`), padded to the longest prompt, plus every completion, padded to
    the longest completion. A group too big for the budget is split into parts of as many attempts as
    fit (at least one); parts with the longest completions go first, so parts of similar length
    share a micro-batch and little is padding."""

    def cost(batch: list[Part]) -> int:
        prompt = max(len(groups[i].prompt_ids) for i, _, _ in batch)
        completion = max(len(a.completion_ids) for i, first, end in batch for a in groups[i].attempts[first:end])
        return len(batch) * prompt + sum(end - first for _, first, end in batch) * completion

    parts = []
    for i, group in enumerate(groups):
        prompt, attempts = len(group.prompt_ids), len(group.attempts)
        completion = max(len(a.completion_ids) for a in group.attempts)
        per_part = max(1, min(attempts, (token_budget - prompt) // completion))
        parts += [(i, first, min(first + per_part, attempts)) for first in range(0, attempts, per_part)]
    batches: list[list[Part]] = []
    for part in sorted(parts, key=lambda part: -cost([part])):
        if batches and cost(batches[-1] + [part]) <= token_budget:
            batches[-1].append(part)
        else:
            batches.append([part])
    return batches


def batch_tensors(groups: list[Group], parts: list[Part], device) -> dict[str, torch.Tensor]:
    """Each part's prompt once, right-padded (`prompt_ids`, `prompt_mask`, `prompt_lengths`), and its
    attempts, one row each (`rows`: the index of the row's sample in `flatten_groups`, and
    `prompt_row`: its prompt's row): completion ids right-padded, `mask` on the completion tokens, and
    the behaviour logprobs."""
    first_sample = [0]
    for g in groups:
        first_sample.append(first_sample[-1] + len(g.attempts))
    prompts = [groups[i].prompt_ids for i, _, _ in parts]
    attempts = [
        (p, groups[i].attempts[j], first_sample[i] + j)
        for p, (i, first, end) in enumerate(parts)
        for j in range(first, end)
    ]
    p_len, c_len = max(map(len, prompts)), max(len(a.completion_ids) for _, a, _ in attempts)
    # plain lists, one tensor per field: a tensor per row costs more than the model on tiny
    tensors = dict(
        prompt_ids=torch.tensor([p + [0] * (p_len - len(p)) for p in prompts]),
        prompt_mask=torch.tensor([[1] * len(p) + [0] * (p_len - len(p)) for p in prompts]),
        prompt_lengths=torch.tensor([len(p) for p in prompts]),
        rows=torch.tensor([sample for _, _, sample in attempts]),
        prompt_row=torch.tensor([p for p, _, _ in attempts]),
        completion_ids=torch.tensor([a.completion_ids + [0] * (c_len - len(a.completion_ids)) for _, a, _ in attempts]),
        mask=torch.tensor(
            [[1.0] * len(a.completion_ids) + [0.0] * (c_len - len(a.completion_ids)) for _, a, _ in attempts]
        ),
        behaviour=torch.tensor([a.logprobs + [0.0] * (c_len - len(a.logprobs)) for _, a, _ in attempts]),
    )
    return {k: v.to(device) for k, v in tensors.items()}


def token_logprobs(
    model, batch: dict, temperature: float, vocab_size: int, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of each completion token at the sampling temperature (rows, completion length) and
    the entropy of each next-token distribution (detached unless `entropy_grad`: an entropy bonus), logits
    restricted to the tokenizer's ids as the server's are. A group's prompt goes through the model once, not once
    per attempt: its keys and values are shared by the group's rows (gradients flow back through both passes), the
    same numbers as a forward of each prompt + completion, for a fraction of the work when completions are short."""
    # of the prompt positions only the last predicts a completion token: the output layer sees only it
    last_prompt_position = (batch["prompt_lengths"] - 1)[:, None]
    prompt = model(
        input_ids=batch["prompt_ids"],
        attention_mask=batch["prompt_mask"],
        use_cache=True,
        logits_to_keep=last_prompt_position,
    )
    if not all(type(layer) is DynamicLayer for layer in prompt.cache.layers):
        raise NotImplementedError(
            f"{type(model).__name__} has sliding-window or linear-attention layers: the trainer shares a "
            "prompt's keys and values across its attempts, which needs full-attention layers"
        )
    row = batch["prompt_row"]
    cache = DynamicCache(ddp_cache_data=[(layer.keys[row], layer.values[row]) for layer in prompt.cache.layers])
    completion_length = batch["completion_ids"].shape[1]
    positions = batch["prompt_lengths"][row, None] + torch.arange(completion_length, device=row.device)
    attention = torch.cat([batch["prompt_mask"][row], batch["mask"].long()], dim=1)
    completion = model(input_ids=batch["completion_ids"], attention_mask=attention, position_ids=positions, cache=cache)
    logits = torch.cat([prompt.logits[row], completion.logits[:, :-1]], dim=1)[..., :vocab_size]
    logprobs = temperature_log_softmax(logits, temperature)
    taken = logprobs.gather(2, batch["completion_ids"][..., None])[..., 0]
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):  # else no vocabulary-wide graph kept
        entropy = -(logprobs.exp() * logprobs).sum(-1)
    return taken, entropy


def check_group(group: Group, args: GRPOArgs) -> None:
    """UserError when a stream record was made with other settings than this trainer's: a group of another
    size would be split or merged by the advantage baseline, and logprobs at another temperature make pi/mu
    wrong for every token (a trainer and an actor started apart, with different flags)."""
    if len(group.attempts) != args.sampling.group_size:
        raise cli.UserError(
            f"the stream's group for problem {group.problem_id!r} has {len(group.attempts)} attempts, "
            f"this trainer's --group-size is {args.sampling.group_size}: start the trainer with the actor's settings"
        )
    # streams written before it was recorded (None): trusted
    if group.temperature is not None and group.temperature != args.sampling.temperature:
        raise cli.UserError(
            f"the stream's group for problem {group.problem_id!r} was sampled at temperature "
            f"{group.temperature}, this trainer's --temperature is {args.sampling.temperature}: start the trainer "
            "with the actor's settings"
        )


def flatten_groups(groups: list[Group]) -> list[Attempt]:
    """Stream records (one per problem: prompt and `group_size` attempts) -> their attempts, one per sample."""
    return [attempt for g in groups for attempt in g.attempts]


def loss_settings(args: GRPOArgs, step: int) -> LossSettings:
    """The loss's settings for the step after `step` completed ones: the KL coefficient and the entropy bonus each go
    linearly from its value to its `_final` one (None: it stays) over the run's steps, as PipelineRL's schedules do."""
    loss = args.loss
    kl_final = loss.kl_coef if loss.kl_coef_final is None else loss.kl_coef_final
    entropy_final = loss.entropy_coef if loss.entropy_coef_final is None else loss.entropy_coef_final
    return LossSettings(
        loss_type=loss.loss_type,
        ratio_cap=loss.ratio_cap,
        importance_sampling=loss.importance_sampling,
        clip_eps=loss.clip_eps,
        clip_eps_high=loss.clip_eps_high,
        kl_coef=linear_decay(step, args.optim.steps, loss.kl_coef, kl_final),
        kl_clamp=loss.kl_clamp,
        entropy_coef=linear_decay(step, args.optim.steps, loss.entropy_coef, entropy_final),
    )


def loss_rows(groups: list[Group], args: GRPOArgs, rewards: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per sample, in `flatten_groups` order: `policy_weights`, what multiplies its log pi (its advantage, or
    reward); `kept`, 0 where overlong filtering leaves it out (finish_reason `length`); `group_tokens`, its
    group's mean prompt + completion length (PipelineRL's group normalisation)."""
    loss = args.loss
    advantages = group_advantages(
        rewards, args.sampling.group_size, loss.baseline, loss.divide_by_std, std_over=loss.std_over
    )
    samples = flatten_groups(groups)
    cut = [loss.overlong_filtering and s.finish_reason == "length" for s in samples]
    # PipelineRL: pipelinerl/finetune/rl/__init__.py#L473, the mean over the group of its sequences' lengths
    group_tokens = [
        len(g.prompt_ids) + sum(len(a.completion_ids) for a in g.attempts) / len(g.attempts)
        for g in groups
        for _ in g.attempts
    ]
    return {
        "policy_weights": policy_weights(advantages, rewards, loss.use_advantages, loss.relu_policy_weights),
        "kept": torch.tensor([0.0 if c else 1.0 for c in cut]),
        "group_tokens": torch.tensor(group_tokens),
    }


@dataclass(frozen=True)
class WeightTotals:
    """An importance weight over a step's completion tokens: its sum, sum of squares, count and max, from which its
    batch-wide ESS (`effective_sample_size`'s)."""

    sum: float
    squares: float
    count: float
    max: float

    @classmethod
    def of(cls, weights: torch.Tensor, share: float) -> "WeightTotals":
        """Of the weights given (1-D), times `share` (0: a filler pass, which adds nothing)."""
        w = weights.double()
        top = float(w.max()) if share and w.numel() else -math.inf
        return cls(float(w.sum()) * share, float(w.square().sum()) * share, w.numel() * share, top)

    def add(self, other: "WeightTotals") -> "WeightTotals":
        return WeightTotals(
            self.sum + other.sum, self.squares + other.squares, self.count + other.count, max(self.max, other.max)
        )

    def ess(self) -> float:
        squares = self.count * self.squares
        return self.sum**2 / squares if squares > 0 else 0.0


@dataclass(frozen=True)
class StepStatistics:
    """A step's statistics, added up micro-batch by micro-batch (`add`), then over the trainer's processes
    (`over_processes`): `policy_loss`'s stats times the tokens in the loss, the entropy summed over the completion
    tokens, both token counts, and the totals of the raw ratio pi/mu and of reinforce's capped weight over every
    completion token (a row that overlong filtering leaves out of the loss too)."""

    loss_stats: dict[str, float]
    entropy: float
    tokens: float
    tokens_in_loss: float
    ratio: WeightTotals
    weight: WeightTotals | None

    @classmethod
    def of_micro_batch(
        cls, out: PolicyLoss, in_loss: torch.Tensor, completion: torch.Tensor, entropy: torch.Tensor, share: float
    ) -> "StepStatistics":
        """A micro-batch's: `in_loss` and `completion` its masks of the tokens in the loss and of every completion
        token; `share` 0 for a filler pass."""
        n = float(in_loss.sum()) * share
        on_tokens = completion.bool()
        return cls(
            loss_stats={k: float(v) * n for k, v in out.stats.items()},
            entropy=float((entropy.detach() * completion).sum()) * share,
            tokens=float(completion.sum()) * share,
            tokens_in_loss=n,
            ratio=WeightTotals.of(out.ratio[on_tokens], share),
            weight=None if out.weight is None else WeightTotals.of(out.weight[on_tokens], share),
        )

    def add(self, other: "StepStatistics") -> "StepStatistics":
        return StepStatistics(
            {k: v + other.loss_stats[k] for k, v in self.loss_stats.items()},
            self.entropy + other.entropy,
            self.tokens + other.tokens,
            self.tokens_in_loss + other.tokens_in_loss,
            self.ratio.add(other.ratio),
            None if self.weight is None else self.weight.add(other.weight),
        )

    def over_processes(self, accelerator) -> "StepStatistics":
        """Summed (the maxima maxed) over the trainer's processes; as it is for one."""
        weights = [w for w in (self.ratio, self.weight) if w is not None]
        counts = [*self.loss_stats.values(), self.entropy, self.tokens, self.tokens_in_loss]
        sums = over_processes(counts + [x for w in weights for x in (w.sum, w.squares, w.count)], "sum", accelerator)
        maxima = over_processes([w.max for w in weights], "max", accelerator)
        n = len(self.loss_stats)
        totals = [WeightTotals(*sums[i : i + 3], top) for i, top in zip(range(n + 3, len(sums), 3), maxima)]
        weight = totals[1] if len(totals) > 1 else None
        return StepStatistics(dict(zip(self.loss_stats, sums[:n])), *sums[n : n + 3], totals[0], weight)

    def metrics(self) -> dict[str, float]:
        """`policy_loss`'s stats as means over the tokens in the loss (0 for a batch all cut by overlong filtering),
        but the raw ratio's and the weight's max and ESS over every completion token; the mean entropy."""
        means = {k: v / max(self.tokens_in_loss, 1.0) for k, v in self.loss_stats.items()}
        means |= {"ratio/max": self.ratio.max, "ess": self.ratio.ess()}
        if self.weight is not None:
            means |= {"weight/max": self.weight.max, "weight/ess": self.weight.ess()}
        return means | {"entropy": self.entropy / self.tokens}


def process_passes(micro_batches: list[list[Part]], accelerator=None) -> list[tuple[list[Part], float]]:
    """This process's forward/backward passes, (micro-batch, share): under several processes every n-th micro-batch
    (share 1), then filler passes (share 0, the first micro-batch again) up to as many passes as any process runs:
    FSDP2 gathers and reduces in every pass, which every process must join."""
    processes, rank = (accelerator.num_processes, accelerator.process_index) if accelerator else (1, 0)
    mine = micro_batches[rank::processes]
    passes = -(-len(micro_batches) // processes)
    return [(mine[i], 1.0) if i < len(mine) else (micro_batches[0], 0.0) for i in range(passes)]


def accumulate_gradients(
    model,
    reference,
    groups: list[Group],
    rewards: torch.Tensor,
    args: GRPOArgs,
    vocab_size: int,
    step: int = 0,
    accelerator=None,
) -> dict[str, float]:
    """One optimizer step's gradients, added into the parameters' `.grad` micro-batch by micro-batch (`pack`):
    the gradient of the whole step's loss (summed over its tokens, divided by its number of sequences or
    `loss_normalizer`'s count), however the groups are packed. `rewards`: one per sample, in `flatten_groups` order;
    `step`: optimizer steps completed before this one (where the KL and entropy schedules are). Returns the step's
    stats (`StepStatistics.metrics`) and the coefficients.

    Under several trainer processes (`accelerator`; each called with the whole step's groups) each process runs its
    `process_passes`; gradients are reduced once, after the last pass, and the stats are over every process's
    tokens."""
    processes = accelerator.num_processes if accelerator else 1
    num_sequences = len(rewards)
    rows = {k: v.to(model.device) for k, v in loss_rows(groups, args, rewards).items()}
    kept_tokens = sum(len(s.completion_ids) for s, k in zip(flatten_groups(groups), rows["kept"].tolist()) if k)
    settings, temperature = loss_settings(args, step), args.sampling.temperature
    passes = process_passes(pack(groups, args.optim.token_budget), accelerator)
    totals = None
    for i, (parts, share) in enumerate(passes):
        batch = batch_tensors(groups, parts, model.device)
        last = i == len(passes) - 1
        with (
            accelerator.no_sync(model) if accelerator and not last else contextlib.nullcontext(),
            accelerator.autocast() if accelerator else contextlib.nullcontext(),  # the reference's forward too
        ):
            new_logprobs, entropy = token_logprobs(
                model, batch, temperature, vocab_size, entropy_grad=settings.entropy_coef != 0
            )
            ref_logprobs = token_logprobs(reference, batch, temperature, vocab_size)[0].detach() if reference else None
            kept = rows["kept"][batch["rows"]]
            in_loss = batch["mask"] * kept[:, None]
            out = policy_loss(
                new_logprobs,
                batch["behaviour"],
                rows["policy_weights"][batch["rows"]],
                batch["mask"],
                num_sequences,
                settings,
                kept=kept,
                ref_logprobs=ref_logprobs,
                entropy=entropy,
                weights=None
                if args.loss.loss_normalizer == "sequences"
                else token_weights(
                    in_loss,
                    args.loss.loss_normalizer,
                    num_sequences,
                    num_tokens=kept_tokens,
                    max_tokens=args.sampling.max_tokens,
                    group_tokens=rows["group_tokens"][batch["rows"]],
                ),
            )
            # FSDP2 averages the processes' gradients, and the step's is their sum
            (out.loss * (share * processes) if processes > 1 else out.loss).backward()
        part = StepStatistics.of_micro_batch(out, in_loss, batch["mask"], entropy, share)
        totals = part if totals is None else totals.add(part)
    return totals.over_processes(accelerator).metrics() | {
        "kl/coef": settings.kl_coef,
        "entropy/coef": settings.entropy_coef,
    }


def over_processes(values: list[float], op: str, accelerator) -> list[float]:
    """`values` summed (`op` "sum") or maxed ("max") over the trainer's processes, elementwise (as they are, for one);
    every process calls it with as many."""
    if accelerator is None or accelerator.num_processes == 1:
        return values
    mine = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    return accelerator.reduce(mine, op).tolist()


def train(args: GRPOArgs, wait_for_servers: Callable[[], list[str]]) -> None:
    """Train until `args.optim.steps`; `wait_for_servers()` returns the servers' URLs once they serve (the
    launcher starts the trainer while they load: models and optimizer are ready by then).

    With `--trainer-processes` over 1, every process runs this (started by the launcher, or by `accelerate launch`
    with configs/accelerate/fsdp2.yaml): each reads the whole stream and trains on its share of each step, and only
    the main one sends weights to the servers, logs and writes checkpoints.

    On SIGTERM or SIGUSR1 it stops after the step in flight (every process after the same one), with a checkpoint,
    and raises `preemption.Preempted`."""
    with preemption.listening() as stop:
        train_until_stopped(args, wait_for_servers, stop)


def train_until_stopped(
    args: GRPOArgs, wait_for_servers: Callable[[], list[str]], stop: preemption.StopSignals
) -> None:
    """`train`, asking `stop` after each step and while waiting for the stream (all processes agree) whether a signal
    asks the run to stop."""
    torch.manual_seed(args.seed)
    accelerator = trainer_accelerator(args)
    torch.set_num_threads(args.torch_threads("trainer"))  # after accelerate, which sets a share of its own
    learner = load_learner(args, accelerator)
    model, optimizer, version = learner.model, learner.optimizer, learner.version
    main = accelerator is None or accelerator.is_main_process
    server_urls = wait_for_servers()
    # once the servers serve: a run whose servers never started leaves no wandb run or metrics behind
    tracker = Tracker.for_run(
        args, f"grpo_{args.schedule.mode}", accelerator, resume_after_step=version if args.resume else None
    )
    servers = ServerUpdates(args, server_urls, sends=main)

    def everyone_has(ready: bool) -> bool:
        """Whether every process has its step's groups (`ready`: this one's), asked of all at once; a signal any of
        them received ends the wait on all (after a signal to every process of a job, the actor's too, no more may
        come). No server left to update (no samples would ever come) fails the first process, which alone sends to
        them; the launcher then stops the others."""
        signal_name = stop.agreed(accelerator)
        if signal_name:
            raise SignalledWhileWaiting(signal_name)
        servers.check()
        return not over_processes([float(not ready)], "max", accelerator)[0]

    stream = GroupReader(args, start=learner.stream_position, everyone_has=everyone_has)
    evaluations = EvaluationLog(args, tracker, start=version) if main and args.evaluation.eval_every else None

    def stopped_after(step: int, signal_name: str) -> preemption.Preempted:
        """The stop after `step`, checkpointed: the streams and the tracker closed."""
        stream.close()
        if evaluations is not None:
            evaluations.close()
        tracker.finish()
        return preemption.stopped(step, args.optim.steps, "step", signal_name)

    timer = StepTimer()
    schedule = args.run_schedule()
    while version < args.optim.steps:
        timer.waiting_for_data()
        try:
            groups = stream.read_step(version)
        except SignalledWhileWaiting as signalled:
            checkpoints.save_checkpoint(
                args, model, learner.tokenizer, optimizer, version, stream.position, accelerator
            )
            raise stopped_after(version, str(signalled)) from None
        timer.training()
        samples = flatten_groups(groups)
        rewards = torch.tensor([s.reward for s in samples])
        stats, grad_norm = optimizer_step(learner, groups, rewards, args, version, accelerator)
        version += 1
        signal_name = stop.agreed(accelerator)
        push_s = 0.0
        # a stopping run's checkpoint holds these weights, and its servers may be ending on the same signal; a run
        # signalled at its last step ends as a finished one, whose last weights go out (its last evaluation's)
        if not signal_name or version == args.optim.steps:
            push_s = servers.push_if_due(model, version, accelerator, stop)
        times = timer.step_done(push_s)
        if accelerator is not None:  # what the largest process holds: a share of the model, not all of it
            stats |= sharding.memory_stats(accelerator, model, optimizer, *filter(None, [learner.reference]))
        if main:
            metrics = step_metrics(samples, rewards, version, grad_norm, times, servers.last_broadcast_s)
            log_step(tracker, args, version, groups, {**metrics, **stats})
            if evaluations is not None:
                evaluations.log_arrived(version)
        if schedule.due(args.save_interval, version) or signal_name:
            checkpoints.save_checkpoint(
                args, model, learner.tokenizer, optimizer, version, stream.position, accelerator
            )
        if signal_name and version < args.optim.steps:
            raise stopped_after(version, signal_name)
    servers.wait()
    if evaluations is not None:
        evaluations.wait_for_last(version, servers.check, stop)
        if evaluations.logged < evaluations.last and schedule.due(args.save_interval, version):
            # a signal came first: the checkpoint at this step lets the rerun evaluate it
            raise stopped_after(version, stop.agreed(None))
        evaluations.close()
    stream.close()
    tracker.finish()


class SignalledWhileWaiting(Exception):
    """The trainer's processes agreed, while they waited for the stream, to stop on a signal (its name)."""


def optimizer_step(
    learner: "Learner", groups: list[Group], rewards: torch.Tensor, args: GRPOArgs, version: int, accelerator=None
) -> tuple[dict[str, float], float]:
    """The step after `version` on its groups (`accumulate_gradients`, the gradient clipped, the optimizer's step);
    returns the step's stats and its gradient norm before clipping."""
    model = learner.model
    stats = accumulate_gradients(
        model, learner.reference, groups, rewards, args, learner.vocab_size, step=version, accelerator=accelerator
    )
    if accelerator is None:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.optim.grad_clip)
    else:  # the norm over every process's shards of the gradients
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.optim.grad_clip)
    learner.optimizer.step()
    learner.optimizer.zero_grad(set_to_none=True)
    return stats, grad_norm.item()


def trainer_accelerator(args: GRPOArgs):
    """The trainer's accelerator: FSDP2 over `--trainer-processes` processes, which the environment must describe
    (`sharding.make_accelerator`; the launcher sets it), or one process's under `--mixed-precision`; None for one
    process in float32 (no accelerate)."""
    processes = args.processes.trainer_processes
    if processes == 1 and args.mixed_precision == "no":
        return None
    accelerator = sharding.make_accelerator(args.mixed_precision)
    if processes == 1:
        return accelerator
    how = (
        f"--trainer-processes {processes}: start the trainer through grpo.launch, or under `accelerate "
        f"launch --config_file configs/accelerate/fsdp2.yaml --num_processes {processes}`"
    )
    if accelerator.num_processes != processes:
        raise cli.UserError(f"{how}; this one runs in {accelerator.num_processes} process(es)")
    if sharding.engine_of(accelerator) != "fsdp2":
        raise cli.UserError(f"{how}; the trainer shards with FSDP2, and this one runs under another engine")
    return accelerator


@dataclass
class Learner:
    """What a run trains from: the policy, the frozen reference (None without a KL coefficient), the tokenizer, the
    optimizer, and where a resumed run takes up (its version, its place in the stream)."""

    model: torch.nn.Module
    reference: torch.nn.Module | None
    tokenizer: object
    optimizer: torch.optim.Optimizer
    version: int
    stream_position: int

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)


def load_learner(args: GRPOArgs, accelerator=None) -> Learner:
    """The models and the optimizer, on the GPU if there is one; with `--resume` the checkpoint's (a UserError
    if there is none, or if it was saved with other settings). Under several trainer processes (`accelerator`)
    the policy, its optimizer and the reference are sharded over them."""
    from lm_human_preference_details.text import load_tokenizer  # an unknown model is one line (`assets.unknown_model`)

    if accelerator is not None:
        device = accelerator.device
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(args.task.model)
    with_reference = args.loss.kl_coef or args.loss.kl_coef_final  # a KL schedule from 0 needs it too
    reference = load_causal_lm(args.task.model).requires_grad_(False) if with_reference else None
    if reference is not None:
        reference = (
            reference.to(device) if accelerator is None else sharding.prepare_frozen(accelerator, reference, True)
        )
    state = checkpoints.checkpoint_state(args) if args.resume else {"version": 0, "stream_position": 0}
    model = load_causal_lm(checkpoints.checkpoint_model(args.output_dir) if args.resume else args.task.model).to(device)
    optimizer = make_optimizer(args.optim.optimizer, model.parameters(), lr=args.optim.lr, eps=args.optim.adam_eps)
    if accelerator is not None:
        # micro_batch_size is DeepSpeed's setting (not an engine of this trainer): a process's share of a step
        model, optimizer = sharding.prepare(
            accelerator, model, optimizer, args.optim.batch_size // accelerator.num_processes
        )
    if args.resume:
        saved = checkpoints.checkpoint_optimizer_state(args.output_dir)
        sharding.load_optimizer_state_dict(accelerator, model, optimizer, saved)
    return Learner(model, reference, tokenizer, optimizer, state["version"], state["stream_position"])


def whole_parameters(model: torch.nn.Module, accelerator=None) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters as the servers take them: whole, named and ordered as `named_parameters()` (a tied
    weight once). A sharded model's are gathered (every process calls this; the others get an empty list)."""
    names = [name for name, _ in model.named_parameters()]
    if accelerator is None:
        return list(model.named_parameters())
    whole = sharding.full_state_dict(accelerator, model)
    return [(name, whole[name]) for name in names] if accelerator.is_main_process else []


WAIT_ROUND_S = 1.0
"""the longest a read of the stream waits before the trainer's processes ask each other again (a signal, every
process's groups)"""


class GroupReader:
    """The stream's groups, one optimizer step's at a time, checked against this trainer's settings (`check_group`)."""

    def __init__(self, args: GRPOArgs, start: int, everyone_has: Callable[[bool], bool]):
        """`start`: the stream position to read from; `everyone_has(ready)`, asked before each read of the stream
        (which waits up to `WAIT_ROUND_S`) and once groups are there (`ready`), says whether every trainer process
        has its groups: they read on until all have, each asking as often (what it raises ends the wait: a signal
        to stop, no server left to update)."""
        self.args, self.everyone_has = args, everyone_has
        self.schedule = args.run_schedule()
        self.reader = open_reader(args.stream_url(), Group.from_json, start=start)
        self.buffered: list[Group] = []

    def read_step(self, version: int) -> list[Group]:
        """The groups of the step after `version`, waiting for them (and in `sync` mode for the rest of the round:
        `Schedule.groups_to_read`)."""
        per_step = self.schedule.groups_per_step
        wanted = self.schedule.groups_to_read(version) if not self.buffered else per_step
        while not self.everyone_has(len(self.buffered) >= wanted):
            if len(self.buffered) < wanted:  # one that has its groups reads no further (a sync round's end)
                self.buffered += self.reader.read(wanted - len(self.buffered), timeout_s=WAIT_ROUND_S)
        groups, self.buffered = self.buffered[:per_step], self.buffered[per_step:]
        for group in groups:
            check_group(group, self.args)
        return groups

    @property
    def position(self) -> int:
        """The stream position of the first group not yet trained on (read ahead but buffered: not counted)."""
        return self.reader.position - len(self.buffered)

    def close(self) -> None:
        self.reader.close()


class EvaluationLog:
    """The actor's evaluations (`records.Evaluation`, from `GRPOArgs.eval_stream_url`) into the run's logs as they
    arrive, each as a line of its own logged at the trainer's step then (`evaluation_metrics`: `eval/step` says
    which weights; wandb and the plots draw `eval/*` over it: `tracking.OWN_AXES`)."""

    def __init__(self, args: GRPOArgs, tracker: Tracker, start: int):
        """`start`: the step the run starts from; the evaluation stream holds the evaluations of earlier weights
        (the launcher cuts it back to them: `checkpoints.evaluations_kept`), then this run's; it reads on after those
        its logs kept (`checkpoints.evaluations_logged`)."""
        self.tracker = tracker
        logged = checkpoints.evaluations_logged(args.output_dir, start)
        self.reader = open_reader(args.eval_stream_url(), Evaluation.from_json, start=logged)
        due = args.run_schedule().evaluations(args.evaluation.eval_every, start)
        self.last = due[-1] if due else -1  # a run resumed at its last step has none left
        self.logged = -1  # the step of the last evaluation logged

    def log_arrived(self, version: int, timeout_s: float = 0.0) -> None:
        """Log the evaluations that arrived (waiting up to `timeout_s` for one) at step `version`."""
        for evaluation in self.reader.read(16, timeout_s):
            metrics = evaluation_metrics(evaluation)
            self.tracker.log(version, metrics)
            self.logged = evaluation.step
            log.info("evaluation of step %d: pass@1 %.3f", evaluation.step, metrics["eval/pass@1"])

    def wait_for_last(self, version: int, check: Callable[[], None], stop: preemption.StopSignals) -> None:
        """After the last step: log evaluations until the last step's has come (`check()` raises when no server is
        left to run it; a signal to stop ends the wait, with what came logged: then `logged` < `last`)."""
        said = -LOG_INTERVAL_S
        while self.logged < self.last and not stop.received:
            if time.monotonic() - said >= LOG_INTERVAL_S:  # a line now and then: a log file shows the run alive
                log.info("waiting for the evaluation of step %d", self.last)
                said = time.monotonic()
            check()
            self.log_arrived(version, timeout_s=1.0)

    def close(self) -> None:
        self.reader.close()


def evaluation_metrics(evaluation: Evaluation) -> dict[str, float]:
    """An evaluation's line in the logs: the step whose weights it began with, pass@1 and pass@k (k =
    `eval/samples`) by the unbiased estimator, averaged over the problems, the mean completion length, the weight
    versions that sampled its tokens and how long it took."""
    k = evaluation.samples
    problems = evaluation.problems
    counts = [(len(problem.rewards), sum(reward == 1 for reward in problem.rewards)) for problem in problems]
    tokens = [t for problem in problems for t in problem.tokens]
    return {
        "eval/step": evaluation.step,
        "eval/pass@1": sum(pass_at_k(n, right, 1) for n, right in counts) / len(problems),
        "eval/pass@k": sum(pass_at_k(n, right, k) for n, right in counts) / len(problems),
        "eval/samples": k,
        "eval/mean_tokens": sum(tokens) / len(tokens),
        "eval/version_min": evaluation.version_min,
        "eval/version_max": evaluation.version_max,
        "eval/seconds": evaluation.seconds,
    }


class ServerUpdates:
    """The weights' way to the servers: a `WeightSender` with a process group to each, the weights cast to the
    servers' dtype, pushed on the schedule (`Schedule.push_due`) and in buckets of `update_bucket_mb`. Under
    several trainer processes each has one, for the gather before a push, and only the main one `sends`."""

    def __init__(self, args: GRPOArgs, server_urls: list[str], sends: bool = True):
        self.args = args
        self.schedule = args.run_schedule()
        self.sender = (
            WeightSender(server_urls, backend=args.processes.sender_backend(), host=args.processes.trainer_host)
            if sends
            else None
        )
        # weights go out in the servers' dtype (bf16 on GPUs): they check it before receiving
        self.dtype = served_dtype(server_urls[0]) if sends else None

    def push_if_due(
        self, model: torch.nn.Module, version: int, accelerator=None, stop: preemption.StopSignals | None = None
    ) -> float:
        """Hand weights `version` to the sender if the schedule says so; the seconds that took (0 if not due). One
        trainer process: the weights are copied and sent in the sender's thread while the next step runs. Several
        (`accelerator` of a sharded model): gathered one bucket at a time, every process joining, each bucket sent
        while the next is gathered (`push_sharded`); the step waits for the whole push. A push that fails once
        `stop` received a signal is no failure: a job's servers end on the same signal, and the checkpoint the
        trainer then writes holds these weights."""
        if not self.schedule.push_due(version):
            return 0.0
        start = time.perf_counter()
        bucket_bytes = int(self.args.processes.update_bucket_mb * 2**20)
        try:
            if accelerator is not None and accelerator.num_processes > 1:
                dropped = self.push_sharded(model, version, bucket_bytes)
            else:
                parameters = whole_parameters(model, accelerator)
                dropped = self.sender.push_tensors(parameters, version, dtype=self.dtype, bucket_bytes=bucket_bytes)
        except Exception as error:
            if stop is None or not stop.received:
                raise
            log.warning("weights %d reached no server (%s): the run is stopping on a signal", version, error)
            dropped = []
        push_s = time.perf_counter() - start
        if dropped:
            log.warning("servers dropped from weight updates: %s", dropped)
        return push_s

    def push_sharded(self, model: torch.nn.Module, version: int, bucket_bytes: int) -> list[str]:
        """Push a sharded model's weights without a whole copy of them anywhere (PipelineRL's "gather the updated
        weights layer by layer"): `sharding.gathered_buckets` gathers them bucket by bucket on every process, and
        the first one sends each bucket as the next is gathered (`WeightSender.push_streamed`), holding its shards
        and at most two buckets (plus one whole tensor while it is gathered). The gathers are collectives, so the
        push cannot overlap the next optimizer step as one process's does: the step waits for it. Returns the
        servers dropped (on the first process)."""
        parameters = list(model.named_parameters())  # a tied weight once, named as the servers check
        specs = tensor_specs(parameters, self.dtype)
        # without a sender `dtype` is None: this process joins each gather and keeps nothing
        flat_buckets = sharding.gathered_buckets([p for _, p in parameters], buckets(specs, bucket_bytes), self.dtype)
        if self.sender is None:
            collections.deque(flat_buckets, maxlen=0)
            return []
        return self.sender.push_streamed(specs, flat_buckets, version, bucket_bytes)

    def check(self) -> None:
        """`WeightSender.check`, where this process sends."""
        if self.sender is not None:
            self.sender.check()

    def wait(self) -> None:
        """Until every push has reached every server."""
        if self.sender is not None:
            self.sender.wait()

    @property
    def last_broadcast_s(self) -> float:
        return self.sender.last_broadcast_s if self.sender is not None else 0.0


class StepTimer:
    """Where the trainer's wall time goes, step by step: waiting for data, training, handing the weights over."""

    def __init__(self):
        self.started: float | None = None  # the first wait for data
        self.last_step_end: float | None = None

    def waiting_for_data(self) -> None:
        self.wait_start = time.perf_counter()
        self.started = self.started or self.wait_start

    def training(self) -> None:
        self.train_start = time.perf_counter()

    def step_done(self, push_s: float) -> dict[str, float]:
        """The step's times: `interval` (since the previous step's end, or the first wait), `wait_data_s`,
        `train_s` (but the push), `push_s`, `elapsed_s` (since the first wait)."""
        now = time.perf_counter()
        interval = now - (self.last_step_end or self.started)
        self.last_step_end = now
        return {
            "interval": interval,
            "wait_data_s": self.train_start - self.wait_start,
            "train_s": now - self.train_start - push_s,
            "push_s": push_s,
            "elapsed_s": now - self.started,
        }


def step_metrics(
    samples: list[Attempt], rewards: torch.Tensor, version: int, grad_norm: float, times: dict, broadcast_s: float
) -> dict[str, float]:
    """What the step that made weights `version` logs beside `accumulate_gradients`'s stats: rewards, success,
    lag (the weights the gradient was taken at, `version - 1`, minus the weights that sampled each token),
    throughput over `times["interval"]` (`StepTimer.step_done`), where the time went."""
    lag = (version - 1) - torch.tensor([v for s in samples for v in s.versions])
    completion_tokens = sum(len(s.completion_ids) for s in samples)
    return {
        "reward/mean": rewards.mean().item(),
        "success/rate": (rewards == 1).float().mean().item(),
        "lag/min": lag.min().item(),
        "lag/mean": lag.float().mean().item(),
        "lag/max": lag.max().item(),
        "samples_per_s": len(samples) / times["interval"],
        "tokens_per_s": completion_tokens / times["interval"],
        "grad_norm": grad_norm,
        "completion/length": completion_tokens / len(samples),
        "time/wait_data_s": times["wait_data_s"],
        "time/train_s": times["train_s"],
        "time/push_s": times["push_s"],
        "time/broadcast_s": broadcast_s,
        "time/elapsed_s": times["elapsed_s"],
        "samples": version * len(samples),
    }


def log_step(tracker: Tracker, args: GRPOArgs, version: int, groups: list[Group], metrics: dict[str, float]) -> None:
    """The step's metrics (metrics.jsonl, wandb, a log line), and every `sample_interval` steps a table of the
    first group's attempts."""
    tracker.log(version, metrics)
    if args.run_schedule().due(args.sample_interval, version):
        tracker.log_samples(
            version,
            [
                {"problem_id": groups[0].problem_id, "reward": a.reward, "completion": a.text}
                for a in groups[0].attempts
            ],
        )
    log.info(
        "step %d reward %.3f lag %.2f samples/s %.1f",
        version,
        metrics["reward/mean"],
        metrics["lag/mean"],
        metrics["samples_per_s"],
    )


def train_then_exit(args: GRPOArgs, wait_for_servers: Callable[[], list[str]]) -> None:
    """`train`, then end the process at once (`lifetime.exit_now`: everything is written by then)."""
    train(args, wait_for_servers)
    exit_now(0)


@cli.main_with_user_errors
def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(message)s")
    # the launcher's flags, this role's purpose
    args = cli.parse(GRPOArgs, get_preset, "tiny", description=__doc__.split("\n\n")[0], presets=PRESETS)
    args.check()
    args.processes.check_weight_backend()
    if args.resume:
        raise cli.UserError(
            "--resume: resume a run through grpo.launch, which restarts the servers with the checkpoint's "
            "weights and version, drops the stream's records after the checkpoint and starts the actor at its step"
        )
    if not args.serving.servers:
        raise cli.UserError("--servers: the trainer alone needs the URLs of running servers (or use grpo.launch)")
    check_serving(args.serving.servers, 0, args.task.model)
    train_then_exit(args, wait_for_servers=lambda: args.serving.servers)


if __name__ == "__main__":
    main()
