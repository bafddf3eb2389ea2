"""data.format: shards (stages/lib/shards.py): an image folder's splits as tar shards of the encoded
files with an index, read by train's DataLoader workers (train.loader: stream)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from stages.data import SPLITS, Images, load_meta, load_split
from stages.lib.images import DataError
from tests.conftest import ROOT, env_with, run, set_params
from tests.support.image_files import make_folder, noise_folder
from tests.support.training import same_weights, stream_fit
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
        assert isinstance(t.x, Images) and isinstance(s.x, Images), name  # the formats' contract
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


def test_training_on_shards_says_and_records_how_many_workers_auto_gave(both, tmp_path):
    """Issue 57: the stream loader's line said no number, and MLflow recorded
    `train.num_workers auto`."""
    import mlflow

    from stages.data import resolve_workers

    sw, _ = both["shards"]
    set_params(sw / "params.yaml", {"epochs": "1", "model.width": "8"})
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    p = run([sys.executable, "-m", "stages.train"], sw,
            env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=uri, REPROTRAIN_WARM="0"))
    n = resolve_workers("auto")
    assert f", stream loader, {n} worker{'' if n == 1 else 's'}): " in p.stdout, p.stdout
    run_id = json.loads((sw / "models/train/run.json").read_text())["run_id"]
    tags = mlflow.MlflowClient(uri).get_run(run_id).data.tags
    assert tags["num_workers"] == str(n) and tags["data.channels"] == "3"


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
    assert not (prep / "train").exists() and load_split(prep, "train").format == "tensors"
    prepared(w, "shards")
    assert not list(prep.glob("*.pt")) and load_split(prep, "train").format == "shards"


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


def test_prepare_killed_mid_split_resumes_after_its_whole_shards_to_the_same_bytes(tmp_path):
    import signal
    import subprocess
    import time

    w = folder_workspace(tmp_path / "w")
    noise_folder(w / "raw", 100)
    set_params(w / "params.yaml", {"data.format": "shards", "data.channels": "3",
                                   "data.shard_mb": "1", "data.num_workers": "1"})
    partial, prep = w / "data/.prepared.partial", w / "data/prepared"
    p = subprocess.Popen([sys.executable, "-m", "stages.prepare"], cwd=w, start_new_session=True,
                         env=env_with(PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:  # killed as a crash kills it, once three of train's about 20 shards are whole
        while not (partial / "train/shard-000002.tar.json").exists() and p.poll() is None:
            time.sleep(0.001)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert not (prep / "meta.json").exists()
    whole = sorted(partial.glob("train/shard-*.tar.json"))
    assert len(whole) >= 3
    inodes = {f.stem: f.with_suffix("").stat().st_ino for f in whole}
    shutil.rmtree(prep, ignore_errors=True)  # as `dvc repro` does before it runs the stage
    said = run([sys.executable, "-m", "stages.prepare"], w, env=env_with(PYTHONPATH=str(ROOT))).stdout
    assert f"prepare: train: resumed after the {len(whole)} whole shards a killed run left in " \
        "data/.prepared.partial/train" in said, said
    # The written shards were not written again: the files moved into data/prepared.
    assert {n: (prep / "train" / n).stat().st_ino for n in inodes} == inodes
    assert not partial.exists()
    resumed = {f.relative_to(prep): f.read_bytes() for f in prep.rglob("*") if f.is_file()}
    shutil.rmtree(prep)
    run([sys.executable, "-m", "stages.prepare"], w, env=env_with(PYTHONPATH=str(ROOT)))
    assert resumed == {f.relative_to(prep): f.read_bytes() for f in prep.rglob("*") if f.is_file()}
    assert len(list(prep.glob("train/shard-*.tar"))) > len(whole)


def test_prepare_deletes_only_a_partial_folder_it_wrote(tmp_path):
    """data/.prepared.partial holds a killed run's shards, and prepare deletes it when done or
    when it holds another run's: never a folder of that name without prepare's `key` in it."""
    w = folder_workspace(tmp_path / "w")
    make_folder(w / "raw", 4, bad=False)
    (w / "data/.prepared.partial").mkdir(parents=True)
    (w / "data/.prepared.partial/notes.txt").write_text("mine")
    set_params(w / "params.yaml", {"data.format": "shards", "data.channels": "3"})
    p = run([sys.executable, "-m", "stages.prepare"], w, check=False,
            env=env_with(PYTHONPATH=str(ROOT)))
    assert p.returncode == 1 and "data/.prepared.partial: prepare keeps a killed run's shards " \
        "under this name, and this is not one of its folders (it has no `key` file); move it " \
        "away, then rerun" in one_error_line(p.stderr), p.stderr
    assert (w / "data/.prepared.partial/notes.txt").read_text() == "mine"
    assert not (w / "data/prepared").exists()


def test_a_folder_whose_decoded_splits_exceed_memory_is_refused_before_decoding(tmp_path):
    import io

    from PIL import Image

    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    n = total // (3 * 1024**2) + 100  # each decoded at 1024 px: 3 MiB, over all the memory
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, "PNG")
    w = folder_workspace(tmp_path / "w")
    for c in ("a", "b"):
        (w / "raw" / c).mkdir(parents=True)
        for i in range(n // 2 + 1):
            (w / "raw" / c / f"{i}.png").write_bytes(png.getvalue())
    set_params(w / "params.yaml", {"data.format": "tensors", "data.channels": "3",
                                   "data.image_size": "1024"})
    p = run([sys.executable, "-m", "stages.prepare"], w, check=False,
            env=env_with(PYTHONPATH=str(ROOT)))
    line = one_error_line(p.stderr)
    assert p.returncode == 1 and f"raw: decoded at data.image_size 1024, the {2 * (n // 2 + 1):,} " \
        "images take " in line and "GiB of memory available; set data.format: shards (or auto)" \
        in line, p.stderr
    assert not (w / "data/prepared").exists() or not any((w / "data/prepared").iterdir())


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="mounts a small tmpfs in a mount namespace of its own: needs root")
def test_shards_larger_than_the_free_disk_are_refused_before_work(tmp_path):
    w = folder_workspace(tmp_path / "w")
    noise_folder(w / "raw", 10)  # 30 files, about 3 MiB
    set_params(w / "params.yaml", {"data.format": "shards", "data.channels": "3"})
    (w / "data").mkdir()
    # data/ on a 1 MiB tmpfs, seen by this command alone (unshare's private propagation).
    p = run(["unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs data && exec "$0" '
             '-m stages.prepare', sys.executable], w, check=False,
            env=env_with(PYTHONPATH=str(ROOT)))
    line = one_error_line(p.stderr)
    need = sum(f.stat().st_size for f in (w / "raw").rglob("*.jpg")) / 2**20
    assert p.returncode == 1 and f"data/prepared: shards of the 30 images in raw need about " \
        f"{need:.1f} MiB more, and its file system has 1.0 MiB free; free space there, or lower " \
        "data.store_size" in line, p.stderr
    assert not any((w / "data").iterdir())


def test_two_ranks_stream_disjoint_halves_of_every_epoch(both):
    from stages.batches import loader_batches, plan_batches, rank_order

    split = load_split(both["shards"][0] / "data/prepared", "train")
    n = len(split.y)
    plan = plan_batches(n, 4, world=2, accumulate=1)
    seen = {}
    for rank in (0, 1):  # each rank's own DataLoader, with 2 workers, as under torchrun
        batches = loader_batches(split, plan, torch.device("cpu"), 7, True, rank, 2, 2, streamed=True)
        for epoch in (0, 1):
            seen[rank, epoch] = [i for _, _, idx in batches(epoch) for i in idx.tolist()]
    for epoch in (0, 1):
        a, b = seen[0, epoch], seen[1, epoch]
        assert not set(a) & set(b) and len(a) == len(b) == n // 2
        assert sorted(a + b) == sorted(rank_order(n, 7, epoch, True, 0, 1)[: n - n % 2].tolist())
    assert seen[0, 0] != seen[0, 1]


def _stream_rank(rank: int, world: int, init: str, prep, out: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model = stream_fit(prep, 1, model=linear(prep), rank=rank, world=world).model
        if rank == 0:
            torch.save(model.state_dict(), out)
    finally:
        torch.distributed.destroy_process_group()


def linear(prep) -> torch.nn.Module:
    meta = load_meta(prep)
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(),
                               torch.nn.Linear(3 * meta["image_size"] ** 2, len(meta["classes"])))


def test_two_ddp_ranks_stream_the_halves_of_one_process_s_batches(both, tmp_path):
    """Two gloo ranks, as torchrun starts them, each streaming with a DataLoader worker of its
    own, take the steps of one process with their global batch of 16: each rank read its own
    half of every batch, crops and all (a linear model: no BatchNorm statistics per rank)."""
    prep = both["shards"][0] / "data/prepared"
    out = tmp_path / "ddp.pt"
    torch.multiprocessing.spawn(_stream_rank, args=(2, f"file://{tmp_path / 'pg'}", prep, str(out)),
                                nprocs=2)
    one = stream_fit(prep, 1, model=linear(prep)).model.state_dict()
    ddp = torch.load(out, weights_only=True)
    assert max((ddp[k] - one[k]).abs().max().item() for k in one) < 1e-5
    assert max((one[k] - linear(prep).state_dict()[k]).abs().max().item() for k in one) > 1e-3


def test_the_gpu_decoders_batches_are_the_workers_crops(both):
    """What the CUDA path does (EncodedStream, then decoded_batch), run here on the CPU with
    torchvision's CPU decoder (libjpeg-turbo, as Pillow): the same crop boxes, the other formats
    decoded in the workers as before, the JPEGs within a level of Pillow's bicubic on
    average (the batched resize is Pillow's, in floating point). tests/experiment/test_gpu.py
    runs it with nvJPEG."""
    from torchvision.io import ImageReadMode, decode_jpeg

    from stages.batches import EncodedStream, StreamedDataset
    from stages.lib.shards import decoded_batch

    split = load_split(both["shards"][0] / "data/prepared", "train")
    crop = ((0.35, 1.0), (0.75, 4 / 3))
    enc, ref = EncodedStream(split, 3, crop), StreamedDataset(split, 3, crop)
    n = len(split.y)
    batch = EncodedStream.collate([enc[(i, 1)] for i in range(n)])
    boxes, ys, idx = batch[3:]
    x = decoded_batch(*batch[:4], split.x.size, split.x.channels, torch.device("cpu"),
                      lambda ps: decode_jpeg(ps, mode=ImageReadMode.RGB), None)
    want = torch.stack([ref[(i, 1)][0] for i in range(n)])
    jpeg = boxes[:, 0] >= 0
    assert 0 < int(jpeg.sum()) < n and torch.equal(idx, torch.arange(n)) and torch.equal(ys, split.y)
    assert torch.equal(x[~jpeg], want[~jpeg])
    diff = (x[jpeg].int() - want[jpeg].int()).abs().float()
    assert diff.mean(dim=(1, 2, 3)).max() < 1, diff.mean(dim=(1, 2, 3))


def test_validation_and_evaluate_decode_shards_in_workers_to_the_same_logits(both):
    from stages.config import ModelConfig, TrainConfig
    from stages.data import in_batches
    from stages.models import build_model
    from stages.runtime import predict

    prep = both["shards"][0] / "data/prepared"
    meta, split = load_meta(prep), load_split(prep, "test")
    torch.manual_seed(0)
    model = build_model(ModelConfig(width=8), 3, len(meta["classes"]), meta["image_size"])
    mean, std = torch.tensor(meta["mean"]), torch.tensor(meta["std"])
    logits = [predict(model, in_batches(split, 4, TrainConfig(num_workers=workers)), mean, std,
                      device=torch.device("cpu")) for workers in (0, 2)]
    assert len(logits[0]) == len(split.y) and torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("orientation", [1, 6])
def test_a_crop_decodes_a_large_jpeg_at_a_reduced_scale_and_cuts_the_same_box(tmp_path,
                                                                              orientation):
    """Pillow's draft: a 256x192 JPEG cropped to 16 px through a box of half its sides decodes
    at 1/4 (64x48: the box keeps 32x24 >= 16), and the box drawn at the full size is cut from it:
    the pixels of the whole decode's crop. Turned a quarter by its EXIF orientation (6), the box
    is drawn at the turned size, 192x256."""
    import numpy as np
    from PIL import Image

    from stages.batches import crop_boxes
    from stages.lib import shards
    from stages.lib.images import Files, decode_pixels

    yy, xx = np.mgrid[0:192, 0:256]
    ramp = np.stack([xx, yy, (xx + yy) / 2], -1) * 0.6 + 20 * np.sin(xx / 40)[..., None]
    exif = Image.Exif()
    exif[shards.ORIENTATION] = orientation
    Image.fromarray(ramp.astype(np.uint8)).save(tmp_path / "a.jpg", quality=95, exif=exif)
    shards.write_split(tmp_path / "split", Files.of([str(tmp_path / "a.jpg")], 0), 3, 16,
                       "squash", 256, 2**20, 1)
    x = shards.ShardImages(tmp_path / "split", 3, 16, "squash")
    size = (256, 192) if orientation == 1 else (192, 256)
    drafted, full = x.pixels(0, 32)
    assert drafted.size == (size[0] // 4, size[1] // 4) and full == size
    whole, _ = decode_pixels((tmp_path / "a.jpg").read_bytes(), 3)
    assert whole.size == size
    boxes = torch.cat([torch.tensor([[0.25, 0.5, 0.5, 0.5]], dtype=torch.float64),
                       crop_boxes(0, 0, torch.arange(4), ((0.35, 1.0), (0.75, 4 / 3)))])
    for box in boxes:
        top, left, h, w = (box * torch.tensor([size[1], size[0]] * 2)).tolist()
        want = np.asarray(whole.resize((16, 16), Image.Resampling.BICUBIC,
                                       box=(left, top, left + w, top + h))).transpose(2, 0, 1)
        diff = (x.cropped(0, box).int() - torch.from_numpy(want.copy()).int()).abs().float()
        assert diff.mean() < 2, (box, diff.mean())


@pytest.fixture
def one_folder_both_ways(tmp_path):
    """Six 16 px noise PNGs as prepare keeps them both ways: decoded into a tensor (decode_image)
    and stored in a shard (write_split); the same pixels."""
    import numpy as np
    from PIL import Image

    from stages.data import Split
    from stages.lib import shards
    from stages.lib.images import Files, decode_image

    rng = np.random.default_rng(0)
    paths = [str(tmp_path / f"{k}.png") for k in range(6)]
    for path in paths:
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(path)
    shards.write_split(tmp_path / "split", Files.of(paths, 0), 3, 16, "squash", 256, 2**20, 1)
    x = shards.ShardImages(tmp_path / "split", 3, 16, "squash")
    tensor = torch.stack([torch.from_numpy(decode_image(p, 3, 16, "squash").copy()) for p in paths])
    assert torch.equal(x[:], tensor)
    return Split(tensor, x.labels()), Split(x, x.labels(), "shards")


def _one_batch(split, crop, epoch: int, loader: str):
    """The epoch's one batch as the loop augments it: a resized crop drawn by (seed 5, epoch,
    index), then the pad-crop and flip; a streamed batch came cropped from its workers."""
    from stages.batches import augment, device_batches, loader_batches, plan_batches

    plan, cpu = plan_batches(len(split.y), len(split.y), 1, 1), torch.device("cpu")
    batches = device_batches(split, plan, cpu, 5, False, 0, 1) if loader == "device" else \
        loader_batches(split, plan, cpu, 5, False, 0, 1, 0, crop, streamed=True)
    (x, _, idx), = batches(epoch)
    return augment(x, idx, 5, epoch, 1, True, crop if loader == "device" else None)


def test_a_resized_crop_is_the_same_function_of_seed_epoch_and_index_for_tensors_and_shards(
        one_folder_both_ways):
    """train.augment_crop_*: the same crops of the same images whether prepare kept tensors or
    shards (Pillow's bicubic on a shard, its port on tensors: within a level)."""
    tensors, sharded = one_folder_both_ways
    crop = ((0.35, 1.0), (0.75, 4 / 3))
    for epoch in (0, 1):
        a, b = _one_batch(tensors, crop, epoch, "device"), _one_batch(sharded, crop, epoch, "stream")
        diff = (a.int() - b.int()).abs()
        assert diff.max() <= 1 and diff.float().mean() < 0.1, (epoch, diff.max())
    uncropped = _one_batch(tensors, None, 1, "device")
    assert (a.int() - uncropped.int()).abs().float().mean() > 20


def test_the_shard_path_with_default_params_applies_no_resized_crop(one_folder_both_ways):
    """Off by default: a streamed batch is the tensors' batch, bit for bit, so `data.format:
    auto` cannot change what is learned."""
    from stages.batches import random_resized_crop
    from stages.config import TrainConfig

    tensors, sharded = one_folder_both_ways
    crop = random_resized_crop(TrainConfig())
    assert crop is None
    for epoch in (0, 1):
        assert torch.equal(_one_batch(tensors, crop, epoch, "device"),
                           _one_batch(sharded, crop, epoch, "stream"))


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory):
    """A folder of 264 noise PNGs of 256 px (kept as they are, 200 KB each) as 1-MiB shards: 31
    train shards, trained one epoch by the stage with 2 DataLoader workers."""
    w = folder_workspace(tmp_path_factory.mktemp("many") / "w")
    noise_folder(w / "raw", 88, ext="png")
    prepared(w, "shards", **{"data.shard_mb": "1", "data.image_size": "16", "epochs": "1",
                             "model.width": "8", "train.num_workers": "2"})
    assert len(list((w / "data/prepared/train").glob("shard-*.tar"))) == 31
    return w


def train_stage(w, mlflow_uri: str, files: int | None = None):
    """The train stage in a session of its own, under an open-files limit of `files`
    (`ulimit -n`), soft and hard."""
    import resource
    import subprocess

    def limit() -> None:
        if files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))

    return subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=w, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=limit,
                            start_new_session=True,
                            env=env_with(PYTHONPATH=str(ROOT), REPROTRAIN_WARM="0",
                                         MLFLOW_TRACKING_URI=mlflow_uri))


def ended(p, timeout: float = 240) -> tuple[str, str]:
    """p's stdout and stderr once it ends; a p still running after `timeout` s (a hang) is
    killed with its workers, and fails the test."""
    import signal
    import subprocess

    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"still running after {timeout} s (a hang)\n{err[-3000:]}") from None


def test_31_shards_train_under_an_open_files_limit_of_48_to_the_same_weights(many_shards,
                                                                             mlflow_uri):
    """Each process held every shard open: under `ulimit -n 48`, 31 shards in each of 2 workers
    beside torch's own descriptors ran out, a worker could not hand a batch over, and training
    waited for ever. Now a process keeps an eighth of its limit open (6 here)."""
    model = many_shards / "models/train/model.pt"
    p = train_stage(many_shards, mlflow_uri, files=48)
    _, err = ended(p)
    assert p.returncode == 0, err[-3000:]
    limited = model.read_bytes()
    model.unlink()
    p = train_stage(many_shards, mlflow_uri)
    _, err = ended(p)
    assert p.returncode == 0, err[-3000:]
    assert model.read_bytes() == limited


def test_a_worker_killed_mid_epoch_ends_training_in_one_line(many_shards, mlflow_uri):
    """SIGKILL to a DataLoader worker (the kernel's OOM killer sends one): torch raises its
    error wherever the training process is (in the model's forward, often), never a hang."""
    import signal
    import time

    set_params(many_shards / "params.yaml", {"epochs": "20"})
    try:
        p = train_stage(many_shards, mlflow_uri)
        workers, deadline = [], time.time() + 120
        while len(workers) < 2 and p.poll() is None and time.time() < deadline:
            time.sleep(0.1)
            workers = dataloader_workers(p.pid)
        time.sleep(1)  # training under way
        os.kill(workers[0], signal.SIGKILL)
        _, err = ended(p)
    finally:
        set_params(many_shards / "params.yaml", {"epochs": "1"})
    # torch's words: "is killed by signal: Killed" from its SIGCHLD handler, "exited
    # unexpectedly" where its wait for a batch notices first; killed as it handed a batch over,
    # the broken connection to it comes first (its pid unknown here).
    line = one_error_line(err)
    assert p.returncode == 1 and (
        line.startswith("error: DataLoader worker (pid") and f"{workers[0]})" in line or
        line.startswith("error: a DataLoader worker died handing a batch over (")), err
    assert line.endswith("; a worker killed by SIGKILL is most often the kernel's out-of-memory "
                         "killer (see `dmesg`): lower train.num_workers or batch_size, then "
                         "rerun; training resumes from its last checkpoint"), err


def dataloader_workers(parent: int) -> list[int]:
    """The children of `parent` forked from it (its command line), not those it ran (git)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                if f"PPid:\t{parent}\n" in f.read() and \
                        b"stages.train" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(int(pid))
        except OSError:  # ended since
            pass
    return found


def test_a_val_sample_that_does_not_decode_in_a_worker_is_one_line(tmp_path, mlflow_uri):
    import numpy as np

    w = folder_workspace(tmp_path / "w")
    make_folder(w / "raw", 8, bad=False)
    prepared(w, "shards", **{"epochs": "1", "model.width": "8", "train.num_workers": "2"})
    shard, offset, size, _ = np.load(w / "data/prepared/val/index.npy")[0].tolist()
    path = f"data/prepared/val/shard-{shard:06d}.tar"
    with open(w / path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * size)
    p = train_stage(w, mlflow_uri)
    _, err = ended(p)
    assert p.returncode == 1 and one_error_line(err).startswith(
        f"error: {path}: sample 0 does not decode (not an image file"), err


class _Failing(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 2:
            raise ValueError(f"sample {i} is not what it should be")
        return torch.zeros(1)


def test_any_error_in_a_dataloader_worker_is_one_line():
    from stages.data import from_workers
    from stages.lib.errors import UserError

    loader = torch.utils.data.DataLoader(_Failing(), num_workers=2)
    with pytest.raises(UserError) as caught:
        list(from_workers(loader))
    assert str(caught.value) == \
        "a DataLoader worker failed: ValueError: sample 2 is not what it should be"


class _Stuck(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> torch.Tensor:
        import time

        time.sleep(1.5)  # as a worker stuck on a read, or one whose batch torch lost
        return torch.zeros(1)


def test_a_batch_that_never_comes_ends_in_one_line_not_a_wait_for_ever():
    from stages.data import from_workers
    from stages.lib.errors import UserError

    loader = torch.utils.data.DataLoader(_Stuck(), num_workers=1, timeout=1)
    with pytest.raises(UserError, match=r"^no batch from the DataLoader workers in 1 s: one is "
                                        "stuck or lost a batch"):
        list(from_workers(loader))


def test_a_label_past_meta_s_classes_is_named_with_its_file_and_row(both, tmp_path):
    import numpy as np

    from stages.lib.errors import UserError

    for fmt in ("shards", "tensors"):
        prep = tmp_path / fmt
        shutil.copytree(both[fmt][0] / "data/prepared", prep)
        if fmt == "shards":
            path = prep / "train/index.npy"
            index = np.load(path)
            index["label"][5] = 99
            np.save(path, index)
        else:
            path = prep / "train.pt"
            d = torch.load(path, weights_only=True)
            d["y"][5] = 99
            torch.save(d, path)
        with pytest.raises(UserError, match=rf"^{path}: row 5 has label 99, and meta.json lists "
                                            r"3 classes \(labels 0 to 2\); rebuild it with"):
            load_split(prep, "train")
def test_validation_keeps_its_decoding_workers_across_epochs(one_folder_both_ways):
    """A sharded val split is decoded by worker processes forked once, not every epoch: in
    epochs 2 and 3 the same two children live beside the training steps (the training loader's
    worker and validation's), and no other was started."""
    import multiprocessing

    from stages.config import TrainConfig
    from stages.loop import Job, RunIO, train
    from tests.support.training import CPU_FP32

    _, sharded = one_folder_both_ways
    seen: dict[int, set[int]] = {}
    # Children of this process that train did not start: under xdist, an earlier test's.
    before = {p.pid for p in multiprocessing.active_children()}

    def log(metrics: dict, step: int, durable: bool = False) -> None:
        if "train_loss_step" in metrics:  # after every step (log_every 1), 3 an epoch
            seen.setdefault((step - 1) // 3, set()).update(
                p.pid for p in multiprocessing.active_children() if p.pid not in before)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 2))
    cfg = TrainConfig(**{**CPU_FP32, "loader": "auto", "num_workers": 1, "log_every": 1})
    job = Job(train=sharded, val=sharded, mean=[0.5] * 3, std=[0.25] * 3, cfg=cfg, lr=1e-3,
              epochs=3, batch_size=2, seed=0)
    train(model, job, RunIO(log=log, progress=False, verbose=False))
    assert len(seen[1]) == 2 and seen[1] == seen[2], seen
