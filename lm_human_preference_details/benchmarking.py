"""What the speed benchmarks (benchmarks/*_speed.py) share: the device their processes run on, how a
benchmarked process is run and logged, the machine's CPU over a run's steady state, a process's peak memory over a
block of code, a GRPO server to time, and their markdown tables."""

import contextlib
import ctypes
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
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


class SteadyCpu(threading.Thread):
    """The machine's CPU over a run's steady state: busy cores and CPU time per sample, from when
    metrics.jsonl has `first_row` rows to when it has `last_row` (a thread polling the file). Every process
    counts, so that a schedule's whole cost is there (servers, actor, verifier, trainer); over the window,
    samples/s = cores busy / CPU seconds per sample: the two ways one schedule can be faster than another."""

    def __init__(self, metrics_path: str, first_row: int, last_row: int):
        super().__init__(daemon=True)
        self.path, self.rows_at = metrics_path, (first_row, last_row)
        self.marks: list[tuple[float | None, float, int]] = []  # (busy CPU s, wall s, rows) at each
        self.done = threading.Event()

    def run(self) -> None:
        rows, metrics = 0, None
        while True:  # a last look after stop(): a starved thread still sees the last row (late, not never)
            stopping = self.done.is_set()
            if metrics is None and os.path.exists(self.path):
                metrics = open(self.path)
            if metrics is not None:
                rows += metrics.read().count("\n")  # whole lines only: a line being written counts once it ends
            while len(self.marks) < 2 and rows >= self.rows_at[len(self.marks)]:
                self.marks.append((busy_cpu_s(), time.perf_counter(), rows))
            if stopping or len(self.marks) == 2:
                break
            self.done.wait(0.01)
        if metrics is not None:
            metrics.close()

    def stop(self) -> None:
        self.done.set()
        self.join()

    def result(self, samples_per_row: float) -> dict:
        """cores_busy and cpu_ms_per_sample; nothing when the window was not seen or there is no /proc/stat."""
        if len(self.marks) < 2 or self.marks[0][0] is None or self.marks[1][2] == self.marks[0][2]:
            return {}
        (cpu0, wall0, rows0), (cpu1, wall1, rows1) = self.marks
        return {
            "cores_busy": (cpu1 - cpu0) / (wall1 - wall0),
            "cpu_ms_per_sample": (cpu1 - cpu0) * 1e3 / ((rows1 - rows0) * samples_per_row),
        }


@dataclass
class PeakRss:
    """This process's resident set (bytes) when a block began (`before`) and at its highest during it (`peak`)."""

    before: int = 0
    peak: int = 0

    @property
    def extra(self) -> int:
        """What the block added at its highest: the memory it needed beyond what the process held."""
        return self.peak - self.before


@contextlib.contextmanager
def peak_rss() -> Iterator[PeakRss]:
    """This process's peak resident set over the block, filled in when the block ends: the kernel's high-water
    mark (VmHWM) reset at the start by writing 5 to /proc/self/clear_refs (Linux 4.0 on); the process's threads
    count together. Memory that the allocator keeps after a free counts until it is reused (glibc keeps large
    blocks once one was freed): `unmap_large_blocks` first makes it count live memory only."""
    rss = PeakRss()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss.before = _status_bytes("VmRSS")
    yield rss
    rss.peak = max(_status_bytes("VmHWM"), rss.before)


def unmap_large_blocks(threshold_bytes: int = 128 * 2**10) -> None:
    """From now on glibc maps every block of `threshold_bytes` or more alone and unmaps it when freed, and it gives
    back the free memory it holds now: the resident set then follows the live memory (`peak_rss`). By default
    glibc raises that threshold to the size of any mapped block freed, up to 32 MiB, and keeps such blocks in its
    heap after a free; this fixes it. Glibc only (Linux); what it sets lasts for the process."""
    libc = ctypes.CDLL(None)
    libc.mallopt(-3, threshold_bytes)  # M_MMAP_THRESHOLD
    libc.malloc_trim(0)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # the kernel writes kB
    raise RuntimeError(f"/proc/self/status has no {field}: peak_rss needs Linux")


@contextlib.contextmanager
def served(settings, engine: Literal["home", "vllm"], folder: str, device: Device) -> Iterator[str]:
    """A server of `engine` for `settings` (`GRPOArgs`), started as the launcher starts one (`ServerEngine`, with
    `server_flags`), its log and vLLM's caches in `folder`: its URL, until the block ends."""
    from lm_human_preference_details.grpo.server_processes import ServerEngine, server_flags

    starter = ServerEngine(engine, folder)
    flags = server_flags(settings, starter.model_for_servers(settings.task.model), version=0, i=0)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "server.log"), "wb") as log:  # the child keeps its own handle
        server_process = starter.start(0, flags, log, device_env(device))
    try:
        yield server_process.wait_until_serving()
    finally:
        server_process.process.terminate()
        server_process.process.wait(timeout=60)
        starter.cleanup()


def markdown_table(caption: str, header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines: its caption, a blank line, the header, its rule and a line per row of cells."""
    return [caption, "", _table_line(header), "|" + "---|" * len(header), *(_table_line(row) for row in rows)]


def _table_line(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"
