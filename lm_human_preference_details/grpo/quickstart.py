"""Stage 3 in one command: pipelined GRPO teaches SmolLM2-135M-Instruct to answer arithmetic in `\\boxed{}`, offline.

    1. train:     pipelined GRPO (`grpo.launch`: servers, actor, trainer) on the `arith-chat` preset, which evaluates
                  on the problems of the task's family that the training stream never shows (`--eval-problems
                  held-out`) at steps 0, 20, 40 and 60, on the servers while the trainer trains (`--eval-every`)
    2. results:   a PNG (success on the training stream and held-out pass@1, reward, lag, entropy), held_out.jsonl
                  (each held-out problem's first answer at the first and the last evaluation) and a few of them

`python -m lm_human_preference_details.grpo.quickstart` (`grpo.launch` flags can follow, e.g. `--steps 100`; `check`
refuses those it cannot honour).
Prompted as the model was trained to be prompted: the question as a user message through its chat template,
asking for the answer in `\\boxed{}`, after one worked exchange on a question outside the task (`chat_example`) that
shows what the box is for. At the start the model mostly answers in prose or boxes a wrong number; GRPO teaches it
the format and the arithmetic (without the example a right boxed answer is so rare that the first groups with a
success come by luck). The held-out problems are sampled at the training temperature, one attempt each.
It prints the servers' engine and the trainer's precision it takes, and why (`engine_choice`,
`precision.fastest_precision`: bf16 only where its matmuls are faster).
"""

import json
import logging
import os
import sys

from lm_human_preference_details import cli, precision
from lm_human_preference_details.grpo import launch
from lm_human_preference_details.grpo.config import PRESETS, GRPOArgs, get_preset
from lm_human_preference_details.grpo.records import Evaluation
from lm_human_preference_details.grpo.rewards import eval_problems
from lm_human_preference_details.grpo.streams import read_all
from lm_human_preference_details.tracking import plot_curves, read_metrics, refuse_to_overwrite

PRESET = "arith-chat"


def engine_choice(args: GRPOArgs) -> str:
    """The servers' engine `--engine` resolves to, and why, in a line."""
    if args.serving.servers:
        return f"the servers at {', '.join(args.serving.servers)}, as --servers says"
    if args.serving.server_engine() == "vllm":
        return "vLLM (`--engine home` for this package's decoder)"
    if args.serving.engine == "home":
        return "the home engine (grpo/serving/server.py), as --engine says"
    return (
        "the home engine (grpo/serving/server.py): vLLM is taken where a GPU is visible and `vllm_env --gpu` has made "
        "its environment; on a CPU the home engine is the faster (it starts sooner and pauses less per weight update: "
        "benchmarks/README.md); `--engine vllm` forces it"
    )


def check(args: GRPOArgs) -> None:
    """What the quickstart cannot do with the flags given, refused before any model loads."""
    args.check()
    args.processes.check_weight_backend()
    if args.resume:
        raise cli.UserError("--resume: the quickstart starts over; resume its training with grpo.launch --resume")
    if not args.evaluation.eval_every:
        raise cli.UserError(
            "--eval-every 0: the quickstart's held-out success comes from the run's evaluations; "
            "pass --eval-every N (steps)"
        )


def write_held_out(path: str, first: Evaluation, last: Evaluation) -> None:
    """held_out.jsonl: each problem's first answer and its reward at the `first` and `last` evaluation."""
    with open(path, "w") as f:
        for before, after in zip(first.problems, last.problems):
            record = {
                "prompt": before.prompt,
                "answer": before.answer,
                "before": before.completions[0],
                "after": after.completions[0],
                "reward_before": before.rewards[0],
                "reward_after": after.rewards[0],
            }
            f.write(json.dumps(record) + "\n")


def plot(args: GRPOArgs, png: str) -> None:
    """The run's curves, held-out pass@1 (at the steps evaluated) on the success panel."""
    plot_curves(
        os.path.join(args.output_dir, "metrics.jsonl"),
        {
            "success rate": ["success/rate", "eval/pass@1"],
            "reward": ["reward/mean"],
            "lag (optimizer steps)": ["lag/mean"],
            "entropy": ["entropy"],
        },
        png,
        title=f"pipelined GRPO on {args.task.model}, preset {args.preset}",
    )


@cli.main_with_user_errors
def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launch %(message)s")  # the launcher's progress
    argv = sys.argv[1:]
    if not cli.flag_given(argv, "--output-dir"):
        argv = [*argv, "--output-dir", "runs/grpo-quickstart"]
    args = cli.parse(GRPOArgs, get_preset, PRESET, argv=argv, description=__doc__.split("\n\n")[0], presets=PRESETS)
    check(args)
    refuse_to_overwrite(args.output_dir, resumable=False)
    problems = eval_problems(args)
    print(f"servers: {engine_choice(args)}")
    if cli.flag_given(argv, "--mixed-precision"):
        print(f"trainer: {args.mixed_precision}, as --mixed-precision says")
    else:
        args.mixed_precision, reason = precision.fastest_precision()
        print(f"trainer: {reason}")
    if args.mixed_precision == "bf16" and args.serving.server_dtype == "auto":
        args.serving.server_dtype = "bfloat16"  # the servers' matmuls in the precision the trainer found fastest
    print(
        f"held out: {len(problems)} problems the training stream never shows, evaluated on the servers every "
        f"{args.evaluation.eval_every} steps"
    )

    launch.launch(args)

    first, *_, last = read_all(args.eval_stream_url(), Evaluation.from_json)  # as the actor wrote them
    write_held_out(os.path.join(args.output_dir, "held_out.jsonl"), first, last)
    records = read_metrics(os.path.join(args.output_dir, "metrics.jsonl"))
    png = os.path.join(args.output_dir, "learning_curves.png")
    plot(args, png)
    print(f"\n=== held-out problems at step {first.step} and step {last.step} ===")
    for before, after in list(zip(first.problems, last.problems))[:5]:
        print(f"{before.prompt!r} (answer {before.answer})")
        print(f"  step {first.step}: {before.completions[0]!r}\n  step {last.step}: {after.completions[0]!r}")
    stream = [r["success/rate"] for r in records if "success/rate" in r]
    held_out = [r["eval/pass@1"] for r in records if "eval/pass@1" in r]
    quarter = max(1, len(stream) // 4)
    print(
        f"\nsuccess on the training stream: {sum(stream[:quarter]) / quarter:.3f} (first {quarter} steps) -> "
        f"{sum(stream[-quarter:]) / quarter:.3f} (last {quarter}); held-out pass@1: "
        + " -> ".join(f"{rate:.3f}" for rate in held_out)
    )
    print(f"learning curves: {png}")


if __name__ == "__main__":
    main()
