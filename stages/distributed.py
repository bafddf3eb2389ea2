"""torch.distributed for the train stage: launch through torchrun, or join the group it made."""

from __future__ import annotations

import datetime
import os
import sys

import torch

from stages.config import TrainConfig


def requested_processes(cfg: TrainConfig) -> int:
    if cfg.nproc_per_node == "auto":
        return max(1, torch.cuda.device_count())
    return int(cfg.nproc_per_node)


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
