"""`make serve`: the registry's champion over HTTP on loopback, images in, labels out.

    python -m stages.serve [--port 5001] [--name NAME]
    python -m stages.serve --save DIR          # the served model as a folder, and exit
    python -m stages.serve --dockerfile DIR    # `mlflow models generate-dockerfile` of it

The champion (alias `champion` of registered model `export.register_as`, in the store of
`make ui`: mlflow.db or MLFLOW_TRACKING_URI) is served by `mlflow models serve --env-manager
local`, which answers `/ping` and `/invocations` with {"inputs": [<base64 image>, ...]}. Only
its model.onnx and model.json come from the registry, never code (stages/serving.py).
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from stages.cli import ArgumentParser, UserError, positive_int, run_stage
from stages.serving import champion_files, registered_name, save_served

SAMPLE = Path(__file__).resolve().parents[1] / "data/samples/7.png"


def curl_line(base: str) -> str:
    """A request that works as printed in bash: one of the sample images, base64 on the fly."""
    sample = SAMPLE.relative_to(Path.cwd()) if SAMPLE.is_relative_to(Path.cwd()) else SAMPLE
    return (f"curl -s {base}/invocations -H 'Content-Type: application/json' -d "
            f"\"{{\\\"inputs\\\": [\\\"$(base64 -w0 {shlex.quote(str(sample))})\\\"]}}\"")


def server_env() -> dict[str, str]:
    """`mlflow models serve` starts `uvicorn` from the PATH: this environment's."""
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")


def serve_command(folder: Path, port: int) -> list[str]:
    # --env-manager local: this environment, the one requirements.lock installed.
    return [sys.executable, "-m", "mlflow", "models", "serve", "-m", str(folder), "--host",
            "127.0.0.1", "--port", str(port), "--env-manager", "local"]


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m stages.serve", description="Serve the champion model.")
    ap.add_argument("--port", type=positive_int, default=5001, help="port on 127.0.0.1")
    ap.add_argument("--name", help="registered model (default: export.register_as)")
    ap.add_argument("--alias", default="champion", help="the version to serve (default champion)")
    ap.add_argument("--timeout", type=positive_int, default=120,
                    help="seconds to wait for the server to answer")
    ap.add_argument("--save", type=Path, metavar="DIR", help="save the served model to DIR, exit")
    ap.add_argument("--dockerfile", type=Path, metavar="DIR",
                    help="write a Docker build context for the served model to DIR, exit")
    args = ap.parse_args(argv)
    name = args.name or registered_name()
    work = Path(tempfile.mkdtemp(prefix="reprotrain-serve-"))
    try:
        serve(name, work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def port_free(port: int) -> bool:
    """Nothing listens on it: else /ping could be answered by another server."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def serve(name: str, work: Path, args) -> None:
    from stages.predict import onnx_runner, read_spec
    from stages.ui import started

    number, files = champion_files(name, work / "registry", args.alias)
    # Checked here, as predict checks them, so that a bad file is one line, not a dead server.
    onnx_runner(files / "model.onnx", read_spec(files / "model.json"), 1)
    what = f"{name} version {number} ({args.alias})"
    if args.save:
        save_served(files, args.save)
        print(f"saved {what} to {args.save}")
        return
    folder = save_served(files, work / "model")
    if args.dockerfile:
        subprocess.run([sys.executable, "-m", "mlflow", "models", "generate-dockerfile", "-m",
                        str(folder), "-d", str(args.dockerfile), "--env-manager", "local"],
                       check=True, env=server_env())
        print(f"wrote {args.dockerfile}/Dockerfile for {what}; build and run it: docker build -t "
              f"{name} {args.dockerfile} && docker run -p 5001:8080 {name}")
        return
    if not port_free(args.port):
        raise UserError(f"port {args.port} on 127.0.0.1 is taken; `make serve PORT={args.port + 1}`")
    base = f"http://127.0.0.1:{args.port}"
    log = Path(tempfile.gettempdir()) / f"reprotrain-serve-{args.port}.log"
    print(f"serving {what} on {base} (its log: {log})", flush=True)
    with started("model server", serve_command(folder, args.port), server_env(), log,
                 f"{base}/ping", args.timeout, f"its log: {log}") as server:
        print("ready (Ctrl-C stops it). Classify an image:")
        print(curl_line(base), flush=True)
        server.wait()

if __name__ == "__main__":
    run_stage(main)
