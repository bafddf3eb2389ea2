"""`make ui`: the MLflow UI of this repo's runs, on loopback, announced once it answers.

    python -m reprotrain.team.ui [--port 5000]

`mlflow ui` alone prints its address about 18 s before it listens, that address opens the
GenAI home page, and on Ctrl-C its workers linger for seconds. Here the server runs in its own
process group with its log in a file; the last line printed is the runs table's address, once
the server answers; Ctrl-C ends the whole group. With a tracking server (MLFLOW_TRACKING_URI=http...)
it starts nothing: it prints that server's runs table (reprotrain/processes.py supervises).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future

from reprotrain import tracking
from reprotrain.processes import private_folder, started
from reprotrain.redact import masked
from reprotrain.tracking import stores
from stages.config import load_params
from stages.lib.cli import ArgumentParser, positive_int, run_stage


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m reprotrain.team.ui", description="The MLflow UI of this repo's runs.")
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
    # MLflow's job runner (GenAI scorers, trace archival): seven more processes, twice the CPU
    # of a start (10 s more here), that the runs table never uses; set it to true to keep it.
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    cmd = [sys.executable, "-m", "mlflow", "ui", "--host", "127.0.0.1", "--port", str(args.port),
           "--allowed-hosts", hosts, "--workers", "1"]
    # No address yet: one printed before the server answers is one a user opens too early.
    print(f"starting the MLflow UI on port {args.port} (7-60 s; its log: {log})", flush=True)
    # The runs table's address (MLflow imported, the store read) while the server starts, so
    # that both addresses come together once it answers. A store that does not exist yet has no
    # experiment, and reading it would create it beside the starting server.
    new = (store := stores.sqlite_file(uri)) is not None and not store.exists()
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
