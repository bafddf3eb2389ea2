"""`make ui`: the MLflow UI of this repo's runs, on loopback, announced once it answers.

    python -m stages.ui [--port 5000]

`mlflow ui` alone prints its address about 18 s before it listens, that address opens the
GenAI home page, and on Ctrl-C its workers linger for seconds. Here the server runs in its own
process group with its log in a file; the last line printed is the runs table's address, once
the server answers; Ctrl-C ends the whole group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from stages import tracking
from stages.cli import ArgumentParser, UserError, positive_int, run_stage
from stages.config import load_params


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


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m stages.ui", description="The MLflow UI of this repo's runs.")
    ap.add_argument("--port", type=positive_int, default=5000, help="port on 127.0.0.1")
    ap.add_argument("--timeout", type=positive_int, default=180,
                    help="seconds to wait for the server to answer")
    args = ap.parse_args(argv)
    cfg = load_params().mlflow
    uri = tracking.tracking_uri(cfg)
    if uri.startswith(("http://", "https://")):
        print(f"runs are on the tracking server: open {tracking.experiment_url(cfg, uri)}")
        return
    base, hosts = f"http://127.0.0.1:{args.port}", f"127.0.0.1:{args.port},localhost:{args.port}"
    log = Path(tempfile.gettempdir()) / f"reprotrain-ui-{args.port}.log"
    env = dict(os.environ, PYTHONWARNINGS="ignore::DeprecationWarning")  # Starlette's, not ours
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host",
             "127.0.0.1", "--port", str(args.port), "--allowed-hosts", hosts, "--workers", "1"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    # `kill` or a closed terminal: still end the server's group, which has its own session.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(128 + signal.SIGHUP))
    try:
        deadline = time.monotonic() + args.timeout
        print(f"starting the MLflow UI on {base} (its log: {log})", flush=True)
        while not answers(f"{base}/health"):
            if server.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace").strip().splitlines()[-3:]
                raise UserError(f"the MLflow UI did not start on port {args.port} "
                                f"({' / '.join(tail) or 'no output'}); if the port is taken, "
                                f"`make ui UI_PORT={args.port + 1}`")
            time.sleep(0.5)
        # The UI's own home page and run links without workflowType open in GenAI mode; this
        # address is the classic runs table, which MLflow keeps while you click within it.
        print("MLflow UI ready (Ctrl-C stops it). Its home page opens in GenAI mode; the "
              "training runs are at:")
        print(tracking.experiment_url(cfg, base), flush=True)
        server.wait()
    except KeyboardInterrupt:
        print("stopping the MLflow UI", file=sys.stderr)
    finally:
        stop(server)


if __name__ == "__main__":
    run_stage(main)
