"""The run's files and its wandb run (offline: the real wandb library, writing its own run folders)."""

import json

import pytest

from lm_human_preference_details.cli import UserError
from lm_human_preference_details.tracking import Tracker, read_metrics


def track(output_dir, name: str, resume_after_step: int | None = None, steps=(1, 2)) -> str:
    """A run that logs `steps`; returns its wandb run id."""
    tracker = Tracker(
        str(output_dir),
        {"lr": 1e-5},
        enabled=True,
        wandb_mode="offline",
        project="p",
        run_name=name,
        resume_after_step=resume_after_step,
    )
    for step in steps:
        tracker.log(step, {"objective/scores": float(step)})
    tracker.finish()
    return (output_dir / "wandb_run_id").read_text().strip()


def offline_runs(output_dir) -> list[str]:
    """The run id of each wandb run folder (`offline-run-<time>-<id>`) that wandb wrote."""
    return sorted(path.name.rsplit("-", 1)[1] for path in (output_dir / "wandb").glob("offline-run-*"))


def test_runs_of_one_name_get_wandb_runs_of_their_own_and_a_resumed_run_continues_its_own(tmp_path):
    """Runs of one preset and seed share their name: as one wandb run, the second's steps would be dropped
    (wandb refuses steps below the run's last). A resumed run continues its own; any name is taken."""
    first = track(tmp_path / "a", "policy_tiny_1")
    second = track(tmp_path / "b", "policy_tiny_1")
    assert first != second
    resumed = track(tmp_path / "a", "policy_tiny_1", resume_after_step=1, steps=(2, 3))
    assert resumed == first and set(offline_runs(tmp_path / "a")) == {first}  # (two inits in one second share a folder)
    assert [r["step"] for r in read_metrics(tmp_path / "a" / "metrics.jsonl")] == [1, 2, 3]
    with pytest.raises(UserError, match=r"a/metrics.jsonl\), which a new run would overwrite: start this one in"):
        track(tmp_path / "a", "policy_tiny_1")  # the same folder without --resume: refused, the logs kept
    assert [r["step"] for r in read_metrics(tmp_path / "a" / "metrics.jsonl")] == [1, 2, 3]
    (tmp_path / "a" / "metrics.jsonl").rename(tmp_path / "a" / "metrics.earlier.jsonl")
    again = track(tmp_path / "a", "policy_tiny_1")  # its logs moved away: a new run
    assert again != first and [r["step"] for r in read_metrics(tmp_path / "a" / "metrics.jsonl")] == [1, 2]
    odd = track(tmp_path / "c", "sweep: lr=1e-5; #3 'tf'?")  # an id made of the name would be refused by wandb
    assert offline_runs(tmp_path / "c") == [odd]
    assert json.loads((tmp_path / "c" / "args.json").read_text()) == {"lr": 1e-5}


def test_a_resumed_run_moves_what_was_logged_after_its_checkpoint_to_a_file_of_its_own(tmp_path, capsys):
    """Steps 3-4 logged by a run killed mid-line after its checkpoint at step 2: the resumed run logs 3-4 again after
    1-2, and the killed run's lines are kept as they were (each kill after that checkpoint in a file of its own)."""
    logged = '{"step": 1, "x": 1.0}\n{"step": 2, "x": 2.0}\n\n{"step": 3, "x": 3.0}\n{"step": 4, "x": 4.0}\n{"step'
    for kill in (1, 2):
        (tmp_path / "metrics.jsonl").write_text(logged)
        tracker = Tracker(
            str(tmp_path), {}, enabled=True, wandb_mode="disabled", project="p", run_name="r", resume_after_step=2
        )
        for step in (3, 4):
            tracker.log(step, {"x": float(step)})
        tracker.finish()
        aside = tmp_path / ("metrics.after-step-2.jsonl" if kill == 1 else "metrics.after-step-2-2.jsonl")
        assert aside.read_text() == logged[logged.index('{"step": 3') :]
        said = capsys.readouterr().out
        assert f"--resume: {tmp_path}/metrics.jsonl: the 3 lines logged after step 2" in said
        assert said.endswith(f"are moved to {aside}\n"), said
        assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()
