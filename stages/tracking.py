"""MLflow tracking; the only module that imports mlflow.

One MLflow run per trained model: train opens it, evaluate and export reopen it by the id in
models/train/run.json. Tracking never crashes training: when the store is unreachable, the
stage warns once and goes on with a no-op tracker; the DVC outputs are written all the same.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from stages.config import MlflowConfig, repo_root

# A server that does not answer should cost seconds, not MLflow's default minutes of retries.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


def tracking_uri(cfg: MlflowConfig) -> str:
    # timeout: how long sqlite waits on a lock held by another process (queued experiments,
    # parallel stages) before "database is locked"; its default is 5 s.
    return (os.environ.get("MLFLOW_TRACKING_URI") or cfg.tracking_uri
            or f"sqlite:///{repo_root() / 'mlflow.db'}?timeout=60")


@contextmanager
def _store_lock(uri: str) -> Iterator[None]:
    """One process at a time creates a sqlite store (its migrations) and the experiment."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    import fcntl

    db = Path(uri.removeprefix("sqlite:///").split("?")[0])
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


class Tracker:
    """Logs into one MLflow run; every call is a no-op once tracking has failed."""

    def __init__(self, uri: str):
        self.uri, self.run_id, self.enabled = uri, None, False

    def _call(self, fn, *args, **kwargs) -> Any:
        if not self.enabled:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - tracking must never stop training
            self.enabled = False
            warnings.warn(f"MLflow logging to {self.uri} failed ({type(e).__name__}: {e}); "
                          "continuing without tracking, DVC outputs are unaffected", stacklevel=3)
            return None

    def log(self, metrics: dict[str, float], step: int) -> None:
        """The loop's `log`: asynchronous, since a synchronous sqlite write costs ~18 ms here."""
        import mlflow

        self._call(mlflow.log_metrics, metrics, step=step, synchronous=False)

    def log_metrics(self, metrics: dict[str, float]) -> None:
        import mlflow

        self._call(mlflow.log_metrics, metrics)

    def log_params(self, params: dict[str, Any]) -> None:
        import mlflow

        self._call(mlflow.log_params, params)

    def set_tags(self, tags: dict[str, Any]) -> None:
        import mlflow

        self._call(mlflow.set_tags, {k: v for k, v in tags.items() if v not in (None, "")})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        import mlflow

        self._call(mlflow.log_artifact, str(path), artifact_path)

    def log_pytorch_model(self, model, input_example):
        """The ModelInfo of the logged model, or None when tracking is off."""
        import mlflow.pytorch
        import torch

        # Explicit requirements: inferring them imports the model in a subprocess (~10 s).
        return self._call(mlflow.pytorch.log_model, model, name="model",
                          input_example=input_example,
                          pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"])

    def register(self, model_uri: str, name: str, accuracy: float) -> dict | None:
        """Register a version with alias `candidate`; move `champion` to it when its test
        accuracy beats the current champion's (or there is none)."""
        return self._call(_register, model_uri, name, accuracy)


def _register(model_uri: str, name: str, accuracy: float) -> dict:
    import mlflow
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient()
    version = mlflow.register_model(model_uri, name).version
    client.set_model_version_tag(name, version, "eval.accuracy", repr(accuracy))
    client.set_registered_model_alias(name, "candidate", version)
    try:
        champion = client.get_model_version_by_alias(name, "champion")
        best = float(champion.tags.get("eval.accuracy", "-1"))
    except MlflowException:  # no champion yet
        champion, best = None, -1.0
    promoted = accuracy > best
    if promoted:
        client.set_registered_model_alias(name, "champion", version)
    return {"name": name, "version": int(version), "champion": promoted,
            "previous_champion": int(champion.version) if champion else None}


def _experiment_id(name: str, uri: str) -> str:
    import mlflow

    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    # Artifacts next to the store in the real workspace, not in the cwd: a `dvc exp run --temp`
    # runs in a copy that is deleted afterwards.
    location = (repo_root() / "mlartifacts").as_uri() if uri.startswith("sqlite:") else None
    try:
        return mlflow.create_experiment(name, artifact_location=location)
    except Exception:  # noqa: BLE001 - another process created it first
        return mlflow.get_experiment_by_name(name).experiment_id


@contextmanager
def start_run(cfg: MlflowConfig, *, run_id: str | None = None, run_name: str | None = None,
              tags: dict[str, Any] | None = None) -> Iterator[Tracker]:
    """Open (or reopen, given `run_id`) the run; end it FINISHED, FAILED or KILLED."""
    tracker = Tracker(tracking_uri(cfg))
    try:
        import mlflow

        mlflow.set_tracking_uri(tracker.uri)
        with _store_lock(tracker.uri):
            exp_id = None if run_id else _experiment_id(cfg.experiment, tracker.uri)
        run = mlflow.start_run(run_id=run_id) if run_id else \
            mlflow.start_run(experiment_id=exp_id, run_name=run_name)
        tracker.run_id, tracker.enabled = run.info.run_id, True
        tracker.set_tags(tags or {})
    except Exception as e:  # noqa: BLE001 - tracking must never stop training
        warnings.warn(f"MLflow tracking at {tracker.uri} is unavailable ({type(e).__name__}: {e}); "
                      "continuing without tracking, DVC outputs are unaffected", stacklevel=3)
    # SIGTERM (a CI cancel, `kill`) becomes SystemExit, so the run is closed as KILLED.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    status = "FINISHED"
    try:
        yield tracker
    except (KeyboardInterrupt, SystemExit):
        status = "KILLED"
        raise
    except BaseException:
        status = "FAILED"
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        if tracker.run_id:
            import mlflow

            tracker._call(mlflow.flush_async_logging)
            tracker.enabled = True  # close the run even if a log call failed on the way
            tracker._call(mlflow.end_run, status)


@contextmanager
def reopen_run(cfg: MlflowConfig, run_id: str | None) -> Iterator[Tracker]:
    """Log into the run that train opened; without one (tracking was down), log nothing."""
    if not run_id:
        warnings.warn("models/train/run.json has no MLflow run id (training ran without "
                      "tracking); nothing is logged to MLflow", stacklevel=3)
        yield Tracker(tracking_uri(cfg))
        return
    with start_run(cfg, run_id=run_id) as tracker:
        yield tracker
