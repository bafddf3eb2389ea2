"""dvc.yaml leaves the team's packages out of the stages' deps (its header says why): tracking
writes nothing DVC tracks. Proven here on real runs: `dvc repro` writes the same bytes whether
the runs go to the embedded sqlite store, to the team's basic-auth `mlflow server` on
PostgreSQL, to the spool (the server is down) or nowhere (a store that cannot be opened turns
the Tracker off, as on a non-zero rank); and a scratch edit to the team's code leaves `dvc
status` up to date, while the same edit to the training loop does not."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import copy_repo, env_with, run
from tests.support.services import (
    create_database,
    mlflow_server,
    postgres,  # noqa: F401 - the fixture
)
from tests.support.workspaces import closed_port

# One epoch of a narrow CNN; steps logged every 5 so tracking has something to send (or spool)
# during the loop, not only at its ends.
TINY = {"epochs": "1", "model.width": "8", "train.warmup_epochs": "0.5", "train.log_every": "5"}
STAGES = ("prepare", "train", "evaluate", "export")
UP_TO_DATE = "Data and pipelines are up to date."


def dvc_outputs(repo: Path) -> list[str]:
    """Every file DVC keeps of a run (outs, metrics, plots of each stage; folders expanded):
    read from dvc.yaml, so an output added there is compared too."""
    declared = []
    for stage in yaml.safe_load((repo / "dvc.yaml").read_text())["stages"].values():
        for kind in ("outs", "metrics", "plots"):
            declared += [next(iter(o)) if isinstance(o, dict) else o for o in stage.get(kind, [])]
    files = []
    for name in declared:
        path = repo / name
        files += sorted(p.relative_to(repo).as_posix() for p in path.rglob("*") if p.is_file()) \
            if path.is_dir() else [name]
    return files


def md5s(repo: Path) -> dict[str, str]:
    return {f: hashlib.md5((repo / f).read_bytes()).hexdigest() for f in dvc_outputs(repo)}


def repro(repo: Path, env: dict[str, str]) -> str:
    """`dvc repro` with every stage run (none restored from a cache): its stdout and stderr."""
    p = run(["dvc", "repro"], repo, env=env)
    for stage in STAGES:
        assert f"Running stage '{stage}'" in p.stdout, p.stdout
    return p.stdout + p.stderr


@pytest.fixture(scope="module")
def sqlite_repo(tmp_path_factory) -> Path:
    """The embedded store, as a user gets it: no MLFLOW_TRACKING_URI, mlflow.db in the repo.
    Also the workspace test_team_code_edits_rerun_no_stage edits."""
    repo = copy_repo(tmp_path_factory.mktemp("sqlite"), TINY)
    repro(repo, env_with())
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    assert client.search_runs([client.get_experiment_by_name("reprotrain").experiment_id])
    assert UP_TO_DATE in run(["dvc", "status"], repo, env=env_with()).stdout
    return repo


@pytest.fixture(scope="module")
def stores(tmp_path_factory, postgres, sqlite_repo) -> dict[str, dict[str, str]]:  # noqa: F811
    """The md5 of every DVC output after one `dvc repro` per store."""
    seen = {"sqlite": md5s(sqlite_repo)}

    folder = tmp_path_factory.mktemp("server")
    with mlflow_server(create_database(postgres, "outputs"), folder) as server:
        repo = copy_repo(folder / "repo", TINY)
        out = repro(repo, server.client_env())
        assert "unreachable" not in out and "without tracking" not in out, out
        run_id = json.loads((repo / "models/train/run.json").read_text())["run_id"]
        import mlflow

        client = mlflow.MlflowClient(server.uri)
        with pytest.MonkeyPatch.context() as env:  # the login, for this client only
            env.setenv("MLFLOW_TRACKING_USERNAME", server.user)
            env.setenv("MLFLOW_TRACKING_PASSWORD", server.password)
            assert "eval/accuracy" in client.get_run(run_id).data.metrics
        seen["server"] = md5s(repo)

    repo = copy_repo(tmp_path_factory.mktemp("spool"), TINY)
    out = repro(repo, env_with(MLFLOW_TRACKING_URI=f"http://127.0.0.1:{closed_port()}"))
    assert out.count("spooled to .mlflow-spool/") == 3, out  # train, evaluate, export
    seen["spool"] = md5s(repo)

    # /dev/null is no folder: the store cannot be created, each stage warns once and its
    # Tracker stays off, every call a no-op.
    repo = copy_repo(tmp_path_factory.mktemp("off"), TINY)
    out = repro(repo, env_with(MLFLOW_TRACKING_URI="sqlite:////dev/null/mlflow.db"))
    assert out.count("continuing without tracking") == 3, out
    assert json.loads((repo / "models/train/run.json").read_text())["run_id"] is None
    seen["off"] = md5s(repo)
    return seen


def test_outputs_are_the_same_bytes_whatever_the_store(stores):
    reference = stores["sqlite"]
    for must in ("data/prepared/train.pt", "models/train/model.pt", "models/train/model.sha256",
                 "models/train/metrics.json", "models/train/history.csv",
                 "models/eval/metrics.json", "models/eval/confusion.png",
                 "models/export/model.onnx", "models/export/model.pt2"):
        assert must in reference, sorted(reference)
    for name, seen in stores.items():
        differ = sorted(f for f in reference.keys() | seen.keys() if reference.get(f) != seen.get(f))
        assert not differ, f"{name} store: these DVC outputs differ from the sqlite store's: {differ}"


def edited(repo: Path, files: list[str]) -> str:
    """`dvc status` with a comment line appended to each of `files`, put back afterwards."""
    before = {f: (repo / f).read_bytes() for f in files}
    try:
        for f in files:
            (repo / f).write_bytes(before[f] + b"# a scratch edit\n")
        return run(["dvc", "status"], repo, env=env_with()).stdout
    finally:
        for f, text in before.items():
            (repo / f).write_bytes(text)


def team_modules(repo: Path) -> list[str]:
    """Every module of the platform, reprotrain/ (the team's packages, the warm process and
    their helpers), whatever its split into submodules is now."""
    return sorted(p.relative_to(repo).as_posix() for p in (repo / "reprotrain").rglob("*.py"))


# What `make sync`, the sweep, the server and serving run; then all of reprotrain/ at once.
TEAM_EDITS = {"sync": ["reprotrain/tracking/sync.py"], "sweep": ["reprotrain/sweep/__main__.py"],
              "server": ["reprotrain/team/server.py"], "serving": ["reprotrain/serving/app.py"],
              "every team module": []}


@pytest.mark.parametrize("what", list(TEAM_EDITS))
def test_team_code_edits_rerun_no_stage(what, sqlite_repo):
    files = TEAM_EDITS[what] or team_modules(sqlite_repo)
    assert files and all((sqlite_repo / f).is_file() for f in files), files
    status = edited(sqlite_repo, files)
    assert UP_TO_DATE in status, f"editing {files} makes a stage stale:\n{status}"


def test_a_training_loop_edit_reruns_train(sqlite_repo):
    """The same edit to code that decides the weights makes train stale: `dvc status` does see
    an edit, so the check above can fail."""
    status = edited(sqlite_repo, ["stages/loop.py"])
    assert UP_TO_DATE not in status and "train:" in status and "stages/loop.py" in status, status
    assert UP_TO_DATE in edited(sqlite_repo, [])  # put back: up to date again

