"""`make server`'s start timed, revisions side by side: the first start on a new database, and a
restart on the same one (what every later start costs).

    python -m stages.bench.server [--revs HEAD] [--rounds 3]

Each start is `python -m stages.team.server` of the revision's clone, logins on, one worker, on
sqlite and a free loopback port, timed from the command to its "MLflow server ready" line, then
stopped with SIGTERM. Rounds interleave the revisions, so that a noisy neighbour slows them
alike; the median of the rounds is shown.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stages.bench.pipeline import clone
from stages.lib.cli import ArgumentParser, positive_int, run_stage

CASES = ("first_s", "again_s")


def ready_s(code: Path, db: str, folder: Path) -> float:
    """Seconds from the command to the server's "ready" line; the server is then stopped."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))} | {
        "MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": "pw-bench-0123456789",
        "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(32), "PYTHONPATH": str(code)}
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"server-{time.time_ns()}.out"
    t = time.perf_counter()
    with out.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stages.team.server", "--db", db, "--artifacts",
             str(folder / "artifacts"), "--port", str(port), "--workers", "1"],
            cwd=code, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while "MLflow server ready" not in out.read_text():
            if proc.poll() is not None or time.perf_counter() - t > 300:
                raise RuntimeError(f"the server did not start:\n{out.read_text()[-2000:]}")
            time.sleep(0.05)
        return time.perf_counter() - t
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def bench(revs: list[str], rounds: int) -> dict[str, dict[str, list[float]]]:
    results = {rev: {c: [] for c in CASES} for rev in revs}
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        root = Path(tmp)
        clones = {rev: clone(rev, root / f"rev-{i}") for i, rev in enumerate(revs)}
        for r in range(rounds):
            for i, (rev, code) in enumerate(clones.items()):
                folder = root / f"run-{r}-{i}"
                db = f"sqlite:///{folder / 'server.db'}"
                results[rev]["first_s"].append(ready_s(code, db, folder))
                results[rev]["again_s"].append(ready_s(code, db, folder))
    return results


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m stages.bench.server", description=__doc__.splitlines()[0])
    ap.add_argument("--revs", default="HEAD", help="git revisions side by side, comma-separated")
    ap.add_argument("--rounds", type=positive_int, default=3)
    args = ap.parse_args(argv)
    from stages.bench.training import cpu_label

    results = bench([r for r in args.revs.split(",") if r], args.rounds)
    print(f"`make server` until ready, median of {args.rounds} rounds, seconds; {cpu_label()}")
    print("| revision | first start (new database) | restart (same database) |")
    print("|---|---|---|")
    for rev, got in results.items():
        med = {k: statistics.median(v) for k, v in got.items()}
        print(f"| {rev} | {med['first_s']:.1f} | {med['again_s']:.1f} |")


if __name__ == "__main__":
    run_stage(main)
