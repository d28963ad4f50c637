"""Save and resume a run: model, optimizer, every process's RNG states, and the loop's own state.

A checkpoint is a folder `<output_dir>/checkpoint/`, replaced atomically (written beside it, then
renamed), so a run killed while saving still has its previous checkpoint.
"""

import os
import random
import shutil

import numpy as np
import torch

from .cli import UserError


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()  # sampling and shuffles on a GPU draw from these
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save(output_dir: str, accelerator, model, optimizer, loop_state: dict) -> None:
    """All processes call this: each writes its RNG state, the main process the rest."""
    final = os.path.join(output_dir, "checkpoint")
    staging = final + ".saving"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    accelerator.wait_for_everyone()
    torch.save(rng_state(), os.path.join(staging, f"rng_{accelerator.process_index}.pt"))
    if accelerator.is_main_process:
        torch.save(
            {"model": accelerator.unwrap_model(model).state_dict(), "optimizer": optimizer.state_dict(), "loop": loop_state},
            os.path.join(staging, "state.pt"),
        )
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(final):
            os.rename(final, old)
        os.rename(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def load(output_dir: str, accelerator, model, optimizer) -> dict:
    """Restore what `save` wrote into `model` and `optimizer`; returns the loop state."""
    path = os.path.join(output_dir, "checkpoint")
    if not os.path.exists(os.path.join(path, "state.pt")):
        raise UserError(f"--resume: no checkpoint in {path}; run without --resume, or point --output-dir at the run to resume")
    state = torch.load(os.path.join(path, "state.pt"), map_location=accelerator.device, weights_only=False)
    if state["loop"]["world_size"] != accelerator.num_processes:  # every process checks, so none waits alone
        raise UserError(
            f"--resume: {path} was saved by {state['loop']['world_size']} processes; resume it with as many, "
            f"not {accelerator.num_processes} (each process's query stream and RNG state belong to its rank)"
        )
    rng_path = os.path.join(path, f"rng_{accelerator.process_index}.pt")
    accelerator.unwrap_model(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    set_rng_state(torch.load(rng_path, weights_only=False))
    return state["loop"]
