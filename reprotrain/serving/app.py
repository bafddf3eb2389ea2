"""`make serve`: the registry's champion over HTTP on loopback, images in, labels out.

    python -m reprotrain.serving.app [--port 5001] [--name NAME]
    python -m reprotrain.serving.app --save DIR          # the served model as a folder, and exit
    python -m reprotrain.serving.app --dockerfile DIR    # `mlflow models generate-dockerfile` of it

The champion (alias `champion` of registered model `export.register_as`, in the store of
`make ui`: mlflow.db or MLFLOW_TRACKING_URI) is served under uvicorn as MLflow's scoring server
serves the logged model (`mlflow models serve`, the container): `/ping`, and `/invocations` of
{"inputs": [<base64 image>, ...]}. Not by that server: its import alone takes four times as long
as `python -m stages.predict` does in all (docs/serving.md, "How fast"). Only the champion's
model.onnx and model.json come from the registry, never code (reprotrain/serving/registry.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from reprotrain.serving.registry import champion_files, example_image, registered_name, save_served
from stages.inference import FIX, BadInput, Classifier
from stages.lib.cli import ArgumentParser, positive_int, run_stage
from stages.lib.errors import UserError

SAMPLE = Path(__file__).resolve().parents[2] / "data/samples/7.png"
DIGITS = [str(d) for d in range(10)]  # the classes SAMPLE is one of
# The largest request body read: a larger one gets a 413 before the rest is read (MLflow's
# server reads any body whole: 200 MB cost 7 s before its 400). 1024 digits take 0.5 MB;
# photos are resized before they are sent (MAX_PIXELS in stages/inference.py).
MAX_BODY_BYTES = 8 * 2**20
SHAPE = '{"inputs": [<base64 image file>, ...]}'
ROUTES = {"/invocations": "POST", "/ping": "GET", "/health": "GET", "/version": "GET"}
# The model server's environment: these variables and those with these prefixes, no other.
SERVER_VARIABLES = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM")
SERVER_PREFIXES = ("LC_", "PYTHON", "OMP_", "MKL_", "OPENBLAS_", "KMP_")


def curl_line(base: str, sample: Path = SAMPLE) -> str:
    """A request that works as printed in bash: an image file, base64 on the fly."""
    sample = sample.relative_to(Path.cwd()) if sample.is_relative_to(Path.cwd()) else sample
    return (f"curl -s {base}/invocations -H 'Content-Type: application/json' -d "
            f"\"{{\\\"inputs\\\": [\\\"$(base64 -w0 {shlex.quote(str(sample))})\\\"]}}\"")


def served_classes(classes: list[str], shown: int = 10) -> str:
    """`3 classes (circle, square, triangle)`: which model it is, at a glance."""
    more = f", ... {len(classes) - shown} more" if len(classes) > shown else ""
    return f"{len(classes)} classes ({', '.join(classes[:shown])}{more})"


def server_env() -> dict[str, str]:
    """What the model server process needs of this environment (this venv's PATH, Python's and
    the math libraries' settings, the locale), nothing else: it never reads the registry, and it
    decodes what anyone who reaches its port sends, so a hole in a decoder would find no login
    to the tracking server nor any other secret (cloud keys) in its environment."""
    env = {k: v for k, v in os.environ.items()
           if k in SERVER_VARIABLES or k.startswith(SERVER_PREFIXES)}
    return dict(env, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")


def serve_command(folder: Path, port: int) -> list[str]:
    """The server process: `run_server` over `folder`'s model.onnx and model.json."""
    return [sys.executable, "-m", "reprotrain.serving.app", "--serve-folder", str(folder), "--port",
            str(port)]


def is_json(content_type: bytes) -> bool:
    """application/json, in UTF-8 if it names a charset at all, and no other parameter.
    Case-insensitive, a quoted value and an empty parameter allowed (RFC 9110 8.3.1, 5.6.6),
    where MLflow's server refuses them. Another parameter is refused as MLflow refuses it:
    `format=pandas-split` and the like are MLflow 1's protocol, whose body means other data."""
    kind, *params = content_type.decode("latin-1").lower().split(";")
    pairs = [(k.strip(), v.strip().strip('"')) for k, _, v in (p.partition("=") for p in params)
             if k.strip()]
    return kind.strip() == "application/json" and all(
        k == "charset" and v in ("utf-8", "utf8") for k, v in pairs)


def parsed(body: bytes) -> object:
    """The request's JSON, from UTF-8 text (decoded once). Python's parser recurses once per `[`
    or `{` and fails near 1000 levels deep with a RecursionError; a request has 2."""
    try:
        # One leading byte order mark is skipped, as MLflow's server skips it (RFC 8259 8.1
        # allows it); decoded first, so that an error's byte offset is the body's.
        text = body.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise BadInput(f"the request is not UTF-8 text (byte {e.start} is not); send JSON, "
                       f"{SHAPE}, uncompressed") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise BadInput(f"the request's JSON is nested too deeply to parse; send {SHAPE}") from None
    except ValueError as e:
        raise BadInput(f"the request is not valid JSON ({e}); send {SHAPE}") from None


async def reply(send, status: int, data: bytes = b"\n", close: bool = False,
                extra: tuple = ()) -> None:
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(data)).encode()), *extra]
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"connection", b"close")] if close else headers})
    await send({"type": "http.response.body", "body": data})


async def refuse(send, status: int, code: str, message: str, close: bool = False) -> None:
    """An error answered as MLflow's scoring server answers its own:
    {"error_code": ..., "message": ...}."""
    await reply(send, status, json.dumps({"error_code": code, "message": message}).encode(), close)


class Served:
    """The classifier over HTTP as MLflow's scoring server answers (`mlflow models serve`, what
    the container runs): GET /ping and /health, POST /invocations of {"inputs": [...]} to
    {"predictions": [...]}, errors as {"error_code", "message"}. Without MLflow's import, and
    with the bounds its server lacks: the request's bytes, counted as they arrive, and an error
    that never repeats the request."""

    def __init__(self, classify: Classifier, max_body: int = MAX_BODY_BYTES):
        from importlib.metadata import version

        self.classify, self.max_body, self.version = classify, max_body, version("mlflow")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        if path.endswith("/") and path.rstrip("/") in ROUTES:
            # As MLflow's server (Starlette's redirect_slashes): a 307 keeps the method and the
            # body, so a client that follows it is answered. The Location is our own route,
            # relative, never built from the Host header a client sent.
            query = scope.get("query_string", b"")
            target = path.rstrip("/").encode() + (b"?" + query if query else b"")
            await reply(send, 307, b"", extra=((b"location", target),))
            return
        if path not in ROUTES:  # the path is not repeated: it can be anything a client sends
            await refuse(send, 404, "ENDPOINT_NOT_FOUND", "no such endpoint here: POST "
                         "/invocations, GET /ping, /health or /version")
            return
        if method != ROUTES[path]:
            await refuse(send, 405, "METHOD_NOT_ALLOWED", f"{path} takes {ROUTES[path]}")
            return
        if path == "/version":  # as MLflow's server: the MLflow it runs with
            await reply(send, 200, self.version.encode())
            return
        if path != "/invocations":
            await reply(send, 200)
            return
        headers = dict(scope["headers"])
        if not is_json(headers.get(b"content-type", b"")):
            # Also with no Content-Type (MLflow's server fails with a 500 on it) and text/csv
            # (a 400 there: no CSV can hold this model's input): the format is what is wrong.
            await refuse(send, 415, "BAD_REQUEST", "send the request as Content-Type: "
                         "application/json (UTF-8), with no parameter but charset")
            return
        too_big = (f"a request body over {self.max_body:,} bytes, the most `make serve` reads "
                   "(MAX_BODY_BYTES in reprotrain/serving/app.py); send the images in smaller batches, "
                   "or resize them first")
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_body:  # refused before any is read
            await refuse(send, 413, "REQUEST_LIMIT_EXCEEDED", too_big, close=True)
            return
        body, more = bytearray(), True
        while more:  # a chunked body has no length: counted as it comes
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                await refuse(send, 413, "REQUEST_LIMIT_EXCEEDED", too_big, close=True)
                return
        try:  # in a thread: other requests go on meanwhile
            records = await asyncio.to_thread(self.answer, bytes(body))
        except BadInput as e:
            await refuse(send, 400, "INVALID_PARAMETER_VALUE", str(e))
            return
        except Exception:  # noqa: BLE001 - the model failed: the log has why, never the client
            logging.getLogger(__name__).exception("the model failed on a request")
            await refuse(send, 500, "INTERNAL_ERROR", "the model failed on this request; the "
                         "server's log says why")
            return
        await reply(send, 200, json.dumps({"predictions": records}).encode())

    def answer(self, body: bytes) -> list[dict]:
        request = parsed(body)
        if not isinstance(request, dict):
            raise BadInput(f"the request is a JSON {type(request).__name__}, not an object with "
                           f"the key 'inputs'; {FIX}")
        if "inputs" not in request:  # other keys are left alone, as MLflow's server leaves them
            keys = ", ".join(repr(k[:20]) for k in list(request)[:3])
            raise BadInput(f"the request has no key 'inputs' (it has {keys}"
                           f"{f' and {len(request) - 3:,} more' if len(request) > 3 else ''}); {FIX}")
        return self.classify(request["inputs"])


def run_server(folder: Path, port: int) -> None:
    """The server process serve_command starts: the classifier over `folder`'s model.onnx and
    model.json, on loopback. It binds its port only once the model is loaded and checked, so
    that /ping answers only a server that can classify."""
    import uvicorn

    classify = Classifier(folder / "model.json", folder / "model.onnx")
    uvicorn.run(Served(classify), host="127.0.0.1", port=port, lifespan="off")


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m reprotrain.serving.app", description="Serve the champion model.")
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
    """Nothing listens on it: else /ping could be answered by another server. Bound as uvicorn
    binds (SO_REUSEADDR, create_server's default), so that the connections a server just
    stopped had closed (TIME_WAIT, a minute) do not keep its restart off the port."""
    try:
        with socket.create_server(("127.0.0.1", port)):
            return True
    except OSError:
        return False


def serve(name: str, work: Path, args) -> None:
    from reprotrain.processes import private_folder, started

    number, files, run = champion_files(name, work / "registry", args.alias)
    # Checked here, as predict checks them, so that a bad file is one line, not a dead server.
    classes = Classifier(files / "model.json", files / "model.onnx").spec["classes"]
    what = f"{name} version {number} ({args.alias})"
    if args.save or args.dockerfile:
        folder = save_served(files, args.save or work / "model")
    if args.save:
        print(f"saved {what} to {args.save}")
        return
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
    # Not in `work`: a server that failed keeps its log, which says why (`started` removes it
    # after a clean stop).
    log = private_folder("serve") / "serve.log"
    print(f"serving {what} on {base}: {served_classes(classes)}, from {run} (its log: {log})",
          flush=True)
    # The digits' sample, or one of the served model's own test images: its input example.
    sample = SAMPLE if classes == DIGITS else example_image(name, number, log.parent)
    with started("model server", serve_command(files, args.port), server_env(), log,
                 f"{base}/ping", args.timeout, f"its log: {log}") as server:
        print("ready (Ctrl-C stops it). Classify an image"
              + (":" if sample == SAMPLE else " (one of the model's own test images):"
                 if sample else f" of {served_classes(classes)}:"))
        print(curl_line(base, sample or Path("your-image.png")), flush=True)
        server.wait()


if __name__ == "__main__":
    run_stage(main)
