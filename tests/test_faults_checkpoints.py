"""Checkpoints under faults: a kill mid-write, a damaged or missing checkpoint, a full
disk, running out of memory: training resumes from what is whole or stops in one line."""

from __future__ import annotations

import errno

import pytest
import torch

from stages.checkpoints import CheckpointError, latest_checkpoint, save_checkpoint
from stages.lib import files
from stages.loop import OutOfMemory
from tests.training import cnn, fit, fit_ckpt, linear_model, same_weights


def test_kill_during_a_checkpoint_write_loses_nothing(digits, tmp_path):
    full = fit_ckpt(cnn(), digits, tmp_path / "full", epochs=3)
    part = tmp_path / "part"
    fit_ckpt(cnn(), digits, part, epochs=3)
    last = (part / "epoch-0003.pt").read_bytes()
    # What a kill leaves behind: the epoch-3 temp file complete but not renamed, a second one
    # cut mid-file, and (killed between rename and checksum) a renamed file without checksum.
    (part / "epoch-0003.pt").unlink()
    (part / "epoch-0003.sha256").unlink()
    (part / ".epoch-0003.abc123.tmp.pt").write_bytes(last)
    (part / ".epoch-0003.def456.tmp.pt").write_bytes(last[: len(last) // 3])
    (part / "epoch-0003.pt").write_bytes(last)
    with pytest.warns(UserWarning, match="epoch-0003.pt is unusable.*checksum missing"):
        state = latest_checkpoint(part)
    assert state["epoch"] == 2
    assert not list(part.glob(".*.tmp.pt"))  # stale temp files cleaned up
    resumed = fit_ckpt(cnn(seed=5), digits, part, epochs=3, resume=state)
    assert same_weights(full.model, resumed.model)


@pytest.mark.parametrize("damage", ["truncate", "bitflip"])
def test_damaged_latest_checkpoint_falls_back_with_a_warning(digits, tmp_path, damage):
    fit_ckpt(linear_model(), digits, tmp_path, epochs=2)
    latest = tmp_path / "epoch-0002.pt"
    data = bytearray(latest.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 100]
    else:
        data[len(data) // 2] ^= 0x01
    latest.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="epoch-0002.pt is unusable"):
        assert latest_checkpoint(tmp_path)["epoch"] == 1


def test_no_usable_checkpoint_fails_naming_the_files_never_restarts_silently(digits, tmp_path):
    fit_ckpt(linear_model(), digits, tmp_path, epochs=2)
    for p in tmp_path.glob("epoch-*.pt"):
        p.write_bytes(p.read_bytes()[:50])
    with pytest.warns(UserWarning), pytest.raises(CheckpointError) as err:
        latest_checkpoint(tmp_path)
    assert "epoch-0001.pt" in str(err.value) and "train.resume: never" in str(err.value)


class OOMAfter(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        if self.training:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.inner(x)


def test_out_of_memory_suggests_batch_size_and_accumulation(digits):
    with pytest.raises(OutOfMemory) as err:
        fit(OOMAfter(linear_model()), digits, n=64)
    assert "Lower batch_size" in str(err.value) and "train.accumulate" in str(err.value)


def test_disk_full_while_writing_a_checkpoint_keeps_the_previous(digits, tmp_path, monkeypatch):
    fit_ckpt(linear_model(), digits, tmp_path, epochs=1)
    before = (tmp_path / "epoch-0001.pt").read_bytes()
    real_save = torch.save

    def full_disk(obj, f):
        real_save(obj, f)
        f.truncate(100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.torch, "save", full_disk)
    with pytest.raises(OSError) as err:
        save_checkpoint({"x": torch.zeros(3)}, tmp_path, 2)
    assert err.value.errno == errno.ENOSPC
    assert "disk full while writing" in str(err.value) and "epoch-0002.pt" in str(err.value)
    assert (tmp_path / "epoch-0001.pt").read_bytes() == before
    assert not (tmp_path / "epoch-0002.pt").exists() and not list(tmp_path.glob(".*tmp*"))
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path)["epoch"] == 1
