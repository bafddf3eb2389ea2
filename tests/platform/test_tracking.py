"""MLflow tracking: metric names and batches, and runs that survive their store. An
unreachable, read-only or shared store never stops training; a failed or killed stage's run says
so; later stages recover a run that was lost or stale (deleted, in another store, no run id)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import mlflow
import pytest
import torch

from reprotrain import tracking
from stages.checkpoints import latest_checkpoint
from stages.config import MlflowConfig, Params, flatten
from stages.data import save_prepared
from tests.conftest import ROOT, copy_params, copy_repo, env_with, run, set_params
from tests.support.workspaces import closed_port, lock_entries, workspace

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


def test_the_runs_table_shows_each_runs_data_source(mlflow_uri, monkeypatch):
    """Issue 57: DVC's random run names (`tubby-oast`) hid which run trained on Fashion-MNIST."""
    import json

    from stages.config import Params, flatten

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    with tracking.start_run(MlflowConfig(experiment="sources")) as run:
        run.log_params(flatten(Params()))  # as train logs them
    client = mlflow.MlflowClient(mlflow_uri)
    exp = client.get_experiment_by_name("sources")
    view = json.loads(exp.tags["mlflow.sharedViewState.reprotrain"])
    (column,) = [c for c in view["selectedColumns"] if "data.source" in c]
    key = column.removeprefix("params.").strip("`")
    assert client.get_run(run.run_id).data.params[key] == "digits"


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


def test_tracking_outage_never_stops_training(tmp_path, digits, mlflow_uri):
    a = workspace(tmp_path / "a", digits)
    b = workspace(tmp_path / "b", digits)
    run([sys.executable, "-m", "stages.train"], a,
        env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri))
    down = f"http://127.0.0.1:{closed_port()}"
    t = time.perf_counter()
    p = run([sys.executable, "-m", "stages.train"], b,
            env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=down))
    assert time.perf_counter() - t < 120
    assert p.stderr.count("is unreachable") == 1, p.stderr  # one warning, not one per metric
    assert json.loads((b / "models/train/metrics.json").read_text())["epochs_run"] == 3
    # Kept in the local spool for `make sync` (tests/platform/test_sync.py replays it).
    assert ".mlflow-spool" in json.loads((b / "models/train/run.json").read_text())["tracking_uri"]
    wa = torch.load(a / "models/train/model.pt", weights_only=True)["model"]
    wb = torch.load(b / "models/train/model.pt", weights_only=True)["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_two_processes_log_to_one_new_sqlite_store_at_once(tmp_path, digits):
    import mlflow

    store = tmp_path / "shared/mlflow.db"
    uri = f"sqlite:///{store}?timeout=60"
    dirs = [workspace(tmp_path / f"w{i}", digits, seed=str(i), **{"train.log_every": "1"})
            for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=d, text=True,
                              env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=uri),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for d in dirs]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert "unavailable" not in err and "failed" not in err, err
    client = mlflow.MlflowClient(f"sqlite:///{store}")
    for d in dirs:
        run_id = json.loads((d / "models/train/run.json").read_text())["run_id"]
        assert client.get_run(run_id).info.status == "FINISHED"
        assert len(client.get_metric_history(run_id, "val/acc")) == 3
        steps = len(client.get_metric_history(run_id, "train/loss_step"))
        assert steps == 3 * 20  # every step of 3 epochs x 20 steps, none lost


class DiesAtOnce(torch.utils.data.Dataset):
    """A DataLoader worker killed as it starts, as by the kernel's out-of-memory killer."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_workers_death_inside_a_tracking_call_is_the_workers_error(mlflow_uri, monkeypatch):
    """torch's SIGCHLD handler raises a dead worker's error wherever training is. Inside a
    tracking call it once became "MLflow logging failed", and tracking went off for the run."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    loader = torch.utils.data.DataLoader(DiesAtOnce(), num_workers=1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with tracking.start_run(MlflowConfig(experiment="worker-death")) as run:
            with pytest.raises(RuntimeError, match=r"^DataLoader worker \(pid \d+\) is killed by "
                                                   r"signal: Killed"):
                run.call(lambda: (iter(loader), time.sleep(60)))
            assert run.enabled
            run.log_metrics({"after": 1.0})
    assert [str(w.message) for w in said if "MLflow" in str(w.message)] == []
    assert mlflow.MlflowClient(mlflow_uri).get_run(run.run_id).data.metrics == {"after": 1.0}


def test_a_failing_stage_leaves_dvc_lock_and_marks_the_run_failed(tmp_path):
    repo = copy_repo(tmp_path / "repo", {"epochs": "2"})
    env = env_with()
    run(["dvc", "repro"], repo, env=env)
    lock = (repo / "dvc.lock").read_bytes()
    model = (repo / "models/train/model.pt").read_bytes()
    set_params(repo / "params.yaml", {"lr": "1e30"})  # diverges: a non-finite loss
    p = run(["dvc", "repro"], repo, env=env, check=False)
    assert p.returncode != 0 and "non-finite loss at step" in p.stderr
    # Every stage's entry as it was; only the params check, which passed, records the new lr.
    assert lock_entries(repo / "dvc.lock") == lock_entries(lock)

    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    exp = client.get_experiment_by_name("reprotrain")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
    assert runs[0].info.status == "FAILED" and runs[1].info.status == "FINISHED"
    # The failed run's outputs are gone (DVC removes outs before a stage), the previous model is
    # in the cache: restoring the params restores it without training.
    set_params(repo / "params.yaml", {"lr": "0.003"})
    p = run(["dvc", "repro"], repo, env=env)
    assert "Restored stage 'train' from run-cache" in p.stdout or "didn't change" in p.stdout
    assert (repo / "models/train/model.pt").read_bytes() == model


def test_sigterm_marks_the_run_killed(tmp_path, digits, mlflow_uri):
    w = workspace(tmp_path / "w", digits, epochs="50", batch_size="16")
    proc = subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=w,
                            env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not list(w.glob(".checkpoints/*/epoch-0001.sha256")):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    state = latest_checkpoint(next(w.glob(".checkpoints/*")))
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err

    import mlflow

    assert mlflow.MlflowClient(mlflow_uri).get_run(state["run_id"]).info.status == "KILLED"


def test_a_read_only_mlflow_store_is_one_warning(tmp_path, mlflow_uri, capfd, monkeypatch):
    import mlflow

    from reprotrain import tracking
    from stages.config import MlflowConfig

    db = tmp_path / "mlflow.db"  # a store that has served runs, then became read-only
    shutil.copy(mlflow_uri.removeprefix("sqlite:///"), db)
    mlflow.MlflowClient(f"sqlite:///{db}").create_experiment(
        "read-only", artifact_location=(tmp_path / "art").as_uri())
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///file:{db}?mode=ro&uri=true"
    (cwd := tmp_path / "cwd").mkdir()
    monkeypatch.chdir(cwd)  # the store's lock once went to `file:/...` under the working folder
    try:
        with pytest.warns(UserWarning) as caught, tracking.start_run(MlflowConfig("read-only")) as r:
            r.log_metrics({"a": 1.0})
    finally:
        del os.environ["MLFLOW_TRACKING_URI"]
    assert [str(w.message) for w in caught if "MLflow" in str(w.message)] == [
        next(str(w.message) for w in caught if "readonly database" in str(w.message))]
    assert "\n" not in str(caught[0].message)
    out = capfd.readouterr()
    assert "Traceback" not in out.err and "SQL" not in out.err, out.err
    # (MLflow itself makes the empty folders `file:/...` here: _make_parent_dirs_if_sqlite)
    assert not [p for p in cwd.rglob("*") if p.is_file()] and (tmp_path / "mlflow.db.lock").is_file()


# ------------------------------------------------------------ a run that recovers


@pytest.fixture(scope="module")
def other_store(tmp_path_factory) -> str:
    """A second sqlite store, made once (migrations: ~6 s)."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('other') / 'mlflow.db'}"
    mlflow.MlflowClient(uri).search_experiments()
    return uri


def trained_dir(tmp_path: Path, cfg: MlflowConfig, params: dict) -> tuple[Path, str]:
    """What train leaves, with the real calls train makes: a run with its params, a model
    file, its metrics and history, and run.json linking them."""
    train_dir = tmp_path / "models/train"
    train_dir.mkdir(parents=True)
    (train_dir / "model.pt").write_bytes(uuid.uuid4().bytes)
    (train_dir / "metrics.json").write_text('{"best_val_acc": 0.9, "epochs_run": 2}')
    (train_dir / "history.csv").write_text("epoch,val_acc\n1,0.8\n2,0.9\n")
    with tracking.start_run(cfg) as run:
        run.log_params(params)
        tracking.link_model(run, train_dir / "model.pt")
    return train_dir, run.run_id


def evaluate(cfg: MlflowConfig, params: dict, meta: dict, train_dir: Path) -> tuple[str, list]:
    """What evaluate does with MLflow: the run it logged into, and the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracking.experiment_run(cfg, params, meta, train_dir) as run:
            run.log_evaluation({"accuracy": 0.95, "loss": 0.1, "n": 360})
    return run.run_id, [str(w.message) for w in caught]


FAULTS = ["none", "run deleted", "experiment deleted", "another store", "no run id",
          "eval param changed"]


@pytest.mark.parametrize("fault", FAULTS)
def test_later_stages_recover_tracking_after_a_lost_or_stale_run(fault, tmp_path, monkeypatch,
                                                                 mlflow_uri, other_store, digits):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    cfg = MlflowConfig(experiment=f"recover-{uuid.uuid4().hex[:8]}")
    params = flatten(Params())
    train_dir, trained = trained_dir(tmp_path, cfg, params)
    client = mlflow.MlflowClient(mlflow_uri)
    exp_id = client.get_run(trained).info.experiment_id
    store = mlflow_uri
    if fault == "run deleted":
        client.delete_run(trained)
    elif fault == "experiment deleted":
        client.delete_experiment(exp_id)
    elif fault == "another store":
        monkeypatch.setenv("MLFLOW_TRACKING_URI", other_store)
        store = other_store
    elif fault == "no run id":  # trained while the store was down
        link = json.loads((train_dir / "run.json").read_text())
        (train_dir / "run.json").write_text(json.dumps({**link, "run_id": None}))
    elif fault == "eval param changed":
        params = {**params, "eval.batch_size": 128}
    before = (train_dir / "run.json").read_text()

    logged_into, said = evaluate(cfg, params, {**digits[1]}, train_dir)
    client = mlflow.MlflowClient(store)
    got = client.get_run(logged_into)
    assert got.info.lifecycle_stage == "active" and got.info.status == "FINISHED"
    assert got.data.metrics["eval/accuracy"] == 0.95
    # The run's params are the ones its metrics were produced with.
    assert got.data.params == {k: str(v) for k, v in params.items()}
    assert client.get_experiment(got.info.experiment_id).name == cfg.experiment
    if fault in ("none", "experiment deleted"):  # restored with its runs: the same run
        assert logged_into == trained and (train_dir / "run.json").read_text() == before
        assert said == ([] if fault == "none" else
                        [f"MLflow experiment {cfg.experiment!r} was deleted in {store}; restored "
                         "it with its runs (delete them one by one, or rename mlflow.experiment)"])
        return
    assert logged_into != trained and len(said) == 1, said
    assert said[0].startswith(f"{train_dir / 'run.json'}: ") and logged_into in said[0]
    # With no run id, the store's run that logged this model's MD5 (found here: the same run).
    assert got.data.tags["training_run_id"] == trained
    assert got.data.tags["mlflow.note.content"].startswith("A run of its own: ")
    assert "restored_from_run_cache" not in got.data.tags
    assert {"val/best_acc", "val/acc"} <= set(got.data.metrics)  # the training's, from DVC outputs
    assert json.loads((train_dir / "run.json").read_text())["run_id"] == logged_into
    assert got.data.tags.get("training_tracking_uri") == (
        f"{mlflow_uri}" if fault == "another store" else None)
    if fault == "eval param changed":
        assert "eval.batch_size: 512 -> 128" in said[0]
        old = mlflow.MlflowClient(mlflow_uri).get_run(trained)
        assert old.data.params["eval.batch_size"] == "512" and not old.data.metrics
    if fault == "run deleted":  # the deleted run is left as the user left it
        assert mlflow.MlflowClient(mlflow_uri).get_run(trained).info.lifecycle_stage == "deleted"
    # Recovered for good: the next stage (export) logs into the new run, without a word.
    assert evaluate(cfg, params, {**digits[1]}, train_dir) == (logged_into, [])
