"""The one MLflow run per model. Train opens it (`start_run`) and names it, with the MD5 of the
model it wrote and the DVC experiment's name, in models/train/run.json (`link_model`; not a DVC
output). Evaluate and export continue it (`experiment_run`) when both still match and the run is
in the store with the params they run with; otherwise they open a run of their own, named after
the experiment and linked to the run that trained the model (tag `training_run_id`). Also what
every run is tagged with (the commit, the DVC experiment, the lock) and the experiment's address
in the UI.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from reprotrain.redact import masked_uri
from reprotrain.tracking.names import EXPERIMENT_TAGS, VIEW, exp_name, git_commit, run_name
from reprotrain.tracking.spool import replay_spool
from reprotrain.tracking.stores import (
    FAILING,
    is_server,
    mark_failing,
    outage,
    reachable,
    reason,
    refusal,
    spool_file,
    spool_uri,
    store_lock,
    tracking_uri,
)
from reprotrain.tracking.tracker import Tracker
from stages.config import MlflowConfig
from stages.lib.cli import timed
from stages.lib.errors import StageWarning
from stages.lib.files import file_hash, write_json
from stages.lib.paths import repo_root

RUN_FILE = "run.json"
# How a store answers for a run it does not hold: basic-auth answers 403, not 404, since it
# checks the permission on the run's experiment before anything looks the run up.
MISSING_RUN = ("RESOURCE_DOES_NOT_EXIST", "PERMISSION_DENIED")
# A sweep's trials (reprotrain/sweep/worker.py) are children of the study's run (opened by
# reprotrain/sweep/launch.py): MLflow nests them under it.
PARENT_RUN_ENV = "REPROTRAIN_SWEEP_PARENT_RUN"


def lock_hash() -> str | None:
    """Which locked environment ran: results are bitwise reproducible only on the same lock."""
    lock = Path("requirements.lock")
    if not lock.exists():
        return None
    return file_hash(lock)[:16]


def _md5(path: Path) -> str:
    """The hash DVC records for the file in dvc.lock: a run is found from `dvc exp show`."""
    return file_hash(path, "md5")


def _experiment_id(name: str, uri: str) -> str:
    import mlflow

    exp = mlflow.get_experiment_by_name(name)
    if exp is not None and exp.lifecycle_stage == "deleted":
        # Its name stays taken until `mlflow gc`: the only way to log under it again. MLflow
        # restores the runs deleted with it, so runs named in run.json are whole again.
        mlflow.MlflowClient().restore_experiment(exp.experiment_id)
        warnings.warn(f"MLflow experiment {name!r} was deleted in {masked_uri(uri)}; restored it with its "
                      "runs (delete them one by one, or rename mlflow.experiment)", StageWarning,
                      stacklevel=2)
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
                tracker.switch_to_spool(None)
            else:
                replay_spool(tracker.uri)
                if tracker.uri in FAILING:  # the replay found it failing: no second wait
                    raise ConnectionError(f"{masked_uri(tracker.uri)} failed during the replay")
                mlflow.set_tracking_uri(tracker.uri)
                with store_lock(tracker.uri):
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
        if not tracker.switch_to_spool(e):
            warnings.warn(f"MLflow tracking at {masked_uri(tracker.uri)} is unavailable "
                          f"({refusal(e) or reason(e)}); continuing without tracking, DVC "
                          "outputs are unaffected", StageWarning, stacklevel=3)
    if tracker.spooled:  # a reopened spooled run keeps its end; a new one has none
        ended = tracker.call(lambda: mlflow.active_run().info.end_time)
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
            tracker.call(tracker.confirm)
            tracker.enabled = True  # close the run even if a log call failed on the way
            active = mlflow.active_run().info.run_id
            tracker.call(mlflow.end_run, status)
            if ended and active:
                tracker.call(lambda: mlflow.MlflowClient().set_terminated(active, status, ended))
            if tracker.spooled:  # after its end: a sync that saw it running sends it again
                (spool_file().parent / "unsynced").touch()


def link_model(run: Tracker, model: Path) -> None:
    """Train's last word: the run of this experiment is the one that trained `model`."""
    md5 = _md5(model)
    run.set_tags({"model_md5": md5, "training_run_id": run.run_id})
    _write_link(model.with_name(RUN_FILE), run, md5)


def _write_link(path: Path, run: Tracker, md5: str) -> None:
    """run.json: which run is this experiment's, for this model."""
    write_json(path, {"run_id": run.run_id, "tracking_uri": masked_uri(run.store), "model_md5": md5,
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

    # Masked again: a run.json written before masking covered every form may hold a password.
    trained_in = link.get("tracking_uri") and masked_uri(link["tracking_uri"])
    tags = {"model_md5": md5, "mlflow.note.content": f"A run of its own: {why}.",
            "restored_from_run_cache": None if note else "true",
            "training_tracking_uri": trained_in if trained_by and
            trained_in != masked_uri(uri) else None}
    with start_run(cfg, tags=tags) as run:
        if note and run.run_id:  # not when the store is down: start_run said so
            warnings.warn(f"{link_file}: {why}; logging into a new run {run.run_id} linked to "
                          "the training run (tag training_run_id)", StageWarning, stacklevel=3)
        run.set_tags({"training_run_id": trained_by or run.call(_training_run, md5)})
        run.log_params(params)
        run.log_dataset(meta, params["data.root"])
        run.log_metrics(json.loads((train_dir / "metrics.json").read_text()))
        with open(train_dir / "history.csv", newline="") as f:
            for row in csv.DictReader(f):
                run.log_metrics({k: float(v) for k, v in row.items() if k != "epoch"},
                                step=int(row["epoch"]))
        logged = [train_dir / "metrics.json", train_dir / "history.csv"]
        made_on = train_dir / "made_on.json"
        if made_on.exists():  # where the weights were made, which need not be here
            run.set_tags(json.loads(made_on.read_text()))
            logged.append(made_on)
        for path in logged:
            run.log_artifact(path, "train")
        if run.run_id:
            _write_link(link_file, run, md5)
        yield run


def _from_spool(cfg: MlflowConfig, link: dict, uri: str) -> dict:
    """run.json naming a run spooled from its start: once the server answers, the spool is
    replayed and the link names that run's copy on the server."""
    if link.get("tracking_uri") != masked_uri(spool_uri()) or not is_server(uri) \
            or uri in FAILING or not reachable(uri):
        return link
    replay_spool(uri)
    try:
        found = _server_id(cfg.experiment, link.get("run_id"), uri)
    except Exception:  # noqa: BLE001 - start_run reports the server
        return link
    return link | {"run_id": found, "tracking_uri": masked_uri(uri)} if found != link.get("run_id") else link


def _server_id(experiment: str, run_id: str, uri: str) -> str:
    """`run_id` on the server at `uri`: a run spooled from its start (run.json, a checkpoint
    of a resumed training) is its copy there once replayed."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from reprotrain.tracking.sync import SOURCE_RUN, label

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
        with store_lock(uri):
            _experiment_id(cfg.experiment, uri)  # a deleted experiment comes back with its runs
        run = mlflow.MlflowClient().get_run(run_id)
    except MlflowException as e:
        if e.error_code in MISSING_RUN:
            return f"its MLflow run {run_id} is not in {masked_uri(uri)}", run_id
        if is_server(uri) and outage(e):  # start_run spools at once, and says so
            mark_failing(uri, e)
        return None, run_id
    except Exception as e:  # noqa: BLE001 - unreachable: start_run warns once
        if is_server(uri) and outage(e):
            mark_failing(uri, e)
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
