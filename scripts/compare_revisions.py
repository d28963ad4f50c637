"""Show that two revisions of the project train bitwise alike: a refactor's check, run before it lands.

    python scripts/compare_revisions.py BEFORE AFTER            # each a git revision or a checkout folder
    python scripts/compare_revisions.py HEAD~3 . --only grpo

What it runs, each revision in a process of its own with its own code first on the path:
- stage 2's tiny preset (`train_policy --task tiny`, seed 1, its reward model trained first): the two metrics.jsonl
  must be equal line by line, every value bitwise, wall-clock fields (`time/*`, `*_s`) and
  the peak memory left out;
- the GRPO trainer alone, reading one stream that AFTER's launcher recorded (the tiny preset), with the default
  loss and with each `--recipe` named by `--recipes`: the final parameters must be equal bitwise. Each trainer
  pushes its weights into a fresh home server of its own revision, which nothing else reads.

Prints a line per comparison and exits non-zero on the first difference.
"""

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

from safetensors.torch import load_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "lm_human_preference_details"
QUIET = ("--wandb-mode", "disabled")
PROCESS_PEAKS = {"memory/peak_gib"}


def checkout(revision: str, into: str) -> str:
    """A folder holding `revision`: itself when it is a folder, else a detached git worktree under `into`."""
    if os.path.isdir(revision):
        return os.path.abspath(revision)
    path = os.path.join(into, revision.replace("/", "_").replace("~", "_"))
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "-q", path, revision], check=True)
    return path


def environment(code: str, scratch: str) -> dict[str, str]:
    """`code` first on the path; offline, no wandb, caches and plots in `scratch`; one thread for reproducibility."""
    env = dict(os.environ, PYTHONPATH=code, HF_HUB_OFFLINE="1", WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    env |= {name: os.path.join(scratch, name.lower()) for name in ("WANDB_DIR", "MPLCONFIGDIR")}
    return env


def run(code: str, scratch: str, module: str, *flags: str) -> None:
    command = [sys.executable, "-m", f"{PACKAGE}.{module}", *flags]
    print("$", " ".join(command[1:]), f"  (code: {code})", flush=True)
    subprocess.run(command, check=True, cwd=scratch, env=environment(code, scratch))


def without_measurements(metrics: dict) -> dict:
    """What training computes: wall-clock times and the process's peak memory are the machine's, not the run's."""
    return {k: v for k, v in metrics.items() if not (k.startswith("time/") or k.endswith("_s") or k in PROCESS_PEAKS)}


def same_value(a, b) -> bool:
    """Bitwise for floats (NaN equals NaN), equality otherwise."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


def compare_stage2(before: str, after: str, scratch: str) -> None:
    logs = []
    for side, code in (("before", before), ("after", after)):
        output = os.path.join(scratch, side, "policy")
        run(code, scratch, "train_policy", "--task", "tiny", "--seed", "1", "--output-dir", output, *QUIET)
        with open(os.path.join(output, "metrics.jsonl")) as f:
            logs.append([without_measurements(json.loads(line)) for line in f])
    first, second = logs
    if len(first) != len(second):
        sys.exit(f"stage 2: {len(first)} metrics lines before, {len(second)} after")
    for number, (a, b) in enumerate(zip(first, second), 1):
        if a.keys() != b.keys():
            sys.exit(f"stage 2: line {number}: keys differ: {sorted(a.keys() ^ b.keys())}")
        if differing := [k for k in a if not same_value(a[k], b[k])]:
            sys.exit(f"stage 2: line {number}: {', '.join(f'{k} {a[k]!r} != {b[k]!r}' for k in differing)}")
    print(
        f"stage 2 tiny: metrics.jsonl equal, {len(first)} lines of {len(first[0])} values "
        "(wall clock and peak memory left out)"
    )


def server_module(code: str) -> str:
    """The home server's module in that revision (the servers moved into grpo/serving/)."""
    serving = os.path.join(code, PACKAGE, "grpo", "serving", "server.py")
    return "grpo.serving.server" if os.path.exists(serving) else "grpo.server"


@contextlib.contextmanager
def home_server(code: str, scratch: str):
    """A home server of `code`'s revision for the tiny-math model; its URL."""
    port_file = tempfile.mktemp(dir=scratch)
    command = [sys.executable, "-m", f"{PACKAGE}.{server_module(code)}", "--port", "0", "--port-file", port_file]
    process = subprocess.Popen(command + ["--threads", "1"], cwd=scratch, env=environment(code, scratch))
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(port_file) or not open(port_file).read().strip():
            if process.poll() is not None or time.monotonic() > deadline:
                sys.exit("the home server did not start")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{open(port_file).read().strip()}"
    finally:
        process.terminate()
        process.wait(30)


def final_parameters(output: str) -> dict:
    folder = os.path.join(output, "checkpoint", "model")
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors |= load_file(os.path.join(folder, name))
    return tensors


def compare_grpo(before: str, after: str, scratch: str, steps: int, recipes: list[str]) -> None:
    record = os.path.join(scratch, "record")
    run(after, scratch, "grpo.launch", "--task", "tiny", "--steps", str(steps + 1), "--output-dir", record, *QUIET)
    stream = os.path.join(record, "stream.jsonl")
    for recipe in recipes:
        parameters = []
        for side, code in (("before", before), ("after", after)):
            output = os.path.join(scratch, side, f"grpo-{recipe}")
            with home_server(code, scratch) as url:
                flags = ["--task", "tiny", "--recipe", recipe, "--steps", str(steps), "--save-interval", str(steps)]
                flags += ["--servers", url, "--stream", stream, "--output-dir", output, "--threads", "1", *QUIET]
                run(code, scratch, "grpo.trainer", *flags)
            parameters.append(final_parameters(output))
        first, second = parameters
        if first.keys() != second.keys():
            sys.exit(f"grpo {recipe}: parameter names differ: {sorted(first.keys() ^ second.keys())}")
        if differing := [name for name in first if not bool((first[name] == second[name]).all())]:
            sys.exit(f"grpo {recipe}: parameters differ after {steps} steps: {', '.join(differing)}")
        print(f"grpo {recipe}: {len(first)} parameters bitwise equal after {steps} steps over one recorded stream")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="git revision or checkout folder")
    parser.add_argument("after", help="git revision or checkout folder (its launcher records the GRPO stream)")
    parser.add_argument("--only", choices=["stage2", "grpo"], help="one of the two comparisons")
    parser.add_argument("--grpo-steps", type=int, default=4, help="trainer steps over the recorded stream")
    parser.add_argument("--recipes", nargs="+", default=["default", "dapo"], help="the GRPO loss settings to compare")
    args = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="compare-revisions-")
    worktrees = os.path.join(scratch, "worktrees")
    try:
        before, after = checkout(args.before, worktrees), checkout(args.after, worktrees)
        if args.only != "grpo":
            compare_stage2(before, after, scratch)
        if args.only != "stage2":
            compare_grpo(before, after, scratch, args.grpo_steps, args.recipes)
    finally:
        if os.path.isdir(worktrees):
            for name in os.listdir(worktrees):
                subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", os.path.join(worktrees, name)])
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
