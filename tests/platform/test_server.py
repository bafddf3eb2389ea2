"""The team's tracking server (`make server`): a real PostgreSQL, a real `mlflow server` with
logins on a free loopback port, and the stages logging to it as a team member would."""

from __future__ import annotations

import json
import multiprocessing
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from tests.conftest import ROOT, VENV_BIN, copy_repo, env_with, run, start_queue, wait_for_queue
from tests.support.services import (
    create_and_log,
    create_database,
    logged_in_page,
    mlflow_server,
    postgres,  # noqa: F401 - the fixture
    server_env,
)

TINY = {"epochs": "2", "model.width": "8", "export.register_as": "reprotrain"}


@pytest.fixture(scope="module")
def server(postgres, tmp_path_factory):  # noqa: F811 - the fixture imported above
    db = create_database(postgres, f"mlflow_{secrets.token_hex(4)}", schema=False)
    with mlflow_server(db, tmp_path_factory.mktemp("server")) as s:
        assert "mlflow db upgrade" in s.log.read_text()  # a first start: the tables are made
        yield s


def start_server(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reprotrain.team.server", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def one_error_line(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 1, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    return lines[0]


def test_make_server_refuses_each_missing_input_in_one_line(tmp_path):
    env = server_env("admin", "a-long-enough-password")
    db, art = f"sqlite:///{tmp_path / 'never.db'}", str(tmp_path / "art")
    p = run(["make", "-s", "server", f"VENV={VENV_BIN.parent}", f"ARTIFACTS={art}", "PORT=5999"],
            ROOT, env=env, check=False)
    assert p.returncode != 0 and "error: no database: `make server DB=postgresql://" in p.stderr
    assert "Traceback" not in p.stderr
    cases = {
        "MLFLOW_TRACKING_PASSWORD must be set": dict(MLFLOW_TRACKING_PASSWORD=""),
        "MLFLOW_TRACKING_USERNAME and": dict(MLFLOW_TRACKING_USERNAME=""),
        "MLFLOW_TRACKING_PASSWORD is too short": dict(MLFLOW_TRACKING_PASSWORD="short"),
        "MLFLOW_FLASK_SERVER_SECRET_KEY must be set": dict(MLFLOW_FLASK_SERVER_SECRET_KEY="abc"),
    }
    for said, change in cases.items():
        line = one_error_line(start_server("--db", db, "--artifacts", art, "--port", "5999",
                                           env={**env, **change}))
        assert said in line
    line = one_error_line(start_server("--db", db, "--artifacts", art, "--port", "5999",
                                       "--host", "0.0.0.0", env=env))
    assert "HOST=0.0.0.0 needs ALLOWED_HOSTS" in line
    line = one_error_line(start_server("--db", "/srv/mlflow.db", "--artifacts", art, "--port", "1",
                                       env=env))
    assert "is not a database URI" in line
    assert not (tmp_path / "never.db").exists()  # refused before anything was made


def test_every_mistake_is_a_line_and_a_password_in_db_is_refused_unseen(tmp_path):
    """`ps` shows DB= to every user for the server's life: a password there, in any form, is
    refused naming the fix, without showing it; several mistakes are one line each."""
    env = server_env("admin", "a-long-enough-password")
    art = str(tmp_path / "art")
    secret = "db-secret-9f3"
    for db in (f"postgresql://mlflow:{secret}@127.0.0.1:1/mlflow",
               f"postgresql://mlflow@127.0.0.1:1/mlflow?sslmode=disable&password={secret}",
               f"host=127.0.0.1 port=1 password='{secret} x' dbname=mlflow",
               # what SQLAlchemy reads as the password: a raw blank, an unescaped /
               f"postgresql://mlflow:{secret} x@127.0.0.1:1/mlflow",
               f"postgresql://mlflow:ab/{secret}@127.0.0.1:1/mlflow",
               # ODBC's keyword string, percent-encoded in a query value
               f"mssql+pyodbc://u@127.0.0.1:1/db?odbc_connect=DRIVER%3Dx%3BUID%3Du%3BPWD%3D{secret}",
               # a blank that ends no password: in ODBC's braces, escaped in libpq's keywords
               f"mssql+pyodbc://u@127.0.0.1:1/db?odbc_connect=DRIVER={{x}};PWD={{{secret} HALF2}}",
               f"host=127.0.0.1 port=1 password={secret}\\ HALF2 dbname=mlflow"):
        p = start_server("--db", db, "--artifacts", art, "--port", "5999", env=env)
        line = one_error_line(p)
        assert "holds a password, which `ps` shows" in line and "~/.pgpass" in line, line
        assert secret not in p.stdout + p.stderr and "***" in line
        assert "HALF2" not in p.stdout + p.stderr, line
    p = start_server("--db", "postgresql://mlflow@127.0.0.1:1/mlflow", "--artifacts", art,
                     "--port", "5999", env={**env, "MLFLOW_TRACKING_PASSWORD": "short",
                                            "MLFLOW_FLASK_SERVER_SECRET_KEY": "abc"})
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 2 and all(x.startswith("error: ") for x in lines)
    assert "MLFLOW_TRACKING_PASSWORD is too short" in lines[0]
    assert "MLFLOW_FLASK_SERVER_SECRET_KEY must be set" in lines[1]
    # MLflow's old default: refused here, not by a traceback tail from the server's start.
    line = one_error_line(start_server("--db", "postgresql://mlflow@127.0.0.1:1/mlflow",
                                       "--artifacts", art, "--port", "5999",
                                       env={**env, "MLFLOW_TRACKING_PASSWORD": "password1234"}))
    assert "default password of older MLflow versions" in line and "choose another" in line
    assert not (tmp_path / "art").exists()


def test_a_schema_from_a_newer_mlflow_is_refused_in_one_line(postgres, tmp_path):  # noqa: F811
    db = create_database(postgres, f"stale_{secrets.token_hex(4)}")
    subprocess.run([sys.executable, "-m", "mlflow", "db", "upgrade", db], check=True,
                   capture_output=True)
    import psycopg

    with psycopg.connect(db, autocommit=True) as conn:  # as a newer MLflow's migration leaves it
        conn.execute("UPDATE alembic_version SET version_num = 'f0e1d2c3b4a5'")
    p = start_server("--db", db, "--artifacts", str(tmp_path / "art"), "--port", "5999",
                     env=server_env("admin", "a-long-enough-password"))
    line = one_error_line(p)
    assert "schema revision f0e1d2c3b4a5, which MLflow" in line and "newer MLflow" in line
    assert "starting the MLflow server" not in p.stdout


def test_without_a_login_or_with_a_wrong_one_the_refusal_is_one_line(server, tmp_path):
    """Tracking never stops the stage: it goes on with one warning line that says how to fix
    it (Python's form of a warning added the file, line and source line: two lines)."""
    code = ("from reprotrain import tracking; from stages.config import MlflowConfig\n"
            "from stages.lib.cli import run_stage\n"
            "def main():\n"
            "    with tracking.start_run(MlflowConfig(experiment='refused')) as run:\n"
            "        run.log_params({'lr': 0.1})\n"
            "    print('the stage went on')\n"
            "run_stage(main)\n")
    for login, said in [({}, "the server needs a login: set MLFLOW_TRACKING_USERNAME and "
                              "MLFLOW_TRACKING_PASSWORD"),
                        ({"MLFLOW_TRACKING_USERNAME": server.user,
                          "MLFLOW_TRACKING_PASSWORD": "wrong-password-123"},
                         f"the server refused the login of '{server.user}': set")]:
        p = run([sys.executable, "-c", code], ROOT,
                env=env_with(MLFLOW_TRACKING_URI=server.uri, **login))
        assert p.stdout.strip() == "the stage went on"
        (warned,) = [line for line in p.stderr.splitlines() if line.strip()] or [p.stderr]
        assert warned.startswith("warning: MLflow tracking at ") and said in warned, p.stderr
        assert "Traceback" not in p.stderr and "wrong-password-123" not in p.stderr


def test_a_login_the_server_checked_is_trusted_but_never_a_wrong_or_an_old_password(server):
    """The server caches the logins it checked (auth_cache_ttl_seconds: a request no longer pays
    the password hash; `make bench-server`): a wrong password right after the right one, and the
    old password right after a change, are still refused. (With several workers, the others
    honour a change within AUTH_CACHE_S.)"""
    import mlflow.server

    from reprotrain.team.server import AUTH_CACHE_S

    assert 0 < AUTH_CACHE_S <= 60
    env = {"MLFLOW_TRACKING_USERNAME": server.user, "MLFLOW_TRACKING_PASSWORD": server.password}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        auth = mlflow.server.get_app_client("basic-auth", tracking_uri=server.uri)
        auth.create_user("cached", "cached-password-1")
        assert login_status(server.uri, "cached", "cached-password-1") == 200
        assert login_status(server.uri, "cached", "cached-password-1") == 200  # from the cache
        assert login_status(server.uri, "cached", "wrong-password-12") == 401
        auth.update_user_password("cached", "cached-password-2")
    assert login_status(server.uri, "cached", "cached-password-1") == 401
    assert login_status(server.uri, "cached", "cached-password-2") == 200


def test_the_server_listens_on_loopback_and_refuses_foreign_host_headers(server):
    import base64
    import urllib.error
    import urllib.request

    import psutil

    port = int(server.uri.rsplit(":", 1)[1])
    bound = {c.laddr.ip for c in psutil.net_connections("tcp")
             if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    assert bound == {"127.0.0.1"}
    login = base64.b64encode(f"{server.user}:{server.password}".encode()).decode()
    api = f"{server.uri}/api/2.0/mlflow/experiments/search?max_results=1"
    with urllib.request.urlopen(urllib.request.Request(
            api, headers={"Authorization": f"Basic {login}"}), timeout=30) as r:
        assert r.status == 200
    for headers, code in [({"Authorization": f"Basic {login}", "Host": "evil.example.com"}, 403),
                          ({}, 401)]:  # DNS rebinding; no login
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(api, headers=headers), timeout=30)
        assert err.value.code == code


def test_a_read_only_user_can_browse_but_not_log(server, monkeypatch):
    import mlflow
    import mlflow.server

    from reprotrain import tracking
    from stages.config import MlflowConfig

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)  # never this checkout's mlflow.db
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", server.user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", server.password)
    mlflow.set_tracking_uri(server.uri)
    with tracking.start_run(MlflowConfig(experiment="shared")) as run:
        run.log_params({"lr": 0.1})
    auth = mlflow.server.get_app_client("basic-auth", tracking_uri=server.uri)
    auth.create_user("reader", "reader-password-1")  # READ is the server's default permission
    mlflow.MlflowClient(server.uri).create_registered_model("shared")

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "reader")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "reader-password-1")
    exp = mlflow.get_experiment_by_name("shared")
    runs = mlflow.search_runs([exp.experiment_id], output_format="list")
    assert [r.info.run_id for r in runs] == [run.run_id] and runs[0].data.params == {"lr": "0.1"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracking.start_run(MlflowConfig(experiment="shared")) as refused:
            refused.log_params({"lr": 0.2})
    assert refused.run_id is None
    said = [str(w.message) for w in caught if "MLflow" in str(w.message)]
    assert len(said) == 1 and "user 'reader' may not write here: ask the server's admin" in said[0]
    client = mlflow.MlflowClient(server.uri)
    with pytest.raises(mlflow.MlflowException, match="403"):
        client.set_registered_model_tag("shared", "owner", "reader")

    # README's grants (as the admin): EDIT on the experiment and the registered model.
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", server.user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", server.password)
    assert len(mlflow.search_runs([exp.experiment_id], output_format="list")) == 1
    auth.grant_user_permission("reader", "experiment", exp.experiment_id, "EDIT")
    auth.grant_user_permission("reader", "registered_model", "shared", "EDIT")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "reader")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "reader-password-1")
    with tracking.start_run(MlflowConfig(experiment="shared")) as granted:
        granted.log_params({"lr": 0.2})
    assert granted.run_id and client.get_run(granted.run_id).data.params == {"lr": "0.2"}
    client.set_registered_model_tag("shared", "owner", "reader")


def test_a_password_in_params_yaml_is_refused_without_showing_it():
    from stages.config import MlflowConfig, ParamsError

    with pytest.raises(ParamsError) as refused:
        MlflowConfig(tracking_uri="http://alice:hunter2-secret@mlflow.example.com")
    assert "hunter2-secret" not in str(refused.value)
    assert "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD" in str(refused.value)


def test_two_processes_creating_the_experiment_at_once_both_log(server, monkeypatch):
    """mlflow #4123: the second create fails with "already exists"; both runs must still log."""
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", server.user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", server.password)

    ctx = multiprocessing.get_context("spawn")
    names = [f"race-{i}" for i in range(2)]
    with ctx.Manager() as manager, ctx.Pool(2) as pool:
        for name in names:
            barrier = manager.Barrier(2)
            results = pool.starmap(create_and_log, [(server.uri, server.user, server.password,
                                                      name, barrier)] * 2)
            assert all(run_id and not said for run_id, said in results), results
            client = mlflow.MlflowClient(server.uri)
            exp = client.get_experiment_by_name(name)
            found = {r.info.run_id for r in client.search_runs([exp.experiment_id])}
            assert found == {run_id for run_id, _ in results}


def server_run(server, monkeypatch, experiment: str = "reprotrain") -> list:
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", server.user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", server.password)
    client = mlflow.MlflowClient(server.uri)
    exp = client.get_experiment_by_name(experiment)
    return client, client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])


def assert_no_local_store(path: Path) -> None:
    assert not (path / "mlflow.db").exists() and not (path / "mlartifacts").exists()
    assert not list(path.glob("**/mlflow.db")) and not list(path.glob("**/mlartifacts"))


def assert_nowhere(secret: str, path: Path, *texts: str) -> None:
    """Not in any file of the workspace (DVC's cache and git's objects included) nor the texts."""
    for f in path.rglob("*"):
        if f.is_file() and not f.is_symlink():
            assert secret.encode() not in f.read_bytes(), f
    for text in texts:
        assert secret not in text


def test_every_stage_logs_to_the_server_and_nothing_stays_local(server, tmp_path, monkeypatch):
    repo = copy_repo(tmp_path / "repo", {**TINY, "mlflow.experiment": "e2e",
                                         "export.register_as": "e2e"})
    env = server.client_env()
    out = [run(["make", "repro", f"VENV={VENV_BIN.parent}"], repo, env=env)]
    out.append(run(["dvc", "exp", "run", "-S", "lr=0.01"], repo, env=env))
    ui = run(["make", "-s", "ui", f"VENV={VENV_BIN.parent}"], repo, env=env, timeout=60)
    out.append(ui)

    client, runs = server_run(server, monkeypatch, "e2e")
    assert len(runs) == 2 and all(r.info.status == "FINISHED" for r in runs)
    first, exp_run = runs
    assert first.data.params["epochs"] == "2" and exp_run.data.params["lr"] == "0.01"
    assert exp_run.data.tags["dvc_exp_name"] == exp_run.info.run_name
    for r in runs:
        assert {"train/loss", "val/acc", "eval/accuracy"} <= r.data.metrics.keys()
        assert len(client.get_metric_history(r.info.run_id, "train/loss")) >= 2
        assert r.info.artifact_uri.startswith("mlflow-artifacts:/")  # proxied by the server
        files = {a.path for a in client.list_artifacts(r.info.run_id, "train")}
        assert {"train/metrics.json", "train/history.csv"} <= files
        assert client.search_logged_models([r.info.experiment_id],
                                           filter_string=f"source_run_id = '{r.info.run_id}'")
    versions = client.search_model_versions("name = 'e2e'")
    assert sorted(v.run_id for v in versions) == sorted(r.info.run_id for r in runs)
    assert client.get_model_version_by_alias("e2e", "candidate").run_id == exp_run.info.run_id
    assert client.get_model_version_by_alias("e2e", "champion").run_id in {
        r.info.run_id for r in runs}
    link = json.loads((repo / "models/train/run.json").read_text())
    assert link["tracking_uri"] == server.uri and link["run_id"] == exp_run.info.run_id

    # make ui starts no local UI: it prints the server's runs table.
    assert ui.stdout.startswith(f"runs are on the tracking server: open {server.uri}/#/experiments/")
    assert "workflowType=machine_learning" in ui.stdout

    # The UI in a real browser: the runs table after logging in; a wrong password shows none of it.
    table, name = ui.stdout.split("open ", 1)[1].strip(), exp_run.info.run_name
    assert name in logged_in_page(table, server.user, server.password, tmp_path / "runs.png", name)
    assert (tmp_path / "runs.png").stat().st_size > 10_000
    refused = logged_in_page(table, server.user, "wrong-password-123", tmp_path / "no.png", name, 20)
    assert name not in refused

    # Without a login, training still finishes and writes its outputs; one line says why.
    (repo / "models/train/model.pt").unlink()
    anon = run([sys.executable, "-m", "stages.train"], repo, env=env_with(
        MLFLOW_TRACKING_URI=server.uri))
    assert (repo / "models/train/model.pt").exists()
    assert [line for line in anon.stderr.splitlines() if "set MLFLOW_TRACKING_USERNAME and" in line]
    assert "Traceback" not in anon.stderr
    out.append(anon)

    assert_no_local_store(repo)
    texts = [p.stdout + p.stderr for p in out]
    for r in runs:
        texts += [json.dumps(r.data.params), json.dumps(r.data.tags)]
    assert_nowhere(server.password, repo, *texts)


def test_two_clones_run_their_queues_at_once(server, tmp_path, monkeypatch):
    clones = [copy_repo(tmp_path / name, TINY) for name in ("alice", "bob")]
    env = server.client_env()
    for clone, lr in zip(clones, ("0.02", "0.03"), strict=True):
        run(["dvc", "exp", "run", "--queue", "-S", f"lr={lr}"], clone, env=env)
    for clone in clones:
        start_queue(clone, env, jobs=1)
    # At once: both started, neither done. A done experiment has its ref under its baseline
    # commit (refs/exps/ab/cdef.../name); the queue's and a running one's are elsewhere.
    refs = [run(["git", "for-each-ref", "--format=%(refname)", "refs/exps"], c).stdout.split()
            for c in clones]
    assert not [r for rs in refs for r in rs if re.match(r"refs/exps/[0-9a-f]{2}/[0-9a-f]{38}/", r)], refs
    for clone in clones:
        status = wait_for_queue(clone, env)
        assert "Success" in status and "Failed" not in status, status

    _, runs = server_run(server, monkeypatch)
    queued = {r.data.params["lr"]: r for r in runs if r.data.params.get("lr") in ("0.02", "0.03")}
    assert sorted(queued) == ["0.02", "0.03"]
    assert all(r.info.status == "FINISHED" and "eval/accuracy" in r.data.metrics
               for r in queued.values())
    for clone in clones:
        assert_no_local_store(clone)
        assert_nowhere(server.password, clone)


def test_no_password_in_the_servers_output_or_log(server):
    """After the tests above logged in, refused logins and created users: what `make server`
    printed and the server's own log hold neither password."""
    own_log = Path(server.log.read_text().split("(its log: ", 1)[1].split(")", 1)[0])
    assert "Created admin user 'admin'" in own_log.read_text()
    for text in (server.log.read_text(), own_log.read_text()):
        assert server.password not in text and "reader-password-1" not in text


def test_a_run_json_naming_a_run_the_server_lacks_gets_a_run_of_its_own(server, trained, tmp_path,
                                                                        monkeypatch):
    """What a replayed spool can leave: run.json naming a run id the server never had. Basic-auth
    answers 403 for it, not 404, which once read as "may not write here": the stage then logged
    nothing anywhere (found by a README walk after `make sync`)."""
    import shutil

    import mlflow
    import mlflow.server

    w = tmp_path / "w"
    shutil.copytree(trained, w)
    link = w / "models/train/run.json"
    missing = "0" * 32
    link.write_text(json.dumps(json.loads(link.read_text()) | {"run_id": missing,
                                                                 "tracking_uri": server.uri}))
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", server.user)  # the admin, for the set-up
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", server.password)
    client = mlflow.MlflowClient(server.uri)
    exp = client.get_experiment_by_name("reprotrain")
    exp_id = exp.experiment_id if exp else client.create_experiment("reprotrain")
    # A member, not the admin: basic-auth checks a member's permission before the run exists.
    auth = mlflow.server.get_app_client("basic-auth", tracking_uri=server.uri)
    auth.create_user("member", "member-password-1")
    auth.grant_user_permission("member", "experiment", exp_id, "EDIT")
    env = server.client_env(PYTHONPATH=str(ROOT)) | {"MLFLOW_TRACKING_USERNAME": "member",
                                                      "MLFLOW_TRACKING_PASSWORD": "member-password-1"}
    p = run([sys.executable, "-m", "stages.evaluate"], w, env=env)
    assert f"its MLflow run {missing} is not in" in p.stderr, p.stderr
    assert "may not write here" not in p.stderr and "failed" not in p.stderr, p.stderr
    runs = client.search_runs([exp_id], f"tags.training_run_id = '{missing}'")
    assert len(runs) == 1 and "eval/accuracy" in runs[0].data.metrics  # the evaluation landed


def test_the_names_every_clone_uses_are_the_admins_before_anyone_logs_in(server):
    """Whoever creates the experiment or the registered model owns it, and `make serve` serves
    that model's champion: `make server` creates both as the admin, so a member who logs in
    first cannot take them; once granted EDIT (README), members log there."""
    import mlflow
    import mlflow.server

    from stages.config import load_params

    params = load_params()
    experiment, model = params.mlflow.experiment, params.export.register_as
    auth = mlflow.server.get_app_client("basic-auth", tracking_uri=server.uri)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_USERNAME", server.user)
        env.setenv("MLFLOW_TRACKING_PASSWORD", server.password)
        auth.create_user("squatter", "squatter-password-1")
    admin = mlflow.MlflowClient(server.uri)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_USERNAME", "squatter")
        env.setenv("MLFLOW_TRACKING_PASSWORD", "squatter-password-1")
        client = mlflow.MlflowClient(server.uri)
        exp = client.get_experiment_by_name(experiment)
        assert exp is not None and client.get_registered_model(model).name == model
        assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"
        for take in (lambda: client.create_experiment(experiment),
                     lambda: client.create_registered_model(model),
                     lambda: client.create_run(exp.experiment_id),
                     lambda: client.set_registered_model_tag(model, "owner", "squatter")):
            with pytest.raises(mlflow.MlflowException):
                take()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_USERNAME", server.user)
        env.setenv("MLFLOW_TRACKING_PASSWORD", server.password)
        assert "owner" not in admin.get_registered_model(model).tags


def start_own_server(db: str, folder: Path, port: int, password: str) -> tuple[subprocess.Popen, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"server-{len(list(folder.glob('server-*.out')))}.out"
    with open(out, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "reprotrain.team.server", "--db", db, "--artifacts",
                                 folder / "artifacts", "--port", str(port), "--workers", "1"],
                                cwd=ROOT, env=server_env("admin", password), stdout=f,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while "MLflow server ready" not in out.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
        time.sleep(0.5)
    return proc, out


def login_status(uri: str, user: str, password: str) -> int:
    import base64
    import urllib.error
    import urllib.request

    login = base64.b64encode(f"{user}:{password}".encode()).decode()
    try:
        with urllib.request.urlopen(urllib.request.Request(
                f"{uri}/api/2.0/mlflow/experiments/search?max_results=1",
                headers={"Authorization": f"Basic {login}"}), timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_the_server_lives_and_dies_with_its_command(postgres, tmp_path):  # noqa: F811
    """Its log is in a private folder (a symlink planted at the old /tmp name is not
    followed), no secret is on a command line, SIGKILL of `make server` ends every server
    process, a restart with a new admin password applies it, and the server dying is one line."""
    import tempfile

    import psutil

    from tests.support.services import free_port

    db = create_database(postgres, f"life_{secrets.token_hex(4)}")
    port, uri = free_port(), ""
    planted = Path(tempfile.gettempdir()) / f"reprotrain-server-{port}.log"
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched\n")
    planted.unlink(missing_ok=True)
    planted.symlink_to(victim)
    old_pw, new_pw = f"old-{secrets.token_hex(8)}", f"new-{secrets.token_hex(8)}"
    procs = []
    try:
        first, out = start_own_server(db, tmp_path / "s", port, old_pw)
        procs.append(first)
        uri = f"http://127.0.0.1:{port}"
        log = Path(out.read_text().split("(its log: ", 1)[1].split(")", 1)[0])
        assert victim.read_text() == "untouched\n" and planted.is_symlink()
        assert log.is_file() and log.parent.stat().st_mode & 0o777 == 0o700
        assert not log.parent.name.endswith(str(port))  # not a name one can plant beforehand
        ini = log.parent / "basic-auth.ini"
        assert old_pw not in ini.read_text()
        children = psutil.Process(first.pid).children(recursive=True)
        assert len(children) >= 2  # mlflow's command, uvicorn and its worker
        for child in children:
            cmdline = Path(f"/proc/{child.pid}/cmdline").read_bytes()
            assert old_pw.encode() not in cmdline and b"assword" not in cmdline

        first.kill()  # SIGKILL: nothing of `make server` runs to stop the server
        first.wait()
        gone, alive = psutil.wait_procs(children, timeout=60)
        assert not alive, [p.cmdline() for p in alive]
        assert not ini.exists() or old_pw not in ini.read_text()
        shutil.rmtree(log.parent)  # SIGKILL left no chance to remove it

        second, out = start_own_server(db, tmp_path / "s", port, new_pw)
        procs.append(second)
        said = out.read_text()
        assert "the admin 'admin' had another password: it is now MLFLOW_TRACKING_PASSWORD's" in said
        assert login_status(uri, "admin", new_pw) == 200
        assert login_status(uri, "admin", old_pw) == 401
        assert old_pw not in said and new_pw not in said and "Warning" not in said

        (mlflow_cmd,) = psutil.Process(second.pid).children()
        mlflow_cmd.kill()  # as the OOM killer would
        second.wait(timeout=60)
        lines = out.read_text().strip().splitlines()
        assert second.returncode == 1, lines
        assert lines[-1].startswith("error: the MLflow server stopped by itself (killed by SIGKILL")
        second_log = Path(out.read_text().split('(its log: ')[-1].split(')')[0])
        assert f"its log: {second_log}" in lines[-1]
        assert second_log.is_file()  # kept: it says why the server died
        shutil.rmtree(second_log.parent)
    finally:
        planted.unlink(missing_ok=True)
        for proc in procs:
            for p in [proc, *psutil.Process(proc.pid).children(recursive=True)] if \
                    proc.poll() is None else []:
                p.kill()


def test_sigterm_is_a_clean_stop_that_leaves_no_log_folder(postgres, tmp_path):  # noqa: F811
    """SIGTERM, as systemd (or make, passing its own on) stops the server: it and its workers
    stop, the command exits 0 (it was 143: `make: *** [Makefile:NNN: server] Error 143`), and
    the private folder of its log and basic-auth's configuration is gone from $TMPDIR."""
    import psutil

    from tests.support.services import free_port

    db = create_database(postgres, f"stop_{secrets.token_hex(4)}")
    proc, out = start_own_server(db, tmp_path, free_port(), f"pw-{secrets.token_hex(12)}")
    try:
        log = Path(out.read_text().split("(its log: ", 1)[1].split(")", 1)[0])
        assert log.is_file()
        servers = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()  # its server gets SIGTERM from the kernel (PR_SET_PDEATHSIG)
            proc.wait()
    assert proc.returncode == 0, out.read_text()
    assert out.read_text().strip().splitlines()[-1] == "stopping the MLflow server"
    gone, alive = psutil.wait_procs(servers, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    assert not log.parent.exists(), sorted(log.parent.iterdir())


def test_a_restart_names_a_member_who_took_a_name_and_a_deleted_experiment(postgres, tmp_path):  # noqa: F811
    """The admin deleted the registered model and a member created it anew (MANAGE: the
    champion is theirs), and deleted the experiment: the restart said both were the admin's
    and ready, and no run could be logged."""
    import mlflow
    import mlflow.server

    from tests.support.services import free_port

    db = create_database(postgres, f"squat_{secrets.token_hex(4)}")
    password, port = f"pw-{secrets.token_hex(8)}", free_port()
    uri = f"http://127.0.0.1:{port}"
    first, _ = start_own_server(db, tmp_path / "s", port, password)
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("MLFLOW_TRACKING_USERNAME", "admin")
            env.setenv("MLFLOW_TRACKING_PASSWORD", password)
            mlflow.server.get_app_client("basic-auth", tracking_uri=uri).create_user(
                "squatter", "squatter-password-1")
            admin = mlflow.MlflowClient(uri)
            admin.delete_registered_model("reprotrain")
            exp_id = admin.get_experiment_by_name("reprotrain").experiment_id
            admin.delete_experiment(exp_id)
            env.setenv("MLFLOW_TRACKING_USERNAME", "squatter")
            env.setenv("MLFLOW_TRACKING_PASSWORD", "squatter-password-1")
            mlflow.MlflowClient(uri).create_registered_model("reprotrain")
    finally:
        first.terminate()
        first.wait(timeout=60)
    second, out = start_own_server(db, tmp_path / "s", port, password)
    try:
        said = out.read_text()
        assert "warning: user 'squatter' can manage registered model 'reprotrain'" in said, said
        assert f"warning: experiment 'reprotrain' (id {exp_id}) is deleted" in said, said
        assert f"experiments restore --experiment-id {exp_id}" in said
        assert "and a member can manage them (above)" in said
        # docs/server.md's way back, as written there: revoke, then grant EDIT.
        with pytest.MonkeyPatch.context() as env:
            env.setenv("MLFLOW_TRACKING_USERNAME", "admin")
            env.setenv("MLFLOW_TRACKING_PASSWORD", password)
            auth = mlflow.server.get_app_client("basic-auth", tracking_uri=uri)
            with pytest.raises(Exception, match="RESOURCE_ALREADY_EXISTS"):
                auth.grant_user_permission("squatter", "registered_model", "reprotrain", "EDIT")
            auth.revoke_user_permission("squatter", "registered_model", "reprotrain")
            auth.grant_user_permission("squatter", "registered_model", "reprotrain", "EDIT")
            assert auth.get_user_permission("squatter", "registered_model",
                                            "reprotrain").permission == "EDIT"
    finally:
        second.terminate()
        second.wait(timeout=60)


def test_a_port_in_use_is_one_plain_line():
    """A second `make server` on the first one's port: the line said `(Address already in
    use (while attempting to bind on address ('127.0.0.1', N)))`."""
    import socket

    from reprotrain.team.server import check_port
    from stages.lib.errors import UserError

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(UserError) as e:
            check_port("127.0.0.1", port)
    assert str(e.value) == (f"cannot listen on 127.0.0.1:{port} (Address already in use): is "
                            "another server there? choose another PORT")


def test_make_server_takes_a_db_with_quotes_and_blanks_as_one_value(tmp_path):
    """`make server DB="host=h password='a b' ..."`: the recipe's single quotes split it, so
    the server never saw the password to refuse it and argparse echoed the rest of it."""
    secret = "S3cr3t x9q"
    for db in (f"host=127.0.0.1 port=1 password='{secret}' dbname=mlflow",
               "postgresql://mlflow@127.0.0.1:1/it's"):
        p = subprocess.run(["make", "-s", "server", f"DB={db}", f"ARTIFACTS={tmp_path / 'a'}",
                            "PORT=5999"], cwd=ROOT, env=server_env("admin", "short"),
                           capture_output=True, text=True, timeout=120)
        out = p.stdout + p.stderr
        assert p.returncode != 0 and "x9q" not in out and "S3cr3t" not in out, out
        assert "MLFLOW_TRACKING_PASSWORD is too short" in out, out  # it reached the checks
        assert "holds a password" in out or "password" not in db, out


def in_a_terminal(argv: list[str], env: dict[str, str], answer: str) -> subprocess.CompletedProcess:
    """argv with a terminal of its own, as a user runs it: getpass reads /dev/tty (the snippet's
    stdin is its heredoc), here a pseudo-terminal that types `answer` once asked for a password
    (getpass flushes what was typed before it asked)."""
    import os
    import pty

    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(ROOT)
        os.execvpe(argv[0], argv, env)
    out, typed, deadline = b"", False, time.monotonic() + 120
    while True:
        if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            os.kill(pid, signal.SIGKILL)  # stuck: what it printed goes into the failure
            break
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
        if not typed and b"password" in out:
            os.write(fd, answer.encode())
            typed = True
    _, status = os.waitpid(pid, 0)
    return subprocess.CompletedProcess(argv, os.waitstatus_to_exitcode(status), out.decode(), "")


def test_docs_member_and_grant_snippets_run_as_written_and_the_member_logs(server, monkeypatch):
    """docs/server.md's two admin snippets, in order: the first creates alice, the second grants
    her EDIT on the experiment and the registered model (it granted a `bob` no one had made)."""
    import mlflow

    text = (ROOT / "docs/server.md").read_text()
    snippets = [b for b in text.split("```bash\n")[1:] if "<<'PY'" in b.split("```")[0]]
    assert len(snippets) >= 2
    password = f"alice-{secrets.token_hex(8)}"
    for block in snippets[:2]:
        script = (block.split("```")[0].replace("http://127.0.0.1:5000", server.uri)
                  .replace(".venv/bin/python", sys.executable))
        p = in_a_terminal(["bash", "-eo", "pipefail", "-c", script], server.client_env(),
                          answer=password + "\n")
        assert p.returncode == 0, p.stdout[-3000:]
    client = mlflow.MlflowClient(server.uri)
    env = {"MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": password}
    p = subprocess.run([sys.executable, "-c", "import mlflow; mlflow.set_experiment('reprotrain'); "
                        "r = mlflow.start_run(); mlflow.log_param('who', 'alice'); mlflow.end_run(); "
                        "mlflow.MlflowClient().set_registered_model_tag('reprotrain', 'by', 'alice');"
                        "print(r.info.run_id)"], cwd=ROOT, env=server.client_env() | env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", server.user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", server.password)
    assert client.get_run(p.stdout.split()[-1]).data.params == {"who": "alice"}
    assert client.get_registered_model("reprotrain").tags["by"] == "alice"
