"""Evaluation metrics: scikit-learn's definitions, without importing scikit-learn in the
stage, and a class the test split lacks named and left out."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import f1_score, precision_recall_fscore_support

from stages.report import classification_metrics


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_equal_scikit_learns_including_classes_never_predicted_or_absent(seed):
    g = torch.Generator().manual_seed(seed)
    k = 6
    y = torch.randint(0, k - 1, (300,), generator=g)  # class 5 never occurs in the labels
    logits = torch.randn(300, k, generator=g)
    logits[:, 4] -= 10  # and class 4 is never predicted
    summary, per_class = classification_metrics(logits, y, [f"c{i}" for i in range(k)])
    true, pred = y.numpy(), logits.argmax(1).numpy()
    p, r, f, s = precision_recall_fscore_support(true, pred, labels=list(range(k)),
                                                 zero_division=0)
    # macro_f1 over the classes the test split holds (class 5 has no test images)
    assert summary["macro_f1"] == pytest.approx(
        f1_score(true, pred, labels=list(range(k - 1)), average="macro", zero_division=0),
        abs=1e-15)
    for i in range(k):
        got = per_class[f"c{i}"]
        assert [got["precision"], got["recall"], got["f1"]] == pytest.approx(
            [p[i], r[i], f[i]], abs=1e-15)
        assert got["support"] == s[i]
    assert summary["accuracy"] == pytest.approx(float(np.mean(true == pred)))
    assert summary["n"] == 300


def test_a_class_absent_from_the_test_split_is_named_and_left_out_of_macro_f1(digits, capsys):
    from stages.report import classification_metrics

    splits, meta = digits
    test = splits["test"]
    keep = test.y != 9
    y = test.y[keep]
    logits = torch.nn.functional.one_hot(y, 10).float() * 10  # every prediction right
    metrics, per_class = classification_metrics(logits, y, meta["classes"])
    assert metrics["accuracy"] == 1.0 and metrics["macro_f1"] == 1.0  # not 0.9
    assert per_class["9"]["support"] == 0
    err = capsys.readouterr().err
    assert "1 classes have no test images (9)" in err
