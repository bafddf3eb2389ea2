"""Stage evaluate: models/train/ + the test split -> models/eval/ (metrics, per-class table,
confusion rows, PNGs)."""

from __future__ import annotations

import torch

from reprotrain import tracking
from stages import weights
from stages.config import EVAL_DIR, PREPARED, TRAIN_DIR, flatten, load_params
from stages.data import in_batches, load_meta, load_split
from stages.lib.cli import run_stage
from stages.lib.files import atomic_write_all, json_text, text_writer
from stages.report import (
    classification_metrics,
    confusion_csv,
    confusion_png,
    misclassified_png,
    per_class_csv,
)
from stages.runtime import predict, resolve_device


def main() -> None:
    params = load_params()
    model, trained = weights.load(TRAIN_DIR / "model.pt")
    test = load_split(PREPARED, "test")
    classes = trained.classes

    # fp32 on purpose: the reported accuracy is the model's, not a lower-precision copy's.
    device = resolve_device(params.train.device)
    logits = predict(model.to(device), in_batches(test, params.eval.batch_size, params.train),
                     torch.tensor(trained.mean, device=device),
                     torch.tensor(trained.std, device=device), device=device)
    pred = logits.argmax(1)
    metrics, per_class = classification_metrics(logits, test.y, classes)

    # All or none: a failed write must not leave new figures beside the previous metrics.
    atomic_write_all({name: text_writer(content) for name, content in {
        EVAL_DIR / "metrics.json": json_text(metrics),
        EVAL_DIR / "per_class.csv": per_class_csv(per_class),
        EVAL_DIR / "confusion.csv": confusion_csv(test.y, pred, classes),
        EVAL_DIR / "confusion.png": confusion_png(test.y, pred, classes),
        EVAL_DIR / "misclassified.png": misclassified_png(test.x, test.y, pred, classes,
                                                          params.eval.misclassified_max),
    }.items()})

    # Per-class figures are one table (per_class.csv, shown as a table in the UI), not
    # metrics: 30 charts of them would bury the curves.
    with tracking.experiment_run(params.mlflow, flatten(params), load_meta(PREPARED), TRAIN_DIR) as run:
        run.log_evaluation(metrics)
        for name in ("metrics.json", "per_class.csv", "confusion.csv", "confusion.png",
                     "misclassified.png"):
            run.log_artifact(EVAL_DIR / name, "eval")
    print(f"test accuracy {metrics['accuracy']:.4f}, macro_f1 {metrics['macro_f1']:.4f}, "
          f"loss {metrics['loss']:.4f} on {metrics['n']} images")


if __name__ == "__main__":
    run_stage(main)
