"""Checkpoint folders: pruning removes only run folders this workspace can prove it wrote, and a
checkpoint folder that would put runs beside the repository's own files is refused."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from stages.checkpoints import (
    KEEP_OTHER_RUNS,
    STALE_RUN_S,
    check_checkpoint_root,
    open_run_dir,
    remove_run,
    tidy_other_runs,
)
from stages.config import ParamsError
from tests.conftest import ROOT, copy_repo, env_with, run, set_params

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
