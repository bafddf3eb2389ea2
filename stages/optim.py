"""The optimizer and the learning-rate schedule. A new schedule: a branch in `Schedule.lr_at`
(or `end_epoch`, if it reacts to validation) and its name in `TrainConfig`'s choices."""

from __future__ import annotations

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
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum,
                               nesterov=cfg.nesterov and cfg.momentum > 0, fused=fused)
    return torch.optim.AdamW(groups, lr=lr, fused=fused)


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
