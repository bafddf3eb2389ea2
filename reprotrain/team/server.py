"""`make server`: the team's MLflow tracking server, with logins, on a database, proxying artifacts.

    MLFLOW_TRACKING_USERNAME=admin MLFLOW_TRACKING_PASSWORD=... MLFLOW_FLASK_SERVER_SECRET_KEY=... \
    python -m reprotrain.team.server --db postgresql://mlflow@db-host/mlflow --artifacts /srv/mlartifacts \
        --port 5000 [--host 127.0.0.1] [--allowed-hosts mlflow.example.com]

Every input is checked first, each in one line. `mlflow db upgrade` brings the database to this
MLflow's schema (a schema it does not know, from a newer MLflow, is refused), then `mlflow server`
runs with MLflow's basic-auth app: every request needs a login. Its users and permissions live in
the same database, beside the runs (their own tables, their own migration history). The first
start creates the admin from MLFLOW_TRACKING_USERNAME/PASSWORD: the same two variables a client
sets, and there is no default password. Clients need no storage credentials: the server writes
the artifacts (`--artifacts-destination`). The server's log goes to a file; the address clients
use is printed once /health answers; Ctrl-C or SIGTERM stops the server and its workers.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

from reprotrain.processes import last_lines, private_folder, started
from reprotrain.redact import holds_password, masked, masked_uri
from reprotrain.tracking import reason
from stages.config import load_params
from stages.lib.cli import ArgumentParser, positive_int, run_stage
from stages.lib.errors import UserError

# Logged-in users may browse every experiment and log only where they created the experiment or
# were granted EDIT: a team shares its results, and a colleague's typo does not overwrite them.
# Without a login nothing is readable (basic-auth asks every request for one).
DEFAULT_PERMISSION = "READ"
DATABASES = ("postgresql", "mysql", "mssql", "sqlite")
MIN_PASSWORD = 12  # MLflow's own rule for basic-auth passwords
AUTH_CACHE_S = 30  # how long a worker trusts a login it checked (auth_config says why)
MIN_SECRET = 32  # the Flask session/CSRF key: 32 characters, as `secrets.token_hex(16)` gives
LEGACY_PASSWORD = "password1234"  # older MLflow's shipped admin password, refused by MLflow 3


def check_inputs(db: str, artifacts: str, host: str, allowed_hosts: str) -> tuple[str, str]:
    """The artifacts destination (a local folder made absolute) and the admin's name; every
    problem ends here, one line each, before anything starts."""
    env = os.environ
    user, password = env.get("MLFLOW_TRACKING_USERNAME", ""), env.get("MLFLOW_TRACKING_PASSWORD", "")
    mistakes = []
    if not db:
        mistakes.append("no database: `make server DB=postgresql://USER@HOST/DB ...` (docs/server.md: "
                        "quick start); the password goes in PGPASSWORD or ~/.pgpass")
    elif holds_password(db):
        # The URI is on the command line of this process, `mlflow db upgrade` and the server for
        # as long as it runs: `ps` shows it to every user of the machine.
        mistakes.append(f"DB={masked_uri(db)} holds a password, which `ps` shows to every user: take "
                        "it out of DB and put it in ~/.pgpass (0600) or PGPASSWORD")
    elif urlsplit(db).scheme.split("+")[0] not in DATABASES:
        mistakes.append(f"DB={masked_uri(db)} is not a database URI; use postgresql://USER@HOST/DB "
                        f"(or another of {', '.join(DATABASES)})")
    if not artifacts:
        mistakes.append("no artifacts destination: `make server ARTIFACTS=/srv/mlartifacts` (a "
                        "folder on the server) or ARTIFACTS=s3://bucket/path")
    if not user or not password:
        mistakes.append("MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD must be set: the "
                        "first start creates that admin (there is no default password)")
    elif password == LEGACY_PASSWORD:
        mistakes.append("MLFLOW_TRACKING_PASSWORD is the default password of older MLflow "
                        "versions, which everyone knows and MLflow refuses: choose another")
    elif len(password) < MIN_PASSWORD:
        mistakes.append(f"MLFLOW_TRACKING_PASSWORD is too short: MLflow wants at least "
                        f"{MIN_PASSWORD} characters")
    if len(env.get("MLFLOW_FLASK_SERVER_SECRET_KEY", "")) < MIN_SECRET:
        mistakes.append(f"MLFLOW_FLASK_SERVER_SECRET_KEY must be set to at least {MIN_SECRET} "
                        "random characters, the same on every server process: export "
                        "MLFLOW_FLASK_SERVER_SECRET_KEY=$(python3 -c 'import secrets; "
                        "print(secrets.token_hex(32))')")
    if host not in ("127.0.0.1", "localhost", "::1") and not allowed_hosts:
        mistakes.append(f"HOST={host} needs ALLOWED_HOSTS: the names clients reach the server by "
                        "(e.g. ALLOWED_HOSTS=mlflow.example.com); other Host headers are refused")
    if mistakes:  # run_stage prefixes the first line with "error: "
        raise UserError("\nerror: ".join(mistakes))
    if urlsplit(artifacts).scheme in ("", "file"):
        folder = Path(artifacts.removeprefix("file://")).expanduser().resolve()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"ARTIFACTS={artifacts}: cannot create the folder ({e.strerror})") from e
        artifacts = str(folder)
    return artifacts, user


def check_bucket(artifacts: str) -> None:
    """An s3:// destination answers with the server's keys before the server is reported ready:
    otherwise every upload fails later, one client at a time, each with its own warning."""
    parts = urlsplit(artifacts)
    if parts.scheme != "s3":
        return
    import boto3
    import botocore.exceptions as boto
    from botocore.config import Config

    bucket, where = parts.netloc, os.environ.get("MLFLOW_S3_ENDPOINT_URL") or "AWS S3"
    keys = ("set the server's AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a profile, or the "
            "machine's role) to keys that may write there")
    try:
        boto3.client("s3", endpoint_url=os.environ.get("MLFLOW_S3_ENDPOINT_URL") or None,
                     config=Config(retries={"max_attempts": 2}, connect_timeout=5,
                                   read_timeout=20)).head_bucket(Bucket=bucket)
    except boto.ClientError as e:
        code = str(e.response.get("Error", {}).get("Code"))
        if code in ("404", "NoSuchBucket"):
            raise UserError(f"ARTIFACTS={artifacts}: the bucket {bucket!r} does not exist on "
                            f"{where}: create it (`aws s3 mb s3://{bucket}`, or ask whoever runs "
                            "the S3 server) or fix ARTIFACTS (and MLFLOW_S3_ENDPOINT_URL)") from None
        if code in ("403", "401", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            raise UserError(f"ARTIFACTS={artifacts}: {where} refused the server's keys for the "
                            f"bucket {bucket!r} ({code}): {keys}") from None
        raise UserError(f"ARTIFACTS={artifacts}: {where} answered {code} for the bucket "
                        f"{bucket!r}: check the bucket and MLFLOW_S3_ENDPOINT_URL") from None
    except boto.NoCredentialsError:
        raise UserError(f"ARTIFACTS={artifacts}: the server has no keys for {where}: {keys}") from None
    except boto.SSLError:
        raise UserError(f"ARTIFACTS={artifacts}: the certificate of {where} is not trusted: give "
                        "the server its CA's certificate with AWS_CA_BUNDLE=/path/ca.pem") from None
    except (boto.ConnectionError, boto.HTTPClientError) as e:
        raise UserError(f"ARTIFACTS={artifacts}: cannot reach {where} ({type(e).__name__}): is "
                        "the S3 server up, and MLFLOW_S3_ENDPOINT_URL its address?") from None


def check_port(host: str, port: int) -> None:
    """Another server on the port would answer /health in this one's place."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        # os.strerror: asyncio-style errors append "(while attempting to bind ...)" to strerror.
        raise UserError(f"cannot listen on {host}:{port} ({os.strerror(e.errno)}): is another server "
                        f"there? choose another PORT") from e


def schema_current(db: str) -> bool:
    """Whether the database already has this MLflow's schema (every start after the first):
    `mlflow db upgrade` would then cost a process that imports MLflow (about 4 s) to do nothing.
    Anything but a clear yes (no tables yet, an unreachable database) is left to it."""
    # Private to MLflow (no public way to read a database's schema revision short of `mlflow db
    # upgrade`); tests/test_private_names.py pins both.
    from mlflow.store.db.utils import _get_latest_schema_revision, _get_schema_version
    from sqlalchemy import create_engine

    try:
        # A host that accepts and never answers: the upgrade's own wait, not a second one.
        engine = create_engine(db, connect_args={"connect_timeout": 10}
                               if db.startswith("postgresql") else {})
        try:
            return _get_schema_version(engine) == _get_latest_schema_revision()
        finally:
            engine.dispose()
    except Exception:  # noqa: BLE001 - `mlflow db upgrade` says why, in upgrade's words
        return False


def upgrade(db: str) -> None:
    """`mlflow db upgrade`: a new database gets the tables, an older one this MLflow's schema."""
    if schema_current(db):
        return
    print(f"mlflow db upgrade {masked_uri(db)}", flush=True)
    p = subprocess.run([sys.executable, "-m", "mlflow", "db", "upgrade", db], capture_output=True,
                       text=True)
    if p.returncode == 0:
        return
    out = masked(p.stderr + p.stdout)
    unknown = re.search(r"Can't locate revision identified by '(\w+)'", out)
    if unknown:
        import mlflow

        raise UserError(f"DB={masked_uri(db)} has schema revision {unknown[1]}, which MLflow "
                        f"{mlflow.__version__} does not know: a newer MLflow migrated it. Run the "
                        "server with that MLflow, or point DB at another database")
    last = [line.strip() for line in out.splitlines() if line.strip()
            and not line.startswith((" ", "\t", "(Background", "Traceback"))]
    raise UserError(f"`mlflow db upgrade` failed on DB={masked_uri(db)}: "
                    f"{last[-1] if last else 'no output'}")


def auth_config(folder: Path, db: str, admin: str) -> Path:
    """basic-auth's ini: its tables in the same database (own alembic_version_auth table), one
    database to back up. In the command's private folder, deleted on exit. Neither the
    database's password (never in DB) nor the admin's (the server gets it as
    MLFLOW_AUTH_ADMIN_PASSWORD) is in it.

    `auth_cache_ttl_seconds`: MLflow's cache of logins it has checked. Without it every request
    checks the password's hash again, by design slow (0.1-0.2 s on 2 cores), and a stage's dozen
    requests paid seconds for it. A password change or a deleted user takes effect at once in the
    worker that made it, and within AUTH_CACHE_S in the others; a wrong password is never cached."""
    ini = folder / "basic-auth.ini"
    with os.fdopen(os.open(ini, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(f"[mlflow]\ndefault_permission = {DEFAULT_PERMISSION}\n"
                f"database_uri = {db.replace('%', '%%')}\nadmin_username = {admin}\n"
                "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                f"auth_cache_ttl_seconds = {AUTH_CACHE_S}\n")
    return ini


def apply_admin_password(db: str, admin: str, password: str) -> bool:
    """Whether the admin, already in the database, had another password and now has this one.
    MLflow creates the admin on the first start only; a later start with a new
    MLFLOW_TRACKING_PASSWORD would leave the old one working, which is not what the person who
    changed it means."""
    import warnings

    with warnings.catch_warnings():  # Starlette's, about MLflow's code: not the user's to fix
        warnings.filterwarnings("ignore", "starlette.middleware.wsgi is deprecated")
        from mlflow.server.auth.sqlalchemy_store import SqlAlchemyStore

    store = SqlAlchemyStore()
    try:
        store.init_db(db)  # basic-auth's own tables and migrations, as the server would make them
    except Exception as e:  # noqa: BLE001 - the database refused: one line, the URI masked
        raise UserError(f"cannot open basic-auth's tables in DB={masked_uri(db)}: {reason(e)}") from None
    try:
        if not store.has_user(admin, use_primary=True) or store.authenticate_user(
                admin, password, use_primary=True):
            return False
        store.update_user(admin, password=password)
        return True
    finally:
        store.engine.dispose()


def claim_names(url: str, experiment: str, model: str) -> str:
    """The experiment and registered model every clone logs to and `make serve` serves from,
    created by the admin before anyone else can: whoever creates one owns it (MANAGE), so a
    member who came first would own the champion. Members log there once granted EDIT.
    Returns the experiment's id."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from reprotrain.tracking import EXPERIMENT_TAGS
    client = mlflow.MlflowClient(url)
    try:
        exp = client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else client.create_experiment(experiment,
                                                                        tags=EXPERIMENT_TAGS)
        try:
            client.get_registered_model(model)
        except MlflowException:
            client.create_registered_model(model)
    except MlflowException as e:
        raise UserError(f"cannot create experiment {experiment!r} and registered model {model!r} "
                        f"as the admin: {reason(e)}") from None
    if exp is not None and exp.lifecycle_stage == "deleted":
        print(f"warning: experiment {experiment!r} (id {exp_id}) is deleted: no run can be "
              f"logged until it is restored: MLFLOW_TRACKING_URI={url} mlflow experiments "
              f"restore --experiment-id {exp_id}", file=sys.stderr, flush=True)
    return exp_id


def other_managers(db: str, admin: str, experiment: str, exp_id: str, model: str) -> list[str]:
    """Who besides the admin may manage the names (delete them, grant and revoke): a member
    who created one while it did not exist (before this server claimed it, or after the admin
    deleted it). One line each, naming the way back."""
    from mlflow.server.auth.sqlalchemy_store import SqlAlchemyStore

    store = SqlAlchemyStore()
    store.init_db(db)
    found = []
    try:
        for user in store.list_users():
            if user.username == admin or user.is_admin:
                continue
            if any(p.experiment_id == exp_id and p.permission == "MANAGE"
                   for p in store.list_experiment_permissions(user.username)):
                found.append(f"user {user.username!r} can manage experiment {experiment!r} "
                             "(created it): delete or demote that permission (docs/server.md, Logins, "
                             "permissions)")
            if any(p.name == model and p.permission == "MANAGE"
                   for p in store.list_registered_model_permissions(user.username)):
                found.append(f"user {user.username!r} can manage registered model {model!r} "
                             "and so the champion `make serve` serves (created it): delete or "
                             "demote that permission (docs/server.md, Logins, permissions)")
    finally:
        store.engine.dispose()
    return found


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m reprotrain.team.server", description="The team's MLflow server.")
    ap.add_argument("--db", default="", help="database URI, e.g. postgresql://mlflow@db-host/mlflow")
    ap.add_argument("--artifacts", default="", help="a folder, or an object store URI (s3://...)")
    ap.add_argument("--port", default="", help="port to listen on")
    ap.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback)")
    ap.add_argument("--allowed-hosts", default="",
                    help="comma-separated Host headers clients use, beside 127.0.0.1 and localhost")
    ap.add_argument("--workers", type=positive_int, default=4)
    ap.add_argument("--timeout", type=positive_int, default=180,
                    help="seconds to wait for the server to answer")
    args = ap.parse_args(argv)
    artifacts, admin = check_inputs(args.db, args.artifacts, args.host, args.allowed_hosts)
    names = load_params()  # the experiment and registered model to claim for the admin
    if not args.port.isdigit() or not 0 < int(args.port) < 65536:
        raise UserError(f"PORT={args.port!r} is not a port: `make server PORT=5000 ...`")
    args.port = int(args.port)
    check_bucket(artifacts)
    check_port(args.host, args.port)
    upgrade(args.db)
    if apply_admin_password(args.db, admin, os.environ["MLFLOW_TRACKING_PASSWORD"]):
        print(f"the admin {admin!r} had another password: it is now MLFLOW_TRACKING_PASSWORD's, "
              "and the old one no longer logs in", flush=True)

    # Host headers: loopback for clients on this machine (and the health check), then the names
    # given; anything else (DNS rebinding) is refused.
    hosts = ",".join([f"127.0.0.1:{args.port}", f"localhost:{args.port}",
                      *filter(None, args.allowed_hosts.split(","))])
    shown = args.host if args.host not in ("0.0.0.0", "::") else args.allowed_hosts.split(",")[0]
    url = f"http://{shown}:{args.port}"
    folder = private_folder("server")
    ini, log = auth_config(folder, args.db, admin), folder / "server.log"
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI",)}
    env.update(MLFLOW_AUTH_CONFIG_PATH=str(ini), MLFLOW_AUTH_ADMIN_USERNAME=admin,
               MLFLOW_AUTH_ADMIN_PASSWORD=os.environ["MLFLOW_TRACKING_PASSWORD"],
               PYTHONWARNINGS="ignore::DeprecationWarning")
    # MLflow's job runner (GenAI scorers, trace archival) is seven more processes that training
    # runs never use; MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true in the environment keeps it.
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    # A client's upload waits while the server retries S3: with botocore's default (legacy, 5
    # tries) a stage took 7-9 s longer to get the 5xx that lets it spool, the endpoint down. One
    # retry after at most a second; the admin's own AWS_RETRY_MODE/AWS_MAX_ATTEMPTS win.
    if "AWS_RETRY_MODE" not in env and "AWS_MAX_ATTEMPTS" not in env:
        env.update(AWS_RETRY_MODE="standard", AWS_MAX_ATTEMPTS="2")
    cmd = [sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth",
           "--backend-store-uri", args.db, "--artifacts-destination", artifacts, "--serve-artifacts",
           "--host", args.host, "--port", str(args.port), "--allowed-hosts", hosts,
           "--workers", str(args.workers)]
    print(f"starting the MLflow server on {args.host}:{args.port} (its log: {log})", flush=True)
    try:
        with started("MLflow server", cmd, env, log, f"http://127.0.0.1:{args.port}/health",
                     args.timeout, f"its log: {log}") as server:
            experiment, model = names.mlflow.experiment, names.export.register_as
            exp_id = claim_names(f"http://127.0.0.1:{args.port}", experiment, model)
            others = other_managers(args.db, admin, experiment, exp_id, model)
            for line in others:
                print(f"warning: {line}", file=sys.stderr, flush=True)
            print(f"MLflow server ready on {url} (Ctrl-C stops it); runs in {masked_uri(args.db)}, "
                  f"artifacts in {artifacts}. Each client, before make repro / dvc exp run:\n"
                  f"  export MLFLOW_TRACKING_URI={url} MLFLOW_TRACKING_USERNAME=<user>\n"
                  "  export MLFLOW_TRACKING_PASSWORD=<password>   # e.g. read -rs "
                  "MLFLOW_TRACKING_PASSWORD; export MLFLOW_TRACKING_PASSWORD\n"
                  f"Users and permissions: docs/server.md, Logins, permissions ({admin} is the "
                  f"admin; experiment {experiment!r} and registered model {model!r} are the "
                  f"admin's{', and a member can manage them (above)' if others else ''}: grant "
                  "members EDIT)", flush=True)
            code = server.wait()
            # Only a server that ended on its own gets here: Ctrl-C and SIGTERM end this process.
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            raise UserError(f"the MLflow server stopped by itself ({how}: {last_lines(log)}); "
                            f"its log: {log}")
    except UserError as e:  # the log's last lines may hold the database URI
        raise UserError(masked(str(e))) from None
    finally:
        ini.unlink(missing_ok=True)


if __name__ == "__main__":
    run_stage(main)
