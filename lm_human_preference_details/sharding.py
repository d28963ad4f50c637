"""Which engine trains a stage across processes, and the few places where sharding changes what a stage does.

The engine is the user's choice in their accelerate config (`accelerate launch --config_file
configs/accelerate/fsdp2.yaml ...`): DDP (every process holds the whole model), FSDP2 (torch's `fully_shard`:
parameters, gradients and optimizer state sharded over the processes), DeepSpeed ZeRO-2 (gradients and optimizer
state sharded) or ZeRO-3 (parameters too). On a GPU accelerate sets the engine up itself; without one it falls
back to DDP in silence, so `make_accelerator` switches it to the engine the config names (the tests' two CPU
processes over gloo run the same code as a GPU cluster) and refuses a config it cannot honour.

What a stage does differently under a sharding engine, each the way the engine's documentation does it:
- `prepare`: the trained model and its optimizer (accelerate's own `prepare`);
- `prepare_frozen`: the reference policy and reward model, sharded (FSDP2's `fully_shard` through accelerate, a
  ZeRO-3 inference engine) or replicated, by the stage's choice;
- `gathered`: the parameters whole for a rollout, which calls the LM token by token outside the model's own
  forward (FSDP2's forward hooks registered on the sampling method, once per rollout for ZeRO-3);
- `full_state_dict` / `load_full_state_dict` and the optimizer's: the checkpoint holds whole tensors, as under
  DDP, so a checkpoint is the same file whatever the engine that wrote it (accelerate's FULL_STATE_DICT), and the
  final model is an ordinary transformers folder;
- `local_state_bytes`: what this process holds of parameters and optimizer state, to show the sharding.
"""

import contextlib
import os
from collections.abc import Iterator
from typing import Literal

import torch

from .cli import UserError

Engine = Literal["single", "ddp", "fsdp2", "zero2", "zero3"]

ENGINE_NAMES: dict[str, str] = {
    "single": "one process",
    "ddp": "DDP (every process holds the whole model)",
    "fsdp2": "FSDP2 (parameters, gradients and optimizer state sharded)",
    "zero2": "DeepSpeed ZeRO-2 (gradients and optimizer state sharded)",
    "zero3": "DeepSpeed ZeRO-3 (parameters, gradients and optimizer state sharded)",
}


def requested_engine() -> Engine | None:
    """The sharding engine the accelerate config asks for (`accelerate launch` passes it in the environment), or
    None for none. A config this library cannot honour is a UserError naming the setting."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        if os.environ.get("FSDP_VERSION", "1") != "2":
            raise UserError(
                "the accelerate config asks for FSDP version 1; this library trains with FSDP2: set `fsdp_version: 2` "
                "in its fsdp_config (configs/accelerate/fsdp2.yaml)"
            )
        if os.environ.get("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT") != "FULL_STATE_DICT":
            raise UserError(
                f"the accelerate config's fsdp_state_dict_type is {os.environ['FSDP_STATE_DICT_TYPE']}; checkpoints "
                "here hold whole tensors (a checkpoint resumes under any engine): set `fsdp_state_dict_type: "
                "FULL_STATE_DICT` (configs/accelerate/fsdp2.yaml)"
            )
        if os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() == "true":
            raise UserError(
                "the accelerate config sets fsdp_cpu_ram_efficient_loading: true; every process loads the model "
                "here: set it to false (configs/accelerate/fsdp2.yaml)"
            )
        return "fsdp2"
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
        if os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"):
            stage = str(_deepspeed_config_file_stage(os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"]))
        if stage not in ("2", "3"):
            raise UserError(
                f"the accelerate config asks for DeepSpeed ZeRO stage {stage}; this library trains with ZeRO-2 or "
                "ZeRO-3: set `zero_stage: 2` or `3` in its deepspeed_config (configs/accelerate/zero2.yaml, zero3.yaml)"
            )
        return "zero2" if stage == "2" else "zero3"
    return None


def _deepspeed_config_file_stage(path: str) -> int | None:
    import json

    with open(path) as f:
        return json.load(f).get("zero_optimization", {}).get("stage")


def make_accelerator():
    """The Accelerator of a stage script: the engine of the user's accelerate config, on the GPUs or, without one,
    on the CPU with gloo across processes; the engine in use is printed.

    `accelerate launch --cpu` starts a single process whatever --num_processes says (accelerate 1.x);
    `accelerate launch --multi_gpu --num_processes 2` (or `torchrun --nproc_per_node 2`) starts two, and
    without a GPU they train on the CPU over gloo.
    """
    # torch.distributed.nn binds the default process group as a default argument of its functions when it is
    # first imported, and DDP imports it: imported after the group exists, it keeps the group alive past
    # destroy_process_group, and gloo's threads then die in the interpreter's teardown (SIGABRT, "terminate
    # called without an active exception", now and then in two-process runs on a loaded machine). Imported
    # before the group exists, it binds None.
    import torch.distributed.nn  # noqa: F401
    from accelerate import Accelerator

    requested = requested_engine()
    if torch.cuda.is_available():
        accelerator = Accelerator()
    else:
        accelerator = Accelerator(cpu=True)
        if requested is not None and accelerator.num_processes == 1:
            raise UserError(
                f"the accelerate config asks for {ENGINE_NAMES[requested]}, which shards over processes, and this "
                "run has one: launch with --num_processes 2 or more, or without the config"
            )
        if requested == "fsdp2":
            _fsdp2_on_cpu(accelerator)
        elif requested in ("zero2", "zero3"):
            _deepspeed_on_cpu(accelerator)
    used = engine_of(accelerator)
    if requested is not None and used != requested:  # never a silent fallback to DDP
        raise UserError(
            f"the accelerate config asks for {ENGINE_NAMES[requested]} but accelerate set up {ENGINE_NAMES[used]}"
        )
    accelerator.print(f"training engine: {ENGINE_NAMES[used]} over {accelerator.num_processes} process(es)")
    return accelerator


def _fsdp2_on_cpu(accelerator) -> None:
    """Switch a CPU Accelerator to FSDP2, as it would be on GPUs: accelerate reads the engine from both its own
    state and the process state, and keeps the FSDP plugin (made from the config's environment) on its state."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def _deepspeed_on_cpu(accelerator) -> None:
    raise UserError("DeepSpeed on the CPU is not wired in yet")


def engine_of(accelerator) -> Engine:
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        return "fsdp2"
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return "zero3" if accelerator.state.deepspeed_plugin.zero_stage == 3 else "zero2"
    return "ddp" if accelerator.num_processes > 1 else "single"


def is_sharded(engine: Engine) -> bool:
    """Whether the engine shards parameters (a module's tensors are pieces of it on each process)."""
    return engine in ("fsdp2", "zero3")


def prepare(accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """The trained model and its optimizer, prepared for the accelerator's engine (accelerate's `prepare`).

    Under FSDP2 each transformer block is a shard group of its own (the LM's `_no_split_modules`, which the model
    passes on), and the model's `sample` method gathers as its forward does (`torch.distributed.fsdp.
    register_fsdp_forward_method`): a rollout calls the LM outside the model's forward."""
    model, optimizer = accelerator.prepare(model, optimizer)
    if engine_of(accelerator) == "fsdp2":
        _register_sample(model)
    return model, optimizer


def _register_sample(model) -> None:
    from torch.distributed.fsdp import register_fsdp_forward_method

    if hasattr(model, "sample"):  # a policy's
        register_fsdp_forward_method(model, "sample")


def prepare_frozen(accelerator, model: torch.nn.Module, shard: bool) -> torch.nn.Module:
    """A frozen model (the reference policy, the reward model) for the engine: sharded like the trained one when
    `shard` and the engine shards parameters, else a whole copy on every process."""
    model = model.to(accelerator.device).requires_grad_(False)
    engine = engine_of(accelerator)
    if not (shard and is_sharded(engine)):
        return model
    if engine == "fsdp2":  # accelerate's own wrapping, without the optimizer its `prepare` insists on
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        model = fsdp2_prepare_model(accelerator, model)
        _register_sample(model)
        return model
    raise UserError(f"a sharded frozen model under {ENGINE_NAMES[engine]} is not wired in yet")


@contextlib.contextmanager
def gathered(accelerator, model: torch.nn.Module) -> Iterator[None]:
    """The model's parameters whole on every process for a rollout: each is gathered once for the whole rollout,
    not once per sampled token (FSDP2: its blocks stay unsharded after their forward until the block ends)."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield
        return
    resharded = {m: _reshards_after_forward(m) for m in units}
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m, reshard in resharded.items():
            m.set_reshard_after_forward(reshard, recurse=False)
            if reshard:
                m.reshard()


def reshard(model: torch.nn.Module) -> None:
    """Put a sharded model's parameters back into their shards: FSDP2 keeps the root's whole after a forward, until
    its backward, and a write into a whole parameter (the reward model's gain and bias) would not reach the shards
    the next forward gathers from. A no-op for an unsharded model."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _reshards_after_forward(module) -> bool:
    # FSDP2 keeps the setting on the module's parameter group: resharding after forward means a mesh to reshard to
    group = module._get_fsdp_state()._fsdp_param_group
    return group is not None and group.post_forward_mesh_info is not None


def full_state_dict(accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole tensors on the CPU (on the main process; the others get what the engine gives them, maybe
    nothing). Every process calls it: under a sharding engine it gathers."""
    if not is_sharded(engine_of(accelerator)):
        return {k: v.detach().cpu() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    return accelerator.get_state_dict(model)


def load_full_state_dict(accelerator, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put whole tensors (`full_state_dict`'s, read on every process) into the model, each process taking its
    shard."""
    if engine_of(accelerator) == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
        return
    accelerator.unwrap_model(model).load_state_dict(state)


def optimizer_state_dict(accelerator, model, optimizer) -> dict:
    """The optimizer's state as whole tensors on the CPU (on the main process; every process calls it)."""
    if engine_of(accelerator) == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(model, _torch_optimizer(optimizer), options=options)
    return optimizer.state_dict()


def load_optimizer_state_dict(accelerator, model, optimizer, state: dict) -> None:
    """Put `optimizer_state_dict`'s whole tensors (read on every process) into the optimizer."""
    if engine_of(accelerator) == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(model, _torch_optimizer(optimizer), state, options=options)
        return
    optimizer.load_state_dict(state)


def _torch_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the torch optimizer


def local_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of parameters and optimizer state this process holds (its shards under a sharding engine)."""

    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    total = sum(local(p).numel() * p.element_size() for p in model.parameters())
    if optimizer is not None:
        for state in _torch_optimizer(optimizer).state.values():
            total += sum(local(v).numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return total


def memory_stats(
    accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *frozen: torch.nn.Module
) -> dict[str, float]:
    """`memory/state_gib`: parameters and optimizer state held by a process (`local_state_bytes`), the `frozen`
    models' parameters included (a module shared with the trained model counted once); `memory/peak_gib`:
    a process's peak memory so far (on a GPU its allocator's peak, on the CPU its peak resident set, which counts the
    interpreter and libraries too); each the largest over the processes."""
    if accelerator.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(accelerator.device)
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports kilobytes
    state = local_state_bytes(model, optimizer) + sum(local_state_bytes(m) for m in frozen if m is not model)
    mine = torch.tensor([state, peak], dtype=torch.float64, device=accelerator.device)
    state, peak = (accelerator.reduce(mine, "max") / 2**30).tolist()
    return {"memory/state_gib": state, "memory/peak_gib": peak}
