"""What the speed benchmarks (benchmarks/*_speed.py) share: the device their processes run on, and how
a benchmarked process is run and logged."""

import os
import subprocess
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


def git_commit() -> str | None:
    """The commit of the code that made a result (None outside a git checkout, as on a machine the tree was copied
    to)."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def synchronize(device) -> None:
    """Wait for the GPU's queued work before reading a clock (nothing to wait for on the CPU)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def busy_cpu_s() -> float | None:
    """Seconds of CPU the machine has spent busy since it booted, all cores and every process together
    (user, nice, system, irq and softirq time of /proc/stat; steal is the hypervisor's); None without
    /proc/stat."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in f.readline().split()[1:8])
    except OSError:
        return None
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def run_logged(cmd: list[str], log_path: str, env: dict[str, str], cwd: str | None = None) -> int:
    """Run `cmd` to the end with its output in `log_path`; its peak RSS in MiB (the kernel's accounting
    of that child). A failure raises with the log's last lines, so a benchmark's log says why."""
    print("$", " ".join(cmd), flush=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        with open(log_path, errors="replace") as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({process.returncode}); {log_path} ends:\n{tail}")
    return usage.ru_maxrss // 1024  # KiB on Linux
