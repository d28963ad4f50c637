"""The whole OAI pipeline in miniature, offline, on a CPU, ending with a plot.

    1. labels:       SmolLM2-135M samples 4 continuations of each query; VADER picks the most positive
    2. reward model: OAI's stage 1 on those labels (normalize, one epoch, normalize)
    3. policy:       OAI's stage 2, PPO against the reward model with the KL penalty
    4. results:      learning curves (reward-model score, VADER's own score of the samples, KL) as a PNG,
                     and the same queries answered before and after training

`python -m lm_human_preference_details.quickstart`: sized to finish on a laptop's CPU while you wait, with a
progress bar on each long phase (sizes in tasks.py, preset `sentiment-smollm2`). Any train_policy.py flag can
follow, e.g. `--ppo.total-episodes 320`. Without `--mixed-precision` it takes bf16 where that is faster than
float32 (a GPU with bfloat16, a CPU whose bf16 matmuls beat float32's: `precision.fastest_precision`), and says why.
Run again, it refuses to overwrite its earlier run: `--resume` continues that one (a finished one only shows its
results again), another `--output-dir` starts a new one.
"""

import os
import sys

import torch

from lm_human_preference_details import cli, labelers, precision, sharding, tasks, train_policy
from lm_human_preference_details.data import QuerySampler, format_queries
from lm_human_preference_details.models import load_causal_lm
from lm_human_preference_details.sampling import sample_responses
from lm_human_preference_details.text import load_tokenizer, strip_pad
from lm_human_preference_details.tracking import plot_curves, read_metrics, refuse_to_overwrite

PRESET = "sentiment-smollm2"


def answer(lm, tokenizer, task, queries: torch.Tensor, seed: int) -> list[str]:
    pad_id = tokenizer.oai_pad_token_id
    torch.manual_seed(seed)
    contexts = format_queries(queries, tokenizer, task).to(next(lm.parameters()).device)
    responses, _ = sample_responses(
        lm, contexts, pad_id, task.response_length, task.temperature, vocab_size=len(tokenizer)
    )
    return [tokenizer.decode(strip_pad(r, pad_id)) for r in responses]


def mean_of(records: list[dict], name: str) -> float:
    values = [r[name] for r in records if name in r]
    return sum(values) / len(values)


@cli.main_with_user_errors
def main() -> None:
    argv = sys.argv[1:]
    if not cli.flag_given(argv, "--output-dir"):
        argv = [*argv, "--output-dir", "runs/quickstart"]
    args = cli.parse(
        train_policy.Args,
        train_policy.defaults_for_task,
        default_task=PRESET,
        argv=argv,
        description=__doc__,
        presets=tasks.PRESETS,
    )
    if not cli.flag_given(argv, "--mixed-precision"):
        args.mixed_precision, reason = precision.fastest_precision()
        print(f"precision: {reason}")
    if not args.resume:  # refused before the models load and sample below, not after
        refuse_to_overwrite(args.output_dir, resumable=True)
    accelerator = sharding.make_accelerator(args.mixed_precision)
    tokenizer = load_tokenizer(args.task.base_model)
    probe = next(QuerySampler(args.task, tokenizer, batch_size=4, seed=args.seed + 7))  # queries shown before and after
    before = answer(load_causal_lm(args.task.base_model), tokenizer, args.task, probe, seed=args.seed)

    policy, _ = train_policy.train(args, accelerator)
    if not accelerator.is_main_process:
        return
    after = answer(policy.lm, tokenizer, args.task, probe, seed=args.seed)

    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    png = os.path.join(args.output_dir, "learning_curves.png")
    plot_curves(
        metrics_path,
        {
            "reward model score": ["objective/scores"],
            f"{args.eval_labeler} score of the samples (the labeler itself)": ["objective/labeler_score"],
            "KL(policy || reference), nats": ["objective/kl"],
        },
        png,
        title=f"PPO on {args.task.base_model}, preset {args.preset}",
    )
    labeler = labelers.load_labeler(args.eval_labeler)
    queries = [tokenizer.decode(strip_pad(q, tokenizer.oai_pad_token_id)) for q in probe]
    print("\n=== the same queries, before and after PPO ===")
    for query, old, new, old_score, new_score in zip(
        queries, before, after, labeler(queries, before), labeler(queries, after)
    ):
        print(f"query:  {query!r}\n  before [{old_score:+.2f}] {old!r}\n  after  [{new_score:+.2f}] {new!r}")
    records = [r for r in read_metrics(metrics_path) if "objective/labeler_score" in r]
    k = max(1, len(records) // 5)
    print(
        f"\n{args.eval_labeler} score of the policy's samples: {mean_of(records[:k], 'objective/labeler_score'):+.3f} "
        f"(first {k} updates) -> {mean_of(records[-k:], 'objective/labeler_score'):+.3f} (last {k}); "
        f"KL at the end {mean_of(records[-k:], 'objective/kl'):.2f} nats"
    )
    print(f"learning curves: {png}")


if __name__ == "__main__":
    main()
