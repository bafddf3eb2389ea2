"""The whole pipeline, end to end, as a user drives it: real dvc, real MLflow, real training."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from stages.lib.cli import HEAVY_IMPORTS
from tests.conftest import (
    VENV_BIN,
    committed,
    copy_repo,
    env_with,
    rendered_dom,
    run,
    set_params,
    start_queue,
    wait_for_queue,
)


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A fresh copy of the repo after one `dvc repro` with a short training run, every stage
    cold: what each stage imports when it starts without the warm process (reprotrain/warm.py,
    which has them all imported already)."""
    path = copy_repo(tmp_path_factory.mktemp("repo"), {"epochs": "3"})
    timings = tmp_path_factory.mktemp("timings") / "stages.jsonl"
    run(["dvc", "repro"], path, env=env_with(REPROTRAIN_TIMINGS=str(timings), REPROTRAIN_WARM="0"))
    shutil.copy(timings, path / ".dvc/tmp/stage-timings.jsonl")
    return path


# The `cache: false` outputs: committed with git, read by comparisons.
COMMITTED = ["train/metrics.json", "train/history.csv", "eval/metrics.json", "eval/per_class.csv",
             "eval/confusion.csv", "eval/confusion.png", "eval/misclassified.png"]


def mlflow_runs(path):
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("reprotrain")
    return client, client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])


def committed_in(path, name: str) -> bytes:
    return subprocess.run(["git", "show", f"HEAD:{name}"], cwd=path, capture_output=True,
                          check=True).stdout


def exps_table(path) -> list[str]:
    return run(["make", "-s", "exps", f"VENV={VENV_BIN.parent}"], path).stdout.splitlines()


def test_repro_writes_every_output(repo):
    for f in ("data/prepared/meta.json", "data/prepared/train.pt", "models/train/model.pt",
              "models/train/model.sha256", "models/train/metrics.json", "models/train/history.csv",
              "models/train/run.json", "models/train/made_on.json",
              "models/eval/metrics.json", "models/eval/confusion.csv", "models/eval/confusion.png",
              "models/eval/misclassified.png", "models/eval/per_class.csv",
              "models/export/model.onnx", "models/export/model.pt2",
              "models/export/model.safetensors", "models/export/model.json"):
        assert (repo / f).is_file() and (repo / f).stat().st_size > 0, f
    metrics = json.loads((repo / "models/eval/metrics.json").read_text())
    assert set(metrics) == {"accuracy", "loss", "macro_f1", "n"}
    assert metrics["accuracy"] >= 0.9  # 3 epochs; the default 30 reach >= 0.98
    # Only what is worth comparing: no run ids or timings in what DVC and git keep.
    assert set(json.loads((repo / "models/train/metrics.json").read_text())) == {
        "best_val_acc", "best_val_loss", "best_epoch", "epochs_run", "num_params"}
    # Where the weights were made, and nothing that differs between runs on one machine.
    assert set(json.loads((repo / "models/train/made_on.json").read_text())) == {"cpu", "bf16",
                                                                                 "threads"}
    history = (repo / "models/train/history.csv").read_text().splitlines()
    assert history[0] == "epoch,train_loss,train_acc,val_loss,val_acc,lr,grad_norm"
    assert len(history) == 1 + 3
    confusion = (repo / "models/eval/confusion.csv").read_text().splitlines()
    assert confusion[0] == "actual,predicted" and len(confusion) == 1 + metrics["n"]
    per_class = (repo / "models/eval/per_class.csv").read_text().splitlines()
    assert per_class[0] == "class,precision,recall,f1,support" and len(per_class) == 1 + 10
    model_json = json.loads((repo / "models/export/model.json").read_text())
    assert model_json["classes"] == [str(i) for i in range(10)]
    assert model_json["input_shape"] == [1, 16, 16]


def test_no_stage_imports_a_heavy_library_it_does_not_use(repo):
    """Each import costs a second or more of every experiment (docs/performance.md)."""
    records = [json.loads(line) for line in
               (repo / ".dvc/tmp/stage-timings.jsonl").read_text().splitlines()]
    imported = {r["stage"]: set(r["imported"]) for r in records}
    assert list(imported) == ["params", "prepare", "train", "evaluate", "export"]
    assert not set(HEAVY_IMPORTS) & imported["params"]
    # (mlflow brings scipy; torchvision brings torch's compiler.)
    assert not {"mlflow", "matplotlib", "torch.onnx", "torchvision"} & imported["prepare"]
    assert not {"sklearn", "matplotlib", "onnxruntime"} & imported["train"]
    assert not {"sklearn", "torchvision", "torch.onnx"} & imported["evaluate"]
    train = next(r for r in records if r["stage"] == "train")
    assert 0 < train["loop_s"] < train["main_s"] and 0 < train["tracking_s"] < train["main_s"]


def test_one_mlflow_run_holds_params_metrics_and_artifacts(repo):
    client, runs = mlflow_runs(repo)
    run_id = json.loads((repo / "models/train/run.json").read_text())["run_id"]
    assert [r.info.run_id for r in runs] == [run_id]
    r = runs[0]
    assert r.info.status == "FINISHED" and r.info.run_name.startswith("workspace@")
    assert r.data.params["lr"] == "0.003" and r.data.params["train.warmup_epochs"] == "1.0"
    assert r.data.params["model.arch"] == "cnn"
    metrics = json.loads((repo / "models/eval/metrics.json").read_text())
    assert r.data.metrics["eval/accuracy"] == pytest.approx(metrics["accuracy"])
    assert len(client.get_metric_history(run_id, "val/acc")) == 3
    # Grouped for the chart view; per-class figures are a table artifact, not 30 metrics.
    assert {m.split("/")[0] for m in r.data.metrics} == {"train", "val", "eval", "perf", "model"}
    assert r.data.tags["git_commit"] and r.data.tags["precision"] in ("bf16", "fp32")
    made_on = json.loads((repo / "models/train/made_on.json").read_text())
    assert {k: r.data.tags[k] for k in made_on} == {k: str(v) for k, v in made_on.items()}
    artifacts = {a.path for top in ("train", "eval", "export") for a in client.list_artifacts(run_id, top)}
    assert {"train/history.csv", "train/made_on.json", "eval/per_class.csv", "eval/confusion.png",
            "export/model.onnx"} <= artifacts
    # Artifacts live in the workspace next to the store, not in a temporary copy.
    assert r.info.artifact_uri.startswith((repo / "mlartifacts").as_uri())
    models = client.search_logged_models(experiment_ids=[r.info.experiment_id])
    assert [(m.name, m.source_run_id) for m in models] == [("cnn-digits", run_id)]
    (dataset,) = r.inputs.dataset_inputs
    meta = json.loads((repo / "data/prepared/meta.json").read_text())
    assert dataset.dataset.name == "digits" and meta["sha256"].startswith(dataset.dataset.digest)
    assert dataset.dataset.source.endswith('datasets/data/digits.csv.gz"}')  # where sklearn ships it
    # The experiment opens in the classic runs view, not MLflow 3's GenAI view.
    exp = client.get_experiment(r.info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    # Duration is the training's: evaluate and export logged later without stretching it.
    assert r.info.end_time / 1000 < (repo / "models/eval/metrics.json").stat().st_mtime


def test_second_repro_runs_nothing(repo):
    p = run(["dvc", "repro"], repo, env=env_with())
    assert "Data and pipelines are up to date." in p.stdout
    assert "Running stage" not in p.stdout


def test_make_verify_reruns_everything_to_the_same_bytes(repo):
    outputs = ["dvc.lock", "models/train/model.pt", *(f"models/{f}" for f in COMMITTED),
               *(f"models/export/model.{x}" for x in ("onnx", "pt2", "safetensors", "json"))]
    before = {f: (repo / f).read_bytes() for f in outputs}
    p = run(["make", "-s", "verify", f"VENV={VENV_BIN.parent}"], repo)
    assert "verified: every output is byte-identical" in p.stdout
    assert {f: (repo / f).read_bytes() for f in outputs} == before
    # A second training is a second run; evaluate and export logged into it, not the first.
    client, runs = mlflow_runs(repo)
    assert len(runs) == 2 and "eval/accuracy" in runs[1].data.metrics
    assert len(client.get_metric_history(runs[0].info.run_id, "eval/accuracy")) == 1


def test_a_fresh_clone_that_retrains_to_the_committed_bytes_still_logs_eval(repo, tmp_path):
    """The committed evaluation is this very model's, so DVC skips evaluate on a fresh clone
    that retrains to the same bytes; export logs that evaluation into the new run."""
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "results of the first repro"], repo)
    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(repo), str(clone)], tmp_path)
    p = run(["dvc", "repro"], clone, env=env_with())
    assert "Stage 'evaluate' didn't change, skipping" in p.stdout
    assert "Running stage 'export'" in p.stdout
    _, runs = mlflow_runs(clone)
    metrics = json.loads((clone / "models/eval/metrics.json").read_text())
    assert runs[-1].data.metrics["eval/accuracy"] == pytest.approx(metrics["accuracy"])


def test_exp_run_changes_only_the_values_given_and_trains_through_torchrun(repo):
    """One experiment for two promises (a pipeline run each would cost ~40 s): `-S` edits only
    the values it names, and train.nproc_per_node=2 trains through torchrun under DVC."""
    p = run(["dvc", "exp", "run", "-S", "lr=0.01", "-S", "train.nproc_per_node=2"], repo,
            env=env_with())
    assert "Stage 'prepare' didn't change, skipping" in p.stdout  # only what changed reruns
    assert "trained cnn" in p.stderr + p.stdout
    diff = run(["git", "diff", "-U0", "params.yaml"], repo).stdout
    changed = [ln for ln in diff.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
    assert changed == ["-lr: 0.003", "+lr: 0.01", "-  nproc_per_node: 1", "+  nproc_per_node: 2"]
    assert json.loads((repo / "models/eval/metrics.json").read_text())["accuracy"] >= 0.9
    _, runs = mlflow_runs(repo)
    latest = runs[-1]
    assert latest.data.params["lr"] == "0.01" and latest.data.params["train.nproc_per_node"] == "2"
    assert latest.data.tags["world_size"] == "2" and latest.info.status == "FINISHED"
    assert latest.info.run_name == latest.data.tags["dvc_exp_name"]  # named after the experiment
    shown = json.loads(run(["dvc", "exp", "show", "--json"], repo, env=env_with()).stdout)
    text = json.dumps(shown)
    assert '"lr": 0.01' in text and '"accuracy"' in text
    run(["git", "checkout", "params.yaml"], repo)


def test_a_refused_value_names_it_and_says_how_to_restore_params_yaml(repo):
    p = run(["dvc", "exp", "run", "-S", "lr='1e-3'"], repo, env=env_with(), check=False)
    assert p.returncode != 0
    assert "lr='1e-3'" in p.stderr, p.stderr
    restore = re.search(r"or `(git checkout [^`]+)` for the committed values", p.stderr)[1]
    run(["bash", "-c", restore], repo)  # exactly as the message says
    assert (repo / "params.yaml").read_bytes() == run(["git", "show", "HEAD:params.yaml"],
                                                      repo).stdout.encode()
    p = run(["dvc", "repro"], repo, env=env_with())  # as the message says: outputs come back
    assert "Running stage 'train'" not in p.stdout and "is cached" in p.stdout, p.stdout
    assert (repo / "models/train/model.pt").exists()


def test_exp_run_rejects_unknown_key(repo):
    before = (repo / "params.yaml").read_bytes()
    p = run(["dvc", "exp", "run", "-S", "no_such_key=1"], repo, env=env_with(), check=False)
    assert p.returncode != 0 and "no_such_key" in p.stderr, p.stderr
    assert "Running stage" not in p.stdout and "Ran experiment" not in p.stdout, p.stdout
    assert (repo / "params.yaml").read_bytes() == before


def test_a_typo_through_dvcs_own_hint_still_fails(repo):
    """DVC refuses `-S lrr=0.01` and suggests `+lrr=0.01`, which adds a key no stage reads:
    the params stage still checks it (issue 22's first-hour walk)."""
    before = (repo / "params.yaml").read_text()
    p = run(["dvc", "exp", "run", "-S", "lrr=0.01"], repo, env=env_with(), check=False)
    assert p.returncode != 0 and "+lrr" in p.stdout + p.stderr
    p = run(["dvc", "exp", "run", "-S", "+lrr=0.05"], repo, env=env_with(), check=False)
    try:
        assert p.returncode != 0 and "Ran experiment" not in p.stdout, p.stdout
        assert "unknown key 'lrr'; did you mean 'lr'?" in p.stdout + p.stderr, p.stderr
    finally:
        (repo / "params.yaml").write_text(before)


def test_after_a_failed_experiment_git_status_shows_every_change_and_the_way_back_works(repo):
    """`dvc exp run` stashes the workspace, resets it and restores it within a second; git's
    index was left with HEAD's blobs beside the restored files' times, so a change of the same
    size vanished from `git status`, and README's way back restored nothing (issue 31). Here:
    an edit to a tracked file and the workspace's results, through a refused experiment and a
    failed one."""
    readme = repo / "README.md"
    edited = readme.read_bytes().replace(b"reprotrain", b"reprotrail", 1)  # the same size
    readme.write_bytes(edited)
    for bad in ("+lrr=0.05", "lr=1000000"):  # refused by the params stage; diverges in train
        p = run(["dvc", "exp", "run", "-S", bad], repo, env=env_with(), check=False)
        assert p.returncode != 0 and "Ran experiment" not in p.stdout, p.stdout + p.stderr
        assert readme.read_bytes() == edited  # the user's edit survives the experiment
        listed = run(["git", "status", "--porcelain", "--untracked-files=no"], repo).stdout
        shown = {line[3:] for line in listed.splitlines()}
        tracked = run(["git", "ls-files"], repo).stdout.split()
        changed = {f for f in tracked if (repo / f).is_file() and
                   run(["git", "hash-object", f], repo).stdout != run(
                       ["git", "rev-parse", f"HEAD:{f}"], repo).stdout}
        assert "README.md" in changed and changed <= shown, (bad, changed - shown)
    run(["git", "checkout", "--", "params.yaml", "dvc.lock", "models", "README.md"], repo)
    assert run(["git", "status", "--porcelain", "--untracked-files=no"], repo).stdout == ""
    assert readme.read_bytes() == committed_in(repo, "README.md")
    run(["dvc", "repro"], repo, env=env_with())  # the rest of the way back: the models


def test_plots_render_offline_in_a_real_browser(repo, tmp_path):
    run(["dvc", "plots", "show", "-o", str(tmp_path / "plots")], repo, env=env_with())
    page = (tmp_path / "plots/index.html").read_text()
    assert "cdn.jsdelivr" not in page and "<script src=" not in page  # nothing to fetch
    dom = rendered_dom(tmp_path / "plots/index.html", tmp_path)
    # Vega-Embed draws each chart into an element of class "marks": loss, accuracy, lr,
    # confusion, F1 per class.
    assert dom.count('class="marks"') == 5, dom[:2000]
    assert "_confusion.png" in dom and "_misclassified.png" in dom


def test_queue_with_a_run_cache_hit_gives_each_experiment_its_own_run(repo):
    """Two queued experiments run side by side on two workers, one store; the second changes
    only an eval param, so its training comes from the run-cache (the `dvc repro` above) and its
    evaluate must not write into that earlier experiment's run."""
    client, before = mlflow_runs(repo)
    trained = json.loads((repo / "models/train/run.json").read_text())
    first_training = before[0].info.run_id
    env = env_with()
    run(["dvc", "exp", "run", "--queue", "-S", "lr=0.02"], repo, env=env)
    run(["dvc", "exp", "run", "--queue", "-S", "eval.batch_size=128"], repo, env=env)
    start_queue(repo, env, jobs=2)
    status = wait_for_queue(repo, env)
    assert status.count("Success") >= 2 and "Failed" not in status, status
    _, after = mlflow_runs(repo)
    new = after[len(before):]
    names = [r.data.tags["dvc_exp_name"] for r in new]
    assert len(new) == 2 and len(set(names)) == 2  # every experiment findable by its name
    assert all(r.info.run_name == r.data.tags["dvc_exp_name"] for r in new)
    assert all(r.info.status == "FINISHED" for r in new)
    by_lr = {r.data.params["lr"]: r for r in new}
    assert sorted(by_lr) == ["0.003", "0.02"]
    hit = by_lr["0.003"]
    assert hit.data.tags["restored_from_run_cache"] == "true"
    assert hit.data.tags["training_run_id"] == first_training != hit.info.run_id
    assert hit.data.tags["threads"] == before[0].data.tags["threads"]  # where the weights were made
    assert "eval/accuracy" in hit.data.metrics and "val/best_acc" in hit.data.metrics
    for r in new:
        tags = r.data.tags
        assert tags["git_commit"] and tags["dvc_baseline_rev"] == tags["git_commit"]
        assert r.info.artifact_uri.startswith((repo / "mlartifacts").as_uri())
    # No run was written by two experiments: one evaluation each, the earlier ones untouched.
    for r in after:
        assert len(client.get_metric_history(r.info.run_id, "eval/accuracy")) <= 1, r.info.run_name
    assert json.loads((repo / "models/train/run.json").read_text()) == trained
    assert not list(repo.glob(".dvc/tmp/exps/**/mlflow.db"))  # never in DVC's temporary copies

    table = exps_table(repo)
    assert max(map(len, table)) <= 120, "\n".join(table)
    assert table[0].split() == ["Experiment", "best_val_acc", "test_acc", "test_loss", "test_f1", "lr",
                                "epochs", "batch_size", "train.nproc_per_node", "eval.batch_size"]
    rows = {line.split()[0]: line.split() for line in table[1:]}
    assert {"workspace", "main", *names} <= set(rows)
    assert rows[by_lr["0.02"].info.run_name][5] == "0.02"  # lr in the table, by the run's name
    assert rows[hit.info.run_name][-1] == "128"
    # Sorted by a sweep's objective: that column is shown, whatever the default drops.
    table = run(["make", "-s", "exps", f"VENV={VENV_BIN.parent}", "EXPS_ORDER=asc",
                 "EXPS_SORT=models/train/metrics.json:best_val_loss"], repo).stdout.splitlines()
    column = table[0].split().index("best_val_loss")
    losses = [float(line.split()[column]) for line in table[1:] if line.split()[0] in names]
    assert len(losses) == len(names) and losses == sorted(losses), "\n".join(table)


def test_ci_report_prints_params_metrics_and_plots(repo):
    set_params(repo / "params.yaml", {"lr": "0.005"})  # an edit not run yet: params differ
    p = run(["make", "-s", "ci-report", "BASE=HEAD", f"VENV={VENV_BIN.parent}"], repo,
            env=env_with())
    assert "## Params: workspace vs HEAD" in p.stdout and "| lr " in p.stdout
    assert "## Metrics: workspace vs HEAD" in p.stdout and "accuracy" in p.stdout
    assert (repo / "dvc_plots/index.html").exists()
    run(["git", "checkout", "params.yaml"], repo)


def test_a_fresh_clone_compares_against_main_without_a_remote(tmp_path):
    """main carries the metrics, history and confusion rows of a real run (`cache: false`),
    so comparisons show main's values with nothing fetched and nothing run."""
    clone = copy_repo(tmp_path / "clone")
    shipped = json.loads(committed("models/eval/metrics.json"))
    env = env_with()
    diff = run(["dvc", "metrics", "diff", "main", "--all", "--json"], clone, env=env).stdout
    main_eval = {k: v["old"] for k, v in json.loads(diff)["models/eval/metrics.json"].items()}
    assert main_eval == {k: shipped[k] for k in main_eval} and set(main_eval) >= {"accuracy"}
    shown = json.loads(run(["dvc", "exp", "show", "--json"], clone, env=env).stdout)
    main_row = next(r for r in shown if r["name"] == "main")
    assert not main_row.get("error") and main_row["data"]["metrics"]
    report = run(["make", "-s", "ci-report", f"VENV={VENV_BIN.parent}"], clone, env=env)
    assert "DVC failed to load" not in report.stdout + report.stderr
    table = exps_table(clone)
    main_row = next(ln.split() for ln in table if ln.split()[:1] == ["main"])
    assert main_row[2] == f"{shipped['accuracy']:.4f}".rstrip("0")
    page = (clone / "dvc_plots/index.html").read_text()
    assert page.count('"rev": "main"') > 0 or page.count('"rev":"main"') > 0
