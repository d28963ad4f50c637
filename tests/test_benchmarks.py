"""benchmarks/learning_curves.py in a seconds-long smoke mode: real runs of the stage, CSV and PNGs."""

import csv
import json
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_learning_curves_over_two_seeds_with_a_baseline(tmp_path):
    reward = tmp_path / "reward"
    subprocess.run([sys.executable, "-m", "lm_human_preference_details.train_reward", "--task", "tiny", "--output-dir", str(reward),
                    "--wandb-mode", "disabled", "--labels.num-train", "256", "--labels.num-test", "0"], check=True, capture_output=True)
    baseline = tmp_path / "baseline.csv"
    baseline.write_text("step,metric,value,seed\n1,objective/kl,0.0,1\n2,objective/kl,1.0,1\n")
    out = tmp_path / "curves"
    load_script("learning_curves").main([
        "--task", "tiny", "--seeds", "1", "2", "--out-dir", str(out), "--baseline", str(baseline),
        "--", "--ppo.total-episodes", "128", "--rewards.trained-model", str(reward / "reward_model"),
    ])
    with open(out / "curves.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["seed"] for r in rows} == {"1", "2"}
    assert {(r["seed"], r["step"]) for r in rows if r["metric"] == "objective/kl"} == {(s, t) for s in "12" for t in "12"}
    for metric in ("objective_scores", "objective_kl", "ppo_policy_approxkl"):
        assert (out / f"{metric}.png").read_bytes()[:4] == b"\x89PNG"


def test_mean_std_by_step():
    curves = load_script("learning_curves")
    rows = [{"step": 1, "value": 1.0}, {"step": 1, "value": 3.0}, {"step": 2, "value": 5.0}]
    assert curves.mean_std_by_step(rows) == ([1, 2], [2.0, 5.0], [1.0, 0.0])


@pytest.mark.slow
def test_grpo_speed_runs_both_schedules_and_times_an_update(tmp_path):
    out = tmp_path / "speed"
    load_script("grpo_speed").main(["--steps", "6", "--repeats", "1", "--sync-steps", "4", "--update-models", "tiny-math",
                                    "--updates", "2", "--out-dir", str(out)])
    results = json.loads((out / "results.json").read_text())
    assert set(results["runs"]) == {"pipeline", "sync G=4"}
    for (run,) in results["runs"].values():
        assert run["samples_per_s"] > 0 and run["tokens_per_s"] > 0
    assert results["runs"]["sync G=4"][0]["lag_mean"] == pytest.approx(7 / 6)  # lags 0, 1, 2, 3 then 0, 1
    (update,) = results["updates"]
    assert update["model"] == "tiny-math" and update["tensors"] == 28 and update["broadcast_s"] > 0 and update["pause_s"] > 0
    table = (out / "results.md").read_text()
    assert "| pipeline |" in table and "| sync G=4 |" in table and "| tiny-math |" in table


@pytest.mark.slow
def test_learning_curves_of_the_grpo_stage(tmp_path):
    out = tmp_path / "grpo"
    load_script("learning_curves").main(["--stage", "grpo.launch", "--task", "tiny", "--seeds", "1", "--out-dir", str(out),
                                         "--", "--steps", "3"])
    with open(out / "curves.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["metric"], r["step"]) for r in rows if r["metric"] in ("success/rate", "lag/mean")} == {
        (m, s) for m in ("success/rate", "lag/mean") for s in "123"}
    assert (out / "success_rate.png").read_bytes()[:4] == b"\x89PNG"
