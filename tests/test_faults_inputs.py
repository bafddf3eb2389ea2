"""Bad inputs fail before any work, in one line naming the key, file or value: params.yaml
(wrong values, YAML errors), damaged prepared data, oversized images, missing classes."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from tests.conftest import ROOT, copy_params, env_with, run, set_params
from tests.workspaces import (
    folder_workspace,
    one_error_line,
    workspace,
)


@pytest.mark.parametrize("edit, expected", [
    ({"lrr": None}, "unknown key 'lrr'; did you mean 'lr'"),
    ({"epochs": "'ten'"}, "epochs='ten' must be int"),
    ({"lr": "'1e-3'"}, "lr='1e-3' must be float, not str (remove the quotes)"),
    ({"lr": "-0.1"}, "lr=-0.1 is invalid: must be > 0"),
    ({"model.arch": "vgg99"}, "model.arch='vgg99' is invalid"),
    ({"data.source": "imagenet"}, "data.source='imagenet' is invalid"),
])
def test_bad_params_fail_before_any_work(tmp_path, edit, expected):
    copy_params(tmp_path)
    if "lrr" in edit:
        with open(tmp_path / "params.yaml", "a") as f:
            f.write("lrr: 0.1\n")
    else:
        set_params(tmp_path / "params.yaml", edit)
    for stage in ("prepare", "train"):
        t = time.perf_counter()
        p = run([sys.executable, "-m", f"stages.{stage}"], tmp_path,
                env=env_with(PYTHONPATH=str(ROOT)), check=False)
        assert p.returncode == 1 and expected in p.stderr, p.stderr
        assert "Traceback" not in p.stderr
        assert not (tmp_path / "data").exists() and not (tmp_path / "models").exists()
        assert time.perf_counter() - t < 60


def test_a_truncated_prepared_split_fails_naming_it(tmp_path, digits):
    w = workspace(tmp_path / "w", digits)
    split = w / "data/prepared/train.pt"
    split.write_bytes(split.read_bytes()[:5000])
    p = run([sys.executable, "-m", "stages.train"], w, env=env_with(PYTHONPATH=str(ROOT)),
            check=False)
    assert p.returncode == 1 and "data/prepared/train.pt: unreadable" in one_error_line(p.stderr)


@pytest.mark.parametrize("text, expected", [
    ("lr: 0.1\nlr: 0.2\n", "params.yaml: line 2: found duplicate key lr"),
    ("lr: [0.1\n", "params.yaml: line 2: expected ',' or ']'"),
])
def test_a_yaml_error_in_params_is_one_line_naming_the_line(tmp_path, text, expected):
    (tmp_path / "params.yaml").write_text(text)
    p = run([sys.executable, "-m", "stages.prepare"], tmp_path,
            env=env_with(PYTHONPATH=str(ROOT)), check=False)
    assert p.returncode == 1 and expected in one_error_line(p.stderr)


@pytest.mark.parametrize("edit, expected", [
    ({"train.warmup_epochs": ".inf"}, "train.warmup_epochs=inf must be a finite number"),
    ({"lr": ".inf"}, "lr=inf must be a finite number"),
    ({"train.min_lr": ".nan"}, "train.min_lr=nan must be a finite number"),
    ({"train.device": "cpu:abc"}, "train.device='cpu:abc' is invalid"),
    ({"train.device": "mps"}, "MPS (Apple GPUs, macOS) is not available"),
    ({"train.device": "cuda"}, "CUDA is not available on this machine"),
])
def test_values_that_would_fail_later_are_refused_before_the_data_loads(tmp_path, edit, expected):
    if "cuda" in expected and torch.cuda.is_available() or \
            "MPS" in expected and torch.backends.mps.is_available():
        pytest.skip("the device exists here")
    copy_params(tmp_path)
    set_params(tmp_path / "params.yaml", edit)
    # No data/prepared at all: the refusal must come first.
    p = run([sys.executable, "-m", "stages.train"], tmp_path,
            env=env_with(PYTHONPATH=str(ROOT)), check=False)
    assert p.returncode == 1 and expected in one_error_line(p.stderr)


def test_an_oversized_image_file_is_rejected_and_listed(tmp_path):
    from stages.lib.images import MAX_IMAGE_BYTES
    from tests.images import make_folder

    w = folder_workspace(tmp_path / "w")
    make_folder(w / "raw", per_class=30, bad=False)
    sparse = tmp_path / "disk.img"
    with open(sparse, "wb") as f:
        f.truncate(8 * 2**30)  # 8 GiB that take no disk: read whole, a MemoryError
    assert sparse.stat().st_size > MAX_IMAGE_BYTES
    (w / "raw/circle/huge.png").symlink_to(sparse)
    p = run([sys.executable, "-m", "stages.prepare"], w, env=env_with(PYTHONPATH=str(ROOT)),
            check=False)
    assert p.returncode == 0 and "Traceback" not in p.stderr and "MemoryError" not in p.stderr
    assert "skipped 1 unreadable files" in p.stderr
    rejected = (w / "data/prepared/rejected.csv").read_text()
    assert "huge.png" in rejected and "limit" in rejected


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
