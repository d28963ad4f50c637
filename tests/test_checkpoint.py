"""The checkpoint folder's atomic swap, on the real file system."""

import os

import pytest

from lm_human_preference_details import checkpoint


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names the flushed files through Linux's /proc")
def test_swap_in_flushes_the_new_checkpoint_before_the_renames_and_the_renames_before_it_deletes_the_old(tmp_path, monkeypatch):
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
    assert flushed_first == {str(staging / "state.pt"), str(staging / "ranks" / "rng_0.pt"), str(staging), str(staging / "ranks")}
    assert events[renames[-1] + 1 :] == [("fsync", str(tmp_path))]  # the folder that holds the renamed entries
    assert (final / "state.pt").read_text() == "new" and (final / "ranks" / "rng_0.pt").read_text() == "new rng"
    assert sorted(os.listdir(tmp_path)) == ["checkpoint"]
