"""MLflow tracking: the stages and the experiment import no mlflow, they log through this package.

One experiment, one MLflow run, never another's. Train opens a run and leaves its id, with the
MD5 of the model it wrote and the DVC experiment's name, in models/train/run.json (not a DVC
output). Evaluate and export log into that run when both still match and the run is in the
store with the params they run with; otherwise (training was restored from DVC's run-cache or
belongs to another experiment, the run was deleted or is in another store, or an `eval.*` param
changed since: MLflow params are immutable) they open a run of their own, named after the
experiment and linked to the run that trained the model (tag `training_run_id`). Tracking
never crashes training: when a tracking server stops answering (at the start or mid-run), the
stage says so once and logs the rest into a local spool (.mlflow-spool/, an embedded store)
that `make sync` replays; any other store that fails leaves a no-op tracker.
The DVC outputs are written all the same.

    runs.py     the one run per model: start_run (train), experiment_run (evaluate, export),
                link_model (run.json), the tags every run gets, experiment_url
    tracker.py  Tracker, what a run is logged through (the loop's `log` callable, metrics,
                params, artifacts, the dataset, a served model and its registered version)
    spool.py    the outage path: a run logged into .mlflow-spool/ while the server is down,
                and a stage's replay of it once the server answers
    sync.py     `make sync` (`python -m reprotrain.tracking.sync`): the spool, or any store, sent
                to a server
    names.py    what runs and metrics are called, the experiment's tags and UI view
    stores.py   which store (tracking_uri), the spool's place, whether a server answers or
                failed (outage, FAILING), errors in one line (reason, refusal); no MLflow

The stages use the names below; the rest is imported from the module that owns it. They are
imported on first use: `make sync` and the server import this package, and runs.py brings torch
(its file hashing), seconds a sync with nothing to send should not pay.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reprotrain.tracking.names import EXPERIMENT_TAGS, git_commit, metric_name, model_task, run_name
    from reprotrain.tracking.runs import (
        PARENT_RUN_ENV,
        experiment_run,
        experiment_url,
        link_model,
        start_run,
    )
    from reprotrain.tracking.stores import reason, refusal, tracking_uri
    from reprotrain.tracking.tracker import Tracker

# MLflow's downloads here (export's input example, `make serve`'s two files) are small: no
# progress bars in a stage's or a command's output.
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

__all__ = ["EXPERIMENT_TAGS", "PARENT_RUN_ENV", "Tracker", "experiment_run", "experiment_url",
           "git_commit", "link_model", "metric_name", "model_task", "reason", "refusal",
           "run_name", "start_run", "tracking_uri"]
HOME = {"EXPERIMENT_TAGS": "names", "git_commit": "names", "metric_name": "names",
        "run_name": "names", "PARENT_RUN_ENV": "runs", "experiment_run": "runs",
        "experiment_url": "runs", "link_model": "runs", "start_run": "runs", "reason": "stores",
        "refusal": "stores", "tracking_uri": "stores", "Tracker": "tracker",
        "model_task": "names"}


def __getattr__(name: str):
    if name in HOME:
        value = getattr(importlib.import_module(f"{__name__}.{HOME[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
