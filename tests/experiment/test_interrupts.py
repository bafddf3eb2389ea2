"""Interruptions: Ctrl-C in a stage or mid-write, and params.yaml changed under a running
training. One line each; nothing half-written; the run is recorded for what it was."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from stages.checkpoints import latest_checkpoint
from stages.lib import files
from tests.conftest import ROOT, copy_params, env_with, set_params
from tests.support.workspaces import (
    folder_workspace,
    interruptible,
    one_error_line,
    wait_for_checkpoint,
    workspace,
)


def test_params_changed_under_a_training_run_fail_it_naming_the_cause(tmp_path, digits, mlflow_uri):
    import mlflow

    w = workspace(tmp_path / "w", digits, epochs="40", batch_size="16")
    proc = subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=w, text=True,
                            env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for_checkpoint(proc, w)
    run_id = latest_checkpoint(next(w.glob(".checkpoints/*")))["run_id"]
    set_params(w / "params.yaml", {"lr": "0.01"})  # what a second `dvc exp run -S lr=0.01` does
    _, err = proc.communicate(timeout=300)
    line = one_error_line(err)
    assert proc.returncode == 1 and "lr: 0.003 -> 0.01" in line
    assert "--queue" in line and "--temp" in line
    assert not (w / "models/train/model.pt").exists()
    run_info = mlflow.MlflowClient(mlflow_uri).get_run(run_id)
    assert run_info.info.status == "FAILED" and "val/best_acc" not in run_info.data.metrics


def test_a_params_file_caught_mid_write_is_not_taken_for_a_change(tmp_path):
    """CI caught the watch reading params.yaml between the truncate and the write of an edit:
    the empty file loaded as the defaults, and a run was failed for changes nobody made."""
    import threading

    from stages.config import load_params
    from stages.lib.errors import UserError
    from stages.train import ParamsWatch, training_params

    path = copy_params(tmp_path)
    set_params(path, {"epochs": "40"})  # not the default, which an empty file loads as
    text = path.read_text()
    watch = ParamsWatch(path, training_params(load_params(path)))
    path.write_text("")  # the editor has truncated; its write lands 0.1 s later
    threading.Timer(0.1, path.write_text, [text]).start()
    watch.check()  # raises UserError if it judged the empty file
    set_params(path, {"lr": "0.01"})
    with pytest.raises(UserError, match=r"lr: 0\.003 -> 0\.01"):
        watch.check()


def test_ctrl_c_in_train_is_one_line_and_the_run_killed(tmp_path, digits, mlflow_uri):
    import mlflow

    w = workspace(tmp_path / "w", digits, epochs="40", batch_size="16")
    proc = subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=w, text=True,
                            env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=interruptible)
    wait_for_checkpoint(proc, w)
    run_id = latest_checkpoint(next(w.glob(".checkpoints/*")))["run_id"]
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends: the whole group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted (Ctrl-C)" in one_error_line(err)
    assert mlflow.MlflowClient(mlflow_uri).get_run(run_id).info.status == "KILLED"


def test_ctrl_c_in_prepare_is_one_line(tmp_path):
    import numpy as np
    from PIL import Image

    w = folder_workspace(tmp_path / "w")
    rng = np.random.default_rng(0)
    for c in ("circle", "square", "triangle"):  # noise decodes slowly: seconds of decoding
        (w / "raw" / c).mkdir(parents=True)
        for j in range(4):
            src = w / "raw" / c / f"{j}.png"
            Image.fromarray(rng.integers(0, 255, (400, 400, 3), dtype=np.uint8)).save(src)
            for i in range(150):
                os.link(src, src.with_name(f"{j}_{i}.png"))
    proc = subprocess.Popen([sys.executable, "-m", "stages.prepare"], cwd=w, text=True,
                            env=env_with(PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=interruptible)
    deadline = time.time() + 120
    while not list(w.glob("data/prepared/.*.npy")):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.02)
    time.sleep(1.5)  # decoding in the workers (a Ctrl-C while they fork is lost in CPython)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted (Ctrl-C)" in one_error_line(err)
    assert not (w / "data/prepared/train.pt").exists()


def test_ctrl_c_during_a_file_write_stays_a_ctrl_c_and_keeps_the_previous(tmp_path, monkeypatch):
    import threading

    path = tmp_path / "big.pt"
    path.write_bytes(b"previous")
    big = {f"t{i}": torch.zeros(1_000_000) for i in range(12)}
    real_save = torch.save

    class SlowDisk:  # each write takes 50 ms: the Ctrl-C lands mid-write on any machine
        def __init__(self, f):
            self.f = f

        def write(self, b):
            time.sleep(0.05)
            return self.f.write(b)

        def flush(self):
            self.f.flush()

    monkeypatch.setattr(torch, "save", lambda obj, f: real_save(obj, SlowDisk(f)))
    # Python's own Ctrl-C handler, also where the suite was started in the background
    # (`make test &`), which leaves SIGINT ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.15, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    # Interrupted mid-record, torch.save's zip writer fails with an inline_container.cc
    # RuntimeError: that would mark the MLflow run FAILED, not KILLED.
    try:
        with pytest.raises(KeyboardInterrupt):
            files.save_torch(path, big)
    finally:
        timer.join()  # never a stray Ctrl-C for the next test
        signal.signal(signal.SIGINT, previous)
    assert path.read_bytes() == b"previous" and not list(tmp_path.glob(".*tmp*"))


SERVER_STOPPED_WHILE_IT_FORKS = """
import os, signal, sys
from reprotrain.processes import private_folder, started

port = sys.argv[1]
log = private_folder("forked") / "server.log"
print(log, flush=True)
# The stop lands as the server is forked, in the window of Python's at-fork hooks.
os.register_at_fork(after_in_parent=lambda: os.kill(os.getpid(), signal.SIGTERM))
with started("test server", [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", port],
             dict(os.environ), log, f"http://127.0.0.1:{port}/", 60, "no hint") as server:
    print("served", flush=True)
    server.wait()
"""


def test_a_stop_while_the_server_is_forked_is_a_clean_stop(tmp_path):
    """A SIGTERM during the fork of the server (CI: `make ui` served on, deaf to further
    SIGTERMs, its stop printed as `Exception ignored in: <function _releaseLock ...>`) stops the
    command cleanly: exit 0, the server gone, its log folder removed."""
    from tests.support.services import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER_STOPPED_WHILE_IT_FORKS, str(port)],
                            cwd=tmp_path, env=env_with(PYTHONPATH=str(ROOT)), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0 and err.strip() == "stopping the test server", (out, err)
    log = out.splitlines()[0]
    assert "served" not in out and not os.path.exists(os.path.dirname(log)), out
    with pytest.raises(OSError):  # nothing serves on its port
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
