"""The whole pipeline, end to end, as a user drives it: real dvc, real MLflow, real training."""

from __future__ import annotations

import json

import pytest

from tests.conftest import copy_repo, env_with, run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A fresh copy of the repo after one `dvc repro` with a short training run."""
    path = copy_repo(tmp_path_factory.mktemp("repo"), {"epochs": "3"})
    run(["dvc", "repro"], path, env=env_with())
    return path


def mlflow_runs(path):
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("reprotrain")
    return client, client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])


def test_repro_writes_every_output(repo):
    for f in ("data/prepared/meta.json", "data/prepared/train.pt", "models/train/model.pt",
              "models/train/metrics.json", "models/train/history.csv", "models/train/run.json",
              "models/eval/metrics.json", "models/eval/confusion.csv", "models/eval/confusion.png",
              "models/eval/misclassified.png", "models/eval/per_class.json",
              "models/export/model.onnx", "models/export/model.pt2",
              "models/export/model.safetensors", "models/export/model.json"):
        assert (repo / f).is_file() and (repo / f).stat().st_size > 0, f
    metrics = json.loads((repo / "models/eval/metrics.json").read_text())
    assert set(metrics) >= {"accuracy", "loss", "macro_f1"}
    assert metrics["accuracy"] >= 0.9  # 3 epochs; the default 30 reach >= 0.98
    history = (repo / "models/train/history.csv").read_text().splitlines()
    assert history[0].startswith("epoch,train_loss,train_acc,val_loss,val_acc,lr,grad_norm")
    assert len(history) == 1 + 3
    confusion = (repo / "models/eval/confusion.csv").read_text().splitlines()
    assert confusion[0] == "actual,predicted" and len(confusion) == 1 + metrics["n"]
    model_json = json.loads((repo / "models/export/model.json").read_text())
    assert model_json["classes"] == [str(i) for i in range(10)]
    assert model_json["input_shape"] == [1, 16, 16]


def test_one_mlflow_run_holds_params_metrics_and_artifacts(repo):
    client, runs = mlflow_runs(repo)
    run_id = json.loads((repo / "models/train/run.json").read_text())["run_id"]
    assert [r.info.run_id for r in runs] == [run_id]
    r = runs[0]
    assert r.info.status == "FINISHED"
    assert r.data.params["lr"] == "0.003" and r.data.params["train.warmup_epochs"] == "1.0"
    assert r.data.params["model.arch"] == "cnn"
    metrics = json.loads((repo / "models/eval/metrics.json").read_text())
    assert r.data.metrics["eval.accuracy"] == pytest.approx(metrics["accuracy"])
    assert len(client.get_metric_history(run_id, "val_acc")) == 3
    assert r.data.tags["git_commit"] and r.data.tags["precision"] in ("bf16", "fp32")
    artifacts = {a.path for top in ("train", "eval", "export") for a in client.list_artifacts(run_id, top)}
    assert {"train/history.csv", "eval/confusion.png", "export/model.onnx"} <= artifacts
    # Artifacts live in the workspace next to the store, not in a temporary copy.
    assert r.info.artifact_uri.startswith((repo / "mlartifacts").as_uri())
    models = client.search_logged_models(experiment_ids=[r.info.experiment_id])
    assert [m.source_run_id for m in models] == [run_id]  # mlflow.pytorch.log_model


def test_second_repro_runs_nothing(repo):
    p = run(["dvc", "repro"], repo, env=env_with())
    assert "Data and pipelines are up to date." in p.stdout
    assert "Running stage" not in p.stdout


def test_exp_run_sets_lr_and_shows_in_exp_show(repo):
    p = run(["dvc", "exp", "run", "-S", "lr=0.01"], repo, env=env_with())
    assert "Stage 'prepare' didn't change, skipping" in p.stdout  # only what changed reruns
    _, runs = mlflow_runs(repo)
    assert len(runs) == 2
    latest = runs[-1]
    assert latest.data.params["lr"] == "0.01"
    assert latest.data.tags.get("dvc_exp_name")
    shown = json.loads(run(["dvc", "exp", "show", "--json"], repo, env=env_with()).stdout)
    text = json.dumps(shown)
    assert '"lr": 0.01' in text and '"accuracy"' in text


def test_exp_run_rejects_unknown_key(repo):
    p = run(["dvc", "exp", "run", "-S", "no_such_key=1"], repo, env=env_with(), check=False)
    assert p.returncode != 0


def test_plots_diff_renders(repo):
    p = run(["dvc", "plots", "diff", "-o", "plots_out"], repo, env=env_with())
    assert (repo / "plots_out/index.html").exists(), p.stdout


def test_exp_run_with_two_processes_trains_through_torchrun(repo):
    p = run(["dvc", "exp", "run", "-S", "train.nproc_per_node=2"], repo, env=env_with())
    assert "trained cnn" in p.stderr + p.stdout
    metrics = json.loads((repo / "models/eval/metrics.json").read_text())
    assert metrics["accuracy"] >= 0.9
    client, runs = mlflow_runs(repo)
    assert runs[-1].data.params["train.nproc_per_node"] == "2"
    assert runs[-1].data.tags["world_size"] == "2" and runs[-1].info.status == "FINISHED"


def test_queued_experiments_with_two_workers_all_land_in_the_workspace_store(repo):
    import time

    _, before = mlflow_runs(repo)
    env = env_with()
    run(["dvc", "exp", "run", "--queue", "-S", "lr=0.001,0.003,0.02"], repo, env=env)
    run(["dvc", "queue", "start", "-j", "2"], repo, env=env)
    deadline = time.time() + 900
    while True:
        status = run(["dvc", "queue", "status"], repo, env=env).stdout
        if "Queued" not in status and "Running" not in status:
            break
        assert time.time() < deadline, status
        time.sleep(5)
    assert status.count("Success") >= 3 and "Failed" not in status, status
    _, after = mlflow_runs(repo)
    new = after[len(before):]
    assert sorted(r.data.params["lr"] for r in new) == ["0.001", "0.003", "0.02"]
    assert all(r.info.status == "FINISHED" for r in new)
    for r in new:
        tags = r.data.tags
        assert tags["dvc_exp_name"] and tags["git_commit"] and tags["params_hash"]
        assert tags["dvc_baseline_rev"] == tags["git_commit"]
        assert r.info.artifact_uri.startswith((repo / "mlartifacts").as_uri())
    assert not list(repo.glob(".dvc/tmp/exps/**/mlflow.db"))  # never in DVC's temporary copies
    shown = run(["dvc", "exp", "show", "--json"], repo, env=env).stdout
    for r in new:
        assert r.info.run_id in shown  # the MLflow run id is a column of `dvc exp show`


def test_ci_report_prints_params_metrics_and_plots(repo):
    from tests.conftest import VENV_BIN

    p = run(["make", "-s", "ci-report", "BASE=HEAD", f"VENV={VENV_BIN.parent}"], repo,
            env=env_with())
    assert "## Params: workspace vs HEAD" in p.stdout and "| lr " in p.stdout
    assert "## Metrics: workspace vs HEAD" in p.stdout and "accuracy" in p.stdout
    assert (repo / "dvc_plots/index.html").exists()
