"""What runs, metrics and the experiment are called in MLflow, and how its UI shows them: a run
is named after the DVC experiment (or, in the workspace, the params that differ from the
commit's), metrics are grouped as `train/...`, `val/...`, `eval/...`, and the experiment carries
the runs table's shared view. Imports no MLflow.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from typing import Any

from stages.config import flatten
from stages.metrics import MLFLOW_NAMES

# MLflow 3.17's UI opens experiments in GenAI mode (Traces, Latency, Token Usage) and its runs
# table with no params or metrics. The experiment says it is model training, and carries a
# shared view of the runs table with the columns worth comparing; `make ui` prints its URL. The
# data source among them: a DVC experiment's run is named after it (`tubby-oast`), which says
# nothing of the data it trained on.
VIEW = "reprotrain"
VIEW_COLUMNS = ["attributes.`Duration`", "params.`data.source`", "params.`lr`", "params.`epochs`",
                "params.`batch_size`",
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


# A version's tag naming what it answers (classes, channels, image size: model_task's JSON).
TASK = "task"


def model_task(spec: dict) -> str:
    """What a model answers, from export's model.json spec: versions of one task compete."""
    return json.dumps({k: spec[k] for k in ("classes", "input_shape")}, sort_keys=True)


def promotes(client, name: str, accuracy: str | None, task: str | None) -> tuple[bool, Any]:
    """The project's promotion rule, for export and for `make sync` against the server: a
    version becomes champion when there is none, or when it answers the champion's task and
    beats its test accuracy. A model of other classes or inputs never displaces it (a shapes
    model's 1.0 on shapes says nothing of the digits the champion's callers send). Returns the
    decision and the champion it was made against."""
    from mlflow.exceptions import MlflowException

    try:
        champion = client.get_model_version_by_alias(name, "champion")
    except MlflowException:  # no champion yet
        return True, None
    same = champion.tags.get(TASK) in (None, task)  # a champion from before tasks: any
    return same and float(accuracy or "-1") > float(champion.tags.get("eval.accuracy", "-1")), \
        champion
