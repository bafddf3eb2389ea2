"""A real training process killed with SIGKILL mid-run, then rerun: it resumes and ends bitwise
where an uninterrupted run ends, in the same MLflow run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from stages.data import save_prepared
from tests.conftest import ROOT, copy_params, env_with, run, set_params

pytestmark = pytest.mark.slow


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
