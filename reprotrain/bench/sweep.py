"""python -m reprotrain.bench.sweep SWEEP --storage URI: one sweep on 1 and on 2 local workers, and
on 2 without its pruner, side by side (docs/sweeps.md has the figures and the command).

Each case starts from nothing: a fresh clone of HEAD with its own bare git remote and DVC
remote folder, so that no case restores another's run-cache; the run-cache hits counted are
the sweep's own repeated points. The cases run one after another on this machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from ruamel.yaml import YAML

CASES = (("1 worker", 1, False), ("2 workers", 2, False), ("2 workers, no pruner", 2, True))


def fresh_project(dest: Path, sweep: Path, no_pruner: bool) -> Path:
    """HEAD in a clone whose `origin` is a bare repository and whose DVC remote is a folder."""
    def git(*argv: str, cwd: Path = dest) -> None:
        subprocess.run(["git", *argv], cwd=cwd, check=True, capture_output=True)

    subprocess.run(["git", "clone", "-q", str(Path.cwd()), str(dest)], check=True)
    subprocess.run([str(Path(sys.executable).parent / "dvc"), "remote", "add", "-d", "storage",
                    str(dest.parent / f"{dest.name}-dvc")], cwd=dest, check=True)
    git("commit", "-qam", "a DVC remote")
    git("clone", "-q", "--bare", str(dest), str(dest.parent / f"{dest.name}.git"), cwd=dest.parent)
    git("remote", "set-url", "origin", str(dest.parent / f"{dest.name}.git"))
    yaml = YAML()
    spec = yaml.load(dest / sweep)
    if no_pruner:
        spec["pruner"] = {"name": "none"}
    yaml.dump(spec, dest / "bench-sweep.yaml")  # untracked: workers read it from the study
    return dest


def run_case(project: Path, workers: int, storage: str, study: str) -> dict:
    import optuna

    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))}
    env["REPROTRAIN_SWEEP_STORAGE"] = storage
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    start = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "reprotrain.sweep", "run", "bench-sweep.yaml",
                        "--workers", str(workers), "--study", study], cwd=project, env=env,
                       capture_output=True, text=True)
    wall = time.perf_counter() - start
    if p.returncode:
        raise RuntimeError(f"{study} failed:\n{p.stdout[-3000:]}\n{p.stderr[-2000:]}")
    trials = optuna.load_study(study_name=study, storage=storage).get_trials()
    states = Counter(t.state.name for t in trials)
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    return {"wall_s": wall, "complete": states["COMPLETE"], "pruned": states["PRUNED"],
            "failed": states["FAIL"],
            "restored": sum(not t.user_attrs.get("retrained") for t in complete),
            "trained_s": sum(t.user_attrs.get("run_s", 0) for t in complete
                             if t.user_attrs.get("retrained")),
            "restored_s": sum(t.user_attrs.get("run_s", 0) for t in complete
                              if not t.user_attrs.get("retrained")),
            "pruned_s": sum(t.user_attrs.get("run_s", 0) for t in trials if t.state.name == "PRUNED"),
            "summary": p.stdout.split("study ", 2)[-1] if "study " in p.stdout else ""}


def main() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    parser = argparse.ArgumentParser(prog="python -m reprotrain.bench.sweep", description=__doc__)
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--storage", required=True, help="a PostgreSQL URI (2 workers)")
    a = parser.parse_args()
    stamp = time.strftime("%m%d-%H%M%S")
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        for i, (name, workers, no_pruner) in enumerate(CASES):
            project = fresh_project(Path(tmp) / f"case{i}", a.sweep, no_pruner)
            rows[name] = run_case(project, workers, a.storage, f"bench-{stamp}-{i}")
            print(f"{name}: {rows[name]['wall_s']:.0f} s\n{rows[name]['summary']}", flush=True)
    base = rows["1 worker"]["wall_s"]
    print(f"\n{'case':<22} {'wall_s':>7} {'vs 1':>5} {'complete':>8} {'restored':>8} "
          f"{'pruned':>6} {'failed':>6} {'trained_s':>9} {'restored_s':>10} {'pruned_s':>8}")
    for name, r in rows.items():
        print(f"{name:<22} {r['wall_s']:>7.0f} {base / r['wall_s']:>5.2f} {r['complete']:>8} "
              f"{r['restored']:>8} {r['pruned']:>6} {r['failed']:>6} {r['trained_s']:>9.0f} "
              f"{r['restored_s']:>10.0f} {r['pruned_s']:>8.0f}")


if __name__ == "__main__":
    main()
