"""SLURM as the scheduler of a sweep's workers: one array job whose tasks all run the same
engine-neutral worker command. SLURM's own client commands (sbatch, squeue, sacct, scancel) do
the work; the cluster they talk to is the one SLURM_CONF (or /etc/slurm) names, and sbatch's
own variables (SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_TIMELIMIT, ...) set the rest."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

from stages.lib.errors import UserError

# A task in one of these states will not run again (squeue's and sacct's names).
DONE = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                  "PREEMPTED", "BOOT_FAIL", "DEADLINE", "REVOKED"})


def submit_array(argv: list[str], tasks: int, workdir: Path, log_dir: Path, env: dict[str, str],
                 name: str) -> str:
    """Submit `argv` as tasks 0..tasks-1 of one array job, run in `workdir` with this process's
    environment plus `env` (each task also gets SLURM_ARRAY_TASK_ID); each task's output goes to
    `log_dir/<name>-<job>_<task>.out`. Returns the job id."""
    if tasks < 1:
        raise UserError(f"a SLURM array job needs at least 1 task, not {tasks}")
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [client("sbatch"), "--parsable", f"--array=0-{tasks - 1}", f"--job-name={name}",
           f"--chdir={workdir}", f"--output={log_dir / '%x-%A_%a.out'}",
           f"--wrap=exec {shlex.join(argv)}"]
    # The environment travels with the job (sbatch's default --export=ALL), not on the command
    # line: values with commas survive, and credentials stay out of `ps` and squeue.
    p = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
    if p.returncode != 0:
        raise UserError(f"sbatch refused the array job {name!r}: {last_line(p)}; check the "
                        "cluster with `sinfo`, and choose a partition, account or time limit with "
                        "SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_TIMELIMIT")
    return p.stdout.strip().split(";")[0]  # "<id>" or "<id>;<cluster>"


def states(job_id: str) -> dict[int, str]:
    """Each task's state (PENDING, RUNNING, COMPLETED, CANCELLED, ...): from slurmctld while it
    remembers the job, from accounting (sacct) after that."""
    p = subprocess.run([client("squeue"), "-h", "-r", "-t", "all", "-j", job_id, "-o", "%i %T"],
                       capture_output=True, text=True)
    rows = p.stdout.split("\n") if p.returncode == 0 else []
    if not any(rows):
        p = subprocess.run([client("sacct"), "-n", "-P", "-X", "-j", job_id, "-o", "JobID,State"],
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise UserError(f"SLURM knows no job {job_id}: squeue no longer lists it and sacct "
                            f"says {last_line(p)!r}")
        rows = [row.replace("|", " ") for row in p.stdout.split("\n")]
    found = {}
    for row in rows:
        if not row.strip():
            continue
        task_id, state = row.split(maxsplit=1)
        job, _, task = task_id.partition("_")
        if job == job_id and task.isdigit():  # "12_[3-5]": not yet expanded, listed again later
            found[int(task)] = state.split()[0]  # sacct: "CANCELLED by 0"
    return found


def cancel(job_id: str, task: int | None = None) -> None:
    """Cancel the whole array job, or one of its tasks."""
    target = job_id if task is None else f"{job_id}_{task}"
    p = subprocess.run([client("scancel"), target], capture_output=True, text=True)
    if p.returncode != 0:
        raise UserError(f"scancel {target} failed: {last_line(p)}")


def wait(job_id: str, timeout_s: float) -> dict[int, str]:
    """The tasks' final states once none is pending or running; TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = states(job_id)
        if now and all(s in DONE for s in now.values()):
            return now
        if time.monotonic() > deadline:
            raise TimeoutError(f"SLURM job {job_id} still has tasks running after {timeout_s:g}s: "
                               f"{now}")
        time.sleep(1)


def client(command: str) -> str:
    """The path of one of SLURM's client commands, or an error that says how to get it."""
    found = shutil.which(command)
    if found is None:
        raise UserError(f"{command} not found on PATH: the SLURM launcher runs SLURM's client "
                        "commands on a machine of the cluster (Debian: apt-get install "
                        "slurm-client; SLURM_CONF names the cluster); without SLURM, use "
                        "LAUNCHER=local")
    return found


def last_line(p: subprocess.CompletedProcess) -> str:
    lines = (p.stderr or p.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit code {p.returncode}"
