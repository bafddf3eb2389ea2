"""A real one-node SLURM cluster for tests: munged, slurmctld and slurmd from Debian's munge and
slurm-wlm, on loopback, with every file in a temp folder. `.ci/run` installs both packages.

What it took (Debian 12, slurm-wlm 22.05.8, munge 0.5.15, as root):
- munged refuses a socket in a folder without execute permission for all ("Socket is
  inaccessible: execute permissions for all required"): the socket gets a 0755 folder of its own
  under /tmp (also short: a unix socket path holds at most 107 bytes); key, seed, pid and log stay
  in a 0700 folder. It runs as root without --force.
- No cgroups: proctrack/linuxproc and task/none; no accounting daemon, so sacct says "Slurm
  accounting storage is disabled" and finished jobs are read from slurmctld (MinJobAge).
- The node is named `localhost` (slurmd -N) with the CPUs and memory `slurmd -C` reports, so
  slurmd does not reconfigure "socket/core boundaries" at start.
- Harmless noise in the logs: "can not load PMIx library" (Debian builds the pmix plugins
  without the library), missing state files on a first start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.services import free_port

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "sinfo")


def node_line() -> str:
    """This machine as slurm.conf's NodeName line: `slurmd -C`'s figures, named localhost."""
    found = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    fields = found.splitlines()[0].split()[1:]  # drop NodeName=<hostname>
    return " ".join(["NodeName=localhost", "NodeAddr=127.0.0.1", *fields, "State=UNKNOWN"])


def slurm_conf(folder: Path, munge_socket: Path) -> str:
    return "\n".join([
        "ClusterName=reprotrain",
        "SlurmctldHost=localhost",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}",
        f"StateSaveLocation={folder / 'state'}",
        f"SlurmdSpoolDir={folder / 'spool'}",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
        f"SlurmdPidFile={folder / 'slurmd.pid'}",
        f"SlurmctldLogFile={folder / 'slurmctld.log'}",
        f"SlurmdLogFile={folder / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "ReturnToService=2",
        "MinJobAge=3600",  # finished jobs stay visible to squeue: there is no accounting
        node_line(),
        "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
    ]) + "\n"


def wait_until(check, timeout_s: float, what: str, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in logs if p.exists())
            raise RuntimeError(f"{what} not ready after {timeout_s}s\n{tails}")
        time.sleep(0.2)


@contextmanager
def slurm_cluster(folder: Path) -> Iterator[dict[str, str]]:
    """munged + slurmctld + slurmd on loopback for the duration; yields the environment the
    SLURM client commands need (SLURM_CONF). Jobs left running are cancelled at the end."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (Debian's slurm-wlm and munge; .ci/run installs "
                    "them)")
    if os.geteuid() != 0:
        pytest.skip("needs root: slurmd starts jobs as their users")
    folder.mkdir(parents=True, exist_ok=True)
    for sub in ("munge", "state", "spool"):
        (folder / sub).mkdir(mode=0o700, exist_ok=True)
    sockets = Path(tempfile.mkdtemp(prefix="munge-", dir="/tmp"))
    sockets.chmod(0o755)
    munge_socket = sockets / "munge.sock"
    conf = folder / "slurm.conf"
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs: list[subprocess.Popen] = []
    try:
        key = folder / "munge/munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
        procs.append(subprocess.Popen(
            ["munged", "--foreground", f"--socket={munge_socket}", f"--key-file={key}",
             f"--pid-file={folder / 'munge/munged.pid'}", f"--log-file={folder / 'munge/munged.log'}",
             f"--seed-file={folder / 'munge/munged.seed'}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_until(munge_socket.exists, 10, "munged", [folder / "munge/munged.log"])
        conf.write_text(slurm_conf(folder, munge_socket))
        logs = [folder / "slurmctld.log", folder / "slurmd.log"]
        for argv in (["slurmctld", "-D", "-f", conf], ["slurmd", "-D", "-f", conf, "-N", "localhost"]):
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))

        def node_idle() -> bool:
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited {p.returncode}:\n"
                                       + "\n".join(f.read_text()[-2000:] for f in logs if f.exists()))
            shown = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True,
                                   text=True)
            return shown.stdout.strip() == "idle"

        wait_until(node_idle, 30, "the SLURM node", logs)
        yield {"SLURM_CONF": str(conf)}
    finally:
        if len(procs) == 3:  # jobs' slurmstepd outlive slurmd: cancel them while it listens
            subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and subprocess.run(
                    ["squeue", "-h"], env=env, capture_output=True,
                    text=True).stdout.strip():
                time.sleep(0.2)
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(sockets, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> Iterator[dict[str, str]]:
    """One SLURM cluster for the test session; the environment its clients need."""
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as env:
        yield env
