"""torch.distributed for the train stage: launch through torchrun, or join the group it made."""

from __future__ import annotations

import ctypes
import datetime
import fcntl
import os
import re
import signal
import socket
import struct
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from stages.config import ParamsError, TrainConfig, batch_share
from stages.lib.errors import UserError


def requested_processes(cfg: TrainConfig, batch_size: int) -> int:
    """train.nproc_per_node as a number, checked against this machine's GPUs: before any
    process starts, not as one traceback per rank."""
    n = max(1, torch.cuda.device_count()) if cfg.nproc_per_node == "auto" else int(cfg.nproc_per_node)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and cfg.device != "cpu" else 0
    # Each process needs a core of its own for its Python loop, on a GPU too: more only queue
    # for the CPU (1000 would start 1000 processes). Checked here, not in the schema: a
    # params.yaml for a 16-core GPU box stays valid on a laptop that only evaluates.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if n > cores:
        raise ParamsError(f"params.yaml: train.nproc_per_node={cfg.nproc_per_node!r} is invalid: "
                          f"this machine has {cores} CPU cores for this process: use at most "
                          "that many processes")
    if gpus and n > gpus:  # process i trains on GPU i (init)
        raise ParamsError(f"params.yaml: train.nproc_per_node={cfg.nproc_per_node!r} is invalid: "
                          f"each process takes a GPU of its own and {gpus} are visible; use at most "
                          f"{gpus}, or auto, or train.device: cpu")
    batch_share(batch_size, n, f"the {n} processes of train.nproc_per_node={cfg.nproc_per_node!r}")
    return n


def relaunch_under_torchrun(nproc: int, module: str) -> None:
    """Replace this process with torchrun running `python -m module` in `nproc` processes.
    exec, not a child: a signal to the stage (Ctrl-C, a CI cancel) reaches torchrun, which
    passes it to every worker."""
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", module]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, args)


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init(cfg: TrainConfig) -> tuple[int, int]:
    """(rank, world size) in the process group torchrun set up; (0, 1) outside one."""
    if not under_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        return 0, 1
    device = None
    if torch.cuda.is_available() and cfg.device != "cpu":
        # Each process's own GPU made current before the first collective, and named at init:
        # NCCL may otherwise hang, or put every process's buffers on GPU 0.
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_agent()
    if device is None and spans_machines() and "GLOO_SOCKET_IFNAME" not in os.environ:
        # Gloo binds to what this machine's hostname resolves to, which Debian maps to 127.0.1.1:
        # the other machines would be told to connect to their own loopback. The interface that
        # reaches rank 0's machine (MASTER_ADDR) is the one the others can reach us on.
        interface = route_interface(os.environ["MASTER_ADDR"])
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    # NCCL between GPUs, gloo between CPU processes; a bounded timeout so that a rank that died
    # does not leave the others waiting for the default 30 minutes.
    torch.distributed.init_process_group("nccl" if device else "gloo", device_id=device,
                                         timeout=datetime.timedelta(minutes=10))
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def shutdown() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@contextmanager
def group(cfg: TrainConfig) -> Iterator[tuple[int, int]]:
    """(rank, world size) for the duration, as `init`. Processes that cannot reach each other,
    or one that dies (a machine lost, a process killed), end this one with one line instead of
    a gloo traceback."""
    try:
        rank, world = init(cfg)
    except RuntimeError as e:
        if not network_error(e):
            raise
        raise UserError(f"the training group could not connect ({network_cause(e)}): on several "
                        "machines, each needs --local-addr=<its address> and the first one "
                        "--rdzv-conf=is_host=1, and GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME on "
                        "GPUs) names the interface that reaches the others; see docs/multinode.md "
                        "\"The several-machines command\"") from None
    try:
        yield rank, world
    except RuntimeError as e:
        if world == 1 or not network_error(e):
            raise
        raise UserError(f"rank {rank} of {world} lost contact with the training group "
                        f"({network_cause(e)}): another process or machine of it stopped (see "
                        "its log). Start torchrun again on every machine: training resumes from "
                        "rank 0's last checkpoint") from None
    finally:
        shutdown()


def network_error(e: RuntimeError) -> bool:
    """Whether a collective failed for want of the other processes: gloo raises plain
    RuntimeErrors naming its transport, NCCL and the store raise DistError."""
    text = str(e)
    return isinstance(e, torch.distributed.DistError) or "gloo/transport" in text \
        or "Connection closed by peer" in text or "Connection reset by peer" in text


def network_cause(e: RuntimeError) -> str:
    """gloo's first line, less its source locations and its advice: "Connection reset by peer"."""
    return re.sub(r"\[(?:enforce fail at )?[^] ]*:\d+\] ", "", str(e).splitlines()[0]) \
        .split(". This is")[0]


def from_rank0(value: Any) -> Any:
    """Rank 0's `value` on every rank (pickled: for the group's own processes only). An
    exception is raised on every rank, so that no rank waits for one that stopped."""
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


def die_with_agent() -> None:
    """SIGKILL for this process when its torchrun agent dies. torchrun starts workers in a
    session of their own, so a killed agent leaves them training on, unwatched: the other
    machines never learn of it, and a torchrun started again here would run a second rank 0
    over the same checkpoints."""
    if not sys.platform.startswith("linux"):
        return
    agent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != agent:  # it died before the request took hold
        os.kill(os.getpid(), signal.SIGKILL)


def spans_machines() -> bool:
    """Whether this torchrun group has processes on other machines (torchrun's nnodes > 1)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])) < int(os.environ["WORLD_SIZE"])


def route_interface(host: str) -> str | None:
    """The name of the network interface this machine reaches `host` through (IPv4); None when
    that cannot be told (GLOO_SOCKET_IFNAME then says it)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # a UDP connect sends nothing: the kernel only picks the route
            local = s.getsockname()[0]
            for _, name in socket.if_nameindex():
                try:  # SIOCGIFADDR: the interface's IPv4 address, in a struct ifreq
                    ifreq = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                except OSError:
                    continue  # no IPv4 address
                if socket.inet_ntoa(ifreq[20:24]) == local:
                    return name
    except OSError:
        pass
    return None
