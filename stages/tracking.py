"""MLflow tracking; the only module that imports mlflow.

One experiment, one MLflow run, never another's. Train opens a run and leaves its id, with the
MD5 of the model it wrote and the DVC experiment's name, in models/train/run.json (not a DVC
output). Evaluate and export log into that run when both still match and the run is in the
store with the params they run with; otherwise (training was restored from DVC's run-cache or
belongs to another experiment, the run was deleted or is in another store, or an `eval.*` param
changed since: MLflow params are immutable) they open a run of their own, named after the
experiment and linked to the run that trained the model (tag `training_run_id`). Tracking
never crashes training: when the store is unreachable, the stage warns once and goes on with a
no-op tracker; the DVC outputs are written all the same.
"""

from __future__ import annotations

import csv
import json
import logging
import os
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

from stages.cli import timed
from stages.config import MlflowConfig, flatten, repo_root
from stages.files import file_hash, write_json

# A server that does not answer should cost seconds, not MLflow's default minutes of retries.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
# The async logging thread otherwise polls its queue with a 1 s timeout, and every flush (each
# epoch, the end of the run, set_terminated) waits out that poll: 1.8 s of train's time at the
# end alone. Buffering waits on the stop event instead, which a flush sets.
os.environ.setdefault("MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS", "1")

# MLflow's sqlite store logs every database error with its traceback (about 60 lines for a
# read-only mlflow.db) before raising it; the one warning below says it instead.
logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)

RUN_FILE = "run.json"
# A sweep's trials (stages/sweep.py) are children of the study's run: MLflow nests them under it.
PARENT_RUN_ENV = "REPROTRAIN_SWEEP_PARENT_RUN"
# MLflow's chart view groups metrics by the part of the name before the first `/`.
METRIC_NAMES = {
    "train_loss": "train/loss", "train_acc": "train/acc", "lr": "train/lr",
    "grad_norm": "train/grad_norm", "train_loss_step": "train/loss_step",
    "lr_step": "train/lr_step", "epochs_run": "train/epochs_run",
    "val_loss": "val/loss", "val_acc": "val/acc", "best_val_acc": "val/best_acc",
    "best_val_loss": "val/best_loss", "best_epoch": "val/best_epoch",
    "samples_per_s": "perf/samples_per_s", "epoch_s": "perf/epoch_s",
    "peak_mem_mb": "perf/peak_mem_mb", "train_s": "perf/train_s",
    "num_params": "model/num_params",
}
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
    return re.sub(r"[^\w\-. :/]", "_", METRIC_NAMES.get(key, key), flags=re.ASCII)


def reason(e: Exception) -> str:
    """An exception in one line: SQLAlchemy's carry the SQL, its parameters and a link."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip() and not
             line.startswith(("[SQL", "[parameters", "(Background", "(raised as a result"))]
    return f"{type(e).__name__}: {' '.join(lines)[:300]}"


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


def exp_name() -> str | None:
    """The DVC experiment being run (`dvc exp run`, also queued and --temp), or None for
    `dvc repro` and direct runs."""
    return os.environ.get("DVC_EXP_NAME") or None


def run_name() -> str:
    """The MLflow run is named after the DVC experiment, so `dvc exp show` and the UI agree.
    A `dvc repro` in the workspace has no such name: its run is named after the commit, the
    params that differ from the commit's and the time, so that five reruns with other lr and
    epochs read as five runs: `workspace@967714c lr=0.01 epochs=5 00:31:07`."""
    if exp_name():
        return exp_name()
    commit = git_commit()[:7] or "nogit"
    return " ".join([f"workspace@{commit}", *params_changed(), time.strftime("%H:%M:%S")])


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


class Tracker:
    """Logs into one MLflow run; every call is a no-op once tracking has failed."""

    def __init__(self, uri: str):
        self.uri, self.run_id, self.enabled = uri, None, False
        self.logged: dict[str, int] = {}  # a resumed run's last step of each metric

    def resume(self) -> None:
        """A run resumed from a checkpoint repeats what it logged after that checkpoint (the
        epoch's row goes out just before it, steps up to 1 s before a kill): `log` skips those
        steps, which a bitwise resume would log with the same values."""
        self.logged = self._call(_last_steps, self.run_id) or {}

    def _call(self, fn, *args, **kwargs) -> Any:
        if not self.enabled:
            return None
        try:
            with timed("tracking_s"):
                return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - tracking must never stop training
            self.enabled = False
            warnings.warn(f"MLflow logging to {self.uri} failed ({reason(e)}); "
                          "continuing without tracking, DVC outputs are unaffected", stacklevel=3)
            return None

    def log(self, metrics: dict[str, float], step: int, durable: bool = False) -> None:
        """The loop's `log`: a step's figures asynchronously, since a synchronous sqlite write
        costs ~15 ms here; an epoch's row (`durable`) after the queue is flushed, so the run
        holds every epoch that a checkpoint covers."""
        import mlflow

        named = {metric_name(k): v for k, v in metrics.items()}
        named = {k: v for k, v in named.items() if step > self.logged.get(k, -1)}
        if not named:
            return
        if durable:
            self._call(mlflow.flush_async_logging)
        self._call(mlflow.log_metrics, named, step=step, synchronous=durable)

    def log_metrics(self, metrics: dict[str, float], prefix: str = "", step: int = 0) -> None:
        """Synchronously, as one batch; a batch the store refuses is retried one metric at a
        time, so one bad value never drops the others."""
        import mlflow
        from mlflow.exceptions import MlflowException

        named = {metric_name(prefix + k): float(v) for k, v in metrics.items()}
        if not self.enabled:
            return
        try:
            with timed("tracking_s"):
                mlflow.log_metrics(named, step=step)
            return
        except MlflowException:
            pass
        except Exception:  # noqa: BLE001 - unreachable store: warn once, go on
            self._call(mlflow.log_metrics, named, step=step)
            return
        refused = []
        for name, value in named.items():
            try:
                mlflow.log_metric(name, value, step=step)
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

        return bool(self._call(lambda: name in mlflow.get_run(self.run_id).data.metrics))

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
        """A pyfunc model logged as code (stages/serving.py's model_kwargs): its ModelInfo, or
        None when tracking is off."""
        import mlflow.pyfunc

        return self._call(mlflow.pyfunc.log_model, name=name, **kwargs)

    def register(self, model_uri: str, name: str, accuracy: float) -> dict | None:
        """Register a version with alias `candidate`; move `champion` to it when its test
        accuracy beats the current champion's (or there is none)."""
        return self._call(_register, model_uri, name, accuracy)


def _log_dataset(meta: dict, root: str) -> None:
    import mlflow
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset

    if meta["source"] == "digits":
        from stages.data import digits_file  # here: `make ui` imports this module, not torch

        where = digits_file()
    else:
        where = (repo_root() / root).resolve()
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
        except Exception:  # noqa: BLE001 - another process created it first
            pass
        exp = mlflow.get_experiment_by_name(name)
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
    study's run (PARENT_RUN_ENV)."""
    tracker = Tracker(tracking_uri(cfg))
    ended = None
    try:
        with timed("tracking_s"):
            import mlflow

            mlflow.set_tracking_uri(tracker.uri)
            with _store_lock(tracker.uri):
                exp_id = _experiment_id(cfg.experiment, tracker.uri)
            if run_id:
                ended = mlflow.MlflowClient().get_run(run_id).info.end_time if keep_duration else None
                run = mlflow.start_run(run_id=run_id)
            else:
                run = mlflow.start_run(experiment_id=exp_id, run_name=name or run_name())
            tracker.run_id, tracker.enabled = run.info.run_id, True
            tracker.set_tags({"git_commit": git_commit(), "dvc_exp_name": exp_name(),
                              "lock_sha256": lock_hash(),
                              "dvc_baseline_rev": os.environ.get("DVC_EXP_BASELINE_REV"),
                              "mlflow.parentRunId": os.environ.get(PARENT_RUN_ENV),
                              **(tags or {})})
    except Exception as e:  # noqa: BLE001 - tracking must never stop training
        warnings.warn(f"MLflow tracking at {tracker.uri} is unavailable ({reason(e)}); "
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
            if ended:
                tracker._call(mlflow.MlflowClient().set_terminated, tracker.run_id, status, ended)


def link_model(run: Tracker, model: Path) -> None:
    """Train's last word: the run of this experiment is the one that trained `model`."""
    md5 = _md5(model)
    run.set_tags({"model_md5": md5, "training_run_id": run.run_id})
    _write_link(model.with_name(RUN_FILE), run, md5)


def _write_link(path: Path, run: Tracker, md5: str) -> None:
    """run.json: which run is this experiment's, for this model."""
    write_json(path, {"run_id": run.run_id, "tracking_uri": run.uri, "model_md5": md5,
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


def _unusable(cfg: MlflowConfig, uri: str, run_id: str | None,
              params: dict[str, Any]) -> tuple[str | None, str | None]:
    """Why a later stage cannot log into the run `run_id` (None: it can), and the run that
    trained the model. An unreachable store is start_run's to report: None."""
    import mlflow
    from mlflow.exceptions import MlflowException

    if not run_id:
        return "training ran without tracking (no run id)", None
    try:
        mlflow.set_tracking_uri(uri)
        with _store_lock(uri):
            _experiment_id(cfg.experiment, uri)  # a deleted experiment comes back with its runs
        run = mlflow.MlflowClient().get_run(run_id)
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return f"its MLflow run {run_id} is not in {uri}", run_id
        return None, run_id
    except Exception:  # noqa: BLE001 - unreachable: start_run warns once
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

