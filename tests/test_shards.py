"""data.format: shards (stages/lib/shards.py): an image folder's splits as tar shards of the encoded
files with an index, read by train's DataLoader workers (train.loader: stream)."""

from __future__ import annotations

import json
import sys
import tarfile

import pytest
import torch

from stages.config import ModelConfig, TrainConfig
from stages.data import SPLITS, load_meta, load_split
from stages.lib.images import DataError
from stages.loop import Job, RunIO, train
from stages.models import build_model
from tests.conftest import ROOT, env_with, run, set_params
from tests.support.image_files import make_folder
from tests.support.training import CPU_FP32, same_weights
from tests.support.workspaces import folder_workspace, one_error_line


def prepared(w, fmt: str, **params: str):
    set_params(w / "params.yaml", {"data.format": fmt, "data.channels": "3", **params})
    return run([sys.executable, "-m", "stages.prepare"], w, env=env_with(PYTHONPATH=str(ROOT)))


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """The same folder (with its unreadable files) prepared as tensors and as shards."""
    out = {}
    for fmt in ("tensors", "shards"):
        w = folder_workspace(tmp_path_factory.mktemp(fmt) / "w")
        make_folder(w / "raw", 24)
        out[fmt] = (w, prepared(w, fmt))
    return out


def test_shards_are_tar_files_of_the_images_that_val_and_test_decode_as_tensors_do(both):
    (tw, _), (sw, said) = both["tensors"], both["shards"]
    prep = sw / "data/prepared"
    assert not list(prep.glob("*.pt")) and load_meta(prep)["format"] == "shards"
    # WebDataset's layout: <key>.<ext> and <key>.cls, keys in order, labels as text.
    with tarfile.open(prep / "train/shard-000000.tar") as tar:
        names = tar.getnames()
        assert names[:2] == ["000000000.png", "000000000.cls"] or \
            names[0].startswith("000000000.") and names[1] == "000000000.cls", names[:4]
        label = int(tar.extractfile(names[1]).read())
    assert label == int(load_split(prep, "train").y[0])
    # One decode for both formats: the same pixels where no augmentation applies.
    for name in ("val", "test"):
        t, s = load_split(tw / "data/prepared", name), load_split(prep, name)
        assert torch.equal(t.y, s.y) and torch.equal(t.x, s.x[0:len(s.y)]), name
    t_meta, s_meta = load_meta(tw / "data/prepared"), load_meta(prep)
    assert t_meta["sizes"] == s_meta["sizes"] and t_meta["counts"] == s_meta["counts"]
    assert torch.allclose(torch.tensor(t_meta["mean"]), torch.tensor(s_meta["mean"]), atol=1e-9)
    assert (tw / "data/prepared/rejected.csv").read_text() == (prep / "rejected.csv").read_text()
    assert "skipped 3 unreadable files" in said.stderr


def test_prepare_writes_the_same_shards_again(both, tmp_path):
    sw, _ = both["shards"]
    before = {p.relative_to(sw): p.read_bytes() for p in (sw / "data/prepared").rglob("*")
              if p.is_file()}
    prepared(sw, "shards")
    after = {p.relative_to(sw): p.read_bytes() for p in (sw / "data/prepared").rglob("*")
             if p.is_file()}
    assert before == after


def stream_fit(prep, workers: int, epochs: int = 2):
    meta = load_meta(prep)
    torch.manual_seed(0)
    model = build_model(ModelConfig(width=8), 3, len(meta["classes"]))
    cfg = TrainConfig(**{**CPU_FP32, "loader": "auto", "num_workers": workers, "augment_crop_pad": 1,
                         "augment_hflip": True})
    job = Job(train=load_split(prep, "train"), val=load_split(prep, "val"), mean=meta["mean"],
              std=meta["std"], cfg=cfg, lr=3e-3, epochs=epochs, batch_size=16, seed=0)
    return train(model, job, RunIO(progress=False))


def test_streamed_training_is_the_same_bytes_whatever_the_number_of_workers(both):
    prep = both["shards"][0] / "data/prepared"
    one = stream_fit(prep, 0)
    assert one.loader == "stream"
    assert same_weights(one.model, stream_fit(prep, 2).model)


def test_a_truncated_shard_is_named_with_the_sample(both, tmp_path):
    import shutil

    prep = tmp_path / "prepared"
    shutil.copytree(both["shards"][0] / "data/prepared", prep)
    shard = prep / "val/shard-000000.tar"
    shard.write_bytes(shard.read_bytes()[:2048])
    x = load_split(prep, "val").x
    with pytest.raises(DataError, match=rf"{shard}: truncated: sample \d+"):
        x[0:len(x)]


def test_the_loader_and_the_format_must_match_in_one_line(both):
    sw, _ = both["shards"]
    set_params(sw / "params.yaml", {"train.loader": "device"})
    try:
        p = run([sys.executable, "-m", "stages.train"], sw, check=False,
                env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI="", REPROTRAIN_WARM="0"))
    finally:
        set_params(sw / "params.yaml", {"train.loader": "auto"})
    assert p.returncode == 1 and "train.loader='device' reads tensors, and data/prepared/ " \
        "holds shards" in one_error_line(p.stderr), p.stderr


def test_auto_keeps_a_small_folder_in_tensors_and_says_why(tmp_path):
    w = folder_workspace(tmp_path / "w")
    make_folder(w / "raw", 8, bad=False)
    said = prepared(w, "auto").stdout
    assert said.startswith("data.format: auto -> tensors: decoded, the splits take 0 MiB, within "
                           "half of the "), said
    assert (w / "data/prepared/train.pt").exists() and "format" not in \
        json.loads((w / "data/prepared/meta.json").read_text())


def test_only_a_folder_is_written_as_shards(tmp_path):
    from stages.config import ParamsError, check_params

    with pytest.raises(ParamsError, match="data.format='shards' is invalid: only data.source: "
                                          "folder is written as shards"):
        check_params({"data": {"source": "digits", "format": "shards"}})
    assert set(SPLITS) == {"train", "val", "test"}


def test_a_format_changed_back_leaves_only_the_new_one(tmp_path):
    w = folder_workspace(tmp_path / "w")
    make_folder(w / "raw", 8, bad=False)
    prepared(w, "shards")
    prepared(w, "tensors")
    prep = w / "data/prepared"
    assert not (prep / "train").exists() and isinstance(load_split(prep, "train").x, torch.Tensor)
    prepared(w, "shards")
    assert not list(prep.glob("*.pt")) and load_split(prep, "train").x.__class__.__name__ == \
        "ShardImages"


def test_a_shard_cut_short_under_training_workers_ends_it_in_one_line_naming_it(tmp_path):
    w = folder_workspace(tmp_path / "w")
    make_folder(w / "raw", 8, bad=False)
    prepared(w, "shards", **{"epochs": "1", "model.width": "8", "train.num_workers": "2"})
    shard = w / "data/prepared/train/shard-000000.tar"
    shard.write_bytes(shard.read_bytes()[:4096])
    p = run([sys.executable, "-m", "stages.train"], w, check=False,
            env=env_with(PYTHONPATH=str(ROOT), REPROTRAIN_WARM="0",
                         MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}"))
    line = one_error_line(p.stderr)
    assert p.returncode == 1 and "data/prepared/train/shard-000000.tar: truncated: sample " in line, \
        p.stderr
