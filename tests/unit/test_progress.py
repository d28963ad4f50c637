"""A long phase's progress: tqdm's bar in a terminal, plain lines in a log file (real tqdm, a real thread, a short
interval)."""

import io
import re
import subprocess
import sys
import time

import pytest

from lm_human_preference_details.progress import progress_bar

INTERVAL_S = 0.3


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def wait_for_lines(stream: io.StringIO, count: int, timeout_s: float = 10) -> list[str]:
    """The stream's lines once it holds `count` of them."""
    deadline = time.monotonic() + timeout_s
    while len(lines := stream.getvalue().splitlines()) < count:
        assert time.monotonic() < deadline, f"{count} lines expected, got {lines}"
        time.sleep(0.01)
    return lines


def test_a_log_gets_a_line_at_the_start_at_each_interval_and_at_the_end(monkeypatch):
    """Done / total, the rate and the time left, as the terminal's bar shows them; a step that runs for several
    intervals (here: no update at all) still gets a line at each."""
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    started = time.monotonic()
    with progress_bar(10, "labels", "label", log_interval_s=INTERVAL_S) as bar:
        assert stderr.getvalue() == "labels: 0/10 (0%), ?label/s, 00:00 elapsed, ? left\n"
        bar.update(5)
        wait_for_lines(stderr, 2)
        assert time.monotonic() - started >= INTERVAL_S
        wait_for_lines(stderr, 3)
        assert time.monotonic() - started >= 2 * INTERVAL_S
        bar.update(5)
    ended = time.monotonic()
    lines = stderr.getvalue().splitlines()
    for line in lines[1:-1]:
        assert re.fullmatch(r"labels: 5/10 \(50%\), \d+\.\d\dlabel/s, 00:00 elapsed, 00:00 left", line), line
    assert re.fullmatch(r"labels: 10/10 \(100%\), \d+\.\d\dlabel/s, 00:00 elapsed, 00:00 left", lines[-1])
    assert len(lines) <= 2 + (ended - started) / INTERVAL_S  # the start, one per interval passed, the end
    time.sleep(2 * INTERVAL_S)
    assert stderr.getvalue().splitlines() == lines  # nothing after the end
    assert "\r" not in stderr.getvalue()  # no redraws


@pytest.mark.parametrize("terminal, main_process", [(True, True), (False, True), (True, False), (False, False)])
def test_only_the_main_process_shows_progress_and_a_terminal_gets_the_bar_alone(
    monkeypatch, capsys, terminal, main_process
):
    """A terminal gets tqdm's bar, redrawn in place, and no line of the log's; a process other than the main one shows
    nothing; a line written through the bar goes to stdout in every case."""
    stderr = Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    with progress_bar(4, "labels", "label", enabled=main_process, log_interval_s=0.05) as bar:
        time.sleep(0.2)
        bar.update(4)
        bar.write("a line")
    shown = stderr.getvalue()
    if not main_process:
        assert shown == ""
    elif terminal:
        assert "labels: 100%" in shown and "4/4" in shown and "\r" in shown and " elapsed, " not in shown
    else:
        lines = shown.splitlines()  # the start, one or more at 0.05 s intervals, the end
        assert len(lines) >= 3 and lines[-1].startswith("labels: 4/4 (100%)"), lines
    assert capsys.readouterr().out == "a line\n"


SPAWNED_BAR = """
import multiprocessing, os

def child():
    from lm_human_preference_details.progress import progress_bar
    with progress_bar(2, "model build", "step") as bar:
        bar.update()
    os._exit(0)  # as a finished rank and the GRPO trainer end

if __name__ == "__main__":
    process = multiprocessing.get_context("spawn").Process(target=child)
    process.start()
    process.join()
"""


def test_a_spawned_process_that_drew_a_bar_and_ended_at_once_leaves_no_semaphore(tmp_path):
    """The launcher's children are spawned and end with `os._exit`: a bar's lock must leave nothing for Python's
    resource tracker to warn of after the run's last line."""
    script = tmp_path / "spawned_bar.py"
    script.write_text(SPAWNED_BAR)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "model build: 1/2" in result.stderr, result.stderr
    assert "leaked semaphore" not in result.stderr, result.stderr
