"""Two machines for one training, on one machine: two torchrun agents (`--nnodes=2`, c10d
rendezvous) running docs/multinode.md's "Several machines" command, one CPU process each, in
workspaces like a clone after `dvc pull`; on loopback, or in two network namespaces joined by a
veth pair (HEAD and OTHER), each mapping its hostname to 127.0.1.1 as Debian does.

Shared by tests/platform/test_multinode.py and the figures of `python -m reprotrain.bench.multinode`. Runs in
a checkout (it reads docs/multinode.md and the committed params.yaml); network namespaces need
root and iproute2's `ip`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reprotrain.ports import free_port
from stages.config import DataConfig
from stages.data import Split, save_prepared
from stages.sources import build_meta, from_arrays, load_digits

ROOT = Path(__file__).resolve().parents[2]
HEAD, OTHER = "10.77.0.1", "10.77.0.2"

Digits = tuple[dict[str, Split], dict]


@dataclass
class Node:
    workspace: Path
    addr: str
    netns: str | None  # None: this machine's own network (loopback)


def digits_data() -> Digits:
    """The digits as prepare splits them with the default params: (splits, meta)."""
    cfg = DataConfig()
    x, y, classes = load_digits()
    splits = from_arrays(x, y, cfg, seed=0)
    return splits, build_meta(splits, classes, cfg)


def committed_params() -> str:
    """params.yaml as HEAD has it, so that an experiment in progress in this checkout changes
    nothing; the working copy outside a git checkout."""
    shown = subprocess.run(["git", "show", "HEAD:params.yaml"], cwd=ROOT, capture_output=True,
                           text=True)
    return shown.stdout if shown.returncode == 0 else (ROOT / "params.yaml").read_text()


def workspace(folder: Path, digits: Digits, epochs: int) -> Path:
    """What each machine has after cloning and `dvc pull`: params and prepared data."""
    folder.mkdir(parents=True, exist_ok=True)
    params, found = re.subn(r"^epochs: .*$", f"epochs: {epochs}", committed_params(), count=1,
                            flags=re.MULTILINE)
    if not found:
        raise ValueError("params.yaml has no top-level `epochs:` line")
    (folder / "params.yaml").write_text(params)
    save_prepared(folder / "data/prepared", *digits)
    return folder


def readme_command() -> str:
    """docs/multinode.md's "Several machines" command, less its example HEAD= ADDR= line."""
    text = (ROOT / "docs/multinode.md").read_text().split("**Several machines**", 1)[1]
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    first, command = block.split("\n", 1)
    if not (first.startswith("HEAD=") and "ADDR=" in first):
        raise ValueError(f"docs/multinode.md's command no longer starts with HEAD= ADDR=: {first}")
    return command


def torchrun(node: Node, head: Node, port: int, rdzv_id: str) -> list[str]:
    """The command as typed on `node`, on a port and rendezvous id of the caller's own."""
    command = readme_command().replace(":29500", f":{port}").replace("train1", rdzv_id)
    # exec: the process started (and killed) is torchrun's agent itself
    argv = ["bash", "-c", f"HEAD={head.addr} ADDR={node.addr}\nexec {command}"]
    return ["ip", "netns", "exec", node.netns, *argv] if node.netns else argv


def agent_env(mlflow_uri: str, **extra: str) -> dict[str, str]:
    # Without the caller's DVC_ and MLFLOW_ variables: DVC_ROOT would move the agents' workspace
    # to the caller's, and each agent logs to `mlflow_uri` alone. PATH finds this venv's torchrun.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DVC_", "MLFLOW_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri, OMP_NUM_THREADS="1", **extra)
    return env


def start(nodes: list[Node], rdzv_id: str, mlflow_uri: str,
          **extra_env: str) -> list[subprocess.Popen[str]]:
    """One agent per node, the first the head; each in a session of its own, to kill whole."""
    port = free_port()
    env = agent_env(mlflow_uri, **extra_env)
    return [subprocess.Popen(torchrun(n, nodes[0], port, rdzv_id), cwd=n.workspace, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True) for n in nodes]


def finish(agents: list[subprocess.Popen[str]], timeout: float = 120) -> list[str]:
    """Each agent's output once it exited; any still running after `timeout` is killed."""
    outputs = []
    try:
        for a in agents:
            outputs.append(a.communicate(timeout=timeout)[0])
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
    return outputs


def train_on(nodes: list[Node], mlflow_uri: str) -> tuple[list[str], float]:
    """Train on `nodes` until every agent exited 0: (their outputs, wall seconds)."""
    started = time.perf_counter()
    agents = start(nodes, "train", mlflow_uri)
    outputs = finish(agents)
    for a, out in zip(agents, outputs, strict=True):
        if a.returncode != 0:
            raise RuntimeError(f"an agent exited {a.returncode}:\n{out[-4000:]}")
    return outputs, time.perf_counter() - started


def metrics(node: Node) -> dict[str, Any]:
    return json.loads((node.workspace / "models/train/metrics.json").read_text())


def netns_available() -> str | None:
    """Why network namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns add)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (apt-get install iproute2)"
    return None


@contextlib.contextmanager
def network_namespaces() -> Iterator[tuple[str, str]]:
    """Two network namespaces joined by a veth pair, HEAD and OTHER, each with its own
    /etc/hosts mapping this hostname to 127.0.1.1 (`ip netns exec` mounts /etc/netns/NAME/hosts
    over /etc/hosts). Yields their names; removed afterwards, whatever happened."""
    tag = f"rt{os.getpid()}"
    names = [f"{tag}a", f"{tag}b"]
    etc = Path("/etc/netns")
    made_etc = not etc.exists()
    made: list[str] = []
    try:
        for ns in names:
            subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, text=True)
            made.append(ns)
            (etc / ns).mkdir(parents=True, exist_ok=True)
            (etc / ns / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()}\n")
        for cmd in (["link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb"],
                    ["link", "set", f"{tag}va", "netns", names[0]],
                    ["link", "set", f"{tag}vb", "netns", names[1]],
                    ["-n", names[0], "addr", "add", f"{HEAD}/24", "dev", f"{tag}va"],
                    ["-n", names[1], "addr", "add", f"{OTHER}/24", "dev", f"{tag}vb"],
                    ["-n", names[0], "link", "set", f"{tag}va", "up"],
                    ["-n", names[1], "link", "set", f"{tag}vb", "up"],
                    ["-n", names[0], "link", "set", "lo", "up"],
                    ["-n", names[1], "link", "set", "lo", "up"]):
            subprocess.run(["ip", *cmd], check=True, capture_output=True, text=True)
        yield names[0], names[1]
    finally:
        for ns in made:  # the veth pair goes with its namespaces
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                      text=True).stdout.split():
                with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(etc / ns, ignore_errors=True)
        if made_etc:
            with contextlib.suppress(OSError):  # another caller's namespaces may still use it
                etc.rmdir()


def kill_the_other_agent(head: Node, other: Node, mlflow_uri: str) -> tuple[int, float, float, str]:
    """Start both agents, SIGKILL the other machine's torchrun agent (alone) once rank 0 is
    training: (the head's exit code, seconds until its stage's error line, seconds until its
    agent exited, its output)."""
    agents = start([head, other], "killed", mlflow_uri)
    seen: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: seen.extend((time.monotonic(), line)
                                                         for line in agents[0].stdout))
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any(line.startswith("epoch 2/") for _, line in seen):  # rank 0 is training
            if agents[0].poll() is not None or time.monotonic() >= deadline:
                raise RuntimeError("rank 0 never reached epoch 2:\n" +
                                   "".join(line for _, line in seen)[-3000:])
            time.sleep(0.05)
        os.kill(agents[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        agents[0].wait(timeout=120)
        exited_s = time.monotonic() - killed
        reader.join(timeout=30)
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
            a.wait()
    error_s = next((t - killed for t, line in seen if line.startswith("error:")), float("nan"))
    return agents[0].returncode, error_s, exited_s, "".join(line for _, line in seen)
