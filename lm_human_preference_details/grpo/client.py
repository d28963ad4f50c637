"""The client side of the inference server's contract, without torch: JSON requests, and a server
started as a child process (what the launcher, the trainer and the benchmarks use to reach one). The
contract's constants and types are `grpo.protocol`'s."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable

from lm_human_preference_details.grpo.protocol import TOKEN_ENV


def check_serving(urls: list[str], version: int, model: str, starts: str = "starts") -> None:
    """UserError unless every server answers and serves weights `version`, the version the run `starts` at (a server
    left at a later one by an earlier run would refuse every update up to it, and sample with weights not the run's)."""
    from lm_human_preference_details.cli import UserError

    for url in urls:
        try:
            served = request_json("GET", f"{url}/health", timeout_s=30)["model_version"]
        except ServerError as error:
            raise UserError(f"--servers: {url} is not serving ({error})") from None
        if served != version:
            module = server_module(url)
            raise UserError(
                f"--servers: {url} serves weights version {served}, and this run {starts} at {version}: restart it "
                f"with `python -m {module} --model {model} --version {version}`"
                + (" (in the vLLM environment)" if module.endswith("vllm_server") else "")
            )


def server_module(url: str) -> str:
    """The module that serves at `url`: the vLLM server (its /metrics says `engine: vllm`; run it in the vLLM
    environment) or this package's own."""
    try:
        engine = request_json("GET", f"{url}/metrics", timeout_s=10).get("engine", "home")
    except ServerError:
        engine = "home"
    return "lm_human_preference_details.grpo.serving." + ("vllm_server" if engine == "vllm" else "server")


class ServerError(RuntimeError):
    """A request to a server failed: `status` is the HTTP status, None when it could not be reached."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def request_json(method: str, url: str, payload: dict | None = None, timeout_s: float = 60) -> dict:
    """A blocking JSON request to a server (the trainer's and the launcher's side of the contract), with the control
    token of $GRPO_SERVER_TOKEN when it is set (the control endpoints require it of a server started with one)."""
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"}
    if os.environ.get(TOKEN_ENV):
        headers["Authorization"] = f"Bearer {os.environ[TOKEN_ENV]}"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise ServerError(f"{method} {url}: {error.code} {error.read().decode(errors='replace')}", error.code) from None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
        raise ServerError(f"{method} {url}: {error}") from None


class ServerProcess:
    """`python -m lm_human_preference_details.grpo.serving.server FLAGS` as a child process at `host` (loopback
    unless other nodes reach it too), on a port the OS picks (`--port 0`, read back through `--port-file`): a port
    chosen beforehand could be taken by another process before the server binds it, and /health would then be
    answered by that one."""

    def __init__(
        self,
        flags: list[str],
        log_file,
        env: dict | None = None,
        command: list[str] | None = None,
        host: str = "127.0.0.1",
    ):
        """`command` starts the server (default: this interpreter's `grpo.serving.server`; `vllm_env.server_command()`
        for the vLLM one); `flags` follow it, then the listening address this class reads back."""
        folder = tempfile.mkdtemp(prefix="grpo-server-")
        self._port_file = os.path.join(folder, "port")
        self._remove_folder = weakref.finalize(
            self, shutil.rmtree, folder, ignore_errors=True
        )  # also if never waited for
        self.host = host
        command = command or [sys.executable, "-m", "lm_human_preference_details.grpo.serving.server"]
        self.process = subprocess.Popen(
            [*command, *flags, "--host", host, "--port", "0", "--port-file", self._port_file],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def wait_until_serving(self, timeout_s: float = 600, while_waiting: Callable[[], None] = lambda: None) -> str:
        """The server's URL, once it answers /health; RuntimeError if it exits first or `timeout_s` passes
        (loading a model can take minutes). `while_waiting()` is called between two looks: what it raises
        ends the wait (the launcher checks on its other processes)."""
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self._port_file):
            while_waiting()
            if self.process.poll() is not None and not os.path.exists(self._port_file):
                raise RuntimeError(f"the server exited with status {self.process.returncode} before listening")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not listening within {timeout_s:.0f} s")
            time.sleep(0.05)
        with open(self._port_file) as f:
            url = f"http://{self.host}:{int(f.read())}"
        self._remove_folder()
        while True:
            while_waiting()
            if self.process.poll() is not None:
                raise RuntimeError(f"the server at {url} exited with status {self.process.returncode}")
            try:
                request_json("GET", f"{url}/health", timeout_s=2)
                return url
            except ServerError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server at {url} did not answer within {timeout_s:.0f} s") from None
                time.sleep(0.1)
