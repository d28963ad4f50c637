"""The offline assets' cache: built once, however many processes ask at the same time."""

import io
import os
import sys
import threading
import time

from lm_human_preference_details.assets import _build_atomically, build_tiny_math


def write_tokenizer(folder: str) -> None:
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        f.write("{}")


def write_model(folder: str) -> None:
    write_tokenizer(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write("{}")


def test_a_rank_that_builds_no_model_files_waits_for_the_rank_that_does(tmp_path):
    """Under torch.distributed transformers saves a model on rank 0 only: rank 1's folder holds just the tokenizer.
    It must neither win the rename nor make rank 0's rename fail ("Directory not empty")."""
    path = str(tmp_path / "cache" / "tiny")
    errors = []

    def rank_zero():
        def build(folder):
            time.sleep(1.0)  # rank 1 finishes its tokenizer-only folder first
            write_model(folder)

        try:
            _build_atomically(path, build)
        except Exception as error:  # reported below: a thread's exception is lost otherwise
            errors.append(error)

    thread = threading.Thread(target=rank_zero)
    thread.start()
    _build_atomically(path, write_tokenizer, timeout_s=30)  # rank 1: returns once rank 0's folder is in place
    thread.join()
    assert errors == []
    assert sorted(os.listdir(path)) == ["config.json", "tokenizer.json"]
    assert os.listdir(tmp_path / "cache") == ["tiny"]  # no build folder left behind


def test_an_incomplete_folder_left_in_the_cache_is_rebuilt(tmp_path):
    path = str(tmp_path / "tiny")
    os.makedirs(path)
    write_tokenizer(path)
    _build_atomically(path, write_model)
    assert sorted(os.listdir(path)) == ["config.json", "tokenizer.json"]


def test_building_tiny_math_logs_its_progress_where_stderr_is_not_a_terminal(tmp_path, monkeypatch):
    """Its training takes a minute or more on a busy CPU: a log file gets lines saying how far it is."""
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    build_tiny_math(str(tmp_path), steps=3, batch_size=2)
    lines = [line for line in stderr.getvalue().splitlines() if line.startswith("building tiny-math")]
    assert lines[0] == "building tiny-math: 0/3 (0%), ?step/s, 00:00 elapsed, ? left", lines
    assert lines[-1].startswith("building tiny-math: 3/3 (100%), "), lines
