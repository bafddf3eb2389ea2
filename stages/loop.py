"""The training loop: one function, `train`, readable top to bottom, plus the small pure pieces it uses.

Each optimization is switchable from the `train` section of params.yaml and commented once, where
it happens, with the reason it is there.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import math
import os
import resource
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from stages.config import TrainConfig, UserError
from stages.data import EpochSampler, IndexedDataset, Split, augment, epoch_order, normalize, rank_order
from stages.files import save_torch, write_text

Log = Callable[[dict[str, float], int], None]


def no_log(metrics: dict[str, float], step: int) -> None:
    pass


class NonFiniteLossError(UserError, RuntimeError):
    pass


# ---------------------------------------------------------------- resolving "auto" settings


def resolve_device(name: str) -> torch.device:
    if name != "auto":
        if name.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"train.device={name!r} but CUDA is not available; use auto or cpu")
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def cpu_has_bf16() -> bool:
    """AMX or AVX512-BF16: the CPUs where bf16 autocast runs native kernels rather than emulated."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_precision(name: str, device: torch.device) -> str:
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if device.type == "cpu" and cpu_has_bf16():
        return "bf16"
    return "fp32"


AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_loader(cfg: TrainConfig, splits: list[Split]) -> str:
    if cfg.loader != "auto":
        return cfg.loader
    size_mb = sum(s.x.numel() * s.x.element_size() for s in splits) / 2**20
    return "device" if size_mb <= cfg.device_data_budget_mb else "dataloader"


def resolve_workers(cfg: TrainConfig) -> int:
    if cfg.num_workers != "auto":
        return int(cfg.num_workers)
    # One core stays with the training process; more than 8 workers rarely pays for small images.
    return max(0, min(8, (os.cpu_count() or 1) - 1))


def seed_worker(worker_id: int) -> None:
    """numpy and random in a worker from the seed torch derived for it (base seed + worker id)."""
    import random

    import numpy as np

    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


# ---------------------------------------------------------------- schedule and optimizer


def lr_at(step: int, *, lr: float, total_steps: int, warmup_steps: int, min_lr: float,
          schedule: str, steps_per_epoch: int, step_epochs: int, step_gamma: float) -> float:
    """The learning rate of optimizer step `step` (0-based): linear warmup, then the schedule."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "cosine":
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps - 1)
        return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    if schedule == "step":
        return lr * step_gamma ** (step // (step_epochs * steps_per_epoch))
    return lr  # constant, and plateau (its reductions are a factor kept by the loop)


def build_optimizer(model: nn.Module, cfg: TrainConfig, lr: float,
                    device: torch.device) -> torch.optim.Optimizer:
    # No weight decay on norm weights and biases: decaying them only fights the normalization.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # Fused kernels update every parameter in one pass instead of a loop of small ops: on this
    # 2-core CPU 0.23 ms instead of 0.82 ms per AdamW step at width 32, 0.51 instead of 1.78 at 64.
    fused = True if device.type in ("cuda", "cpu") else None
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum,
                               nesterov=cfg.nesterov and cfg.momentum > 0, fused=fused)
    return torch.optim.AdamW(groups, lr=lr, fused=fused)


# ---------------------------------------------------------------- checkpoints


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def save_checkpoint(state: dict, ckpt_dir: Path, epoch: int, keep: int = 2) -> Path:
    """Atomic (temp file, then rename) with a checksum beside it; the last `keep` are kept."""
    path = ckpt_dir / f"epoch-{epoch:04d}.pt"
    save_torch(path, state)
    # The checksum is written last: a checkpoint without one was never finished.
    write_text(path.with_suffix(".sha256"), _sha256(path) + "\n")
    for old in sorted(ckpt_dir.glob("epoch-*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
        old.with_suffix(".sha256").unlink(missing_ok=True)
    return path


class CheckpointError(UserError, RuntimeError):
    pass


def latest_checkpoint(ckpt_dir: Path) -> dict | None:
    """The newest checkpoint that verifies and loads; a broken one is skipped with a warning.
    None when there is none; an error when there are some but none is usable: a silent restart
    from scratch would throw away the run."""
    for stale in ckpt_dir.glob(".*.tmp.pt"):  # left by a kill mid-write: never used, removed
        stale.unlink(missing_ok=True)
    found = sorted(ckpt_dir.glob("epoch-*.pt"), reverse=True)
    for path in found:
        digest = path.with_suffix(".sha256")
        try:
            if not digest.exists() or digest.read_text().strip() != _sha256(path):
                raise ValueError("checksum missing or does not match (truncated or corrupted)")
            state = torch.load(path, map_location="cpu", weights_only=True)
            state["path"] = str(path)
            return state
        except Exception as e:  # noqa: BLE001 - any unreadable checkpoint: fall back to the previous
            warnings.warn(f"checkpoint {path} is unusable ({type(e).__name__}: {e}); "
                          "falling back to an older one", stacklevel=2)
    if found:
        raise CheckpointError(f"no usable checkpoint among {', '.join(str(p) for p in found)}; "
                              "to start this run afresh, set train.resume: never")
    return None


# ---------------------------------------------------------------- evaluation


@torch.inference_mode()
def predict(model: nn.Module, split: Split, mean: Tensor, std: Tensor, *, device: torch.device,
            precision: str = "fp32", batch_size: int = 512,
            channels_last: bool = False) -> Tensor:
    """Logits (float32, on the CPU) for a whole split, in order."""
    model.eval()
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = []
    for i in range(0, len(split.y), batch_size):
        x = split.x[i:i + batch_size].to(device, non_blocking=True)
        x = normalize(x, mean, std).contiguous(memory_format=fmt)
        with torch.autocast(device.type, AMP_DTYPES.get(precision, torch.float32),
                            enabled=precision in AMP_DTYPES):
            out.append(model(x).float())
    return torch.cat(out).cpu()


# ---------------------------------------------------------------- the loop


@dataclass
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
    train_s: float = 0.0


class OutOfMemory(UserError, RuntimeError):
    pass


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


def reset_peak_mem(device: torch.device) -> bool:
    """Start a new peak-memory window for `peak_mem_mb`; False where the platform cannot, and
    the CPU figure is then the process's lifetime peak."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    # On the CPU the kernel keeps the resident high-water mark itself (VmHWM); writing 5 to
    # clear_refs restarts it: exact, free, and no sampling thread competing with the compute.
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def proc_status_mb(key: str) -> float | None:
    """A memory line of /proc/self/status (VmRSS, VmHWM) in MiB; None off Linux."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return None
    return next((int(line.split()[1]) / 1024 for line in lines if line.startswith(key + ":")), None)


def peak_mem_mb(device: torch.device) -> float:
    """Peak memory since `reset_peak_mem`: CUDA's allocated bytes, the CPU's resident memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    hwm = proc_status_mb("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@_explain_oom
def train(model: nn.Module, train_split: Split, val_split: Split, mean: list[float],
          std: list[float], cfg: TrainConfig, *, lr: float, epochs: int, batch_size: int,
          seed: int, log: Log = no_log, ckpt_dir: Path | None = None,
          resume: dict | None = None, extra_state: dict | None = None,
          progress: bool | None = None, verbose: bool = True, rank: int = 0,
          world: int = 1) -> TrainResult:
    """Train `model` in place; returns it with the best weights by validation accuracy.

    `progress`: the tqdm bar (default: when stderr is a terminal); `verbose`: a line per epoch.
    `rank`/`world`: this process in an initialized torch.distributed group (DDP); `batch_size`
    is then the global batch, split evenly across the processes.
    """
    distributed = world > 1
    if batch_size % world:
        raise ValueError(f"batch_size={batch_size} is the global batch: it must divide evenly "
                         f"among the {world} processes")
    device = resolve_device(cfg.device)
    if distributed and device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    precision = resolve_precision(cfg.precision, device)
    loader = resolve_loader(cfg, [train_split, val_split])
    amp_dtype = AMP_DTYPES.get(precision)

    if cfg.deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; set before its first use.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # warn_only: a CUDA op without a deterministic kernel warns instead of killing the run.
        torch.use_deterministic_algorithms(True, warn_only=True)
        # ...but not its NaN-filling of every torch.empty, a debugging aid: 10% of a CPU step
        # here (profiled), and no kernel we use reads memory it did not write.
        torch.utils.deterministic.fill_uninitialized_memory = False
        torch.backends.cudnn.deterministic = True
    # cudnn.benchmark picks the fastest conv algorithm per shape, but that choice is not repeatable.
    torch.backends.cudnn.benchmark = not cfg.deterministic
    # TF32 matmuls on Ampere+: ~8x the fp32 throughput for a 10-bit mantissa, harmless for training.
    torch.set_float32_matmul_precision("high")

    mean_t = torch.tensor(mean, device=device)
    std_t = torch.tensor(std, device=device)
    # channels_last lets conv kernels (oneDNN on CPU, cuDNN tensor cores) skip layout transposes;
    # it pays together with bf16: `make bench` here, CIFAR-sized, bf16 alone about 2x the
    # samples/s of the standard loop, with channels_last and device-resident data about 2.8x.
    fmt = torch.channels_last if cfg.channels_last else torch.contiguous_format
    model.to(device, memory_format=fmt)
    # DDP all-reduces gradients bucket by bucket while the backward pass is still running.
    ddp = nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None) if distributed else None
    # torch.compile fuses kernels; weights are saved from `model`, the uncompiled module.
    net = ddp or model
    net = torch.compile(net, mode=None if cfg.compile is True else cfg.compile) if cfg.compile else net
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(cfg.ema_decay),
        use_buffers=True) if cfg.ema else None
    optimizer = build_optimizer(model, cfg, lr, device)
    # Loss scaling only for fp16: bf16 has fp32's exponent range, gradients do not underflow.
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)

    # Overfit mode: a few fixed batches, no augmentation, to prove the model can learn at all.
    if cfg.overfit_batches:
        keep = epoch_order(len(train_split.y), seed, 0)[:cfg.overfit_batches * batch_size]
        train_split = Split(train_split.x[keep], train_split.y[keep])
    shuffle = not cfg.overfit_batches
    pad = 0 if cfg.overfit_batches else cfg.augment_crop_pad
    hflip = cfg.augment_hflip and not cfg.overfit_batches

    n = len(train_split.y)
    local_bs, per_rank = batch_size // world, n // world
    sizes = [min(local_bs, per_rank - i) for i in range(0, per_rank, local_bs)]
    if len(sizes) > 1 and sizes[-1] == 1:
        sizes.pop()  # a batch of one breaks BatchNorm's batch statistics
    steps_per_epoch = math.ceil(len(sizes) / cfg.accumulate)
    total_steps = steps_per_epoch * epochs
    schedule = dict(lr=lr, total_steps=total_steps, min_lr=cfg.min_lr, schedule=cfg.schedule,
                    warmup_steps=round(cfg.warmup_epochs * steps_per_epoch),
                    steps_per_epoch=steps_per_epoch, step_epochs=cfg.step_epochs,
                    step_gamma=cfg.step_gamma)

    if loader == "device":
        # The whole split lives on the device as uint8 (4x smaller than float): batches are
        # index_select calls, no per-sample Python, no host-to-device copy per step.
        x_all, y_all = train_split.x.to(device), train_split.y.to(device)
    else:
        workers = resolve_workers(cfg)
        sampler = EpochSampler(n, seed, shuffle, rank, world)
        dl = torch.utils.data.DataLoader(
            IndexedDataset(train_split), batch_size=local_bs, sampler=sampler,
            num_workers=workers,
            # Pinned (page-locked) host memory lets the copy below run asynchronously via DMA.
            pin_memory=device.type == "cuda",
            # Workers stay alive across epochs instead of being forked again every epoch.
            persistent_workers=workers > 0, prefetch_factor=4 if workers else None,
            drop_last=sum(sizes) < per_rank,
            # Its own generator: a DataLoader otherwise draws worker seeds from the global RNG
            # each epoch, which shifts the dropout masks away from the device path's.
            generator=torch.Generator().manual_seed(seed), worker_init_fn=seed_worker)

    def micro_batches(epoch: int) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        if loader == "device":
            order = rank_order(n, seed, epoch, shuffle, rank, world).to(device)
            start = 0
            for size in sizes:
                idx = order[start:start + size]
                start += size
                yield x_all[idx], y_all[idx], idx
        else:
            sampler.set_epoch(epoch)
            for x, y, idx in dl:
                # non_blocking: the copy overlaps with compute (it is async from pinned memory).
                yield (x.to(device, non_blocking=True), y.to(device, non_blocking=True),
                       idx.to(device, non_blocking=True))

    # State that a checkpoint carries; resume restores all of it so that the run ends where an
    # uninterrupted one would.
    start_epoch, step, plateau_scale, bad_epochs = 0, 0, 1.0, 0
    history: list[dict] = []
    best = {"score": (-1.0, -math.inf), "epoch": 0, "state": None}
    if resume is not None:
        model.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        scaler.load_state_dict(resume["scaler"])
        if ema is not None:
            ema.load_state_dict(resume["ema"])
        torch.set_rng_state(resume["rng"]["torch"])
        if device.type == "cuda" and resume["rng"].get("cuda"):
            torch.cuda.set_rng_state_all(resume["rng"]["cuda"])
        start_epoch, step = resume["epoch"], resume["step"]
        plateau_scale, bad_epochs = resume["plateau_scale"], resume["bad_epochs"]
        history = list(resume["history"])
        best = {"score": tuple(resume["best"]["score"]), "epoch": resume["best"]["epoch"],
                "state": resume["best"]["state"]}
        if rank == 0:
            print(f"resuming from {resume.get('path', 'checkpoint')} at epoch {start_epoch + 1}",
                  file=sys.stderr)

    show_bar = (sys.stderr.isatty() if progress is None else progress) and rank == 0
    last_ckpt: Path | None = Path(resume["path"]) if resume and "path" in resume else None
    stopped_early = False
    flag_host = torch.zeros((), dtype=torch.bool, pin_memory=device.type == "cuda")
    flag_event: torch.cuda.Event | None = None
    prev_lr = lr
    t_train = time.perf_counter()

    for epoch in range(start_epoch, epochs):
        model.train()
        t0 = time.perf_counter()
        reset_peak_mem(device)
        # Sums stay on the device: .item() is a host-device sync, so it happens only when logging.
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), device=device, dtype=torch.long)
        grad_norm_sum = torch.zeros((), device=device)
        seen = 0
        bar = tqdm(total=steps_per_epoch, desc=f"epoch {epoch + 1}/{epochs}", leave=False,
                   disable=not show_bar, dynamic_ncols=True)
        batches = micro_batches(epoch)
        for _ in range(steps_per_epoch):
            window = [b for _, b in zip(range(cfg.accumulate), batches, strict=False)]
            window_n = sum(len(y) for _, y, _ in window)
            window_loss = torch.zeros((), device=device)
            for i, (x, y, idx) in enumerate(window):
                # Augmentation keyed by (seed, epoch, sample index), batched on the device.
                if pad or hflip:
                    x = augment(x, idx, seed, epoch, pad, hflip)
                x = normalize(x, mean_t, std_t).contiguous(memory_format=fmt)
                # DDP: gradients are all-reduced once per window, on its last micro-batch.
                sync = ddp.no_sync() if ddp and i < len(window) - 1 else contextlib.nullcontext()
                with sync:
                    # Autocast runs convs and matmuls in bf16/fp16, reductions in fp32.
                    with torch.autocast(device.type, amp_dtype or torch.float32,
                                        enabled=amp_dtype is not None):
                        logits = net(x)
                    loss = criterion(logits.float(), y)
                    # Weighted by the micro-batch's share of the window: the accumulated
                    # gradient equals one batch of window_n samples, also for a short window.
                    scaler.scale(loss * (len(y) / window_n)).backward()
                window_loss += loss.detach() * len(y)
                correct += (logits.argmax(1) == y).sum()
            loss_sum += window_loss
            seen += window_n

            # Unscale before clipping, so the threshold applies to the true gradient (fp16 only).
            scaler.unscale_(optimizer)
            grad_norm = nn.utils.clip_grad_norm_(
                model.parameters(), cfg.clip_grad_norm if cfg.clip_grad_norm > 0 else math.inf)
            grad_norm_sum += grad_norm
            step_lr = lr_at(step, **schedule) * plateau_scale
            for group in optimizer.param_groups:
                group["lr"] = step_lr
            scaler.step(optimizer)
            scaler.update()
            # set_to_none frees the gradient memory and skips a zero-fill kernel.
            optimizer.zero_grad(set_to_none=True)
            if ema is not None:
                ema.update_parameters(model)

            # Non-finite guard, within one step. On the CPU reading the loss is free; on CUDA the
            # flag goes to pinned memory asynchronously and is read one step later, so the GPU
            # queue never drains.
            if flag_event is not None:
                flag_event.synchronize()
                if flag_host.item():
                    raise NonFiniteLossError(_nonfinite_message(step - 1, epoch, prev_lr, last_ckpt))
            bad = (~torch.isfinite(window_loss)).float()
            if distributed:  # every rank stops at the same step, or the others wait forever
                torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
            flag_host.copy_(bad > 0, non_blocking=True)
            if device.type == "cuda":
                flag_event = torch.cuda.Event()
                flag_event.record()
            elif flag_host.item():
                raise NonFiniteLossError(_nonfinite_message(step, epoch, step_lr, last_ckpt))
            prev_lr = step_lr
            step += 1
            if step % cfg.log_every == 0:
                step_loss = window_loss.item() / window_n
                log({"train_loss_step": step_loss, "lr_step": step_lr}, step)
                bar.set_postfix(loss=f"{step_loss:.4f}", lr=f"{step_lr:.2e}",
                                samples_s=f"{seen / (time.perf_counter() - t0):.0f}")
            bar.update()
        bar.close()

        if distributed:  # the epoch's figures over all ranks
            totals = torch.stack([loss_sum, correct.to(loss_sum.dtype)])
            torch.distributed.all_reduce(totals)
            loss_sum, correct, seen = totals[0], totals[1], seen * world
            # BatchNorm statistics are per rank: validate every rank with rank 0's, so they all
            # see the same val_acc and take the same best-epoch and early-stopping decisions.
            for module in (model, ema.module if ema is not None else None):
                for buffer in module.buffers() if module is not None else []:
                    torch.distributed.broadcast(buffer, 0)
        train_loss = loss_sum.item() / seen  # one sync per epoch
        if not math.isfinite(train_loss):
            raise NonFiniteLossError(_nonfinite_message(step - 1, epoch, step_lr, last_ckpt))
        flag_event = None  # the epoch's last step is checked by the line above
        train_s = time.perf_counter() - t0
        eval_model = ema.module if ema is not None else net
        val_logits = predict(eval_model, val_split, mean_t, std_t, device=device,
                             precision=precision, batch_size=max(batch_size, 256),
                             channels_last=cfg.channels_last)
        val_loss = F.cross_entropy(val_logits, val_split.y).item()
        val_acc = (val_logits.argmax(1) == val_split.y).float().mean().item()
        row = {"epoch": epoch + 1, "train_loss": train_loss, "train_acc": float(correct) / seen,
               "val_loss": val_loss, "val_acc": val_acc, "lr": step_lr,
               "grad_norm": grad_norm_sum.item() / steps_per_epoch,
               "samples_per_s": seen / train_s, "epoch_s": time.perf_counter() - t0,
               "peak_mem_mb": peak_mem_mb(device)}
        history.append(row)
        log({k: v for k, v in row.items() if k != "epoch"}, epoch + 1)
        if verbose and rank == 0:
            print(f"epoch {epoch + 1}/{epochs} train_loss {train_loss:.4f} "
                  f"train_acc {row['train_acc']:.4f} val_loss {val_loss:.4f} val_acc {val_acc:.4f} "
                  f"lr {step_lr:.2e} {row['samples_per_s']:.0f} samples/s {row['epoch_s']:.1f}s",
                  file=sys.stderr, flush=True)

        # Best by validation accuracy, ties broken by lower validation loss.
        score = (val_acc, -val_loss)
        improved = score > best["score"]
        if improved:
            src = ema.module if ema is not None else model
            best = {"score": score, "epoch": epoch + 1,
                    "state": {k: v.detach().cpu().clone() for k, v in src.state_dict().items()}}
            bad_epochs = 0
        else:
            bad_epochs += 1
        if cfg.schedule == "plateau" and bad_epochs and bad_epochs % cfg.plateau_patience == 0:
            plateau_scale *= cfg.plateau_factor
        stop = cfg.early_stopping_patience and bad_epochs >= cfg.early_stopping_patience

        if ckpt_dir is not None and rank == 0:
            last_ckpt = save_checkpoint({
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(), "ema": ema.state_dict() if ema else None,
                "rng": {"torch": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state_all() if device.type == "cuda" else []},
                "epoch": epoch + 1, "step": step, "plateau_scale": plateau_scale,
                "bad_epochs": bad_epochs, "history": history,
                "best": {"score": list(best["score"]), "epoch": best["epoch"],
                         "state": best["state"]},
                **(extra_state or {}),
            }, ckpt_dir, epoch + 1)
        if stop:
            stopped_early = True
            if verbose and rank == 0:
                print(f"early stopping: no val_acc improvement for {bad_epochs} epochs",
                      file=sys.stderr)
            break

    final = ema.module if ema is not None else model
    if best["state"] is not None:
        final.load_state_dict(best["state"])
    final = copy.deepcopy(final).cpu().to(memory_format=torch.contiguous_format)
    return TrainResult(
        model=final, history=history, best_epoch=best["epoch"], best_val_acc=best["score"][0],
        best_val_loss=-best["score"][1], epochs_run=len(history), stopped_early=stopped_early,
        device=str(device), precision=precision, loader=loader,
        train_s=time.perf_counter() - t_train)


def _nonfinite_message(step: int, epoch: int, lr: float, last_ckpt: Path | None) -> str:
    kept = f"the last good checkpoint is {last_ckpt}" if last_ckpt else "no checkpoint was written yet"
    return (f"non-finite loss at step {step} (epoch {epoch + 1}, lr {lr:.3g}); {kept}. "
            "Try a lower lr, check the data for NaN/inf values, or set train.clip_grad_norm.")
