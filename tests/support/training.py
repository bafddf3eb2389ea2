"""Small real training runs the loop, checkpoint and model tests share: the real loop on the real digits."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from stages.config import ModelConfig, TrainConfig
from stages.data import Split, load_meta, load_split
from stages.loop import Job, RunIO, no_log, train
from stages.models import build_model

CPU_FP32 = dict(device="cpu", precision="fp32", loader="device", log_every=1000,
                warmup_epochs=0.5, augment_crop_pad=0)


def linear_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(256, 10))


def cnn(seed: int = 0, width: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(width=width, dropout=0.1), 1, 10, 16)


def fit(model, digits, n: int | None = None, epochs: int = 1, batch_size: int = 32,
        lr: float = 3e-3, seed: int = 0, log=no_log, **cfg):
    splits, meta = digits
    tr = splits["train"]
    if n is not None:
        tr = Split(tr.x[:n], tr.y[:n])
    return train(model, Job(train=tr, val=splits["val"], mean=meta["mean"], std=meta["std"],
                            cfg=TrainConfig(**{**CPU_FP32, **cfg}), lr=lr, epochs=epochs,
                            batch_size=batch_size, seed=seed),
                 RunIO(log=log, progress=False))


def fit_ckpt(model, digits, ckpt_dir, epochs: int, resume: dict | None = None, **cfg):
    splits, meta = digits
    return train(model, Job(train=splits["train"], val=splits["val"], mean=meta["mean"],
                            std=meta["std"], cfg=TrainConfig(**{**CPU_FP32, **cfg}), lr=3e-3,
                            epochs=epochs, batch_size=64, seed=0),
                 RunIO(ckpt_dir=ckpt_dir, resume=resume, progress=False))


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in
               zip(a.state_dict().values(), b.state_dict().values(), strict=True))


@contextlib.contextmanager
def uninitialized_memory_is_nan():
    """torch.empty and friends fill NaN: memory nobody initialized shows, deterministically."""
    before = torch.are_deterministic_algorithms_enabled(), \
        torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = before[1]


def sgd_step(model, opt, scaler, x, y, blow_up: float = 1.0) -> None:
    loss = nn.functional.cross_entropy(model(x), y) * blow_up
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


class InfGradOnce(nn.Module):
    """A real model whose first backward pass produces non-finite gradients (an fp16 overflow)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.fired = inner, False

    def forward(self, x):
        out = self.inner(x)
        if self.training and not self.fired:
            self.fired = True
            out.register_hook(lambda g: g * math.inf)
        return out


def stream_fit(prep, workers: int, epochs: int = 2, model: nn.Module | None = None,
               batch_size: int = 16, rank: int = 0, world: int = 1, **cfg):
    """A model (by default a width-8 CNN) trained on a prepared folder (shards: train.loader
    auto is stream) with every augmentation on, by this process as `rank` of `world` where a
    process group is up."""
    meta = load_meta(prep)
    torch.manual_seed(0)
    model = model or build_model(ModelConfig(width=8), 3, len(meta["classes"]), meta["image_size"])
    config = TrainConfig(**{**CPU_FP32, "loader": "auto", "num_workers": workers,
                            "augment_crop_pad": 1, "augment_hflip": True,
                            "augment_crop_scale": [0.35, 1.0], **cfg})
    job = Job(train=load_split(prep, "train"), val=load_split(prep, "val"), mean=meta["mean"],
              std=meta["std"], cfg=config, lr=3e-3, epochs=epochs, batch_size=batch_size,
              seed=0, rank=rank, world=world)
    return train(model, job, RunIO(progress=False, verbose=rank == 0))
