"""Stage 1 end to end, through the real command line, on the offline `tiny` preset."""

import contextlib
import json
import math
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from lm_human_preference_details import cli, train_reward
from lm_human_preference_details.data import QuerySampler
from lm_human_preference_details.models import RewardModel, load_causal_lm
from lm_human_preference_details.sampling import sample_responses
from lm_human_preference_details.tasks import get_preset
from lm_human_preference_details.text import load_tokenizer
from lm_human_preference_details.tracking import read_metrics
from tests.conftest import accelerate_two_processes, signal_once_logged


def run_stage(
    *args: str, launcher: tuple[str, ...] = (sys.executable, "-m"), timeout: int = 300
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*launcher, "lm_human_preference_details.train_reward", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("reward")
    result = run_stage("--task", "tiny", "--output-dir", str(out), "--wandb-mode", "offline")
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.slow
def test_tiny_preset_learns_the_labeler(tiny_run):
    metrics = read_metrics(tiny_run / "metrics.jsonl")
    test_accuracy = [m["test/accuracy"] for m in metrics if "test/accuracy" in m]
    assert test_accuracy and test_accuracy[-1] >= 0.5, test_accuracy  # chance is 0.25
    assert any("norm/before/std" in m for m in metrics) and any("norm/after/std" in m for m in metrics)
    args = json.loads((tiny_run / "args.json").read_text())
    assert args["preset"] == "tiny" and args["labels"]["labeler"] == "vowels"
    labels = json.loads((tiny_run / "labels.json").read_text())
    assert len(labels) == 1536 + 256 and set(labels[0]) == {"query", "sample0", "sample1", "sample2", "sample3", "best"}
    assert list((tiny_run / "wandb").glob("offline-run-*")), "wandb should have logged offline"


@pytest.mark.slow
def test_normalized_reward_of_fresh_reference_samples_is_standard(tiny_run):
    """After `normalize_after`, reference-policy samples the model never saw score mean ~0, std ~1."""
    task = get_preset("tiny").task
    tokenizer = load_tokenizer(task.base_model)
    pad_id = tokenizer.oai_pad_token_id
    reward_model = RewardModel.load(str(tiny_run / "reward_model"))
    ref_lm = load_causal_lm(task.base_model)
    torch.manual_seed(12345)
    sampler = QuerySampler(task, tokenizer, batch_size=256, seed=777)
    rewards = []
    with torch.no_grad():
        for _ in range(8):
            queries = next(sampler)
            responses, _ = sample_responses(ref_lm, queries, pad_id, task.response_length, task.temperature)
            rewards.append(reward_model(torch.cat([queries, responses], 1), pad_id))
    rewards = torch.cat(rewards)
    # 2048 samples: the standard error of the mean is about 0.02
    assert abs(rewards.mean().item()) < 0.15
    assert abs(rewards.std(unbiased=False).item() - 1) < 0.15


@pytest.mark.slow
def test_two_processes_over_gloo(tmp_path):
    out = tmp_path / "ddp"
    result = run_stage(
        "--task",
        "tiny",
        "--output-dir",
        str(out),
        "--wandb-mode",
        "disabled",
        "--labels.num-train",
        "512",
        "--labels.num-test",
        "128",
        "--normalize-samples",
        "128",
        launcher=(*accelerate_two_processes(), "-m"),
    )
    # the launcher's own traceback of a failed rank takes the last 3000 characters; the rank's words are before it
    assert result.returncode == 0, result.stderr[-10000:]
    metrics = read_metrics(out / "metrics.jsonl")
    assert [m["step"] for m in metrics if "train/loss" in m] == list(range(1, 512 // 32 + 1))
    assert all(math.isfinite(m["train/loss"]) for m in metrics if "train/loss" in m)
    assert RewardModel.load(str(out / "reward_model")) is not None


SMALL = ["--task", "tiny", "--labels.num-train", "128", "--labels.num-test", "0", "--batch-size", "16"]
SMALL += ["--normalize-samples", "64", "--rollout-batch-size", "64", "--wandb-mode", "disabled"]
"""the tiny preset cut to 8 steps of 16 labels, for the runs that test mechanics, not learning"""


@pytest.mark.slow
def test_a_signalled_run_stops_after_its_step_with_a_checkpoint_and_resumes_bitwise(tmp_path, monkeypatch, capsys):
    """SIGTERM during training: the run stops after the step in flight with status 75, its line and a checkpoint
    of that step; --resume then ends with the reward model of a run never stopped (its labels, made on the spot,
    read back; its normalization before training not redone), and every step logged once. Those two runs in this
    process, to save their start-up."""
    signalled = tmp_path / "signalled"
    process = subprocess.Popen(
        [sys.executable, "-m", "lm_human_preference_details.train_reward", *SMALL, "--output-dir", str(signalled)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    signalled_after, _ = signal_once_logged(process, signalled / "metrics.jsonl", 2)
    _, err = process.communicate(timeout=120)
    assert process.returncode == cli.PREEMPTED, err[-3000:]
    found = re.search(r"^stopped at step (\d+) of 8 on SIGTERM: rerun with --resume$", err, re.MULTILINE)
    assert found and signalled_after <= int(found[1]) <= signalled_after + 1 < 8, err[-3000:]
    stopped_at = int(found[1])
    assert [m["step"] for m in read_metrics(signalled / "metrics.jsonl")] == list(range(stopped_at + 1))  # 0: norm
    assert torch.load(signalled / "checkpoint" / "state.pt", weights_only=False)["loop"]["step"] == stopped_at
    assert not (signalled / "reward_model").exists()

    for argv in (
        [*SMALL, "--output-dir", str(tmp_path / "straight")],
        [*SMALL, "--output-dir", str(signalled), "--resume"],
    ):
        monkeypatch.setattr(sys, "argv", ["train_reward", *argv])
        train_reward.main()
    resumed_out = capsys.readouterr().out.split("saved the reward model")[1]
    assert f"resumed after step {stopped_at}" in resumed_out
    assert "making" not in resumed_out and "normalize before" not in resumed_out  # done before the checkpoint
    for name in ("model.safetensors", RewardModel.HEAD_FILE):
        straight = load_file(tmp_path / "straight" / "reward_model" / name)
        resumed = load_file(signalled / "reward_model" / name)
        assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight), name
    assert read_metrics(signalled / "metrics.jsonl") == read_metrics(tmp_path / "straight" / "metrics.jsonl")


def bad_label_file(tmp_path, text: str) -> str:
    path = tmp_path / "labels.json"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda tmp: ["--task", "no-such-task"], "--task 'no-such-task' is unknown"),
        (
            lambda tmp: ["--task", "tiny", "--labels.num-train", "100"],
            "labels.num_train=100 must be a positive multiple of batch_size=32",
        ),
        (lambda tmp: ["--task", "tiny", "--labels.source", bad_label_file(tmp, "{not json")], "not JSON"),
        (lambda tmp: ["--task", "tiny", "--labels.source", str(tmp / "missing.json")], "no such file"),
        (
            lambda tmp: [
                "--task",
                "tiny",
                "--labels.source",
                bad_label_file(tmp, json.dumps([{"query": [1] * 16, "best": 0}])),
            ],
            "record 0: field 'sample0'",
        ),
        (
            lambda tmp: ["--task", "tiny", "--labels.labeler", "nosuchmodule:score"],
            "labeler 'nosuchmodule:score' cannot be loaded",
        ),
        (lambda tmp: ["--task", "tiny", "--batch-size", "-32"], "--batch-size must be > 0, got -32"),  # 1536 % -32 == 0
        (lambda tmp: ["--task", "tiny", "--rollout-batch-size", "0"], "--rollout-batch-size must be > 0, got 0"),
        (lambda tmp: ["--task", "tiny", "--task.temperature", "0"], "--task.temperature must be > 0, got 0.0"),
        (
            lambda tmp: ["--task", "tiny", "--task.truncate-token", "34"],
            "--task.truncate-token 34 is outside the tokenizer's vocabulary [0, 34)",
        ),
        (
            lambda tmp: ["--task", "tiny", "--task.base-model", "no-such-model"],
            "model 'no-such-model' cannot be loaded",
        ),  # the hub is offline
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, monkeypatch, capsys, make_args, message):
    """The script's own entry point, in process (the subprocess test below shows the same through python -m)."""
    monkeypatch.setattr(
        sys,
        "argv",
        ["train_reward", *make_args(tmp_path), "--output-dir", str(tmp_path / "out"), "--wandb-mode", "disabled"],
    )
    with pytest.raises(SystemExit) as exit_info:
        train_reward.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_bad_input_through_the_real_command_line(tmp_path):
    result = run_stage("--task", "tiny", "--batch-size", "5", "--output-dir", str(tmp_path), "--wandb-mode", "disabled")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        result.stderr.strip().splitlines()[-1]
        == "error: labels.num_train=1536 must be a positive multiple of batch_size=5"
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-labels", "0"], "error: --num-labels must be > 0, got 0"),
        (["--num-responses", "1"], "error: --num-responses must be > 1, got 1"),
        (["--batch-size", "0"], "error: --batch-size must be > 0, got 0"),
    ],
)
def test_make_labels_refuses_sizes_that_make_no_labels(tmp_path, flags, message):
    cmd = [
        sys.executable,
        "-m",
        "lm_human_preference_details.make_labels",
        "--task",
        "tiny",
        "--output",
        str(tmp_path / "l.json"),
        *flags,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [message], result.stderr


def test_make_labels_cli_writes_oai_format_and_logs_its_progress(tmp_path):
    """With its output in a pipe (a log file on a cluster) the labelling still says where it is, in plain lines."""
    out = tmp_path / "labels.json"
    cmd = [
        sys.executable,
        "-m",
        "lm_human_preference_details.make_labels",
        "--task",
        "tiny",
        "--num-labels",
        "10",
        "--output",
        str(out),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    progress = [line for line in result.stderr.splitlines() if line.startswith("labels: ")]
    assert progress[0] == "labels: 0/10 (0%), ?label/s, 00:00 elapsed, ? left", result.stderr
    assert progress[-1].startswith("labels: 10/10 (100%), "), result.stderr
    records = json.loads(out.read_text())
    task = get_preset("tiny").task
    assert len(records) == 10
    for r in records:
        assert len(r["query"]) == task.query_length and 0 <= r["best"] < 4
        assert all(len(r[f"sample{k}"]) == task.response_length for k in range(4))


def test_reference_reward_stats_stay_on_the_models_device_and_count_their_batches(monkeypatch, capsys):
    """On a GPU the rewards, and so the sums reduced across processes, are on the GPU: the sample count must
    be too (`torch.stack` refuses a CPU tensor among CUDA ones). The `meta` device stands in for CUDA here. Its
    batches are counted in a log file (minutes of sampling before and after training, silent until then)."""
    device = torch.device("meta")
    monkeypatch.setattr(
        train_reward,
        "sample_responses",
        lambda lm, contexts, *a, **k: (torch.zeros(len(contexts), 3, dtype=torch.long, device=device), None),
    )
    monkeypatch.setattr(train_reward, "format_queries", lambda queries, tokenizer, task: queries)
    tokenizer = type("Tokenizer", (), {"oai_pad_token_id": 9, "__len__": lambda self: 7})()
    sampler = type("Sampler", (), {"batch_size": 4, "__next__": lambda self: torch.zeros(4, 2, dtype=torch.long)})()
    reduced = []

    def reduce(tensor, reduction):  # one process: the sums as they are (meta tensors hold no values: 4 rewards of 1)
        reduced.append((tensor.device, reduction))
        return torch.tensor([4.0, 4.0, 4.0], dtype=torch.float64)

    accelerator = type(
        "Accelerator",
        (),
        {
            "device": device,
            "num_processes": 1,
            "is_local_main_process": True,
            "reduce": staticmethod(reduce),
            "autocast": contextlib.nullcontext,
        },
    )()
    reward_model = lambda ids, pad_id: torch.ones(len(ids), device=device)  # noqa: E731
    mean, std = train_reward.reference_reward_stats(
        reward_model, None, sampler, get_preset("tiny").task, tokenizer, 8, accelerator, desc="normalize before"
    )
    assert reduced == [(device, "sum")] and (mean, std) == (1.0, 0.0)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("normalize before: 0/2 (0%)") and lines[-1].startswith("normalize before: 2/2 (100%)")


@pytest.mark.parametrize("mean, std", [(0.5, 0.0), (math.nan, 1.0), (0.5, math.nan), (0.5, math.inf)])
def test_normalize_refuses_rewards_it_cannot_map_to_a_standard_normal(mean, std):
    """A std of 0 or a NaN would make gain and bias NaN or infinite, saved with the model and scoring every
    sample of stage 2 as NaN (OAI asserts the numbers are finite)."""
    calls = []
    reward_model = type(
        "RewardModel",
        (),
        {
            "gain": torch.ones(1),
            "bias": torch.zeros(1),
            "reset_reward_scale": lambda self: calls.append("reset"),
            "set_reward_norm": lambda self, **kwargs: calls.append("set"),
        },
    )()
    with pytest.raises(
        RuntimeError, match=f"normalize before: the reference samples' rewards have mean {mean} and std {std}"
    ):
        train_reward.normalize(reward_model, lambda n, desc: (mean, std), 0, None, 0, "before", None)
    assert calls == ["reset"]


def test_make_labels_labels_only_queries_whose_responses_all_pass_the_truncation_filter(monkeypatch):
    """As OAI's labelers saw only responses with the truncate token at or after truncate_after (stage 2 scores
    the others with a fixed penalty), so a query is labeled only when all its responses have it."""
    import dataclasses

    from lm_human_preference_details import make_labels
    from lm_human_preference_details.cli import UserError
    from lm_human_preference_details.text import contains_truncate_token, strip_pad

    tokenizer = load_tokenizer("tiny")
    k = tokenizer.encode("k")[0]  # the untrained-looking tiny model samples every character now and then
    task = dataclasses.replace(get_preset("tiny").task, truncate_token=k, truncate_after=1)
    lm = load_causal_lm(task.base_model)
    seen = []

    def labeler(queries, responses):
        seen.extend(responses)
        return [float(len(r)) for r in responses]

    torch.manual_seed(0)
    labels = make_labels.make_labels(
        lm,
        tokenizer,
        QuerySampler(task, tokenizer, batch_size=64, seed=0),
        task,
        labeler,
        num_labels=12,
        num_responses=2,
    )
    assert len(labels) == 12 and len(seen) >= 2 * 12
    assert all(text.endswith("k") for text in seen)  # the labeler saw passing responses only, cut after their k
    pad = tokenizer.oai_pad_token_id
    for response in labels.samples.flatten(0, 1):
        assert contains_truncate_token(response[None], k, 1).item()
        kept = strip_pad(response, pad)
        assert kept[-1] == k and k not in kept[1:-1]  # cut after the first k from index 1
    first_queries = next(QuerySampler(task, tokenizer, batch_size=12, seed=0))
    assert not torch.equal(labels.queries, first_queries)  # queries with a failing response were skipped

    monkeypatch.setattr(make_labels, "MAX_BATCHES_WITHOUT_LABEL", 3)
    never = dataclasses.replace(task, truncate_after=task.response_length - 1)  # 4 responses ending in k: hardly ever
    with pytest.raises(
        UserError, match=r"3 batches in a row had no query whose 4 responses all contain --task.truncate-token"
    ):
        make_labels.make_labels(
            lm,
            tokenizer,
            QuerySampler(never, tokenizer, batch_size=64, seed=0),
            never,
            labeler,
            12,
            4,
        )


def test_make_labels_shows_its_progress_in_a_terminal(monkeypatch):
    """A label's batch of samples can take minutes on a CPU: in a terminal a bar counts the labels made and the
    tokens of the batch being sampled."""
    import io

    from lm_human_preference_details import make_labels

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    task = get_preset("tiny").task
    tokenizer = load_tokenizer("tiny")
    sampler = QuerySampler(task, tokenizer, batch_size=4, seed=0)
    make_labels.make_labels(load_causal_lm("tiny"), tokenizer, sampler, task, lambda q, r: [0.0] * len(r), 6, 2)
    drawn = sys.stderr.getvalue()
    assert "labels: 100%" in drawn and "6/6" in drawn
    assert f"sampling token {task.response_length}/{task.response_length}" in drawn
