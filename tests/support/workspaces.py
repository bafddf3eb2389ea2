"""Workspaces and helpers the stage-level tests share: a stage folder with prepared digits, a
trained or exported model, and the one-line error every failure must end in."""

from __future__ import annotations

import signal
import sys
import time

from reprotrain.ports import free_port as closed_port  # noqa: F401 - nothing listens there
from stages.data import save_prepared
from tests.conftest import ROOT, copy_params, env_with, run, set_params


def workspace(path, digits, **params):
    path.mkdir(parents=True, exist_ok=True)
    copy_params(path)
    set_params(path / "params.yaml", {"epochs": "3", "model.width": "8", **params})
    save_prepared(path / "data/prepared", *digits)
    return path


def one_error_line(stderr: str) -> str:
    """The error, alone on the last line; before it at most progress lines, no traceback."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() or "Traceback" in line]
    assert errors == lines[-1:] and lines[-1].startswith("error: "), stderr
    return lines[-1]


def predict(tmp_path, *args):
    return run([sys.executable, "-m", "stages.predict", *args], tmp_path,
               env=env_with(PYTHONPATH=str(ROOT)), check=False)


def rewrite_zip(src, dst, edit):
    import zipfile

    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w") as out:
        for name in z.namelist():
            out.writestr(name, edit(name, z.read(name)))


def wait_for_checkpoint(proc, w, epoch: int = 1) -> None:
    deadline = time.time() + 300
    while not list(w.glob(f".checkpoints/*/epoch-{epoch:04d}.sha256")):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)


def interruptible() -> None:
    """In the child: Ctrl-C, Ctrl-\\ and a closed terminal as in a terminal. A shell without job
    control starts background commands (and everything they start) with SIGINT and SIGQUIT
    ignored, and `nohup` ignores SIGHUP: make would inherit that and never stop."""
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def folder_workspace(w):
    """params.yaml for an image folder in w/raw, decoded by two worker processes."""
    w.mkdir()
    copy_params(w)
    set_params(w / "params.yaml", {"data.source": "folder", "data.root": "raw",
                                   "data.num_workers": "2"})
    return w


def files_sha(path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest() + "\n"


def lock_entries(lock) -> dict:
    """dvc.lock's stages but the params check (it has no outputs and passes on any valid edit)."""
    from omegaconf import OmegaConf

    text = lock.read_text() if hasattr(lock, "read_text") else lock.decode()
    stages = OmegaConf.to_container(OmegaConf.create(text))["stages"]
    return {k: v for k, v in stages.items() if k != "params"}
