"""Stop a stage soon, with a checkpoint, when the cluster asks: SIGTERM or SIGUSR1 (Slurm's `--signal`).

The first signal only sets a flag (`StopSignals`); the stage's loop asks `agreed` once per update, checkpoints and
raises `Preempted`, which the entry point (`cli.main_with_user_errors`) prints as one line before it exits with
`EXIT_STATUS`. A second signal ends the process at once, as the signal would without us; one within `SAME_REQUEST_S`
of the first is the same request delivered twice (Slurm signals every process of a job step, and torch's launcher,
one of them, forwards its own SIGTERM to its ranks).

Under `accelerate launch` the signal may reach the processes at different moments (torch's launcher forwards its
SIGTERM to each rank in turn; Slurm signals every process of a step itself), or only some of them: `agreed` takes the
signal any process received, over the process group, so that all stop after the same update and write one checkpoint.
torch's launcher kills its ranks 30 s after it forwarded the signal (`TORCH_ELASTIC_SHUTDOWN_TIMEOUT`), and forwards
only the signals in `PET_SIGNALS_TO_HANDLE` (SIGTERM, SIGINT, SIGHUP, SIGQUIT unless set; README: Slurm).

torch is imported where it is used: `cli` imports `Preempted` from here without paying for it.
"""

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

EXIT_STATUS = 75
"""the exit status of a preempted run: sysexits.h's EX_TEMPFAIL, "a temporary failure; the user is invited to
retry". Not 0, which a job script's `&&` or `set -e` would take for a finished run and go on to its next step; not
143 (128 + SIGTERM), which a shell reports for a process the signal killed, with no checkpoint; not 1 or 2, this
project's crash and bad input. A job script can requeue on it (`[ $? -eq 75 ] && scontrol requeue $SLURM_JOB_ID`)
where it runs the stage itself: torch's launcher exits 1 whatever its ranks' status."""

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""what `StopSignals` takes as "stop soon": Slurm's default before it kills a job, and the one users pick with
`sbatch --signal=USR1@120` (Ctrl-C, SIGINT, stays an immediate KeyboardInterrupt)"""


SAME_REQUEST_S = 1.0
"""a second signal this soon after the first is the first one again (torch's launcher forwards within milliseconds)"""


class Preempted(Exception):
    """The run stopped on a signal after its checkpoint; the message is the line the user sees."""


class StopSignals:
    """While installed (`listening`), the first SIGTERM or SIGUSR1 is remembered in `received`; a second one, past
    `SAME_REQUEST_S`, ends the process by its default action."""

    def __init__(self):
        self.received = 0
        """the number of the first signal received; 0: none yet"""
        self.received_at = 0.0
        """when (time.monotonic) the first signal came"""

    def _handle(self, signum: int, frame) -> None:
        """Remember the first signal; on a second, end the process as that signal does by default."""
        if self.received and time.monotonic() - self.received_at < SAME_REQUEST_S:
            return
        if self.received:
            os.write(2, f"\n{signal.Signals(signum).name} again: exiting now, without a checkpoint\n".encode())
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.received, self.received_at = signum, time.monotonic()
        name = signal.Signals(signum).name
        os.write(2, f"\n{name}: stopping after this step, with a checkpoint ({name} again: at once)\n".encode())

    def agreed(self, accelerator) -> str | None:
        """The name of a signal any process received (the largest number of those), or None: the same answer on
        every process. Every process calls it at the same point of each update: with several, it is an all-reduce
        of one number on the run's process group (`accelerator` None: one process without accelerate, as GRPO's
        trainer runs)."""
        signum = self.received
        if accelerator is not None and accelerator.num_processes > 1:
            import torch

            flag = torch.tensor([signum], dtype=torch.int64, device=accelerator.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            signum = int(flag.item())
        return signal.Signals(signum).name if signum else None


_listening: StopSignals | None = None
"""the process's handlers while `listening` is entered: stage 1 inside stage 2 shares stage 2's"""


@contextlib.contextmanager
def listening() -> Iterator[StopSignals]:
    """Take `SIGNALS` as "stop soon" for the block, then put the previous handlers back. Nested, the outer block's
    `StopSignals` (a signal during stage 1 inside stage 2 is one for both). Outside the main thread, where Python
    cannot install handlers, one that never receives a signal."""
    global _listening
    if _listening is not None:
        yield _listening
        return
    stop = StopSignals()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {signum: signal.signal(signum, stop._handle) for signum in SIGNALS}
    _listening = stop
    try:
        yield stop
    finally:
        _listening = None
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def stopped(step: int, total: int, unit: str, signal_name: str) -> Preempted:
    """The `Preempted` of a run stopped after `step` of `total` (`unit`: update, step) on a signal."""
    return Preempted(f"stopped at {unit} {step} of {total} on {signal_name}: rerun with --resume")
