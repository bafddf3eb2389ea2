"""Several machines for one training: two torchrun agents (`--nnodes=2`, c10d rendezvous), one
CPU process each, running the real train stage. On loopback, and in two network namespaces
joined by a veth pair: two real addresses, each "machine" mapping its hostname to 127.0.1.1
as Debian does, which is what breaks gloo and the rendezvous when nothing says otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from reprotrain.bench.netns import (
    HEAD,
    OTHER,
    Node,
    finish,
    kill_the_other_agent,
    metrics,
    netns_available,
    network_namespaces,
    start,
    train_on,
    workspace,
)
from tests.conftest import ROOT, env_with, run


@pytest.fixture(scope="module")
def one_process(digits, tmp_path_factory, mlflow_uri) -> dict:
    """The same training in one process: the reference both runs are held to."""
    w = workspace(tmp_path_factory.mktemp("single"), digits, epochs=4)
    run([sys.executable, "-m", "stages.train"], w,
        env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri, OMP_NUM_THREADS="1"))
    return json.loads((w / "models/train/metrics.json").read_text())


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


TOLERANCE = 0.03  # validation accuracy, as tests/experiment/test_distributed.py holds two processes to


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

    # One process in the head's workspace starts afresh: its weights would not be the two's.
    alone = run([sys.executable, "-m", "stages.train"], head.workspace,
                env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri))
    assert "resuming from" not in alone.stderr and "trained cnn" in alone.stdout, alone.stderr

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
