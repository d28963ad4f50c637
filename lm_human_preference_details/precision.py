"""Which precision a run computes in: what a run can honour (`check_mixed_precision`, `check_accelerator`) and the
quickstarts' choice (`fastest_precision`: bf16 only where its matmuls beat float32's). Accelerate's autocast does the
computing; `sharding.make_accelerator(mixed_precision)` sets it up.
"""

import contextlib
import os
import time

import torch

from .cli import UserError
from .sharding import ENGINE_NAMES, Engine


def check_accelerator(accelerator, mixed_precision: str) -> None:
    """UserError if a stage was handed an accelerator of another mixed precision than its `--mixed-precision`
    (`make_accelerator(args.mixed_precision)` makes the right one)."""
    if accelerator.mixed_precision != mixed_precision:
        raise UserError(
            f"--mixed-precision {mixed_precision}, but the accelerator autocasts to {accelerator.mixed_precision}: "
            "make it with sharding.make_accelerator(args.mixed_precision)"
        )


def check_mixed_precision(mixed_precision: str, engine: Engine | None, device: torch.device) -> None:
    """UserError for a mixed precision this run cannot honour: another than `accelerate launch` was told (it would
    be silently overridden one way or the other), fp16 without a GPU (accelerate autocasts to fp16 only on one, and
    would train in float32 in silence), or under a sharding engine (`engine`: its own mixed precision, FSDP2's
    parameter casts or DeepSpeed's bf16 weights, is other numerics than autocast and is not wired in)."""
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if launched is not None and launched != mixed_precision:
        raise UserError(
            f"accelerate launch says --mixed_precision {launched}, this run --mixed-precision {mixed_precision}: pass "
            f"--mixed-precision {launched} to the stage, or launch with --mixed_precision {mixed_precision}"
        )
    if mixed_precision == "no":
        return
    if mixed_precision == "fp16" and device.type != "cuda":
        raise UserError("--mixed-precision fp16 needs a GPU (accelerate autocasts to fp16 only there): use bf16, or no")
    if engine not in (None, "single", "ddp"):
        raise UserError(
            f"--mixed-precision {mixed_precision} runs under DDP or one process here, not {ENGINE_NAMES[engine]}: "
            "launch without the sharding config, or with --mixed-precision no"
        )


def bf16_speedup(device: torch.device, rounds: int = 5) -> float:
    """How many times as fast a matmul of a transformer layer's size (SmolLM2-135M's width, a PPO batch of tokens)
    runs under bf16 autocast as in float32 on `device`: a CPU without native bfloat16 (AVX512-BF16, AMX) emulates
    it, several times slower. Each precision's fastest of `rounds`, taken in turn, on one thread: a matmul over
    several threads waits for the slowest, which another process on the same cores holds back: the answer flipped
    from one call to the next on a busy machine."""
    tokens, weight = torch.randn(1024, 576, device=device), torch.randn(1536, 576, device=device)
    contexts = {"float32": contextlib.nullcontext, "bf16": lambda: torch.autocast(device.type, dtype=torch.bfloat16)}
    fastest = dict.fromkeys(contexts, float("inf"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(rounds):
            for name, context in contexts.items():
                with context():
                    tokens @ weight.T  # warm-up: the kernel's first call packs its operands
                    start = time.perf_counter()
                    for _ in range(3):
                        tokens @ weight.T
                    fastest[name] = min(fastest[name], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return fastest["float32"] / fastest["bf16"]


def fastest_precision(device: torch.device | None = None) -> tuple[str, str]:
    """`--mixed-precision` for a quickstart on `device` (default: the GPU if any, else the CPU): bf16 where faster
    than float32, else no; and why."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16", "bf16 autocast: this GPU computes in bfloat16"
        return "no", "float32: this GPU has no bfloat16"
    speedup = bf16_speedup(device)
    if speedup >= 1.2:
        return "bf16", f"bf16 autocast: its matmuls run {speedup:.1f}x as fast as float32's on this CPU"
    return "no", (
        f"float32: bf16 matmuls run {speedup:.2f}x as fast as float32's on this CPU (no native bfloat16: "
        "AVX512-BF16 or AMX); --mixed-precision bf16 forces it"
    )
