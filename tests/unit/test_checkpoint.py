"""The checkpoint folder's atomic swap, on the real file system."""

import os

import pytest

from lm_human_preference_details import checkpoint


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names the flushed files through Linux's /proc")
def test_swap_in_flushes_the_new_checkpoint_before_the_renames_and_the_renames_before_it_deletes_the_old(
    tmp_path, monkeypatch
):
    events = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(source, target):
        events.append(("rename", str(target)))
        real_rename(source, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    final, staging = tmp_path / "checkpoint", tmp_path / "checkpoint.saving"
    final.mkdir()
    (final / "state.pt").write_text("previous")
    (staging / "ranks").mkdir(parents=True)
    (staging / "state.pt").write_text("new")
    (staging / "ranks" / "rng_0.pt").write_text("new rng")

    checkpoint.swap_in(str(staging), str(final))

    renames = [i for i, (kind, _) in enumerate(events) if kind == "rename"]
    assert [events[i][1] for i in renames] == [f"{final}.old", str(final)]
    flushed_first = {path for kind, path in events[: renames[0]] if kind == "fsync"}
    assert flushed_first == {
        str(staging / "state.pt"),
        str(staging / "ranks" / "rng_0.pt"),
        str(staging),
        str(staging / "ranks"),
    }
    assert events[renames[-1] + 1 :] == [("fsync", str(tmp_path))]  # the folder that holds the renamed entries
    assert (final / "state.pt").read_text() == "new" and (final / "ranks" / "rng_0.pt").read_text() == "new rng"
    assert sorted(os.listdir(tmp_path)) == ["checkpoint"]


def test_a_process_on_a_gpu_saves_and_restores_the_random_state_of_its_own_gpu_only(monkeypatch):
    """Not every visible GPU's (`get_rng_state_all`): a run resumed with fewer GPUs visible to each process failed
    with an IndexError. Checked through the calls, since this machine has no GPU."""
    import torch

    calls = []
    monkeypatch.setattr(
        torch.cuda,
        "get_rng_state",
        lambda device: calls.append(("get", device)) or torch.tensor([7], dtype=torch.uint8),
    )
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda state, device: calls.append(("set", device, state.tolist()))
    )
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("every GPU's state saved"))
    gpu = torch.device("cuda", 1)
    state = checkpoint.rng_state(gpu)
    checkpoint.set_rng_state(state, gpu)
    assert calls == [("get", gpu), ("set", gpu, [7])]
    checkpoint.set_rng_state(checkpoint.rng_state(torch.device("cpu")), gpu)  # saved on the CPU: nothing to restore
    assert "cuda" not in checkpoint.rng_state(torch.device("cpu")) and len(calls) == 2


def test_a_staged_checkpoint_replaces_the_previous_one_whole_or_not_at_all(tmp_path):
    """A block that fails leaves the previous checkpoint as it was; the next save clears what it left half written.
    `state_file` finds a checkpoint's file, also one that a save killed between its renames left as `.old`, and names
    a file its checkpoint lacks (a damaged checkpoint, which `load_or_explain` then reports, not a missing one)."""
    final = str(tmp_path / "checkpoint")
    assert checkpoint.folder(str(tmp_path)) == final and checkpoint.state_file(final, "state.json") is None
    with checkpoint.staged(final) as staging:
        (tmp_path / "checkpoint.saving" / "state.json").write_text("1")
        assert staging == final + ".saving" and not os.path.exists(final)
    assert (tmp_path / "checkpoint" / "state.json").read_text() == "1"
    with pytest.raises(RuntimeError, match="killed mid-save"), checkpoint.staged(final) as staging:
        (tmp_path / "checkpoint.saving" / "half.pt").write_text("half")
        raise RuntimeError("killed mid-save")
    assert sorted(os.listdir(final)) == ["state.json"]
    with checkpoint.staged(final):
        assert os.listdir(final + ".saving") == []  # the failed save's file is gone
        (tmp_path / "checkpoint.saving" / "state.json").write_text("2")
    assert (
        sorted(os.listdir(tmp_path)) == ["checkpoint"] and (tmp_path / "checkpoint" / "state.json").read_text() == "2"
    )
    os.rename(final, final + ".old")
    assert checkpoint.state_file(final, "state.json") == os.path.join(final, "state.json")
    assert checkpoint.state_file(final, "state.pt") == os.path.join(final, "state.pt")
