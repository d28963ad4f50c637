"""The processes of a run end with the process that started them (no server left behind when a
launcher is killed with SIGKILL and cannot clean up), and end at once when their work is done."""

import ctypes
import logging
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1


def exit_with_parent(parent: int | None = None) -> None:
    """End this process when `parent` (default: the current parent) is gone.

    On Linux the kernel sends SIGKILL when the parent dies (`prctl(PR_SET_PDEATHSIG)`); a watchdog
    thread covers other systems and a parent that died before this call (then we are already
    orphaned, and `parent` says whose child we were meant to be)."""
    parent = os.getppid() if parent is None else parent
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def exit_now(status: int = 0) -> None:
    """Flush the logs and standard streams, then end the process without the interpreter's teardown.

    For a process that has joined a gloo process group (the trainer, a server): the group's threads
    are still alive at interpreter exit, and tearing them down there can abort the process ("terminate
    called without an active exception", seen now and then in CI), which would turn a finished run
    into a failed one. It also skips the second or so that unloading torch and transformers takes."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
