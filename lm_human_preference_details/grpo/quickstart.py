"""Stage 3 in one command: pipelined GRPO teaches SmolLM2-135M-Instruct to answer arithmetic in `\\boxed{}`, offline.

    1. held out:  the problems of the task's family the training stream never shows; success before training
    2. train:     pipelined GRPO (`grpo.launch`: servers, actor, trainer) on the `arith-chat` preset
    3. held out:  the same problems, answered by the trained model (the run's last checkpoint)
    4. results:   a PNG (success on the training stream and on the held-out problems, reward, lag, entropy),
                  held_out.jsonl and a few answers before and after

`python -m lm_human_preference_details.grpo.quickstart` (`grpo.launch` flags can follow, e.g. `--steps 100`; `check`
refuses those it cannot honour).
Prompted as the model was trained to be prompted: the question as a user message through its chat template,
asking for the answer in `\\boxed{}`, after one worked exchange on a question outside the task (`chat_example`) that
shows what the box is for. At the start the model mostly answers in prose or boxes a wrong number; GRPO teaches it
the format and the arithmetic (without the example a right boxed answer is so rare that the first groups with a
success come by luck). The held-out success is sampled at the training temperature, one attempt per problem.
It prints the servers' engine and the trainer's precision it takes, and why (`engine_choice`,
`precision.fastest_precision`: bf16 only where its matmuls are faster).
"""

import json
import logging
import os
import sys

import torch

from lm_human_preference_details import cli, precision
from lm_human_preference_details.grpo import launch
from lm_human_preference_details.grpo.config import PRESETS, GRPOArgs, get_preset
from lm_human_preference_details.grpo.rewards import Problem, held_out_problems, math_reward
from lm_human_preference_details.progress import progress_bar
from lm_human_preference_details.tracking import plot_curves, read_metrics, refuse_to_overwrite

PRESET = "arith-chat"
HELD_OUT = 100
"""held-out problems evaluated before and after (at most)"""


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
    if args.save_interval == 0:
        raise cli.UserError("--save-interval 0: the held-out answers after training come from the last checkpoint")
    if args.sampling.ignore_eos:
        raise cli.UserError("--ignore-eos: the held-out answers stop at EOS, as training's must to compare them")


def answers(model_path: str, args: GRPOArgs, problems: list[Problem], seed: int) -> list[str]:
    """One sampled completion per problem, as the servers sample them (the chat template with `--chat`, the run's
    temperature and token limit, stopped at EOS)."""
    from transformers import AutoModelForCausalLM

    from lm_human_preference_details.assets import resolve_model_path
    from lm_human_preference_details.text import load_tokenizer

    path = resolve_model_path(model_path)  # built on first use (tiny-math trains then: hence no torch.no_grad here)
    tokenizer = load_tokenizer(path)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    torch.manual_seed(seed)
    completions, bar = [], progress_bar(len(problems), "held-out answers", "problem")
    for problem in problems:
        if args.task.chat:
            ids = tokenizer.apply_chat_template(
                args.task.chat_messages(problem.prompt), add_generation_prompt=True, return_dict=False
            )
        else:
            ids = tokenizer(problem.prompt, add_special_tokens=False)["input_ids"]  # as the servers tokenize
        prompt = torch.tensor([ids], device=device)
        out = model.generate(  # without gradients of its own
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=args.sampling.max_tokens,
            do_sample=True,
            temperature=args.sampling.temperature,
            top_k=0,
            top_p=1.0,
            eos_token_id=tokenizer.eos_token_id,  # the servers' stop token
            pad_token_id=tokenizer.eos_token_id,
        )
        completions.append(tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True))
        bar.update()
    bar.close()
    return completions


def success(args: GRPOArgs, problems: list[Problem], completions: list[str]) -> list[float]:
    """Each completion's reward, as the actor scores it (the answer prefix put back in front)."""
    return [
        math_reward(args.task.answer_prefix + c, p.answer, args.task.integer_answers)
        for p, c in zip(problems, completions)
    ]


def plot(args: GRPOArgs, before: float, after: float, last: int, png: str) -> None:
    """The run's curves, with the held-out success before (step 0) and after (step `last`) on the success panel."""
    plot_curves(
        os.path.join(args.output_dir, "metrics.jsonl"),
        {
            "success rate": ["success/rate"],
            "reward": ["reward/mean"],
            "lag (optimizer steps)": ["lag/mean"],
            "entropy": ["entropy"],
        },
        png,
        title=f"pipelined GRPO on {args.task.model}, preset {args.preset}",
        points={"success rate": {"held out (before, after)": [(0, before), (last, after)]}},
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
    problems = held_out_problems(args)[:HELD_OUT]
    print(f"servers: {engine_choice(args)}")
    if cli.flag_given(argv, "--mixed-precision"):
        print(f"trainer: {args.mixed_precision}, as --mixed-precision says")
    else:
        args.mixed_precision, reason = precision.fastest_precision()
        print(f"trainer: {reason}")
    if args.mixed_precision == "bf16" and args.serving.server_dtype == "auto":
        args.serving.server_dtype = "bfloat16"  # the servers' matmuls in the precision the trainer found fastest
    print(f"held out: {len(problems)} problems the training stream never shows; answering them before training")
    before = answers(args.task.model, args, problems, seed=args.seed)
    scores_before = success(args, problems, before)
    rate_before = sum(scores_before) / len(problems)
    print(f"held-out success before training: {rate_before:.3f}")

    launch.launch(args)

    from lm_human_preference_details.grpo.checkpoints import checkpoint_model

    after = answers(checkpoint_model(args.output_dir), args, problems, seed=args.seed)
    scores_after = success(args, problems, after)
    rate_after = sum(scores_after) / len(problems)
    with open(os.path.join(args.output_dir, "held_out.jsonl"), "w") as f:
        for problem, old, new, old_score, new_score in zip(problems, before, after, scores_before, scores_after):
            record = {"prompt": problem.prompt, "answer": problem.answer, "before": old, "after": new}
            f.write(json.dumps(record | {"reward_before": old_score, "reward_after": new_score}) + "\n")
    records = read_metrics(os.path.join(args.output_dir, "metrics.jsonl"))
    png = os.path.join(args.output_dir, "learning_curves.png")
    plot(args, rate_before, rate_after, records[-1]["step"], png)
    print("\n=== held-out problems, before and after training ===")
    for problem, old, new in list(zip(problems, before, after))[:5]:
        print(f"{problem.prompt!r} (answer {problem.answer})\n  before: {old!r}\n  after:  {new!r}")
    stream = [r["success/rate"] for r in records]
    quarter = max(1, len(stream) // 4)
    print(
        f"\nsuccess on the training stream: {sum(stream[:quarter]) / quarter:.3f} (first {quarter} steps) -> "
        f"{sum(stream[-quarter:]) / quarter:.3f} (last {quarter}); held out: {rate_before:.3f} -> {rate_after:.3f}"
    )
    print(f"learning curves: {png}")


if __name__ == "__main__":
    main()
