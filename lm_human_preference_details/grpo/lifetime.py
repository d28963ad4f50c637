"""The processes of a run end with the process that started them (no server left behind when a
launcher is killed with SIGKILL and cannot clean up)."""

import ctypes
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
