"""Where runs go besides the configured store: the tracking server's address, and the spool a
stage logs to while the server does not answer (an embedded store of its own, not a DVC output,
git-ignored), which `make sync` replays. Shared by tracking, which spools, and sync, which
replays; imports no MLflow.
"""

from __future__ import annotations

import re
from pathlib import Path

from stages.config import repo_root

SPOOL = ".mlflow-spool"
SERVER_RUN = "reprotrain.server_run_id"  # a spooled run continues this run of the server
SYNCED = "reprotrain.synced"  # a spooled run already sent whole (to <server>@<end time>)
PROBE_S = 2.0


def spool_file() -> Path:
    return repo_root() / SPOOL / "mlflow.db"


def spool_uri() -> str:
    return f"sqlite:///{spool_file()}?timeout=60"


def is_server(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def plain_uri(uri: str) -> str:
    """A store's URI without the user and password it may carry."""
    return re.sub(r"//[^/@]*@", "//", uri)


def reachable(uri: str) -> bool:
    """Whether the server answers at all (any HTTP status: a refusal is not an outage), within
    PROBE_S: one quick look before minutes of MLflow's own retries."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(plain_uri(uri).rstrip("/") + "/health", timeout=PROBE_S):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


def spool_synced(since: float) -> None:
    """Everything spooled before `since` is on the server: stages stop looking at the spool."""
    marker = spool_file().parent / "unsynced"
    try:
        if marker.stat().st_mtime < since:
            marker.unlink()
    except FileNotFoundError:
        pass
