"""Process supervision for the commands that run a server (`make ui`, `make server`, `make
serve`, the serving bench): a server in its own process group with its log in a private folder,
ready once its health URL answers, stopped with everything it started whatever ends the command.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from reprotrain.redact import masked
from stages.lib.cli import STOPS, stop_on_signals
from stages.lib.errors import UserError
from stages.lib.images import die_with_parent


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server and its workers, SIGKILL to what is left after 5 s."""
    for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(server.pid, sig)
            server.wait(timeout=wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def private_folder(name: str) -> Path:
    """A new 0700 folder for a command's log (and its config): a fixed name in /tmp could be a
    symlink another user planted, and writing to it would overwrite what it points at."""
    return Path(tempfile.mkdtemp(prefix=f"reprotrain-{name}-"))


def last_lines(log: Path, n: int = 3) -> str:
    tail = log.read_text(errors="replace").strip().splitlines()[-n:]
    return " / ".join(tail) or "no output"


def _server_child(parent: int) -> None:
    """In the server, before exec: the stops this command held across the fork, back to their
    default (one pending kills it now, as it would have), then SIGTERM when this command dies:
    its death leaves it no chance to stop the server (which then forwards the signal to its
    workers)."""
    for sig in STOPS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)
    die_with_parent(parent, signal.SIGTERM)


def _parent_is_make() -> bool:
    try:
        return Path(f"/proc/{os.getppid()}/comm").read_text().strip() in ("make", "gmake")
    except OSError:  # not Linux: no PR_SET_PDEATHSIG either
        return False


@contextmanager
def started(name: str, cmd: list[str], env: dict[str, str], log: Path, health: str,
            timeout: int, hint: str) -> Iterator[subprocess.Popen]:
    """`cmd` in its own process group with its output in `log` (a new file in a folder of
    `private_folder`'s); yields once `health` answers. Ctrl-C, SIGTERM, a closed terminal, an
    error or this process's death end the whole group; `hint` says what to do when it never
    answers. The first three are a clean stop: exit 0, and the log's folder removed (a server
    that failed or died keeps it: the message names the log, which says why)."""
    if _parent_is_make():
        # `kill -9` of make leaves this process nobody's, and the server with it, holding the
        # port. Another parent (a shell under nohup, systemd, pytest) may end while it serves.
        die_with_parent(os.getppid(), signal.SIGTERM)
    parent = os.getpid()
    # `kill` or a closed terminal: still end the server's group, which has its own session.
    # Before it starts: one that comes meanwhile is a clean stop too (the server, if it was
    # just forked, gets SIGTERM from the kernel as this process ends: die_with_parent).
    stop_on_signals()
    server, ready, asked = None, False, False
    try:
        # Held across the fork: a stop that came during it ran its KeyboardInterrupt in Python's
        # at-fork hooks, which print and drop it, and the command served on, deaf to the next.
        signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
        try:
            with open(log, "x") as out:
                server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True,
                                          preexec_fn=lambda: _server_child(parent))
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)  # a held stop lands here
        deadline = time.monotonic() + timeout
        while not answers(health):
            if server.poll() is not None or time.monotonic() > deadline:
                # The log's last lines may name the store, its password too.
                raise UserError(masked(f"the {name} did not start ({last_lines(log)}); {hint}"))
            time.sleep(0.1)
        ready = True
        yield server
    except KeyboardInterrupt:
        asked = True
        with suppress(OSError):  # stderr may be a terminal that is gone (SIGHUP)
            print(f"stopping the {name}", file=sys.stderr)
    finally:
        if server is not None:
            stop(server)
    if asked:  # nothing went wrong: its log would only pile up in $TMPDIR
        shutil.rmtree(log.parent, ignore_errors=True)
        if not ready:  # stopped while it started: returning without a yield is a RuntimeError
            sys.exit(0)
