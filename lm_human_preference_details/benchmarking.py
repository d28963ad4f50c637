"""What the speed benchmarks (benchmarks/*_speed.py) share: the device their processes run on."""

import os
from typing import Literal

Device = Literal["cpu", "cuda"]


def device_env(device: Device, python_path: str | None = None, **extra: str) -> dict[str, str]:
    """The environment of a benchmarked process: `cpu` hides every GPU from it, so that nothing in
    it (accelerate, the GRPO trainer and servers, TRL) picks one up by itself. `python_path` goes
    before the PYTHONPATH it inherits (where benchmarks/gpu.sh put the packages it installed)."""
    env = dict(os.environ, **extra, **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}))
    if python_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [python_path, os.environ.get("PYTHONPATH")]))
    return env


def machine(device: Device) -> str:
    """What the runs ran on, for a table's header."""
    if device == "cuda":
        import torch

        return f"one {torch.cuda.get_device_name()} ({os.cpu_count()} CPU cores)"
    return f"{os.cpu_count()} CPU cores"


def synchronize(device) -> None:
    """Wait for the GPU's queued work before reading a clock (nothing to wait for on the CPU)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
