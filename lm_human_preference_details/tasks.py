"""Named experiments: OAI's `launch.py` presets, plus offline ones that run on a CPU.

A preset fills the defaults of a stage's `Args`; any flag on the command line overrides it.
"""

import copy
from dataclasses import dataclass, field

from .assets import SMOLLM2, TINY
from .cli import UserError

OAI_LABELS = "https://openaipublic.blob.core.windows.net/lm-human-preferences/labels"


@dataclass
class TaskHParams:
    """What the policy reads and writes (# OAI: lm_human_preferences/lm_tasks.py#L16-L34)."""

    base_model: str = "gpt2"
    """the pretrained LM that starts the policy, the reference policy and the reward model: a hub name,
    a local folder, or an offline preset (`tiny`, `smollm2-135m`)"""
    query_dataset: str = "books"
    """where queries come from: `books` (OAI's book passages) or `tldr` (OAI's Reddit posts), downloaded once;
    `chatterbot` (offline English sentences)"""
    query_length: int = 64
    """tokens per query, padded with the pad id beyond the vocab"""
    query_prefix: str = ""
    """text put before every query the policy reads"""
    query_suffix: str = ""
    """text put after every query the policy reads"""
    query_seed: int = 0
    """order of the query documents; OAI's is 0 whatever the run's seed
    (# OAI: lm_human_preferences/language/datasets.py#L33)"""
    start_text: str | None = "."
    """a query starts after the first occurrence of this token in the document (None: at its start)"""
    end_text: str | None = None
    """a query is cut after the last occurrence of this token (None: not cut)"""
    response_length: int = 24
    """tokens per response; sampling never stops early"""
    truncate_token: int | None = None
    """responses are cut after the first of this token id at or after `truncate_after` (None: not cut)"""
    truncate_after: int = 0
    """the first index at which `truncate_token` counts"""
    penalty_reward_value: float = -1.0
    """the score of a response that lacks `truncate_token` at or after `truncate_after`"""
    temperature: float = 1.0
    """sampling temperature; logits are divided by it wherever logprobs are computed"""


def check_task(task: TaskHParams) -> None:
    """The task's sizes and cuts: a UserError before any work (the vocabulary is checked once the tokenizer
    is loaded: `check_truncate_token`)."""
    from lm_human_preference_details.cli import UserError, require

    require(
        0,
        {
            "task.query_length": task.query_length,
            "task.response_length": task.response_length,
            "task.temperature": task.temperature,
        },
    )
    if task.truncate_token is not None and not 0 <= task.truncate_after < task.response_length:
        raise UserError(
            f"--task.truncate-after {task.truncate_after} must be in [0, task.response_length={task.response_length}): "
            f"a response has no token at or after it, so every response would get the penalty"
        )


def check_truncate_token(task: TaskHParams, vocab_size: int) -> None:
    """A `truncate_token` the tokenizer has (`vocab_size` ids)."""
    from lm_human_preference_details.cli import UserError

    if task.truncate_token is not None and not 0 <= task.truncate_token < vocab_size:
        raise UserError(
            f"--task.truncate-token {task.truncate_token} is outside the tokenizer's vocabulary [0, {vocab_size}): "
            "no response would contain it, so every response would get the penalty"
        )


@dataclass
class LabelHParams:
    """Where the reward model's labels come from (# OAI: lm_human_preferences/train_reward.py#L22-L26)."""

    type: str = "best_of_4"
    """`best_of_N`: a query, N responses, the index of the best one"""
    num_train: int = 4992
    """labels trained on, the first ones of the file, one epoch"""
    num_test: int = 0
    """labels after the training ones held out to measure accuracy (0: none)"""
    source: str | None = None
    """a label file in OAI's JSON format: a local path, an http(s) URL, or `hub:FILE` in the hub dataset
    vwxyzjn/lm-human-preferences; None: make labels on the spot with `labeler`"""
    labeler: str | None = None
    """when `source` is None: `vader`, `vowels`, or `module:function` scoring (queries, responses) -> floats"""

    @property
    def num_responses(self) -> int:
        if not self.type.startswith("best_of_") or not self.type[len("best_of_") :].isdigit():
            raise UserError(f"labels.type={self.type!r} is not supported; use best_of_N, e.g. best_of_4")
        return int(self.type[len("best_of_") :])


@dataclass
class TaskPreset:
    task: TaskHParams
    labels: LabelHParams
    reward: dict = field(default_factory=dict)
    """overrides of train_reward.Args fields"""
    policy: dict = field(default_factory=dict)
    """overrides of train_policy.Args fields"""


def _books(labels: str) -> TaskPreset:
    # OAI: launch.py#L8-L19 (books_task)
    # OAI: launch.py#L49-L72 (reward experiments)
    # OAI: launch.py#L116-L138 (policy sentiment)
    return TaskPreset(
        task=TaskHParams(
            base_model="gpt2",
            query_dataset="books",
            query_length=64,
            start_text=".",
            end_text=".",
            response_length=24,
            truncate_token=13,
            truncate_after=16,
            temperature=0.7,
        ),
        labels=LabelHParams(type="best_of_4", num_train=4992, source=f"{OAI_LABELS}/{labels}/offline_5k.json"),
        reward=dict(batch_size=32, lr=5e-5, rollout_batch_size=512, normalize_samples=256),
        policy=dict(
            rewards=dict(kl_coef=0.15, adaptive_kl=True, target_kl=6.0, horizon=10000),
            ppo=dict(total_episodes=1_000_000, batch_size=512, lr=1e-5, noptepochs=4, nminibatches=1),
        ),
    )


def _tldr() -> TaskPreset:
    # OAI: launch.py#L36-L47 (summarize_tldr_task)
    # OAI: launch.py#L50-L55 (reward experiments)
    # OAI: launch.py#L98-L111 (reward tldr)
    # OAI: launch.py#L171-L187 (policy tldr)
    return TaskPreset(
        task=TaskHParams(
            base_model="gpt2",
            query_dataset="tldr",
            query_length=500,
            query_suffix="\n\nTL;DR:",
            start_text=None,
            end_text=None,
            response_length=75,
            truncate_token=198,
            truncate_after=55,
            temperature=0.7,  # 198: "\n"
        ),
        labels=LabelHParams(type="best_of_4", num_train=46_000, source=f"{OAI_LABELS}/tldr/online_45k.json"),
        reward=dict(batch_size=16, lr=2.5e-5, rollout_batch_size=128, normalize_samples=256),
        policy=dict(
            rewards=dict(kl_coef=0.03, adaptive_kl=False),
            # OAI binds `rewards.whiten=False`, a field its HParams do not have (its tldr run stops there with a
            # KeyError); read here as the reward whitening it names
            ppo=dict(
                total_episodes=1_000_000, batch_size=32, lr=2e-6, noptepochs=4, nminibatches=1, whiten_rewards=False
            ),
        ),
    )


PRESETS: dict[str, TaskPreset] = {
    "sentiment": _books("sentiment"),
    "descriptiveness": _books("descriptiveness"),
    "tldr": _tldr(),  # OAI's summarization of Reddit posts (cnndm is not ported: its stories are in a gs:// folder)
    # seconds on a CPU: a 2-layer character-level GPT-2 learns to prefer vowels (labels made on the spot)
    "tiny": TaskPreset(
        task=TaskHParams(
            base_model=TINY,
            query_dataset="chatterbot",
            query_length=16,
            start_text=None,
            end_text=None,
            response_length=12,
            temperature=1.0,
        ),
        labels=LabelHParams(type="best_of_4", num_train=1536, num_test=256, labeler="vowels"),
        reward=dict(batch_size=32, lr=1e-3, rollout_batch_size=128, normalize_samples=256),
        policy=dict(
            eval_labeler="vowels",
            rewards=dict(kl_coef=0.05, adaptive_kl=True, target_kl=3.0, horizon=2000),
            ppo=dict(total_episodes=64 * 30, batch_size=64, lr=3e-4, noptepochs=4, nminibatches=1),
        ),
    ),
    # a real pretrained LM, offline: SmolLM2-135M learns the VADER labeler's taste for positive text;
    # sized for the CPU quickstart: stage 1 and stage 2 each take minutes on a laptop's cores
    "sentiment-smollm2": TaskPreset(
        task=TaskHParams(
            # the query wrapped in SmolLM2's chat template, as OAI's tldr task wraps its query in a prefix/suffix
            base_model=SMOLLM2,
            query_dataset="chatterbot",
            query_length=16,
            start_text=None,
            end_text=None,
            query_prefix="<|im_start|>user\n",
            query_suffix="<|im_end|>\n<|im_start|>assistant\n",
            response_length=16,
            temperature=0.7,
        ),
        labels=LabelHParams(type="best_of_4", num_train=384, num_test=64, labeler="vader"),
        reward=dict(batch_size=16, lr=1e-4, rollout_batch_size=128, normalize_samples=128),
        policy=dict(
            eval_labeler="vader",
            rewards=dict(kl_coef=0.05, adaptive_kl=True, target_kl=6.0, horizon=10000),
            ppo=dict(total_episodes=32 * 16, batch_size=32, lr=1e-4, noptepochs=2, nminibatches=1),
        ),
    ),
}


def get_preset(name: str) -> TaskPreset:
    if name not in PRESETS:
        raise UserError(f"--task {name!r} is unknown; choose one of {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name])  # callers change their Args freely; the presets stay as written
