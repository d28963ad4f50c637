"""benchmarks/learning_curves.py in a seconds-long smoke mode: real runs of the stage, CSV and PNGs."""

import csv
import importlib.util
import json
import os
import statistics
import subprocess
import time

import pytest
import torch

from tests.conftest import REPO


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_learning_curves_over_two_seeds_with_a_baseline(tmp_path, tiny_reward_model):
    """Stage 2 only, on an untrained reward model: the curves are of whatever the runs log."""
    baseline = tmp_path / "baseline.csv"
    baseline.write_text("step,metric,value,seed\n1,objective/kl,0.0,1\n2,objective/kl,1.0,1\n")
    out = tmp_path / "curves"
    load_script("learning_curves").main(
        [
            "--task",
            "tiny",
            "--seeds",
            "1",
            "2",
            "--out-dir",
            str(out),
            "--baseline",
            str(baseline),
            "--",
            "--ppo.total-episodes",
            "128",
            "--rewards.trained-model",
            tiny_reward_model,
        ]
    )
    with open(out / "curves.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["seed"] for r in rows} == {"1", "2"}
    assert {(r["seed"], r["step"]) for r in rows if r["metric"] == "objective/kl"} == {
        (s, t) for s in "12" for t in "12"
    }
    for metric in ("objective_scores", "objective_kl", "ppo_policy_approxkl"):
        assert (out / f"{metric}.png").read_bytes()[:4] == b"\x89PNG"


def test_mean_std_by_step():
    curves = load_script("learning_curves")
    rows = [{"step": 1, "value": 1.0}, {"step": 1, "value": 3.0}, {"step": 2, "value": 5.0}]
    assert curves.mean_std_by_step(rows) == ([1, 2], [2.0, 5.0], [1.0, 0.0])


def test_grpo_speed_rows_per_tensor_updates_and_one_thread_sync_are_flag_variants_of_the_launch(monkeypatch):
    for name in ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS"):  # the parse sets them: not for later tests
        monkeypatch.delenv(name, raising=False)
    speed = load_script("grpo_speed_schedules")
    names = dict(speed.schedules(speed.Args(task="tiny", sync_steps=[4, 8])))  # tiny sends its updates in buckets
    assert names == {
        "pipeline": ["--mode", "pipeline"],
        "pipeline, per-tensor updates": ["--mode", "pipeline", "--update-bucket-mb", "0"],
        "pipeline, 2 steps ahead": ["--mode", "pipeline", "--steps-ahead", "2"],
        "pipeline, 2.5 steps ahead, requests of 4 problems": [
            "--mode",
            "pipeline",
            "--steps-ahead",
            "2.5",
            "--problems-per-request",
            "4",
        ],
        "pipeline, 6 steps ahead": ["--mode", "pipeline", "--steps-ahead", "6"],
        "sync G=4": ["--mode", "sync", "--sync-steps", "4"],
        "sync G=8": ["--mode", "sync", "--sync-steps", "8"],
        "sync G=4, one thread per process": ["--mode", "sync", "--sync-steps", "4", "--threads", "1"],
    }
    assert "pipeline, per-tensor updates" not in dict(
        speed.schedules(speed.Args(task="arith"))
    )  # one per tensor already
    assert list(
        dict(
            speed.schedules(
                speed.Args(per_tensor_row=False, one_thread_row=False, sync_steps=[4], pipeline_steps_ahead=[4])
            )
        )
    ) == ["pipeline", "sync G=4"]  # 4: the preset's own, the `pipeline` row
    from lm_human_preference_details.cli import UserError

    with pytest.raises(
        UserError, match="--pipeline-steps-ahead 2.3: --steps-ahead 2.3 is 18.4 problems ahead, not a whole number"
    ):
        speed.schedules(speed.Args(task="tiny", pipeline_steps_ahead=[2.3]))  # before any run


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_grpo_speed_counts_the_machines_cpu_between_two_rows_of_the_metrics(tmp_path):
    from lm_human_preference_details import benchmarking as speed

    metrics = tmp_path / "metrics.jsonl"
    cpu = speed.SteadyCpu(str(metrics), first_row=2, last_row=4)
    cpu.start()
    with open(metrics, "w", buffering=1) as f:
        f.write("{}\n{}\n")
        wait_for(lambda: len(cpu.marks) == 1)  # the thread has seen row 2
        spent = time.process_time()
        while time.process_time() - spent < 1.0:  # one core busy
            pass
        spent = time.process_time() - spent
        f.write("{}\n{")  # row 3, and row 4 half written: not yet a row
        time.sleep(0.05)
        assert len(cpu.marks) == 1
        f.write("}\n")
    cpu.stop()  # at once: the thread's last look still sees row 4
    result = cpu.result(samples_per_row=64)
    assert set(result) == {"cores_busy", "cpu_ms_per_sample"}
    assert 0.5 <= result["cores_busy"] <= os.cpu_count() + 0.1  # this process's core, and whatever else ran
    assert result["cpu_ms_per_sample"] >= 0.9 * spent * 1e3 / (2 * 64)
    unseen = speed.SteadyCpu(str(tmp_path / "none.jsonl"), first_row=2, last_row=4)
    unseen.start()
    unseen.stop()
    assert unseen.result(samples_per_row=64) == {}  # a run that never got there: no numbers rather than wrong ones


def test_peak_rss_counts_the_memory_a_block_touched_at_its_highest_and_not_an_earlier_peak():
    from lm_human_preference_details.benchmarking import peak_rss

    mib = 2**20
    earlier = torch.ones(128 * mib // 4)  # a higher peak before the block: the reset forgets it
    del earlier
    with peak_rss() as rss:
        inside = torch.ones(48 * mib // 4)
        del inside
    assert rss.before > 0 and 46 * mib <= rss.extra < 64 * mib, rss  # pages the process held before may serve it


def test_grpo_speed_rows_are_over_the_steps_after_the_warm_up_and_the_table_shows_them():
    """Start-up is no schedule's: samples/s, tokens/s and lag leave out the first `warm` steps (the CPU columns'
    window), so that samples/s = 1000 x cores busy / CPU ms per sample holds in the table."""
    speed = load_script("grpo_speed")
    schedules = load_script("grpo_speed_schedules")
    # 8 steps of 64 samples: a slow start (1 s), then 0.1 s a step; lag 0 at first, then 1, 3 by turns (rounds of 2)
    elapsed = [1.0 + 0.1 * i for i in range(8)]
    rows = [
        {
            "time/elapsed_s": t,
            "samples": 64 * (i + 1),
            "completion/length": 6.0 if i else 20.0,
            "lag/mean": 0.0 if i < 2 else (1.0, 3.0)[i % 2],
            "success/rate": 0.5,
            "time/wait_data_s": 0.0,
        }
        for i, t in enumerate(elapsed)
    ]
    row = schedules.steady_state(rows, warm=2, round_steps=2)
    assert row["samples_per_s"] == pytest.approx(640) and row["s_per_step"] == pytest.approx(0.1)
    assert row["tokens_per_s"] == pytest.approx(640 * 6) and row["lag_steady"] == pytest.approx(2.0)
    assert row["samples_per_s_whole_run"] == pytest.approx(512 / 1.7)
    cpu = {"cores_busy": 1.28, "cpu_ms_per_sample": 2.0}  # 1000 x 1.28 / 2.0 = 640
    sync = dict(row, samples_per_s=320.0, tokens_per_s=1920.0, lag_steady=1.5)
    table = speed.markdown(speed.Args(steps=8, repeats=1), {"pipeline": [row | cpu], "sync G=4": [sync | cpu]}, [], [])
    lines: dict[str, str] = {}
    for line in table.splitlines():  # the main table's row of each (the matched-lag table's come after)
        if line.startswith(("| pipeline", "| sync")):
            lines.setdefault(line.split(" | ")[0].strip("| "), line)
    assert lines["pipeline"].startswith("| pipeline | 640 | 3840 | 6.0 | 2.00 | 0.50 | 1.28 | 2.00 | 1.00x |")
    assert lines["sync G=4"].startswith("| sync G=4 | 320 | 1920 | 6.0 | 1.50 | 0.50 | 1.28 | 2.00 | 2.00x | 2.00 |")


def test_grpo_speed_compares_each_sync_schedule_with_the_fastest_pipeline_at_no_more_lag():
    speed = load_script("grpo_speed_schedules")
    rounds = {
        "pipeline": [(100, 2.9), (120, 2.8)],
        "pipeline, 2 steps ahead": [(80, 1.4), (90, 1.6)],
        "pipeline, 6 steps ahead": [(130, 4.1), (150, 4.0)],
        "sync G=4": [(50, 1.5), (60, 1.5)],
        "sync G=8": [(70, 3.5), (60, 3.5)],
        "sync G=2": [(40, 0.5), (40, 0.5)],
    }
    runs = {name: [{"samples_per_s": s, "lag_steady": lag} for s, lag in rs] for name, rs in rounds.items()}
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    rows = {
        line.split(" | ")[0].strip("| "): line for line in speed.matched_lag(runs, med) if line.startswith("| sync")
    }
    # G=4 (lag 1.5): only the 2-ahead pipeline (median lag 1.5) is as on-policy; G=8: the 4-ahead one
    # is, and is faster than the 2-ahead; the 6-ahead one is faster still but lags more
    assert rows["sync G=4"] == "| sync G=4 | 1.50 | pipeline, 2 steps ahead | 1.50 | 1.55x | 1.60 / 1.50 |"
    assert rows["sync G=8"] == "| sync G=8 | 3.50 | pipeline | 2.85 | 1.69x | 1.43 / 2.00 |"
    assert rows["sync G=2"] == "| sync G=2 | 0.50 | none is as on-policy | - | - | - |"


@pytest.mark.slow
def test_learning_curves_of_the_grpo_stage(tmp_path):
    out = tmp_path / "grpo"
    load_script("learning_curves").main(
        ["--stage", "grpo.launch", "--task", "tiny", "--seeds", "1", "--out-dir", str(out), "--", "--steps", "3"]
        + ["--eval-every", "2"]
    )
    with open(out / "curves.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["metric"], r["step"]) for r in rows if r["metric"] in ("success/rate", "lag/mean")} == {
        (m, s) for m in ("success/rate", "lag/mean") for s in "123"
    }
    assert [r["step"] for r in rows if r["metric"] == "eval/pass@1"] == ["0", "2", "3"]  # at the steps evaluated
    assert (out / "success_rate.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "eval_pass@1.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_adam_ablation_compares_both_optimizers_on_one_reward_model(tmp_path):
    out = tmp_path / "ablation"
    load_script("adam_ablation").main(["--task", "tiny", "--seeds", "1", "--updates", "2", "--out-dir", str(out)])
    results = json.loads((out / "results.json").read_text())
    runs = results["runs"]["1"]
    assert set(runs) == {"adam_tf", "adam_torch"} and all(len(r) == 2 for r in runs.values())
    # same seed and reward model: the first rollout is the same, so only the update differs
    assert runs["adam_tf"][0]["objective/scores"] == runs["adam_torch"][0]["objective/scores"]
    assert runs["adam_tf"][0]["ppo/policy/approxkl"] != runs["adam_torch"][0]["ppo/policy/approxkl"]
    first = results["summary"]["first update"]["adam_tf"]
    assert (
        first["ppo/policy/ratio_min"] <= 1 <= first["ppo/policy/ratio_max"] and first["ppo/policy/logprob_diff_var"] > 0
    )
    assert "| approxkl |" in (out / "results.md").read_text()


class FakeRun:
    def __init__(self, name, config, history):
        self.name, self.config, self.history = name, config, history

    def scan_history(self, keys):
        return [{k: v for k, v in record.items() if k in keys} for record in self.history]


class FakeApi:
    """wandb.Api's surface that oai_baseline uses, with runs shaped like OAI's (configs wrapped in `value`)."""

    def __init__(self, runs):
        self._runs = runs

    def runs(self, path):
        assert path == "openrlbenchmark/lm-human-preferences"
        return self._runs


def test_oai_baseline_export_renames_metrics_and_keeps_the_matching_runs(tmp_path):
    def config(task, model):
        return {"task_id": {"value": task}, "task": {"value": {"policy": {"initial_model": model}}}}

    history = [
        {"_step": 0, "ppo/objective/score": 0.1, "ppo/ppo/policy/approxkl": 0.01, "ppo/objective/kl": None},
        {"_step": 1, "ppo/objective/score": 0.5, "ppo/ppo/policy/approxkl": 0.02, "ppo/objective/kl": 0.3},
    ]
    api = FakeApi(
        [
            FakeRun("seed-a", config("sentiment", "124M"), history),
            FakeRun("other-task", config("descriptiveness", "124M"), history),
            FakeRun("bigger", config("sentiment", "774M"), history),
        ]
    )
    out = tmp_path / "oai.csv"
    load_script("oai_baseline").main(["--task", "sentiment", "--out", str(out)], api=api)
    rows = load_script("learning_curves").read_long_csv(str(out), default_source="baseline")
    assert {r["seed"] for r in rows} == {"seed-a"}
    got = {(r["metric"], r["step"]): r["value"] for r in rows}
    assert got == {
        ("objective/scores", 0): 0.1,
        ("objective/scores", 1): 0.5,
        ("ppo/policy/approxkl", 0): 0.01,
        ("ppo/policy/approxkl", 1): 0.02,
        ("objective/kl", 1): 0.3,
    }
    with pytest.raises(SystemExit, match="no run"):
        load_script("oai_baseline").main(["--task", "tldr", "--out", str(out)], api=api)


@pytest.mark.slow
def test_gpu_sh_writes_every_speed_table_of_ppo_speed_and_grpo_speed(tmp_path):
    """benchmarks/gpu.sh as a lent GPU machine runs it, here on the CPU at seconds-long sizes: the smoke
    test of both speed scripts: every table they make, every kind of row but grpo_speed's two flag
    variants of a launch (per-tensor updates, one thread per process: the schedules test above and
    tests/grpo/test_launch.py), and TRL's rows where LMHPD_TRL_PYTHON and LMHPD_TRL116_PYTHON name an
    environment with it, as tests/run.sh makes them; and a short launch on one node's two CPU slots."""
    trl_python, trl116_python = os.environ.get("LMHPD_TRL_PYTHON"), os.environ.get("LMHPD_TRL116_PYTHON")
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", os.path.join(REPO, "benchmarks", "gpu.sh")],
        capture_output=True,
        text=True,
        env=dict(os.environ, OUT=str(out), DEVICE="cpu", SMOKE="1", WHEELS=str(tmp_path / "no_wheels")),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [
        "gpu_sh.log",
        "grpo_speed",
        "grpo_speed/results.json",
        "grpo_speed/results.md",
        "ppo_speed",
        "ppo_speed/results.json",
        "ppo_speed/results.md",
        "weight_sync",
        "weight_sync/results.json",
        "weight_sync/results.md",
        "world_map",
        "world_map/results.json",
    ]
    log = (out / "gpu_sh.log").read_text()
    assert "gpu.sh done in" in log
    # one node's two CPU slots: a server on one, the trainer on the other
    assert "nodes 1, servers 1, trainer processes 1" in log
    world = json.loads((out / "world_map" / "results.json").read_text())["map"]
    assert not world["colocated"] and [s["devices"] for s in world["servers"]] == [[0]]

    ppo = json.loads((out / "ppo_speed" / "results.json").read_text())
    names = {"ours", "raw"} | ({"trl"} if trl_python else set())
    assert set(ppo["main"]) == names and ppo["args"]["device"] == "cpu"
    for name, m in ppo["main"].items():
        assert m["s_per_update"] > 0 and m["peak_mib"] > 100 and len(m["runs"][0]["times"]) == 1, name
    table = (out / "ppo_speed" / "results.md").read_text()
    assert all(f"| {name} |" in table for name in names)
    (scaled,) = ppo["scaling"]
    assert scaled["batch_size"] == 8 and scaled["response_length"] == 8 and scaled["ours"] > 0 and scaled["raw"] > 0

    grpo = json.loads((out / "grpo_speed" / "results.json").read_text())
    assert set(grpo["runs"]) == {
        "pipeline",
        "pipeline, 2.5 steps ahead, requests of 4 problems",
        "sync G=4",
        "raw compute (one process)",
    } | ({"trl GRPOTrainer"} if trl116_python else set())
    for name, (run,) in grpo["runs"].items():
        assert run["samples_per_s"] > 0 and (
            "tokens_per_s" not in run or 0 < run["tokens_per_s"] <= 4 * run["samples_per_s"]
        ), name
    assert "tokens_per_s" in grpo["runs"]["pipeline"][0]
    assert grpo["runs"]["sync G=4"][0]["lag_mean"] == 1.5  # lags 0, 1, 2, 3 twice
    assert grpo["runs"]["sync G=4"][0]["lag_steady"] == 1.5  # after the first round
    assert (
        0
        < grpo["runs"]["pipeline, 2.5 steps ahead, requests of 4 problems"][0]["lag_mean"]
        < grpo["runs"]["pipeline"][0]["lag_mean"]
    )
    for name in ("pipeline", "sync G=4"):
        run = grpo["runs"][name][0]
        assert 0 < run["cores_busy"] <= os.cpu_count() + 0.1 and run["cpu_ms_per_sample"] > 0, name
    (scaled,) = grpo["scaling"]
    assert scaled["batch"] == 16 and scaled["tokens"] == 3 and scaled["pipeline"] > 0 and scaled["sync G=4"] > 0
    table = (out / "grpo_speed" / "results.md").read_text()
    assert "| pipeline |" in table and "| sync G=4 |" in table
    assert "| 16 | 3 |" in table and "At matched on-policyness" in table
    if trl116_python:
        assert grpo["runs"]["trl GRPOTrainer"][0]["lag_mean"] == 0 and "| trl GRPOTrainer |" in table

    sync = json.loads((out / "weight_sync" / "results.json").read_text())["rows"]
    assert [(r["staging"], r["transfer"], r["broadcasts"]) for r in sync] == [
        ("staged", "per_tensor", 28),
        ("staged", "buckets", 1),
        ("in_place", "per_tensor", 28),
        ("in_place", "buckets", 1),
    ]
    for r in sync:
        assert 0 < r["pause_s"] < r["end_to_end_s"] and r["raw_s"] > 0 and r["receive_s"] > 0, r
    assert (out / "weight_sync" / "results.md").read_text().splitlines()[-1].startswith("worst end to end / raw: ")
    missing = [
        name
        for name, python in (("LMHPD_TRL_PYTHON", trl_python), ("LMHPD_TRL116_PYTHON", trl116_python))
        if not python
    ]
    if missing:
        pytest.skip(
            f"{' and '.join(missing)} not set: TRL's rows not compared (bash tests/run.sh makes TRL's environments "
            "and sets both)"
        )


def test_grpo_speed_with_vllm_adds_a_pipeline_and_a_sync_row_on_it_and_names_the_home_engine(monkeypatch):
    for name in ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS"):  # the parse sets them: not for later tests
        monkeypatch.delenv(name, raising=False)
    speed = load_script("grpo_speed_schedules")
    args = speed.Args(
        task="tiny", sync_steps=[4, 8], engines=["home", "vllm"], pipeline_steps_ahead=[6], one_thread_row=False
    )
    assert dict(speed.schedules(args)) == {
        "pipeline": ["--mode", "pipeline", "--engine", "home"],
        "pipeline, per-tensor updates": ["--mode", "pipeline", "--update-bucket-mb", "0", "--engine", "home"],
        "sync G=4": ["--mode", "sync", "--sync-steps", "4", "--engine", "home"],
        "sync G=8": ["--mode", "sync", "--sync-steps", "8", "--engine", "home"],
        "pipeline, 6 steps ahead": ["--mode", "pipeline", "--steps-ahead", "6", "--engine", "home"],
        "pipeline, vLLM": ["--mode", "pipeline", "--engine", "vllm"],
        "sync G=4, vLLM": ["--mode", "sync", "--sync-steps", "4", "--engine", "vllm"],
    }
    assert [speed.row_engine(name) for name, _ in speed.schedules(args)] == ["home"] * 5 + ["vllm"] * 2


def test_grpo_speed_matches_lag_within_an_engine_and_rates_every_row_against_the_first():
    speed = load_script("grpo_speed")
    schedules = load_script("grpo_speed_schedules")
    rounds = {
        "pipeline": [(100, 2.0)],
        "sync G=4": [(50, 1.5)],
        "pipeline, vLLM": [(400, 1.0)],  # faster and more on-policy, but another engine
        "sync G=4, vLLM": [(200, 1.5)],
    }
    runs = {name: [{"samples_per_s": s, "lag_steady": lag} for s, lag in rs] for name, rs in rounds.items()}
    med = {name: rs[0] for name, rs in runs.items()}
    rows = {
        line.split(" | ")[0].strip("| "): line for line in schedules.matched_lag(runs, med) if line.startswith("| sync")
    }
    assert rows["sync G=4"] == "| sync G=4 | 1.50 | none is as on-policy | - | - | - |"
    assert rows["sync G=4, vLLM"] == "| sync G=4, vLLM | 1.50 | pipeline, vLLM | 1.00 | 2.00x | 2.00 |"
    only_vllm = {name: rs for name, rs in runs.items() if name.endswith("vLLM")}
    table = speed.markdown(speed.Args(steps=8, repeats=1, engines=["vllm"]), only_vllm, [])
    assert "| pipeline, vLLM / this (samples/s) |" in table  # the first row is the reference, whichever engine
    assert "| sync G=4, vLLM | 200 | - | - | 1.50 | - | - | - | 2.00x | 2.00 |" in table


def test_grpo_speed_table_of_generation_against_vllms_limit():
    speed = load_script("grpo_speed")
    shape = {"model": "tiny-math", "requests": 8, "prompts_per_request": 8, "n": 8, "max_tokens": 24, "in_flight": 32}
    generation = [
        {**shape, "task": "tiny", "engine": "home", "samples_per_s": 100.0, "tokens_per_s": 2400.0},
        {**shape, "task": "tiny", "engine": "vllm", "samples_per_s": 50.0, "tokens_per_s": 1200.0},
        {
            **shape,
            "task": "tiny",
            "engine": "vllm offline generate (limit)",
            "samples_per_s": 60.0,
            "tokens_per_s": 1440,
        },
        {
            **shape,
            "task": "arith",
            "model": "smollm2-135m",
            "engine": "home",
            "samples_per_s": 4.25,
            "tokens_per_s": 102,
        },
    ]
    table = speed.markdown(
        speed.Args(steps=8, repeats=1),
        {"pipeline": [{"samples_per_s": 10.0, "lag_steady": 1.0}]},
        [],
        generation,
    )
    lines = table.splitlines()
    assert lines[-4:] == [
        "| tiny | tiny-math | home | 8 x 8 x 8 | 24 | 32 | 100.0 | 2400 | 0.60x |",
        "| tiny | tiny-math | vllm | 8 x 8 x 8 | 24 | 32 | 50.0 | 1200 | 1.20x |",
        "| tiny | tiny-math | vllm offline generate (limit) | 8 x 8 x 8 | 24 | 32 | 60.0 | 1440 | 1.00x |",
        "| arith | smollm2-135m | home | 8 x 8 x 8 | 24 | 32 | 4.2 | 102 | - |",  # no limit row for arith
    ]
    assert "Generation alone" not in speed.markdown(
        speed.Args(steps=8, repeats=1), {"pipeline": [{"samples_per_s": 10.0, "lag_steady": 1.0}]}, []
    )


def test_weight_sync_tables_rate_each_row_against_the_raw_broadcast_and_end_with_the_worst():
    sync = load_script("weight_sync")
    row = {
        "model": "smollm2-135m",
        "engine": "home",
        "dtype": "bfloat16",
        "staging": "staged",
        "transfer": "buckets",
        "broadcasts": 17,
        "mib_sent": 256.5,
        "send_s": 0.31,
        "receive_s": 0.3,
        "pause_s": 0.0004,
        "end_to_end_s": 0.36,
        "raw_s": 0.24,
        "e2e_over_raw": 1.5,
    }
    worse = {**row, "engine": "vllm", "pause_s": 0.25, "end_to_end_s": 0.6, "e2e_over_raw": 2.5}
    sharded = {"model": "smollm2-135m", "model_mib": 513.1, "largest_tensor_mib": 108.0, "extra_mib": 230.4}
    lines = sync.markdown(sync.Args(), [row, worse], [{**sharded, "push_s": 0.61}]).splitlines()
    assert "| smollm2-135m | 513.1 | 108.0 | 230.4 | 610 |" in lines
    cells = "| smollm2-135m | home | bfloat16 | staged | 17 (16 MiB) | 256.5 | 310.0 | 300.0 | 0.4 | 360.0 | 240.0 |"
    assert f"{cells} 1.50x |" in lines
    assert lines[-1] == "worst end to end / raw: 2.50x (smollm2-135m, vllm, bfloat16, staged, buckets)"


def test_grpo_speed_generation_requests_are_the_actors(monkeypatch):
    for name in ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS"):  # the parse sets them: not for later tests
        monkeypatch.delenv(name, raising=False)
    speed = load_script("grpo_speed_generation")
    from lm_human_preference_details.grpo.rewards import load_task_problems

    tiny = speed.generation_settings("tiny")
    problems = [p.prompt for p in load_task_problems(tiny)]  # the 20 sums it trains on
    requests = speed.generation_prompts(tiny, 4)
    # a step's 8 problems per request (problems_per_request 0), in order, around the 20 again
    assert requests == [problems[0:8], problems[8:16], [*problems[16:20], *problems[0:4]], problems[4:12]]
    assert tiny.torch_threads("server") == (len(os.sched_getaffinity(0)))  # a server alone: every core
    shape = speed.generation_shape(speed.Args(generation_requests=3, generation_tokens=5), "tiny", tiny)
    assert shape == {
        "task": "tiny",
        "model": "tiny-math",
        "requests": 3,
        "prompts_per_request": 8,
        "n": 8,
        "max_tokens": 5,
        "in_flight": 32,  # the preset's max_in_flight
    }
    arith = speed.generation_settings("arith")
    assert [len(r) for r in speed.generation_prompts(arith, 2)] == [1, 1]  # one problem per request
    assert speed.generation_shape(speed.Args(generation_in_flight=4), "arith", arith)["in_flight"] == 4


@pytest.mark.slow
def test_grpo_speed_times_generation_alone_on_a_real_server_over_http(tmp_path, monkeypatch):
    """One generation row end to end (the home engine: vLLM's start alone takes minutes on this machine's CPU)."""
    for name in ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS"):  # the parse sets them: not for later tests
        monkeypatch.delenv(name, raising=False)
    from lm_human_preference_details.assets import resolve_model_path

    resolve_model_path("tiny-math")  # built here on first use (minutes on a busy CPU), not within the server's start
    speed = load_script("grpo_speed_generation")
    args = speed.Args(out_dir=str(tmp_path), generation_requests=3, generation_tokens=5, generation_in_flight=2)
    row = speed.time_generation(args, "tiny", "home")
    # 3 requests of the step's 8 problems x 8 samples, every sample 5 tokens long (past EOS)
    assert (row["engine"], row["sequences"], row["tokens"]) == ("home", 3 * 8 * 8, 3 * 8 * 8 * 5)
    assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"]) and row["seconds"] > 0
    assert row["decode_batch_mean"] > 1  # the requests' samples were decoded together
    assert "serving" in (tmp_path / "generation" / "tiny" / "home" / "server.log").read_text()


@pytest.mark.slow
def test_sharding_memory_puts_each_engine_beside_ddp_and_fsdp2_holds_at_most_06x_its_state(tmp_path, capsys):
    """benchmarks/sharding_memory.py on the tiny preset, every engine whose accelerate config is there: a row each
    with its ratios to DDP. ZeRO-3 with every tensor sharded, as tests/stages/test_sharding.py runs it (DeepSpeed keeps
    the tiny model's tensors, all below `stage3_param_persistence_threshold`, whole on every process)."""
    bench = load_script("sharding_memory")
    engines = [e for e in ("fsdp2", "zero2", "zero3") if os.path.isfile(os.path.join(bench.CONFIGS, f"{e}.yaml"))]
    engines.append("ddp-bf16")  # DDP under bf16 autocast
    argv = ["--task", "tiny", "--engines", "ddp", *engines, "--zero3-persistence-threshold", "0"]
    results = bench.main([*argv, "--out-dir", str(tmp_path)])
    printed = capsys.readouterr().out
    assert list(results) == ["ddp", *engines]
    ddp = results["ddp"]
    for engine, r in results.items():
        assert "error" not in r, (engine, r)
        assert r["state_gib"] > 0 and r["peak_gib"] > 0.1 and r["s_per_update"] > 0, engine
        assert len(r["runs"][0]["times"]) == 2, engine  # 3 updates, the first not timed
        ratios = (
            f"{r['state_gib'] / ddp['state_gib']:.3f}x | {r['peak_gib']:.2f} | {r['peak_gib'] / ddp['peak_gib']:.2f}x"
        )
        assert f"| {engine} | {r['state_gib']:.3f} | {ratios} |" in printed, engine
    assert "| ddp | " in printed and "| 1.000x |" in printed
    assert results["fsdp2"]["state_gib"] <= 0.6 * ddp["state_gib"]
    assert results["ddp-bf16"]["state_gib"] == ddp["state_gib"]  # autocast: parameters and Adam's state stay float32
    if "zero2" in results:  # parameters whole, optimizer state halved
        assert results["zero2"]["state_gib"] <= 0.95 * ddp["state_gib"]
    if "zero3" in results:
        # parameters and Adam's state halved, and ZeRO's float32 master partition (a copy even in float32 training)
        # on top: 3/5 of DDP's 5 copies of the policy's size, plus the partitions' alignment padding
        assert results["zero3"]["state_gib"] <= 0.601 * ddp["state_gib"]
    assert (tmp_path / "results.md").read_text() in printed
    assert not (tmp_path / "runs" / "ddp_0" / "checkpoint").exists()  # GiBs on a real model: deleted once read
