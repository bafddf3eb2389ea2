"""MLflow tracking; the only module that imports mlflow.

One experiment, one MLflow run, never another's. Train opens a run and leaves its id, with the
MD5 of the model it wrote and the DVC experiment's name, in models/train/run.json (not a DVC
output). Evaluate and export log into that run when both still match and the run is in the
store with the params they run with; otherwise (training was restored from DVC's run-cache or
belongs to another experiment, the run was deleted or is in another store, or an `eval.*` param
changed since: MLflow params are immutable) they open a run of their own, named after the
experiment and linked to the run that trained the model (tag `training_run_id`). Tracking
never crashes training: when a tracking server stops answering (at the start or mid-run), the
stage says so once and logs the rest into a local spool (.mlflow-spool/, an embedded store)
that `make sync` (stages/tracking/sync.py) replays; any other store that fails leaves a no-op tracker.
The DVC outputs are written all the same.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import os
import platform
import re
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from stages.config import MlflowConfig, flatten, repo_root
from stages.lib.cli import timed
from stages.lib.files import file_hash, write_json
from stages.metrics import MLFLOW_NAMES
from stages.tracking.stores import (  # reason, refusal: also read as tracking.reason/.refusal
    SERVER_MODEL,
    SERVER_RUN,
    SPOOL,
    SYNCED,
    is_server,
    outage,
    plain_uri,
    reachable,
    reason,
    refusal,
    spool_file,
    spool_synced,
    spool_uri,
)

# The async logging thread otherwise polls its queue with a 1 s timeout, and every flush (each
# epoch, the end of the run, set_terminated) waits out that poll: 1.8 s of train's time at the
# end alone. Buffering waits on the stop event instead, which a flush sets.
os.environ.setdefault("MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS", "1")

# MLflow's sqlite store logs every database error with its traceback (about 60 lines for a
# read-only mlflow.db) before raising it; the one warning below says it instead.
logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
# Its logging thread logs each batch a gone server refused; the Tracker spools them instead.
logging.getLogger("mlflow.utils.async_logging.async_logging_queue").setLevel(logging.CRITICAL)

RUN_FILE = "run.json"
# How a store answers for a run it does not hold: basic-auth answers 403, not 404, since it
# checks the permission on the run's experiment before anything looks the run up.
MISSING_RUN = ("RESOURCE_DOES_NOT_EXIST", "PERMISSION_DENIED")
# A sweep's trials (stages/sweep/__init__.py) are children of the study's run: MLflow nests them under it.
PARENT_RUN_ENV = "REPROTRAIN_SWEEP_PARENT_RUN"
# MLflow 3.17's UI opens experiments in GenAI mode (Traces, Latency, Token Usage) and its runs
# table with no params or metrics. The experiment says it is model training, and carries a
# shared view of the runs table with the columns worth comparing; `make ui` prints its URL.
VIEW = "reprotrain"
VIEW_COLUMNS = ["attributes.`Duration`", "params.`lr`", "params.`epochs`", "params.`batch_size`",
                "metrics.`eval/accuracy`", "metrics.`eval/macro_f1`", "metrics.`eval/loss`",
                "metrics.`val/best_acc`"]
EXPERIMENT_TAGS = {
    "mlflow.experimentKind": "custom_model_development",
    f"mlflow.sharedViewState.{VIEW}": json.dumps({"selectedColumns": VIEW_COLUMNS,
                                                  "orderByKey": "attributes.start_time",
                                                  "orderByAsc": False}),
}


def metric_name(key: str) -> str:
    """The MLflow name of a metric: grouped, and with every character MLflow refuses (a class
    folder may be called `a,b` or `c+d`) replaced by `_`."""
    return re.sub(r"[^\w\-. :/]", "_", MLFLOW_NAMES.get(key, key), flags=re.ASCII)


def tracking_uri(cfg: MlflowConfig) -> str:
    # timeout: how long sqlite waits on a lock held by another process (queued experiments,
    # parallel stages) before "database is locked"; its default is 5 s.
    uri = (os.environ.get("MLFLOW_TRACKING_URI") or cfg.tracking_uri
           or f"sqlite:///{repo_root() / 'mlflow.db'}?timeout=60")
    parts = urlsplit(uri)
    if parts.scheme in ("http", "https") and parts.password is not None:
        # http://user:password@host would land in run.json and the runs' tags: MLflow takes the
        # same login from these two variables.
        os.environ.setdefault("MLFLOW_TRACKING_USERNAME", unquote(parts.username or ""))
        os.environ.setdefault("MLFLOW_TRACKING_PASSWORD", unquote(parts.password))
        uri = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
    return uri


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


def exp_name() -> str | None:
    """The DVC experiment being run (`dvc exp run`, also queued and --temp), or None for
    `dvc repro` and direct runs."""
    return os.environ.get("DVC_EXP_NAME") or None


def run_name() -> str:
    """The MLflow run is named after the DVC experiment, so `dvc exp show` and the UI agree.
    A `dvc repro` in the workspace has no such name: its run is named after the params that
    differ from the commit's, the commit and the time, so that five reruns with other lr and
    epochs read as five runs: `lr=0.01 epochs=5 workspace@967714c 00:31:07`. What differs comes
    first: the UI's runs table cuts names at about 20 characters."""
    if exp_name():
        return exp_name()
    commit = git_commit()[:7] or "nogit"
    return " ".join([*params_changed(), f"workspace@{commit}", time.strftime("%H:%M:%S")])


def params_changed(path: str = "params.yaml") -> list[str]:
    """`key=value` for each value of params.yaml that differs from the commit's."""
    from omegaconf import OmegaConf

    try:
        shown = subprocess.run(["git", "show", f"HEAD:{path}"], capture_output=True, text=True,
                               timeout=10, check=True).stdout
        before = flatten(OmegaConf.to_container(OmegaConf.create(shown)) or {})
        now = flatten(OmegaConf.to_container(OmegaConf.load(path)) or {})
    except Exception:  # noqa: BLE001 - no git, no commit, unreadable: the name is only a label
        return []
    return [f"{k}={v}" for k, v in now.items() if before.get(k, object()) != v]


def lock_hash() -> str | None:
    """Which locked environment ran: results are bitwise reproducible only on the same lock."""
    lock = Path("requirements.lock")
    if not lock.exists():
        return None
    return file_hash(lock)[:16]


def _md5(path: Path) -> str:
    """The hash DVC records for the file in dvc.lock: a run is found from `dvc exp show`."""
    return file_hash(path, "md5")


REPLAY_S = 30  # a stage replays the spool for at most this long before its own work
# Servers this process saw fail (5xx, a hang): every later run of the process goes straight to
# the spool, rather than waiting out MLflow's timeout and retries once more.
FAILING: set[str] = set()


def _spool_run(experiment: str, run_id: str | None, name: str, server: str):
    """Open the spool's run for `run_id` (a run of the server, or one spooled before), or a
    new one; the fluent API's tracking URI is the spool's already."""
    import mlflow

    client = mlflow.MlflowClient()
    with _store_lock(spool_uri()):
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            location = (repo_root() / SPOOL / "artifacts").as_uri()
            exp_id = client.create_experiment(experiment, artifact_location=location,
                                              tags=EXPERIMENT_TAGS)
        else:
            exp_id = exp.experiment_id
            if exp.lifecycle_stage == "deleted":
                client.restore_experiment(exp_id)
    (spool_file().parent / "unsynced").touch()
    found = None
    if run_id:
        runs = client.search_runs([exp_id], filter_string=f"tags.`{SERVER_RUN}` = '{run_id}'",
                                  max_results=1)
        found = runs[0].info.run_id if runs else None
        if found is None:
            try:
                found = client.get_run(run_id).info.run_id  # a run spooled at its start
            except Exception:  # noqa: BLE001 - a run of the server: continued below
                pass
    if found:
        if SYNCED in client.get_run(found).data.tags:  # reopened: sync sends it again
            client.delete_tag(found, SYNCED)
        return mlflow.start_run(run_id=found)
    return mlflow.start_run(experiment_id=exp_id, run_name=name or run_name(),
                            tags={SERVER_RUN: run_id or "", "reprotrain.spooled_for": plain_uri(server),
                                  "reprotrain.spooled_on": platform.node()})


def replay_spool(uri: str) -> None:
    """A stage that finds the server answering sends what was spooled first (at most
    REPLAY_S; `make sync` sends the rest). Never fails the stage."""
    marker = spool_file().parent / "unsynced"
    if not is_server(uri) or not marker.exists():
        return
    from stages.tracking.sync import Busy, sync

    started = time.time()
    try:
        report = sync(spool_uri(), uri, budget_s=REPLAY_S, unsynced_only=True, wait_s=REPLAY_S)
    except Busy as e:  # a `make sync` holds the spool: it sends what this replay would
        print(f"note: {e}; this stage goes on", file=sys.stderr)
        return
    except Exception as e:  # noqa: BLE001 - the stage's own run comes first
        if outage(e):
            FAILING.add(uri)
        print(f"warning: replaying the spool {SPOOL}/ to {plain_uri(uri)} failed "
              f"({refusal(e) or reason(e)}); `make sync` retries it", file=sys.stderr)
        return
    if not report.left:
        spool_synced(started)
    if report.runs or report.left:
        print(report.line(f"{SPOOL}/", plain_uri(uri)), file=sys.stderr)


class Tracker:
    """Logs into one MLflow run. When the store is a server that stops answering, the rest of
    the run goes to the local spool (`spool_uri`), which `make sync` replays; when the spool
    fails too, or the store is not a server, every later call is a no-op."""

    def __init__(self, uri: str, experiment: str = ""):
        self.uri, self.run_id, self.enabled = uri, None, False
        self.experiment, self.name = experiment, ""
        self.spooled = False  # logging into the spool since the server went away
        self.spool_run_id: str | None = None
        self.logged: dict[str, int] = {}  # a resumed run's last step of each metric
        # Steps sent asynchronously and not yet confirmed: a server that dies loses its queue,
        # so they go to the spool again (sync skips those the server did store).
        self.pending: list[tuple[dict[str, float], int, int, Any]] = []
        # The served model's name and arguments: a registration the server fails is made in the
        # spool, which needs the model itself, not the server's id of it.
        self.served: tuple[str, dict[str, Any]] | None = None

    def resume(self) -> None:
        """A run resumed from a checkpoint repeats what it logged after that checkpoint (the
        epoch's row goes out just before it, steps up to 1 s before a kill): `log` skips those
        steps, which a bitwise resume would log with the same values."""
        import mlflow

        # The active run's: the spool's when the server is down (sync skips the server's steps).
        self.logged = self._call(lambda: _last_steps(mlflow.active_run().info.run_id)) or {}

    def _call(self, fn, *args, **kwargs) -> Any:
        if not self.enabled:
            return None
        try:
            with timed("tracking_s"):
                return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - tracking must never stop training
            if self._spool(e):
                return self._call(fn, *args, **kwargs)
            self.enabled = False
            warnings.warn(f"MLflow logging to {self.uri} failed ({reason(e)}); "
                          "continuing without tracking, DVC outputs are unaffected", stacklevel=3)
            return None

    def _spool(self, e: Exception | None) -> bool:
        """Go on in the spool, once, when the server does not answer (`e`: what failed, None
        at the start). Fluent calls then log into the spooled run; the server's run id stays
        `run_id`, the one run.json and checkpoints name."""
        import mlflow

        if self.spooled or not is_server(self.uri) or (e is not None and not outage(e)):
            return False
        FAILING.add(self.uri)
        self.spooled, where = True, spool_uri()
        try:
            with timed("tracking_s"):
                mlflow.set_tracking_uri(where)
                if mlflow.active_run():  # the server's: end_run forgets it, then asks the spool
                    try:
                        mlflow.end_run()
                    except Exception:  # noqa: BLE001 - the spool has no such run
                        pass
                run = _spool_run(self.experiment, self.run_id, self.name, self.uri)
                self.run_id, self.spool_run_id = self.run_id or run.info.run_id, run.info.run_id
                for metrics, step, ts, _ in self.pending:
                    mlflow.log_metrics(metrics, step=step, timestamp=ts)
                self.pending.clear()
        except Exception as spool_error:  # noqa: BLE001 - a full disk: no tracking, as before
            self.enabled = False
            warnings.warn(f"MLflow tracking at {plain_uri(self.uri)} is unreachable and the local "
                          f"spool failed too ({reason(spool_error)}); continuing without "
                          "tracking, DVC outputs are unaffected", stacklevel=4)
            return False
        self.enabled = True
        cause = re.search(r"\[Errno -?\d+\] [\w ]+|timed out|too many \d+ error responses",
                          str(e)) if e else None
        print(f"warning: MLflow server {plain_uri(self.uri)} is unreachable"
              + (f" ({cause[0]})" if cause else "") + f"; this run is spooled to {SPOOL}/ "
              "(`make sync` sends it when the server is back; DVC outputs are unaffected)",
              file=sys.stderr)
        return True

    @property
    def store(self) -> str:
        """The store that holds `run_id`: the spool for a run spooled from its start."""
        return spool_uri() if self.spooled and self.run_id == self.spool_run_id else self.uri

    def _confirm(self) -> None:
        """The asynchronous steps reached the store, or they go to the spool."""
        import mlflow

        mlflow.flush_async_logging()
        for *_, ops in self.pending:
            ops.wait()  # raises what the store answered
        self.pending.clear()

    def log(self, metrics: dict[str, float], step: int, durable: bool = False) -> None:
        """The loop's `log`: a step's figures asynchronously, since a synchronous sqlite write
        costs ~15 ms here; an epoch's row (`durable`) after the queue is flushed, so the run
        holds every epoch that a checkpoint covers."""
        import mlflow

        named = {metric_name(k): v for k, v in metrics.items()}
        named = {k: v for k, v in named.items() if step > self.logged.get(k, -1)}
        if not named or not self.enabled:
            return
        # One timestamp, also for a retry in the spool: sync tells a copy by step and time.
        ts = int(time.time() * 1000)
        if durable:
            self._call(self._confirm)
            self._call(mlflow.log_metrics, named, step=step, timestamp=ts, synchronous=True)
            return
        ops = self._call(mlflow.log_metrics, named, step=step, timestamp=ts, synchronous=False)
        if ops is not None and not self.spooled:
            self.pending.append((named, step, ts, ops))

    def log_metrics(self, metrics: dict[str, float], prefix: str = "", step: int = 0) -> None:
        """Synchronously, as one batch; a batch the store refuses is retried one metric at a
        time, so one bad value never drops the others."""
        import mlflow
        from mlflow.exceptions import MlflowException

        named = {metric_name(prefix + k): float(v) for k, v in metrics.items()}
        if not self.enabled:
            return
        ts = int(time.time() * 1000)
        try:
            with timed("tracking_s"):
                mlflow.log_metrics(named, step=step, timestamp=ts)
            return
        except Exception as e:  # noqa: BLE001 - a server gone: the spool; a store down: warn
            if self._spool(e) or not isinstance(e, MlflowException):
                self._call(mlflow.log_metrics, named, step=step, timestamp=ts)
                return
        refused = []
        for name, value in named.items():
            try:
                mlflow.log_metric(name, value, step=step, timestamp=ts)
            except MlflowException:
                refused.append(name)
        if refused:
            warnings.warn(f"MLflow refused the metrics {refused}; the others are logged",
                          stacklevel=2)

    def log_evaluation(self, metrics: dict[str, float]) -> None:
        """Test metrics as `eval/...`; the test-set size is a fact (tag `eval.n`), not a chart."""
        self.log_metrics({k: v for k, v in metrics.items() if k != "n"}, prefix="eval/")
        self.set_tags({"eval.n": metrics.get("n")})

    def has_metric(self, name: str) -> bool:
        import mlflow

        # The active run: the spooled one when the server went away.
        active = mlflow.active_run()
        return active is not None and bool(self._call(
            lambda: name in mlflow.get_run(active.info.run_id).data.metrics))

    def log_params(self, params: dict[str, Any]) -> None:
        import mlflow

        self._call(mlflow.log_params, params)

    def set_tags(self, tags: dict[str, Any]) -> None:
        import mlflow

        self._call(mlflow.set_tags, {k: v for k, v in tags.items() if v not in (None, "")})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        import mlflow

        self._call(mlflow.log_artifact, str(path), artifact_path)

    def log_dataset(self, meta: dict, root: str) -> None:
        """The prepared data as the run's input: where it came from and its content hash."""
        self._call(_log_dataset, meta, root)

    def log_served_model(self, name: str, **kwargs):
        """A pyfunc model logged as code (stages/serving/registry.py's model_kwargs): its ModelInfo, or
        None when tracking is off."""
        import mlflow.pyfunc

        self.served = (name, kwargs)
        return self._call(mlflow.pyfunc.log_model, name=name, **kwargs)

    def register(self, model_uri: str, name: str, accuracy: float) -> dict | None:
        """Register a version with alias `candidate`; move `champion` to it when its test
        accuracy beats the current champion's (or there is none). Registered in the spool, it
        says so here and returns None: a champion there is only the laptop's, and `make sync`
        decides it against the server's."""
        reg = self._call(self._register, model_uri, name, accuracy)
        if reg and self.spooled:
            print(f"registered {name} in the local spool ({SPOOL}/), not on the server, which "
                  "did not answer: `make sync` registers it there, champion if it beats the "
                  "server's")
            return None
        return reg


    def _register(self, model_uri: str, name: str, accuracy: float) -> dict:
        """`_register`; in the spool, a model logged on the server before it failed is logged
        again there (the spool cannot register the server's), naming the server's copy."""
        import mlflow
        import mlflow.pyfunc
        from mlflow.exceptions import MlflowException

        if self.spooled and self.served and model_uri.startswith("models:/m-"):
            server_model = model_uri.removeprefix("models:/")
            try:
                mlflow.MlflowClient().get_logged_model(server_model)
            except MlflowException:
                served, kwargs = self.served
                info = mlflow.pyfunc.log_model(name=served, **kwargs)
                mlflow.MlflowClient().set_logged_model_tags(info.model_id,
                                                            {SERVER_MODEL: server_model})
                model_uri = info.model_uri
        return _register(model_uri, name, accuracy)


def _log_dataset(meta: dict, root: str) -> None:
    import mlflow
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset

    from stages.data import raw_data  # here: `make ui` imports this module, not torch

    where = raw_data(meta["source"], root)
    with warnings.catch_warnings():  # "can be interpreted in multiple ways": both are local
        warnings.simplefilter("ignore")
        source = resolve_dataset_source(str(where))
    # MLflow keeps at most 36 characters of digest; the full SHA-256 is the tag data_sha256.
    dataset = MetaDataset(source, name=meta["source"], digest=meta["sha256"][:32])
    mlflow.log_input(dataset, context="training",
                     tags={"sizes": json.dumps(meta["sizes"]), "classes": str(len(meta["classes"]))})


def _last_steps(run_id: str) -> dict[str, int]:
    import mlflow

    client = mlflow.MlflowClient()
    return {key: max(m.step for m in client.get_metric_history(run_id, key))
            for key in client.get_run(run_id).data.metrics}


def _register(model_uri: str, name: str, accuracy: float) -> dict:
    import mlflow
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient()
    # Without MLflow's "Successfully registered model", "Created version" lines (export says
    # where it registered, the server or the spool) and its wait for a version that a server
    # with its own artifact store makes ready at once.
    with contextlib.redirect_stderr(io.StringIO()):
        version = mlflow.register_model(model_uri, name, await_registration_for=0).version
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
    if exp is not None and exp.lifecycle_stage == "deleted":
        # Its name stays taken until `mlflow gc`: the only way to log under it again. MLflow
        # restores the runs deleted with it, so runs named in run.json are whole again.
        mlflow.MlflowClient().restore_experiment(exp.experiment_id)
        warnings.warn(f"MLflow experiment {name!r} was deleted in {uri}; restored it with its "
                      "runs (delete them one by one, or rename mlflow.experiment)", stacklevel=2)
    if exp is None:
        # Artifacts next to the store in the real workspace, not in the cwd: a `dvc exp run
        # --temp` runs in a copy that is deleted afterwards.
        location = (repo_root() / "mlartifacts").as_uri() if uri.startswith("sqlite:") else None
        try:
            mlflow.create_experiment(name, artifact_location=location, tags=EXPERIMENT_TAGS)
        except Exception:  # noqa: BLE001 - another process created it first (mlflow #4123)
            exp = mlflow.get_experiment_by_name(name)
            if exp is None:  # no: the store refused it (a permission, a full disk)
                raise
        exp = exp or mlflow.get_experiment_by_name(name)
    for key, value in EXPERIMENT_TAGS.items():  # a store made before this version's tags
        if exp.tags.get(key) != value:
            mlflow.MlflowClient().set_experiment_tag(exp.experiment_id, key, value)
    return exp.experiment_id


@contextmanager
def start_run(cfg: MlflowConfig, *, run_id: str | None = None, tags: dict[str, Any] | None = None,
              keep_duration: bool = False, name: str | None = None) -> Iterator[Tracker]:
    """Open a new run named after the experiment (or `name`; or reopen `run_id`); end it
    FINISHED, FAILED or KILLED. `keep_duration`: a later stage's logging does not stretch the
    run's Duration, which stays the training's. Under a sweep the run is a child of the
    study's run (PARENT_RUN_ENV). A server that does not answer costs one quick probe: the run
    goes to the spool; one that answers again first gets what was spooled."""
    import mlflow

    tracker = Tracker(tracking_uri(cfg), cfg.experiment)
    tracker.run_id, tracker.name = run_id, "" if run_id else (name or run_name())
    ended = None
    try:
        with timed("tracking_s"):
            if is_server(tracker.uri) and (tracker.uri in FAILING or not reachable(tracker.uri)):
                tracker._spool(None)
            else:
                replay_spool(tracker.uri)
                if tracker.uri in FAILING:  # the replay found it failing: no second wait
                    raise ConnectionError(f"{plain_uri(tracker.uri)} failed during the replay")
                mlflow.set_tracking_uri(tracker.uri)
                with _store_lock(tracker.uri):
                    exp_id = _experiment_id(cfg.experiment, tracker.uri)
                if run_id:
                    run_id = _server_id(cfg.experiment, run_id, tracker.uri) \
                        if is_server(tracker.uri) else run_id
                    ended = mlflow.MlflowClient().get_run(run_id).info.end_time
                    run = mlflow.start_run(run_id=run_id)
                else:
                    run = mlflow.start_run(experiment_id=exp_id, run_name=tracker.name)
                tracker.run_id, tracker.enabled = run.info.run_id, True
    except Exception as e:  # noqa: BLE001 - tracking must never stop training
        if not tracker._spool(e):
            warnings.warn(f"MLflow tracking at {plain_uri(tracker.uri)} is unavailable "
                          f"({refusal(e) or reason(e)}); continuing without tracking, DVC "
                          "outputs are unaffected", stacklevel=3)
    if tracker.spooled:  # a reopened spooled run keeps its end; a new one has none
        ended = tracker._call(lambda: mlflow.active_run().info.end_time)
    if not keep_duration:
        ended = None
    tracker.set_tags({"git_commit": git_commit(), "dvc_exp_name": exp_name(),
                      "lock_sha256": lock_hash(),
                      "dvc_baseline_rev": os.environ.get("DVC_EXP_BASELINE_REV"),
                      "mlflow.parentRunId": os.environ.get(PARENT_RUN_ENV), **(tags or {})})
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
        if tracker.run_id and mlflow.active_run() is not None:  # None: it never started
            tracker._call(tracker._confirm)
            tracker.enabled = True  # close the run even if a log call failed on the way
            active = mlflow.active_run().info.run_id
            tracker._call(mlflow.end_run, status)
            if ended and active:
                tracker._call(lambda: mlflow.MlflowClient().set_terminated(active, status, ended))
            if tracker.spooled:  # after its end: a sync that saw it running sends it again
                (spool_file().parent / "unsynced").touch()


def link_model(run: Tracker, model: Path) -> None:
    """Train's last word: the run of this experiment is the one that trained `model`."""
    md5 = _md5(model)
    run.set_tags({"model_md5": md5, "training_run_id": run.run_id})
    _write_link(model.with_name(RUN_FILE), run, md5)


def _write_link(path: Path, run: Tracker, md5: str) -> None:
    """run.json: which run is this experiment's, for this model."""
    write_json(path, {"run_id": run.run_id, "tracking_uri": plain_uri(run.store), "model_md5": md5,
                      "dvc_exp_name": exp_name()})


@contextmanager
def experiment_run(cfg: MlflowConfig, params: dict[str, Any], meta: dict,
                   train_dir: Path) -> Iterator[Tracker]:
    """The MLflow run of this experiment's model in `train_dir`, for evaluate and export.

    The run named in run.json when it names this model and this experiment, and is still in the
    store with the params this stage runs with. Otherwise a new run of this experiment, with
    its params, dataset (`meta` of the prepared data) and the training's metrics and curves
    (from the DVC outputs), tagged `training_run_id` with the run that trained the model, its
    note (the UI's description) saying why: training came from DVC's run-cache or another
    experiment, the run was deleted or is in another store, or params it logged (MLflow's are
    immutable) differ from this stage's, say a changed `eval.batch_size`."""
    md5 = _md5(train_dir / "model.pt")
    link_file = train_dir / RUN_FILE
    link = json.loads(link_file.read_text()) if link_file.exists() else {}
    uri = tracking_uri(cfg)
    link = _from_spool(cfg, link, uri)
    trained_by, why, note = None, "training was restored from DVC's run-cache", False
    if link.get("model_md5") == md5:
        trained_by = link.get("run_id")
        if link.get("dvc_exp_name") != exp_name():
            why = f"the model was trained in {link.get('dvc_exp_name') or 'the workspace'}"
        else:
            why, trained_by = _unusable(cfg, uri, link.get("run_id"), params)
            if why is None:
                with start_run(cfg, run_id=link["run_id"], keep_duration=True) as run:
                    yield run
                return
            note = True

    tags = {"model_md5": md5, "mlflow.note.content": f"A run of its own: {why}.",
            "restored_from_run_cache": None if note else "true",
            "training_tracking_uri": link.get("tracking_uri") if trained_by and
            link.get("tracking_uri") != uri else None}
    with start_run(cfg, tags=tags) as run:
        if note and run.run_id:  # not when the store is down: start_run said so
            warnings.warn(f"{link_file}: {why}; logging into a new run {run.run_id} linked to "
                          "the training run (tag training_run_id)", stacklevel=3)
        run.set_tags({"training_run_id": trained_by or run._call(_training_run, md5)})
        run.log_params(params)
        run.log_dataset(meta, params["data.root"])
        run.log_metrics(json.loads((train_dir / "metrics.json").read_text()))
        with open(train_dir / "history.csv", newline="") as f:
            for row in csv.DictReader(f):
                run.log_metrics({k: float(v) for k, v in row.items() if k != "epoch"},
                                step=int(row["epoch"]))
        for name in ("metrics.json", "history.csv"):
            run.log_artifact(train_dir / name, "train")
        if run.run_id:
            _write_link(link_file, run, md5)
        yield run


def _from_spool(cfg: MlflowConfig, link: dict, uri: str) -> dict:
    """run.json naming a run spooled from its start: once the server answers, the spool is
    replayed and the link names that run's copy on the server."""
    if link.get("tracking_uri") != plain_uri(spool_uri()) or not is_server(uri) \
            or uri in FAILING or not reachable(uri):
        return link
    replay_spool(uri)
    try:
        found = _server_id(cfg.experiment, link.get("run_id"), uri)
    except Exception:  # noqa: BLE001 - start_run reports the server
        return link
    return link | {"run_id": found, "tracking_uri": uri} if found != link.get("run_id") else link


def _server_id(experiment: str, run_id: str, uri: str) -> str:
    """`run_id` on the server at `uri`: a run spooled from its start (run.json, a checkpoint
    of a resumed training) is its copy there once replayed."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from stages.tracking.sync import SOURCE_RUN, label

    client = mlflow.MlflowClient(uri)
    try:
        return client.get_run(run_id).info.run_id
    except MlflowException as e:
        if e.error_code not in MISSING_RUN:
            raise
    exp = client.get_experiment_by_name(experiment)
    key = f"{label(spool_uri())}#{run_id}"
    runs = client.search_runs([exp.experiment_id], f"tags.`{SOURCE_RUN}` = '{key}'",
                              max_results=1) if exp else []
    return runs[0].info.run_id if runs else run_id


def _unusable(cfg: MlflowConfig, uri: str, run_id: str | None,
              params: dict[str, Any]) -> tuple[str | None, str | None]:
    """Why a later stage cannot log into the run `run_id` (None: it can), and the run that
    trained the model. An unreachable store is start_run's to report: None."""
    import mlflow
    from mlflow.exceptions import MlflowException

    if not run_id:
        return "training ran without tracking (no run id)", None
    if is_server(uri) and (uri in FAILING or not reachable(uri)):  # start_run spools, once
        return None, run_id
    try:
        mlflow.set_tracking_uri(uri)
        with _store_lock(uri):
            _experiment_id(cfg.experiment, uri)  # a deleted experiment comes back with its runs
        run = mlflow.MlflowClient().get_run(run_id)
    except MlflowException as e:
        if e.error_code in MISSING_RUN:
            return f"its MLflow run {run_id} is not in {uri}", run_id
        if is_server(uri) and outage(e):  # start_run spools at once, and says so
            FAILING.add(uri)
        return None, run_id
    except Exception as e:  # noqa: BLE001 - unreachable: start_run warns once
        if is_server(uri) and outage(e):
            FAILING.add(uri)
        return None, run_id
    trained_by = run.data.tags.get("training_run_id", run_id)
    if run.info.lifecycle_stage == "deleted":
        return f"its MLflow run {run_id} was deleted", trained_by
    want = {k: str(v) for k, v in params.items()}
    changed = sorted(k for k in want.keys() | run.data.params.keys()
                     if want.get(k) != run.data.params.get(k))
    if changed:
        shown = ", ".join(f"{k}: {run.data.params.get(k)} -> {want.get(k)}" for k in changed[:3])
        return (f"its MLflow run {run_id} was logged with other params "
                f"({shown}{', ...' if len(changed) > 3 else ''})"), trained_by
    return None, run_id


def _training_run(md5: str) -> str | None:
    """The first run that logged this model, from any experiment in the store."""
    import mlflow

    client = mlflow.MlflowClient()
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, filter_string=f"tags.model_md5 = '{md5}'",
                              order_by=["attributes.start_time ASC"], max_results=1)
    return runs[0].data.tags.get("training_run_id") if runs else None


def experiment_url(cfg: MlflowConfig, base: str) -> str:
    """The experiment's runs table in the MLflow UI at `base` (the classic view, not GenAI)."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri(cfg))
    exp = mlflow.get_experiment_by_name(cfg.experiment)
    if exp is None:
        return f"{base} (no experiment {cfg.experiment!r} yet: run `make repro` first)"
    return (f"{base}/#/experiments/{exp.experiment_id}/runs"
            f"?viewStateShareKey={VIEW}&workflowType=machine_learning")

