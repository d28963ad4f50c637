"""One PPO update, side by side: this project vs TRL's PPOTrainer vs the raw compute of the same update.

    bash benchmarks/trl_env.sh .venv-trl 1.12.0
    python benchmarks/ppo_speed.py --trl-python .venv-trl/bin/python --out-dir benchmarks/results/ppo_speed

Same model (the `tiny` preset's 2-layer GPT-2), same shapes (batch 64, 64 query + 24 response tokens,
4 PPO epochs, 1 minibatch), same machine, runs interleaved (ours, raw, TRL, ours, raw, TRL, ...):
- `ours`: `train_policy.py --task tiny` at those shapes; seconds per update from its `time/update_s`.
- `raw`: the update's model calls alone, no bookkeeping: a prefill and one cached forward per response
  token (sampling), the policy, reference and reward forwards, then per epoch one forward, backward and
  Adam step.
- `trl`: TRL's PPOTrainer (`trl.experimental.ppo`, TRL 1.12.0, the last release that has it) with the
  same tiny GPT-2 as policy and reference and GPT-2 sequence classifiers of the same size as value and
  reward models; seconds per update between its `on_step_end` callbacks. (`ours` and `raw` load GPT-2
  through `models.load_causal_lm`, whose GELU is torch's fused kernel; TRL gets transformers'
  `gelu_new`, the same function in seven ops, as any TRL user does.) TRL lives in its own
  environment (`--trl-python`), never in this project's dependencies; without it the TRL column is left out.
Each process runs `--warmup` updates first (not timed) and `--updates` timed ones; the table shows the
median seconds per update, episodes/s, peak host memory (max RSS of the process; with `--device cuda`
GPU memory is not in it) and the ratios.
The scaling table (`--scaling`) repeats `ours` and `raw` over batch sizes and response lengths.
`--device cuda` runs all three on the GPU (benchmarks/gpu.sh); `cpu`, the default, hides any GPU.
"""

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import tyro

from lm_human_preference_details.benchmarking import Device, device_env, git_commit, machine, run_logged, synchronize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Args:
    batch_size: int = 64
    """episodes per PPO update"""
    query_length: int = 64
    """query tokens"""
    response_length: int = 24
    """response tokens"""
    epochs: int = 4
    """PPO epochs per update (1 minibatch each)"""
    warmup: int = 1
    """updates per process before the timed ones"""
    updates: int = 5
    """timed updates per process"""
    repeats: int = 2
    """processes per implementation, interleaved; the table shows medians"""
    trl_python: str | None = None
    """python of an environment with trl==1.12.0 (see the module docstring); None: no TRL column"""
    scaling: bool = False
    """also time `ours` and `raw` at each batch size and response length below"""
    scaling_batches: list[int] = field(default_factory=lambda: [16, 64, 256])
    """`--scaling`: batch sizes"""
    scaling_lengths: list[int] = field(default_factory=lambda: [24, 96])
    """`--scaling`: response lengths"""
    out_dir: str = "runs/ppo_speed"
    """results.json, results.md and the runs go here"""
    device: Device = "cpu"
    """where every implementation runs (`cpu` hides any GPU from them)"""
    role: str = "main"
    """internal: `raw` or `trl` runs one implementation in this process and writes --result"""
    result: str = ""
    """internal: where a role writes its seconds per update"""


# ------------------------------------------------------------------------------------------- roles
def raw_update_times(args: Args) -> list[float]:
    """The update's model calls, timed alone."""
    import torch

    from lm_human_preference_details.models import PolicyAndValue, RewardModel, load_causal_lm, logprobs_of
    from lm_human_preference_details.text import load_tokenizer

    torch.manual_seed(0)
    device = torch.device(args.device)
    tokenizer = load_tokenizer("tiny")
    vocab, pad_id = len(tokenizer), tokenizer.oai_pad_token_id
    policy = PolicyAndValue(load_causal_lm("tiny"), vocab).to(device)
    reference = PolicyAndValue(load_causal_lm("tiny"), vocab).requires_grad_(False).to(device)
    reward = RewardModel.from_pretrained_lm("tiny").requires_grad_(False).to(device)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-5)
    queries = torch.randint(0, vocab - 1, (args.batch_size, args.query_length), device=device)
    q = args.query_length
    times = []
    for _ in range(args.warmup + args.updates):
        start = time.perf_counter()
        with torch.no_grad():  # sampling: a prefill, then one cached forward per token
            out = policy.lm(input_ids=queries, use_cache=True, logits_to_keep=1)
            tokens = []
            for t in range(args.response_length):
                tokens.append(torch.multinomial(torch.softmax(out.logits[:, -1, :vocab].float(), -1), 1))
                if t + 1 < args.response_length:
                    out = policy.lm(input_ids=tokens[-1], cache=out.cache, use_cache=True)
            ids = torch.cat([queries, *tokens], dim=1)
            predicting = slice(q - 1, -1)  # the positions that predict the response tokens
            policy(ids, pad_id, predicting), reference(ids, pad_id, predicting), reward(ids, pad_id)
        for _ in range(args.epochs):
            logits, values = policy(ids, pad_id, predicting)
            loss = -logprobs_of(logits, ids[:, q:], 1.0).mean() + values.square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times[args.warmup :]


def trl_update_times(args: Args) -> list[float]:
    """TRL's PPOTrainer on the same tiny GPT-2, seconds between the ends of two updates."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    from lm_human_preference_details.assets import resolve_model_path

    path = resolve_model_path("tiny")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = tokenizer.eos_token
    generator = torch.Generator().manual_seed(0)
    queries = torch.randint(0, len(tokenizer) - 1, (args.batch_size * 4, args.query_length), generator=generator)
    ends: list[float] = []

    class UpdateTimer(TrainerCallback):
        def on_train_begin(self, *_, **__):
            ends.append(time.perf_counter())

        def on_step_end(self, *_, **__):
            ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        config = PPOConfig(
            output_dir=out,
            per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=1,
            num_ppo_epochs=args.epochs,
            num_mini_batches=1,
            response_length=args.response_length,
            stop_token=None,
            total_episodes=args.batch_size * (args.warmup + args.updates),
            local_rollout_forward_batch_size=args.batch_size,
            learning_rate=1e-5,
            temperature=1.0,
            num_sample_generations=0,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            use_cpu=args.device == "cpu",
            seed=0,
            disable_tqdm=True,
            bf16=False,
            gradient_checkpointing=False,  # as every row: fp32, no recomputed forward (TRL 1.12's PPO ignores both)
        )
        trainer = PPOTrainer(
            args=config,
            processing_class=tokenizer,
            model=AutoModelForCausalLM.from_pretrained(path),
            ref_model=AutoModelForCausalLM.from_pretrained(path),
            reward_model=AutoModelForSequenceClassification.from_pretrained(path, num_labels=1),
            value_model=AutoModelForSequenceClassification.from_pretrained(path, num_labels=1),
            train_dataset=Dataset.from_dict({"input_ids": queries.tolist()}),
            callbacks=[UpdateTimer()],
        )
        trainer.train()
    durations = [b - a for a, b in zip(ends, ends[1:])]
    return durations[args.warmup :]


# -------------------------------------------------------------------------------------- the table
def measure(args: Args, name: str, shape: Args, run_dir: str, reward_model: str) -> dict:
    result = os.path.join(run_dir, f"{name}.json")
    if name == "ours":
        episodes = shape.batch_size * (shape.warmup + shape.updates)
        peak = run_logged(
            [
                sys.executable,
                "-m",
                "lm_human_preference_details.train_policy",
                "--task",
                "tiny",
                "--output-dir",
                run_dir,
                "--wandb-mode",
                "disabled",
                "--rewards.trained-model",
                reward_model,
                "--save-interval",
                "0",
                "--task.query-length",
                str(shape.query_length),
                "--task.response-length",
                str(shape.response_length),
                "--ppo.batch-size",
                str(shape.batch_size),
                "--ppo.noptepochs",
                str(shape.epochs),
                "--ppo.nminibatches",
                "1",
                "--ppo.total-episodes",
                str(episodes),
            ],
            os.path.join(run_dir, "log.txt"),
            device_env(args.device),
            ROOT,
        )
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            times = [json.loads(line)["time/update_s"] for line in f][shape.warmup :]
    else:
        python = sys.executable if name == "raw" else args.trl_python
        flags = [
            "--role",
            name,
            "--result",
            result,
            "--batch-size",
            str(shape.batch_size),
            "--query-length",
            str(shape.query_length),
            "--response-length",
            str(shape.response_length),
            "--epochs",
            str(shape.epochs),
            "--warmup",
            str(shape.warmup),
            "--updates",
            str(shape.updates),
            "--device",
            args.device,
        ]
        peak = run_logged(
            [python, os.path.abspath(__file__), *flags],
            os.path.join(run_dir, "log.txt"),
            device_env(args.device, python_path=ROOT),
            ROOT,
        )
        with open(result) as f:
            times = json.load(f)
    return {"s_per_update": statistics.median(times), "peak_mib": peak, "times": times}


def compare(args: Args, shape: Args, names: list[str], reward_model: str, label: str) -> dict[str, dict]:
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names:
            run_dir = os.path.join(args.out_dir, label, f"{name}_{repeat}")
            shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: a stage refuses to log over an earlier one
            os.makedirs(run_dir, exist_ok=True)
            runs[name].append(measure(args, name, shape, run_dir, reward_model))
    return {
        name: {
            "s_per_update": statistics.median(r["s_per_update"] for r in rs),
            "peak_mib": max(r["peak_mib"] for r in rs),
            "episodes_per_s": shape.batch_size / statistics.median(r["s_per_update"] for r in rs),
            "runs": rs,
        }
        for name, rs in runs.items()
    }


def markdown(args: Args, main: dict, scaling: list[dict]) -> str:
    lines = [
        f"One PPO update on the `tiny` model: batch {args.batch_size}, {args.query_length} query + "
        f"{args.response_length} response tokens, {args.epochs} epochs, 1 minibatch; "
        f"median of {args.repeats} processes x {args.updates} updates, "
        f"{machine(args.device)}"
        + (
            " (host memory: mostly the CUDA context, not comparable across implementations)"
            if args.device == "cuda"
            else ""
        )
        + ".",
        "",
        "| implementation | s / update | episodes/s | peak host memory (MiB) | time / raw compute "
        "| ours' episodes/s / this |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in main.items():
        lines.append(
            f"| {name} | {m['s_per_update']:.3f} | {m['episodes_per_s']:.0f} | {m['peak_mib']} | "
            f"{m['s_per_update'] / main['raw']['s_per_update']:.2f}x "
            f"| {main['ours']['episodes_per_s'] / m['episodes_per_s']:.2f}x |"
        )
    if scaling:
        lines += [
            "",
            "Scaling (`ours` and `raw`, seconds per update):",
            "",
            "| batch | response tokens | ours | raw | ours / raw |",
            "|---|---|---|---|---|",
        ]
        for s in scaling:
            lines.append(
                f"| {s['batch_size']} | {s['response_length']} | {s['ours']:.3f} | {s['raw']:.3f} "
                f"| {s['ours'] / s['raw']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = tyro.cli(Args, args=argv)
    if args.role != "main":
        times = raw_update_times(args) if args.role == "raw" else trl_update_times(args)
        with open(args.result, "w") as f:
            json.dump(times, f)
        return
    os.makedirs(args.out_dir, exist_ok=True)
    reward_dir = os.path.join(args.out_dir, "reward")
    reward_model = os.path.join(reward_dir, "reward_model")
    if not os.path.isdir(reward_model):
        os.makedirs(reward_dir, exist_ok=True)
        run_logged(
            [
                sys.executable,
                "-m",
                "lm_human_preference_details.train_reward",
                "--task",
                "tiny",
                "--output-dir",
                reward_dir,
                "--wandb-mode",
                "disabled",
                "--labels.num-train",
                "256",
                "--labels.num-test",
                "0",
            ],
            os.path.join(reward_dir, "log.txt"),
            device_env(args.device),
            ROOT,
        )
    names = ["ours", "raw"] + (["trl"] if args.trl_python else [])
    main_table = compare(args, args, names, reward_model, "main")
    scaling: list[dict] = []
    save(args, main_table, scaling)
    if args.scaling:
        for batch_size in args.scaling_batches:
            for response_length in args.scaling_lengths:
                shape = Args(**{**vars(args), "batch_size": batch_size, "response_length": response_length})
                both = compare(args, shape, ["ours", "raw"], reward_model, f"scaling_b{batch_size}_r{response_length}")
                scaling.append(
                    {
                        "batch_size": batch_size,
                        "response_length": response_length,
                        "ours": both["ours"]["s_per_update"],
                        "raw": both["raw"]["s_per_update"],
                    }
                )
                save(args, main_table, scaling)
    print(markdown(args, main_table, scaling))


def save(args: Args, main_table: dict, scaling: list[dict]) -> None:
    """results.json and results.md as they stand (after the main table and each scaling row: a benchmark
    stopped midway keeps what it has)."""
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump({"args": vars(args), "commit": git_commit(), "main": main_table, "scaling": scaling}, f, indent=2)
    with open(os.path.join(args.out_dir, "results.md"), "w") as f:
        f.write(markdown(args, main_table, scaling))


if __name__ == "__main__":
    main()
