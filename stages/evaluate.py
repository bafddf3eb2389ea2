"""Stage evaluate: models/train/ + the test split -> models/eval/ (metrics, confusion, PNGs)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from stages import tracking
from stages.config import load_params, run_stage
from stages.data import load_split
from stages.files import write_json
from stages.loop import predict, resolve_device
from stages.models import load_trained
from stages.report import (
    classification_metrics,
    plot_confusion,
    plot_misclassified,
    write_confusion_csv,
)

PREPARED = Path("data/prepared")
TRAIN = Path("models/train")
OUT = Path("models/eval")


def main() -> None:
    params = load_params()
    model, ckpt = load_trained(TRAIN / "model.pt")
    test = load_split(PREPARED, "test")
    classes = ckpt["classes"]

    # fp32 on purpose: the reported accuracy is the model's, not a lower-precision copy's.
    device = resolve_device(params.train.device)
    logits = predict(model.to(device), test, torch.tensor(ckpt["mean"], device=device),
                     torch.tensor(ckpt["std"], device=device), device=device,
                     batch_size=params.eval.batch_size)
    pred = logits.argmax(1)
    metrics, per_class = classification_metrics(logits, test.y, classes)

    write_json(OUT / "metrics.json", metrics)
    write_json(OUT / "per_class.json", per_class)
    write_confusion_csv(OUT / "confusion.csv", test.y, pred, classes)
    plot_confusion(OUT / "confusion.png", test.y, pred, classes)
    plot_misclassified(OUT / "misclassified.png", test.x, test.y, pred, classes,
                       params.eval.misclassified_max)

    run_id = json.loads((TRAIN / "run.json").read_text())["run_id"]
    with tracking.reopen_run(params.mlflow, run_id) as run:
        flat = {f"eval.{k}": v for k, v in metrics.items()}
        flat.update({f"eval.{c}.{m}": v for c, d in per_class.items()
                     for m, v in d.items() if m != "support"})
        run.log_metrics(flat)
        for name in ("metrics.json", "per_class.json", "confusion.csv", "confusion.png",
                     "misclassified.png"):
            run.log_artifact(OUT / name, "eval")
    print(f"test accuracy {metrics['accuracy']:.4f}, macro_f1 {metrics['macro_f1']:.4f}, "
          f"loss {metrics['loss']:.4f} on {metrics['n']} images")


if __name__ == "__main__":
    run_stage(main)
