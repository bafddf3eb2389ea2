"""`make bench-serve`: the ways to classify images, side by side in one run, on loopback.

    python -m reprotrain.bench.serving [--requests 300] [--batches 20] [--budget-s 60] [--revs 1d5d579]

- `make serve`: the champion looked up in the registry (MLflow imported, the store read, the
  two files downloaded), then the model server;
- `mlflow models serve` of the same model saved (`python -m reprotrain.serving.app --save`):
  MLflow's scoring server, what the container runs and what `make serve` ran before;
- served mlflow.pytorch: the model as export logged it before, `mlflow models serve` of it; the
  client decodes, resizes and normalizes each image and applies softmax to the logits, as its
  users had to;
- in-process predict: the functions `python -m stages.predict` runs, in this process;
- with --revs: `make serve` of each revision given, on this checkout's registry.

For each: cold start (command to first answer), latency of one image per request (p50, p99;
client work included), and images/s in requests of --batch-size images. Each phase stops after
its count or --budget-s, whichever comes first. Then `make serve`'s start in its parts. Needs
`make repro` first (a registered champion, models/train/model.pt, models/export/).
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from reprotrain.bench import cpu_label
from reprotrain.processes import answers, stop
from reprotrain.serving.app import serve_command, server_env
from reprotrain.tracking.stores import tracking_uri
from stages.config import EXPORT_DIR, TRAIN_DIR
from stages.inference import model_input, onnx_runner, probabilities, read_spec
from stages.lib.cli import ArgumentParser, positive_int, run_stage
from stages.lib.images import decode_image

SAMPLES = sorted(Path("data/samples").glob("*.png"))


def post(conn: http.client.HTTPConnection, body: str) -> dict:
    conn.request("POST", "/invocations", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {data[:300]!r}")
    return json.loads(data)


def measure(classify: Callable[[list[bytes]], list], images: list[bytes], args) -> dict:
    """p50/p99 ms of one image per call, and images/s in calls of args.batch_size images."""
    latencies = []
    deadline = time.monotonic() + args.budget_s
    for i in range(args.requests):
        t = time.perf_counter()
        classify([images[i % len(images)]])
        latencies.append(time.perf_counter() - t)
        if time.monotonic() > deadline:
            break
    batch = [images[i % len(images)] for i in range(args.batch_size)]
    done, t0 = 0, time.perf_counter()
    deadline = time.monotonic() + args.budget_s
    for _ in range(args.batches):
        assert len(classify(batch)) == len(batch)
        done += len(batch)
        if time.monotonic() > deadline:
            break
    ms = sorted(x * 1e3 for x in latencies)
    return {"p50_ms": statistics.median(ms), "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
            "requests": len(ms), "images_per_s": done / (time.perf_counter() - t0),
            "batch_requests": done // len(batch)}


def served(command: list[str], port: int, first: Callable[[], object], timeout_s: int,
           log: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, float]:
    """A server started by `command` (in `env`; by default without the tracking server's
    login), and the seconds from the command to its first answer."""
    t = time.perf_counter()
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                  env=env or server_env(), start_new_session=True)
    while not answers(f"http://127.0.0.1:{port}/ping"):
        if server.poll() is not None or time.perf_counter() - t > timeout_s:
            stop(server)
            raise RuntimeError(f"{' '.join(command)} did not answer; its log (removed with the "
                               f"bench's folder) ended:\n{log.read_text()[-2000:]}")
        time.sleep(0.05)
    first()
    return server, time.perf_counter() - t


def pyfunc_client(port: int) -> tuple[http.client.HTTPConnection, Callable[[list[bytes]], list]]:
    """A connection to a server of the served model, and the images it classifies."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

    def classify(batch: list[bytes]) -> list:
        body = json.dumps({"inputs": [base64.b64encode(b).decode() for b in batch]})
        return post(conn, body)["predictions"]

    return conn, classify


def pyfunc_row(command: list[str], images: list[bytes], port: int, args, log: Path,
               env: dict[str, str] | None = None) -> dict:
    conn, classify = pyfunc_client(port)
    server, cold = served(command, port, lambda: classify(images[:1]), args.timeout, log, env)
    try:
        return {"cold_start_s": cold, **measure(classify, images, args)}
    finally:
        conn.close()
        stop(server)


def make_serve(port: int, code: Path | None = None) -> list[str]:
    """`make serve` of this checkout, or of the clone `code`, on this environment."""
    return ["make", "-s", *(["-C", str(code)] if code else []), "serve", f"PORT={port}",
            f"VENV={Path(sys.prefix)}"]


def rev_row(rev: str, images: list[bytes], port: int, args, work: Path) -> dict:
    """`make serve` of another revision (a clone), on this checkout's registry."""
    from reprotrain.bench.pipeline import clone
    from stages.config import load_params

    code = clone(rev, work / f"rev-{port}")
    os.utime(code / "requirements.lock", (0, 0))  # older than the venv: make installs nothing
    env = dict(os.environ, MLFLOW_TRACKING_URI=tracking_uri(load_params().mlflow))
    return pyfunc_row(make_serve(port, code), images, port, args, work / f"rev-{port}.log", env)


def mlflow_serve_row(images: list[bytes], port: int, args, work: Path) -> dict:
    """`mlflow models serve` of the model `make serve` serves, saved as `--save` saves it."""
    subprocess.run([sys.executable, "-m", "reprotrain.serving.app", "--save", str(work / "saved")],
                   check=True, capture_output=True)
    command = [sys.executable, "-m", "mlflow", "models", "serve", "-m", str(work / "saved"),
               "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)]
    return pyfunc_row(command, images, port, args, work / "mlflow-serve.log")


def server_alone_s(images: list[bytes], port: int, args, work: Path) -> float:
    """The model server process alone, over models/export's files: command to first answer
    (one image classified, as in the rows)."""
    conn, classify = pyfunc_client(port)
    server, cold = served(serve_command(EXPORT_DIR, port), port, lambda: classify(images[:1]),
                          args.timeout, work / "alone.log")
    conn.close()
    stop(server)
    return cold


def pytorch_row(images: list[bytes], port: int, args, work: Path) -> dict:
    """The model as export logged it until the served pyfunc: mlflow.pytorch with a tensor
    example, served as `mlflow models serve` does; the client does the preprocessing."""
    import mlflow.pytorch
    import torch

    from stages import weights

    model, _ = weights.load(TRAIN_DIR / "model.pt")
    spec = read_spec(EXPORT_DIR / "model.json")
    channels, size, _ = spec["input_shape"]
    folder = work / "pytorch-model"
    example = np.zeros((2, channels, size, size), np.float32)  # batch > 1: a dynamic batch
    mlflow.pytorch.save_model(model, str(folder), input_example=example,
                              pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

    def classify(batch: list[bytes]) -> list:
        x = model_input([decode_image(b, channels, size, spec["resize"]) for b in batch], spec)
        logits = post(conn, json.dumps({"inputs": x.tolist()}))["predictions"]
        return list(probabilities(np.asarray(logits), len(batch), spec, "mlflow.pytorch",
                                  "model.json"))

    command = [sys.executable, "-m", "mlflow", "models", "serve", "-m", str(folder),
               "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)]
    server, cold = served(command, port, lambda: classify(images[:1]), args.timeout,
                          work / "pytorch.log")
    try:
        return {"cold_start_s": cold, **measure(classify, images, args)}
    finally:
        conn.close()
        stop(server)


def predict_row(images: list[bytes], args) -> dict:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "stages.predict", str(SAMPLES[0]), "--json"], check=True,
                   capture_output=True)
    cold = time.perf_counter() - t
    spec = read_spec(EXPORT_DIR / "model.json")
    run = onnx_runner(EXPORT_DIR / "model.onnx", spec, 60)
    channels, size, _ = spec["input_shape"]

    def classify(batch: list[bytes]) -> list:
        x = model_input([decode_image(b, channels, size, spec["resize"]) for b in batch], spec)
        return list(probabilities(run(x), len(x), spec, "model.onnx", "model.json"))

    return {"cold_start_s": cold, **measure(classify, images, args)}


def markdown(rows: dict[str, dict], parts: dict[str, float], args) -> str:
    base = rows["make serve"]
    predict = rows["in-process stages.predict"]["cold_start_s"]
    out = [f"CPU: {cpu_label()}; {args.requests} requests of 1 image, {args.batches} of "
           f"{args.batch_size} (each phase at most {args.budget_s} s); `make bench-serve`", "",
           f"| | cold start s | vs predict's | 1 image p50 ms | p99 ms | images/s, batches of "
           f"{args.batch_size} | images/s vs make serve |", "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        out.append(f"| {name} | {r['cold_start_s']:.2f} | {r['cold_start_s'] / predict:.1f}x | "
                   f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['images_per_s']:.0f} | "
                   f"{r['images_per_s'] / base['images_per_s']:.2f}x |")
    out += ["", "`make serve`'s start in its parts (from the rows above and the model server "
            "alone):", "", "| part | s |", "|---|---|"]
    out += [f"| {name} | {s:.2f} |" for name, s in parts.items()]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m reprotrain.bench.serving", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=positive_int, default=300, help="requests of one image")
    ap.add_argument("--batches", type=positive_int, default=20, help="requests of a batch")
    ap.add_argument("--batch-size", type=positive_int, default=64)
    ap.add_argument("--budget-s", type=positive_int, default=60, help="the most one phase runs")
    ap.add_argument("--timeout", type=positive_int, default=180, help="seconds to start a server")
    ap.add_argument("--port", type=positive_int, default=5011)
    ap.add_argument("--out", type=Path, default=Path("bench/serve.json"))
    ap.add_argument("--revs", default="", help="other revisions' `make serve` beside, comma-separated "
                    "(a clone of each, on this checkout's registry)")
    args = ap.parse_args(argv)
    images = [p.read_bytes() for p in SAMPLES]
    with tempfile.TemporaryDirectory(prefix="reprotrain-bench-serve-") as tmp:
        work, port = Path(tmp), args.port
        rows = {"make serve": pyfunc_row(make_serve(port), images, port, args, work / "serve.log",
                                         dict(os.environ)),
                "mlflow models serve of the same model": mlflow_serve_row(images, port + 2, args,
                                                                          work),
                "served mlflow.pytorch + client preprocessing":
                    pytorch_row(images, port + 3, args, work),
                "in-process stages.predict": predict_row(images, args)}
        for i, rev in enumerate(r for r in args.revs.split(",") if r):
            rows[f"make serve at {rev}"] = rev_row(rev, images, port + 5 + i, args, work)
        alone = server_alone_s(images, port + 4, args, work)
    parts = {"the registry's lookup with MLflow, Python, params (make serve less the model server)":
             rows["make serve"]["cold_start_s"] - alone,
             "the model server process, to its first answer": alone}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cpu": cpu_label(), "rows": rows, "parts": parts}, indent=2)
                        + "\n")
    print(markdown(rows, parts, args))


if __name__ == "__main__":
    run_stage(main)
