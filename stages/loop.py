"""The training loop: `train` reads top to bottom, each step a named function below it.

Each optimization that changes what is computed is a switch in params.yaml's `train` section,
commented once where it happens with the reason it is there. Two only make the same arithmetic
faster and are always on: the fused optimizer (stages/optim.py) and TF32 matmuls on CUDA
(stages/runtime.py).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import math
import sys
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor, nn
from tqdm import tqdm

from stages.batches import (
    Batches,
    BatchPlan,
    Crop,
    augment,
    device_batches,
    epoch_order,
    loader_batches,
    plan_batches,
    random_resized_crop,
    windows,
)
from stages.checkpoints import CheckpointError, save_checkpoint
from stages.config import TrainConfig
from stages.data import Split, in_batches, normalize, resolve_loader
from stages.lib.errors import StageWarning, UserError
from stages.metrics import EPOCH, epoch_line
from stages.models import loss_fn
from stages.optim import EMA, Schedule, build_optimizer
from stages.runtime import (
    autocast,
    peak_mem_mb,
    predict,
    reset_peak_mem,
    resolve_device,
    resolve_precision,
    set_backends,
)


class Log(Protocol):
    """Where the loop's figures go. `durable`: stored before the call returns. An epoch's row
    is, since the checkpoint written next covers that epoch: a run killed after it and resumed
    would otherwise never log that epoch."""

    def __call__(self, metrics: dict[str, float], step: int, durable: bool = False) -> None: ...


CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that use CUDA graphs


def no_log(metrics: dict[str, float], step: int, durable: bool = False) -> None:
    pass


class NonFiniteLossError(UserError, RuntimeError):
    pass


class OutOfMemory(UserError, RuntimeError):
    pass


@dataclass(frozen=True, kw_only=True)
class Job:
    """What to train on and how, and this process's place in an initialized torch.distributed
    group (DDP)."""
    train: Split
    val: Split
    mean: list[float]
    std: list[float]
    cfg: TrainConfig
    lr: float
    epochs: int
    batch_size: int  # the global batch, split evenly across the processes
    seed: int
    rank: int = 0
    world: int = 1


@dataclass(frozen=True, kw_only=True)
class RunIO:
    """What the run reads and writes besides the model: its log, its checkpoints (and the one
    it resumes from), its printout."""
    log: Log = no_log
    ckpt_dir: Path | None = None  # None: no checkpoints
    resume: dict | None = None  # a checkpoint of this run to go on from
    extra_state: dict | None = None  # goes into every checkpoint as is
    progress: bool | None = None  # the tqdm bar; None: when stderr is a terminal
    verbose: bool = True  # a line per epoch, and why it stopped early


@dataclass(kw_only=True)
class TrainResult:
    model: nn.Module  # the uncompiled module holding the best (or EMA) weights
    history: list[dict] = field(default_factory=list)
    best_epoch: int = 0
    best_val_acc: float = 0.0
    best_val_loss: float = math.inf
    epochs_run: int = 0
    stopped_early: bool = False
    device: str = "cpu"
    precision: str = "fp32"
    loader: str = "device"
    loop_s: float = 0.0  # the epochs, set-up excluded


@dataclass(kw_only=True)
class Setup:
    """What stays fixed for the whole run, derived from the job."""
    job: Job
    device: torch.device
    precision: str
    fmt: torch.memory_format
    mean: Tensor
    std: Tensor
    train: Split  # the training split; in overfit mode a few fixed batches of it
    shuffle: bool
    pad: int  # augmentation: random-crop padding (0: off)
    hflip: bool
    crop: Crop | None  # the random-resized crop's ranges (None: off)
    loader: str  # train.loader, auto resolved
    plan: BatchPlan
    val: Iterable[Tensor]  # the validation split's batches, its workers kept across epochs

    @property
    def cfg(self) -> TrainConfig:
        return self.job.cfg


@dataclass(kw_only=True)
class Parts:
    """What the steps update."""
    model: nn.Module  # the plain module: its weights are what is saved
    net: nn.Module  # what runs the forward pass: `model`, wrapped by DDP and/or compiled
    ddp: nn.parallel.DistributedDataParallel | None
    ema: EMA | None
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    criterion: nn.Module
    schedule: Schedule

    @property
    def evaluated(self) -> nn.Module:
        """The weights that validation judges and the run keeps: the EMA's when there is one."""
        return self.ema.module if self.ema is not None else self.model


@dataclass(kw_only=True)
class LoopState:
    """Everything besides the modules that a checkpoint carries, so that a resumed run ends
    where an uninterrupted one would."""
    epoch: int = 0  # epochs completed
    step: int = 0  # optimizer steps taken
    bad_epochs: int = 0  # epochs since validation last improved
    history: list[dict] = field(default_factory=list)
    best_score: tuple[float, float] = (-1.0, -math.inf)  # (val_acc, -val_loss)
    best_epoch: int = 0
    best_state: dict | None = None
    last_ckpt: Path | None = None  # not saved: where this state was last written
    stopped_early: bool = False  # not saved


@dataclass
class EpochSums:
    """An epoch's running totals. The tensors stay on the device: .item() is a host-device
    sync, so it happens once, at the epoch's end."""
    loss: Tensor
    grad_norm: Tensor
    finite_norms: Tensor  # steps whose gradient norm was finite
    correct: Tensor
    seen: int = 0
    lr: float = 0.0  # the last step's

    @classmethod
    def zeros(cls, device: torch.device) -> EpochSums:
        zero = functools.partial(torch.zeros, (), device=device)
        return cls(zero(), zero(), zero(dtype=torch.long), zero(dtype=torch.long))


def _explain_oom(fn):
    """An out-of-memory error says what to change, in the params' own names."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except torch.OutOfMemoryError as e:
            raise OutOfMemory(f"out of memory while training ({str(e).splitlines()[0]}). Lower "
                              "batch_size, or keep the effective batch with a smaller batch_size "
                              "and a larger train.accumulate") from e

    return wrapper


@_explain_oom
def train(model: nn.Module, job: Job, io: RunIO = RunIO()) -> TrainResult:
    """Train `model` in place; returns it with the best weights by validation accuracy."""
    setup = set_up(job)
    batches = batch_source(setup)
    parts = build_parts(model, setup)
    state = restore(io.resume, parts, setup) if io.resume is not None else LoopState()
    guard = NonFiniteGuard(setup.device, job.world > 1)
    loop_start = time.perf_counter()

    for epoch in range(state.epoch, job.epochs):
        # Dropout draws from a generator seeded per (seed, epoch, rank): each process has its
        # own stream, and a resumed epoch replays without restoring any RNG state.
        torch.manual_seed(epoch_seed(job.seed, epoch, job.rank))
        t0 = time.perf_counter()
        reset_peak_mem(setup.device)
        sums = train_epoch(setup, parts, state, guard, batches(epoch), epoch, io)
        figures = epoch_figures(sums, setup, state, guard, epoch, t0)
        share_batchnorm(parts, job.world)
        figures |= validate(parts, job.val, setup)
        figures |= {"epoch_s": time.perf_counter() - t0, "peak_mem_mb": peak_mem_mb(setup.device)}
        row = epoch_row(epoch, figures)
        report_epoch(row, state, io, job)
        if end_epoch(row, state, parts, setup, io):
            break

    return result(parts, state, setup, time.perf_counter() - loop_start)


# ---------------------------------------------------------------- setting up


def set_up(job: Job) -> Setup:
    cfg = job.cfg
    device = resolve_device(cfg.device)
    if job.world > 1 and device.type == "cuda":  # each process's own GPU, made current at init
        device = torch.device("cuda", torch.cuda.current_device())
    set_backends(cfg.deterministic)
    # channels_last lets conv kernels (oneDNN on CPU, cuDNN tensor cores) skip layout
    # transposes; it pays together with bf16 (docs/performance.md).
    fmt = torch.channels_last if cfg.channels_last else torch.contiguous_format
    loader = resolve_loader(cfg, [job.train, job.val])
    # Overfit mode proves that the model can learn at all: a few fixed batches, in order, not
    # augmented.
    overfit = cfg.overfit_batches > 0
    train_split = job.train
    if overfit:
        keep = epoch_order(len(train_split.y), job.seed, 0)[:cfg.overfit_batches * job.batch_size]
        train_split = Split(train_split.x[keep], train_split.y[keep])
        loader = "dataloader" if loader == "stream" else loader  # decoded now, kept as tensors
    plan = plan_batches(len(train_split.y), job.batch_size, job.world, cfg.accumulate)
    return Setup(job=job, device=device, precision=resolve_precision(cfg.precision, device),
                 fmt=fmt, mean=torch.tensor(job.mean, device=device),
                 std=torch.tensor(job.std, device=device), train=train_split, shuffle=not overfit,
                 pad=0 if overfit else cfg.augment_crop_pad,
                 hflip=cfg.augment_hflip and not overfit,
                 crop=None if overfit else random_resized_crop(cfg), loader=loader, plan=plan,
                 val=in_batches(job.val, max(job.batch_size, 256), cfg))


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    digest = hashlib.sha256(f"{seed}/{epoch}/{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # manual_seed takes a signed 64-bit value


def batch_source(setup: Setup) -> Batches:
    job = setup.job
    args = (setup.train, setup.plan, setup.device, job.seed, setup.shuffle, job.rank, job.world)
    if setup.loader == "device":
        return device_batches(*args)
    return loader_batches(*args, setup.cfg.num_workers, setup.crop, streamed=setup.loader == "stream")


def build_parts(model: nn.Module, setup: Setup) -> Parts:
    """The model wrapped for the run, with its optimizer, loss scaler, EMA, loss and schedule."""
    cfg, device, lr = setup.cfg, setup.device, setup.job.lr
    model.to(device, memory_format=setup.fmt)
    # DDP all-reduces gradients bucket by bucket while the backward pass is still running.
    ddp = nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None) \
        if setup.job.world > 1 else None
    # torch.compile fuses kernels; weights are saved from `model`, the uncompiled module.
    net = ddp or model
    if cfg.compile:
        net = torch.compile(net, mode=None if cfg.compile is True else cfg.compile)
    ema = EMA(model, cfg.ema_decay) if cfg.ema else None
    if cfg.compile in CUDA_GRAPH_MODES:
        # CUDA graphs must not allocate `.grad` inside their capture: zeroed gradients from the
        # start, kept (zeroed, not freed) after every step.
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    # Loss scaling only for fp16: bf16 has fp32's exponent range, gradients do not underflow.
    scaler = torch.amp.GradScaler(device.type, enabled=setup.precision == "fp16")
    return Parts(model=model, net=net, ddp=ddp, ema=ema,
                 optimizer=build_optimizer(model, cfg, lr, device), scaler=scaler,
                 criterion=loss_fn(cfg.label_smoothing),
                 schedule=Schedule(cfg, lr, setup.plan.steps_per_epoch, setup.job.epochs))


# ---------------------------------------------------------------- one epoch, one step


def train_epoch(setup: Setup, parts: Parts, state: LoopState, guard: NonFiniteGuard,
                batches: Batches, epoch: int, io: RunIO) -> EpochSums:
    sums = EpochSums.zeros(setup.device)
    t0 = time.perf_counter()
    shown = (sys.stderr.isatty() if io.progress is None else io.progress) and setup.job.rank == 0
    bar = tqdm(total=setup.plan.steps_per_epoch, desc=f"epoch {epoch + 1}/{setup.job.epochs}",
               leave=False, disable=not shown, dynamic_ncols=True)
    parts.model.train()  # validation left it in eval mode
    for window in windows(batches, setup.plan):
        window_loss, n = forward_backward(setup, parts, window, epoch, sums)
        lr = parts.schedule.lr_at(state.step)
        grad_norm = optimizer_step(parts, setup.cfg, lr)
        # fp16 loss scaling skips a step whose gradients overflowed: its inf norm is not counted.
        finite = torch.isfinite(grad_norm)
        sums.grad_norm += torch.where(finite, grad_norm, 0.0)
        sums.finite_norms += finite
        guard.check(window_loss, state.step, epoch, lr, state.last_ckpt)
        state.step += 1
        sums.lr = lr
        if state.step % setup.cfg.log_every == 0:
            step_loss = window_loss.item() / n
            io.log({"train_loss_step": step_loss, "lr_step": lr}, state.step)
            bar.set_postfix(loss=f"{step_loss:.4f}", lr=f"{lr:.2e}",
                            samples_s=f"{sums.seen / (time.perf_counter() - t0):.0f}")
        bar.update()
    bar.close()
    return sums


def forward_backward(setup: Setup, parts: Parts, window: list, epoch: int,
                     sums: EpochSums) -> tuple[Tensor, int]:
    """Gradients of one optimizer step, accumulated over its micro-batches."""
    window_n = sum(len(y) for _, y, _ in window)
    window_loss = torch.zeros((), device=setup.device)
    for i, (x, y, idx) in enumerate(window):
        # Augmentation keyed by (seed, epoch, sample index), batched on the device; a streamed
        # batch came through its resized crops in the workers.
        crop = setup.crop if setup.loader != "stream" else None
        if setup.pad or setup.hflip or crop:
            x = augment(x, idx, setup.job.seed, epoch, setup.pad, setup.hflip, crop)
        x = normalize(x, setup.mean, setup.std).contiguous(memory_format=setup.fmt)
        # DDP: gradients are all-reduced once per window, on its last micro-batch.
        last = i == len(window) - 1
        with parts.ddp.no_sync() if parts.ddp and not last else contextlib.nullcontext():
            with autocast(setup.device, setup.precision):
                logits = parts.net(x)
            loss = parts.criterion(logits.float(), y)
            # Weighted by the micro-batch's share of the window: the accumulated gradient
            # equals one batch of window_n samples, also for a short window.
            parts.scaler.scale(loss * (len(y) / window_n)).backward()
        window_loss += loss.detach() * len(y)
        sums.correct += (logits.argmax(1) == y).sum()
    sums.loss += window_loss
    sums.seen += window_n
    return window_loss, window_n


def optimizer_step(parts: Parts, cfg: TrainConfig, lr: float) -> Tensor:
    """Clip, step, update the EMA; returns the gradient norm before clipping."""
    # Unscale before clipping, so the threshold applies to the true gradient (fp16 only).
    parts.scaler.unscale_(parts.optimizer)
    grad_norm = nn.utils.clip_grad_norm_(
        parts.model.parameters(), cfg.clip_grad_norm if cfg.clip_grad_norm > 0 else math.inf)
    for group in parts.optimizer.param_groups:
        group["lr"] = lr
    parts.scaler.step(parts.optimizer)
    parts.scaler.update()
    # set_to_none frees the gradient memory and skips a zero-fill kernel; CUDA graphs keep
    # theirs (see `wrap`).
    parts.optimizer.zero_grad(set_to_none=cfg.compile not in CUDA_GRAPH_MODES)
    if parts.ema is not None:
        parts.ema.update(parts.model)
    return grad_norm


class NonFiniteGuard:
    """Stops the run within one step of a non-finite loss. On the CPU reading the flag is free;
    on CUDA it goes to pinned memory asynchronously and is read one step later, so the GPU
    queue never drains."""

    def __init__(self, device: torch.device, distributed: bool):
        self.device, self.distributed = device, distributed
        self.flag = torch.zeros((), dtype=torch.bool, pin_memory=device.type == "cuda")
        self.pending: tuple[torch.cuda.Event, int, int, float] | None = None

    def check(self, loss: Tensor, step: int, epoch: int, lr: float, last_ckpt: Path | None) -> None:
        if self.pending is not None:
            event, *where = self.pending
            event.synchronize()
            if self.flag.item():
                raise NonFiniteLossError(nonfinite_message(*where, last_ckpt))
        bad = (~torch.isfinite(loss)).float()
        if self.distributed:  # every rank stops at the same step, or the others wait forever
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        self.flag.copy_(bad > 0, non_blocking=True)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self.pending = (event, step, epoch, lr)
        elif self.flag.item():
            raise NonFiniteLossError(nonfinite_message(step, epoch, lr, last_ckpt))

    def epoch_checked(self) -> None:
        self.pending = None  # the epoch's last step is checked by its loss sum


def nonfinite_message(step: int, epoch: int, lr: float, last_ckpt: Path | None) -> str:
    kept = f"the last good checkpoint is {last_ckpt}" if last_ckpt else "no checkpoint was written yet"
    return (f"non-finite loss at step {step} (epoch {epoch + 1}, lr {lr:.3g}); {kept}. "
            "Try a lower lr, check the data for NaN/inf values, or set train.clip_grad_norm.")


# ---------------------------------------------------------------- the end of an epoch


def epoch_figures(sums: EpochSums, setup: Setup, state: LoopState, guard: NonFiniteGuard,
                  epoch: int, t0: float) -> dict[str, float]:
    """The epoch's training figures, loss and accuracy over all processes."""
    loss, correct, seen = sums.loss, sums.correct, sums.seen
    if setup.job.world > 1:
        totals = torch.stack([loss, correct.to(loss.dtype)])
        torch.distributed.all_reduce(totals)
        loss, correct, seen = totals[0], totals[1], seen * setup.job.world
    train_loss = loss.item() / seen  # one sync per epoch
    if not math.isfinite(train_loss):
        raise NonFiniteLossError(nonfinite_message(state.step - 1, epoch, sums.lr, state.last_ckpt))
    guard.epoch_checked()
    return {"train_loss": train_loss, "train_acc": float(correct) / seen, "lr": sums.lr,
            "grad_norm": sums.grad_norm.item() / int(sums.finite_norms)
            if sums.finite_norms else math.nan,
            "samples_per_s": sums.seen / (time.perf_counter() - t0)}  # after the sync


def share_batchnorm(parts: Parts, world: int) -> None:
    """BatchNorm statistics are per process: every process validates with rank 0's, so they
    all see the same val_acc and take the same best-epoch and early-stopping decisions."""
    if world == 1:
        return
    for module in (parts.model, parts.ema.module if parts.ema is not None else None):
        for buffer in module.buffers() if module is not None else []:
            torch.distributed.broadcast(buffer, 0)


def validate(parts: Parts, split: Split, setup: Setup) -> dict[str, float]:
    net = parts.ema.module if parts.ema is not None else parts.net
    logits = predict(net, setup.val, setup.mean, setup.std, device=setup.device,
                     precision=setup.precision, channels_last=setup.cfg.channels_last)
    loss, acc = loss_fn()(logits, split.y).item(), (logits.argmax(1) == split.y).float().mean().item()
    if setup.job.world > 1:
        # Rank 0's figures for every process: they decide the best epoch, plateau cuts and early
        # stopping, and one ULP of difference (cudnn.benchmark tunes per process) would split
        # the decisions, drift the lr apart or leave the others waiting for a stopped rank.
        figures = torch.tensor([loss, acc], dtype=torch.float64, device=setup.device)
        torch.distributed.broadcast(figures, 0)
        loss, acc = figures.tolist()
    return {"val_loss": loss, "val_acc": acc}


def epoch_row(epoch: int, figures: dict[str, float]) -> dict:
    """The figures in stages/metrics.py's EPOCH order, which must declare exactly these."""
    if figures.keys() != EPOCH.keys():
        raise RuntimeError(f"epoch figures {sorted(figures.keys() ^ EPOCH.keys())}: computed in "
                           "stages/loop.py or declared in stages/metrics.py EPOCH, not both")
    return {"epoch": epoch + 1} | {name: figures[name] for name in EPOCH}


def report_epoch(row: dict, state: LoopState, io: RunIO, job: Job) -> None:
    state.history.append(row)
    io.log({name: row[name] for name in EPOCH}, row["epoch"], durable=True)
    if io.verbose and job.rank == 0:
        print(epoch_line(row, job.epochs), file=sys.stderr, flush=True)


def end_epoch(row: dict, state: LoopState, parts: Parts, setup: Setup, io: RunIO) -> bool:
    """Keep the best weights, adjust the schedule, write a checkpoint; True to stop early."""
    keep_best(state, parts, row)
    parts.schedule.after_validation(state.bad_epochs)
    state.epoch = row["epoch"]
    rank0 = setup.job.rank == 0
    if io.ckpt_dir is not None and rank0:
        state.last_ckpt = save_checkpoint(checkpoint_state(parts, state, setup, io.extra_state),
                                          io.ckpt_dir, state.epoch)
    patience = setup.cfg.early_stopping_patience
    state.stopped_early = bool(patience) and state.bad_epochs >= patience
    if state.stopped_early and io.verbose and rank0:
        print(f"early stopping: no val_acc improvement for {state.bad_epochs} epochs",
              file=sys.stderr)
    return state.stopped_early


def keep_best(state: LoopState, parts: Parts, row: dict) -> None:
    """Best by validation accuracy, ties broken by lower validation loss."""
    score = (row["val_acc"], -row["val_loss"])
    if score > state.best_score:
        state.best_score, state.best_epoch, state.bad_epochs = score, row["epoch"], 0
        state.best_state = {k: v.detach().cpu().clone() for k, v in parts.evaluated.state_dict().items()}
    else:
        state.bad_epochs += 1


def result(parts: Parts, state: LoopState, setup: Setup, loop_s: float) -> TrainResult:
    final = parts.evaluated
    if state.best_state is not None:
        final.load_state_dict(state.best_state)
    return TrainResult(
        model=copy.deepcopy(final).cpu().to(memory_format=torch.contiguous_format),
        history=state.history, best_epoch=state.best_epoch, best_val_acc=state.best_score[0],
        best_val_loss=-state.best_score[1], epochs_run=len(state.history),
        stopped_early=state.stopped_early, device=str(setup.device),
        precision=setup.precision, loader=setup.loader, loop_s=loop_s)


# ---------------------------------------------------------------- the checkpoint: written and restored here


def checkpoint_state(parts: Parts, state: LoopState, setup: Setup, extra: dict | None) -> dict:
    return {
        "model": parts.model.state_dict(), "optimizer": parts.optimizer.state_dict(),
        "scaler": parts.scaler.state_dict(),
        "ema": parts.ema.state_dict() if parts.ema is not None else None,
        "device": setup.device.type, "precision": setup.precision,
        "schedule": parts.schedule.state_dict(),
        "epoch": state.epoch, "step": state.step, "bad_epochs": state.bad_epochs,
        "history": state.history, "best_score": list(state.best_score),
        "best_epoch": state.best_epoch, "best_state": state.best_state,
        **(extra or {}),
    }


def restore(ckpt: dict, parts: Parts, setup: Setup) -> LoopState:
    try:
        parts.model.load_state_dict(ckpt["model"])
        parts.optimizer.load_state_dict(ckpt["optimizer"])
        if ckpt["scaler"] and parts.scaler.is_enabled():  # {} when it was saved disabled
            parts.scaler.load_state_dict(ckpt["scaler"])
        if parts.ema is not None:
            parts.ema.load_state_dict(ckpt["ema"])
        parts.schedule.load_state_dict(ckpt["schedule"])
        was = (ckpt["device"], ckpt["precision"])
        state = LoopState(epoch=ckpt["epoch"], step=ckpt["step"], bad_epochs=ckpt["bad_epochs"],
                          history=list(ckpt["history"]), best_score=tuple(ckpt["best_score"]),
                          best_epoch=ckpt["best_epoch"], best_state=ckpt["best_state"],
                          last_ckpt=Path(ckpt["path"]) if "path" in ckpt else None)
    except (KeyError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"{ckpt.get('path', 'the checkpoint')} does not fit this run "
                              f"({type(e).__name__}: {e}); to start afresh, set train.resume: "
                              "never") from e
    if setup.job.rank == 0:
        print(f"resuming from {ckpt.get('path', 'checkpoint')} at epoch {state.epoch + 1}",
              file=sys.stderr)
        now = (setup.device.type, setup.precision)
        if was != now:  # `auto` resolved otherwise on this machine
            warnings.warn(f"the checkpoint was trained in {was[1]} on {was[0]}, this run is "
                          f"{now[1]} on {now[0]}: it goes on, but will not end bitwise where an "
                          "uninterrupted run would. Set train.device and train.precision to "
                          "the checkpoint's to match it", StageWarning, stacklevel=2)
    return state
