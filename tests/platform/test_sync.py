"""The tracking server going away loses nothing, and local runs move up to it: a real `mlflow
server` on a free loopback port, killed and started again on the same port and database; the
spool replayed with `python -m reprotrain.tracking.sync` (what `make sync` runs), also twice and after a
kill halfway; a workspace's own mlflow.db moved up with its registered model."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from stages.data import save_prepared
from tests.conftest import ROOT, VENV_BIN, copy_params, env_with, run, set_params
from tests.support.services import (
    MlflowServer,
    create_database,
    free_port,
    postgres,  # noqa: F401 - the fixture
)
from tests.support.services import mlflow_server as team_server


def workspace(path: Path, digits, **params) -> Path:
    """A folder with params.yaml and the prepared digits: what train, evaluate, export read."""
    path.mkdir(parents=True, exist_ok=True)
    copy_params(path)
    set_params(path / "params.yaml", {"epochs": "4", "model.width": "8", **params})
    save_prepared(path / "data/prepared", *digits)
    return path


@contextmanager
def mlflow_server(db: str, artifacts: Path, port: int) -> Iterator[subprocess.Popen]:
    """A plain `mlflow server` (no logins) on loopback, in its own process group, until it
    answers /health; stopped with its workers afterwards."""
    log = open(artifacts.parent / f"server-{port}-{time.time_ns()}.log", "w")
    proc = subprocess.Popen(
        [str(VENV_BIN / "mlflow"), "server", "--backend-store-uri", db, "--artifacts-destination",
         str(artifacts), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env=env_with(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"))  # as make server has it
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None, (artifacts.parent / log.name).read_text()[-3000:]
                assert time.time() < deadline, "mlflow server did not answer within 120 s"
                time.sleep(0.3)
        yield proc
    finally:
        kill(proc)
        log.close()


def kill(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def empty_db(tmp_path_factory) -> Path:
    """An empty MLflow database, its schema made once (migrations ~6 s)."""
    import mlflow

    db = tmp_path_factory.mktemp("server") / "empty.db"
    mlflow.MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def server_db(empty_db, tmp_path) -> str:
    """The database of this test's server: a copy of the empty one (champions do not leak)."""
    shutil.copy(empty_db, tmp_path / "server.db")
    return f"sqlite:///{tmp_path / 'server.db'}"


def stage(name: str, w: Path, uri: str, check: bool = True) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", f"stages.{name}"], w, check=check,
               env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=uri, DVC_ROOT=str(w)))


def sync(w: Path, uri: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "reprotrain.tracking.sync", *args], w, check=check,
               env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=uri, DVC_ROOT=str(w)))


def history(w: Path) -> dict[str, list[tuple[int, float]]]:
    from reprotrain.tracking import metric_name

    with open(w / "models/train/history.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return {metric_name(k): [(int(r["epoch"]), float(r[k])) for r in rows]
            for k in rows[0] if k != "epoch"}


def assert_history_once(client, run_id: str, w: Path) -> None:
    """Every metric of history.csv on the server: each epoch's step once, with its value."""
    for key, want in history(w).items():
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert [s for s, _ in got] == [s for s, _ in want], (key, got, want)
        assert all(abs(a - b) < 1e-5 for (_, a), (_, b) in zip(got, want, strict=True)), key


@contextmanager
def killing_proxy(upstream: str, trigger: str) -> Iterator[tuple[str, list[int]]]:
    """A loopback HTTP proxy to `upstream` that SIGKILLs the pid put in the list it yields at
    the first request whose path holds `trigger`, which it never forwards."""
    with faulty_proxy(upstream) as proxy:
        proxy.kills = trigger
        yield proxy.uri, proxy.victim


def wait_for_epoch(proc: subprocess.Popen, w: Path, epoch: int) -> None:
    deadline = time.time() + 300
    while not list(w.glob(f".checkpoints/*/epoch-{epoch:04d}.sha256")):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
        time.sleep(0.05)


def test_server_killed_mid_training_loses_nothing_once_it_is_back(tmp_path, digits, server_db):
    """The server SIGKILLed after the first epoch and started again: train exits 0 with the
    outputs of an undisturbed run and says so in one line; the next stage replays the spool,
    and the server's run holds every step of history.csv once, the params, tags and artifacts."""
    import mlflow
    import torch

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    (tmp_path / "art").mkdir()
    w = workspace(tmp_path / "w", digits)
    ref = workspace(tmp_path / "ref", digits)
    with mlflow_server(server_db, tmp_path / "art", port) as server:
        proc = subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=w, text=True,
                                env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=uri,
                                             DVC_ROOT=str(w)),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        wait_for_epoch(proc, w, 1)
        t = time.perf_counter()
        kill(server)
        out, err = proc.communicate(timeout=600)
        after_kill_s = time.perf_counter() - t
    assert proc.returncode == 0, err
    assert err.count("is unreachable") == 1 and "make sync" in err, err
    assert "Traceback" not in err and "Failed to log run data" not in err, err
    # The same DVC outputs as a run that never saw the server go (here: no server at all).
    stage("train", ref, f"sqlite:///{tmp_path / 'ref.db'}")
    for name in ("metrics.json", "history.csv"):
        assert (w / "models/train" / name).read_bytes() == (ref / "models/train" / name).read_bytes()
    wa = torch.load(w / "models/train/model.pt", weights_only=True)["model"]
    wb = torch.load(ref / "models/train/model.pt", weights_only=True)["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    link = json.loads((w / "models/train/run.json").read_text())
    assert link["tracking_uri"] == uri  # the run began on the server: it stays that run

    with mlflow_server(server_db, tmp_path / "art", port):
        # The next stage finds the server back: it replays the spool before its own run.
        p = stage("evaluate", w, uri)
        assert "synced 1 run(s)" in p.stderr and "unreachable" not in p.stderr, p.stderr
        client = mlflow.MlflowClient(uri)
        r = client.get_run(link["run_id"])
        assert r.info.status == "FINISHED" and "eval/accuracy" in r.data.metrics
        assert_history_once(client, link["run_id"], w)
        assert r.data.params["epochs"] == "4" and r.data.tags["model_md5"] == link["model_md5"]
        assert {"val/best_acc", "perf/train_s"} <= r.data.metrics.keys()
        arts = {f.path for f in client.list_artifacts(link["run_id"], "train")}
        assert arts == {"train/metrics.json", "train/history.csv", "train/made_on.json"}
        assert client.list_artifacts(link["run_id"], "eval")
        steps = client.get_metric_history(link["run_id"], "train/loss_step")
        assert sorted(m.step for m in steps) == sorted({m.step for m in steps})  # none twice
        assert "0 run(s) from" in sync(w, uri).stdout  # `make sync`: nothing left to send
        assert client.get_metric_history(link["run_id"], "train/loss_step") == steps
    print(f"stage went on {after_kill_s:.1f}s after the kill")


def test_server_down_at_start_spools_and_sync_lands_everything_once(tmp_path, digits, server_db):
    """No server at all for train, evaluate and export: each is bounded in time, says so in
    one line and spools; `sync` killed halfway, run again and a third time lands the run, its
    artifacts, its logged model and the registered version with its aliases, each once."""
    import mlflow

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    (tmp_path / "art").mkdir()
    w = workspace(tmp_path / "w", digits, epochs="3", **{"train.log_every": "2",
                                                           "export.register_as": "digits-cnn"})
    for name in ("train", "evaluate", "export"):
        t = time.perf_counter()
        p = stage(name, w, uri)
        print(name, f"{time.perf_counter() - t:.1f}s")
        assert p.stderr.count("is unreachable") == 1, p.stderr
        assert "spooled to .mlflow-spool/" in p.stderr and "Traceback" not in p.stderr
    # Export says where the version went, and none of MLflow's own registration lines.
    assert "registered digits-cnn in the local spool (.mlflow-spool/), not on the server" \
        in p.stdout and "champion" not in p.stdout.replace("champion if it beats", ""), p.stdout
    assert "Successfully registered" not in p.stderr + p.stdout and "Created version" not in p.stderr
    link = json.loads((w / "models/train/run.json").read_text())
    assert link["tracking_uri"].startswith("sqlite:///") and ".mlflow-spool" in link["tracking_uri"]
    spool = mlflow.MlflowClient(link["tracking_uri"])
    assert spool.get_model_version_by_alias("digits-cnn", "champion").run_id == link["run_id"]

    with mlflow_server(server_db, tmp_path / "art", port):
        # Killed halfway, for certain: the first artifact upload it sends (after the run, its
        # params and metrics) goes through a proxy that SIGKILLs it instead of forwarding.
        with killing_proxy(uri, "/mlflow-artifacts/artifacts/") as (via, victim):
            proc = subprocess.Popen([sys.executable, "-m", "reprotrain.tracking.sync"], cwd=w,
                                    env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=via,
                                                 DVC_ROOT=str(w)),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            victim.append(proc.pid)
            proc.communicate(timeout=300)
        assert proc.returncode == -signal.SIGKILL
        server = mlflow.MlflowClient(server_db)  # its database, read directly
        [half] = server.search_runs(["1"])
        assert half.info.status == "RUNNING" and half.data.metrics and not server.search_model_versions()

        for _ in range(2):
            p = sync(w, uri)
            # One line of its own: none of MLflow's "View run", "Waiting up to 300 seconds".
            assert len(p.stdout.splitlines()) == 1 and not p.stderr, (p.stdout, p.stderr)
        assert "synced 0 run(s)" in p.stdout and "1 run(s) already there" in p.stdout, p.stdout
        client = mlflow.MlflowClient(uri)
        [r] = client.search_runs(["1"])
        assert r.info.status == "FINISHED"
        assert r.data.tags["reprotrain.source_run"].endswith(f".mlflow-spool/mlflow.db#{link['run_id']}")
        assert_history_once(client, r.info.run_id, w)
        for key, value in json.loads((w / "models/eval/metrics.json").read_text()).items():
            if key != "n":
                [m] = client.get_metric_history(r.info.run_id, f"eval/{key}")
                assert abs(m.value - value) < 1e-6
        assert r.data.params == spool.get_run(link["run_id"]).data.params
        assert [d.dataset.digest for d in r.inputs.dataset_inputs] == \
            [d.dataset.digest for d in spool.get_run(link["run_id"]).inputs.dataset_inputs]
        assert {f.path for f in client.list_artifacts(r.info.run_id)} == {"train", "eval", "export"}
        [version] = client.search_model_versions("name = 'digits-cnn'")
        assert set(client.get_model_version("digits-cnn", version.version).aliases) == \
            {"candidate", "champion"}
        [model] = client.search_logged_models(["1"])
        assert model.source_run_id == r.info.run_id and version.source == f"models:/{model.model_id}"
        local = mlflow.artifacts.download_artifacts(artifact_uri=model.artifact_location,
                                                    tracking_uri=uri, dst_path=str(tmp_path / "m"))
        assert mlflow.models.Model.load(Path(local) / "MLmodel").model_id == model.model_id


def test_sync_from_moves_a_workspaces_own_runs_up_once(tmp_path, digits, server_db):
    """A week offline in miniature: two trainings and a registered, aliased model in the
    workspace's embedded mlflow.db; `sync --from` (make sync FROM=...) moves them all onto the
    server, saying where each came from, and a second sync moves nothing."""
    import mlflow

    w = workspace(tmp_path / "w", digits, epochs="3", **{"export.register_as": "digits-cnn"})
    local = f"sqlite:///{w / 'mlflow.db'}"
    for name in ("train", "evaluate", "export"):
        stage(name, w, local)
    set_params(w / "params.yaml", {"seed": "1"})
    stage("train", w, local)
    mine = mlflow.MlflowClient(local)
    runs = {r.info.run_id: r for r in mine.search_runs(["1"])}
    assert len(runs) == 2

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    (tmp_path / "art").mkdir()
    with mlflow_server(server_db, tmp_path / "art", port):
        p = sync(w, uri, "--from", local)
        assert "synced 2 run(s)" in p.stdout and "1 model versions" in p.stdout, p.stdout
        p = sync(w, uri, "--from", local)
        assert "synced 0 run(s)" in p.stdout and "2 run(s) already there" in p.stdout, p.stdout
        client = mlflow.MlflowClient(uri)
        moved = {r.data.tags["reprotrain.source_run"].rpartition("#")[2]: r
                 for r in client.search_runs(["1"])}
        assert moved.keys() == runs.keys()
        for run_id, r in moved.items():
            assert r.data.tags["reprotrain.source_run"].endswith(f"{w / 'mlflow.db'}#{run_id}")
            assert r.data.params == runs[run_id].data.params
            assert r.info.start_time == runs[run_id].info.start_time
            assert r.info.status == "FINISHED" and r.info.end_time == runs[run_id].info.end_time
            for key in runs[run_id].data.metrics:
                want = [(m.step, m.timestamp, m.value) for m in mine.get_metric_history(run_id, key)]
                got = [(m.step, m.timestamp, m.value) for m in client.get_metric_history(r.info.run_id, key)]
                assert sorted(got) == sorted(want), key
        last = max(runs.values(), key=lambda r: r.info.start_time).info.run_id
        assert_history_once(client, moved[last].info.run_id, w)
        [version] = client.search_model_versions("name = 'digits-cnn'")
        assert set(client.get_model_version("digits-cnn", version.version).aliases) == \
            {"candidate", "champion"}
        assert version.run_id == moved[mine.get_model_version("digits-cnn", "1").run_id].info.run_id


@pytest.mark.parametrize(("args", "env", "expected"), [
    ([], {}, "error: MLFLOW_TRACKING_URI is not set"),
    (["--from", "sqlite:///nope/mlflow.db"], {"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"},
     "error: FROM=sqlite:///nope/mlflow.db: no such file"),
])
def test_sync_refuses_in_one_line(tmp_path, args, env, expected):
    p = run([sys.executable, "-m", "reprotrain.tracking.sync", *args], tmp_path, check=False,
            env=env_with(PYTHONPATH=str(ROOT), **env))
    assert p.returncode == 1 and p.stderr.strip().startswith(expected) and \
        len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_sync_to_a_server_that_does_not_answer_is_one_line(tmp_path):
    (tmp_path / "local.db").touch()
    p = run([sys.executable, "-m", "reprotrain.tracking.sync", "--from",
             f"sqlite:///{tmp_path / 'local.db'}"],
            tmp_path, check=False, env=env_with(PYTHONPATH=str(ROOT),
                                                MLFLOW_TRACKING_URI=f"http://127.0.0.1:{free_port()}"))
    assert p.returncode == 1 and p.stderr.strip().splitlines() == [
        p.stderr.strip()] and "does not answer" in p.stderr, p.stderr


# ------------------------------------------------- the team server failing, not down
# Against the team's server as `make server` runs it: logins, on PostgreSQL.


@pytest.fixture(scope="module")
def team(postgres, tmp_path_factory) -> Iterator[tuple[MlflowServer, str]]:  # noqa: F811
    """The basic-auth server and its database's URI (a test stops the database a while)."""
    db = create_database(postgres, f"sync_{os.urandom(4).hex()}")
    with team_server(db, tmp_path_factory.mktemp("team")) as server:
        yield server, db


def logged_in(server: MlflowServer, uri: str, w: Path, **extra: str) -> dict[str, str]:
    """A stage's or sync's environment: the workspace `w`, the server at `uri` (it or a proxy
    before it), logged in as the admin unless `extra` says otherwise."""
    return env_with(**{"PYTHONPATH": str(ROOT), "DVC_ROOT": str(w), "MLFLOW_TRACKING_URI": uri,
                       "MLFLOW_TRACKING_USERNAME": server.user,
                       "MLFLOW_TRACKING_PASSWORD": server.password, **extra})


class FaultyProxy:
    """A real loopback reverse proxy before the server, as nginx would be: it forwards
    (`mode = "forward"`), answers 502 to everything as when its MLflow is down (`"502"`), or
    forwards /health and lets every API call hang (`"hang"`); whatever the mode, it answers 503
    to each call whose path holds `fails` (one endpoint failing while the others work), and
    forwards the first call whose path holds `loses` but answers it 504, as a proxy whose
    read timed out does while the server went on; a call whose path holds `kills` SIGKILLs
    the pid in `victim` (a client mid-request) and gets a 502."""

    def __init__(self, upstream: str):
        import http.server
        import threading

        self.mode, self.released, self.fails, self.loses = "forward", threading.Event(), "", ""
        self.kills: str = ""
        self.victim: list[int] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def forward(self) -> None:
                if proxy.kills and proxy.kills in self.path and proxy.victim:
                    os.kill(proxy.victim[0], signal.SIGKILL)
                    self.send_error(502)
                    return
                if proxy.fails and proxy.fails in self.path:
                    self.send_error(503, "Service Unavailable")
                    return
                if proxy.mode == "502":
                    self.send_error(502, "Bad Gateway")
                    return
                if proxy.mode == "hang" and not self.path.startswith("/health"):
                    proxy.released.wait(120)
                    self.close_connection = True
                    return
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None
                req = urllib.request.Request(upstream + self.path, data=body, method=self.command,
                                             headers={k: v for k, v in self.headers.items()
                                                      if k.lower() not in ("host", "connection")})
                try:
                    with urllib.request.urlopen(req, timeout=60) as r:
                        status, headers, data = r.status, r.headers, r.read()
                except urllib.error.HTTPError as e:
                    status, headers, data = e.code, e.headers, e.read()
                if proxy.loses and proxy.loses in self.path:
                    proxy.loses = ""
                    self.send_error(504, "Gateway Timeout")
                    return
                self.send_response(status)
                for k, v in headers.items():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = forward

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads, self.server.block_on_close = True, False
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def faulty_proxy(upstream: str) -> Iterator[FaultyProxy]:
    proxy = FaultyProxy(upstream)
    try:
        yield proxy
    finally:
        proxy.close()


@contextmanager
def database_stopped(db: str) -> Iterator[None]:
    """The server's PostgreSQL database refusing every connection, its open ones cut: what a
    stopped database looks like to the server (its /health still answers 200)."""
    import psycopg

    cluster, name = db.rsplit("/", 1)

    def allow(yes: bool) -> None:
        with psycopg.connect(f"{cluster}/postgres", autocommit=True) as conn:
            conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(yes).lower()}')
            if not yes:
                conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                             "WHERE datname = %s", (name,))

    allow(False)
    try:
        yield
    finally:
        allow(True)


@pytest.fixture
def admin(team, monkeypatch):
    """This process's MLflow client logged in to the team server as its admin."""
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", team[0].user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", team[0].password)
    import mlflow

    return mlflow.MlflowClient(team[0].uri)


def server_runs(client, experiment: str) -> list:
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id]) if exp else []


FAILURES = ["502 from a proxy", "database stopped", "API hangs", "502 mid-run"]


@pytest.mark.parametrize("failure", FAILURES)
def test_a_failing_server_spools_the_run_and_sync_lands_it_once(failure, team, admin, tmp_path,
                                                               digits):
    """A server that answers but fails (502 from its proxy, 503 without its database, an API
    that hangs; at the start or after an epoch) is an outage like a dead one: train says so
    once, within seconds, and spools; run.json names the run; `make sync` then lands it on
    the server once."""
    import mlflow

    server, db = team
    experiment = f"fail-{FAILURES.index(failure)}-{os.urandom(3).hex()}"
    w = workspace(tmp_path / "w", digits, epochs="3", **{"mlflow.experiment": experiment})
    with contextlib.ExitStack() as faults, faulty_proxy(server.uri) as proxy:
        if failure == "502 from a proxy":
            proxy.mode = "502"
        elif failure == "API hangs":
            proxy.mode = "hang"
        elif failure == "database stopped":
            faults.enter_context(database_stopped(db))
        t = time.perf_counter()
        # A hang costs twice MLFLOW_HTTP_REQUEST_TIMEOUT (a call and its retry): 3 s rather
        # than the default 10 s, which docs/server.md measures; the way to the spool is the same.
        hang = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "3"} if failure == "API hangs" else {}
        proc = subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=w, text=True,
                                env=logged_in(server, proxy.uri, w, **hang),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if failure == "502 mid-run":
            wait_for_epoch(proc, w, 1)
            proxy.mode = "502"
        out, err = proc.communicate(timeout=600)
        took = time.perf_counter() - t
    print(f"{failure}: train took {took:.1f}s")
    assert proc.returncode == 0, err
    assert err.count("is unreachable") == 1 and "spooled to .mlflow-spool/" in err, err
    assert "continuing without tracking" not in err and "Traceback" not in err, err
    link = json.loads((w / "models/train/run.json").read_text())
    assert link["run_id"], link
    spool = mlflow.MlflowClient(stores_spool(w))
    assert spool.search_runs([spool.get_experiment_by_name(experiment).experiment_id])

    p = run([sys.executable, "-m", "reprotrain.tracking.sync"], w, env=logged_in(server, server.uri, w))
    assert p.stdout.startswith("synced 1 run(s)") and len(p.stdout.splitlines()) == 1, p.stdout
    p = run([sys.executable, "-m", "reprotrain.tracking.sync"], w, env=logged_in(server, server.uri, w))
    assert p.stdout.startswith("synced 0 run(s)") and "1 run(s) already there" in p.stdout
    [r] = server_runs(admin, experiment)
    assert r.info.status == "FINISHED" and r.data.params["epochs"] == "3"
    if failure == "502 mid-run":  # the run began on the server: the spool's part merged into it
        assert r.info.run_id == link["run_id"]
    assert_history_once(admin, r.info.run_id, w)


def test_a_registration_the_server_fails_lands_once_with_its_model(team, admin, tmp_path, digits):
    """Export logs its model on the server, then the server fails only the registration (503
    on registered-models/create): the version goes to the spool, with the model (the spool
    cannot register the server's), and `make sync` registers it once, on the model the server
    already holds: one logged model, one version, champion."""
    server, _ = team
    name = f"reg-{os.urandom(3).hex()}"
    w = workspace(tmp_path / "w", digits, epochs="2", **{"mlflow.experiment": name,
                                                          "export.register_as": name})
    for step in ("train", "evaluate"):
        run([sys.executable, "-m", f"stages.{step}"], w, env=logged_in(server, server.uri, w))
    with faulty_proxy(server.uri) as proxy:
        proxy.fails = "registered-models/create"
        p = run([sys.executable, "-m", "stages.export"], w, env=logged_in(server, proxy.uri, w))
    assert "continuing without tracking" not in p.stderr, p.stderr
    assert f"registered {name} in the local spool" in p.stdout, p.stdout
    for _ in range(2):
        run([sys.executable, "-m", "reprotrain.tracking.sync"], w, env=logged_in(server, server.uri, w))
    [r] = server_runs(admin, name)
    [version] = admin.search_model_versions(f"name = '{name}'")
    [model] = admin.search_logged_models([r.info.experiment_id])
    assert version.run_id == r.info.run_id and version.source == f"models:/{model.model_id}"
    assert str(model.status) == "READY" and version.tags["eval.accuracy"]
    assert admin.get_model_version_by_alias(name, "champion").version == version.version


def stores_spool(w: Path) -> str:
    return f"sqlite:///{w / '.mlflow-spool/mlflow.db'}"


def fill_spool(w: Path, empty_db: Path, experiment: str, runs: int = 1, steps: int = 50,
               model: str | None = None) -> Path:
    """A spool as stages leave it while the server is away: `runs` finished runs of
    `experiment` with params, `steps` metric steps and an artifact, and with `model` a logged
    model of the first run registered as version 1 with alias champion; its file."""
    import mlflow
    from mlflow.entities import LoggedModelStatus, Metric, Param

    spool = w / ".mlflow-spool"
    spool.mkdir(parents=True, exist_ok=True)
    shutil.copy(empty_db, spool / "mlflow.db")
    (spool / "unsynced").touch()
    mlflow.set_tracking_uri(stores_spool(w))  # a version's `models:/` source is looked up there
    client = mlflow.MlflowClient(stores_spool(w))
    exp_id = client.create_experiment(experiment, artifact_location=(spool / "artifacts").as_uri())
    now = int(time.time() * 1000)
    for i in range(runs):
        r = client.create_run(exp_id, run_name=f"spooled-{i}", start_time=now)
        client.log_batch(r.info.run_id, params=[Param("lr", str(0.1 * (i + 1)))],
                         metrics=[Metric("train/loss", 1 / (s + 1), now + s, s) for s in range(steps)])
        client.log_text(r.info.run_id, f"run {i}\n", "train/note.txt")
        if model and i == 0:
            logged = client.create_logged_model(exp_id, name="cnn", source_run_id=r.info.run_id)
            (w / "model").mkdir()
            (w / "model/weights.bin").write_bytes(os.urandom(1000))
            client.log_model_artifacts(logged.model_id, str(w / "model"))
            client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
            client.create_registered_model(model)
            client.create_model_version(model, f"models:/{logged.model_id}", r.info.run_id,
                                        model_id=logged.model_id, tags={"eval.accuracy": "0.9"})
            client.set_registered_model_alias(model, "champion", "1")
        client.set_terminated(r.info.run_id, "FINISHED", now + steps)
    return spool / "mlflow.db"


def sync_process(server: MlflowServer, w: Path, call: str, ready: Path, go: Path,
                 **env: str) -> subprocess.Popen:
    """A process that imports what sync needs, says it is `ready`, and at `go` runs `call`:
    two of them reach the server at the same moment."""
    code = ("import os, sys, time\nimport mlflow, reprotrain.tracking.sync, reprotrain.tracking.spool\n"
            "open(sys.argv[1], 'w').close()\n"
            "while not os.path.exists(sys.argv[2]):\n    time.sleep(0.005)\n" + call)
    return subprocess.Popen([sys.executable, "-c", code, str(ready), str(go)], cwd=w, text=True,
                            env=logged_in(server, server.uri, w, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


CALLS = {"make sync": "reprotrain.tracking.sync.main([])",
         "a stage's replay": "reprotrain.tracking.spool.replay_spool(os.environ['MLFLOW_TRACKING_URI'])"}


@pytest.mark.parametrize("second", list(CALLS))
def test_two_syncs_at_once_land_each_run_and_version_once(second, team, admin, empty_db,
                                                          tmp_path):
    """`make sync` twice at the same moment, or with a stage's replay of the spool: one waits
    for the other (a lock on the spool), and the server gets each run, its logged model and
    its registered version once; `make sync` prints its one line and none of MLflow's."""
    server, _ = team
    name = f"race-{os.urandom(3).hex()}"
    w = tmp_path / "w"
    fill_spool(w, empty_db, name, runs=3, model=name)
    go = tmp_path / "go"
    procs = [sync_process(server, w, CALLS[kind], tmp_path / f"ready-{i}", go)
             for i, kind in enumerate(["make sync", second])]
    deadline = time.time() + 120
    while not all((tmp_path / f"ready-{i}").exists() for i in range(2)):
        assert time.time() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.05)
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert "Traceback" not in err and "View run" not in out and "Waiting up to" not in err, (out, err)
    runs = server_runs(admin, name)
    assert len(runs) == 3 and len({r.data.tags["reprotrain.source_run"] for r in runs}) == 3
    assert all(r.info.status == "FINISHED" for r in runs)
    [version] = admin.search_model_versions(f"name = '{name}'")
    assert len(admin.search_logged_models([runs[0].info.experiment_id])) == 1
    assert admin.get_model_version_by_alias(name, "champion").version == version.version
    for r in runs:
        assert len(admin.get_metric_history(r.info.run_id, "train/loss")) == 50
    said = outs[0][0].splitlines()
    assert len(said) == 1 and said[0].startswith("synced "), outs[0]


def test_the_sync_lock_is_never_followed_through_a_link_nor_skipped(tmp_path):
    """A link planted at the lock's name had its target truncated and overwritten, and a lock
    that could not be opened was skipped, so two syncs could double again (second pass)."""
    from reprotrain.tracking import sync
    from stages.lib.errors import UserError

    db, lock = tmp_path / "mlflow.db", tmp_path / "mlflow.db.sync-lock"
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    lock.symlink_to(target)
    with pytest.raises(UserError, match="is a symbolic link, not the lock"):
        with sync._lock(f"sqlite:///{db}", wait_s=0):
            pass
    assert target.read_text() == "keep me\n"
    lock.unlink()
    lock.mkdir()  # there, and not a file sync can lock
    with pytest.raises(UserError, match="cannot open the sync lock"):
        with sync._lock(f"sqlite:///{db}", wait_s=0):
            pass
    lock.rmdir()
    with sync._lock(f"sqlite:///{db}", wait_s=0):  # and the plain case still locks
        with pytest.raises(sync.Busy, match="another sync of .*mlflow.db is running"):
            with sync._lock(f"sqlite:///{db}", wait_s=0.2):
                pass


def test_a_spool_sent_already_is_one_line_without_mlflow_or_the_server(empty_db, tmp_path):
    """Every spooled run marked sent to this server: said from the spool's file alone (it was
    11 s, each run read back in 28 requests). Nothing listens on that port, and sync imports
    neither MLflow nor torch; a run whose mark is not its end's on it is sent again."""
    w = tmp_path / "w"
    db = fill_spool(w, empty_db, f"sent-{os.urandom(3).hex()}", runs=2)
    uri = f"http://127.0.0.1:{free_port()}"
    client = mlflow_client(db)
    runs = client.search_runs(["1"])
    for r in runs:
        client.set_tag(r.info.run_id, "reprotrain.synced", f"{uri}@{r.info.end_time}")
    env = env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=uri, DVC_ROOT=str(w))
    code = ("import sys, reprotrain.tracking.sync as s; s.main([]); "
            "print(sorted({'mlflow', 'torch'} & set(sys.modules)))")
    p = run([sys.executable, "-c", code], w, env=env)
    assert p.stdout.splitlines() == [f"synced 0 run(s) from .mlflow-spool/ to {uri}: 0 metric "
                                     "steps, 0 artifacts, 0 model versions; 2 run(s) already "
                                     "there", "[]"] and not p.stderr, (p.stdout, p.stderr)
    assert not (w / ".mlflow-spool/unsynced").exists()  # stages no longer replay it
    client.set_tag(runs[0].info.run_id, "reprotrain.synced", f"{uri}@0")  # reopened since
    p = run([sys.executable, "-m", "reprotrain.tracking.sync"], w, check=False, env=env)
    assert p.returncode == 1 and "does not answer" in p.stderr, p.stderr


@pytest.mark.parametrize("lost", ["runs/create", "model-versions/create"])
def test_a_create_whose_answer_is_lost_lands_once(lost, team, admin, empty_db, tmp_path):
    """The server makes the run (or the version) but its answer is lost (the proxy's 504):
    MLflow retries the POST and the server makes a second one. Sync keeps one: one run per
    source run, one version, champion."""
    server, _ = team
    name = f"lost-{os.urandom(3).hex()}"
    w = tmp_path / "w"
    fill_spool(w, empty_db, name, runs=2, model=name)
    with faulty_proxy(server.uri) as proxy:
        proxy.loses = lost
        run([sys.executable, "-m", "reprotrain.tracking.sync"], w, env=logged_in(server, proxy.uri, w))
        assert not proxy.loses  # the fault happened
    p = run([sys.executable, "-m", "reprotrain.tracking.sync"], w, env=logged_in(server, server.uri, w))
    assert "2 run(s) already there" in p.stdout, p.stdout
    runs = server_runs(admin, name)
    assert len(runs) == 2 and len({r.data.tags["reprotrain.source_run"] for r in runs}) == 2
    assert all(r.info.status == "FINISHED" for r in runs), [r.info.status for r in runs]
    [version] = admin.search_model_versions(f"name = '{name}'")
    assert admin.get_model_version_by_alias(name, "champion").version == version.version


@pytest.mark.parametrize("value", ["abc", "0"])
def test_sync_with_a_bad_http_timeout_names_it_in_one_line(value, team, empty_db, tmp_path):
    """The user's MLFLOW_HTTP_REQUEST_TIMEOUT, not the server: `abc` was a 30-line traceback,
    0 "the MLflow server ... failed ... rerun make sync when it answers"."""
    server, _ = team
    w = tmp_path / "w"
    db = fill_spool(w, empty_db, f"timeout-{os.urandom(3).hex()}")
    p = run([sys.executable, "-m", "reprotrain.tracking.sync"], w, check=False,
            env=logged_in(server, server.uri, w, MLFLOW_HTTP_REQUEST_TIMEOUT=value))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert lines[0].startswith(f"error: MLFLOW_HTTP_REQUEST_TIMEOUT={value!r} is not"), lines
    [r] = mlflow_client(db).search_runs(["1"])
    assert "reprotrain.synced" not in r.data.tags


@pytest.mark.parametrize("how", ["newer", "older"])
def test_a_store_of_another_mlflow_is_named_not_the_server(how, team, empty_db, tmp_path):
    """A spool (or FROM=) of another MLflow's schema: MLflow refuses it, and sync said "the
    MLflow server ... failed ...: rerun make sync when it answers"."""
    import sqlite3

    server, _ = team
    w = tmp_path / "w"
    db = fill_spool(w, empty_db, f"schema-{os.urandom(3).hex()}")
    with contextlib.closing(sqlite3.connect(db)) as con:
        con.execute("UPDATE alembic_version SET version_num = ?",
                    ("ffffffffffff" if how == "newer" else "0a8213491aaa",))
        con.commit()
    kept = db.read_bytes()
    for args in ([], ["--from", f"sqlite:///{db}"]):
        p = run([sys.executable, "-m", "reprotrain.tracking.sync", *args], w, check=False,
                env=logged_in(server, server.uri, w))
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 1 and len(lines) == 1, p.stderr
        assert f"{db} was written by another MLflow" in lines[0] and "MLflow server" not in lines[0]
    assert db.read_bytes() == kept


def mlflow_client(db: Path):
    import mlflow

    return mlflow.MlflowClient(f"sqlite:///{db}")


def damage_spool(db: Path, how: str) -> None:
    import sqlite3

    data = db.read_bytes()
    if how == "truncated":
        db.write_bytes(data[: len(data) // 2])
    elif how == "random bytes":
        db.write_bytes(os.urandom(len(data)))
    elif how == "a table dropped":
        with contextlib.closing(sqlite3.connect(db)) as con:
            con.execute("DROP TABLE metrics")
            con.commit()
    else:
        db.write_bytes(b"")


@pytest.mark.parametrize("how", ["truncated", "random bytes", "a table dropped", "0 bytes"])
def test_a_damaged_spool_is_kept_aside_and_named_in_one_line(how, team, empty_db, tmp_path):
    server, _ = team
    w = tmp_path / "w"
    db = fill_spool(w, empty_db, f"damaged-{os.urandom(3).hex()}", steps=3000)
    damage_spool(db, how)
    bad = db.read_bytes()
    p = run([sys.executable, "-m", "reprotrain.tracking.sync"], w, check=False,
            env=logged_in(server, server.uri, w))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert lines[0].startswith(f"error: the spool {db} is damaged ("), lines
    [kept] = db.parent.glob("mlflow.db.damaged-*")
    assert kept.read_bytes() == bad and f"kept aside as {kept}" in lines[0] and not db.exists()
    assert not (db.parent / "unsynced").exists()  # stages no longer replay it


def test_sync_into_an_experiment_an_admin_deleted_refuses_in_one_line(team, admin, empty_db,
                                                                     tmp_path):
    """Restoring it would bring back the runs deleted with it: the admin's call, not sync's."""
    server, _ = team
    name = f"deleted-{os.urandom(3).hex()}"
    exp_id = admin.create_experiment(name)
    old = admin.create_run(exp_id).info.run_id
    admin.delete_run(old)
    admin.delete_experiment(exp_id)
    w = tmp_path / "w"
    db = fill_spool(w, empty_db, name)
    p = run([sys.executable, "-m", "reprotrain.tracking.sync"], w, check=False,
            env=logged_in(server, server.uri, w))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert f"the experiment {name!r} was deleted on the server (id {exp_id})" in lines[0]
    assert f"mlflow experiments restore --experiment-id {exp_id}" in lines[0]
    assert admin.get_experiment(exp_id).lifecycle_stage == "deleted"
    assert admin.get_run(old).info.lifecycle_stage == "deleted" and db.exists()


@pytest.mark.parametrize("who", ["a READ user", "a wrong password"])
def test_sync_refused_by_the_server_is_one_line_naming_the_user(who, team, admin, empty_db,
                                                               tmp_path):
    import mlflow.server

    server, _ = team
    name = f"refused-{os.urandom(3).hex()}"
    admin.create_experiment(name)
    user, password = (f"reader{os.urandom(3).hex()}", "reader-password-1") \
        if who == "a READ user" else (server.user, "wrong-password-123")
    if who == "a READ user":  # READ is the server's default permission
        mlflow.server.get_app_client("basic-auth", tracking_uri=server.uri).create_user(user, password)
    w = tmp_path / "w"
    db = fill_spool(w, empty_db, name)
    p = run([sys.executable, "-m", "reprotrain.tracking.sync"], w, check=False,
            env=logged_in(server, server.uri, w, MLFLOW_TRACKING_USERNAME=user,
                          MLFLOW_TRACKING_PASSWORD=password))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert (f"user '{user}' may not write here" if who == "a READ user" else
            f"the server refused the login of '{user}'") in lines[0], lines
    assert "the spool .mlflow-spool/ is kept" in lines[0] and password not in p.stderr
    assert db.exists() and server_runs(admin, name) == []


@pytest.mark.parametrize("failure", ["502 from a proxy", "database stopped"])
def test_sync_to_a_failing_server_is_bounded_and_one_line(failure, team, empty_db, tmp_path):
    import mlflow

    server, db = team
    w = tmp_path / "w"
    fill_spool(w, empty_db, f"failing-{os.urandom(3).hex()}")
    with contextlib.ExitStack() as faults, faulty_proxy(server.uri) as proxy:
        if failure == "502 from a proxy":
            proxy.mode = "502"
        else:
            faults.enter_context(database_stopped(db))
        t = time.perf_counter()
        p = run([sys.executable, "-m", "reprotrain.tracking.sync"], w, check=False, timeout=120,
                env=logged_in(server, proxy.uri, w))
        took = time.perf_counter() - t
    print(f"{failure}: sync took {took:.1f}s")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1 and took < 60, (took, p.stderr)
    assert "the spool" in lines[0] and "is kept" in lines[0], lines
    [r] = mlflow.MlflowClient(stores_spool(w)).search_runs(["1"])
    assert "reprotrain.synced" not in r.data.tags  # the next sync sends it
