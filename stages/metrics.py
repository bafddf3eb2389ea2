"""Every metric a run reports, named once. A per-epoch metric declared in EPOCH reaches the
epoch's row (the loop fails on one it does not compute), MLflow under its grouped name, the
line printed per epoch and, when it compares across machines, history.csv.

Imports nothing: `make ui` reads the names without torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EpochMetric:
    mlflow: str  # MLflow's chart view groups metrics by the part before the first `/`
    history: bool  # kept in history.csv; timings differ between machines and reruns
    shown: str = ""  # its part of the epoch's line, a format of the value ("": not printed)


EPOCH = {
    "train_loss": EpochMetric("train/loss", True, "train_loss {:.4f}"),
    "train_acc": EpochMetric("train/acc", True, "train_acc {:.4f}"),
    "val_loss": EpochMetric("val/loss", True, "val_loss {:.4f}"),
    "val_acc": EpochMetric("val/acc", True, "val_acc {:.4f}"),
    "lr": EpochMetric("train/lr", True, "lr {:.2e}"),
    "grad_norm": EpochMetric("train/grad_norm", True),
    "samples_per_s": EpochMetric("perf/samples_per_s", False, "{:.0f} samples/s"),
    "epoch_s": EpochMetric("perf/epoch_s", False, "{:.1f}s"),
    "peak_mem_mb": EpochMetric("perf/peak_mem_mb", False),
}

HISTORY = ["epoch", *(name for name, m in EPOCH.items() if m.history)]  # history.csv's columns

# The other metrics: per optimizer step, and of the whole run.
MLFLOW_NAMES = {name: m.mlflow for name, m in EPOCH.items()} | {
    "train_loss_step": "train/loss_step", "lr_step": "train/lr_step",
    "epochs_run": "train/epochs_run", "best_val_acc": "val/best_acc",
    "best_val_loss": "val/best_loss", "best_epoch": "val/best_epoch",
    "train_s": "perf/train_s", "num_params": "model/num_params",
}


def epoch_line(row: dict, epochs: int) -> str:
    shown = (m.shown.format(row[name]) for name, m in EPOCH.items() if m.shown)
    return " ".join([f"epoch {row['epoch']}/{epochs}", *shown])
