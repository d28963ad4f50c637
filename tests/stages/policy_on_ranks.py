"""Run stage 2 under `accelerate launch`; each process writes its final weights and KL coefficient.

Used by tests/stages/test_train_policy.py to check that processes stay in sync; not a test itself.
"""

import sys

import torch
from safetensors.torch import save_file

from lm_human_preference_details import cli, sharding, train_policy


@cli.main_with_user_errors  # as the stage's own entry point: the process group ends before the interpreter does
def main() -> None:
    out = sys.argv[1]
    args = cli.parse(train_policy.Args, train_policy.defaults_for_task, default_task="tiny", argv=sys.argv[2:])
    accelerator = sharding.make_accelerator()
    policy, kl_ctl = train_policy.train(args, accelerator)
    state = {k: v.detach().clone() for k, v in policy.state_dict().items()}  # clone: tied weights share memory
    state["kl_coef"] = torch.tensor(kl_ctl.value, dtype=torch.float64)
    save_file(state, f"{out}/rank{accelerator.process_index}.safetensors")


if __name__ == "__main__":
    main()
    cli.exit_finished_rank()
