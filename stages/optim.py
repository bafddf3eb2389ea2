"""The optimizer, the weight average (EMA) and the learning-rate schedule. A new schedule: a
function in `SCHEDULES` (or a branch in `Schedule.after_validation`, if it reacts to
validation), its name in `config.SCHEDULES` (a test keeps the two equal); its settings go in
`TrainConfig`."""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable
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
    # times faster per step, see docs/performance.md).
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
            # torch._foreach_lerp_ and _foreach_copy_ are private (torch has no public foreach
            # ops): one call updates every tensor (multi-tensor kernels on CUDA), not a Python
            # loop of small ops; tests/test_private_names.py pins both.
            torch._foreach_lerp_([a for a, _ in floats], [m for _, m in floats], 1 - self.decay)
        if copied:
            # Private, as _foreach_lerp_ above.
            torch._foreach_copy_([a for a, _ in copied], [m for _, m in copied])
        self.updates += 1

    def state_dict(self) -> dict:
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = state["updates"]


def _cosine(s: Schedule, step: int) -> float:
    progress = (step - s.warmup_steps) / max(1, s.total_steps - s.warmup_steps - 1)
    return s.cfg.min_lr + (s.lr - s.cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _step(s: Schedule, step: int) -> float:
    return s.lr * s.cfg.step_gamma ** (step // (s.cfg.step_epochs * s.steps_per_epoch))


def _constant(s: Schedule, step: int) -> float:
    return s.lr


# `train.schedule` names an entry: the rate after warmup of optimizer step `step`. `plateau` is
# constant until validation stalls (`Schedule.after_validation`).
SCHEDULES: dict[str, Callable[[Schedule, int], float]] = {
    "cosine": _cosine, "step": _step, "plateau": _constant, "constant": _constant,
}


@dataclass
class Schedule:
    """The learning rate of every optimizer step: linear warmup, then the `train.schedule`
    entry of SCHEDULES, times the plateau cuts so far (its only state)."""

    cfg: TrainConfig
    lr: float
    steps_per_epoch: int
    epochs: int
    scale: float = 1.0

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.epochs

    @property
    def warmup_steps(self) -> int:
        return round(self.cfg.warmup_epochs * self.steps_per_epoch)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            base = self.lr * (step + 1) / self.warmup_steps
        else:
            base = SCHEDULES[self.cfg.schedule](self, step)
        return base * self.scale

    def after_validation(self, epochs_without_improvement: int) -> None:
        """Plateau: cut the rate after every `plateau_patience` epochs without improvement."""
        stalled, patience = epochs_without_improvement, self.cfg.plateau_patience
        if self.cfg.schedule == "plateau" and stalled and stalled % patience == 0:
            self.scale *= self.cfg.plateau_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
