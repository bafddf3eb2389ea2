"""Checkpoints: a training killed mid-run (SIGKILL) or mid-write resumes to the
weights an uninterrupted run ends with; a damaged or missing checkpoint, a full disk or running
out of memory ends in one line or falls back to what is whole. Pruning removes only run folders
this workspace can prove it wrote, and a checkpoint folder that would put runs beside the
repository's own files is refused."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stages.checkpoints import (
    KEEP_OTHER_RUNS,
    STALE_RUN_S,
    CheckpointError,
    check_checkpoint_root,
    described,
    latest_checkpoint,
    open_run_dir,
    remove_run,
    save_checkpoint,
    tidy_other_runs,
)
from stages.config import ParamsError
from stages.data import save_prepared
from stages.loop import OutOfMemory
from tests.conftest import ROOT, copy_params, copy_repo, env_with, run, set_params
from tests.support.training import cnn, fit, fit_ckpt, linear_model, same_weights


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

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError) as err:
        save_checkpoint({"x": torch.zeros(3)}, tmp_path, 2)
    assert err.value.errno == errno.ENOSPC
    assert "disk full while writing" in str(err.value) and "epoch-0002.pt" in str(err.value)
    assert (tmp_path / "epoch-0001.pt").read_bytes() == before
    assert not (tmp_path / "epoch-0002.pt").exists() and not list(tmp_path.glob(".*tmp*"))
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path)["epoch"] == 1


WEEK_AGO = time.time() - STALE_RUN_S - 3600


def age(path: Path, when: float) -> None:
    for p in (*path.rglob("*"), path):
        os.utime(p, (when, when), follow_symlinks=False)


def our_run(root: Path, workspace: Path, i: int, when: float) -> Path:
    d = root / f"{i:016x}"
    open_run_dir(d, workspace, {"lr": 0.001 * (i + 1)})
    (d / "epoch-0001.pt").write_bytes(b"x")
    (d / "epoch-0001.sha256").write_text("0\n")
    age(d, when)
    return d


def test_pruning_removes_only_stale_runs_this_workspace_wrote(tmp_path, capsys):
    workspace, root = tmp_path / "repo", tmp_path / "shared-ckpt"
    workspace.mkdir()
    ours = [our_run(root, workspace, i, time.time() - 60 * i if i < KEEP_OTHER_RUNS + 2
                    else WEEK_AGO - i) for i in range(KEEP_OTHER_RUNS + 4)]
    # A week old and outside the newest few, like the stale runs above, but not provably ours:
    foreign = root / "other-project"  # another project's folder in a shared checkpoint folder
    (foreign / "sub").mkdir(parents=True)
    (foreign / "sub" / "weights.pt").write_bytes(b"theirs")
    clone = our_run(root, tmp_path / "another-clone", 100, WEEK_AGO)  # another workspace's run
    edited = our_run(root, workspace, 101, WEEK_AGO)  # ours, but the user put a file in it
    (edited / "notes.txt").write_text("keep me")
    forged = root / f"{102:016x}"  # our naming, no ownership record
    forged.mkdir()
    (forged / "epoch-0001.pt").write_bytes(b"x")
    target = tmp_path / "elsewhere" / f"{103:016x}"  # ours, reached through a symlink
    our_run(target.parent, workspace, 103, WEEK_AGO)
    (root / f"{104:016x}").symlink_to(target)
    for d in (foreign, clone, edited, forged, target):
        age(d, WEEK_AGO)

    tidy_other_runs(root / ("f" * 16), workspace, {"lr": 0.5})
    err = capsys.readouterr().err.splitlines()
    assert [d.exists() for d in ours] == [True] * (KEEP_OTHER_RUNS + 2) + [False] * 2
    assert (foreign / "sub" / "weights.pt").read_bytes() == b"theirs"
    assert all((d / "epoch-0001.pt").exists() for d in (clone, edited, forged, target))
    assert (edited / "notes.txt").read_text() == "keep me"
    assert len(err) == 2 and "removed 2 unfinished runs" in err[0]
    assert str(ours[0]) in err[1] and f"and {KEEP_OTHER_RUNS + 1} older" in err[1]
    assert "lr: 0.001 -> 0.5" in err[1]


def test_the_starting_afresh_note_names_every_difference_data_included(tmp_path, capsys):
    """Issue 57: the note named `epochs: 30 -> 1` only, though the data's source, channels and
    size differed too."""
    workspace, root = tmp_path / "repo", tmp_path / "ckpt"
    digits = {"source": "digits", "channels": 1, "image_size": 16, "sha256": "a" * 64}
    fashion = {"source": "fashion_mnist", "channels": 1, "image_size": 28, "sha256": "b" * 64}
    theirs = root / ("1" * 16)
    open_run_dir(theirs, workspace, described({"epochs": 30}, digits))
    (theirs / "epoch-0001.pt").write_bytes(b"x")
    tidy_other_runs(root / ("2" * 16), workspace, described({"epochs": 1}, fashion))
    (note,) = capsys.readouterr().err.splitlines()
    assert "epochs: 30 -> 1, data.source: 'digits' -> 'fashion_mnist', data.image_size: 16 -> " \
        "28, data.sha256: 'aaaaaaaaaaaa' -> 'bbbbbbbbbbbb'" in note, note


def test_a_finished_run_removes_its_own_files_only(tmp_path):
    workspace = tmp_path / "repo"
    d = our_run(tmp_path / "ckpt", workspace, 1, time.time())
    (d / ".epoch-0002.ab12_x9z.tmp.pt").write_bytes(b"partial")  # what a kill mid-write leaves
    assert remove_run(d, workspace) and not d.exists()
    d = our_run(tmp_path / "ckpt", workspace, 2, time.time())
    (d / "results").mkdir()
    assert not remove_run(d, workspace) and (d / "epoch-0001.pt").exists()


@pytest.fixture(scope="module")
def old_clone(tmp_path_factory) -> Path:
    """A clone whose every file is a week old: what the stale-run pruning took for abandoned."""
    repo = copy_repo(tmp_path_factory.mktemp("old") / "repo")
    (repo / "data/prepared").mkdir(parents=True)
    (repo / "data/prepared/train.pt").write_bytes(b"prepared")
    age(repo, WEEK_AGO)
    return repo


@pytest.mark.parametrize("ckpt_dir, why", [
    ("", "is or contains this repository"),
    (".", "is or contains this repository"),
    ("..", "is or contains this repository"),
    ("/", "is or contains this repository"),
    (".git", "inside a folder git or DVC owns"),
    (".dvc/cache", "inside a folder git or DVC owns"),
    ("data", "overlaps data/prepared"),
    ("models/train/ckpt", "overlaps models/train"),
    ("data/raw", "overlaps data/raw"),
    ("stages", "holds files git tracks (stages/"),
    (".github/..//.ci", "holds files git tracks (.ci/"),
])
def test_a_checkpoint_folder_that_holds_or_is_owned_by_the_repo_is_refused(old_clone, ckpt_dir, why):
    with pytest.raises(ParamsError, match="train.checkpoint_dir resolves to") as err:
        check_checkpoint_root(old_clone / ckpt_dir, old_clone, "data/raw")
    assert why in str(err.value) and "such as .checkpoints" in str(err.value)


def test_a_checkpoint_folder_reached_through_a_symlink_is_judged_by_its_target(old_clone, tmp_path):
    (tmp_path / "link").symlink_to(old_clone)
    with pytest.raises(ParamsError, match=f"resolves to {old_clone}, which is or contains"):
        check_checkpoint_root(tmp_path / "link", old_clone, "data/raw")
    with pytest.raises(ParamsError, match="inside a folder git or DVC owns"):
        check_checkpoint_root(tmp_path / "link/.dvc/x", old_clone, "data/raw")


def test_another_repository_as_checkpoint_folder_is_refused(old_clone, tmp_path):
    (tmp_path / "other" / ".git").mkdir(parents=True)
    with pytest.raises(ParamsError, match="is another repository"):
        check_checkpoint_root(tmp_path / "other", old_clone, "data/raw")
    check_checkpoint_root(tmp_path / "shared", old_clone, "data/raw")  # a folder of its own: fine
    check_checkpoint_root(old_clone / ".checkpoints", old_clone, "data/raw")


@pytest.mark.parametrize("ckpt_dir", ["''", "."])
def test_train_refuses_the_repo_as_checkpoint_folder_and_removes_nothing(old_clone, ckpt_dir):
    before = sorted(p.relative_to(old_clone) for p in old_clone.rglob("*"))
    params = old_clone / "params.yaml"
    saved = params.read_text()
    set_params(params, {"train.checkpoint_dir": ckpt_dir})
    try:
        p = run([sys.executable, "-m", "stages.train"], old_clone,
                env=env_with(PYTHONPATH=str(ROOT)), check=False)
    finally:
        params.write_text(saved)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().count("\n") == 0 and "train.checkpoint_dir" in p.stderr
    assert sorted(p.relative_to(old_clone) for p in old_clone.rglob("*")) == before
    assert (old_clone / ".git").is_dir() and (old_clone / ".dvc").is_dir()


def workspace(path, digits, mlflow_uri):
    splits, meta = digits
    path.mkdir()
    copy_params(path)
    # Small batches: many steps per epoch (over a second), so the kill lands inside an epoch.
    set_params(path / "params.yaml", {"epochs": "5", "batch_size": "4", "model.width": "16",
                                      "train.log_every": "5"})
    save_prepared(path / "data/prepared", splits, meta)
    return env_with(MLFLOW_TRACKING_URI=mlflow_uri, PYTHONPATH=str(ROOT))


def weights(path):
    return torch.load(path / "models/train/model.pt", weights_only=True)["model"]


def test_sigkill_then_rerun_resumes_to_identical_weights(tmp_path, digits, mlflow_uri):
    a, b = tmp_path / "a", tmp_path / "b"
    env = workspace(a, digits, mlflow_uri)
    run([sys.executable, "-m", "stages.train"], a, env=env)

    env = workspace(b, digits, mlflow_uri)
    proc = subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=b, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import mlflow

    client = mlflow.MlflowClient(mlflow_uri)
    deadline = time.time() + 300
    while not list(b.glob(".checkpoints/*/epoch-0002.sha256")):
        assert proc.poll() is None and time.time() < deadline, "training ended before epoch 2"
        time.sleep(0.02)
    # Kill once epoch 3 has logged steps of its own (MLflow's queue writes about once a second):
    # the resumed run repeats them, and must not log them twice.
    run_id = torch.load(max(b.glob(".checkpoints/*/epoch-0002.pt")), weights_only=False)["run_id"]
    epoch2 = max(m.step for m in client.get_metric_history(run_id, "train/loss_step"))
    while max(m.step for m in client.get_metric_history(run_id, "train/loss_step")) <= epoch2:
        assert proc.poll() is None and time.time() < deadline, "training ended in epoch 3"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # mid-epoch 3
    proc.wait()
    assert not (b / "models/train/model.pt").exists()
    ckpts = sorted(p.name for p in b.glob(".checkpoints/*/epoch-*.pt"))
    assert ckpts[-1] in ("epoch-0002.pt", "epoch-0003.pt")

    p = run([sys.executable, "-m", "stages.train"], b, env=env)
    assert "resuming from" in p.stderr
    assert not list(b.glob(".checkpoints/*/*.pt"))  # removed once complete

    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)

    assert json.loads((b / "models/train/run.json").read_text())["run_id"] == run_id
    r = client.get_run(run_id)
    assert r.info.status == "FINISHED"
    steps = {m.step for m in client.get_metric_history(run_id, "val/acc")}
    assert steps == {1, 2, 3, 4, 5}  # the killed epochs and the resumed ones, one run
    # Every step once, as in the uninterrupted run: nothing the kill cut off is missing, and
    # nothing logged between the last checkpoint and the kill is logged again on resume.
    uninterrupted = json.loads((a / "models/train/run.json").read_text())["run_id"]
    for key in ("val/acc", "train/loss", "train/loss_step", "train/lr_step"):
        got = [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
        want = [(m.step, m.value) for m in client.get_metric_history(uninterrupted, key)]
        assert sorted(got) == sorted(want), key
