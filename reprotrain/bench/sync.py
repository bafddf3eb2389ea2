"""`make sync` timed, revisions side by side, against the team server (`make server`, logins on).

    python -m reprotrain.bench.sync [--revs HEAD] [--rounds 3]

One run as the stages leave it in the spool (params, 30 epochs of metrics, artifacts, a logged
model registered with `candidate` and `champion`), logged once live to the server (`live_s`:
the same calls, in a process of their own) and once into a spool. Then, for each revision in a
clone of its own: `make sync` with no spool (`none_s`), of the one run (`one_s`), and again
with everything sent (`again_s`); each a fresh `python -m reprotrain.tracking.sync` process, with
the lines it printed and the HTTP requests the server logged for it. Rounds interleave the
revisions, so that a noisy neighbour slows them alike; the median of the rounds is shown.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from reprotrain.bench.pipeline import clone, timed
from reprotrain.ports import free_port
from stages.lib.cli import ArgumentParser, positive_int, run_stage

EPOCHS = 30
KEYS = ("train/loss", "train/accuracy", "val/loss", "val/accuracy", "train/lr", "train/epoch_s")
CASES = ("none_s", "one_s", "again_s")


def log_run(uri: str, experiment: str, folder: Path) -> None:
    """What train, evaluate and export log, through MlflowClient calls: the run of the bench."""
    import mlflow
    from mlflow.entities import LoggedModelStatus, Metric, Param

    if uri.startswith("sqlite:///"):  # a version's `models:/` source is looked up there
        mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(
        experiment, artifact_location=(folder / "artifacts").as_uri()
        if uri.startswith("sqlite:///") else None)
    now = int(time.time() * 1000)
    r = client.create_run(exp_id, run_name="bench", start_time=now)
    run_id = r.info.run_id
    client.log_batch(run_id, params=[Param(f"param_{i}", str(i)) for i in range(30)])
    for epoch in range(EPOCHS):  # train logs each epoch as it ends
        client.log_batch(run_id, metrics=[Metric(k, 1 / (epoch + 1), now + epoch, epoch)
                                          for k in KEYS])
    for name in ("train/history.csv", "train/params.yaml", "eval/metrics.json",
                 "eval/confusion.csv", "export/signature.json"):
        client.log_text(run_id, f"{name}\n" * 50, name)
    client.log_batch(run_id, metrics=[Metric(f"eval/{k}", 0.9, now, 0)
                                      for k in ("accuracy", "loss", "f1")])
    model = client.create_logged_model(exp_id, name="model", source_run_id=run_id)
    files = folder / f"model-{time.time_ns()}"
    files.mkdir(parents=True)
    (files / "MLmodel").write_text(f"run_id: {run_id}\nmodel_id: {model.model_id}\n")
    (files / "model.onnx").write_bytes(os.urandom(20_000))
    client.log_model_artifacts(model.model_id, str(files))
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    name = f"{experiment}-cnn"
    if not client.search_registered_models(f"name = '{name}'"):
        client.create_registered_model(name)
    v = client.create_model_version(name, f"models:/{model.model_id}", run_id,
                                    model_id=model.model_id, tags={"eval.accuracy": "0.9"},
                                    await_creation_for=0)
    for alias in ("candidate", "champion"):
        client.set_registered_model_alias(name, alias, v.version)
    client.set_terminated(run_id, "FINISHED", now + EPOCHS)


# The bench server's admin: one login for every start, so that a restart on the same database
# is only a restart (a new password would be set on it first).
LOGIN = {"MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": "pw-bench-0123456789"}


def start_server(folder: Path, code: Path | None = None
                 ) -> tuple[subprocess.Popen, str, dict[str, str]]:
    """`make server` (of the clone `code`, or this checkout) on sqlite in `folder` and a free
    loopback port, once it says it is ready; the env a client logs in with."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))} | \
        LOGIN | {"MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(32)}
    if code:
        env["PYTHONPATH"] = str(code)
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "server.out"
    with out.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "reprotrain.team.server", "--db", f"sqlite:///{folder / 'server.db'}",
             "--artifacts", str(folder / "artifacts"), "--port", str(port), "--workers", "1"],
            cwd=code, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while "MLflow server ready" not in out.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start:\n{out.read_text()[-2000:]}")
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port}", dict(LOGIN)


@contextmanager
def running_server(folder: Path) -> Iterator[tuple[dict[str, str], Path]]:
    """`make server` in `folder` while the block runs: the environment a client logs to it
    with, and the server's log, one uvicorn access line per request."""
    proc, uri, login = start_server(folder)
    try:
        said = (folder / "server.out").read_text()
        yield login | {"MLFLOW_TRACKING_URI": uri}, Path(re.search(r"\(its log: (\S+)\)", said)[1])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


# Put first on a sync's PYTHONPATH: urllib3's debug line for each request MLflow sends, into
# a file (only `logging` imported up front: the no-op sync's seconds stay its own).
COUNTER = """import logging, os
if os.environ.get("BENCH_REQUESTS"):
    _h = logging.FileHandler(os.environ["BENCH_REQUESTS"])
    _log = logging.getLogger("urllib3.connectionpool")
    _log.setLevel(logging.DEBUG)
    _log.addHandler(_h)
    _log.propagate = False
"""


def requests_sent(log: Path) -> int:
    """The HTTP requests (urllib3: one `"METHOD /path HTTP/1.1" status` line each) in `log`."""
    return log.read_text().count(' HTTP/1.1" ') if log.exists() else 0


def bench(revs: list[str], rounds: int) -> dict:
    here = Path.cwd()
    results = {rev: {c: [] for c in (*CASES, "live_s")} for rev in revs}
    said: dict[str, dict[str, str]] = {rev: {} for rev in revs}
    with tempfile.TemporaryDirectory(prefix="bench-sync-") as tmp:
        root = Path(tmp)
        clones = {rev: clone(rev, root / f"rev-{i}") for i, rev in enumerate(revs)}
        proc, uri, login = start_server(root / "server")
        (root / "hook").mkdir()
        (root / "hook/sitecustomize.py").write_text(COUNTER)
        try:
            base = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))}
            for r in range(rounds):
                for rev, code in clones.items():
                    w = root / f"w-{r}-{rev.replace('/', '_')}"
                    w.mkdir()
                    env = base | login | {"MLFLOW_TRACKING_URI": uri, "DVC_ROOT": str(w),
                                          "PYTHONPATH": f"{root / 'hook'}:{code}"}
                    logger = [sys.executable, "-m", "reprotrain.bench.sync", "--log"]
                    mine = env | {"PYTHONPATH": str(here)}
                    took, _ = timed([*logger, uri, f"bench-{r}-{rev}", str(w)], w, mine)
                    results[rev]["live_s"].append(took)
                    sync = [sys.executable, "-m", "reprotrain.tracking.sync"]
                    took, out = timed(sync, w, env | {"BENCH_REQUESTS": str(w / "none.log")})
                    said[rev]["none_s"] = f"{out.strip()} [{requests_sent(w / 'none.log')} requests]"
                    results[rev]["none_s"].append(took)
                    spool = w / ".mlflow-spool"
                    spool.mkdir()
                    (spool / "unsynced").touch()
                    timed([*logger, f"sqlite:///{spool / 'mlflow.db'}", f"bench-{r}-{rev}",
                           str(spool)], w, mine)
                    for case in ("one_s", "again_s"):
                        log = w / f"{case}.log"
                        took, out = timed(sync, w, env | {"BENCH_REQUESTS": str(log)})
                        said[rev][case] = f"{out.strip()} [{requests_sent(log)} requests]"
                        results[rev][case].append(took)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    return {"results": results, "said": said}


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m reprotrain.bench.sync", description=__doc__.splitlines()[0])
    ap.add_argument("--revs", default="HEAD", help="git revisions side by side, comma-separated")
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--log", nargs=3, metavar=("URI", "EXPERIMENT", "FOLDER"),
                    help=argparse_hidden())
    args = ap.parse_args(argv)
    if args.log:
        log_run(args.log[0], args.log[1], Path(args.log[2]))
        return
    from reprotrain.bench import cpu_label

    revs = [r for r in args.revs.split(",") if r]
    report = bench(revs, args.rounds)
    print(f"`make sync`, median of {args.rounds} rounds, seconds; {cpu_label()}")
    print("| revision | live log of the run | sync, no spool | sync of the run | again |")
    print("|---|---|---|---|---|")
    for rev, got in report["results"].items():
        med = {k: statistics.median(v) for k, v in got.items()}
        ratio = med["one_s"] / med["live_s"]
        print(f"| {rev} | {med['live_s']:.1f} | {med['none_s']:.1f} | {med['one_s']:.1f} "
              f"({ratio:.1f}x live) | {med['again_s']:.1f} |")
    for rev, lines in report["said"].items():
        for case, out in lines.items():
            print(f"\n{rev} {case}:\n{out}")


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    run_stage(main)
