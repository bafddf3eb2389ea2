"""Tracking under faults: an unreachable or read-only store, two processes creating one,
a failed or killed stage's run, and the UI bound to loopback. Training never stops for them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from stages.checkpoints import latest_checkpoint
from tests.conftest import ROOT, copy_repo, env_with, run, set_params
from tests.workspaces import (
    closed_port,
    lock_entries,
    workspace,
)


@pytest.mark.slow
def test_tracking_outage_never_stops_training(tmp_path, digits, mlflow_uri):
    a = workspace(tmp_path / "a", digits)
    b = workspace(tmp_path / "b", digits)
    run([sys.executable, "-m", "stages.train"], a,
        env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri))
    down = f"http://127.0.0.1:{closed_port()}"
    t = time.perf_counter()
    p = run([sys.executable, "-m", "stages.train"], b,
            env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=down))
    assert time.perf_counter() - t < 120
    assert p.stderr.count("is unreachable") == 1, p.stderr  # one warning, not one per metric
    assert json.loads((b / "models/train/metrics.json").read_text())["epochs_run"] == 3
    # Kept in the local spool for `make sync` (tests/test_sync.py replays it).
    assert ".mlflow-spool" in json.loads((b / "models/train/run.json").read_text())["tracking_uri"]
    wa = torch.load(a / "models/train/model.pt", weights_only=True)["model"]
    wb = torch.load(b / "models/train/model.pt", weights_only=True)["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_two_processes_log_to_one_new_sqlite_store_at_once(tmp_path, digits):
    import mlflow

    store = tmp_path / "shared/mlflow.db"
    uri = f"sqlite:///{store}?timeout=60"
    dirs = [workspace(tmp_path / f"w{i}", digits, seed=str(i), **{"train.log_every": "1"})
            for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=d, text=True,
                              env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=uri),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for d in dirs]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert "unavailable" not in err and "failed" not in err, err
    client = mlflow.MlflowClient(f"sqlite:///{store}")
    for d in dirs:
        run_id = json.loads((d / "models/train/run.json").read_text())["run_id"]
        assert client.get_run(run_id).info.status == "FINISHED"
        assert len(client.get_metric_history(run_id, "val/acc")) == 3
        steps = len(client.get_metric_history(run_id, "train/loss_step"))
        assert steps == 3 * 20  # every step of 3 epochs x 20 steps, none lost


@pytest.mark.slow
def test_a_failing_stage_leaves_dvc_lock_and_marks_the_run_failed(tmp_path):
    repo = copy_repo(tmp_path / "repo", {"epochs": "2"})
    env = env_with()
    run(["dvc", "repro"], repo, env=env)
    lock = (repo / "dvc.lock").read_bytes()
    model = (repo / "models/train/model.pt").read_bytes()
    set_params(repo / "params.yaml", {"lr": "1e30"})  # diverges: a non-finite loss
    p = run(["dvc", "repro"], repo, env=env, check=False)
    assert p.returncode != 0 and "non-finite loss at step" in p.stderr
    # Every stage's entry as it was; only the params check, which passed, records the new lr.
    assert lock_entries(repo / "dvc.lock") == lock_entries(lock)

    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    exp = client.get_experiment_by_name("reprotrain")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
    assert runs[0].info.status == "FAILED" and runs[1].info.status == "FINISHED"
    # The failed run's outputs are gone (DVC removes outs before a stage), the previous model is
    # in the cache: restoring the params restores it without training.
    set_params(repo / "params.yaml", {"lr": "0.003"})
    p = run(["dvc", "repro"], repo, env=env)
    assert "Restored stage 'train' from run-cache" in p.stdout or "didn't change" in p.stdout
    assert (repo / "models/train/model.pt").read_bytes() == model


@pytest.mark.slow
def test_sigterm_marks_the_run_killed(tmp_path, digits, mlflow_uri):
    w = workspace(tmp_path / "w", digits, epochs="50", batch_size="16")
    proc = subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=w,
                            env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not list(w.glob(".checkpoints/*/epoch-0001.sha256")):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    state = latest_checkpoint(next(w.glob(".checkpoints/*")))
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err

    import mlflow

    assert mlflow.MlflowClient(mlflow_uri).get_run(state["run_id"]).info.status == "KILLED"


@pytest.mark.slow
def test_make_ui_binds_loopback_and_rejects_foreign_hosts(tmp_path):
    """Also: its last line is the runs table's address, printed once the server answers, and
    SIGTERM to make ends every server process."""
    import psutil

    port = closed_port()
    proc = subprocess.Popen(["make", "-s", "ui", f"UI_PORT={port}"], cwd=ROOT, env=env_with(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:  # make ends only when killed: the loop ends at the address
            lines.append(line.rstrip())
            if line.startswith(f"http://127.0.0.1:{port}"):
                break
        assert lines and lines[-1].startswith(f"http://127.0.0.1:{port}/#/experiments/"
                                              ) or "no experiment" in lines[-1], lines
        assert "workflowType=machine_learning" in lines[-1] or "no experiment" in lines[-1]
        assert not any("Warning" in line for line in lines), lines
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            assert r.status == 200  # already answering when the address was printed
        bound = {c.laddr.ip for c in psutil.net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
        assert bound == {"127.0.0.1"}
        api = f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/search?max_results=1"
        with urllib.request.urlopen(api, timeout=10) as r:
            assert r.status == 200
        req = urllib.request.Request(api, headers={"Host": "evil.example.com"})  # DNS rebinding
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 403
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    deadline = time.time() + 15
    while any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
              for c in psutil.net_connections("tcp")):
        assert time.time() < deadline, "the UI server outlived make ui"
        time.sleep(0.5)
    assert not [p for p in psutil.process_iter(["cmdline"])
                if str(port) in " ".join(p.info["cmdline"] or []) and "mlflow" in
                " ".join(p.info["cmdline"] or [])]


def test_a_read_only_mlflow_store_is_one_warning(tmp_path, mlflow_uri, capfd):
    import mlflow

    from stages import tracking
    from stages.config import MlflowConfig

    db = tmp_path / "mlflow.db"  # a store that has served runs, then became read-only
    shutil.copy(mlflow_uri.removeprefix("sqlite:///"), db)
    mlflow.MlflowClient(f"sqlite:///{db}").create_experiment(
        "read-only", artifact_location=(tmp_path / "art").as_uri())
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///file:{db}?mode=ro&uri=true"
    try:
        with pytest.warns(UserWarning) as caught, tracking.start_run(MlflowConfig("read-only")) as r:
            r.log_metrics({"a": 1.0})
    finally:
        del os.environ["MLFLOW_TRACKING_URI"]
    assert [str(w.message) for w in caught if "MLflow" in str(w.message)] == [
        next(str(w.message) for w in caught if "readonly database" in str(w.message))]
    assert "\n" not in str(caught[0].message)
    out = capfd.readouterr()
    assert "Traceback" not in out.err and "SQL" not in out.err, out.err
