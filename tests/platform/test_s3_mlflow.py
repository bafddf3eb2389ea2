"""MLflow's artifacts on S3 (issue 33, item 3): `make server ARTIFACTS=s3://...` on PostgreSQL,
with a real S3 server (SeaweedFS, reprotrain/team/s3.py) behind it. The server alone holds the
endpoint and the keys; the clients (the stages, `make sync`, `make serve`) hold none of them.
Train, evaluate and export log the run and the served model into the bucket, `make serve`
loads the champion from it; with the S3 server down behind a running tracking server, the
stages spool the run with its artifacts and `make sync` lands it once S3 is back."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from stages.data import save_prepared
from tests.conftest import ROOT, copy_params, run, set_params
from tests.support.services import (
    MlflowServer,
    create_database,
    free_port,
    mlflow_server,
    postgres,  # noqa: F401 - the fixture
    s3,  # noqa: F401 - the fixture
)

BUCKET, PREFIX = "team-mlflow", "mlflow"
NAME = "s3-champion"
STORAGE = ("AWS_", "MLFLOW_S3_")  # what only the server may hold
TINY = {"epochs": "2", "model.width": "8", "train.log_every": "5", "export.register_as": NAME}
SAMPLE = ROOT / "data/samples/0.png"


def client_env(server: MlflowServer, w: Path) -> dict[str, str]:
    """A client's environment: logged in to the server, no storage endpoint nor keys (not even
    the ones the test runner may have)."""
    env = {k: v for k, v in server.client_env(PYTHONPATH=str(ROOT), DVC_ROOT=str(w)).items()
           if not k.startswith(STORAGE)}
    assert not [k for k in env if k.startswith(STORAGE)]
    return env


def workspace(path: Path, digits) -> Path:
    """params.yaml and the prepared digits: what train, evaluate and export read."""
    copy_params(path)
    set_params(path / "params.yaml", TINY)
    save_prepared(path / "data/prepared", *digits)
    return path


def stages(w: Path, env: dict[str, str]) -> list[subprocess.CompletedProcess]:
    return [run([sys.executable, "-m", f"stages.{name}"], w, env=env)
            for name in ("train", "evaluate", "export")]


def bucket_keys(store, prefix: str = PREFIX) -> set[str]:
    """Every object's key under `prefix` in the bucket, read with the server's keys."""
    import boto3

    client = boto3.client("s3", endpoint_url=store.endpoint, aws_access_key_id=store.access_key,
                          aws_secret_access_key=store.secret_key, region_name="us-east-1")
    keys = set()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        keys |= {o["Key"] for o in page.get("Contents", [])}
    return keys


def admin_client(server: MlflowServer, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", server.user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", server.password)
    return mlflow.MlflowClient(server.uri)


@pytest.fixture(scope="module")
def team(postgres, s3, tmp_path_factory) -> Iterator[MlflowServer]:  # noqa: F811 - fixtures
    db = create_database(postgres, f"s3_{secrets.token_hex(4)}")
    with mlflow_server(db, tmp_path_factory.mktemp("server"), artifacts=f"s3://{BUCKET}/{PREFIX}",
                       env=s3.env()) as server:
        yield server


@pytest.fixture(scope="module")
def champion(team, digits, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A tiny model trained, evaluated and exported by a client without storage keys: run,
    logged model and registered champion on the server, their files in the bucket."""
    w = workspace(tmp_path_factory.mktemp("w"), digits)
    env = client_env(team, w)
    done = stages(w, env)
    for p in done:
        assert "Warning" not in p.stderr and "spooled" not in p.stderr, p.stderr
    assert f"registered {NAME} version 1 as candidate, now champion" in done[-1].stdout
    return w, env


def test_the_run_and_the_logged_model_are_in_the_bucket(team, champion, s3, monkeypatch):  # noqa: F811
    w, _ = champion
    client = admin_client(team, monkeypatch)
    run_id = json.loads((w / "models/train/run.json").read_text())["run_id"]
    r = client.get_run(run_id)
    exp = r.info.experiment_id
    assert r.info.artifact_uri == f"mlflow-artifacts:/{exp}/{run_id}/artifacts"
    keys = bucket_keys(s3)
    for name in ("train/metrics.json", "train/history.csv", "eval/metrics.json", "export/model.onnx"):
        assert f"{PREFIX}/{exp}/{run_id}/artifacts/{name}" in keys, sorted(keys)
    [model] = client.search_logged_models([exp])
    assert model.source_run_id == run_id
    files = {k.rsplit("/artifacts/", 1)[1] for k in keys
             if k.startswith(f"{PREFIX}/{exp}/models/{model.model_id}/artifacts/")}
    assert "MLmodel" in files and len(files) > 1, sorted(keys)
    version = client.get_model_version_by_alias(NAME, "champion")
    assert version.source == f"models:/{model.model_id}"
    assert not (w / "mlartifacts").exists() and not (w / ".mlflow-spool").exists()


def test_make_serve_loads_the_champion_from_the_bucket(champion, tmp_path):
    w, env = champion
    port = free_port()
    log = tmp_path / "serve.out"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "reprotrain.serving.app", "--port", str(port)],
                                cwd=w, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=5) as r:
                    assert r.status == 200
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(1)
        import base64

        body = json.dumps({"inputs": [base64.b64encode(SAMPLE.read_bytes()).decode()]}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())
        assert len(answer["predictions"]) == 1, answer
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "Traceback" not in log.read_text(), log.read_text()


def test_s3_down_behind_the_server_spools_the_run_and_sync_lands_it_once(postgres, digits,  # noqa: F811
                                                                         tmp_path, monkeypatch):
    """The tracking server answers, its artifact store does not: each stage says so in one
    line and spools; `make sync` with S3 back sends the run, its artifacts and the logged
    model into the bucket, and a second sync sends nothing again."""
    import psutil

    from reprotrain.team.s3 import start, stop

    store = start(tmp_path / "s3", 0, (BUCKET,))
    port = int(store.endpoint.rsplit(":", 1)[1])
    db = create_database(postgres, f"s3_down_{secrets.token_hex(4)}")
    try:
        with mlflow_server(db, tmp_path / "server", artifacts=f"s3://{BUCKET}/{PREFIX}",
                           env=store.env()) as server:
            stop(store)
            # A client waits while the server retries S3: it retries once, not botocore's
            # default four times (7-9 s more a stage, here, before the 5xx that lets it spool).
            [mlflow] = [p for p in psutil.process_iter(["cmdline"]) if "--artifacts-destination"
                        in (p.info["cmdline"] or ()) and server.uri.rsplit(":", 1)[1] in p.info["cmdline"]]
            assert {"AWS_RETRY_MODE": "standard", "AWS_MAX_ATTEMPTS": "2"}.items() <= mlflow.environ().items()
            w = workspace(tmp_path / "w", digits)
            env = client_env(server, w)
            for p in stages(w, env):
                warned = [line for line in p.stderr.splitlines() if "warning" in line.lower()]
                assert len(warned) == 1 and "Traceback" not in p.stderr, p.stderr
                assert "is unreachable (its artifact store failed" in warned[0], warned
                assert "spooled to .mlflow-spool/" in warned[0], warned
            assert "registered s3-champion in the local spool" in p.stdout, p.stdout

            sync = [sys.executable, "-m", "reprotrain.tracking.sync"]
            down = run(sync, w, env=env, check=False, timeout=180)
            lines = down.stderr.strip().splitlines()
            assert down.returncode == 1 and len(lines) == 1, down.stderr
            assert "its artifact store failed" in lines[0] and "is kept" in lines[0], lines

            store = start(tmp_path / "s3", port, (BUCKET,))
            first = run(sync, w, env=env)
            assert "synced 1 run(s)" in first.stdout and not first.stderr, (first.stdout, first.stderr)
            again = run(sync, w, env=env)
            assert "synced 0 run(s)" in again.stdout and "1 run(s) already there" in again.stdout, \
                again.stdout

            client = admin_client(server, monkeypatch)
            exp = client.get_experiment_by_name("reprotrain").experiment_id
            [r] = client.search_runs([exp])
            assert {f.path for f in client.list_artifacts(r.info.run_id)} == {"train", "eval", "export"}
            keys = bucket_keys(store)
            for name in ("train/metrics.json", "eval/metrics.json", "export/model.onnx"):
                assert sum(k.endswith(f"/{r.info.run_id}/artifacts/{name}") for k in keys) == 1, keys
            [model] = client.search_logged_models([exp])
            assert model.source_run_id == r.info.run_id
            assert f"{PREFIX}/{exp}/models/{model.model_id}/artifacts/MLmodel" in keys, sorted(keys)
            version = client.get_model_version_by_alias(NAME, "champion")
            assert version.source == f"models:/{model.model_id}" and version.version == "1"
    finally:
        stop(store)
