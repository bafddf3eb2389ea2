"""`make server`'s start timed, revisions side by side: the first start on a new database, and a
restart on the same one (what every later start costs); then what one logged-in request costs.

    python -m reprotrain.bench.server [--revs HEAD] [--rounds 3]

Each start is `python -m reprotrain.team.server` of the revision's clone, logins on, one worker, on
sqlite and a free loopback port, timed from the command to its "MLflow server ready" line, then
stopped with SIGTERM. After the restart, REQUESTS logged-in requests one after another (MLflow's
experiments search, as a client's every call starts: basic-auth checks the login first).
Rounds interleave the revisions, so that a noisy neighbour slows them
alike; the median of the rounds is shown.
"""

from __future__ import annotations

import base64
import signal
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from reprotrain.bench.pipeline import clone
from reprotrain.bench.sync import start_server
from stages.lib.cli import ArgumentParser, positive_int, run_stage

CASES = ("first_s", "again_s", "request_s")
REQUESTS = 30


def ready_s(code: Path, folder: Path, requests: int = 0) -> tuple[float, float | None]:
    """Seconds from the command to the server's "ready" line, and the median seconds of
    `requests` logged-in requests; the server is then stopped."""
    t = time.perf_counter()
    proc, uri, login = start_server(folder, code)
    took = time.perf_counter() - t
    each = []
    auth = base64.b64encode(f"{login['MLFLOW_TRACKING_USERNAME']}:"
                            f"{login['MLFLOW_TRACKING_PASSWORD']}".encode()).decode()
    for _ in range(requests):
        t = time.perf_counter()
        with urllib.request.urlopen(urllib.request.Request(
                f"{uri}/api/2.0/mlflow/experiments/search?max_results=1",
                headers={"Authorization": f"Basic {auth}"}), timeout=60) as r:
            r.read()
        each.append(time.perf_counter() - t)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    return took, statistics.median(each) if each else None


def bench(revs: list[str], rounds: int) -> dict[str, dict[str, list[float]]]:
    results = {rev: {c: [] for c in CASES} for rev in revs}
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        root = Path(tmp)
        clones = {rev: clone(rev, root / f"rev-{i}") for i, rev in enumerate(revs)}
        for r in range(rounds):
            for i, (rev, code) in enumerate(clones.items()):
                folder = root / f"run-{r}-{i}"  # one database: its first start, then a restart
                results[rev]["first_s"].append(ready_s(code, folder)[0])
                again, request = ready_s(code, folder, REQUESTS)
                results[rev]["again_s"].append(again)
                results[rev]["request_s"].append(request)
    return results


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m reprotrain.bench.server", description=__doc__.splitlines()[0])
    ap.add_argument("--revs", default="HEAD", help="git revisions side by side, comma-separated")
    ap.add_argument("--rounds", type=positive_int, default=3)
    args = ap.parse_args(argv)
    from reprotrain.bench import cpu_label

    results = bench([r for r in args.revs.split(",") if r], args.rounds)
    print(f"`make server` until ready, median of {args.rounds} rounds, seconds; {cpu_label()}")
    print("| revision | first start (new database) | restart (same database) "
          f"| a logged-in request (median of {REQUESTS}) |")
    print("|---|---|---|---|")
    for rev, got in results.items():
        med = {k: statistics.median(v) for k, v in got.items()}
        print(f"| {rev} | {med['first_s']:.1f} | {med['again_s']:.1f} "
              f"| {med['request_s'] * 1000:.0f} ms |")


if __name__ == "__main__":
    run_stage(main)
