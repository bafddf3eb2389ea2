"""`python -m reprotrain.sweep run`: the sweep file checked, the commit pinned on the remote, the
study created and the MLflow parent run opened, then the workers started on an engine (local
processes, or a SLURM array through reprotrain/sweep/slurm.py) and watched until they end."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from reprotrain import tracking
from reprotrain.sweep.report import none_completed, plot, progress, pull, summary
from reprotrain.sweep.spec import SweepError, load_sweep
from reprotrain.sweep.study import create_study, optuna_logging_quiet, shown, storage_uri
from reprotrain.sweep.trial import STORAGE_ENV
from reprotrain.sweep.worker import default_dvc_remote, dvc_remote_keys, last_error, shared_dvc_remote
from stages.config import load_params

WORKDIR = Path(".dvc/tmp/sweeps")  # clones and logs of local workers; git and DVC ignore it
MAX_WORKERS = 256  # a SLURM array's tasks; local workers are bounded by this machine's cores


def run(path: Path, trials: int | None, workers: int, launcher: str, storage: str | None,
        remote: str, study: str | None, workdir: Path) -> None:
    spec = load_sweep(path, trials)  # a bad file fails here, before anything starts
    if launcher not in ("local", "slurm"):
        raise SweepError(f"LAUNCHER={launcher!r}: use local or slurm")
    check_workers(workers, spec["trials"], launcher)
    uri = storage_uri(storage, workers)
    url, commit = pinned_commit(remote)
    params = load_params()
    name = study or f"{path.stem}-{time.strftime('%m%d-%H%M%S')}"
    about = {"remote": url, "commit": commit, "sweep_file": str(path),
             "dvc_remote": shared_dvc_remote(Path.cwd())}
    print(plan(name, spec, params, commit, workers, launcher, uri), flush=True)
    optuna_logging_quiet()  # "A new study created in RDB": the line above said it
    optuna_study = create_study(uri, name, spec, about)
    log_dir = (workdir / name).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"study {name} in {shown(uri)}: {spec['trials']} trials of {commit[:7]} on "
          f"{workers_text(workers, launcher)}; logs in {log_dir}", flush=True)
    with tracking.start_run(params.mlflow, name=name, tags={
            "sweep_file": str(path), "optuna_study": name, "optuna_storage": shown(uri),
            "sweep_space": json.dumps(spec["space"])}) as parent:
        optuna_study.set_user_attr("mlflow_parent_run", parent.run_id or "")
        parent.log_params({f"sweep.{k}": v for k, v in flat_spec(spec).items()})
        argv = [sys.executable, "-m", "reprotrain.sweep", "worker", "--study", name,
                "--workdir", str(workdir.resolve())]
        env = {**os.environ, **dvc_remote_keys(Path.cwd()), STORAGE_ENV: uri,
               "MLFLOW_TRACKING_URI": tracking.tracking_uri(params.mlflow)}
        engine = Local(argv, workers, log_dir, env) if launcher == "local" else \
            Slurm(argv, workers, log_dir, env, name)
        try:
            watch(optuna_study, spec, engine)
        except BaseException:
            engine.stop()
            raise
        trials = optuna_study.get_trials(deepcopy=False)
        counts = Counter(t.state.name for t in trials)
        parent.log_metrics({"trials_complete": counts["COMPLETE"], "trials_pruned":
                            counts["PRUNED"], "trials_failed": counts["FAIL"],
                            "restored": sum(not t.user_attrs.get("retrained", True) for t in trials)})
        if counts["COMPLETE"]:
            parent.log_metrics({"best_value": optuna_study.best_value})
        picture = plot(optuna_study, spec, log_dir / "trials.png")
        parent.log_artifact(picture)
    print(summary(optuna_study, spec), flush=True)
    print(f"picture: {picture}")
    pull(optuna_study, spec)
    unfinished = counts["WAITING"] + counts["RUNNING"]
    if unfinished:
        raise SweepError(f"{unfinished} trials never ended ({', '.join(engine.lost()) or 'workers gone'});"
                         f" start more workers: {STORAGE_ENV}=... python -m reprotrain.sweep worker "
                         f"--study {name}")
    if not counts["COMPLETE"]:  # nothing to pull, compare or restore: a failed sweep
        raise SweepError(none_completed(optuna_study, default_dvc_remote(Path.cwd())[0], log_dir))


def check_workers(workers: int, trials: int, launcher: str) -> None:
    cores = os.cpu_count() or 1
    if not 1 <= workers <= MAX_WORKERS:
        raise SweepError(f"WORKERS={workers} must be from 1 to {MAX_WORKERS}")
    if workers > trials:
        raise SweepError(f"WORKERS={workers} is more than TRIALS={trials}: the others would find "
                         f"no trial to run; use WORKERS={trials} or fewer")
    if launcher == "local" and workers > cores:
        # Each local worker trains on this machine: more of them than cores only slows all.
        raise SweepError(f"WORKERS={workers} local workers: this machine has {cores} cores; use "
                         f"WORKERS={cores} or fewer, or LAUNCHER=slurm")


def pinned_commit(remote: str) -> tuple[str, str]:
    """The remote's URL and HEAD's commit, which must be on it: every worker clones it there."""
    def git(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *argv], capture_output=True, text=True)

    from reprotrain.redact import holds_credentials

    url = git("remote", "get-url", remote).stdout.strip() or remote
    if holds_credentials(url):
        # Every worker's `git clone URL` shows it in `ps`, each clone keeps it in .git/config and
        # the study keeps it for every user of its storage.
        raise SweepError(f"REMOTE={shown(remote)}: its URL {shown(url)} holds a password or a "
                         "token, which the workers' `git clone` would show to every user: let "
                         "git find it instead (a credential helper, or an SSH URL with a key)")
    commit = git("rev-parse", "HEAD").stdout.strip()
    listed = git("ls-remote", url)
    if listed.returncode:
        raise SweepError(f"REMOTE={shown(remote)}: {last_error(listed.stderr)}; give a git remote "
                         "the workers can clone (a name from `git remote -v`, or a URL)")
    tips = {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}
    if commit not in tips and not any(git("merge-base", "--is-ancestor", commit, t).returncode == 0
                                      for t in tips):
        raise SweepError(f"HEAD {commit[:7]} is not on REMOTE={shown(remote)}: `git push "
                         f"{shown(remote)}` it first; every worker clones that commit from there")
    if git("status", "--porcelain", "--untracked-files=no").stdout.strip():
        print(f"warning: uncommitted changes are not part of the sweep: workers run {commit[:7]}",
              file=sys.stderr)
    return url, commit


def workers_text(workers: int, launcher: str) -> str:
    return f"{workers} {launcher} worker{'' if workers == 1 else 's'}"


def plan(name: str, spec: dict, params, commit: str, workers: int, launcher: str, uri: str) -> str:
    """What the sweep will do, in one line, before it starts: no secrets (the storage's kind)."""
    epochs = spec["space"].get("epochs")
    epochs = f"{epochs['low']}-{epochs['high']}" if epochs and "low" in epochs else \
        "/".join(map(str, epochs["values"])) if epochs else spec["params"].get("epochs", params.epochs)
    obj = spec["objective"]
    swept = ", ".join(spec["space"])
    kind = uri.split(":", 1)[0].split("+", 1)[0]
    return (f"sweep {name}: {spec['trials']} trials x {epochs} epochs of {commit[:7]} over {swept}, "
            f"{obj['direction']} {obj['metric']} ({obj['file']}), "
            f"{workers_text(workers, launcher)}, study in {kind} storage")


def flat_spec(spec: dict) -> dict[str, Any]:
    from stages.config import flatten

    return {k: json.dumps(v) if isinstance(v, list | dict) else v for k, v in flatten(spec).items()}


class Local:
    """N worker processes on this machine, each in its own session (a kill takes its children)."""

    def __init__(self, argv: list[str], workers: int, log_dir: Path, env: dict):
        self.procs = []
        for i in range(workers):
            with open(log_dir / f"worker-{i}.log", "w") as log:
                self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                   env=env, start_new_session=True))

    def alive(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def lost(self) -> list[str]:
        return [f"worker {i} exited {p.returncode}" for i, p in enumerate(self.procs)
                if p.returncode not in (None, 0)]

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)


class Slurm:
    """An array job whose tasks are workers (reprotrain/sweep/slurm.py: sbatch, squeue/sacct, scancel)."""

    def __init__(self, argv: list[str], workers: int, log_dir: Path, env: dict, name: str):
        from reprotrain.sweep import slurm

        self.slurm = slurm
        self.job = slurm.submit_array(argv, workers, Path.cwd(), log_dir, env, name)
        print(f"SLURM array job {self.job}: {workers} tasks", flush=True)

    def alive(self) -> bool:
        tasks = self.slurm.states(self.job)  # {} while the array is not expanded yet: pending
        return not tasks or any(s not in self.slurm.DONE for s in tasks.values())

    def lost(self) -> list[str]:
        return [f"task {i} {s}" for i, s in self.slurm.states(self.job).items() if s != "COMPLETED"]

    def stop(self) -> None:
        self.slurm.cancel(self.job)


def watch(study, spec: dict, engine) -> None:
    """A line per change (done, running, pruned, failed, the best so far) until the workers end."""
    last = None
    while True:
        running = engine.alive()
        line = progress(study, spec)
        if line != last:
            print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)
            last = line
        if not running:
            return
        time.sleep(1)
