"""prepare and the data path: deterministic splits, honest statistics, index-keyed augmentation."""

from __future__ import annotations

import json
import os
import sys

import torch

from stages.batches import augment, epoch_order
from stages.data import SPLITS, load_split
from stages.sources import stratified_split
from tests.conftest import ROOT, copy_params, env_with, run, set_params
from tests.support.workspaces import one_error_line, workspace


def _prepare(tmp_path, **params):
    copy_params(tmp_path)
    set_params(tmp_path / "params.yaml", params)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run([sys.executable, "-m", "stages.prepare"], tmp_path, env=env)
    return json.loads((tmp_path / "data/prepared/meta.json").read_text())


def test_prepare_is_deterministic_and_seeded(tmp_path):
    a, b, c = (tmp_path / n for n in "abc")
    for d in (a, b, c):
        d.mkdir()
    meta_a = _prepare(a, seed="7")
    meta_b = _prepare(b, seed="7")
    meta_c = _prepare(c, seed="8")
    assert meta_a == meta_b
    for name in SPLITS:
        assert (a / f"data/prepared/{name}.pt").read_bytes() == (b / f"data/prepared/{name}.pt").read_bytes()
    assert meta_c["sha256"] != meta_a["sha256"]  # another seed, another split

    # The whole real dataset, disjoint splits, every class in every split in proportion.
    assert meta_a["sizes"] == {"train": 1257, "val": 180, "test": 360}
    assert sum(meta_a["sizes"].values()) == 1797
    for split, counts in meta_a["counts"].items():
        share = meta_a["sizes"][split] / 1797
        for n in counts.values():
            assert abs(n - 180 * share) <= 2 + 0.1 * 180 * share
    train = load_split(a / "data/prepared", "train")
    assert train.x.dtype == torch.uint8 and tuple(train.x.shape[1:]) == (1, 16, 16)
    # Statistics from the train split alone.
    assert abs(meta_a["mean"][0] - train.x.float().div(255).mean().item()) < 1e-6
    assert meta_a["classes"] == [str(i) for i in range(10)]


def test_split_indices_are_disjoint():
    y = torch.arange(200) % 4
    parts = stratified_split(y, 0.1, 0.2, seed=1)
    all_idx = torch.cat(list(parts.values()))
    assert len(all_idx) == 200 and len(set(all_idx.tolist())) == 200


def test_augmentation_depends_on_the_sample_not_the_batch(digits):
    splits, _ = digits
    x = splits["train"].x[:64]
    idx = torch.arange(64)
    full = augment(x, idx, seed=1, epoch=3, pad=2, hflip=True)
    # The same samples drawn in another order and batch composition get the same crops.
    perm = torch.randperm(64)
    part = augment(x[perm[:10]], idx[perm[:10]], seed=1, epoch=3, pad=2, hflip=True)
    assert torch.equal(part, full[perm[:10]])
    # Another epoch, other crops; shapes and dtype kept; pixels come from the image or padding.
    other = augment(x, idx, seed=1, epoch=4, pad=2, hflip=True)
    assert not torch.equal(other, full)
    assert full.shape == x.shape and full.dtype == torch.uint8
    assert full.sum() <= x.sum()


def test_crop_without_padding_is_identity(digits):
    splits, _ = digits
    x = splits["train"].x[:8]
    assert torch.equal(augment(x, torch.arange(8), 0, 0, pad=0, hflip=False), x)


def test_epoch_order_is_a_pure_function_of_seed_and_epoch():
    assert torch.equal(epoch_order(100, 3, 5), epoch_order(100, 3, 5))
    assert not torch.equal(epoch_order(100, 3, 5), epoch_order(100, 3, 6))
    assert sorted(epoch_order(100, 3, 5).tolist()) == list(range(100))


def test_digits_are_scikit_learns_read_without_importing_it():
    import numpy as np
    from sklearn.datasets import load_digits as sklearn_digits

    from stages.sources import load_digits

    x, y, classes = load_digits()
    theirs = sklearn_digits()
    assert torch.equal(x[:, 0], torch.from_numpy(np.round(theirs.images * (255 / 16)).astype(np.uint8)))
    assert y.tolist() == theirs.target.tolist() and classes == [str(c) for c in range(10)]


def test_the_dataset_record_names_where_the_raw_data_lives():
    from stages.sources import raw_data

    assert raw_data("digits", "data/raw").name == "digits.csv.gz"
    assert raw_data("digits", "data/raw").is_file()  # inside scikit-learn, not data.root
    assert raw_data("folder", "data/raw") == (ROOT / "data/raw").resolve()


def test_a_truncated_prepared_split_fails_naming_it(tmp_path, digits):
    w = workspace(tmp_path / "w", digits)
    split = w / "data/prepared/train.pt"
    split.write_bytes(split.read_bytes()[:5000])
    p = run([sys.executable, "-m", "stages.train"], w, env=env_with(PYTHONPATH=str(ROOT)),
            check=False)
    assert p.returncode == 1 and "data/prepared/train.pt: unreadable" in one_error_line(p.stderr)


def test_auto_workers_share_the_node_s_cores_among_its_ranks(monkeypatch):
    """train.num_workers: auto under torchrun: each of the node's LOCAL_WORLD_SIZE ranks keeps a
    core and forks what is left of its share, so the ranks and their workers never take more
    cores than the node has (8 ranks on 16 cores forked 8 x 8 = 64 decoders)."""
    from stages.data import resolve_workers

    cpus = os.cpu_count() or 1
    assert resolve_workers("auto", 1) == max(0, min(8, cpus - 1))
    for ranks in (2, 8, cpus):
        workers = resolve_workers("auto", ranks)
        assert ranks * (workers + 1) <= max(cpus, ranks), (ranks, workers)
        assert workers == max(0, min(8, cpus // ranks - 1))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cpus))  # as torchrun sets it: one rank per core
    assert resolve_workers("auto") == 0
    assert resolve_workers(3) == 3  # a number is taken as asked
