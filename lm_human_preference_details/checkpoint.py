"""Save and resume a run: model, optimizer, every process's RNG states, and the loop's own state.

A checkpoint is a folder `<output_dir>/checkpoint/` (`folder`), replaced atomically (written beside it by
`staged`, then renamed into place by `swap_in`), so a run killed while saving still has its previous
checkpoint. It records the run's settings, and a resume with other settings (a batch size, a learning rate,
the reward model) is refused: the loop's state (query position, LR schedule, optimizer) only means something
under the old ones. `save` / `saved` / `load` are the PPO stages' checkpoint; the GRPO trainer writes its own
files (a model folder the servers load) through the same `staged`, `state_file` and `check_same_settings`.

Only the latest checkpoint is kept (a save deletes the one it replaces): a kill or power cut mid-save cannot damage
it, so what does is outside the run (a file deleted, cut short by a copy, a failing disk), which a second copy on
the same disk would seldom escape, at twice the disk (a SmolLM2-135M checkpoint is 1.6 GB). A damaged one stops
the run with one line naming the file (`load_or_explain`).
"""

import contextlib
import dataclasses
import glob
import json
import os
import pickle
import random
import shutil
from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np
import torch
from accelerate.utils import broadcast_object_list
from safetensors import SafetensorError, safe_open

from . import sharding
from .cli import UserError
from .tracking import earlier_logs

T = TypeVar("T")

UNREADABLE = (OSError, EOFError, ValueError, KeyError, RuntimeError, pickle.UnpicklingError, SafetensorError)
"""what torch.load, safetensors and json raise for a file cut short, zeroed or of another format (a zeroed torch
file is a KeyError; JSON and UTF-8 errors are ValueErrors)"""


def load_or_explain(path: str, load: Callable[[str], T], fix: str) -> T:
    """`load(path)`, or a UserError naming the file, what is wrong with it (missing, or the loader's own words for
    a file it cannot read) and `fix`, the user's way out."""
    if not os.path.isfile(path):
        raise UserError(f"{path} is missing; {fix}")
    try:
        return load(path)
    except UNREADABLE as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{path} cannot be read, cut short or corrupted? ({reason}); {fix}") from e


def check_weights(model_folder: str, fix: str) -> None:
    """UserError (`load_or_explain`) when `model_folder` has no `*.safetensors` file or one that is cut short or
    corrupted: safetensors checks a file's header against its size, so this reads no weights."""
    files = sorted(glob.glob(os.path.join(model_folder, "*.safetensors")))
    if not files:
        raise UserError(f"{model_folder} has no weights (no *.safetensors file); {fix}")
    for path in files:
        load_or_explain(path, _tensor_names, fix)


def _tensor_names(path: str) -> list[str]:
    """The names in a safetensors file's header (which safetensors checks against the file's size)."""
    with safe_open(path, "pt") as f:
        return list(f.keys())


def damaged(final: str) -> str:
    """The way out of a damaged checkpoint `final`, for `load_or_explain`."""
    return (
        f"the checkpoint {final} is damaged: put back a copy of it, or start a new run in another --output-dir "
        "(no earlier checkpoint is kept)"
    )


def read_json(path: str):
    """A JSON file's value (a checkpoint's state.json)."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def rng_state(device: torch.device) -> dict:
    """The random states a process draws from: torch's, numpy's, Python's, and on a GPU its own GPU's (sampling and
    shuffles there draw from it; only its own: another process's GPUs, or the number visible, may differ on resume)."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:  # a run saved on the CPU has none: its GPU draws start afresh
        torch.cuda.set_rng_state(state["cuda"], device)
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def folder(output_dir: str) -> str:
    """The run's checkpoint folder."""
    return os.path.join(output_dir, "checkpoint")


@contextlib.contextmanager
def staged(final: str, accelerator=None) -> Iterator[str]:
    """A fresh folder beside `final` to write the new checkpoint into; when the block ends it is `swap_in`ed as
    `final` (a block that raises leaves `final` as it was). Under accelerate every process enters the block and
    may write into the folder: the main process makes it and swaps it in, with the others waiting at each step."""
    main = accelerator is None or accelerator.is_main_process
    wait_for_everyone = accelerator.wait_for_everyone if accelerator is not None else lambda: None
    staging = final + ".saving"
    if main:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    wait_for_everyone()
    yield staging
    wait_for_everyone()
    if main:
        swap_in(staging, final)
    wait_for_everyone()


def state_file(final: str, name: str) -> str | None:
    """The path of the checkpoint `final`'s file `name`, which a complete checkpoint has (`staged` writes it
    whole or not at all: if it is missing, the checkpoint is damaged); None when there is no checkpoint. A save
    killed between `swap_in`'s renames is put back first (`recover`)."""
    recover(final)
    return os.path.join(final, name) if os.path.isdir(final) else None


def swap_in(staging: str, final: str) -> None:
    """Make the complete folder `staging` the checkpoint `final`, replacing the previous one. A crash between the
    two renames leaves the previous one as `final.old`, which `recover` puts back. `staging`'s files reach the
    disk before the renames, and the renames before the old one is deleted: after a power cut the file
    system may keep a rename but not the data written before it, which would leave empty files behind
    a complete-looking checkpoint."""
    old = final + ".old"
    shutil.rmtree(old, ignore_errors=True)
    for folder, _, files in os.walk(staging):
        for name in files:
            _fsync(os.path.join(folder, name))
        _fsync(folder)
    if os.path.exists(final):
        os.rename(final, old)
    os.rename(staging, final)
    _fsync(os.path.dirname(os.path.abspath(final)))
    shutil.rmtree(old, ignore_errors=True)


def _fsync(path: str) -> None:
    """Flush a file's data, or a folder's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def recover(final: str) -> None:
    """A save killed between `swap_in`'s two renames left only `final.old`: put it back."""
    if not os.path.exists(final) and os.path.exists(final + ".old"):
        os.rename(final + ".old", final)


def settings(args) -> dict:
    """A run's arguments as flat `section.field` names -> values (what a checkpoint records)."""

    def flatten(value, prefix: str) -> dict:
        if isinstance(value, dict):
            return {k: v for key, item in value.items() for k, v in flatten(item, f"{prefix}{key}.").items()}
        return {prefix[:-1]: value}

    return flatten(dataclasses.asdict(args), "")


def check_same_settings(saved: dict | None, current: dict, may_differ: set[str], where: str) -> None:
    """UserError naming every setting (`settings`) that differs from the checkpoint's, but those in `may_differ`
    and those only one side has (a field added or removed since; a checkpoint from before settings were
    recorded: None, not checked)."""
    if saved is None:
        return
    changed = sorted(k for k in saved.keys() & current.keys() if k not in may_differ and saved[k] != current[k])
    if changed:
        differences = "; ".join(f"{k}: {saved.get(k)!r} then, {current.get(k)!r} now" for k in changed)
        raise UserError(
            f"--resume: {where} was saved with other settings ({differences}); resume with the same ones "
            f"(these may change: {', '.join(sorted(may_differ))}), or start a new run in another --output-dir"
        )


def save(output_dir: str, accelerator, model, optimizer, loop_state: dict) -> None:
    """All processes call this: each writes its RNG state (and under DeepSpeed its ZeRO partition), the main process
    the rest, with the model's and the optimizer's whole tensors, which under a sharding engine every process helps
    gather (`sharding.save_training_state`)."""
    with staged(folder(output_dir), accelerator) as staging:
        training_state = sharding.save_training_state(accelerator, model, optimizer, staging)
        torch.save(rng_state(accelerator.device), os.path.join(staging, f"rng_{accelerator.process_index}.pt"))
        if accelerator.is_main_process:
            state = {**training_state, "engine": sharding.engine_of(accelerator), "loop": loop_state}
            torch.save(state, os.path.join(staging, "state.pt"))


def saved(output_dir: str, accelerator) -> bool:
    """Whether `output_dir` has a checkpoint to resume, whole or damaged (the same answer on every process)."""
    found = [False]
    if accelerator.is_main_process:
        found[0] = state_file(folder(output_dir), "state.pt") is not None
    broadcast_object_list(found)
    return found[0]


def resolve_resume(resume: bool | str, found: bool, output_dir: str) -> bool:
    """`--resume` (`cli.Resume`) as yes or no: `auto` is yes when the run in `output_dir` saved something to resume
    (`found`: a checkpoint, or stage 2's reward model), no when the folder holds no logs, and refused when it holds
    logs without a checkpoint (a run killed before its first save: a new run would overwrite them)."""
    if resume != "auto":
        return bool(resume)
    if found:
        return True
    if logs := earlier_logs(output_dir):
        raise UserError(
            f"--resume auto: {output_dir} holds an earlier run's logs ({', '.join(logs)}) but no checkpoint to "
            "continue them from (killed before its first save?); move those files away to start over, or start "
            "this run in another --output-dir"
        )
    return False


def load(output_dir: str, accelerator, model, optimizer) -> dict:
    """Restore what `save` wrote into `model` and `optimizer`; returns the loop state."""
    path = folder(output_dir)
    if not saved(output_dir, accelerator):
        raise UserError(
            f"--resume: no checkpoint in {path}; run without --resume, or point --output-dir at the run to resume"
        )
    # onto the CPU, whatever the device: a CPU process's device under accelerate is `cpu:<rank>`, a location
    # torch.load cannot restore; load_state_dict copies each tensor to its parameter's device
    state = load_or_explain(os.path.join(path, "state.pt"), load_onto_cpu, damaged(path))
    if state["loop"]["world_size"] != accelerator.num_processes:  # every process checks, so none waits alone
        raise UserError(
            f"--resume: {path} was saved by {state['loop']['world_size']} processes; resume it with as many, "
            f"not {accelerator.num_processes} (each process's query stream and RNG state belong to its rank)"
        )
    engine = sharding.engine_of(accelerator)
    saved_under = state.get("engine", engine if engine in ("single", "ddp") else "ddp")  # (older: always DDP's)
    if saved_under != engine:  # each engine's optimizer state has its own form: keyed by names, or in partitions
        raise UserError(
            f"--resume: {path} was saved under {sharding.ENGINE_NAMES[saved_under]}; resume it under the same engine "
            f"(the accelerate config it was launched with), not {sharding.ENGINE_NAMES[engine]}"
        )
    rng_path = os.path.join(path, f"rng_{accelerator.process_index}.pt")
    sharding.load_training_state(accelerator, model, optimizer, path, state)
    set_rng_state(load_or_explain(rng_path, load_onto_cpu, damaged(path)), accelerator.device)
    return state["loop"]


def load_onto_cpu(path: str):
    """A file `torch.save` wrote (objects of the run's own making: numpy's and Python's RNG states too)."""
    return torch.load(path, map_location="cpu", weights_only=False)
