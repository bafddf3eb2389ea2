"""Fault injection: each case injects the fault for real (a real process, file, port or signal)
and asserts that nothing is lost and the message says what to do."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from stages import files
from stages.checkpoints import CheckpointError, latest_checkpoint, save_checkpoint
from stages.data import save_prepared
from stages.loop import OutOfMemory
from tests.conftest import ROOT, copy_repo, env_with, run, set_params
from tests.training import cnn, fit, fit_ckpt, linear_model, same_weights

# ------------------------------------------------------------ 1, 2: broken checkpoint files


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


# ------------------------------------------------------------ 7: a malicious pickle


class Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))  # would create the marker file when unpickled


def test_a_malicious_pickle_is_refused_and_never_runs(tmp_path, digits):
    marker = tmp_path / "pwned"
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(ROOT / "params.yaml", work / "params.yaml")
    save_prepared(work / "data/prepared", *digits)
    (work / "models/train").mkdir(parents=True)
    with open(work / "models/train/model.pt", "wb") as f:
        pickle.dump({"model": Exploit(marker)}, f)
    (work / "models/train/run.json").write_text('{"run_id": null}')
    p = run([sys.executable, "-m", "stages.evaluate"], work,
            env=env_with(PYTHONPATH=str(ROOT)), check=False)
    assert p.returncode == 1 and "refused to load" in p.stderr and "weights_only" in p.stderr
    assert not marker.exists()
    # The same file as the newest checkpoint, with a matching checksum: skipped, never run.
    ckpt = tmp_path / "ckpt"
    fit_ckpt(linear_model(), digits, ckpt, epochs=1)
    shutil.copy(work / "models/train/model.pt", ckpt / "epoch-0009.pt")
    (ckpt / "epoch-0009.sha256").write_text(files_sha(ckpt / "epoch-0009.pt"))
    with pytest.warns(UserWarning, match="epoch-0009.pt is unusable"):
        assert latest_checkpoint(ckpt)["epoch"] == 1
    assert not marker.exists()


def files_sha(path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest() + "\n"


# ------------------------------------------------------------ 8: bad params, before any work


@pytest.mark.parametrize("edit, expected", [
    ({"lrr": None}, "unknown key 'lrr'; did you mean 'lr'"),
    ({"epochs": "'ten'"}, "epochs='ten' must be int"),
    ({"lr": "'1e-3'"}, "lr='1e-3' must be float, not str (remove the quotes)"),
    ({"lr": "-0.1"}, "lr=-0.1 is invalid: must be > 0"),
    ({"model.arch": "vgg99"}, "model.arch='vgg99' is invalid"),
    ({"data.source": "imagenet"}, "data.source='imagenet' is invalid"),
])
def test_bad_params_fail_before_any_work(tmp_path, edit, expected):
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    if "lrr" in edit:
        with open(tmp_path / "params.yaml", "a") as f:
            f.write("lrr: 0.1\n")
    else:
        set_params(tmp_path / "params.yaml", edit)
    for stage in ("prepare", "train"):
        t = time.perf_counter()
        p = run([sys.executable, "-m", f"stages.{stage}"], tmp_path,
                env=env_with(PYTHONPATH=str(ROOT)), check=False)
        assert p.returncode == 1 and expected in p.stderr, p.stderr
        assert "Traceback" not in p.stderr
        assert not (tmp_path / "data").exists() and not (tmp_path / "models").exists()
        assert time.perf_counter() - t < 60


# ------------------------------------------------------------ 10, 11: out of memory, disk full


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


# ------------------------------------------------------------ 4, 5, 6: stages and tracking


def workspace(path, digits, **params):
    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "params.yaml", path / "params.yaml")
    set_params(path / "params.yaml", {"epochs": "3", "model.width": "8", **params})
    save_prepared(path / "data/prepared", *digits)
    return path


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the socket goes


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
    assert p.stderr.count("is unavailable") == 1, p.stderr  # one warning, not one per metric
    assert json.loads((b / "models/train/metrics.json").read_text())["epochs_run"] == 3
    assert json.loads((b / "models/train/run.json").read_text())["run_id"] is None
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
    assert (repo / "dvc.lock").read_bytes() == lock

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


# ------------------------------------------------------------ 12: the UI binds loopback only


@pytest.mark.slow
def test_make_ui_binds_loopback_and_rejects_foreign_hosts(tmp_path):
    port = closed_port()
    proc = subprocess.Popen(["make", "-s", "ui", f"UI_PORT={port}"], cwd=ROOT, env=env_with(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, "mlflow ui did not start"
                time.sleep(0.5)
        import psutil

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


