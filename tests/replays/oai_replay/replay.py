"""Replays OpenAI's own training runs through this project's unmodified stage functions.

For each shape (a task and its PPO or reward-model settings, at the size of a 2-layer test GPT-2):
  1. the port's initial weights: a random GPT-2 over OAI's `test` encoding (`abcdefghijklmnopqrstuvwxyz.`,
     pad 27), a reward model on it, the reward head that stage 1 initializes;
  2. OAI's unmodified trainers (`oai_run.py`, one subprocess for all shapes) start from those weights and
     record their queries, sampled responses, numpy permutations, statistics and parameters after every update;
  3. `train_policy.train` / `train_reward.train` run with `StageHooks` that hand them OAI's queries (moved from
     OAI's right padding to the port's left padding), responses and permutations, and that read the port's
     parameters after every update under OAI's variable names.
Across ranks: OAI's trainers run as the ranks of `mpirun` (`run_oai(ranks=2)`), each recording its own run, and
the port's as the processes of `accelerate launch` (`replay_on_ranks`, `on_ranks.py`), each replaying its rank's.
"""

import json
import os
import pickle
import re
import subprocess
import sys
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from accelerate.utils import set_seed

from lm_human_preference_details import sharding, train_policy, train_reward
from lm_human_preference_details.models import PolicyAndValue, RewardModel, load_causal_lm
from lm_human_preference_details.sampling import StageHooks
from lm_human_preference_details.tasks import TaskHParams
from lm_human_preference_details.text import left_pad, load_tokenizer, strip_pad

OAI_VOCAB = "abcdefghijklmnopqrstuvwxyz."
"""OAI's `test` encoding; it encodes other characters as `.`
(# OAI: lm_human_preferences/language/encodings.py#L145-L158)"""
OAI_PAD = len(OAI_VOCAB)  # OAI: lm_human_preferences/language/encodings.py#L153
MODEL = dict(n_vocab=len(OAI_VOCAB), n_ctx=32, n_layer=2, n_embd=16, n_head=2)
"""OAI's model HParams for its `test` model, here larger than OAI's own test size (n_ctx 8) to fit the shapes"""
REPLAYS = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
"""tests/replays: OAI's runs start there, `oai_replay` on their path"""


@dataclass(frozen=True)
class Shape:
    """One replayed run: the port's settings, which `oai_hparams` translates into OAI's."""

    name: str
    task: TaskHParams
    seed: int
    ppo: train_policy.PPOHParams = field(default_factory=train_policy.PPOHParams)
    rewards: train_policy.RewardHParams = field(default_factory=train_policy.RewardHParams)
    reward: dict | None = None
    """stage 1 (train_reward.Args fields) instead of stage 2"""


def oai_test_tokenizer():
    """A character-level tokenizer with OAI's `test` encoding's ids, unknown characters as `.`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({c: i for i, c in enumerate(OAI_VOCAB)}, unk_token="."))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=".")


def save_base_model(path: str, seed: int) -> str:
    """A random GPT-2 of OAI's test size with OAI's test encoding: the policy, reference and reward trunk."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=MODEL["n_vocab"],
        n_positions=MODEL["n_ctx"],
        n_embd=MODEL["n_embd"],
        n_layer=MODEL["n_layer"],
        n_head=MODEL["n_head"],
        initializer_range=0.2,  # wide enough that the samples and the gradients are not flat
        bos_token_id=None,
        eos_token_id=None,
    )
    GPT2LMHeadModel(config).save_pretrained(path)
    oai_test_tokenizer().save_pretrained(path)
    return path


def initial_reward_model(base: str, seed: int) -> RewardModel:
    """The reward model stage 1 starts from (`train_reward.train`: the seed, then the model)."""
    set_seed(seed)
    return RewardModel.from_pretrained_lm(base)


def save_reward_model(path: str, base: str, seed: int) -> str:
    """A reward model for stage 2, with a gain and bias as stage 1 leaves them."""
    model = initial_reward_model(base, seed)
    with torch.no_grad():
        model.gain.fill_(1.7)
        model.bias.fill_(-0.3)
    model.save(path)
    load_tokenizer(base).save_pretrained(path)
    return path


def copied(parameter: torch.Tensor) -> np.ndarray:
    """The parameter's values now (`.numpy()` alone would share its memory and follow its updates)."""
    return parameter.detach().numpy().copy()


def trunk_to_oai(trunk: torch.nn.Module, scope: str) -> dict[str, np.ndarray]:
    """A transformers GPT-2 trunk's parameters under OAI's variable names: Conv1D weights are OAI's [1, nx, nf] `w`
    without the leading axis.

    # OAI: lm_human_preferences/language/model.py#L62-L98 (`norm`'s g and b, `conv1x1`'s w and b)
    # OAI: lm_human_preferences/language/model.py#L309-L312 (wpe, wte)
    """
    named = {}
    for key, value in trunk.named_parameters():
        module, kind = key.rsplit(".", 1)
        value = copied(value)
        if module in ("wte", "wpe"):
            named[f"{scope}/{module}"] = value
            continue
        norm = module.rsplit(".", 1)[-1].startswith("ln_")
        name = re.sub(r"^h\.(\d+)\.", r"h\1/", module).replace(".", "/")
        if kind == "weight":
            named[f"{scope}/{name}/{'g' if norm else 'w'}"] = value if norm else value[None]
        else:
            named[f"{scope}/{name}/b"] = value
    return named


def head_to_oai(head: torch.nn.Linear, scope: str) -> dict[str, np.ndarray]:
    """A scalar head under OAI's names: `w` [n_embd], `b` [].

    # OAI: lm_human_preferences/language/model.py#L248-L254
    """
    return {f"{scope}/w": copied(head.weight)[0], f"{scope}/b": copied(head.bias)[0]}


def policy_to_oai(policy: PolicyAndValue, scope: str = "policy") -> dict[str, np.ndarray]:
    return trunk_to_oai(policy.lm.base_model, f"{scope}/model") | head_to_oai(
        policy.value_head, f"{scope}/model/heads/value"
    )


def reward_model_to_oai(model: RewardModel) -> dict[str, np.ndarray]:
    return (
        trunk_to_oai(model.backbone, "reward_model/model")
        | head_to_oai(model.head, "reward_model/model/heads/reward")
        | {
            "reward_model/reward_norm/gain": copied(model.gain).reshape(()),  # OAI's are scalars, ours of shape (1,)
            "reward_model/reward_norm/bias": copied(model.bias).reshape(()),
        }
    )


def oai_hparams(shape: Shape, label_file: str | None) -> dict:
    """OAI's HParams (dotted keys) of the shape (# OAI: lm_human_preferences/lm_tasks.py#L16-L34)."""
    t = shape.task
    hparams = {
        "run.seed": shape.seed,
        "task.policy.initial_model": "test",
        "task.policy.temperature": t.temperature,
        "task.query_dataset": "test",
        "task.query_length": t.query_length,
        "task.response_length": t.response_length,
        "task.query_prefix": t.query_prefix,
        "task.query_suffix": t.query_suffix,
        "task.start_text": t.start_text,
        "task.end_text": t.end_text,
        "task.truncate_token": t.truncate_token,
        "task.truncate_after": t.truncate_after,
        "task.penalty_reward_value": int(t.penalty_reward_value),  # typed int in OAI's TaskHParams
    }
    if shape.reward is not None:  # OAI: lm_human_preferences/train_reward.py#L36-L54
        r = shape.reward
        return hparams | {
            "labels.type": "best_of_4",
            "labels.num_train": r["labels"].num_train,
            "labels.source": label_file,
            **{
                k: r[k]
                for k in ("batch_size", "lr", "rollout_batch_size", "normalize_samples", "normalize_before")
                + ("normalize_after",)
            },
        }
    p, rw = shape.ppo, shape.rewards  # OAI: lm_human_preferences/train_policy.py#L25-L58
    hparams |= {
        "rewards.trained_model": "test",
        "rewards.kl_coef": rw.kl_coef,
        **{f"ppo.{k}": getattr(p, k) for k in ("total_episodes", "batch_size", "nminibatches", "noptepochs")},
        **{f"ppo.{k}": getattr(p, k) for k in ("lr", "whiten_rewards")},
    }
    if rw.adaptive_kl:
        hparams |= {
            "rewards.adaptive_kl": "on",
            "rewards.adaptive_kl.target": rw.target_kl,
            "rewards.adaptive_kl.horizon": rw.horizon,
        }
    return hparams


def random_labels(shape: Shape, num: int) -> list[dict]:
    """Best-of-4 labels as OAI's files hold them (queries right-padded with OAI's pad)."""
    rng = np.random.default_rng(shape.seed)
    t = shape.task
    lengths = rng.integers(1, t.query_length + 1, num)
    queries = [[*rng.integers(0, OAI_PAD, n).tolist(), *[OAI_PAD] * (t.query_length - n)] for n in lengths]
    samples = rng.integers(0, OAI_PAD, (num, 4, t.response_length)).tolist()
    best = rng.integers(0, 4, num).tolist()
    return [
        {"query": q, **{f"sample{k}": s[k] for k in range(4)}, "best": b} for q, s, b in zip(queries, samples, best)
    ]


def write_labels(path: str, labels: list[dict], pad_id: int) -> str:
    """`labels` with OAI's pad replaced by `pad_id` (the port's label files carry the port's)."""
    with open(path, "w") as f:
        json.dump(
            [
                {k: [pad_id if t == OAI_PAD else t for t in v] if k == "query" else v for k, v in r.items()}
                for r in labels
            ],
            f,
        )
    return path


@dataclass
class Prepared:
    """A shape's files: the port's models and labels, and the weights OAI starts from."""

    shape: Shape
    base: str
    reward_model: str | None = None
    label_file: str | None = None
    oai_label_file: str | None = None

    def oai_run(self) -> dict:
        """What `oai_run.py` runs for this shape."""
        base = PolicyAndValue(load_causal_lm(self.base))
        if self.shape.reward is not None:
            reward = initial_reward_model(self.base, self.shape.seed)
            weights = policy_to_oai(base, "ref_policy") | reward_model_to_oai(reward)
            return dict(
                stage="reward",
                model=MODEL,
                seed=self.shape.seed,
                weights=weights,
                hparams=oai_hparams(self.shape, self.oai_label_file),
            )
        weights = policy_to_oai(base) | policy_to_oai(base, "ref_policy")
        weights |= reward_model_to_oai(RewardModel.load(self.reward_model))
        return dict(
            stage="policy", model=MODEL, seed=self.shape.seed, weights=weights, hparams=oai_hparams(self.shape, None)
        )


def prepare(shape: Shape, folder: str) -> Prepared:
    os.makedirs(folder, exist_ok=True)
    prepared = Prepared(shape, save_base_model(os.path.join(folder, "base"), shape.seed))
    if shape.reward is None:
        prepared.reward_model = save_reward_model(os.path.join(folder, "reward"), prepared.base, shape.seed + 1)
    else:
        labels = random_labels(shape, shape.reward["labels"].num_train)
        prepared.oai_label_file = write_labels(os.path.join(folder, "oai_labels.json"), labels, OAI_PAD)
        pad_id = load_tokenizer(prepared.base).oai_pad_token_id
        prepared.label_file = write_labels(os.path.join(folder, "labels.json"), labels, pad_id)
    return prepared


def run_oai(prepared: list[Prepared], folder: str, ranks: int = 1) -> list[list[dict]]:
    """OAI's trainers on every shape, in one subprocess (TensorFlow's start is most of its time), or in `ranks`
    processes of `mpirun`; each rank's records."""
    in_path, out_path = os.path.join(folder, "oai_in.pkl"), os.path.join(folder, "oai_out.pkl")
    with open(in_path, "wb") as f:
        pickle.dump([p.oai_run() for p in prepared], f)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=REPLAYS)
    command = [sys.executable, "-m", "oai_replay.oai_run", in_path, out_path]
    if ranks > 1:
        # as root too (CI's containers), more ranks than cores, and no rank pinned to a core of a shared machine
        env |= dict(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        command = ["mpirun", "-np", str(ranks), "--oversubscribe", "--bind-to", "none", *command]
    result = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    records = []
    for rank in range(ranks):
        with open(f"{out_path}.{rank}", "rb") as f:
            records.append(pickle.load(f))
    return records


@dataclass
class RanksJob:
    """One replay in each process of a launch (`on_ranks.py`): process r replays `records[r]`, OAI's rank r's."""

    prepared: Prepared
    records: list[dict]
    output_dir: str
    whiten_over_all: bool = False
    """the control: whiten each minibatch over all processes' rows (OAI: each rank's own)"""


def replay_on_ranks(jobs: list[RanksJob], folder: str) -> list[list]:
    """`replay_policy` / `replay_reward` of each job in both processes of one `accelerate launch`; each process's
    results."""
    from tests.conftest import REPO, accelerate_two_processes

    in_path, out_path = os.path.join(folder, "port_in.pkl"), os.path.join(folder, "port_out.pkl")
    with open(in_path, "wb") as f:
        pickle.dump(jobs, f)
    # the repository's root: the script imports `tests.replays`
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    command = [*accelerate_two_processes(), os.path.join(REPLAYS, "oai_replay", "on_ranks.py"), in_path, out_path]
    result = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    results = []
    for rank in range(2):
        with open(f"{out_path}.{rank}", "rb") as f:
            results.append(pickle.load(f))
    return results


class RecordedQueries:
    """OAI's query batches, moved from its right padding (pad 27) to the port's left padding."""

    def __init__(self, batches: list[np.ndarray], pad_id: int):
        self.batches, self.pad_id, self.batches_drawn = batches, pad_id, 0
        self.batch_size = len(batches[0])

    def __next__(self) -> torch.Tensor:
        batch = self.batches[self.batches_drawn]
        self.batches_drawn += 1
        return left_pad([strip_pad(row.tolist(), OAI_PAD) for row in batch], batch.shape[1], self.pad_id)


def replay_hooks(queries: list, responses: list, permutations: list, pad_id: int, snapshots: list, to_oai):
    """`StageHooks` that hand the stage OAI's queries, responses and permutations in OAI's order, and keep the
    model's parameters under OAI's names (`to_oai`) after every update in `snapshots`."""
    responses, permutations = iter(responses), iter(permutations)

    def sample(lm, contexts, pad_id, response_length, temperature, **kwargs):
        recorded = torch.as_tensor(next(responses), dtype=torch.long)
        assert recorded.shape == (len(contexts), response_length)
        return recorded, None

    def permutation(n, **kwargs):
        order = torch.as_tensor(next(permutations), dtype=torch.long)
        assert len(order) == n
        return order

    return StageHooks(
        query_sampler=lambda *args, **kwargs: RecordedQueries(queries, pad_id),
        sample=sample,
        permutation=permutation,
        after_update=lambda update, model: snapshots.append(to_oai(model)),
    )


def replay_policy(
    prepared: Prepared, record: dict, output_dir: str, accelerator=None, **ppo_overrides
) -> tuple[list, list]:
    """The port's stage 2 on OAI's rollouts (`record`: one rank's), in this process or in each of a launch's
    (`accelerator`); its parameters (OAI's names) and metrics after every update."""
    shape = prepared.shape
    args = train_policy.Args(
        task=replace(shape.task, base_model=prepared.base),
        rewards=replace(shape.rewards, trained_model=prepared.reward_model),
        ppo=replace(shape.ppo, **ppo_overrides),
        seed=shape.seed,
        output_dir=output_dir,
        wandb_mode="disabled",
        save_interval=0,
        sample_interval=10**6,
    )
    pad_id = load_tokenizer(prepared.base).oai_pad_token_id
    updates = record["updates"]
    snapshots = []
    hooks = replay_hooks(
        [u["queries"] for u in updates],
        [u["responses"] for u in updates],
        record["permutations"],
        pad_id,
        snapshots,
        policy_to_oai,
    )
    accelerator = accelerator or sharding.make_accelerator()
    train_policy.train(args, accelerator, hooks)
    return snapshots, logged_metrics(output_dir, accelerator)


def replay_reward(prepared: Prepared, record: dict, output_dir: str, accelerator=None) -> tuple[list, dict, dict]:
    """The port's stage 1 on OAI's labels, label order and normalization samples (`record`: one rank's), in this
    process or in each of a launch's (`accelerator`): its parameters (OAI's names) after every update and after
    normalizing at the end, and its metrics."""
    shape = prepared.shape
    settings = dict(shape.reward)
    labels = replace(settings.pop("labels"), source=prepared.label_file)
    args = train_reward.Args(
        task=replace(shape.task, base_model=prepared.base),
        labels=labels,
        seed=shape.seed,
        output_dir=output_dir,
        wandb_mode="disabled",
        **settings,
    )
    pad_id = load_tokenizer(prepared.base).oai_pad_token_id
    batches = [batch for normalization in record["normalize_samples"] for batch in normalization]
    snapshots = []
    hooks = replay_hooks(
        [q for q, _ in batches],
        [r for _, r in batches],
        record["label_orders"],
        pad_id,
        snapshots,
        reward_model_to_oai,
    )
    accelerator = accelerator or sharding.make_accelerator()
    path = train_reward.train(args, accelerator, hooks)
    metrics = {k: v for line in logged_metrics(output_dir, accelerator) for k, v in line.items()}
    return snapshots, reward_model_to_oai(RewardModel.load(path)), metrics


def logged_metrics(output_dir: str, accelerator) -> list[dict]:
    """The lines of a stage's metrics.jsonl, once its main process, which writes them, is done."""
    accelerator.wait_for_everyone()
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def max_difference(oai: dict[str, np.ndarray], port: dict[str, np.ndarray]) -> tuple[float, str]:
    """The largest absolute difference over all parameters, and the parameter's name."""
    assert oai.keys() == port.keys(), set(oai) ^ set(port)
    return max((float(np.abs(oai[k] - port[k]).max()), k) for k in oai)
