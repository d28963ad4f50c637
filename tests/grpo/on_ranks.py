"""GRPO optimizer steps on the groups of a JSON file, through the trainer's own functions (`grpo/trainer.py`), in
float64: in one process, or in each process of `accelerate launch --config_file configs/accelerate/fsdp2.yaml` with
`--trainer-processes N`. `python tests/grpo/on_ranks.py STEPS_JSON GRPO_FLAGS...`: trains from the checkpoint
with `--resume` (else from the start) up to `--steps`, then checkpoints. Into `--output-dir`: the whole weights after
each step (weights-N.safetensors), each step's stats (stats-N.json), and what each process holds of the policy
(rank-R.json).

Used by tests/grpo/test_sharded.py; not a test itself.
"""

import dataclasses
import json
import os
import sys

import torch
from safetensors.torch import save_file

from lm_human_preference_details import cli
from lm_human_preference_details.grpo import checkpoints, trainer
from lm_human_preference_details.grpo.config import PRESETS, GRPOArgs, get_preset
from lm_human_preference_details.grpo.records import Group
from lm_human_preference_details.models import load_causal_lm


@cli.main_with_user_errors  # the process group ends before the interpreter does
def main() -> None:
    with open(sys.argv[1]) as f:
        steps = json.load(f)  # per step: {"token_budget": ..., "groups": [each group's JSON line, ...]}
    args = cli.parse(GRPOArgs, get_preset, "tiny", argv=sys.argv[2:], presets=PRESETS)
    # float64: the sharded and the single-process sums then agree to far below the tolerance, and so do the signs
    # of Adam's first updates, which float32 rounding can flip where a gradient is nearly 0
    trainer.load_causal_lm = lambda name: load_causal_lm(name).double()
    accelerator = trainer.trainer_accelerator(args)
    learner = trainer.load_learner(args, accelerator)
    main_process = accelerator is None or accelerator.is_main_process
    os.makedirs(args.output_dir, exist_ok=True)
    for version in range(learner.version, args.optim.steps):
        step = steps[version]
        groups = [Group.from_json(line) for line in step["groups"]]
        rewards = torch.tensor([s.reward for s in trainer.flatten_groups(groups)], dtype=torch.float64)
        step_args = dataclasses.replace(args, optim=dataclasses.replace(args.optim, token_budget=step["token_budget"]))
        stats, grad_norm = trainer.optimizer_step(learner, groups, rewards, step_args, version, accelerator)
        weights = dict(trainer.whole_parameters(learner.model, accelerator))  # every process joins the gather
        if main_process:
            save_file(weights, os.path.join(args.output_dir, f"weights-{version + 1}.safetensors"))
            with open(os.path.join(args.output_dir, f"stats-{version + 1}.json"), "w") as f:
                json.dump({**stats, "grad_norm": grad_norm}, f)
    checkpoints.save_checkpoint(
        args, learner.model, learner.tokenizer, learner.optimizer, args.optim.steps, 0, accelerator=accelerator
    )
    rank = accelerator.process_index if accelerator else 0
    local = [p.to_local() if hasattr(p, "to_local") else p for p in learner.model.parameters()]
    with open(os.path.join(args.output_dir, f"rank-{rank}.json"), "w") as f:
        json.dump(
            {
                "local_elements": sum(p.numel() for p in local),
                "elements": sum(p.numel() for p in learner.model.parameters()),
                "dtensors": sum(hasattr(p, "to_local") for p in learner.model.parameters()),
            },
            f,
        )


if __name__ == "__main__":
    main()
    cli.exit_finished_rank()
