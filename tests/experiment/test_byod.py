"""Bring your own data: image folders in every format, broken files, torchvision sources."""

from __future__ import annotations

import csv
import json
import os
import shutil
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stages.data import load_split
from stages.lib.images import decode_image
from tests.conftest import ROOT, copy_params, env_with, run, set_params
from tests.support.image_files import CLASSES, EPS, FORMATS, draw, fake_ghostscript, make_folder, save
from tests.support.workspaces import folder_workspace


def prepare(tmp_path, check=True, env_extra=None, **params):
    copy_params(tmp_path)
    set_params(tmp_path / "params.yaml", params)
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env_extra or {}))
    return run([sys.executable, "-m", "stages.prepare"], tmp_path, env=env, check=check)


def folder_params(root, **extra):
    return {"data.source": "folder", "data.root": str(root), "data.channels": "3",
            "data.image_size": "24", **extra}


@pytest.mark.parametrize("ext, mode", FORMATS)
def test_every_format_and_mode_decodes_to_the_target(tmp_path, ext, mode):
    import random

    path = tmp_path / f"img{ext}"
    save(draw("square", random.Random(1)), path, mode)
    for channels in (1, 3):
        x = decode_image(path, channels, 20, "squash")
        assert x.shape == (channels, 20, 20) and x.dtype == np.uint8
        assert x.max() > 120  # the bright shape survived the conversion (16-bit scaled, not clipped)
    assert decode_image(path, 3, 20, "center_crop").shape == (3, 20, 20)


def test_transparency_is_composited_onto_black(tmp_path):
    img = Image.new("RGBA", (8, 8), (255, 255, 255, 0))  # fully transparent white
    img.save(tmp_path / "t.png")
    assert decode_image(tmp_path / "t.png", 1, 8, "squash").max() == 0


def test_a_lossless_jpeg_decodes_where_a_reduced_scale_decode_is_asked(tmp_path):
    """libjpeg scales only a DCT's inverse: a lossless JPEG (SOF3) asked at 1/2 scale, as the
    crops and the channel check ask, decodes whole rather than reading as damaged."""
    from stages.lib.images import decode_pixels, has_colour
    from tests.support.image_files import lossless_jpeg

    pixels = np.random.default_rng(0).integers(0, 256, (64, 48), dtype=np.uint8)
    path = tmp_path / "lossless.jpg"
    path.write_bytes(lossless_jpeg(pixels))
    img, size = decode_pixels(path, 1, draft=16)
    assert size == (48, 64) and np.array_equal(np.asarray(img), pixels)
    assert not has_colour(path)


def test_folder_prepare_skips_and_lists_bad_files(tmp_path):
    data = tmp_path / "shapes"
    counts = make_folder(data, per_class=20)
    p = prepare(tmp_path, **folder_params(data, **{"data.max_rejected_fraction": "0.1"}))
    assert "skipped 3 unreadable files" in p.stderr
    meta = json.loads((tmp_path / "data/prepared/meta.json").read_text())
    assert meta["classes"] == sorted(CLASSES)
    assert sum(meta["sizes"].values()) == counts["all"]  # hidden files and folders ignored
    assert meta["rejected"] == 3
    rows = list(csv.DictReader(open(tmp_path / "data/prepared/rejected.csv")))
    reasons = {os.path.basename(r["path"]): r["reason"] for r in rows}
    assert set(reasons) == {"empty.png", "truncated.png", "notes.jpg"}
    assert "0 bytes" in reasons["empty.png"]
    assert "not an image file of a format read here (BMP, JPEG, PNG, TIFF, WEBP)" in \
        reasons["notes.jpg"]
    x = load_split(tmp_path / "data/prepared", "train").x
    assert tuple(x.shape[1:]) == (3, 24, 24)


def test_a_postscript_file_among_the_images_is_listed_and_never_runs_ghostscript(tmp_path):
    data = tmp_path / "shapes"
    make_folder(data, per_class=10, bad=False)
    (data / "circle/drawing.png").write_bytes(EPS)  # what its name says is not what it holds
    called = fake_ghostscript(tmp_path / "bin")
    p = prepare(tmp_path, env_extra={"PATH": f"{called.parent}{os.pathsep}{os.environ['PATH']}"},
                **folder_params(data, **{"data.max_rejected_fraction": "0.1"}))
    assert not called.exists(), f"prepare ran Ghostscript: {called.read_text()}"
    assert "skipped 1 unreadable files" in p.stderr and "Traceback" not in p.stderr, p.stderr
    (row,) = csv.DictReader(open(tmp_path / "data/prepared/rejected.csv"))
    assert row["path"].endswith("drawing.png")
    assert row["reason"] == ("not an image file of a format read here (BMP, JPEG, PNG, TIFF, "
                             "WEBP); convert it, e.g. to PNG")


def test_an_image_with_a_side_too_long_is_listed_not_a_memory_error(tmp_path):
    """A 74-byte PNG declaring 1x100,000,000 pixels (under Pillow's bomb limit) ended prepare in
    a MemoryError traceback: resizing it allocates a filter tap per source row."""
    data = tmp_path / "shapes"
    make_folder(data, per_class=10, bad=False)
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return (struct.pack(">I", len(payload)) + kind + payload
                + struct.pack(">I", zlib.crc32(kind + payload)))
    (data / "circle/tall.png").write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 100_000_000, 8, 0, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(b"\0" * 1000)) + chunk(b"IEND", b""))
    p = prepare(tmp_path, check=False, **folder_params(data, **{"data.max_rejected_fraction": "0.1"}))
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    (row,) = csv.DictReader(open(tmp_path / "data/prepared/rejected.csv"))
    assert row["path"].endswith("tall.png")
    assert row["reason"] == ("1x100000000 pixels: a side over 65,535 (MAX_SIDE in "
                             "stages/lib/images.py); crop or resize it first")


@pytest.mark.parametrize("fmt", ["tensors", "shards"])
def test_given_splits_are_used_and_leakage_is_reported(tmp_path, fmt):
    data = tmp_path / "shapes"
    make_folder(data, per_class=0, splits={"train": 12, "val": 3, "test": 4}, bad=False)
    shutil.copy(data / "train/circle/circle_000.png", data / "test/circle/leak.png")
    p = prepare(tmp_path, **folder_params(data, **{"data.format": fmt}))
    meta = json.loads((tmp_path / "data/prepared/meta.json").read_text())
    assert meta["sizes"] == {"train": 36, "val": 9, "test": 13}
    assert meta["duplicates_across_splits"] == 1 and "leakage" in p.stderr
    leak = list(csv.DictReader(open(tmp_path / "data/prepared/leakage.csv")))
    assert [(r["split"], os.path.basename(r["path"])) for r in leak] == \
        [("train", "circle_000.png"), ("test", "leak.png")]


def test_leaks_are_whole_digests_shared_across_splits_in_the_splits_order():
    """leaks_in matches files by their digests' first 8 bytes, then by the whole digest."""
    from stages.lib.images import DIGEST, Files
    from stages.sources import leaks_in

    def digest(head: int, tail: int) -> bytes:
        return bytes([head] * 8 + [tail] * 24)

    def leaks(**splits):  # each split's files: (path, digest) decoded, or (path, None) rejected
        items = {n: Files.of([p for p, _ in files], 0) for n, files in splits.items()}
        return leaks_in(items, {n: (np.array([i for i, (_, d) in enumerate(files) if d], dtype=int),
                                    np.array([digest(*d) for _, d in files if d], dtype=DIGEST))
                                for n, files in splits.items()})

    got = leaks(train=[("a", (1, 1)), ("b", (2, 2)), ("b2", (2, 2)), ("c", (3, 3)), ("e", (5, 5))],
                val=[("bad", None), ("c-val", (3, 3)), ("twin", (1, 9))],  # twin: a's first 8 bytes
                test=[("e-test", (5, 5)), ("c-test", (3, 3)), ("lone", (7, 7))])
    assert got == {digest(3, 3).hex(): [("train", "c"), ("val", "c-val"), ("test", "c-test")],
                   digest(5, 5).hex(): [("train", "e"), ("test", "e-test")]}
    assert leaks(train=[("a", (1, 1))], val=[], test=[]) == {} == leaks(train=[], val=[], test=[])


def test_too_many_bad_files_fail_naming_the_threshold(tmp_path):
    data = tmp_path / "shapes"
    make_folder(data, per_class=10)
    p = prepare(tmp_path, check=False, **folder_params(data, **{"data.max_rejected_fraction": "0.05"}))
    assert p.returncode == 1
    assert "3 of 33 images" in p.stderr and "data.max_rejected_fraction 0.05" in p.stderr
    assert "empty.png" in p.stderr


def test_empty_class_folder_and_single_class_fail_naming_them(tmp_path):
    data = tmp_path / "shapes"
    make_folder(data, per_class=10, bad=False)
    (data / "hexagon").mkdir()
    (data / "hexagon/.DS_Store").write_text("x")
    p = prepare(tmp_path, check=False, **folder_params(data))
    assert p.returncode == 1 and "hexagon: class folder has no images" in p.stderr
    shutil.rmtree(data / "hexagon")
    for c in ("square", "triangle"):
        shutil.rmtree(data / c)
    p = prepare(tmp_path, check=False, **folder_params(data))
    assert p.returncode == 1 and "only one class folder ('circle')" in p.stderr


def test_offline_torchvision_source_says_which_files_to_put_where(tmp_path):
    closed = "http://127.0.0.1:9"  # nothing listens there: the download fails at once
    p = prepare(tmp_path, check=False, env_extra={"http_proxy": closed, "https_proxy": closed},
                **{"data.source": "cifar10", "data.root": str(tmp_path / "raw")})
    assert p.returncode == 1
    assert "Offline?" in p.stderr and "cifar-10-python.tar.gz" in p.stderr
    assert str(tmp_path / "raw") in p.stderr
    assert len(p.stderr.splitlines()) == 1, p.stderr  # torchvision's message spans lines
    (tmp_path / "raw").mkdir(exist_ok=True)
    (tmp_path / "raw/cifar-10-python.tar.gz").write_bytes(b"a partial download")
    p = prepare(tmp_path, check=False, env_extra={"http_proxy": closed, "https_proxy": closed},
                **{"data.source": "cifar10", "data.root": str(tmp_path / "raw")})
    assert p.returncode == 1 and len(p.stderr.splitlines()) == 1, p.stderr
    assert "cifar-10-python.tar.gz: found, but its md5 is" in p.stderr


def _idx(path, array: np.ndarray) -> None:
    """The IDX format MNIST ships in (uint8 data), uncompressed as torchvision keeps it."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim)
    header += b"".join(struct.pack(">I", d) for d in array.shape)
    path.write_bytes(header + array.tobytes())


def test_mnist_files_put_in_place_by_hand_are_used(tmp_path):
    raw = tmp_path / "raw/MNIST/raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 100), ("t10k", 30)):
        _idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        _idx(raw / f"{prefix}-labels-idx1-ubyte", np.arange(n, dtype=np.uint8) % 10)
    prepare(tmp_path, **{"data.source": "mnist", "data.root": str(tmp_path / "raw"),
                         "data.image_size": "28"})
    meta = json.loads((tmp_path / "data/prepared/meta.json").read_text())
    assert meta["sizes"] == {"train": 90, "val": 10, "test": 30}  # MNIST's own test split kept
    assert meta["classes"][0].startswith("0")


def _gzipped_fashion(raw, n_train=200, n_test=20) -> None:
    """Fashion-MNIST's four files, small, gzipped again as a distribution does: torchvision's
    MD5s of its own .gz files do not match them."""
    import gzip

    raw.mkdir(parents=True)
    rng = np.random.default_rng(1)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        for kind, array in (("images-idx3", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)),
                            ("labels-idx1", np.arange(n, dtype=np.uint8) % 10)):
            _idx(raw / f"{prefix}-{kind}-ubyte", array)
            path = raw / f"{prefix}-{kind}-ubyte"
            (raw / f"{path.name}.gz").write_bytes(gzip.compress(path.read_bytes(), mtime=0))
            path.unlink()


CLOSED = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}


def test_a_distributions_gzipped_files_are_read_in_place_and_a_bad_one_named(tmp_path, monkeypatch):
    """Issue 57: Debian's Fashion-MNIST .gz files (compressed again) failed torchvision's MD5,
    and the error, five lines of download attempts, never said a file was found."""
    from stages.config import DataConfig
    from stages.lib.images import DataError
    from stages.sources import SOURCES

    for k, v in CLOSED.items():
        monkeypatch.setenv(k, v)
    raw = tmp_path / "fashion/FashionMNIST/raw"
    _gzipped_fashion(raw)
    before = sorted(p.name for p in raw.iterdir())
    cfg = DataConfig(source="fashion_mnist", root=str(tmp_path / "fashion"), image_size=28)
    loaded = SOURCES["fashion_mnist"](cfg, 0, tmp_path / "scratch")
    assert {k: len(v.y) for k, v in loaded.splits.items()} == {"train": 180, "val": 20, "test": 20}
    assert loaded.classes[9] == "Ankle boot"
    assert sorted(p.name for p in raw.iterdir()) == before  # nothing written in data.root
    bad = raw / "t10k-images-idx3-ubyte.gz"
    bad.write_bytes(bad.read_bytes()[:-40])
    with pytest.raises(DataError) as err:
        SOURCES["fashion_mnist"](cfg, 0, tmp_path / "scratch")
    assert str(bad) in str(err.value) and "found" in str(err.value) and "\n" not in str(err.value)


DEBIAN = Path("/usr/share/datasets/fashion-mnist")


@pytest.mark.skipif(not DEBIAN.is_dir(), reason="Debian's dataset-fashion-mnist not installed")
def test_debians_fashion_mnist_files_are_read_as_they_ship(tmp_path):
    from stages.sources import load_torchvision

    raw = tmp_path / "fashion/FashionMNIST/raw"
    raw.mkdir(parents=True)
    for f in DEBIAN.glob("*.gz"):
        (raw / f.name).symlink_to(f)
    parts, classes = load_torchvision("fashion_mnist", tmp_path / "fashion")
    assert {k: v.x.shape for k, v in parts.items()} == {"train": (60000, 1, 28, 28),
                                                         "test": (10000, 1, 28, 28)}
    assert len(classes) == 10 and parts["test"].y.bincount().tolist() == [1000] * 10


def test_a_torchvision_root_shared_with_other_data_is_refused_naming_it(tmp_path):
    """prepare depends on all of data.root: a dataset beside MNIST's files would rerun it."""
    from stages.lib.images import DataError
    from stages.sources import load_torchvision

    raw = tmp_path / "raw"
    (raw / "MNIST/raw").mkdir(parents=True)
    (raw / "shapes").mkdir()
    (raw / ".gitignore").write_text("/shapes\n")  # hidden files are not data
    with pytest.raises(DataError, match="holds shapes beside mnist's files.*"
                       "-S data.root=data/raw/mnist"):
        load_torchvision("mnist", raw)


def test_prepare_says_when_it_resizes_from_what_to_what_and_the_key_that_keeps_the_size(tmp_path):
    """Issue 57: 28x28 images shrank to the default 16x16 silently."""
    from stages.config import DataConfig
    from stages.sources import resize_line

    p = prepare(tmp_path / "digits", **{"data.channels": "auto"})
    assert "prepare: resizing 8x8 -> 16x16 (data.image_size; -S data.image_size=8 keeps the " \
        "native size)" in p.stdout.splitlines()
    assert "data.channels: auto -> 1: the source's own" in p.stdout  # issue 57, annoying 5
    data = tmp_path / "shapes"
    make_folder(data, per_class=10, bad=False)  # 32x32 colour images, 21 in train
    p = prepare(tmp_path, **folder_params(data, **{"data.channels": "auto"}))
    assert "prepare: resizing 32x32 -> 24x24" in p.stdout
    assert "data.channels: auto -> 3: some of 21 images sampled hold colour" in p.stdout
    assert json.loads((tmp_path / "data/prepared/meta.json").read_text())["channels"] == 3
    assert resize_line(DataConfig(image_size=32), {(32, 32): 9}) is None
    assert resize_line(DataConfig(image_size=32), {(720, 477): 5, (32, 32): 1}) == (
        "prepare: resizing 2 sizes (the most common 720x477, 5 of 6 sampled) -> 32x32 by "
        "data.resize: squash (data.image_size)")


def test_auto_channels_follow_the_folder_and_warnings_fire_only_out_of_distribution(tmp_path):
    """Issue 57: the recipe's data.channels=3 made a grayscale folder's model warn on each of
    its own test images, and a colour photo given to it got no warning."""
    import random

    from stages.inference import unlike_training
    from stages.lib.images import Files, has_colour
    from stages.sources import sample_folder

    rng = random.Random(0)
    grey, colour = tmp_path / "grey.png", tmp_path / "colour.jpg"
    draw("circle", rng).convert("L").convert("RGB").save(grey)  # stored as RGB, no colour
    draw("circle", rng).save(colour, quality=90)
    assert not has_colour(grey) and has_colour(colour)
    assert sample_folder(Files.of([str(grey)] * 3, 0)) == ({(32, 32): 3}, False)
    assert sample_folder(Files.of([str(grey), str(colour)], 0))[1]
    spec = {"mean": [0.0], "std": [1.0]}
    x = np.zeros((1, 8, 8), np.float32)  # the training mean: no brightness warning
    assert unlike_training(np.zeros((1, 8, 8), np.uint8), x, spec, colour=False) is None
    assert "in color and the model takes grayscale" in unlike_training(
        np.zeros((1, 8, 8), np.uint8), x, spec, colour=True)


def test_an_oversized_image_file_is_rejected_and_listed(tmp_path):
    from stages.lib.images import MAX_IMAGE_BYTES
    from tests.support.image_files import make_folder

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
