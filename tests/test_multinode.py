"""Several machines for one training: two torchrun agents (`--nnodes=2`, c10d rendezvous), one
CPU process each, running the real train stage. On loopback, and in two network namespaces
joined by a veth pair: two real addresses, each "machine" mapping its hostname to 127.0.1.1
as Debian does, which is what breaks gloo and the rendezvous when nothing says otherwise."""

from __future__ import annotations

import contextlib
import json
import os
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

import pytest

from stages.data import save_prepared
from tests.conftest import ROOT, copy_params, env_with, run, set_params
from tests.support.services import free_port

HEAD, OTHER = "10.77.0.1", "10.77.0.2"


@dataclass
class Node:
    workspace: Path
    addr: str
    netns: str | None  # None: this machine's own network (loopback)


def workspace(folder: Path, digits, epochs: int) -> Path:
    """What each machine has after cloning and `dvc pull`: params and prepared data."""
    copy_params(folder)
    set_params(folder / "params.yaml", {"epochs": str(epochs)})
    save_prepared(folder / "data/prepared", *digits)
    return folder


def readme_command() -> str:
    """docs/multinode.md's "Several machines" command, less its example HEAD= ADDR= line."""
    text = (ROOT / "docs/multinode.md").read_text().split("**Several machines**", 1)[1]
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    first, command = block.split("\n", 1)
    assert first.startswith("HEAD=") and "ADDR=" in first
    return command


def torchrun(node: Node, head: Node, port: int, rdzv_id: str) -> list[str]:
    """The command as typed on `node`, on a port and rendezvous id of the test's own."""
    command = readme_command().replace(":29500", f":{port}").replace("train1", rdzv_id)
    # exec: the process the test starts (and kills) is torchrun's agent itself
    argv = ["bash", "-c", f"HEAD={head.addr} ADDR={node.addr}\nexec {command}"]
    return ["ip", "netns", "exec", node.netns, *argv] if node.netns else argv


def start(nodes: list[Node], rdzv_id: str, mlflow_uri: str,
          **extra_env: str) -> list[subprocess.Popen]:
    port = free_port()
    env = env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri, OMP_NUM_THREADS="1",
                   **extra_env)
    return [subprocess.Popen(torchrun(n, nodes[0], port, rdzv_id), cwd=n.workspace, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True) for n in nodes]


def finish(agents: list[subprocess.Popen], timeout: float = 120) -> list[str]:
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
    started = time.perf_counter()
    agents = start(nodes, "train", mlflow_uri)
    outputs = finish(agents)
    for a, out in zip(agents, outputs, strict=True):
        assert a.returncode == 0, out[-4000:]
    return outputs, time.perf_counter() - started


def metrics(node: Node) -> dict:
    return json.loads((node.workspace / "models/train/metrics.json").read_text())


@pytest.fixture(scope="module")
def one_process(digits, tmp_path_factory, mlflow_uri) -> dict:
    """The same training in one process: the reference both runs are held to."""
    w = workspace(tmp_path_factory.mktemp("single"), digits, epochs=4)
    run([sys.executable, "-m", "stages.train"], w,
        env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri, OMP_NUM_THREADS="1"))
    return json.loads((w / "models/train/metrics.json").read_text())


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
            with contextlib.suppress(OSError):  # another test's namespaces may still use it
                etc.rmdir()


@pytest.fixture
def two_machines() -> Iterator[tuple[str, str]]:
    why = netns_available()
    if why:
        pytest.skip(why)
    try:
        with network_namespaces() as names:
            yield names
    except subprocess.CalledProcessError as e:
        if not e.cmd or e.cmd[0] != "ip":
            raise
        pytest.skip(f"cannot make network namespaces here: {' '.join(e.cmd)}: "
                    f"{(e.stderr or '').strip()}")


def in_netns(ns: str, code: str) -> str:
    return run(["ip", "netns", "exec", ns, sys.executable, "-c", code], ROOT,
               env=env_with(PYTHONPATH=str(ROOT))).stdout.strip()


TOLERANCE = 0.03  # validation accuracy, as tests/test_distributed.py holds two processes to


def test_two_agents_on_loopback_train_like_one_process(digits, tmp_path, mlflow_uri, one_process):
    # Two addresses of this machine's loopback (127.0.0.0/8 is all lo), so that only one hosts
    nodes = [Node(workspace(tmp_path / n, digits, epochs=4), f"127.0.0.{i}", None)
             for i, n in ((1, "a"), (2, "b"))]
    outputs, _ = train_on(nodes, mlflow_uri)
    # c10d ignores --node-rank: ranks follow --local-addr as text; rank 0 alone writes outputs
    assert outputs[0].count("trained cnn") == 1 and "trained cnn" not in outputs[1]
    assert not (nodes[1].workspace / "models/train").exists()
    assert abs(metrics(nodes[0])["best_val_acc"] - one_process["best_val_acc"]) <= TOLERANCE


def test_two_agents_on_two_addresses_train_like_one_process(digits, tmp_path, mlflow_uri,
                                                            one_process, two_machines):
    head_ns, other_ns = two_machines
    # What makes this a test of real addresses: each side maps its hostname to 127.0.1.1, and
    # rank 0's address is reached through the veth, not loopback
    assert in_netns(other_ns, "import socket; print(socket.gethostbyname(socket.gethostname()))") \
        == "127.0.1.1"
    assert in_netns(other_ns, f"from stages.distributed import route_interface as r; print(r({HEAD!r}))") \
        == f"rt{os.getpid()}vb"
    head = Node(workspace(tmp_path / "head", digits, epochs=4), HEAD, head_ns)
    other = Node(workspace(tmp_path / "other", digits, epochs=4), OTHER, other_ns)
    outputs, _ = train_on([head, other], mlflow_uri)
    # Ranks sort by --local-addr: the head (10.77.0.1) is rank 0 and holds the outputs
    assert outputs[0].count("trained cnn") == 1 and "trained cnn" not in outputs[1]
    assert not (other.workspace / "models/train").exists()
    assert abs(metrics(head)["best_val_acc"] - one_process["best_val_acc"]) <= TOLERANCE


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
            assert agents[0].poll() is None and time.monotonic() < deadline, seen
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


def test_a_killed_agent_fails_the_other_in_bounded_time_and_a_rerun_resumes(
        digits, tmp_path, mlflow_uri, two_machines):
    head_ns, other_ns = two_machines
    head = Node(workspace(tmp_path / "head", digits, epochs=8), HEAD, head_ns)
    other = Node(workspace(tmp_path / "other", digits, epochs=8), OTHER, other_ns)
    code, error_s, exited_s, out = kill_the_other_agent(head, other, mlflow_uri)
    assert code != 0 and error_s < 10 and exited_s < 30, (error_s, exited_s, out[-3000:])
    # torchrun's agent prints its own report; the stage's is one line, no traceback of ours
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rank 0 of 2 lost contact with the training group" in errors[0], out
    assert "stages/" not in "".join(line for line in out.splitlines()
                                    if line.lstrip().startswith("File"))
    # The killed agent's worker went with it, rather than train on unwatched
    deadline = time.monotonic() + 10
    while subprocess.run(["ip", "netns", "pids", other_ns], capture_output=True, text=True).stdout:
        assert time.monotonic() < deadline, "the killed agent's worker outlived it"
        time.sleep(0.2)

    outputs, _ = train_on([head, other], mlflow_uri)  # the other machine has no checkpoint
    assert "resuming from" in outputs[0] and outputs[0].count("trained cnn") == 1, outputs[0]
    assert metrics(head)["epochs_run"] == 8


def test_a_wrong_interface_fails_each_machine_in_one_line(digits, tmp_path, mlflow_uri,
                                                                 two_machines):
    """GLOO_SOCKET_IFNAME naming an interface these machines lack (a typo, another machine's
    name): each process's gloo fails at the start, in one line that says where to look."""
    head_ns, other_ns = two_machines
    nodes = [Node(workspace(tmp_path / "head", digits, epochs=4), HEAD, head_ns),
             Node(workspace(tmp_path / "other", digits, epochs=4), OTHER, other_ns)]
    agents = start(nodes, "unreachable", mlflow_uri, GLOO_SOCKET_IFNAME="nonesuch0")
    outputs = finish(agents, timeout=60)
    for agent, out in zip(agents, outputs, strict=True):
        assert agent.returncode != 0
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "the training group could not connect" in errors[0], out
        assert "GLOO_SOCKET_IFNAME" in errors[0] and "docs/multinode.md" in errors[0]
        assert "stages/" not in "".join(line for line in out.splitlines()
                                        if line.lstrip().startswith("File"))
