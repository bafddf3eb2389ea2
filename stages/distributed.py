"""torch.distributed for the train stage: launch through torchrun, or join the group it made."""

from __future__ import annotations

import datetime
import os
import sys

import torch

from stages.config import ParamsError, TrainConfig


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
    if batch_size % n:  # an integer nproc_per_node is checked with the params; auto only here
        raise ParamsError(f"params.yaml: batch_size={batch_size} is invalid: must be a multiple of "
                          f"the {n} processes of train.nproc_per_node={cfg.nproc_per_node!r}: each "
                          "takes an equal share of the global batch")
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
    # NCCL between GPUs, gloo between CPU processes; a bounded timeout so that a rank that died
    # does not leave the others waiting for the default 30 minutes.
    torch.distributed.init_process_group("nccl" if device else "gloo", device_id=device,
                                         timeout=datetime.timedelta(minutes=10))
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def shutdown() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
