"""Stage 1: train a reward model from best-of-N preference labels, as OAI's `train_reward.py` does.

    labels:           `labels.source`, or made on the spot with `labels.labeler` (make_labels.py)
    normalize before: gain, bias := 1, 0; score responses of the reference policy; set gain, bias so
                      that they score N(0, 1)
    one epoch over the first `num_train` labels, LR annealed linearly to 0:
        loss = cross-entropy of softmax(r(q, y_0..y_N-1)) against `best`
    checkpoint every `save_interval` steps and after the last; on SIGTERM or SIGUSR1 after the step in flight,
    then stop (preemption.py)
    held-out accuracy on the `num_test` labels after them
    normalize after:  the same again, so the KL coefficient of stage 2 keeps its meaning
    save the reward model (safetensors + config) for train_policy.py

`python -m lm_human_preference_details.train_reward --task tiny --output-dir runs/rm`
`accelerate launch lm_human_preference_details/train_reward.py --task sentiment`
"""

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed

from lm_human_preference_details import checkpoint, cli, labelers, precision, preemption, sharding, tasks
from lm_human_preference_details.data import Labels, QuerySampler, format_queries, load_labels, write_labels
from lm_human_preference_details.make_labels import make_labels
from lm_human_preference_details.models import RewardModel, load_causal_lm
from lm_human_preference_details.optim import OptimizerName, make_optimizer
from lm_human_preference_details.progress import progress_bar
from lm_human_preference_details.sampling import StageHooks, sample_responses
from lm_human_preference_details.tasks import LabelHParams, TaskHParams
from lm_human_preference_details.text import load_tokenizer
from lm_human_preference_details.tracking import RunArgs, Tracker


@dataclass
class Args(RunArgs):
    """Stage 1: train a reward model from best-of-N labels."""

    task: TaskHParams = field(default_factory=TaskHParams)
    labels: LabelHParams = field(default_factory=LabelHParams)
    batch_size: int = 32
    """labels per optimizer step, over all processes (OAI's books tasks: 32)"""
    lr: float = 5e-5
    """learning rate at the start; annealed linearly to 0 over the epoch"""
    adam_eps: float = 1e-5
    """Adam epsilon; OAI's is 1e-5 (# OAI: lm_human_preferences/utils/core.py#L627)"""
    optimizer: OptimizerName = "adam_tf"
    """`adam_tf`: TensorFlow 1's Adam as OAI (eps outside the bias correction); `adam_torch`: torch.optim.Adam"""
    rollout_batch_size: int = 512
    """queries sampled at once from the reference policy to normalize the reward, over all processes"""
    normalize_before: bool = True
    """before training, set gain and bias so that the reward of reference samples is N(0, 1)"""
    normalize_after: bool = True
    """after training, the same again, so that a KL coefficient always means the same"""
    normalize_samples: int = 256
    """reference samples that estimate the reward's mean and std (rounded up to whole rollout batches)"""
    debug_normalize: int = 0
    """reference samples that re-measure mean and std after normalizing (0: do not)"""
    output_dir: str = "runs/reward"
    """metrics.jsonl, args.json, labels made on the spot, checkpoint/, and the trained model under reward_model/"""
    save_interval: int = 0
    """steps between checkpoints (0: only after the last, or when a signal stops the run: preemption.py)"""
    resume: cli.Resume = False
    """continue the run in output_dir from its last checkpoint; `auto`: if it has one, else start it (cli.Resume)"""


MAY_CHANGE_ON_RESUME = {"resume", "save_interval", "output_dir", "wandb_mode", "wandb_project", "run_name"}
"""what a resumed run may set otherwise; the rest of its settings must be the checkpoint's
(`checkpoint.check_same_settings`)"""


def defaults_for_task(name: str) -> Args:
    preset = tasks.get_preset(name)
    return Args(preset=name, task=preset.task, labels=preset.labels, **preset.reward)


def validate(args: Args, world_size: int) -> None:
    """Fail before any work on combinations that cannot run (# OAI: lm_human_preferences/train_reward.py#L56-L58)."""
    tasks.check_task(args.task)
    cli.require(
        0,
        {
            "batch_size": args.batch_size,
            "rollout_batch_size": args.rollout_batch_size,
            "lr": args.lr,
            "adam_eps": args.adam_eps,
        },
    )
    cli.require(
        0,
        {
            "labels.num_test": args.labels.num_test,
            "debug_normalize": args.debug_normalize,
            "save_interval": args.save_interval,
        },
        strictly=False,
    )
    if args.labels.num_train <= 0 or args.labels.num_train % args.batch_size:
        raise cli.UserError(
            f"labels.num_train={args.labels.num_train} must be a positive multiple of batch_size={args.batch_size}"
        )
    if args.batch_size % world_size:
        raise cli.UserError(f"batch_size={args.batch_size} must divide evenly over {world_size} processes")
    if args.rollout_batch_size % world_size:
        raise cli.UserError(
            f"rollout_batch_size={args.rollout_batch_size} must divide evenly over {world_size} processes"
        )
    if (args.normalize_before or args.normalize_after) and args.normalize_samples <= 0:
        raise cli.UserError("normalize_samples must be positive when normalize_before or normalize_after is set")
    if args.labels.source is None and args.labels.labeler is None:
        raise cli.UserError("labels: give --labels.source FILE or --labels.labeler NAME to make labels on the spot")
    if args.labels.source is None:
        labelers.load_labeler(args.labels.labeler)  # a bad name fails now, not once the models are loaded
    _ = args.labels.num_responses  # raises on a labels.type that is not best_of_N


def query_responses_of(queries: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
    """(B, Q), (B, K, R) -> (B*K, Q+R): each query before each of its responses.

    # OAI: lm_human_preferences/rewards.py#L105-L107
    """
    num_responses = samples.shape[1]
    return torch.cat([queries.repeat_interleave(num_responses, dim=0), samples.flatten(0, 1)], dim=1)


def reward_logits(reward_model, labels: Labels, pad_id: int) -> torch.Tensor:
    """(B, K): the reward of every response of every label (# OAI: lm_human_preferences/label_types.py#L44-L49)."""
    return reward_model(query_responses_of(labels.queries, labels.samples), pad_id).view(labels.samples.shape[:2])


@torch.no_grad()
def reference_reward_stats(
    reward_model,
    ref_lm,
    sampler,
    task: TaskHParams,
    tokenizer,
    num_samples: int,
    accelerator,
    sample=None,
    desc: str = "reference samples",
) -> tuple[float, float]:
    """Mean and population std of the reward of reference-policy samples, over all processes; `sample` draws
    them (None: `sample_responses`). Its batches are counted by a progress bar named `desc` (minutes on a CPU).

    Responses are sampled untruncated, from the formatted query; the reward model reads the bare query.
    # OAI: lm_human_preferences/train_reward.py#L162-L168 (stats)
    # OAI: lm_human_preferences/train_reward.py#L190-L199 (sample_policy_batch)
    """
    pad_id = tokenizer.oai_pad_token_id
    rollout_batch_size = sampler.batch_size * accelerator.num_processes
    rewards, num_batches = [], math.ceil(num_samples / rollout_batch_size)
    bar = progress_bar(num_batches, desc, "batch", enabled=accelerator.is_local_main_process)
    for _ in range(num_batches):
        queries = next(sampler).to(accelerator.device)
        with accelerator.autocast():  # as the trained reward model's forward (accelerate's prepare wraps it)
            responses, _ = (sample or sample_responses)(
                ref_lm,
                format_queries(queries, tokenizer, task),
                pad_id,
                task.response_length,
                task.temperature,
                vocab_size=len(tokenizer),
            )
            rewards.append(reward_model(torch.cat([queries, responses], dim=1), pad_id).float())
        bar.update()
    bar.close()
    rewards = torch.cat(rewards).double()
    sums = accelerator.reduce(
        torch.stack([rewards.sum(), rewards.square().sum(), rewards.new_tensor(float(len(rewards)))]), "sum"
    )
    mean = sums[0] / sums[2]
    return float(mean), float(torch.sqrt(sums[1] / sums[2] - mean**2))


def reference_query_sampler(args: Args, tokenizer, accelerator, hooks: StageHooks):
    """The query stream of `normalize`'s reference samples (`hooks.query_sampler`), this process's share of it."""
    return hooks.query_sampler(
        args.task,
        tokenizer,
        batch_size=args.rollout_batch_size // accelerator.num_processes,
        seed=args.task.query_seed,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
    )


def reference_reward_measure(
    args: Args, reward_model, ref_lm, tokenizer, accelerator, hooks: StageHooks, sampler
) -> Callable[[int | None, str], tuple[float, float]]:
    """`normalize`'s measure: `reference_reward_stats` of a number of samples (None: `normalize_samples`), from
    `sampler` (`reference_query_sampler`) and responses that `hooks.sample` draws, its progress named `desc`."""

    def measure(num_samples: int | None, desc: str) -> tuple[float, float]:
        return reference_reward_stats(
            reward_model,
            ref_lm,
            sampler,
            args.task,
            tokenizer,
            num_samples or args.normalize_samples,
            accelerator,
            hooks.sample,
            desc,
        )

    return measure


def normalize(reward_model, measure, debug_samples: int, tracker: Tracker, step: int, when: str, accelerator) -> None:
    """gain, bias := 1, 0; measure; set gain and bias to map the measured N(mean, std) to N(0, 1).

    For best_of_N labels the target is N(0, 1) both before and after (PickBest.target_scales is None).
    # OAI: lm_human_preferences/train_reward.py#L207-L219 (normalize)
    # OAI: lm_human_preferences/rewards.py#L77-L89 (set_reward_norm)
    """
    gain_and_bias = [reward_model.gain, reward_model.bias]  # written into the shards a sharded model gathers from
    with sharding.writing(accelerator, reward_model, gain_and_bias):
        reward_model.reset_reward_scale()
    mean, std = measure(None, f"normalize {when}")
    # OAI: lm_human_preferences/train_reward.py#L182-L186 asserts them finite
    if not (math.isfinite(mean) and math.isfinite(std) and std > 0):
        raise RuntimeError(
            f"normalize {when}: the reference samples' rewards have mean {mean} and std {std}; gain and bias "
            "need a finite mean and a std above 0 (a reward model that diverged, or scores every sample alike)"
        )
    with sharding.writing(accelerator, reward_model, gain_and_bias):
        reward_model.set_reward_norm(old_mean=mean, old_std=std, new_mean=0.0, new_std=1.0)
        gain, bias = reward_model.gain_and_bias()
    stats = {f"norm/{when}/mean": mean, f"norm/{when}/std": std, f"norm/{when}/gain": gain, f"norm/{when}/bias": bias}
    if debug_samples:
        stats[f"norm/{when}/check_mean"], stats[f"norm/{when}/check_std"] = measure(
            debug_samples, f"normalize {when}, check"
        )
    accelerator.print(f"normalize {when}: reward {mean:.4f} +- {std:.4f} -> gain {gain:.4f}, bias {bias:.4f}")
    tracker.log(step, stats)


def obtain_labels(args: Args, tokenizer, ref_lm, accelerator, resume: bool = False) -> Labels:
    """The label file, or labels made on the spot by the main process with `labels.labeler` (a resumed run reads
    those the run made, which its checkpoint comes after)."""
    label_kwargs = dict(
        num_responses=args.labels.num_responses,
        query_length=args.task.query_length,
        response_length=args.task.response_length,
        vocab_size=len(tokenizer),
        pad_id=tokenizer.oai_pad_token_id,
    )
    source = args.labels.source
    if source is None:
        source = os.path.join(args.output_dir, "labels.json")
        if accelerator.is_main_process and not resume:
            needed = args.labels.num_train + args.labels.num_test
            accelerator.print(f"making {needed} labels with the {args.labels.labeler!r} labeler")
            # its own query stream, so that labels and normalization samples do not share queries
            sampler = QuerySampler(
                args.task, tokenizer, batch_size=args.rollout_batch_size, seed=args.task.query_seed + 1
            )
            labeler = labelers.load_labeler(args.labels.labeler)
            with accelerator.autocast():  # the run's precision for its samples too
                labels = make_labels(ref_lm, tokenizer, sampler, args.task, labeler, needed, args.labels.num_responses)
            write_labels(source, labels, tokenizer.oai_pad_token_id)
        accelerator.wait_for_everyone()
    labels = load_labels(source, **label_kwargs)
    if len(labels) < args.labels.num_train + args.labels.num_test:
        raise cli.UserError(
            f"labels.source={source} has {len(labels)} labels, fewer than labels.num_train + labels.num_test = "
            f"{args.labels.num_train + args.labels.num_test}"
        )
    return labels


@torch.no_grad()
def accuracy(reward_model, labels: Labels, pad_id: int, batch_size: int, accelerator) -> float:
    """Share of labels whose best response gets the highest reward, over all processes."""
    mine = labels[accelerator.process_index :: accelerator.num_processes].to(accelerator.device)
    correct = sum(
        (reward_logits(reward_model, mine[i : i + batch_size], pad_id).argmax(1) == mine.best[i : i + batch_size]).sum()
        for i in range(0, len(mine), batch_size)
    )
    counts = accelerator.reduce(torch.tensor([float(correct), float(len(mine))], device=accelerator.device), "sum")
    return float(counts[0] / counts[1])


def initial_reward_model(args: Args, accelerator: Accelerator) -> RewardModel:
    """The reward model to train, on the accelerator's device; the RNG is then seeded for this process."""
    # every process builds the same reward head, as OAI's rank 0 broadcasts its initial weights (`sync_models`
    # before training); then each its own stream
    # OAI: lm_human_preferences/train_reward.py#L317-L324
    set_seed(args.seed)
    reward_model = RewardModel.from_pretrained_lm(args.task.base_model).to(accelerator.device)
    set_seed(args.seed + accelerator.process_index * 100003)  # OAI: lm_human_preferences/utils/core.py#L108-L111
    return reward_model


def resume_steps(args: Args, accelerator, model, optimizer, sampler, requested: dict) -> int:
    """Restore the last checkpoint into the model (gain and bias normalized before training included), the optimizer
    and the reference query stream (its settings must be `requested`, but for `MAY_CHANGE_ON_RESUME`); the step to
    continue from."""
    loop = checkpoint.load(args.output_dir, accelerator, model, optimizer)
    where = checkpoint.folder(args.output_dir)
    checkpoint.check_same_settings(loop.get("settings"), requested, MAY_CHANGE_ON_RESUME, where)
    sampler.skip(loop["sampler_batches"])
    accelerator.print(f"resumed after step {loop['step']}")
    return loop["step"] + 1


def save_steps(args: Args, accelerator, model, optimizer, step: int, sampler, requested: dict) -> None:
    """A checkpoint after `step`, with what `resume_steps` restores."""
    loop_state = {
        "step": step,
        "sampler_batches": sampler.batches_drawn,
        "world_size": accelerator.num_processes,
        "settings": requested,
    }
    checkpoint.save(args.output_dir, accelerator, model, optimizer, loop_state)


def train(args: Args, accelerator: Accelerator, hooks: StageHooks | None = None) -> str:
    """Run stage 1; returns the folder of the trained reward model. On SIGTERM or SIGUSR1 it stops after the step
    in flight, with a checkpoint, and raises `preemption.Preempted`.

    `hooks`: where the normalization's queries and responses and the labels' order come from (`StageHooks`;
    None: this stage's own).
    """
    with preemption.listening() as stop:
        return train_until_stopped(args, accelerator, hooks or StageHooks(), stop)


def train_until_stopped(args: Args, accelerator: Accelerator, hooks: StageHooks, stop: preemption.StopSignals) -> str:
    """`train`, asking `stop` after each step (all processes agree) whether a signal asks the run to stop."""
    validate(args, accelerator.num_processes)
    precision.check_accelerator(accelerator, args.mixed_precision)
    requested = checkpoint.settings(args)
    resume = checkpoint.resolve_resume(args.resume, checkpoint.saved(args.output_dir, accelerator), args.output_dir)
    reward_model = initial_reward_model(args, accelerator)
    tokenizer = load_tokenizer(args.task.base_model)
    tasks.check_truncate_token(args.task, len(tokenizer))  # before the run's files and wandb run exist
    # a new run's tracker refuses an earlier run's logs before any work; a resumed run's continues them after its
    # checkpoint's step, known once the checkpoint is loaded
    tracker = None if resume else Tracker.for_run(args, "reward", accelerator)
    device = accelerator.device
    pad_id = tokenizer.oai_pad_token_id
    ref_lm = load_causal_lm(args.task.base_model).to(device).requires_grad_(False)
    labels = obtain_labels(args, tokenizer, ref_lm, accelerator, resume)
    train_labels = labels[: args.labels.num_train]
    test_labels = labels[args.labels.num_train : args.labels.num_train + args.labels.num_test]
    sampler = reference_query_sampler(args, tokenizer, accelerator, hooks)
    measure = reference_reward_measure(args, reward_model, ref_lm, tokenizer, accelerator, hooks, sampler)
    if args.normalize_before and not resume:  # OAI: lm_human_preferences/train_reward.py#L232-L234
        normalize(reward_model, measure, args.debug_normalize, tracker, 0, "before", accelerator)

    optimizer = make_optimizer(args.optimizer, reward_model.parameters(), args.lr, args.adam_eps)
    model, optimizer = sharding.prepare(
        accelerator, reward_model, optimizer, args.batch_size // accelerator.num_processes
    )
    start_step = 1
    if resume:
        start_step = resume_steps(args, accelerator, model, optimizer, sampler, requested)
        tracker = Tracker.for_run(args, "reward", accelerator, resume_after_step=start_step - 1)
    # one shuffle shared by all processes, so each label is trained on exactly once
    # OAI: lm_human_preferences/train_reward.py#L240-L241
    order = hooks.permutation(args.labels.num_train, generator=torch.Generator().manual_seed(args.seed))
    num_steps = args.labels.num_train // args.batch_size
    if signal_name := stop.agreed(accelerator):  # received while the labels were made or the reward normalized
        save_steps(args, accelerator, model, optimizer, start_step - 1, sampler, requested)
        tracker.finish()
        raise preemption.stopped(start_step - 1, num_steps, "step", signal_name)
    bar = progress_bar(num_steps, "reward model", "batch", enabled=accelerator.is_main_process, initial=start_step - 1)
    for step in range(start_step, num_steps + 1):
        start = (step - 1) * args.batch_size
        lr = (1 - start / args.labels.num_train) * args.lr  # OAI: lm_human_preferences/train_reward.py#L249
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = train_labels[
            order[start : start + args.batch_size][accelerator.process_index :: accelerator.num_processes]
        ].to(device)
        logits = reward_logits(model, batch, pad_id)  # (b, K)
        loss = F.cross_entropy(logits, batch.best)  # OAI: lm_human_preferences/label_types.py#L44-L49
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        hooks.after_update(step, accelerator.unwrap_model(model))
        stats = accelerator.reduce(
            torch.stack([loss.detach(), (logits.argmax(1) == batch.best).float().mean()]), "mean"
        )
        tracker.log(step, {"train/loss": stats[0], "train/accuracy": stats[1], "train/lr": lr})
        bar.update()
        if (step % max(1, num_steps // 10) == 0 or step == num_steps) and accelerator.is_local_main_process:
            bar.write(f"step {step}/{num_steps}  loss {float(stats[0]):.4f}  accuracy {float(stats[1]):.3f}")
        signal_name = stop.agreed(accelerator)
        if (args.save_interval and step % args.save_interval == 0) or step == num_steps or signal_name:
            save_steps(args, accelerator, model, optimizer, step, sampler, requested)
        if signal_name and step < num_steps:
            bar.close()
            tracker.finish()
            raise preemption.stopped(step, num_steps, "step", signal_name)
    bar.close()

    if len(test_labels):
        test_accuracy = accuracy(reward_model, test_labels, pad_id, args.batch_size, accelerator)
        tracker.log(num_steps, {"test/accuracy": test_accuracy})
        chance = 1 / args.labels.num_responses
        accelerator.print(f"held-out accuracy on {len(test_labels)} labels: {test_accuracy:.3f} (chance {chance:.3f})")
    if args.normalize_after:  # OAI: lm_human_preferences/train_reward.py#L252-L254
        normalize(reward_model, measure, args.debug_normalize, tracker, num_steps, "after", accelerator)

    path = os.path.join(args.output_dir, "reward_model")
    save_reward_model(path, reward_model, tokenizer, accelerator)
    tracker.finish()
    return path


def save_reward_model(path: str, reward_model: RewardModel, tokenizer, accelerator) -> None:
    """The trained reward model and its tokenizer (`RewardModel.save`), written by the main process beside `path`
    and swapped in whole (`checkpoint.staged`): a folder at `path` is a complete one, which a resumed stage 2
    takes as stage 1 done. Every process calls it."""
    state_dict = sharding.full_state_dict(accelerator, reward_model)  # every process helps gather a sharded one
    with checkpoint.staged(path, accelerator) as staging:
        if accelerator.is_main_process:
            reward_model.save(staging, state_dict)
            tokenizer.save_pretrained(staging)
    accelerator.print(f"saved the reward model to {path}")


@cli.main_with_user_errors
def main() -> None:
    args = cli.parse(Args, defaults_for_task, default_task="sentiment", presets=tasks.PRESETS)
    train(args, sharding.make_accelerator(args.mixed_precision))


if __name__ == "__main__":
    main()
    cli.exit_finished_rank()
