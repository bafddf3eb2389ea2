"""Prepared splits as shards (`data.format: shards`), for image folders whose decoded splits would
not fit in memory. Each split is a folder of tar files in WebDataset's layout (`<key>.<ext>` the
image file, `<key>.cls` its label: WebDataset, DALI and `tar` read them), about SHARD_BYTES each,
and index.npy: where each sample's bytes are. Images are kept encoded, downsized only past
`data.store_size`, so train decodes and augments them at that resolution (a random-resized crop,
in DataLoader workers), while val, test, evaluate and predict decode them with
`stages.lib.images.decode_image`, as prepare decodes a folder into tensors.

Read through the index, not WebDataset's or LitData's streaming readers: those deal shards out to
the workers, so the order of samples changes with the number of workers (docs/data.md). Here a
sample is one `pread`, and the order is the tensors path's, a function of (seed, epoch) alone.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from stages.lib.images import DataError, check_size, decode_pixels, fit, open_image, parallel_map

SHARD_BYTES = 128 * 2**20
INDEX = np.dtype([("shard", "<u4"), ("offset", "<u8"), ("size", "<u4"), ("label", "<i8")])
# Formats kept byte for byte (when within store_size); others (BMP, TIFF) are stored as PNG.
KEPT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}
# The random-resized crop's area and aspect ranges: torchvision's ImageNet ratio, a larger
# minimum area than its 0.08 (small images, few classes).
CROP_SCALE, CROP_RATIO = (0.35, 1.0), (3 / 4, 4 / 3)


def shard_name(i: int) -> str:
    return f"shard-{i:06d}.tar"


@dataclass
class Stored:
    data: bytes  # what the shard holds: the file as it was, or downsized and encoded again
    ext: str
    sha256: str  # of the file as read: identical files in two splits are leakage
    sums: np.ndarray  # (2, C): sum and sum of squares of its pixels at image_size, in [0, 1]


def store_one(args: tuple[str, int, int, str, int]) -> Stored | str:
    """One image file as a shard stores it, or the reason it is rejected."""
    path, channels, image_size, resize, store_size = args
    try:
        check_size(path)
        data = Path(path).read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        img = decode_pixels(data, channels)  # a file that does not decode is rejected now
        with open_image(data) as opened:
            kept = KEPT.get(opened.format or "")
        if kept is None or max(img.size) > store_size:
            img.thumbnail((store_size, store_size), Image.Resampling.BICUBIC)
            out = io.BytesIO()
            kept = "jpg" if kept == "jpg" else "png"
            img.save(out, "JPEG" if kept == "jpg" else "PNG", quality=95)
            data = out.getvalue()
            img = decode_pixels(data, channels)  # as val will read it: JPEG is lossy
        x = fit(img, image_size, resize).astype(np.float64) / 255
        return Stored(data, kept, digest, np.stack([x.sum((1, 2)), np.square(x).sum((1, 2))]))
    except (DataError, OSError) as e:
        return str(e)


class ShardWriter:
    """Tar files of SHARD_BYTES in `folder`, each written under a temporary name and renamed
    when whole; members with fixed owners and times, so the same samples give the same bytes."""

    def __init__(self, folder: Path):
        self.folder, self.count, self.tar, self.tmp = folder, 0, None, None

    def add(self, key: str, ext: str, data: bytes, label: int) -> tuple[int, int]:
        """Writes one sample; returns (shard, offset of its image bytes)."""
        if self.tar is None or self.tar.offset >= SHARD_BYTES:
            self.close()
            self.tmp = self.folder / f".{shard_name(self.count)}.tmp"
            self.tar = tarfile.open(self.tmp, "w", format=tarfile.USTAR_FORMAT)
        offset = self._member(f"{key}.{ext}", data)
        self._member(f"{key}.cls", str(label).encode())
        return self.count, offset

    def _member(self, name: str, data: bytes) -> int:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), 0, 0o644
        start = self.tar.offset
        self.tar.addfile(info, io.BytesIO(data))
        return start + tarfile.BLOCKSIZE  # a USTAR header of a short name is one block

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()
            os.replace(self.tmp, self.folder / shard_name(self.count))
            self.count, self.tar = self.count + 1, None


@dataclass
class WrittenSplit:
    index: np.ndarray
    rejected: list[tuple[str, str]]
    accepted: list[tuple[str, str]]  # (path, sha256)
    sums: np.ndarray  # (2, C) over the split


def write_split(folder: Path, items: list[tuple[Path, int]], channels: int, image_size: int,
                resize: str, store_size: int, workers: int) -> WrittenSplit:
    """A split's images into shards in `folder`, in the order of `items`."""
    from tqdm import tqdm

    folder.mkdir(parents=True, exist_ok=True)
    jobs = [(str(p), channels, image_size, resize, store_size) for p, _ in items]
    writer, rows = ShardWriter(folder), []
    rejected, accepted, sums = [], [], np.zeros((2, channels))
    for (path, label), got in tqdm(zip(items, parallel_map(store_one, jobs, workers), strict=True),
                                   total=len(items), desc=f"shard {folder.name}", mininterval=2,
                                   disable=len(items) < 1000):
        if isinstance(got, str):
            rejected.append((str(path), got))
            continue
        shard, offset = writer.add(f"{len(rows):09d}", got.ext, got.data, label)
        rows.append((shard, offset, len(got.data), label))
        accepted.append((str(path), got.sha256))
        sums += got.sums
    writer.close()
    index = np.array(rows, dtype=INDEX)
    tmp = folder / ".index.tmp.npy"
    np.save(tmp, index)
    os.replace(tmp, folder / "index.npy")
    return WrittenSplit(index, rejected, accepted, sums)


def digest(folders: Iterable[Path]) -> str:
    """SHA-256 over the shards and indexes, in order: meta.json's data hash."""
    h = hashlib.sha256()
    for folder in folders:
        for path in sorted(folder.glob("shard-*.tar")) + [folder / "index.npy"]:
            with open(path, "rb") as f:
                while chunk := f.read(2**20):
                    h.update(chunk)
    return h.hexdigest()


class ShardImages:
    """A split's images in its shards, indexed as its uint8 (N, C, H, W) tensor would be: x[i],
    x[a:b] and x[indices] decode those samples (decode_image, at image_size). Memory holds the
    index alone; a sample is one pread of its bytes."""

    dtype = torch.uint8

    def __init__(self, folder: Path, channels: int, size: int, resize: str):
        path = folder / "index.npy"
        try:
            self.index = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: unreadable ({e}); restore data/prepared with `dvc checkout "
                            "data/prepared` or rebuild it with `dvc repro -f prepare`") from None
        if self.index.dtype != INDEX:
            raise DataError(f"{path}: not a shard index of this version; rebuild it with "
                            "`dvc repro -f prepare`")
        self.folder, self.channels, self.size, self.resize = folder, channels, size, resize
        self.shape = (len(self.index), channels, size, size)
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.index)

    def numel(self) -> int:
        return int(np.prod(self.shape))

    def element_size(self) -> int:
        return 1

    def labels(self) -> Tensor:
        return torch.from_numpy(self.index["label"].astype(np.int64))

    def __getstate__(self) -> dict:  # a DataLoader worker opens its own files
        return {**self.__dict__, "_fds": {}}

    def raw(self, i: int) -> bytes:
        """Sample i's image bytes; a short read names the shard and sample."""
        if self._pid != os.getpid():  # forked: the parent's offsets are shared, pread has none
            self._fds, self._pid = {}, os.getpid()
        shard, offset, size, _ = self.index[i].tolist()
        path = self.folder / shard_name(shard)
        try:
            if shard not in self._fds:
                self._fds[shard] = os.open(path, os.O_RDONLY)
                # Samples are read in a random order: no read-ahead past each one.
                os.posix_fadvise(self._fds[shard], 0, 0, os.POSIX_FADV_RANDOM)
            data = os.pread(self._fds[shard], size, offset)
        except OSError as e:
            raise DataError(f"{path}: sample {i} unreadable ({e.strerror}); restore it with "
                            "`dvc checkout data/prepared` or `dvc repro -f prepare`") from None
        if len(data) != size:
            raise DataError(f"{path}: truncated: sample {i} ends past its end; restore it with "
                            "`dvc checkout data/prepared` or `dvc repro -f prepare`")
        return data

    def pixels(self, i: int) -> Image.Image:
        data = self.raw(i)
        try:
            return decode_pixels(data, self.channels)
        except DataError as e:
            raise DataError(f"{self.folder / shard_name(int(self.index[i]['shard']))}: sample {i} "
                            f"does not decode ({e}); rebuild it with `dvc repro -f prepare`") from None

    def decoded(self, i: int) -> Tensor:
        return torch.from_numpy(np.array(fit(self.pixels(i), self.size, self.resize)))

    def __getitem__(self, key: int | slice | Tensor | list) -> Tensor:
        if isinstance(key, (int, np.integer)):
            return self.decoded(int(key))
        picked = range(len(self))[key] if isinstance(key, slice) else \
            (key.tolist() if isinstance(key, Tensor) else list(key))
        if not picked:
            return torch.empty((0, *self.shape[1:]), dtype=torch.uint8)
        return torch.stack([self.decoded(i) for i in picked])

    def cropped(self, i: int, seed: int) -> Tensor:
        """Sample i at image_size through a random-resized crop of its stored resolution, the
        crop drawn from `seed` alone (the loader keys it by seed, epoch and index)."""
        img = self.pixels(i)
        top, left, h, w = crop_box(img.width, img.height, torch.Generator().manual_seed(seed))
        # What torchvision's resized_crop does to a PIL image, and val's resize (fit) too.
        img = img.resize((self.size, self.size), Image.Resampling.BICUBIC,
                         box=(left, top, left + w, top + h))
        return torch.from_numpy(np.asarray(img, dtype=np.uint8).reshape(
            self.size, self.size, self.channels).transpose(2, 0, 1).copy())


def crop_box(width: int, height: int, g: torch.Generator) -> tuple[int, int, int, int]:
    """(top, left, height, width) of a random-resized crop: torchvision's RandomResizedCrop
    draw, from a generator of its own (torchvision's draws from the global RNG, and seeding that
    per sample costs 1 ms under torch.compile's wrapper)."""
    area = width * height
    log_ratio = torch.log(torch.tensor(CROP_RATIO))
    for _ in range(10):
        target = area * torch.empty(1).uniform_(*CROP_SCALE, generator=g).item()
        ratio = torch.exp(torch.empty(1).uniform_(*log_ratio.tolist(), generator=g)).item()
        w, h = round((target * ratio) ** 0.5), round((target / ratio) ** 0.5)
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (1,), generator=g))
            left = int(torch.randint(0, width - w + 1, (1,), generator=g))
            return top, left, h, w
    ratio = width / height  # as torchvision: the whole image, cut to the nearest ratio allowed
    if ratio < CROP_RATIO[0]:
        w, h = width, round(width / CROP_RATIO[0])
    elif ratio > CROP_RATIO[1]:
        w, h = round(height * CROP_RATIO[1]), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def is_sharded(prepared: Path, name: str) -> bool:
    return (prepared / name / "index.npy").exists()


def remove(folder: Path) -> None:
    """A split's shards and index, what write_split writes (and its temporary files), then the
    folder if that left it empty; anything else in it is kept."""
    for pattern in ("shard-*.tar", ".shard-*.tar.tmp", "index.npy", ".index.tmp.npy"):
        for path in folder.glob(pattern):
            path.unlink()
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
