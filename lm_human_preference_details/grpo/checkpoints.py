"""The GRPO trainer's checkpoint: a model folder the servers load, the optimizer, the version and the stream position.

The launcher reads it to resume (`resumed_state`, `model_folder`) without importing the trainer; the generic
mechanics (staging, damage, settings) are `lm_human_preference_details.checkpoint`'s.
"""

import dataclasses
import json
import os

import torch

from lm_human_preference_details import checkpoint, cli, sharding, tracking
from lm_human_preference_details.grpo.config import EvalArgs, GRPOArgs
from lm_human_preference_details.grpo.records import Evaluation
from lm_human_preference_details.grpo.streams import read_all
from lm_human_preference_details.grpo.world import PlacementArgs

MAY_CHANGE_ON_RESUME = {
    "resume",
    "save_interval",
    "sample_interval",
    "output_dir",
    "wandb_mode",
    "wandb_project",
    "run_name",
    "steps",
    "servers",
    "num_servers",
    "engine",  # which servers sample is not what is trained: both serve the checkpoint's weights
    "threads",
    "request_timeout_s",
    "max_in_flight",
    "server_batch_size",
    "trainer_host",
    "weight_backend",
    "update_bucket_mb",
    "weight_staging",
    *(setting.name for setting in dataclasses.fields(PlacementArgs)),
    *(setting.name for setting in dataclasses.fields(EvalArgs)),  # what is measured, not what is trained
}
"""what a resumed run may set otherwise (how long it runs, where and how its processes run); the rest must be the
checkpoint's: the stream position counts groups of its batch size, the optimizer state is of its settings"""


def save_checkpoint(
    args: GRPOArgs, model, tokenizer, optimizer, version: int, stream_position: int, accelerator=None
) -> None:
    """Model and tokenizer (a folder the servers can load), optimizer, version, stream position and the run's
    settings; written beside and swapped into place (`checkpoint.staged`), so a crash mid-save keeps the previous
    checkpoint. Under several trainer processes every one calls it (the whole tensors are gathered) and the main one
    writes."""
    model_state = sharding.full_state_dict(accelerator, model) if accelerator is not None else None
    optimizer_states = sharding.optimizer_state_dict(accelerator, model, optimizer)
    if accelerator is not None and not accelerator.is_main_process:
        return
    with checkpoint.staged(checkpoint.folder(args.output_dir)) as staging:
        model.save_pretrained(os.path.join(staging, "model"), state_dict=model_state)
        tokenizer.save_pretrained(os.path.join(staging, "model"))
        torch.save(optimizer_states, os.path.join(staging, "optimizer.pt"))
        with open(os.path.join(staging, "state.json"), "w") as f:
            state = {"version": version, "stream_position": stream_position, "settings": args.flag_values()}
            json.dump(state, f)


def checkpoint_state(args: GRPOArgs) -> dict:
    """The checkpoint's version and stream position; a UserError if there is none, or if it was saved with other
    settings."""
    folder = checkpoint.folder(args.output_dir)
    path = checkpoint.state_file(folder, "state.json")
    if path is None:
        raise cli.UserError(f"--resume: no checkpoint in {args.output_dir} (none saved yet? see --save-interval)")
    state = checkpoint.load_or_explain(path, checkpoint.read_json, checkpoint.damaged(folder))
    # the servers load the model folder: a damaged one is refused here, before any of them starts
    checkpoint.check_weights(checkpoint_model(args.output_dir), checkpoint.damaged(folder))
    checkpoint.check_same_settings(state.get("settings"), args.flag_values(), MAY_CHANGE_ON_RESUME, folder)
    return state


def evaluations_logged(output_dir: str, version: int) -> int:
    """How many of the evaluation stream's records a run resumed at `version` has logged: those its metrics.jsonl
    holds at steps up to the checkpoint's (a resumed tracker sets the later lines aside). Its trainer reads on from
    there."""
    path = os.path.join(output_dir, "metrics.jsonl")
    rows = tracking.read_metrics(path) if os.path.exists(path) else []
    return sum("eval/step" in row and row["step"] <= version for row in rows)


def evaluations_kept(args: GRPOArgs, version: int) -> int:
    """How many of the evaluation stream's records a run resumed at `version` keeps: those of earlier weights,
    logged or not (one that came after the checkpoint is logged by the resumed trainer); those of its own weights
    and later the resumed actor evaluates again."""
    return sum(evaluation.step < version for evaluation in read_all(args.eval_stream_url(), Evaluation.from_json))


def checkpoint_model(output_dir: str) -> str:
    """The checkpoint's model folder: what a resumed run's servers and trainer load."""
    return os.path.join(checkpoint.folder(output_dir), "model")


def checkpoint_optimizer_state(output_dir: str) -> dict:
    """The checkpoint's optimizer state, on the CPU (a checkpoint saved on a GPU resumes without one; loading it
    moves each state to its parameter's device); a UserError naming the file if it is damaged."""
    folder = checkpoint.folder(output_dir)
    path = os.path.join(folder, "optimizer.pt")
    return checkpoint.load_or_explain(path, checkpoint.load_onto_cpu, checkpoint.damaged(folder))
