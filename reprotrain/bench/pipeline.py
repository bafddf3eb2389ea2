"""python -m reprotrain.bench.training --pipeline: where an experiment's wall time goes, stage by stage.

Each git revision gets its own clone; every round runs the stages there as DVC runs them
(`python -m stages.<name>`, a fresh process each), rounds interleaved across revisions so that
a noisy neighbour slows them alike. A revision with the warm process (reprotrain/warm.py) runs
three times per round: cold (`REPROTRAIN_WARM=0`, each stage imports everything itself), warm,
and first: in an environment no warm process has served yet, as a fresh clone's first run, which
starts one on the way (ended with the round).
Round 0 is a discarded warm-up: it creates the clone's data, `mlflow.db` (schema migrations),
Python's bytecode caches and the warm process, which a user pays once.

Per stage: the wall time of the process, split into start-up (interpreter and imports, up to
the stage's `main`), tracking (MLflow calls, their imports included), the training loop, the
stage's own work, and exit (teardown after `main`). The overhead is everything but the loop.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STAGES = ("params", "prepare", "train", "evaluate", "export")  # params: where a revision has it
PARTS = ("startup_s", "tracking_s", "loop_s", "work_s", "exit_s")


def clone(rev: str, dest: Path) -> Path:
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(Path.cwd()), str(dest)], check=True)
    subprocess.run(["git", "-C", str(dest), "checkout", "-q", rev], check=True)
    return dest


def timed(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, str]:
    """Seconds a command took, and its output; a failure stops the bench with its output."""
    start = time.perf_counter()
    p = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if p.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed in {cwd} (exit {p.returncode}):\n"
                           f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return seconds, p.stdout + p.stderr


def run_stage(workspace: Path, stage: str, warm: bool = False,
              extra: dict[str, str] | None = None) -> dict:
    """One stage in a fresh process; its own timing record where the revision writes one.
    `extra`: more environment (a tracking server's URI and login)."""
    timings = workspace / ".timings.jsonl"
    timings.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLFLOW_", "DVC_", "REPROTRAIN_WARM"))}
    env |= {"REPROTRAIN_TIMINGS": str(timings), "REPROTRAIN_T0": repr(time.time()),
            **({} if warm else {"REPROTRAIN_WARM": "0"}), **(extra or {})}
    start = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", f"stages.{stage}"], cwd=workspace, env=env,
                       capture_output=True, text=True)
    wall = time.perf_counter() - start
    if p.returncode:
        raise RuntimeError(f"{stage} failed in {workspace}:\n{p.stderr[-2000:]}")
    m = {"wall_s": wall}
    if timings.exists():
        rec = json.loads(timings.read_text().splitlines()[-1])
        m |= {"startup_s": rec["startup_s"], "tracking_s": rec["tracking_s"],
              "loop_s": rec["loop_s"], "exit_s": wall - rec["startup_s"] - rec["main_s"],
              "work_s": rec["main_s"] - rec["tracking_s"] - rec["loop_s"]}
        m["warm"] = rec.get("warm", False)  # a warm row must not hide a cold run: the table says
    elif stage == "train":  # an older revision: the loop's seconds end its last line
        found = re.search(r"([\d.]+)s\s*$", p.stdout)
        m["loop_s"] = float(found.group(1)) if found else None
    return m


def variants(rev: str, ws: Path, server: dict[str, str] | None
             ) -> dict[str, tuple[Path, bool, dict[str, str] | None]]:
    """The rows a revision gets: cold, warm and first where it has the warm process; with `server`
    (the environment that logs to one), each of those again, tracked to the server."""
    kinds = {"": False} if not (ws / "reprotrain/warm.py").exists() else \
        {" cold": False, " warm": True, " first": True}
    rows = {f"{rev}{k}": (ws, warm, None) for k, warm in kinds.items()}
    if server:
        rows |= {f"{rev}{k}, server": (ws, warm, server) for k, warm in kinds.items()}
    return rows


def end_warm_processes(marked: dict[str, str]) -> None:
    """SIGTERM to the warm processes whose environment holds `marked` (a round's own)."""
    mark = "".join(f"{k}={v}" for k, v in marked.items()).encode()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if b"warm.py\0serve" in (proc / "cmdline").read_bytes() \
                    and mark in (proc / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), signal.SIGTERM)
        except (OSError, ValueError):
            pass  # gone meanwhile, or not this user's


def requests_logged(server_log: Path | None) -> int:
    """The requests the bench's server has answered so far: uvicorn's access line each."""
    if server_log is None:
        return 0
    return sum(' HTTP/1.1" ' in line for line in server_log.read_text().splitlines())


def pipeline(revs: list[str], rounds: int,
             server: tuple[dict[str, str], Path] | None = None) -> dict:
    """Every revision's rows, rounds interleaved; with `server` (the environment that logs to a
    running `make server`, and its access log: reprotrain.bench.sync.running_server), also against
    it, with the requests each stage sent."""
    login, log = server or (None, None)
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        spaces = {label: v for i, rev in enumerate(revs)
                  for label, v in variants(rev, clone(rev, Path(tmp) / f"r{i}"), login).items()}
        samples: dict[str, dict[str, list[dict]]] = {
            label: {s: [] for s in STAGES if (ws / f"stages/{s}.py").exists()}
            for label, (ws, _, _) in spaces.items()}
        for round_ in range(rounds + 1):
            for label, (ws, warm, extra) in spaces.items():
                # A variable no library reads: only the warm process's key changes.
                fresh = {"BENCH_FIRST_RUN": f"{os.getpid()}-{round_}"} if label.endswith(
                    (" first", " first, server")) else {}
                for stage in samples[label]:
                    sent = requests_logged(log)
                    m = run_stage(ws, stage, warm, (extra or {}) | fresh)
                    if extra:
                        m["requests"] = requests_logged(log) - sent
                    if round_:
                        samples[label][stage].append(m)
                    print(f"  round {round_}/{rounds} {label} {stage}: {m['wall_s']:.1f} s",
                          file=sys.stderr, flush=True)
                if fresh:
                    end_warm_processes(fresh)
    out = {}
    for rev, stages in samples.items():
        rows = {s: {k: statistics.median(x[k] for x in ms) if ms[0].get(k) is not None else None
                    for k in ("wall_s", *PARTS, "requests")} | {"warm": sum(x.get("warm", False)
                                                                   for x in ms), "runs": len(ms)}
                for s, ms in stages.items()}
        total = sum(r["wall_s"] for r in rows.values())
        loop = rows["train"]["loop_s"] or 0.0
        out[rev] = {"stages": rows, "total_s": total, "loop_s": loop,
                    "overhead_s": total - loop, "overhead_per_loop": (total - loop) / loop}
    return out


def markdown(report: dict, cpu: str, rounds: int) -> str:
    lines = [f"Pipeline, stage by stage ({cpu}; median of {rounds} rounds after a warm-up):", "",
             "| revision | stage | wall | start-up | tracking | loop | own work | exit | requests |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rev, r in report.items():
        for stage, m in r["stages"].items():
            cells = [f"{m[k]:.1f} s" if m.get(k) is not None else "-" for k in ("wall_s", *PARTS)]
            sent = "-" if m.get("requests") is None else f"{m['requests']:.0f}"
            if rev.endswith((" warm", " warm, server")) and m["warm"] < m["runs"]:
                cells[0] += f" ({m['runs'] - m['warm']} of {m['runs']} cold)"
            elif rev.endswith((" first", " first, server")) and m["warm"]:
                cells[0] += f" ({m['warm']} of {m['runs']} warm)"
            lines.append(f"| {rev} | {stage} | " + " | ".join(cells) + f" | {sent} |")
        lines.append(f"| {rev} | **total** | **{r['total_s']:.1f} s** | | | {r['loop_s']:.1f} s "
                     f"| overhead {r['overhead_s']:.1f} s = {r['overhead_per_loop']:.2f}x the "
                     "loop | | |")
    for rev, r in report.items():  # the server's price: each server row against its own
        if rev.endswith(", server") and rev.removesuffix(", server") in report:
            local = report[rev.removesuffix(", server")]["total_s"]
            lines.append(f"\n{rev}: {r['total_s'] / local:.2f}x the embedded store's "
                         f"{local:.1f} s")
    return "\n".join(lines)
