"""The optimizer, the weight average (EMA) and the learning-rate schedule. A new schedule: a
branch in `Schedule.lr_at` (or `end_epoch`, if it reacts to validation) and its name in
`TrainConfig`'s choices."""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn

from stages.config import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig, lr: float,
                    device: torch.device) -> torch.optim.Optimizer:
    # No weight decay on norm weights and biases: decaying them only fights the normalization.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # Fused kernels update every parameter in one pass instead of a loop of small ops (several
    # times faster per step, see README "How fast").
    fused = True if device.type in ("cuda", "cpu") else None
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr, fused=fused)
    sgd = torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum,
                          nesterov=cfg.nesterov and cfg.momentum > 0, fused=fused)
    if cfg.momentum > 0:
        # Zeroed momentum buffers from the start: fused SGD creates them with empty_like on its
        # first step and leaves them so when fp16 loss scaling skips that step (an overflow,
        # common at the initial scale), and momentum then starts from garbage. With
        # dampening 0, 0.9 * 0 + g is exactly the g the first step would have stored.
        for p in decay + no_decay:
            sgd.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return sgd


class EMA:
    """An exponential moving average of the weights and float buffers (BatchNorm statistics):
    the first update copies the model, each later one moves `1 - decay` of the way to it.

    Its bookkeeping stays on the host: torch's AveragedModel keeps an update counter that it
    copies to the device and reads back on every update, which drains the GPU queue per step.
    """

    def __init__(self, model: nn.Module, decay: float):
        self.module = copy.deepcopy(model)
        self.decay = decay
        self.updates = 0

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        pairs = list(zip(itertools.chain(self.module.parameters(), self.module.buffers()),
                         itertools.chain(model.parameters(), model.buffers()), strict=True))
        pairs = [(a.detach(), m.detach()) for a, m in pairs]
        floats = [(a, m) for a, m in pairs if a.is_floating_point()]
        # Counters (num_batches_tracked) are copied, never averaged.
        copied = pairs if self.updates == 0 else [(a, m) for a, m in pairs if not a.is_floating_point()]
        if floats and self.updates > 0:
            torch._foreach_lerp_([a for a, _ in floats], [m for _, m in floats], 1 - self.decay)
        if copied:
            torch._foreach_copy_([a for a, _ in copied], [m for _, m in copied])
        self.updates += 1

    def state_dict(self) -> dict:
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = state["updates"]


@dataclass
class Schedule:
    """The learning rate of every optimizer step: linear warmup, then cosine, step or constant;
    `plateau` cuts it by a factor whenever validation stalls. That factor is its only state."""

    lr: float
    kind: str  # train.schedule
    total_steps: int
    warmup_steps: int
    steps_per_epoch: int
    min_lr: float = 0.0
    step_epochs: int = 10
    step_gamma: float = 0.1
    plateau_patience: int = 2
    plateau_factor: float = 0.5
    scale: float = 1.0  # the product of the plateau cuts so far

    @classmethod
    def from_config(cls, cfg: TrainConfig, lr: float, steps_per_epoch: int,
                    epochs: int) -> Schedule:
        return cls(lr=lr, kind=cfg.schedule, total_steps=steps_per_epoch * epochs,
                   warmup_steps=round(cfg.warmup_epochs * steps_per_epoch),
                   steps_per_epoch=steps_per_epoch, min_lr=cfg.min_lr,
                   step_epochs=cfg.step_epochs, step_gamma=cfg.step_gamma,
                   plateau_patience=cfg.plateau_patience, plateau_factor=cfg.plateau_factor)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            base = self.lr * (step + 1) / self.warmup_steps
        elif self.kind == "cosine":
            progress = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps - 1)
            base = self.min_lr + (self.lr - self.min_lr) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        elif self.kind == "step":
            base = self.lr * self.step_gamma ** (step // (self.step_epochs * self.steps_per_epoch))
        else:  # constant, plateau
            base = self.lr
        return base * self.scale

    def end_epoch(self, epochs_without_improvement: int) -> None:
        """Plateau: cut the rate after every `plateau_patience` epochs without improvement."""
        stalled = epochs_without_improvement
        if self.kind == "plateau" and stalled and stalled % self.plateau_patience == 0:
            self.scale *= self.plateau_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
