"""Classification metrics and the pictures of them: computed once, written to DVC and MLflow."""

from __future__ import annotations

import io
import sys

import numpy as np
import torch
from torch import Tensor

from stages.lib.files import csv_text
from stages.models import loss_fn


def classification_metrics(logits: Tensor, y: Tensor, classes: list[str]) -> tuple[dict, dict]:
    """(summary, per class): the summary goes to `dvc exp show`, both go to MLflow.

    scikit-learn's definitions (zero_division=0; F1 = 2 tp / (support + predicted)), computed
    from the confusion counts: importing sklearn would cost the stage seconds of start-up.
    """
    pred = logits.argmax(1).numpy()
    true = y.numpy()
    k = len(classes)
    counts = np.bincount(true * k + pred, minlength=k * k).reshape(k, k)  # rows: actual
    tp, s, predicted = np.diag(counts), counts.sum(1), counts.sum(0)
    p, r, f = (np.divide(a, b, out=np.zeros(k), where=b > 0)
               for a, b in ((tp, predicted), (tp, s), (2 * tp, s + predicted)))
    summary = {
        "accuracy": float((pred == true).mean()),
        "loss": loss_fn()(logits, y).item(),
        "macro_f1": float(f[present_labels(true, classes)].mean()),
        "n": int(len(true)),
    }
    per_class = {c: {"precision": float(p[i]), "recall": float(r[i]), "f1": float(f[i]),
                     "support": int(s[i])} for i, c in enumerate(classes)}
    return summary, per_class


def present_labels(true: np.ndarray, classes: list[str]) -> list[int]:
    """The classes the test split holds. One it lacks (present in train only) has no recall to
    measure: its F1 of 0 in macro_f1 would mark down the model for a gap in the data."""
    present = sorted(set(true.tolist()))
    absent = [c for i, c in enumerate(classes) if i not in present]
    if absent:
        print(f"warning: {len(absent)} classes have no test images ({', '.join(absent)}): "
              f"macro_f1 averages the {len(present)} classes present; add test images of them "
              "or a larger data.test_fraction", file=sys.stderr)
    return present


def per_class_csv(per_class: dict[str, dict]) -> str:
    """One row per class: a table in `git diff`, in DVC and in the MLflow UI's artifact view."""
    return csv_text(["class", "precision", "recall", "f1", "support"],
                    ([c, *(round(d[k], 6) for k in ("precision", "recall", "f1")), d["support"]]
                     for c, d in per_class.items()))


def confusion_csv(y: Tensor, pred: Tensor, classes: list[str]) -> str:
    """One row per test sample (actual, predicted), the shape DVC's confusion template reads."""
    return csv_text(["actual", "predicted"], ((classes[a], classes[b]) for a, b in
                                              zip(y.tolist(), pred.tolist(), strict=True)))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    # Class names are text, never markup: `$`, `$$`, `$_$` (price tiers) would otherwise go to
    # the math parser, which draws them wrong or raises.
    matplotlib.rcParams["text.parse_math"] = False
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def confusion_png(y: Tensor, pred: Tensor, classes: list[str]) -> bytes:
    plt = _pyplot()

    k = len(classes)
    m = np.zeros((k, k), dtype=int)
    np.add.at(m, (y.numpy(), pred.numpy()), 1)
    fig, ax = plt.subplots(figsize=(1 + 0.5 * k, 1 + 0.5 * k))
    ax.imshow(m, cmap="Blues")
    for i in range(k):
        for j in range(k):
            if m[i, j]:
                ax.text(j, i, m[i, j], ha="center", va="center", fontsize=8,
                        color="white" if m[i, j] > m.max() / 2 else "black")
    ax.set(xticks=range(k), yticks=range(k), xticklabels=classes, yticklabels=classes,
           xlabel="predicted", ylabel="actual", title=f"confusion ({int(m.trace())}/{m.sum()} right)")
    return _png(fig)


def misclassified_png(x: Tensor, y: Tensor, pred: Tensor, classes: list[str],
                      limit: int) -> bytes:
    """A grid of wrongly classified test images, titled actual -> predicted."""
    plt = _pyplot()

    wrong = torch.nonzero(pred != y).flatten()[:limit].tolist()
    cols = max(1, min(6, len(wrong)))
    rows = max(1, -(-len(wrong) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(1.6 * cols, 1.8 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, i in zip(axes.flat, wrong, strict=False):
        img = x[i].permute(1, 2, 0).numpy()
        ax.imshow(img[..., 0] if img.shape[-1] == 1 else img, cmap="gray", vmin=0, vmax=255)
        ax.set_title(f"{classes[y[i]]} -> {classes[pred[i]]}", fontsize=8)
    if not wrong:
        axes.flat[0].text(0.5, 0.5, "no misclassified images", ha="center", va="center")
    return _png(fig)
