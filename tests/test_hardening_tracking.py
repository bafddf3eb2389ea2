"""Issue 21, tracking: MLflow runs that recover, `make share`/`verify`/`setup` that explain
themselves. Each fault is real: runs and experiments deleted in a real store, a second store,
real make with a real remote missing, a real thread-count change, a real wrong `python3`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import mlflow
import pytest

from stages import tracking
from stages.config import MlflowConfig, Params, flatten
from tests.conftest import ROOT, VENV_BIN, copy_params, env_with, run

# ------------------------------------------------------------ 1, 2: a run that recovers


@pytest.fixture(scope="module")
def other_store(tmp_path_factory) -> str:
    """A second sqlite store, made once (migrations: ~6 s)."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('other') / 'mlflow.db'}"
    mlflow.MlflowClient(uri).search_experiments()
    return uri


def trained_dir(tmp_path: Path, cfg: MlflowConfig, params: dict) -> tuple[Path, str]:
    """What train leaves, with the real calls train makes: a run with its params, a model
    file, its metrics and history, and run.json linking them."""
    train_dir = tmp_path / "models/train"
    train_dir.mkdir(parents=True)
    (train_dir / "model.pt").write_bytes(uuid.uuid4().bytes)
    (train_dir / "metrics.json").write_text('{"best_val_acc": 0.9, "epochs_run": 2}')
    (train_dir / "history.csv").write_text("epoch,val_acc\n1,0.8\n2,0.9\n")
    with tracking.start_run(cfg) as run:
        run.log_params(params)
        tracking.link_model(run, train_dir / "model.pt")
    return train_dir, run.run_id


def evaluate(cfg: MlflowConfig, params: dict, meta: dict, train_dir: Path) -> tuple[str, list]:
    """What evaluate does with MLflow: the run it logged into, and the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracking.experiment_run(cfg, params, meta, train_dir) as run:
            run.log_evaluation({"accuracy": 0.95, "loss": 0.1, "n": 360})
    return run.run_id, [str(w.message) for w in caught]


FAULTS = ["none", "run deleted", "experiment deleted", "another store", "no run id",
          "eval param changed"]


@pytest.mark.parametrize("fault", FAULTS)
def test_later_stages_recover_tracking_after_a_lost_or_stale_run(fault, tmp_path, monkeypatch,
                                                                 mlflow_uri, other_store, digits):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    cfg = MlflowConfig(experiment=f"recover-{uuid.uuid4().hex[:8]}")
    params = flatten(Params())
    train_dir, trained = trained_dir(tmp_path, cfg, params)
    client = mlflow.MlflowClient(mlflow_uri)
    exp_id = client.get_run(trained).info.experiment_id
    store = mlflow_uri
    if fault == "run deleted":
        client.delete_run(trained)
    elif fault == "experiment deleted":
        client.delete_experiment(exp_id)
    elif fault == "another store":
        monkeypatch.setenv("MLFLOW_TRACKING_URI", other_store)
        store = other_store
    elif fault == "no run id":  # trained while the store was down
        link = json.loads((train_dir / "run.json").read_text())
        (train_dir / "run.json").write_text(json.dumps({**link, "run_id": None}))
    elif fault == "eval param changed":
        params = {**params, "eval.batch_size": 128}
    before = (train_dir / "run.json").read_text()

    logged_into, said = evaluate(cfg, params, {**digits[1]}, train_dir)
    client = mlflow.MlflowClient(store)
    got = client.get_run(logged_into)
    assert got.info.lifecycle_stage == "active" and got.info.status == "FINISHED"
    assert got.data.metrics["eval/accuracy"] == 0.95
    # The run's params are the ones its metrics were produced with.
    assert got.data.params == {k: str(v) for k, v in params.items()}
    assert client.get_experiment(got.info.experiment_id).name == cfg.experiment
    if fault in ("none", "experiment deleted"):  # restored with its runs: the same run
        assert logged_into == trained and (train_dir / "run.json").read_text() == before
        assert said == ([] if fault == "none" else
                        [f"MLflow experiment {cfg.experiment!r} was deleted in {store}; restored "
                         "it with its runs (delete them one by one, or rename mlflow.experiment)"])
        return
    assert logged_into != trained and len(said) == 1, said
    assert said[0].startswith(f"{train_dir / 'run.json'}: ") and logged_into in said[0]
    # With no run id, the store's run that logged this model's MD5 (found here: the same run).
    assert got.data.tags["training_run_id"] == trained
    assert got.data.tags["mlflow.note.content"].startswith("A run of its own: ")
    assert "restored_from_run_cache" not in got.data.tags
    assert {"val/best_acc", "val/acc"} <= set(got.data.metrics)  # the training's, from DVC outputs
    assert json.loads((train_dir / "run.json").read_text())["run_id"] == logged_into
    assert got.data.tags.get("training_tracking_uri") == (
        f"{mlflow_uri}" if fault == "another store" else None)
    if fault == "eval param changed":
        assert "eval.batch_size: 512 -> 128" in said[0]
        old = mlflow.MlflowClient(mlflow_uri).get_run(trained)
        assert old.data.params["eval.batch_size"] == "512" and not old.data.metrics
    if fault == "run deleted":  # the deleted run is left as the user left it
        assert mlflow.MlflowClient(mlflow_uri).get_run(trained).info.lifecycle_stage == "deleted"
    # Recovered for good: the next stage (export) logs into the new run, without a word.
    assert evaluate(cfg, params, {**digits[1]}, train_dir) == (logged_into, [])


# ------------------------------------------------------------ 3, 4: make share, make verify

# A stage whose outputs depend on torch's thread count, as real training does in its last bits.
THREADS_STAGE = """\
stages:
  work:
    cmd: python -c "import json, torch; t = torch.get_num_threads();
      open('model.bin', 'w').write(str(t)); json.dump(dict(threads=t), open('metrics.json', 'w'))"
    outs:
      - model.bin
    metrics:
      - metrics.json:
          cache: false
"""


def make(repo: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The repo's own Makefile, on the venv the tests run in."""
    return run(["make", "-s", *args, f"VENV={VENV_BIN.parent}"], repo, env=env_with(**env),
               check=False)


def last_lines(p: subprocess.CompletedProcess) -> list[str]:
    """stderr less make's own `make: *** [...] Error 1`: the recipe's words."""
    return [line for line in p.stderr.splitlines() if line.strip() and not line.startswith("make:")]


@pytest.fixture(scope="module")
def dvc_repo(tmp_path_factory) -> Path:
    """A git + DVC repo with this Makefile and stages/, one stage run and committed."""
    repo = tmp_path_factory.mktemp("dvc_repo")
    for name in ("Makefile", "requirements.lock", ".dvc/config"):
        (repo / name).parent.mkdir(exist_ok=True)
        shutil.copy2(ROOT / name, repo / name)  # copy2: the venv's stamp stays newer than the lock
    shutil.copytree(ROOT / "stages", repo / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    copy_params(repo)  # make repro and make verify check it before DVC reads it
    (repo / "dvc.yaml").write_text(THREADS_STAGE)
    run(["git", "init", "-q", "-b", "main"], repo)
    run(["dvc", "init", "-q", "--force"], repo)
    shutil.copy2(ROOT / ".dvc/config", repo / ".dvc/config")
    run(["dvc", "repro", "-q"], repo, env=env_with(OMP_NUM_THREADS="1"))
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "init"], repo)
    return repo


def workspace_state(repo: Path) -> dict:
    return {"files": {f: (repo / f).read_bytes() for f in ("dvc.lock", "model.bin", "metrics.json",
                                                         ".dvc/config")},
            "git": run(["git", "status", "--porcelain"], repo).stdout,
            "cache": sorted(p.name for p in (repo / ".dvc/cache").rglob("*") if p.is_file())}


@pytest.mark.parametrize("remote, expected", [
    (None, "error: no DVC remote to share to: add one with `dvc remote add -d NAME URL`"),
    ("s3://bucket/x", "error: the DVC remote 'r' (s3://bucket/x) needs the package dvc-s3: "
                      "`.venv/bin/pip install dvc-s3`, then rerun `make share`"),
    ("http://127.0.0.1:{port}/x", "error: could not push to the DVC remote 'r' "
                                  "(http://127.0.0.1:{port}/x): 1 files failed to upload "
                                  "(Cannot connect to host 127.0.0.1:{port}"),
    ("{tmp}/file/under", "error: could not push to the DVC remote 'r' ({tmp}/file/under): "
                         "[Errno 20] Not a directory: '{tmp}/file/under/"),
])
def test_make_share_without_a_usable_remote_is_one_line(dvc_repo, tmp_path, remote, expected):
    from tests.workspaces import closed_port

    repo = tmp_path / "repo"
    shutil.copytree(dvc_repo, repo, symlinks=True)
    (tmp_path / "file").write_text("a file, not a folder")
    fill = {"port": closed_port(), "tmp": tmp_path}
    if remote:
        run(["dvc", "remote", "add", "--local", "-d", "r", remote.format(**fill)], repo)
    before = workspace_state(repo)
    p = make(repo, "share")
    assert p.returncode == 2 and last_lines(p) == last_lines(p)[-1:], p.stderr
    assert last_lines(p)[0].startswith(expected.format(**fill)), p.stderr
    assert workspace_state(repo) == before  # nothing lost, nothing half-pushed locally


def test_make_verify_on_another_thread_count_names_the_outputs_and_the_way_back(dvc_repo, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(dvc_repo, repo, symlinks=True)
    before = workspace_state(repo)
    p = make(repo, "verify", OMP_NUM_THREADS="1")
    assert p.returncode == 0 and "verified: every output is byte-identical" in p.stdout, p.stderr

    p = make(repo, "verify", OMP_NUM_THREADS="2")
    assert p.returncode == 2 and len(last_lines(p)) == 1, p.stderr
    line = last_lines(p)[0]
    assert line.startswith("error: NOT reproduced: a rerun changed metrics.json, model.bin. "), line
    assert "thread count (OMP_NUM_THREADS)" in line
    assert (repo / "model.bin").read_text() == "2"  # the rerun's outputs, as the line says
    back = line.split("to get the previous ones back: ")[1]
    assert back == "git checkout -- dvc.lock metrics.json && dvc checkout"
    run(["bash", "-c", back], repo)  # the advice, as a user pastes it
    assert workspace_state(repo) | {"cache": []} == before | {"cache": []}
    assert "up to date" in run(["dvc", "status"], repo).stdout


# ------------------------------------------------------------ 5: a wrong Python

def test_make_refuses_a_wrong_python_and_never_reuses_its_venv(tmp_path):
    """A `python3` that is 3.7 first on PATH: one line, no .venv; a .venv left by it (no
    stamp) is made again by the right Python. In a copy of the Makefile: the real .venv is
    never touched."""
    work, bin_dir = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    bin_dir.mkdir()
    shutil.copy(ROOT / "Makefile", work)
    (work / "stages/lib").mkdir(parents=True)  # what `make setup` runs from the checkout: pip's narrator
    for name in ("__init__.py", "lib/__init__.py", "lib/pip_progress.py"):
        shutil.copy(ROOT / "stages" / name, work / "stages" / name)
    (work / "requirements.lock").write_text("# nothing to install\n")
    fake = bin_dir / "python3"
    fake.write_text('#!/bin/sh\necho "Python 3.7.17"\n')
    fake.chmod(0o755)
    env = {**env_with(), "PATH": f"{bin_dir}:{os.environ['PATH']}"}

    p = run(["make", "-s", "setup"], work, env=env, check=False)
    assert p.returncode == 2 and last_lines(p) == [
        f"error: Python >= 3.11 needed, but python3 is 3.7.17 ({fake}); pick another: "
        "make PYTHON=python3.11"], p.stderr
    assert not (work / ".venv").exists()

    (work / ".venv/bin").mkdir(parents=True)  # what a 3.7 left: a venv, and no stamp
    shutil.copy(fake, work / ".venv/bin/python")
    p = run(["make", "-s", "setup", f"PYTHON={sys._base_executable}"], work, env=env, check=False)
    assert p.returncode == 0, p.stderr
    made = run([str(work / ".venv/bin/python"), "--version"], work).stdout
    assert made.startswith(f"Python {sys.version_info.major}.{sys.version_info.minor}.")
    assert (work / ".venv/.installed").exists()
