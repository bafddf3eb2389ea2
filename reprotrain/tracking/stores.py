"""Which store a run goes to: the configured one (`tracking_uri`), or the spool a stage logs to
while the server does not answer (an embedded store of its own, not a DVC output, git-ignored),
which `make sync` replays. Whether a server answers and whether a failure is its outage (then
FAILING), errors in one line, the lock under which a sqlite store is created. Shared by the
tracker and the spool, which log, and sync, which replays; imports no MLflow.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote, urlsplit

from stages.config import MlflowConfig
from stages.lib.paths import repo_root

# A server that does not answer, or answers 5xx, should cost seconds, not MLflow's default
# minutes of retries: one retry (a proxy's or a restarting server's blip), then the spool.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")

SPOOL = ".mlflow-spool"
SERVER_RUN = "reprotrain.server_run_id"  # a spooled run continues this run of the server
SYNCED = "reprotrain.synced"  # a spooled run already sent whole (to <server>@<end time>)
# On a spooled logged model: the server's model it is a copy of (logged there before the server
# failed at the registration); sync registers that one rather than uploading it again.
SERVER_MODEL = "reprotrain.server_model_id"
PROBE_S = 2.0
# Servers this process saw fail (5xx, a hang): every later run of the process goes straight to
# the spool, rather than waiting out MLflow's timeout and retries once more.
FAILING: set[str] = set()
# Why each of FAILING failed (outage_cause), for the one line that says a run is spooled.
FAILED_BECAUSE: dict[str, str] = {}
# MLflow's proxied artifact API: a 5xx or a hang there is the server's artifact store failing
# (an S3 endpoint down behind it, a full disk), which the server's /health does not show.
ARTIFACTS_API = "/mlflow-artifacts/"


def tracking_uri(cfg: MlflowConfig) -> str:
    # timeout: how long sqlite waits on a lock held by another process (queued experiments,
    # parallel stages) before "database is locked"; its default is 5 s.
    uri = (os.environ.get("MLFLOW_TRACKING_URI") or cfg.tracking_uri
           or f"sqlite:///{repo_root() / 'mlflow.db'}?timeout=60")
    parts = urlsplit(uri)
    if parts.scheme in ("http", "https") and parts.password is not None:
        # http://user:password@host would land in run.json and the runs' tags: MLflow takes the
        # same login from these two variables.
        os.environ.setdefault("MLFLOW_TRACKING_USERNAME", unquote(parts.username or ""))
        os.environ.setdefault("MLFLOW_TRACKING_PASSWORD", unquote(parts.password))
        uri = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
    return uri


def sqlite_file(uri: str) -> Path | None:
    """The file of a `sqlite:///` store, also in sqlite's URI form (`sqlite:///file:PATH?mode=ro&uri=true`,
    which a lock beside `file:PATH` once turned into a folder named `file:`); None for others."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri.removeprefix("sqlite:///").split("?")[0]
    return Path(urlsplit(path).path if path.startswith("file:") else path)


@contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """One process at a time creates a sqlite store (its migrations) and the experiment."""
    if (db := sqlite_file(uri)) is None:
        yield
        return
    from filelock import FileLock

    db.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(db.with_name(db.name + ".lock")):  # flock, waiting as long as it takes
        yield


def spool_file() -> Path:
    return repo_root() / SPOOL / "mlflow.db"


def spool_uri() -> str:
    return f"sqlite:///{spool_file()}?timeout=60"


def is_server(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def reachable(uri: str) -> bool:
    """Whether the server answers, within PROBE_S: one quick look before MLflow's own retries.
    A refusal (401, 403) is an answer; a 5xx is not (a reverse proxy whose MLflow is gone
    answers 502, a server without its database 503)."""
    import urllib.error
    import urllib.request

    parts = urlsplit(uri)  # a login left in it is no part of the address urllib opens
    health = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl().rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(health, timeout=PROBE_S):
            return True
    except urllib.error.HTTPError as e:
        return e.code < 500
    except (OSError, ValueError):
        return False


def outage(e: BaseException) -> bool:
    """Whether a failed call is the server's failing rather than a refusal of the request (a
    login, a permission, a bad value): down, hanging past MLFLOW_HTTP_REQUEST_TIMEOUT, 5xx after
    MLflow's retries (its database stopped, a proxy whose MLflow is gone). What was to be logged
    then goes to the spool."""
    status = getattr(getattr(e, "response", None), "status_code", None)  # requests' HTTPError
    if status is None and hasattr(e, "get_http_status_code"):  # an MlflowException
        status = e.get_http_status_code()
    return status is None or status >= 500


def outage_cause(e: BaseException | None) -> str:
    """What failed, in a few words for the user's one line ("" when nothing says more than
    "unreachable"): the connection, or the artifact store behind a server that answers."""
    if e is None:
        return ""
    text = str(e)
    how = re.search(r"\[Errno -?\d+\] [\w ]+|timed out|too many \d+ error responses", text)
    if ARTIFACTS_API in text:
        return ("its artifact store failed" + (f", {how[0]}" if how else "") + ": the S3 "
                "endpoint or folder behind --artifacts-destination, which its admin should check")
    return how[0] if how else ""


def mark_failing(uri: str, e: BaseException | None) -> None:
    """`uri` failed this process (`e`, what it answered): later runs go straight to the spool."""
    FAILING.add(uri)
    if cause := outage_cause(e):
        FAILED_BECAUSE.setdefault(uri, cause)


def http_settings() -> str | None:
    """What is wrong with the user's MLFLOW_HTTP_REQUEST_TIMEOUT or _MAX_RETRIES (None:
    nothing): MLflow reads them at each call, and a bad one fails every call as if the server
    had (a timeout of 0: "cannot be set to a value less than or equal to 0"; `abc`: a
    traceback)."""
    for name, least in (("MLFLOW_HTTP_REQUEST_TIMEOUT", 1), ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", 0)):
        value = os.environ.get(name, "")
        try:
            if int(value) >= least:
                continue
        except ValueError:
            pass
        return (f"{name}={value!r} is not a whole number of at least {least}: set it so, or "
                "unset it (this project's defaults: a 10 s timeout, 1 retry)")
    return None


def spool_synced(since: float) -> None:
    """Everything spooled before `since` is on the server: stages stop looking at the spool."""
    marker = spool_file().parent / "unsynced"
    try:
        if marker.stat().st_mtime < since:
            marker.unlink()
    except FileNotFoundError:
        pass


def reason(e: Exception) -> str:
    """An exception in one line: SQLAlchemy's carry the SQL, its parameters and a link."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip() and not
             line.startswith(("[SQL", "[parameters", "(Background", "(raised as a result"))]
    return f"{type(e).__name__}: {' '.join(lines)[:300]}"


def refusal(e: Exception) -> str | None:
    """A server's refused login or permission in one line, with the fix; None for other errors."""
    code, user = getattr(e, "error_code", None), os.environ.get("MLFLOW_TRACKING_USERNAME")
    if code == "UNAUTHENTICATED":
        said = f"refused the login of {user!r}" if user else "needs a login"
        return (f"the server {said}: set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD "
                "to your user on it")
    if code == "PERMISSION_DENIED":
        return (f"user {user!r} may not write here: ask the server's admin for EDIT on the "
                "experiment and the registered model (docs/server.md: Logins, permissions)")
    return None
