"""Progress of a long phase (labels made, held-out answers, a model built, the vLLM environment made): a tqdm bar
in a terminal, plain lines in a log file.

A bar redraws one line in place, which a log file (a cluster job's output) cannot show: tqdm leaves it out there, and
a phase of minutes looked hung. Where stderr is not a terminal the same bar writes a whole line when the phase
starts, every `log_interval_s` after (from a thread of its own, so a step that takes minutes still gets its lines),
and when it ends. Imports only the standard library and tqdm: the vLLM environment, which lacks tyro, builds models.
"""

import sys
import threading

from tqdm import tqdm

# the bars' lock is a thread lock: tqdm's default holds a multiprocessing one too, whose semaphore a process ended by
# `os._exit` (a finished rank, the GRPO trainer) leaves behind, and Python's resource tracker warns of it at exit
tqdm.set_lock(threading.RLock())

LOG_INTERVAL_S = 30.0
"""seconds between a phase's lines in a log file"""
LOG_LINE = "{desc}: {n_fmt}/{total_fmt} ({percentage:.0f}%), {rate_fmt}, {elapsed} elapsed, {remaining} left{postfix}"
"""a phase's line in a log file: what the terminal's bar shows, in words"""


class LogLines(tqdm):
    """A tqdm bar that, instead of redrawing, writes `LOG_LINE` to its file at its start, every `log_interval_s`
    and at its end; lines printed meanwhile (`write`) pass untouched."""

    def __init__(self, *args, log_interval_s: float, **kwargs):
        self.log_interval_s = log_interval_s
        self.ended = threading.Event()
        super().__init__(*args, bar_format=LOG_LINE, **kwargs)
        self.print_line()
        threading.Thread(target=self.print_lines, name=f"progress of {self.desc}", daemon=True).start()

    def print_line(self) -> None:
        """The bar as it stands, as a line."""
        with self._lock:
            self.fp.write(" ".join(str(self).split()) + "\n")  # one space each: tqdm pads the rate for redraws
            self.fp.flush()

    def print_lines(self) -> None:
        """Every `log_interval_s` until the phase ends, one line: the thread's loop."""
        while not self.ended.wait(self.log_interval_s):
            self.print_line()

    def display(self, msg=None, pos=None) -> bool:
        return False  # the lines come from `print_line` alone: no redraws, whatever tqdm's own timing says

    def clear(self, nolock=False) -> None:
        pass  # a line, once written, stays: nothing to erase before `write`

    def close(self) -> None:
        if not self.disable:  # the first close: the phase ends
            self.ended.set()
            self._ema_dt = lambda: None  # the last line's rate is the whole phase's, as tqdm's own last bar
            self.print_line()
        self.leave = False  # tqdm's own closing output is a redraw: none
        super().close()


def progress_bar(
    total: int,
    desc: str,
    unit: str,
    *,
    enabled: bool = True,
    initial: int = 0,
    log_interval_s: float = LOG_INTERVAL_S,
) -> tqdm:
    """A progress bar on stderr for a long phase, only where `enabled` (the main process): a tqdm bar in a terminal,
    as the Hugging Face libraries show one; elsewhere (a log file, a test's pipe) `LogLines`, one line at the start
    and every `log_interval_s`. Lines printed while it runs go through its `write`, which puts them above a drawn
    bar (a plain print would break the bar's line)."""
    kwargs = dict(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr)
    if not enabled:
        return tqdm(**kwargs, disable=True)
    if sys.stderr.isatty():
        return tqdm(**kwargs, dynamic_ncols=True)
    return LogLines(**kwargs, log_interval_s=log_interval_s)
