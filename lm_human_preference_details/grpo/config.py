"""The arguments of a GRPO run (shared by launch, trainer and actor) and its `--task` presets."""

import copy
import math
import os
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Annotated, Literal

import tyro

from lm_human_preference_details.cli import Resume, UserError
from lm_human_preference_details.grpo.loss_options import Baseline, ImportanceSampling, LossType, Normalizer, StdOver
from lm_human_preference_details.grpo.protocol import (
    MAX_CHOICES,
    MIN_TEMPERATURE,
    ServerDtype,
    WeightBackend,
    WeightStaging,
)
from lm_human_preference_details.grpo.rewards import eval_problems
from lm_human_preference_details.grpo.schedule import Mode, Schedule
from lm_human_preference_details.grpo.streams import companion_url
from lm_human_preference_details.grpo.world import PlacementArgs
from lm_human_preference_details.tracking import RunArgs

Engine = Literal["auto", "home", "vllm"]
RecipeName = Literal["default", "pipelinerl", "dr_grpo", "dapo"]


@dataclass(frozen=True)
class Recipe:
    """A peer's loss settings: where they come from, and the loss fields (`LossArgs`) that it sets otherwise than
    this project's defaults (it resets every other one to its default)."""

    source: str
    settings: dict[str, object]


RECIPES: dict[str, Recipe] = {
    "default": Recipe(
        "this project's: PipelineRL's paper (arXiv 2509.19128), whose weight cap is 5, with the group-mean "
        "baseline and the KL clamp of its RLConfig (10); what stage 3 was tuned and tested with",
        {},
    ),
    "pipelinerl": Recipe(
        "PipelineRL's conf/finetune/base.yaml at 58d3934: reinforce with epsilon_high 0.02, "
        "clamp_log_ratio_ref_new_value 5, kl_coef = final_kl_coef = 0, entropy_bonus 0, no std division, and "
        "populate_rl_data's leave-one-out baseline",
        {"baseline": "leave_one_out", "ratio_cap": 1.02, "kl_clamp": 5.0},
    ),
    "dr_grpo": Recipe(
        "Dr. GRPO (arXiv 2503.20783) as TRL's GRPOTrainer runs it: loss_type dr_grpo (a constant normaliser), "
        "scale_rewards none, PPO's clip 0.2, beta 0",
        {"loss_type": "ppo_clip", "loss_normalizer": "max_tokens"},
    ),
    "dapo": Recipe(
        "DAPO (arXiv 2503.14476) as TRL's GRPOTrainer runs it: loss_type dapo (token-level), epsilon 0.2 and "
        "epsilon_high 0.28, scale_rewards group, mask_truncated_completions (overlong filtering), beta 0",
        {
            "loss_type": "ppo_clip",
            "clip_eps_high": 0.28,
            "divide_by_std": True,
            "loss_normalizer": "tokens",
            "overlong_filtering": True,
        },
    ),
}


def settings_as_flags(settings: dict[str, object]) -> list[str]:
    """Command-line flags that set these fields (tyro's spelling: `--no-NAME` for a false bool)."""
    spelled = []
    for name, value in settings.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            spelled.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            spelled += [f"--{flag}", str(value)]
    return spelled


def recipes_help() -> str:
    """`--recipe`'s help: each recipe's flags and where they come from."""
    return (
        "a peer's loss settings in one flag: it sets every loss option (the `loss options` below), in its place on the "
        "command line, so flags after it override it. "
        + "; ".join(
            f"`{name}`: {' '.join(settings_as_flags(r.settings)) or 'the defaults'}, {r.source}"
            for name, r in RECIPES.items()
        )
    )


def gpu_visible() -> bool:
    """Whether this process would see an NVIDIA GPU, without importing torch (the launcher imports none): a device
    node there, and CUDA_VISIBLE_DEVICES not hiding them all (`benchmarking`'s `--device cpu` sets it empty)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return False
    return any(name[len("nvidia") :].isdigit() for name in os.listdir("/dev") if name.startswith("nvidia"))


@dataclass
class TaskArgs:
    """What is learned: the model and the problems it is trained on."""

    model: str = "tiny-math"
    """model name or folder, for the servers and the trainer alike"""
    problems: str = "tiny-sums"
    """`tiny-sums` (a+b, digits 0-4, for `tiny-math`), `arith` (arithmetic, see arith_digits), `gsm8k`,
    `math500`, or a local JSON/JSONL file (GSM8K, MATH-500, Open-Reasoner-Zero or prompt/answer records)"""
    arith_digits: int = 2
    """`arith` problems: digits per operand"""
    arith_template: str = "What is {expression}? Put the final answer in \\boxed{{}}."
    """`arith` problems: the prompt, `{expression}` filled in (e.g. `23+45`)"""
    num_problems: int = 0
    """use the first N problems (0: all)"""
    answer_prefix: str = ""
    """text the prompt ends with that belongs to the answer (e.g. `\\boxed{`): prepended to the
    completion before it is scored"""
    chat: bool = False
    """send prompts as a user message through the model's chat template (/v1/chat/completions)"""
    chat_example: list[str] = field(default_factory=list)
    """with `chat`: a worked example, `QUESTION ANSWER`, put before every problem as an earlier exchange of the chat
    (a one-shot prompt, as few-shot chat evaluations build one) to show the answer's format; empty: none"""
    integer_answers: bool = False
    """score the last boxed answer only as a plain integer, anything else 0: math_verify evaluates a boxed
    expression, so a policy learns to box the question (`\\boxed{6-1}` scores as 5) instead of answering it"""

    def chat_messages(self, prompt: str) -> list[dict[str, str]]:
        """A problem's chat request: the worked example's exchange (`chat_example`), then the problem."""
        example = []
        if self.chat_example:
            question, answer = self.chat_example
            example = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return [*example, {"role": "user", "content": prompt}]


@dataclass
class SamplingArgs:
    """How the servers sample a problem's group of attempts."""

    group_size: int = 8
    """attempts per problem (the group whose mean reward is the baseline)"""
    max_tokens: int = 8
    """completion length limit (sequences also stop at EOS, unless `ignore_eos`)"""
    temperature: float = 1.0
    """sampling temperature; the trainer's logprobs use the same one"""
    ignore_eos: bool = False
    """sample exactly max_tokens tokens, past EOS (speed benchmarks: every sample costs the same)"""


@dataclass
class OptimArgs:
    """The optimizer, its steps and their size."""

    steps: int = 60
    """optimizer steps"""
    batch_size: int = 64
    """samples (completions) per optimizer step; a multiple of group_size"""
    lr: float = 1e-3
    """learning rate (constant)"""
    optimizer: Literal["adam_tf", "adam_torch"] = "adam_torch"
    """`adam_tf` (TF1 epsilon placement, as in stages 1-2) or `adam_torch` (optim.OptimizerName, spelled out:
    this module imports no torch, so neither does the launcher, which starts the servers once it is imported)"""
    adam_eps: float = 1e-8
    """Adam epsilon"""
    grad_clip: float = 0.3
    """max global gradient norm (PipelineRL: 0.3)"""
    token_budget: int = 4096
    """tokens per forward/backward micro-batch: its prompts once each, padded to the longest prompt, plus
    its completions, padded to the longest completion (a group over it is split; the prompts' keys and
    values, copied to each row, are not counted)"""


@dataclass
class LossArgs:
    """The policy loss: the fields a `--recipe` sets."""

    loss_type: LossType = "reinforce"
    """`reinforce`: importance ratio pi/mu capped above (PipelineRL's; also TRL's loss with truncated importance
    sampling at one gradient step per batch); `ppo_clip`: PPO's clipped ratio (PipelineRL's `ppo`, TRL's); `gspo`:
    the clipped ratio of whole sequences (GSPO; PipelineRL's `gspo`, TRL's importance_sampling_level=sequence)"""
    ratio_cap: float = 5.0
    """upper cap of the importance ratio for `reinforce` (PipelineRL paper: 5; PipelineRL's code: 1 + epsilon_high,
    1.02 in its base.yaml; TRL's vllm_importance_sampling_clip_max: 3)"""
    importance_sampling: ImportanceSampling = "token_truncate"
    """`reinforce`'s weight (TRL's vllm_importance_sampling_mode, whose default is sequence_mask): the ratio capped
    (`*_truncate`, PipelineRL's) or 0 above the cap (`*_mask`), per token or per sequence (its ratio: the product
    over its tokens)"""
    clip_eps: float = 0.2
    """PPO clip range for `ppo_clip` and `gspo`: the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high]
    (PipelineRL's epsilon_low; TRL's epsilon: 0.2)"""
    clip_eps_high: float | None = None
    """epsilon above 1 for `ppo_clip` and `gspo` (None: clip_eps; PipelineRL's epsilon_high; TRL's epsilon_high;
    DAPO's clip-higher uses 0.28)"""
    baseline: Baseline = "mean"
    """group baseline: the group mean (GRPO; TRL), or the mean of the other attempts (RLOO; PipelineRL since its
    commit 4988fe8)"""
    divide_by_std: bool = False
    """divide advantages by the std of the rewards (GRPO paper; TRL's scale_rewards group/batch, its default group;
    PipelineRL's divide_advantage_by_std, off in its base.yaml)"""
    std_over: StdOver = "group"
    """with `divide_by_std`, the rewards whose std divides: the group's or the whole batch's (TRL's scale_rewards)"""
    use_advantages: bool = True
    """weigh log pi by the advantage; off: by the raw reward, no baseline (PipelineRL's use_advantages)"""
    relu_policy_weights: bool = False
    """clamp those weights below at 0: only better-than-baseline attempts are reinforced (PipelineRL's
    relu_log_p_weights)"""
    loss_normalizer: Normalizer = "sequences"
    """what the token sum of the loss is divided by: `sequences` in the batch (PipelineRL's 1 / batch_size);
    `sequence_mean`, each sequence's mean over its tokens (TRL's loss_type grpo); `tokens` in the batch (TRL's
    dapo, its default; bnpo with one micro-batch); `max_tokens` x sequences (TRL's dr_grpo); `group_tokens`, the
    mean prompt + completion length of the token's group, not the batch size (PipelineRL's group_normalization)"""
    overlong_filtering: bool = False
    """completions cut by --max-tokens (finish_reason `length`) get no gradient; they still count as sequences,
    not as tokens (PipelineRL's overlong_filtering; TRL's mask_truncated_completions)"""
    kl_coef: float = 0.0
    """k3 KL penalty to the initial policy (0 with kl_coef_final 0: no reference model; PipelineRL's kl_coef, 0 in
    its base.yaml; TRL's beta, default 0)"""
    kl_coef_final: float | None = None
    """the KL coefficient at the last step, reached linearly from kl_coef (None: kl_coef throughout; PipelineRL's
    final_kl_coef, kl_coef in its base.yaml)"""
    kl_clamp: float = 10.0
    """bound on |log ref - log pi| in the k3 penalty (PipelineRL's clamp_log_ratio_ref_new_value: 10 in RLConfig,
    5 in its base.yaml; TRL has none)"""
    entropy_coef: float = 0.0
    """entropy bonus added to the per-token objective (PipelineRL's entropy_bonus, 0 in its base.yaml)"""
    entropy_coef_final: float | None = None
    """the entropy bonus at the last step, reached linearly (None: entropy_coef throughout; PipelineRL's
    final_entropy_bonus)"""


@dataclass
class ScheduleArgs:
    """When the trainer pushes weights and how far ahead of them the actor runs (`GRPOArgs.run_schedule`)."""

    mode: Mode = "pipeline"
    """`pipeline`: weights pushed to the servers after every optimizer step while they generate;
    `sync`: the conventional schedule, generate `sync_steps` steps of data with frozen weights, then train"""
    sync_steps: int = 4
    """`sync` mode: optimizer steps per generation round (G)"""
    steps_ahead: float = 3
    """`pipeline` mode: the actor starts groups for at most this many optimizer steps beyond the
    servers' weights (this sets the lag: the mean lag stays below it, by how much depends on how generation and
    training times compare, see benchmarks/README.md; 1 leaves the servers idle while the trainer steps; the
    trainer takes groups in the order they finish, so a group that finishes after later ones, or is retried, can
    lag more). A fraction lets that share of each step's problems start a step earlier (2.5: half of them start
    as with 3, half as with 2), for a lag between the two; it needs requests that small (`problems_per_request`)"""


@dataclass
class ServingArgs:
    """The inference servers: how many, which engine, and how the actor asks them."""

    num_servers: int = 1
    """inference servers to start (each a process)"""
    servers: list[str] = field(default_factory=list)
    """URLs of servers already running (then launch starts none)"""
    engine: Engine = "auto"
    """the servers the launcher starts: `home` is grpo/serving/server.py (this package's batched decoder, any model, the
    tested and lighter one on a CPU); `vllm` is grpo/serving/vllm_server.py, the same contract served by vLLM in its own
    environment (`python -m lm_human_preference_details.grpo.serving.vllm_env` makes it; on a CPU vLLM's attention takes
    heads 32, 64, 80, ... wide, not the tiny presets' 16). `auto`: vLLM where a GPU is visible and its environment
    holds vLLM's GPU build (`vllm_env --gpu`; where its speed matters), else home (`ServingArgs.server_engine`)"""
    server_batch_size: int = 64
    """sequences each server decodes together"""
    server_dtype: ServerDtype = "auto"
    """the servers' weights: `auto` is bfloat16 on a GPU (as vLLM serves) and float32 on the CPU; float32 on a GPU
    makes on-policy ratios pi/mu exactly 1 (the trainer computes in float32), bfloat16 on the CPU shows what a GPU
    server's rounding does to them"""
    max_in_flight: int = 32
    """requests (`request_problems()` problems x `group_size` attempts each) the actor keeps in flight
    per server: more sequences than the server's batch, so a finished slot is refilled from its queue at once"""
    problems_per_request: int = 1
    """problems sent in one completion request (OpenAI's list-of-prompts form); fewer, larger requests
    cost the servers less HTTP and prefill per sample. Divides batch_size / group_size (a request never
    spans two optimizer steps); 0: all of an optimizer step's problems in one request; with `chat` each
    problem still goes in a request of its own"""
    weight_staging: WeightStaging = "staged"
    """how the servers take a weight update in: `staged` readies it beside the old weights (received into buffers
    of their own; vLLM also repacks them for its kernels there, a second copy of the weights on each vLLM server)
    while generation goes on, and pauses only to swap them in; `in_place` loads into the served weights during the
    pause (on vLLM: a longer pause, a copy of the weights less)"""
    request_timeout_s: float = 300.0
    """a completion request taking longer is retried on another server; with no usable server for this long, the actor
    fails the run"""

    def server_engine(self) -> Literal["home", "vllm"]:
        """`engine` with `auto` resolved: vLLM where its environment holds the GPU build and a GPU is visible, else
        home. A UserError for `vllm` without its environment, naming the command that makes it."""
        from lm_human_preference_details.grpo.serving import vllm_env  # the standard library only

        if self.engine == "home":
            return "home"
        if self.engine == "auto":
            usable = vllm_env.python_executable() is not None and vllm_env.for_gpu()
            return "vllm" if usable and gpu_visible() else "home"
        try:
            vllm_env.server_command()
        except RuntimeError as error:
            raise UserError(f"--engine vllm: {error}") from None
        return "vllm"


@dataclass
class EvalArgs:
    """Evaluation on problems the run does not train on, by the actor on the servers while the trainer trains."""

    eval_every: int = 0
    """evaluate at step 0, every N optimizer steps and at the last (0: never); each evaluation samples with the
    weights the servers serve once they reach that step, beside the training requests: the trainer never waits, but
    at its end for the last one (`eval/*` in metrics.jsonl)"""
    eval_problems: str = "held-out"
    """`held-out`: the problems of the task's family (`--problems arith` or `tiny-sums`) that the training stream
    never shows; or what `--problems` reads: `gsm8k`, `math500`, or a local JSON/JSONL file"""
    eval_num_problems: int = 0
    """evaluate on the first N of them (0: all)"""
    eval_samples: int = 1
    """samples per problem, at the run's temperature and token limit: the k of `eval/pass@k` (Chen et al.'s unbiased
    estimator; `eval/pass@1` is the mean success)"""


@dataclass
class ProcessArgs:
    """The trainer's processes, every process's threads, and how the weights travel to the servers."""

    trainer_processes: int = 1
    """trainer processes the launcher starts; more than one shard the policy, its gradients and optimizer state (and
    the reference model) over them with FSDP2 (torch's `fully_shard` through accelerate, with the settings of
    configs/accelerate/fsdp2.yaml), each training on its share of a step's micro-batches, the weights gathered whole
    once per push to the servers"""
    threads: int = 0
    """torch CPU threads per process (server, trainer); 0: the cores shared among the processes that compute
    at once. `pipeline`: the servers and the trainer's processes run side by side, cores // (servers +
    trainer_processes) each (more oversubscribes the cores, and threads that wait for each other's cores make every
    process slower). `sync`: they take turns, so the trainer's processes share every core and the servers do.
    Servers given with `--servers` count as on this machine; pass `--threads` when they are not"""
    trainer_host: str = "127.0.0.1"
    """address at which the servers reach the trainer for the weight broadcast"""
    weight_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """how weight updates travel: `gloo` (CPU tensors, or GPU tensors through host memory; works wherever the servers
    run, also on the trainer's own GPU) or `nccl` (GPU to GPU; only for servers on other GPUs than the trainer's:
    NCCL refuses two ranks on one GPU). `auto`: nccl where the map puts the servers on GPUs of their own, else gloo"""
    update_bucket_mb: float = 0.0
    """weight updates go out as flat buckets of consecutive tensors, at most this many MiB each
    (0: one broadcast per tensor, PipelineRL's way; on gloo each broadcast has a CPU cost per side however
    small, which a tiny model's update is mostly made of: see benchmarks/README.md)"""

    def sender_backend(self) -> WeightBackend:
        """The weight backend the trainer sends with: `weight_backend`, whose `auto` the launcher resolves from the
        map (`nodes.weight_backend_for`); a trainer started alone takes gloo for it, which works wherever the servers
        run."""
        return "gloo" if self.weight_backend == "auto" else self.weight_backend

    def check_weight_backend(self) -> None:
        """What the trainer's side needs (the launcher and the trainer check it; an actor sends no weights)."""
        if self.weight_backend == "nccl":
            import torch

            if not torch.cuda.is_available():
                raise UserError(
                    "--weight-backend nccl sends GPU tensors and no GPU is visible; use --weight-backend gloo"
                )


@dataclass
class GRPOArgs(RunArgs):
    """GRPO with verifiable rewards, trained the PipelineRL way (in-flight weight updates)."""

    output_dir: str = "runs/grpo"
    """metrics.jsonl, samples.jsonl, the stream, process logs, checkpoints"""
    stream: str = ""
    """where samples go: empty = `<output_dir>/stream.jsonl`, or `redis://HOST:PORT/DB?stream=NAME`"""
    recipe: Annotated[RecipeName, tyro.conf.arg(help=recipes_help())] = "default"
    sample_interval: int = 10
    """optimizer steps between sample tables (samples.jsonl and wandb; a wandb Table every step would
    cost a small model's trainer a noticeable share of its time)"""
    save_interval: int = 20
    """checkpoint every N optimizer steps (0: never); `--resume` continues from the last one"""
    resume: Resume = False
    """continue from the last checkpoint in output_dir (through `grpo.launch`, which restarts every process at it);
    `auto`: if it has one, else start it (cli.Resume)"""
    task: tyro.conf.OmitArgPrefixes[TaskArgs] = field(default_factory=TaskArgs)
    sampling: tyro.conf.OmitArgPrefixes[SamplingArgs] = field(default_factory=SamplingArgs)
    optim: tyro.conf.OmitArgPrefixes[OptimArgs] = field(default_factory=OptimArgs)
    loss: tyro.conf.OmitArgPrefixes[LossArgs] = field(default_factory=LossArgs)
    schedule: tyro.conf.OmitArgPrefixes[ScheduleArgs] = field(default_factory=ScheduleArgs)
    serving: tyro.conf.OmitArgPrefixes[ServingArgs] = field(default_factory=ServingArgs)
    processes: tyro.conf.OmitArgPrefixes[ProcessArgs] = field(default_factory=ProcessArgs)
    placement: tyro.conf.OmitArgPrefixes[PlacementArgs] = field(default_factory=PlacementArgs)
    evaluation: tyro.conf.OmitArgPrefixes[EvalArgs] = field(default_factory=EvalArgs)

    @classmethod
    def recipe_flags(cls, name: str) -> list[str]:
        """The flags `--recipe NAME` stands for (`cli.parse` puts them right after it): every loss field, at the
        recipe's value or else its default. A UserError for an unknown recipe."""
        if name not in RECIPES:
            raise UserError(f"--recipe {name!r} is unknown; choose one of {', '.join(RECIPES)}")
        return settings_as_flags(asdict(LossArgs()) | RECIPES[name].settings)

    def stream_url(self) -> str:
        return self.stream or os.path.join(self.output_dir, "stream.jsonl")

    def eval_stream_url(self) -> str:
        """Where the actor's evaluations (`records.Evaluation`) go to the trainer: beside the samples' stream."""
        return companion_url(self.stream_url(), "eval", os.path.join(self.output_dir, "eval.jsonl"))

    def flag_values(self) -> dict[str, object]:
        """Every field under its flag's name (`lr`, not `optim.lr`: the sub-configs' flags have no prefix, so their
        names are unique); what a checkpoint records, as it did before the fields were grouped."""
        values = {}
        for field_ in fields(self):
            value = getattr(self, field_.name)
            values |= asdict(value) if is_dataclass(value) else {field_.name: value}
        return values

    def groups_per_step(self) -> int:
        return self.optim.batch_size // self.sampling.group_size

    def request_problems(self) -> int:
        """Problems in one completion request: `problems_per_request`, or when 0 an optimizer step's."""
        return self.serving.problems_per_request or self.groups_per_step()

    def run_schedule(self) -> Schedule:
        """When the trainer reads, pushes and saves, and how far ahead the actor runs."""
        return Schedule(
            mode=self.schedule.mode,
            steps=self.optim.steps,
            sync_steps=self.schedule.sync_steps,
            steps_ahead=self.schedule.steps_ahead,
            groups_per_step=self.groups_per_step(),
            request_problems=self.request_problems(),
        )

    def torch_threads(self, role: Literal["server", "trainer"]) -> int:
        """`threads`, or when 0 the share of the cores that this mode gives each server or the trainer."""
        if self.processes.threads:
            return self.processes.threads
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        servers = len(self.serving.servers) or self.serving.num_servers
        trainers = self.processes.trainer_processes
        if self.schedule.mode == "pipeline":
            return max(1, cores // (servers + trainers))
        return max(1, cores // trainers) if role == "trainer" else max(1, cores // servers)

    def check(self) -> None:
        """Sizes that must fit together; a UserError names the field and the fix."""
        task, sampling, optim, loss, values = self.task, self.sampling, self.optim, self.loss, self.flag_values()
        if task.chat_example and (len(task.chat_example) != 2 or not task.chat):
            raise UserError(
                f"--chat-example: give two texts, a question and its answer, with --chat (got {len(task.chat_example)}"
                f"{'' if task.chat else ' without --chat'})"
            )
        if optim.batch_size < sampling.group_size:
            raise UserError(f"--batch-size {optim.batch_size} must be at least --group-size {sampling.group_size}")
        if sampling.group_size < 1 or sampling.group_size < 2 and loss.use_advantages:
            raise UserError(
                f"--group-size {sampling.group_size}: a group needs at least 2 attempts (one is its own baseline, "
                "advantage 0, as in PipelineRL; --no-use-advantages trains on the rewards, in groups of any size)"
            )
        if optim.batch_size % sampling.group_size:
            raise UserError(f"--batch-size {optim.batch_size} must be a multiple of --group-size {sampling.group_size}")
        for name in (
            "steps",
            "sync_steps",
            "steps_ahead",
            "num_servers",
            "trainer_processes",
            "server_batch_size",
            "max_in_flight",
            "max_tokens",
            "sample_interval",
        ):
            if values[name] < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {values[name]}")
        if not (math.isfinite(sampling.temperature) and sampling.temperature >= MIN_TEMPERATURE):
            raise UserError(
                f"--temperature must be a finite number >= {MIN_TEMPERATURE} (sampling only), "
                f"got {sampling.temperature}"
            )
        for name in ("lr", "ratio_cap", "clip_eps", "kl_clamp", "grad_clip", "request_timeout_s"):
            if values[name] <= 0:
                raise UserError(f"--{name.replace('_', '-')} must be > 0, got {values[name]}")
        if loss.clip_eps_high is not None and not loss.clip_eps_high > 0:
            raise UserError(f"--clip-eps-high must be > 0 (or None: --clip-eps), got {loss.clip_eps_high}")
        for name in ("kl_coef", "save_interval", "update_bucket_mb", "threads", "problems_per_request", "num_problems"):
            if values[name] < 0:
                raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {values[name]}")
        if loss.kl_coef_final is not None and not loss.kl_coef_final >= 0:
            raise UserError(f"--kl-coef-final must be >= 0 (or None: --kl-coef throughout), got {loss.kl_coef_final}")
        for name in ("entropy_coef", "entropy_coef_final"):
            if values[name] is not None and not math.isfinite(values[name]):
                raise UserError(f"--{name.replace('_', '-')} must be a finite number, got {values[name]}")
        if loss.importance_sampling != "token_truncate" and loss.loss_type != "reinforce":
            raise UserError(
                f"--importance-sampling {loss.importance_sampling} weighs --loss-type reinforce's gradient; "
                f"{loss.loss_type} clips its ratio instead: pass --loss-type reinforce, or leave --importance-sampling"
            )
        if self.groups_per_step() % self.request_problems():
            raise UserError(
                f"--problems-per-request {self.serving.problems_per_request} must divide the {self.groups_per_step()} "
                f"problems of an optimizer step (batch_size / group_size), or be 0: all of them in one request"
            )
        choices = (1 if task.chat else self.request_problems()) * sampling.group_size
        if choices > MAX_CHOICES:
            raise UserError(
                f"--problems-per-request {self.serving.problems_per_request}: {choices} samples in one request "
                f"(problems x --group-size {sampling.group_size}), a server takes at most {MAX_CHOICES}: pass one that "
                f"divides the {self.groups_per_step()} problems of a step into requests of at most "
                f"{MAX_CHOICES // sampling.group_size}"
            )
        if self.schedule.mode == "pipeline":
            self.run_schedule().problems_ahead()  # a fraction of a step the problems or requests cannot split: refused
        if optim.token_budget < 1:
            raise UserError(f"--token-budget must be >= 1, got {optim.token_budget}")
        self.check_evaluation()

    def check_evaluation(self) -> None:
        """`--eval-*`: the sizes, and (when evaluation is on) problems to evaluate on, loaded as the actor will."""
        evaluation = self.evaluation
        for name in ("eval_every", "eval_num_problems"):
            if getattr(evaluation, name) < 0:
                raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(evaluation, name)}")
        if not 1 <= evaluation.eval_samples <= MAX_CHOICES:
            raise UserError(
                f"--eval-samples must be between 1 and {MAX_CHOICES} (samples per problem, the k of pass@k, sent in "
                f"one request), got {evaluation.eval_samples}"
            )
        if self.schedule.mode == "sync" and evaluation.eval_every % self.schedule.sync_steps:
            raise UserError(
                f"--eval-every {evaluation.eval_every}: in sync mode the servers get new weights every --sync-steps "
                f"{self.schedule.sync_steps} steps, so only their multiples can be evaluated; pass a multiple of "
                f"{self.schedule.sync_steps}"
            )
        if evaluation.eval_every:
            eval_problems(self)  # none held out, or no such file: refused before anything starts


PRESETS: dict[str, GRPOArgs] = {
    # learns fast on a CPU: the format-taught tiny model, sums of two digits 0-4 (25 problems: the 20 of 0-3 + b are
    # trained on, the 5 of 4 + b held out for --eval-every, sampled 64 times each: a pass@1 whose rise over a run
    # stands well above its noise, benchmarks/README.md)
    # (the tiny model is cheap to run, so overheads rule: a server batch of 256 amortises each decode
    # step's; one request per optimizer step (its 8 problems, one prefill) costs the servers less HTTP and
    # prefill than several smaller ones, in both modes; and its 28 tensors go to the servers as one
    # broadcast; benchmarks/README.md has the timings)
    "tiny": GRPOArgs(
        preset="tiny",
        task=TaskArgs(model="tiny-math", problems="tiny-sums", answer_prefix="\\boxed{", num_problems=20),
        sampling=SamplingArgs(group_size=8, max_tokens=6),
        optim=OptimArgs(batch_size=64, steps=100, lr=5e-4),
        schedule=ScheduleArgs(steps_ahead=4),
        serving=ServingArgs(server_batch_size=256, problems_per_request=0),
        processes=ProcessArgs(update_bucket_mb=16),
        evaluation=EvalArgs(eval_samples=64),
    ),
    # a real pretrained LM (SmolLM2-135M-Instruct, offline) completing `4+5=\boxed{`: rarely right at
    # the start; sized for a GPU (on a few CPU cores a step takes seconds)
    "arith": GRPOArgs(
        preset="arith",
        task=TaskArgs(
            model="smollm2-135m",
            problems="arith",
            arith_digits=1,
            arith_template="{expression}=\\boxed{{",
            answer_prefix="\\boxed{",
            num_problems=512,
        ),
        sampling=SamplingArgs(group_size=8, max_tokens=8),
        optim=OptimArgs(batch_size=32, steps=40, lr=1e-5),
        serving=ServingArgs(max_in_flight=8, server_batch_size=64),
    ),
    # the reasoning quickstart (grpo/quickstart.py): SmolLM2-135M-Instruct asked through its chat template for
    # one-digit + - * answers in \boxed{}, after one worked exchange that shows the format on a question outside the
    # task (France's capital); it starts out mostly failing (it often answers in prose, or boxes a wrong number) and
    # GRPO teaches it the format and the arithmetic; only plain boxed integers score (integer_answers); 60 steps draw
    # 240 of the 300 problems (with repeats); 100 of those never drawn are evaluated at steps 0, 20, 40 and 60, one
    # sample each (what it does: README.md)
    "arith-chat": GRPOArgs(
        preset="arith-chat",
        task=TaskArgs(
            model="smollm2-135m",
            problems="arith",
            arith_digits=1,
            chat=True,
            chat_example=[
                "What is the capital of France? Put the final answer in \\boxed{}.",
                "The capital of France is Paris.\n\nThe answer is \\boxed{Paris}.",
            ],
            integer_answers=True,
            num_problems=240,
        ),
        sampling=SamplingArgs(group_size=8, max_tokens=24, temperature=0.7),
        optim=OptimArgs(batch_size=32, steps=60, lr=1e-5),
        serving=ServingArgs(max_in_flight=8, server_batch_size=64),
        evaluation=EvalArgs(eval_every=20, eval_num_problems=100),
    ),
}


def get_preset(name: str) -> GRPOArgs:
    if name not in PRESETS:
        raise UserError(f"--task {name!r} is unknown; choose one of {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name])
