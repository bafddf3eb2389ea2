"""MLflow names and batches: any class name, and a refused metric never drops the others."""

from __future__ import annotations

import csv
import json
import sys

import mlflow
import pytest

from stages import tracking
from stages.config import MlflowConfig
from stages.data import save_prepared
from tests.conftest import ROOT, copy_params, env_with, run, set_params

HOSTILE = ["a,b", "c+d", "e (f)", "g h", "i/j", "k=l", "m'n", "o;p", "q*r", "s#t"]


def test_metric_names_are_grouped_and_safe_for_mlflow():
    assert tracking.metric_name("val_acc") == "val/acc"
    assert tracking.metric_name("eval/a,b (c)+d") == "eval/a_b _c__d"
    from mlflow.utils.validation import _validate_metric_name

    for name in HOSTILE:
        _validate_metric_name(tracking.metric_name(f"eval/{name}.f1"))  # raises if refused


def test_a_refused_metric_never_drops_the_others(mlflow_uri, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    too_long = "x" * 1000  # MLflow refuses names over 250 characters
    with pytest.warns(UserWarning, match="refused the metrics"):
        with tracking.start_run(MlflowConfig(experiment="refused")) as run:
            run.log_metrics({"accuracy": 0.5, too_long: 1.0, "loss": 0.25}, prefix="eval/")
            run.log_metrics({"macro_f1": 0.75}, prefix="eval/")  # tracking still on
    r = mlflow.MlflowClient(mlflow_uri).get_run(run.run_id)
    assert r.data.metrics == {"eval/accuracy": 0.5, "eval/loss": 0.25, "eval/macro_f1": 0.75}
    assert r.info.status == "FINISHED"


@pytest.mark.slow
def test_class_folders_named_with_any_character_are_evaluated_and_logged(tmp_path, digits,
                                                                         mlflow_uri):
    """Train and evaluate for real on digits whose classes carry the characters MLflow refuses
    in metric names; the eval metrics land, per-class figures are one table."""
    splits, meta = digits
    copy_params(tmp_path)
    set_params(tmp_path / "params.yaml", {"epochs": "1", "model.width": "8"})
    save_prepared(tmp_path / "data/prepared", splits, {**meta, "classes": HOSTILE})
    env = env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri)
    run([sys.executable, "-m", "stages.train"], tmp_path, env=env)
    p = run([sys.executable, "-m", "stages.evaluate"], tmp_path, env=env)
    assert "refused" not in p.stderr and "failed" not in p.stderr, p.stderr
    with open(tmp_path / "models/eval/per_class.csv", newline="") as f:
        assert [row["class"] for row in csv.DictReader(f)] == HOSTILE
    run_id = json.loads((tmp_path / "models/train/run.json").read_text())["run_id"]
    client = mlflow.MlflowClient(mlflow_uri)
    r = client.get_run(run_id)
    assert r.info.status == "FINISHED"
    assert {"eval/accuracy", "eval/loss", "eval/macro_f1"} <= set(r.data.metrics)
    assert not [m for m in r.data.metrics if m.startswith("eval/") and m.count("/") > 1]
    local = client.download_artifacts(run_id, "eval/per_class.csv", str(tmp_path / "dl"))
    with open(local, newline="") as f:
        assert [row["class"] for row in csv.DictReader(f)] == HOSTILE
