"""`make ui`: the MLflow UI of this repo's runs, on loopback, announced once it answers.

    python -m stages.team.ui [--port 5000]

`mlflow ui` alone prints its address about 18 s before it listens, that address opens the
GenAI home page, and on Ctrl-C its workers linger for seconds. Here the server runs in its own
process group with its log in a file; the last line printed is the runs table's address, once
the server answers; Ctrl-C ends the whole group. With a tracking server (MLFLOW_TRACKING_URI=http...)
it starts nothing: it prints that server's runs table. `started` also runs `make server`.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager, suppress
from pathlib import Path

from stages import tracking
from stages.config import load_params
from stages.lib.cli import ArgumentParser, positive_int, run_stage, stop_on_signals
from stages.lib.errors import UserError
from stages.lib.redact import masked


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


# Looked up here, not in the forked child: another thread (make ui's) may hold a lock the child
# would need to import or load anything.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def _die_with_parent(parent: int) -> None:
    """SIGTERM to this process when `parent` dies, even by SIGKILL. In the server, before exec:
    this command's death leaves it no chance to stop the server (which then forwards the signal
    to its workers); in this command under make: make's."""
    if _prctl is not None:
        _prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


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
        _die_with_parent(os.getppid())
    parent = os.getpid()
    # `kill` or a closed terminal: still end the server's group, which has its own session.
    # Before it starts: one that comes meanwhile is a clean stop too (the server, if it was
    # just forked, gets SIGTERM from the kernel as this process ends: _die_with_parent).
    stop_on_signals()
    server, ready, asked = None, False, False
    try:
        with open(log, "x") as out:
            server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True,
                                      preexec_fn=lambda: _die_with_parent(parent))
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


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m stages.team.ui", description="The MLflow UI of this repo's runs.")
    ap.add_argument("--port", type=positive_int, default=5000, help="port on 127.0.0.1")
    ap.add_argument("--timeout", type=positive_int, default=180,
                    help="seconds to wait for the server to answer")
    args = ap.parse_args(argv)
    cfg = load_params().mlflow
    uri = tracking.tracking_uri(cfg)
    if uri.startswith(("http://", "https://")):
        try:
            where = tracking.experiment_url(cfg, uri)
        except Exception as e:  # noqa: BLE001 - a refused login or a server that is down
            where = f"{uri} ({tracking.refusal(e) or tracking.reason(e)})"
        print(f"runs are on the tracking server: open {masked(where)}")
        return
    base, hosts = f"http://127.0.0.1:{args.port}", f"127.0.0.1:{args.port},localhost:{args.port}"
    log = private_folder("ui") / "ui.log"
    # The store in the environment, not on the command line: `ps` shows a database password
    # there to every user. (PYTHONWARNINGS: Starlette's, not ours.)
    env = dict(os.environ, PYTHONWARNINGS="ignore::DeprecationWarning", MLFLOW_BACKEND_STORE_URI=uri)
    cmd = [sys.executable, "-m", "mlflow", "ui", "--host", "127.0.0.1", "--port", str(args.port),
           "--allowed-hosts", hosts, "--workers", "1"]
    # No address yet: one printed before the server answers is one a user opens too early.
    print(f"starting the MLflow UI on port {args.port} (7-60 s; its log: {log})", flush=True)
    # The runs table's address (MLflow imported, the store read) while the server starts, so
    # that both addresses come together once it answers. A store that does not exist yet has no
    # experiment, and reading it would create it beside the starting server.
    store = uri.removeprefix("sqlite:///").split("?", 1)[0]  # the default has ?timeout=
    new = uri.startswith("sqlite:///") and not store.startswith("file:") and \
        not Path(store).exists()
    table = in_background(lambda: f"{base} (no experiment {cfg.experiment!r} yet: run `make "
                          "repro` first)" if new else tracking.experiment_url(cfg, base))
    with started("MLflow UI", cmd, env, log, f"{base}/health", args.timeout,
                 f"if port {args.port} is taken, `make ui UI_PORT={args.port + 1}`; its log: "
                 f"{log}") as server:
        # The UI's own home page and run links without workflowType open in GenAI mode; this
        # address is the classic runs table, which MLflow keeps while you click within it.
        print(f"MLflow UI ready on {base} (Ctrl-C stops it); its home page opens in GenAI "
              "mode, the training runs are at:")
        print(table.result(), flush=True)
        server.wait()


def in_background(work: Callable[[], str]) -> Future[str]:
    """`work` in a daemon thread: a UI that did not start exits at once, where a pool's thread
    kept it for MLflow's retries of an unreachable store (about 100 s)."""
    done: Future[str] = Future()

    def run() -> None:
        try:
            done.set_result(work())
        except BaseException as e:  # noqa: BLE001 - handed to whoever reads the result
            done.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return done


if __name__ == "__main__":
    run_stage(main)
