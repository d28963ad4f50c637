"""One weight push of the GRPO trainer sharded over the processes of `accelerate launch --config_file
configs/accelerate/fsdp2.yaml` (`ServerUpdates.push_if_due` with `--trainer-processes N`), to a running server.
`python benchmarks/weight_sync_on_ranks.py MODEL SERVER_URL OUTPUT_JSON GRPO_FLAGS...`: every weight of MODEL (a
name or folder) is moved by a seeded amount (the same on every process, so that the pushed weights differ from the
server's), the model is sharded and pushed as version 1; the first process writes into OUTPUT_JSON the extra peak
memory it needed during the push (`benchmarking.peak_rss`, large blocks unmapped when freed), the push's seconds,
and the digests of the whole weights gathered after it (`weights.tensor_digests`).

Run by benchmarks/weight_sync.py (its sharded push row) and tests/grpo/test_sharded.py.
"""

import json
import sys

import torch

from lm_human_preference_details import cli, sharding
from lm_human_preference_details.benchmarking import peak_rss, unmap_large_blocks
from lm_human_preference_details.grpo import trainer
from lm_human_preference_details.grpo.config import PRESETS, GRPOArgs, get_preset
from lm_human_preference_details.grpo.weights import tensor_digests
from lm_human_preference_details.models import load_causal_lm
from lm_human_preference_details.optim import make_optimizer


@cli.main_with_user_errors  # the process group ends before the interpreter does
def main() -> None:
    model_name, server_url, output_json = sys.argv[1:4]
    args = cli.parse(GRPOArgs, get_preset, "tiny", argv=sys.argv[4:], presets=PRESETS)
    accelerator = trainer.trainer_accelerator(args)
    model = load_causal_lm(model_name)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter), alpha=0.01)
    optimizer = make_optimizer(args.optim.optimizer, model.parameters(), lr=args.optim.lr, eps=args.optim.adam_eps)
    model, optimizer = sharding.prepare(accelerator, model, optimizer, 1)
    servers = trainer.ServerUpdates(args, [server_url], sends=accelerator.is_main_process)
    unmap_large_blocks()  # the resident set counts live memory, not blocks kept after a free
    with peak_rss() as rss:
        push_s = servers.push_if_due(model, 1, accelerator)
    servers.wait()
    whole = trainer.whole_parameters(model, accelerator)  # every process joins the gather
    if accelerator.is_main_process:
        with open(output_json, "w") as f:
            json.dump({"extra_bytes": rss.extra, "push_s": push_s, "digests": tensor_digests(whole)}, f)


if __name__ == "__main__":
    main()
    cli.exit_finished_rank()
