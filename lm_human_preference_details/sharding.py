"""Which engine trains a stage across processes, and the few places where sharding changes what a stage does.

The engine is the user's choice in their accelerate config (`accelerate launch --config_file
configs/accelerate/fsdp2.yaml ...`): DDP (every process holds the whole model), FSDP2 (torch's `fully_shard`:
parameters, gradients and optimizer state sharded over the processes), DeepSpeed ZeRO-2 (gradients and optimizer
state sharded) or ZeRO-3 (parameters too). On a GPU accelerate sets the engine up itself; without one it falls
back to DDP in silence, so `make_accelerator` switches it to the engine the config names (the tests' two CPU
processes over gloo run the same code as a GPU cluster) and refuses a config it cannot honour.

What a stage does differently under a sharding engine, each the way the engine's documentation does it:
- `prepare`: the trained model and its optimizer (accelerate's own `prepare`; under DeepSpeed the engine counts the
  loop's micro-batches itself, so that K of them make one update, as under DDP);
- `prepare_frozen`: the reference policy and reward model, sharded (FSDP2's `fully_shard` through accelerate, a
  ZeRO-3 inference engine) or replicated, by the stage's choice;
- `gathered`: the parameters whole for a rollout, which calls the LM token by token outside the model's own
  forward, gathered once for the whole rollout (FSDP2: hooks on the sampling method; ZeRO-3: DeepSpeed's
  `unwrap_model_for_generation`);
- `writing`: parameters written outside the optimizer (the reward model's gain and bias), into the shards;
- `full_state_dict`: the whole tensors, from which the final model is an ordinary transformers folder;
- `gathered_buckets`: FSDP2's whole tensors a few at a time, flat, for a weight push that never holds them all;
- `save_training_state` / `load_training_state`: a checkpoint's model and optimizer, whole tensors under DDP and
  FSDP2 (accelerate's FULL_STATE_DICT), each process's ZeRO partition under DeepSpeed (accelerate's `save_state`);
- `local_state_bytes`: what this process holds of parameters and optimizer state, to show the sharding.

`make_accelerator(mixed_precision)` also sets up accelerate's autocast; which precision a run can honour, and which
one a quickstart takes, is precision.py's.
"""

import contextlib
import math
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
                "here gather whole tensors (sharded ones are not wired in): set `fsdp_state_dict_type: "
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
        if os.environ.get("ACCELERATE_DEEPSPEED_ZERO3_INIT", "false").lower() == "true":
            raise UserError(
                "the accelerate config sets zero3_init_flag: true; every process loads the models whole here, and "
                "the engine shards them: set it to false (configs/accelerate/zero3.yaml)"
            )
        return "zero2" if stage == "2" else "zero3"
    return None


def _deepspeed_config_file_stage(path: str) -> int | None:
    import json

    if not os.path.isfile(path):
        raise UserError(
            f"the accelerate config's deepspeed_config_file {path} is not there from {os.getcwd()}: launch from the "
            "folder it is relative to (the repository root for configs/accelerate/), or give its absolute path"
        )
    with open(path) as f:
        return json.load(f).get("zero_optimization", {}).get("stage")


def make_accelerator(mixed_precision: str = "no"):
    """The Accelerator of a stage script: the engine of the user's accelerate config, on the GPUs or, without one,
    on the CPU with gloo across processes, under `mixed_precision` (`precision.check_mixed_precision`); the engine
    in use is printed.

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

    from .precision import check_mixed_precision  # here, not above: precision.py names the engines from this module

    requested = requested_engine()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_mixed_precision(mixed_precision, requested, device)
    if device.type == "cuda":
        accelerator = Accelerator(mixed_precision=mixed_precision)
    elif requested in ("zero2", "zero3"):
        # accelerate sets DeepSpeed up (over deepspeed.comm) only when not told cpu=True, and then finds no
        # backend of its own without a GPU: named, gloo
        from accelerate.utils import InitProcessGroupKwargs

        accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    else:
        accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
        if requested == "fsdp2" and accelerator.num_processes > 1:
            _fsdp2_on_cpu(accelerator)
    if requested is not None and accelerator.num_processes == 1:
        raise UserError(
            f"the accelerate config asks for {ENGINE_NAMES[requested]}, which shards over processes, and this "
            "run has one: launch with --num_processes 2 or more, or without the config"
        )
    used = engine_of(accelerator)
    if used == "zero3":
        # accelerate hands transformers the ZeRO-3 config whatever zero3_init_flag says, and `from_pretrained` then
        # loads every model partitioned, unusable until an engine wraps it (a frozen model kept whole, stage 1's
        # sampler): the models load whole, as the config asks, and the engines partition them
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    if requested is not None and used != requested:  # never a silent fallback to DDP
        raise UserError(
            f"the accelerate config asks for {ENGINE_NAMES[requested]} but accelerate set up {ENGINE_NAMES[used]}"
        )
    processes = "" if used == "single" else f" over {accelerator.num_processes} processes"
    precision = "" if mixed_precision == "no" else f", {mixed_precision} autocast"
    accelerator.print(f"training engine: {ENGINE_NAMES[used]}{processes}{precision}")
    return accelerator


def _fsdp2_on_cpu(accelerator) -> None:
    """Switch a CPU Accelerator to FSDP2, as it would be on GPUs: accelerate reads the engine from both its own
    state and the process state, and keeps the FSDP plugin (made from the config's environment) on its state."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


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


def prepare(
    accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batch_size: int,
    gradient_accumulation_steps: int = 1,
):
    """The trained model and its optimizer, prepared for the accelerator's engine (accelerate's `prepare`). The
    stages' loop is the same under every engine: `gradient_accumulation_steps` times `accelerator.backward(loss /
    K)` over micro-batches of `micro_batch_size` (per process), then `optimizer.step(); optimizer.zero_grad()`.

    FSDP2: each transformer block is a shard group of its own (the LM's `_no_split_modules`, which the model
    passes on), and the model's `sample` method gathers as its forward does (`torch.distributed.fsdp.
    register_fsdp_forward_method`): a rollout calls the LM outside the model's forward.
    DeepSpeed: the engine steps our own torch optimizer (on its flat partitions); it needs the micro-batch size in
    its config (no dataloader tells it), counts the micro-batches itself (`StepAfterEveryBackward`) and clips no
    gradient (its default clips to norm 1, which OAI's PPO never does)."""
    if engine_of(accelerator) in ("zero2", "zero3"):
        from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

        class StepAfterEveryBackward(DeepSpeedEngineWrapper):
            """`accelerator.backward` for a loop that divides its loss by K itself and accumulates K micro-batches
            without `accelerator.accumulate`: accelerate's own wrapper would step the engine after every
            micro-batch (outside `accumulate` each counts as the last) and DeepSpeed would divide the loss by K
            again. Here the engine counts the micro-batches (its config's `gradient_accumulation_steps`):
            `engine.step()` after each backward updates on every K-th."""

            def backward(self, loss, sync_gradients=True, **kwargs):
                self.engine.backward(loss, scale_wrt_gas=False, **kwargs)
                self.engine.step()

        config = accelerator.state.deepspeed_plugin.deepspeed_config
        config["train_micro_batch_size_per_gpu"] = micro_batch_size
        config["gradient_accumulation_steps"] = gradient_accumulation_steps
        config["gradient_clipping"] = 0.0
        config.pop("train_batch_size", None)  # "auto": the two above and the process count make it
        model, optimizer = accelerator.prepare(model, optimizer)
        accelerator.deepspeed_engine_wrapped = StepAfterEveryBackward(model)
        return model, optimizer
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
        # back into shards after every forward, the root and the output layer too: accelerate keeps those whole
        # until the backward, which a frozen model never runs
        model.set_reshard_after_forward(True)
        _register_sample(model)
        return model
    # ZeRO-3: an inference engine of its own (as TRL's `prepare_deepspeed`), not through accelerate's `prepare`,
    # whose second engine would replace the one `accelerator.backward` steps
    import copy

    import deepspeed

    config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)  # required, unused without steps
    for key in ("train_batch_size", "optimizer", "scheduler", "zero_allow_untested_optimizer"):
        config.pop(key, None)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    return engine


@contextlib.contextmanager
def gathered(accelerator, model: torch.nn.Module) -> Iterator[None]:
    """The model's parameters whole on every process for a rollout: each is gathered once for the whole rollout,
    not once per sampled token (FSDP2: its blocks stay unsharded after their forward until the block ends; ZeRO-3:
    DeepSpeed's `unwrap_model_for_generation`, which also lifts its hooks that would release them after each)."""
    from torch.distributed.fsdp import FSDPModule

    if engine_of(accelerator) == "zero3":
        import deepspeed

        with deepspeed.zero.unwrap_model_for_generation(model):
            yield
        return
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


@contextlib.contextmanager
def writing(accelerator, model: torch.nn.Module, parameters: list[torch.Tensor]) -> Iterator[None]:
    """`parameters` of `model` whole and writable on every process, the writes reaching the shards that later
    forwards gather from (every process enters it and writes the same values). FSDP2 keeps the root's parameters
    whole after a forward until its backward, and a write there would be lost: they are put back into their shards
    (DTensors, written shard by shard). ZeRO-3 gathers them and spreads the main process's values after."""
    engine = engine_of(accelerator) if accelerator is not None else "single"
    if engine == "zero3":
        import deepspeed

        with deepspeed.zero.GatheredParameters(parameters, modifier_rank=0):
            yield
        return
    if engine == "fsdp2":
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    yield


def _reshards_after_forward(module) -> bool:
    # FSDP2 keeps the setting on the module's parameter group: resharding after forward means a mesh to reshard to
    group = module._get_fsdp_state()._fsdp_param_group
    return group is not None and group.post_forward_mesh_info is not None


def full_state_dict(accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole tensors on the CPU (on the main process; the others get what the engine gives them, maybe
    nothing). Every process calls it: under a sharding engine it gathers."""
    engine = engine_of(accelerator)
    if engine == "fsdp2":
        return accelerator.get_state_dict(model)
    module = accelerator.unwrap_model(model)
    gather = contextlib.nullcontext()
    if engine == "zero3":  # exact float32 (accelerate's `get_state_dict` gathers 16-bit weights under ZeRO-3)
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(module.parameters()))
    with gather:
        if not accelerator.is_main_process:
            return {}
        return {k: v.detach().to("cpu", copy=engine == "zero3") for k, v in module.state_dict().items()}


def gathered_buckets(
    parameters: list[torch.Tensor], plan: list[list[int]], dtype: torch.dtype | None
) -> Iterator[torch.Tensor | None]:
    """The whole values of `parameters` (FSDP2's DTensors; a tensor that is not one is whole already) in the flat
    buckets of `plan` (indices into `parameters`, each bucket's values one after another, cast to `dtype`:
    `weights.flatten`'s layout), one new bucket yielded as soon as it is full. Each tensor is gathered alone and
    copied into its bucket before the next is gathered: a process holds its shards, the bucket being filled and
    one whole tensor (plus what the caller keeps of the buckets yielded). Each gather is a collective: every
    process iterates it to the end, over the same tensors in the same order; with `dtype` None a process only
    joins the gathers, and gets None per bucket."""
    for bucket in plan:
        sizes = [parameters[i].numel() for i in bucket]
        flat = None if dtype is None else torch.empty(sum(sizes), dtype=dtype, device=parameters[bucket[0]].device)
        offset = 0
        for i, size in zip(bucket, sizes):
            whole = flat_whole(parameters[i].detach())
            if flat is not None:
                flat[offset : offset + size].copy_(whole)
            offset += size
            del whole  # freed before the next gather
        yield flat


def flat_whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value, flat, on every process (a collective); a tensor that is not one, flattened. One
    sharded on its first dimension over a 1-D mesh (FSDP2's parameters) is all-gathered straight into one new
    tensor, its shards padded to the first one's rows (`torch.chunk`'s layout: only the last shards are short):
    `DTensor.full_tensor` would hold the whole value twice at its peak (gathered, then copied out)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor):
        return tensor.reshape(-1)
    if tensor.device_mesh.ndim != 1 or tuple(tensor.placements) != (Shard(0),):
        return tensor.full_tensor().reshape(-1)
    group = tensor.device_mesh.get_group()
    processes = dist.get_world_size(group)
    shard_elements = -(-tensor.shape[0] // processes) * math.prod(tensor.shape[1:])
    local = tensor.to_local().reshape(-1)
    if local.numel() < shard_elements:
        local = torch.cat([local, local.new_zeros(shard_elements - local.numel())])
    gathered = torch.empty(processes * shard_elements, dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(gathered, local, group=group)
    return gathered[: tensor.numel()]


def save_training_state(accelerator, model, optimizer, folder: str) -> dict:
    """Write what a checkpoint needs of `model` and `optimizer` into `folder` (every process calls it); returns
    what the main process adds to the checkpoint's state file. DDP, FSDP2: the whole tensors, in the state file
    (FSDP2's optimizer state keyed by parameter names, torch's distributed-checkpoint form). DeepSpeed: each
    process's ZeRO partition, written by the engine (accelerate's `save_state`) into `folder`/engine."""
    engine = engine_of(accelerator)
    if engine in ("zero2", "zero3"):
        accelerator.save_state(os.path.join(folder, "engine"))
        return {}
    return {
        "model": full_state_dict(accelerator, model),
        "optimizer": optimizer_state_dict(accelerator, model, optimizer),
    }


def load_training_state(accelerator, model, optimizer, folder: str, state: dict) -> None:
    """Restore what `save_training_state` wrote into `folder` and returned (`state`, read on every process)."""
    engine = engine_of(accelerator)
    if engine in ("zero2", "zero3"):
        accelerator.load_state(os.path.join(folder, "engine"))
        return
    if engine == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state["model"], options=StateDictOptions(full_state_dict=True))
    else:
        accelerator.unwrap_model(model).load_state_dict(state["model"])
    load_optimizer_state_dict(accelerator, model, optimizer, state["optimizer"])


def optimizer_state_dict(accelerator, model, optimizer) -> dict:
    """The optimizer's state as whole tensors, for the main process to save (every process calls it): under FSDP2
    gathered and keyed by parameter names (torch's distributed-checkpoint form), else the optimizer's own state dict
    (`accelerator` None: one process without accelerate). Not under DeepSpeed, whose engine saves its partitions."""
    if accelerator is not None and engine_of(accelerator) == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(model, optimizer.optimizer, options=whole)
    return optimizer.state_dict()


def load_optimizer_state_dict(accelerator, model, optimizer, state: dict) -> None:
    """Put `optimizer_state_dict`'s whole tensors (read on every process) into the optimizer, each process taking
    its shard."""
    if accelerator is not None and engine_of(accelerator) == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer.optimizer, state, options=StateDictOptions(full_state_dict=True))
        return
    optimizer.load_state_dict(state)


def local_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of parameters and optimizer state this process holds, each tensor's memory counted once: an FSDP2
    parameter's local shard, a ZeRO-3 parameter's partition (and its whole tensor while gathered or kept whole:
    DeepSpeed keeps tensors below `stage3_param_persistence_threshold` elements whole on every process), ZeRO's
    float32 master partitions (a copy it keeps even in float32 training) and the optimizer's own state."""
    seen = set()

    def nbytes(tensors) -> int:
        total = 0
        for t in tensors:
            if t is None or not torch.is_tensor(t):
                continue
            t = t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 DTensor: this process's shard
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
            if t.numel() == 0 or key in seen:
                continue
            seen.add(key)
            total += t.numel() * t.element_size()
        return total

    module = getattr(model, "module", model)  # a DeepSpeed engine's or DDP's module
    total = nbytes(t for p in module.parameters() for t in (getattr(p, "ds_tensor", None), p.data))
    if optimizer is not None:
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper: a ZeRO optimizer or ours
        zero_partitions = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
        total += nbytes(t for name in zero_partitions for t in getattr(inner, name, []))
        base = getattr(inner, "optimizer", inner)  # a ZeRO optimizer steps ours
        total += nbytes(v for state in base.state.values() for v in state.values())
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
