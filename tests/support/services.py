"""Real services for the team set-up tests: a throwaway PostgreSQL cluster in a temp folder, on a
free loopback port, and the team's MLflow server on it. `.ci/run` installs Debian's postgresql
where it is missing."""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from reprotrain.ports import free_port  # noqa: F401 - the tests import it from here


def postgres_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


def as_postgres(*argv: str | Path) -> list[str]:
    """initdb and the server refuse to run as root: they run as Debian's `postgres` user."""
    argv = [str(a) for a in argv]
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


@contextmanager
def postgres_cluster(folder: Path) -> Iterator[str]:
    """A PostgreSQL server on loopback for the duration; yields its URI without a database
    (`f"{uri}/name"` after `create_database(uri, "name")`). Trust auth: loopback, a test."""
    bin_dir = postgres_bin()
    if bin_dir is None or (os.geteuid() == 0 and shutil.which("runuser") is None):
        pytest.skip("needs PostgreSQL's binaries (Debian's postgresql; .ci/run installs it)")
    folder.mkdir(parents=True, exist_ok=True)
    data, sockets = folder / "pgdata", folder / "pgsock"
    sockets.mkdir(exist_ok=True)
    if os.geteuid() == 0:
        for p in (folder, sockets):
            shutil.chown(p, "postgres")
        for parent in folder.parents:  # pytest's tmp folders are 0700: postgres must get through
            if parent == Path("/tmp") or parent == Path("/"):
                break
            parent.chmod(parent.stat().st_mode | 0o711)
    subprocess.run(as_postgres(bin_dir / "initdb", "-D", data, "-U", "postgres", "-A", "trust",
                               "--no-sync", "-E", "UTF8"), check=True, capture_output=True)
    port = free_port()
    options = (f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1 -c fsync=off "
               "-c synchronous_commit=off -c full_page_writes=off")
    subprocess.run(as_postgres(bin_dir / "pg_ctl", "-D", data, "-o", options, "-l",
                               folder / "postgres.log", "-w", "-t", "60", "start"),
                   check=True, capture_output=True)
    # Its pid now: at the end pytest may already have closed the temp folders to `postgres`,
    # and pg_ctl, running as that user, then cannot stop it.
    pid = int((data / "postmaster.pid").read_text().split()[0])
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}"
    finally:
        stopped = subprocess.run(as_postgres(bin_dir / "pg_ctl", "-D", data, "-m", "immediate",
                                             "stop"), capture_output=True)
        if stopped.returncode:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGQUIT)  # the server's own immediate shutdown


def create_database(uri: str, name: str, schema: bool = True) -> str:
    """A new database on the cluster; returns its URI. With MLflow's and basic-auth's tables
    already (`schema`), copied from a template the team server's own upgrade made once per
    cluster: a first start on an empty database runs the migrations, 14 s of the suite's time
    per server. schema=False gives an empty one (tests/platform/test_server.py's server starts on it)."""
    import psycopg

    template = "mlflow_schema"
    if schema and uri not in _templates:
        create_database(uri, template, schema=False)
        from reprotrain.team.server import apply_admin_password, upgrade

        upgrade(f"{uri}/{template}")
        apply_admin_password(f"{uri}/{template}", "admin", "")  # no admin yet: only the tables
        _templates.add(uri)
    with psycopg.connect(f"{uri}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if schema else ""))
    return f"{uri}/{name}"


_templates: set[str] = set()  # the clusters whose template is made


@pytest.fixture(scope="session")
def postgres() -> Iterator[str]:
    """One cluster for the test session (each test creates its own database). In a folder of
    its own, not pytest's: another pytest session starting on this machine sets pytest's
    folders back to 0700, and the server, running as `postgres`, died of it mid-run."""
    folder = Path(tempfile.mkdtemp(prefix="reprotrain-postgres."))
    try:
        with postgres_cluster(folder) as uri:
            yield uri
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class MlflowServer:
    uri: str
    user: str
    password: str
    log: Path  # what `python -m reprotrain.team.server` printed; the server's own log is in its tempdir

    def client_env(self, **extra: str) -> dict[str, str]:
        """A client's environment (tests.conftest.env_with) pointed at this server, logged in."""
        from tests.conftest import env_with

        return env_with(MLFLOW_TRACKING_URI=self.uri, MLFLOW_TRACKING_USERNAME=self.user,
                        MLFLOW_TRACKING_PASSWORD=self.password, **extra)


def server_env(user: str, password: str) -> dict[str, str]:
    """What `make server` needs in its environment: the first admin and the Flask secret key."""
    from tests.conftest import env_with

    return env_with(MLFLOW_TRACKING_USERNAME=user, MLFLOW_TRACKING_PASSWORD=password,
                    MLFLOW_FLASK_SERVER_SECRET_KEY=secrets.token_hex(32))


@contextmanager
def mlflow_server(db: str, folder: Path, timeout: float = 240, artifacts: str = "",
                  env: dict[str, str] | None = None) -> Iterator[MlflowServer]:
    """The team server, started as a user does (`python -m reprotrain.team.server`, logins on) on a free
    loopback port against `db`, artifacts in `folder` (or at `artifacts`, an s3:// URI whose
    endpoint and keys are in `env`, the server's alone); stopped with SIGTERM, as systemd does."""
    folder.mkdir(parents=True, exist_ok=True)
    user, password, port = "admin", f"pw-{secrets.token_hex(12)}", free_port()
    log = folder / "server.out"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "reprotrain.team.server", "--db", db,
             "--artifacts", artifacts or folder / "artifacts", "--port", str(port), "--workers", "1"],
            cwd=Path(__file__).resolve().parents[2], env=server_env(user, password) | (env or {}),
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while "MLflow server ready" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the MLflow server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield MlflowServer(f"http://127.0.0.1:{port}", user, password, log)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def create_and_log(uri: str, user: str, password: str, name: str, barrier) -> tuple:
    """In a fresh process (tests/platform/test_server.py's race): once `barrier` lets every process go,
    open a run in experiment `name`, creating it; the run's id and MLflow's warnings."""
    import warnings

    os.environ.update(MLFLOW_TRACKING_URI=uri, MLFLOW_TRACKING_USERNAME=user,
                      MLFLOW_TRACKING_PASSWORD=password)
    import mlflow  # noqa: F401 - imported before the barrier: both reach the server together

    from reprotrain import tracking
    from stages.config import MlflowConfig

    barrier.wait()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracking.start_run(MlflowConfig(experiment=name)) as run:
            run.log_params({"lr": 0.1})
    return run.run_id, [str(w.message) for w in caught if "MLflow" in str(w.message)]


def logged_in_page(url: str, user: str, password: str, png: Path, text: str,
                   timeout: float = 90) -> str:
    """The DOM of `url` in headless Chromium logged in with basic auth, once `text` shows (or
    `timeout` passed), and its screenshot in `png`. Basic auth goes in an Authorization header
    (Chrome DevTools Protocol, over aiohttp's websocket): credentials in the URL are refused by the
    MLflow UI's own fetch calls ("Request cannot be constructed from a URL that includes
    credentials")."""
    import asyncio
    import base64
    import json
    import tempfile

    import aiohttp

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        pytest.skip("no chromium: `apt-get install chromium` to render the page")
    auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    async def drive(port: int) -> str:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/json/list") as r:
                page = next(t for t in await r.json() if t["type"] == "page")
            async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                ids = iter(range(1, 10**6))

                async def call(method: str, **params):
                    sent = next(ids)
                    await ws.send_json({"id": sent, "method": method, "params": params})
                    while True:
                        msg = json.loads((await ws.receive()).data)
                        if msg.get("id") == sent:
                            return msg.get("result", {})

                await call("Network.enable")
                await call("Network.setExtraHTTPHeaders", headers={"Authorization": auth})
                await call("Emulation.setDeviceMetricsOverride", width=1600, height=1000,
                           deviceScaleFactor=1, mobile=False)
                await call("Page.navigate", url=url)
                deadline = time.monotonic() + timeout
                dom = ""
                while text not in dom and time.monotonic() < deadline:
                    await asyncio.sleep(1)
                    dom = (await call("Runtime.evaluate", expression="document.documentElement"
                                      ".outerHTML", returnByValue=True))["result"].get("value", "")
                await asyncio.sleep(1)  # the table's last paint
                shot = await call("Page.captureScreenshot", format="png")
                png.write_bytes(base64.b64decode(shot["data"]))
                return dom

    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu",
             "--disable-background-networking", "--disable-component-update", "--no-first-run",
             f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            active = Path(profile) / "DevToolsActivePort"
            deadline = time.monotonic() + 60
            while not active.exists() or not active.read_text().strip():
                assert time.monotonic() < deadline and proc.poll() is None, "chromium did not start"
                time.sleep(0.2)
            return asyncio.run(drive(int(active.read_text().split()[0])))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)


def s3_client_env(tmp: Path, **extra: str) -> dict[str, str]:
    """A client's environment with no S3 keys but those given: none from the caller's
    environment or ~/.aws, and no lookup of EC2's metadata address, which would leave loopback."""
    from tests.conftest import env_with

    env = {k: v for k, v in env_with().items() if not k.startswith("AWS_")}
    return env | {"AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": str(tmp / "no-aws"),
                  "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "no-aws")} | extra


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A real S3 server (SeaweedFS, `make s3`'s) for the test session, on loopback, with two
    buckets: `team-dvc` for DVC remotes and `team-mlflow` for MLflow's artifacts."""
    from reprotrain.team.s3 import start, stop

    server = start(tmp_path_factory.mktemp("s3"), 0, ("team-dvc", "team-mlflow"))
    try:
        yield server
    finally:
        stop(server)
