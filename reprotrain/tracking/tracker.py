"""The Tracker: what a stage and the training loop log (the loop's `log` callable writes through
it) goes into one MLflow run. When the store is a server that stops answering it goes on in the
spool (spool.py); any other store that fails leaves a no-op, since tracking never stops training.
Also the registration of a served model's version (candidate, champion).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from reprotrain.redact import masked_uri
from reprotrain.tracking.names import TASK, metric_name, promotes
from reprotrain.tracking.spool import open_spool_run
from reprotrain.tracking.stores import (
    FAILED_BECAUSE,
    SERVER_MODEL,
    SPOOL,
    is_server,
    mark_failing,
    outage,
    outage_cause,
    reason,
    spool_uri,
)
from stages.lib.cli import timed
from stages.lib.errors import StageWarning, worker_died

# The async logging thread otherwise polls its queue with a 1 s timeout, and every flush (each
# epoch, the end of the run, set_terminated) waits out that poll: 1.8 s of train's time at the
# end alone. Buffering waits on the stop event instead, which a flush sets.
os.environ.setdefault("MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS", "1")

# MLflow's sqlite store logs every database error with its traceback (about 60 lines for a
# read-only mlflow.db) before raising it; the one warning of the Tracker (or start_run) says it
# instead.
logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
# Its logging thread logs each batch a gone server refused; the Tracker spools them instead.
logging.getLogger("mlflow.utils.async_logging.async_logging_queue").setLevel(logging.CRITICAL)
# Every export's log_model ran the model on its input example, to infer the output's schema, and
# said so at INFO: a line on each export that asks nothing of the user. Its warnings still show.
logging.getLogger("mlflow.models.signature").setLevel(logging.WARNING)


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
        self.logged = self.call(lambda: _last_steps(mlflow.active_run().info.run_id)) or {}

    def call(self, fn, *args, **kwargs) -> Any:
        """`fn`'s answer; in the spool when the server stops answering, None (and one warning)
        when the store fails otherwise, and from then on."""
        if not self.enabled:
            return None
        try:
            with timed("tracking_s"):
                return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - tracking must never stop training
            if worker_died(e):  # raised here by torch's signal handler: training's, not ours
                raise
            if self.switch_to_spool(e):
                return self.call(fn, *args, **kwargs)
            self.enabled = False
            warnings.warn(f"MLflow logging to {masked_uri(self.uri)} failed ({reason(e)}); "
                          "continuing without tracking, DVC outputs are unaffected", StageWarning,
                          stacklevel=3)
            return None

    def switch_to_spool(self, e: Exception | None) -> bool:
        """Go on in the spool, once, when the server does not answer (`e`: what failed, None
        at the start). Fluent calls then log into the spooled run; the server's run id stays
        `run_id`, the one run.json and checkpoints name."""
        import mlflow

        if self.spooled or not is_server(self.uri) or (e is not None and not outage(e)):
            return False
        mark_failing(self.uri, e)
        self.spooled, where = True, spool_uri()
        try:
            with timed("tracking_s"):
                mlflow.set_tracking_uri(where)
                if mlflow.active_run():  # the server's: end_run forgets it, then asks the spool
                    try:
                        mlflow.end_run()
                    except Exception:  # noqa: BLE001 - the spool has no such run
                        pass
                run = open_spool_run(self.experiment, self.run_id, self.name, self.uri)
                self.run_id, self.spool_run_id = self.run_id or run.info.run_id, run.info.run_id
                for metrics, step, ts, _ in self.pending:
                    mlflow.log_metrics(metrics, step=step, timestamp=ts)
                self.pending.clear()
        except Exception as spool_error:  # noqa: BLE001 - a full disk: no tracking, as before
            self.enabled = False
            warnings.warn(f"MLflow tracking at {masked_uri(self.uri)} is unreachable and the local "
                          f"spool failed too ({reason(spool_error)}); continuing without "
                          "tracking, DVC outputs are unaffected", StageWarning, stacklevel=4)
            return False
        self.enabled = True
        # At the start (`e` None) or after a failed replay: why this process saw it fail.
        cause = outage_cause(e) or FAILED_BECAUSE.get(self.uri, "")
        print(f"warning: MLflow server {masked_uri(self.uri)} is unreachable"
              + (f" ({cause})" if cause else "") + f"; this run is spooled to {SPOOL}/ "
              "(`make sync` sends it when the server is back; DVC outputs are unaffected)",
              file=sys.stderr)
        return True

    @property
    def store(self) -> str:
        """The store that holds `run_id`: the spool for a run spooled from its start."""
        return spool_uri() if self.spooled and self.run_id == self.spool_run_id else self.uri

    def confirm(self) -> None:
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
            self.call(self.confirm)
            self.call(mlflow.log_metrics, named, step=step, timestamp=ts, synchronous=True)
            return
        ops = self.call(mlflow.log_metrics, named, step=step, timestamp=ts, synchronous=False)
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
            if worker_died(e):
                raise
            if self.switch_to_spool(e) or not isinstance(e, MlflowException):
                self.call(mlflow.log_metrics, named, step=step, timestamp=ts)
                return
        refused = []
        for name, value in named.items():
            try:
                mlflow.log_metric(name, value, step=step, timestamp=ts)
            except MlflowException:
                refused.append(name)
        if refused:
            warnings.warn(f"MLflow refused the metrics {refused}; the others are logged",
                          StageWarning, stacklevel=2)

    def log_evaluation(self, metrics: dict[str, float]) -> None:
        """Test metrics as `eval/...`; the test-set size is a fact (tag `eval.n`), not a chart."""
        self.log_metrics({k: v for k, v in metrics.items() if k != "n"}, prefix="eval/")
        self.set_tags({"eval.n": metrics.get("n")})

    def has_metric(self, name: str) -> bool:
        import mlflow

        # The active run: the spooled one when the server went away.
        active = mlflow.active_run()
        return active is not None and bool(self.call(
            lambda: name in mlflow.get_run(active.info.run_id).data.metrics))

    def log_params(self, params: dict[str, Any]) -> None:
        import mlflow

        self.call(mlflow.log_params, params)

    def set_tags(self, tags: dict[str, Any]) -> None:
        import mlflow

        self.call(mlflow.set_tags, {k: v for k, v in tags.items() if v not in (None, "")})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        import mlflow

        self.call(mlflow.log_artifact, str(path), artifact_path)

    def log_dataset(self, meta: dict, root: str) -> None:
        """The prepared data as the run's input: where it came from and its content hash."""
        self.call(_log_dataset, meta, root)

    def log_served_model(self, name: str, **kwargs):
        """A pyfunc model logged as code (reprotrain/serving/registry.py's model_kwargs): its ModelInfo, or
        None when tracking is off."""
        import mlflow.pyfunc

        self.served = (name, kwargs)
        return self.call(mlflow.pyfunc.log_model, name=name, **kwargs)

    def register(self, model_uri: str, name: str, accuracy: float, task: str) -> dict | None:
        """Register a version with alias `candidate`; move `champion` to it as `promotes` says.
        Registered in the spool, it says so here and returns None: a champion there is only the
        laptop's, and `make sync` decides it against the server's."""
        reg = self.call(self._register, model_uri, name, accuracy, task)
        if reg and self.spooled:
            print(f"registered {name} in the local spool ({SPOOL}/), not on the server, which "
                  "did not answer: `make sync` registers it there, champion if it beats the "
                  "server's")
            return None
        return reg

    def _register(self, model_uri: str, name: str, accuracy: float, task: str) -> dict:
        """`register_version`; in the spool, a model logged on the server before it failed is
        logged again there (the spool cannot register the server's), naming the server's copy."""
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
        return register_version(model_uri, name, accuracy, task)


def _log_dataset(meta: dict, root: str) -> None:
    import mlflow
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset

    from stages.sources import raw_data  # here: `make ui` imports this module, not torch

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


def register_version(model_uri: str, name: str, accuracy: float, task: str) -> dict:
    import mlflow

    client = mlflow.MlflowClient()
    # Without MLflow's "Successfully registered model", "Created version" lines (export says
    # where it registered, the server or the spool) and its wait for a version that a server
    # with its own artifact store makes ready at once.
    with contextlib.redirect_stderr(io.StringIO()):
        version = mlflow.register_model(model_uri, name, await_registration_for=0).version
    client.set_model_version_tag(name, version, "eval.accuracy", repr(accuracy))
    client.set_model_version_tag(name, version, TASK, task)
    client.set_registered_model_alias(name, "candidate", version)
    promoted, champion = promotes(client, name, repr(accuracy), task)
    if promoted:
        client.set_registered_model_alias(name, "champion", version)
    return {"name": name, "version": int(version), "champion": promoted,
            "previous_champion": int(champion.version) if champion else None,
            "other_task": bool(champion) and champion.tags.get(TASK, task) != task}
