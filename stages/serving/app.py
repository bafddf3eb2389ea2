"""`make serve`: the registry's champion over HTTP on loopback, images in, labels out.

    python -m stages.serving.app [--port 5001] [--name NAME]
    python -m stages.serving.app --save DIR          # the served model as a folder, and exit
    python -m stages.serving.app --dockerfile DIR    # `mlflow models generate-dockerfile` of it

The champion (alias `champion` of registered model `export.register_as`, in the store of
`make ui`: mlflow.db or MLFLOW_TRACKING_URI) is served by MLflow's scoring server, the app
`mlflow models serve --env-manager local` runs, which answers `/ping` and `/invocations` with
{"inputs": [<base64 image>, ...]}; here under uvicorn behind the bounds it lacks (`Bounded`).
Only its model.onnx and model.json come from the registry, never code (stages/serving/registry.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from stages.lib.cli import ArgumentParser, positive_int, run_stage
from stages.lib.errors import UserError
from stages.serving.registry import champion_files, registered_name, save_served
from stages.tracking.stores import plain_uri

SAMPLE = Path(__file__).resolve().parents[2] / "data/samples/7.png"
# The largest request body read: a larger one gets a 413 before the rest is read (MLflow's
# server reads any body whole: 200 MB cost 7 s before its 400). 1024 digits take 0.5 MB;
# photos are resized before they are sent (MAX_PIXELS in stages/serving/served_model.py).
MAX_BODY_BYTES = 8 * 2**20
# Python's JSON parser recurses once per `[` or `{` and fails near 1000 levels deep with a
# RecursionError, a 500 from MLflow's server; a request has 2. A body with fewer brackets than
# this is never parsed twice to find out.
FEW_BRACKETS = 100
# What logs in to the tracking server (MLflow reads each from the environment).
LOGIN = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
# The longest message an error reply of MLflow's server keeps: it repeats the request in its own
# messages ("Failed to predict data '<every image>'"), 7 MB for a 7 MB request.
MAX_ERROR_CHARS = 1000


def curl_line(base: str) -> str:
    """A request that works as printed in bash: one of the sample images, base64 on the fly."""
    sample = SAMPLE.relative_to(Path.cwd()) if SAMPLE.is_relative_to(Path.cwd()) else SAMPLE
    return (f"curl -s {base}/invocations -H 'Content-Type: application/json' -d "
            f"\"{{\\\"inputs\\\": [\\\"$(base64 -w0 {shlex.quote(str(sample))})\\\"]}}\"")


def server_env() -> dict[str, str]:
    """`mlflow models serve` starts `uvicorn` from the PATH: this environment's. Without the
    tracking server's login: the model server never reads the registry, and it decodes what
    anyone who reaches its port sends, so a hole in a decoder would not hand over the password."""
    env = {k: v for k, v in os.environ.items() if k not in LOGIN}
    if "MLFLOW_TRACKING_URI" in env:
        env["MLFLOW_TRACKING_URI"] = plain_uri(env["MLFLOW_TRACKING_URI"])
    return dict(env, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")


def serve_command(folder: Path, port: int) -> list[str]:
    """The server process: `run_server` over `folder`, in this environment (the one
    requirements.lock installed, as `mlflow models serve --env-manager local` would use)."""
    return [sys.executable, "-m", "stages.serving.app", "--serve-folder", str(folder), "--port",
            str(port)]


def too_deep(body: bytes) -> bool:
    """Whether parsing `body` as JSON ends in a RecursionError."""
    if body.count(b"[") + body.count(b"{") < FEW_BRACKETS:
        return False
    try:
        json.loads(body)
    except RecursionError:
        return True
    except ValueError:  # not JSON at all: MLflow's own 400 says so
        pass
    return False


def not_utf8_at(body: bytes) -> int | None:
    """The first byte that is not UTF-8, or None: MLflow's server answered such a body (a gzip
    file, Latin-1) with Python's repr of all of it, twice (8 MB in, 80 MB out)."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start
    return None


def cut_errors(send):
    """`send` with each error reply's message cut to MAX_ERROR_CHARS, its length set again."""
    start, parts = None, []

    async def cutting(message) -> None:
        nonlocal start
        if message["type"] == "http.response.start" and message["status"] >= 400:
            start = message
            return
        if start is None or message["type"] != "http.response.body":
            await send(message)
            return
        parts.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = b"".join(parts)
        with contextlib.suppress(ValueError, TypeError, KeyError):  # not MLflow's JSON: as is
            reply = json.loads(body)
            text = reply["message"]
            if isinstance(text, str) and len(text) > MAX_ERROR_CHARS:
                reply["message"] = (f"{text[:MAX_ERROR_CHARS]}... ({len(text) - MAX_ERROR_CHARS:,} "
                                    "characters cut: MLflow's server repeats the request)")
                body = json.dumps(reply).encode()
        headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
        await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return cutting


async def refuse(send, status: int, code: str, message: str) -> None:
    """An error answered as MLflow answers its own: {"error_code": ..., "message": ...}."""
    body = json.dumps({"error_code": code, "message": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class Bounded:
    """An ASGI app (MLflow's scoring server) behind a bound on the request's bytes, checked as
    they arrive, and a 400 for JSON nested too deep to parse."""

    def __init__(self, app, max_body: int = MAX_BODY_BYTES):
        self.app, self.max_body = app, max_body

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_big = (f"a request body over {self.max_body:,} bytes, the most `make serve` reads "
                   "(MAX_BODY_BYTES in stages/serving/app.py); send the images in smaller batches, "
                   "or resize them first")
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_body:  # refused before any is read
            await refuse(send, 413, "REQUEST_LIMIT_EXCEEDED", too_big)
            return
        body, more = bytearray(), True
        while more:  # a chunked body has no length: counted as it comes
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                await refuse(send, 413, "REQUEST_LIMIT_EXCEEDED", too_big)
                return
        data = bytes(body)
        if (at := await asyncio.to_thread(not_utf8_at, data)) is not None:
            await refuse(send, 400, "BAD_REQUEST", f"the request is not UTF-8 text (byte {at} "
                         "is not); send JSON, {\"inputs\": [<base64 image file>, ...]}, "
                         "uncompressed")
            return
        if await asyncio.to_thread(too_deep, data):  # other requests go on meanwhile
            await refuse(send, 400, "INVALID_PARAMETER_VALUE",
                         "the request's JSON is nested too deeply to parse; send "
                         "{\"inputs\": [<base64 image file>, ...]}")
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": data, "more_body": False}

        await self.app(scope, replay, cut_errors(send))


def run_server(folder: Path, port: int) -> None:
    """The server process serve_command starts: MLflow's scoring server over the saved model
    `folder` (what `mlflow models serve` runs), bounded, on loopback."""
    import uvicorn
    from mlflow.pyfunc import load_model, scoring_server

    uvicorn.run(Bounded(scoring_server.init(load_model(str(folder)))), host="127.0.0.1",
                port=port)


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m stages.serving.app", description="Serve the champion model.")
    ap.add_argument("--port", type=positive_int, default=5001, help="port on 127.0.0.1")
    ap.add_argument("--name", help="registered model (default: export.register_as)")
    ap.add_argument("--alias", default="champion", help="the version to serve (default champion)")
    ap.add_argument("--timeout", type=positive_int, default=120,
                    help="seconds to wait for the server to answer")
    ap.add_argument("--save", type=Path, metavar="DIR", help="save the served model to DIR, exit")
    ap.add_argument("--dockerfile", type=Path, metavar="DIR",
                    help="write a Docker build context for the served model to DIR, exit")
    ap.add_argument("--serve-folder", type=Path, help=argparse.SUPPRESS)  # serve_command's
    args = ap.parse_args(argv)
    if args.serve_folder:
        run_server(args.serve_folder, args.port)
        return
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
    from stages.team.ui import private_folder, started

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
    log = private_folder("serve") / "serve.log"  # kept after `work` goes: it says why it failed
    print(f"serving {what} on {base} (its log: {log})", flush=True)
    with started("model server", serve_command(folder, args.port), server_env(), log,
                 f"{base}/ping", args.timeout, f"its log: {log}") as server:
        print("ready (Ctrl-C stops it). Classify an image:")
        print(curl_line(base), flush=True)
        server.wait()

if __name__ == "__main__":
    run_stage(main)
