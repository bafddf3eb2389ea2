"""Prepared splits as shards (`data.format: shards`), for image folders whose decoded splits would
not fit in memory. Each split is a folder of tar files in WebDataset's layout (`<key>.<ext>` the
image file, `<key>.cls` its label: WebDataset, DALI and `tar` read them), about `data.shard_mb` each,
and index.npy: where each sample's bytes are. Images are kept encoded, downsized only past
`data.store_size`, so train can cut a crop at that resolution (`cropped`: the box is the
experiment's, stages/batches.py), while val, test, evaluate and predict decode them with
`stages.lib.images.decode_image`, as prepare decodes a folder into tensors.

Read through the index, not WebDataset's or LitData's streaming readers: those deal shards out to
the workers, so the order of samples changes with the number of workers (docs/data.md). Here a
sample is one `pread`, and the order is the tensors path's, a function of (seed, epoch) alone.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import math
import os
import resource
import tarfile
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from stages.lib.files import atomic_write, write_error, write_text
from stages.lib.images import (
    DIGEST,
    DataError,
    Files,
    check_size,
    decode_pixels,
    fit,
    open_image,
    parallel_map,
)

INDEX = np.dtype([("shard", "<u4"), ("offset", "<u8"), ("size", "<u4"), ("label", "<i8")])
# Formats kept byte for byte (when within store_size); others (BMP, TIFF) are stored as PNG.
KEPT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}
ORIENTATION = 0x0112  # the EXIF tag decode_pixels turns an image by


def shard_name(i: int) -> str:
    return f"shard-{i:06d}.tar"


@dataclass
class Stored:
    data: bytes  # what the shard holds: the file as it was, or downsized and encoded again
    ext: str
    sha256: bytes  # of the file as read: identical files in two splits are leakage
    sums: np.ndarray  # (2, C): sum and sum of squares of its pixels at image_size, in [0, 1]


def store_one(args: tuple[str, int, int, str, int]) -> Stored | str:
    """One image file as a shard stores it, or the reason it is rejected."""
    path, channels, image_size, resize, store_size = args
    try:
        check_size(path)
        data = Path(path).read_bytes()
        digest = hashlib.sha256(data).digest()
        img, _ = decode_pixels(data, channels)  # a file that does not decode is rejected now
        with open_image(data) as opened:
            kept = KEPT.get(opened.format or "")
        if kept is None or max(img.size) > store_size:
            img.thumbnail((store_size, store_size), Image.Resampling.BICUBIC)
            out = io.BytesIO()
            kept = "jpg" if kept == "jpg" else "png"
            img.save(out, "JPEG" if kept == "jpg" else "PNG", quality=95)
            data = out.getvalue()
            img, _ = decode_pixels(data, channels)  # as val will read it: JPEG is lossy
        x = fit(img, image_size, resize).astype(np.float64) / 255
        return Stored(data, kept, digest, np.stack([x.sum((1, 2)), np.square(x).sum((1, 2))]))
    except (DataError, OSError) as e:
        return str(e)


class ShardWriter:
    """Tar files of about `shard_bytes` in `folder`, numbered from `first`, each written under a
    temporary name and renamed when whole; members with fixed owners and times, so the same
    samples give the same bytes. Written member by member with tarfile's own headers
    (TarInfo.tobuf) rather than a TarFile, which holds every member's TarInfo until it closes:
    100 MB for a shard of small images."""

    def __init__(self, folder: Path, shard_bytes: int, first: int = 0):
        self.folder, self.shard_bytes, self.count = folder, shard_bytes, first
        self.file, self.tmp = None, None

    def full(self) -> bool:
        return self.file is not None and self.file.tell() >= self.shard_bytes

    def add(self, key: str, ext: str, data: bytes, label: int) -> tuple[int, int]:
        """Writes one sample; returns (shard, offset of its image bytes)."""
        if self.file is None:
            self.tmp = self.folder / f".{shard_name(self.count)}.tmp"
            self.file = open(self.tmp, "wb")  # noqa: SIM115 (closed in close)
        try:
            offset = self._member(f"{key}.{ext}", data)
            self._member(f"{key}.cls", str(label).encode())
        except OSError as e:
            raise self._failed(e) from e
        return self.count, offset

    def _failed(self, e: OSError) -> OSError:
        """A failed write's one line, which names the shard (a full disk: the images as stored
        can take more than their files, when re-encoded); the half-written shard removed."""
        with suppress(OSError):  # its buffer's flush fails again
            self.file.close()
        self.tmp.unlink()
        self.file = None
        return write_error(e, self.tmp, scratch=True) or e

    def _member(self, name: str, data: bytes) -> int:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), 0, 0o644
        self.file.write(info.tobuf(tarfile.USTAR_FORMAT))
        offset = self.file.tell()
        self.file.write(data + b"\0" * (-len(data) % tarfile.BLOCKSIZE))
        return offset

    def close(self) -> Path:
        """The open shard, ended as TarFile ends one (two zero blocks, then zeros to a whole
        record), under its name."""
        end = self.file.tell() + 2 * tarfile.BLOCKSIZE
        try:
            self.file.write(b"\0" * (2 * tarfile.BLOCKSIZE + -end % tarfile.RECORDSIZE))
            self.file.close()
        except OSError as e:
            raise self._failed(e) from e
        path = self.folder / shard_name(self.count)
        os.replace(self.tmp, path)
        self.count, self.file = self.count + 1, None
        return path


@dataclass
class Piece:
    """What one shard holds, written beside it (`shard-N.tar.json`) once it is whole: a killed
    prepare resumes after the last whole shard, and a resumed split adds up as an uninterrupted
    one does, piece by piece."""
    end: int  # items[:end] are done: in this shard or an earlier one, or rejected
    bytes: int  # the shard's size
    rows: list[tuple[int, int, int, int]] = field(default_factory=list)  # INDEX rows
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    accepted: list[tuple[int, str]] = field(default_factory=list)  # (item, sha256 in hex)
    sums: list[list[float]] = field(default_factory=list)  # (2, C)


@dataclass
class WrittenSplit:
    """A split's shards as arrays, a few bytes a sample: a list of tuples per sample would be
    memory that grows with the dataset."""
    index: np.ndarray  # INDEX
    rejected: list[tuple[str, str]]  # (path, reason)
    accepted: np.ndarray  # the items stored, by their position in the split's items
    digests: np.ndarray  # their files' SHA-256 (DIGEST)
    sums: np.ndarray  # (2, C) over the split
    resumed: int  # shards an earlier, killed run had written whole


def written_pieces(folder: Path) -> list[Piece]:
    """The whole shards an earlier run left in `folder`, in order, up to the first one missing
    or of another size; the rest (and any half-written shard) is deleted."""
    pieces: list[Piece] = []
    while True:
        shard, record = folder / shard_name(len(pieces)), folder / f"{shard_name(len(pieces))}.json"
        try:
            piece = Piece(**json.loads(record.read_text()))
            if shard.stat().st_size == piece.bytes:
                pieces.append(piece)
                continue
        except (OSError, ValueError, TypeError):
            pass
        break
    for path in folder.glob("*shard-*"):
        if int(path.name.lstrip(".").split("-")[1][:6]) >= len(pieces):
            path.unlink()
    return pieces


def write_split(folder: Path, items: Files, channels: int, image_size: int,
                resize: str, store_size: int, shard_bytes: int, workers: int) -> WrittenSplit:
    """A split's images into shards in `folder`, in the order of `items`, after the shards a
    killed run had written whole there."""
    from tqdm import tqdm

    folder.mkdir(parents=True, exist_ok=True)
    done = written_pieces(folder)
    resumed, start = len(done), done[-1].end if done else 0
    index, accepted, digests, rejected = [], [], [], []
    sums = np.zeros((2, channels))

    def keep(piece: Piece) -> None:  # a whole shard's record, kept as arrays
        nonlocal sums
        index.append(np.array([tuple(r) for r in piece.rows], dtype=INDEX))
        accepted.append(np.array([i for i, _ in piece.accepted], dtype=np.int64))
        digests.append(np.array([bytes.fromhex(d) for _, d in piece.accepted], dtype=DIGEST))
        rejected.extend(map(tuple, piece.rejected))
        sums = sums + np.array(piece.sums)

    for piece in done:
        keep(piece)
    writer = ShardWriter(folder, shard_bytes, resumed)
    piece, piece_sums, rows = Piece(start, 0), np.zeros((2, channels)), sum(map(len, index))

    def finish(end: int) -> None:  # the open shard is whole: rename it, record its piece
        nonlocal piece, piece_sums
        path = writer.close()
        piece.end, piece.bytes, piece.sums = end, path.stat().st_size, piece_sums.tolist()
        write_text(path.with_name(path.name + ".json"), json.dumps(asdict(piece)))
        keep(piece)
        piece, piece_sums = Piece(end, 0), np.zeros((2, channels))

    rest = items[start:]
    jobs = ((path, channels, image_size, resize, store_size) for path, _ in rest)
    work = zip(rest, parallel_map(store_one, jobs, workers), strict=True)
    for pos, ((path, label), got) in enumerate(tqdm(work, total=len(rest), desc=f"shard {folder.name}",
                                                    mininterval=2, disable=len(rest) < 1000), start):
        if isinstance(got, str):
            piece.rejected.append((path, got))
            continue
        if writer.full():
            finish(pos)
        shard, offset = writer.add(f"{rows:09d}", got.ext, got.data, label)
        piece.rows.append((shard, offset, len(got.data), label))
        piece.accepted.append((pos, got.sha256.hex()))
        piece_sums += got.sums
        rows += 1
    if writer.file is not None:
        finish(len(items))
    else:  # files rejected after the last shard: in no record, redone after a kill
        rejected += piece.rejected
    index_all = np.concatenate(index) if index else np.empty(0, INDEX)
    atomic_write(folder / "index.npy", lambda p: np.save(p, index_all))
    return WrittenSplit(index_all, rejected,
                        np.concatenate(accepted) if accepted else np.empty(0, np.int64),
                        np.concatenate(digests) if digests else np.empty(0, DIGEST), sums, resumed)


def digest(folders: Iterable[Path]) -> str:
    """SHA-256 over the shards and indexes, in order: meta.json's data hash."""
    h = hashlib.sha256()
    for folder in folders:
        for path in sorted(folder.glob("shard-*.tar")) + [folder / "index.npy"]:
            with open(path, "rb") as f:
                while chunk := f.read(2**20):
                    h.update(chunk)
    return h.hexdigest()


# The shards this process holds open, least recently read first, keyed by (reader, shard): every
# split of the process shares one bound. A forked DataLoader worker inherits them (pread has no
# file offset to share) and then opens and closes its own. Read from one thread per process.
OPEN: OrderedDict[tuple[int, int], int] = OrderedDict()
READERS = itertools.count()


def open_shards_cap() -> int:
    """How many shards a process keeps open: an eighth of its open-files limit (`ulimit -n`), at
    most 64. Every shard of a split open in each of the training process and its workers would
    exhaust a limit of 1024 at about 1,000 shards. The other seven eighths are what torch needs:
    it passes each batch from a worker as descriptors (its file_descriptor sharing), and a
    worker with none left cannot accept the fetch, which then waits for ever. A shard opened
    again costs microseconds, a sample's decode far more."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 64 if soft == resource.RLIM_INFINITY else max(1, min(64, soft // 8))


def shard_fd(key: tuple[int, int], path: Path) -> int:
    """A descriptor of the shard at `path`, opened if it is not among OPEN; the least recently
    read one is closed past open_shards_cap()."""
    if key in OPEN:
        OPEN.move_to_end(key)
        return OPEN[key]
    while OPEN and len(OPEN) >= open_shards_cap():
        os.close(OPEN.popitem(last=False)[1])
    fd = os.open(path, os.O_RDONLY)
    # Samples are read in a random order: no read-ahead past each one.
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    OPEN[key] = fd
    return fd


class ShardImages:
    """A split's images in its shards (stages.data.Images), decoded as indexed (decode_image, at
    image_size). Memory holds the index alone; a sample is one pread of its bytes."""

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
        self.reader = next(READERS)  # its shards' keys in OPEN: a split loaded again opens them anew

    def __len__(self) -> int:
        return len(self.index)

    def labels(self) -> Tensor:
        return torch.from_numpy(self.index["label"].astype(np.int64))

    def raw(self, i: int) -> bytes:
        """Sample i's image bytes; a short read names the shard and sample."""
        shard, offset, size, _ = self.index[i].tolist()
        path = self.folder / shard_name(shard)
        try:
            data = os.pread(shard_fd((self.reader, shard), path), size, offset)
        except OSError as e:
            raise DataError(f"{path}: sample {i} unreadable ({e.strerror}); restore it with "
                            "`dvc checkout data/prepared` or `dvc repro -f prepare`") from None
        if len(data) != size:
            raise DataError(f"{path}: truncated: sample {i} ends past its end; restore it with "
                            "`dvc checkout data/prepared` or `dvc repro -f prepare`")
        return data

    def pixels(self, i: int, draft: int = 0) -> tuple[Image.Image, tuple[int, int]]:
        """Sample i as decode_pixels gives it: the image, and its size undrafted."""
        data = self.raw(i)
        if frame_marker(data) in LOSSLESS_FRAMES:
            draft = 0  # libjpeg scales a DCT's output; a lossless JPEG fails to decode drafted
        try:
            return decode_pixels(data, self.channels, draft)
        except DataError as e:
            raise DataError(f"{self.folder / shard_name(int(self.index[i]['shard']))}: sample {i} "
                            f"does not decode ({e}); rebuild it with `dvc repro -f prepare`") from None

    def decoded(self, i: int) -> Tensor:
        return torch.from_numpy(np.array(fit(self.pixels(i)[0], self.size, self.resize)))

    def __getitem__(self, key: int | slice | Tensor | list) -> Tensor:
        if isinstance(key, (int, np.integer)):
            return self.decoded(int(key))
        picked = range(len(self))[key] if isinstance(key, slice) else \
            (key.tolist() if isinstance(key, Tensor) else list(key))
        if not picked:
            return torch.empty((0, *self.shape[1:]), dtype=torch.uint8)
        return torch.stack([self.decoded(i) for i in picked])

    def frame(self, width: int, height: int) -> tuple[float, float, float, float]:
        """(top, left, height, width) in an image of that size of what `fit` keeps of it
        (data.resize): the whole image, or its centred square."""
        if self.resize == "squash":
            return 0.0, 0.0, float(height), float(width)
        side = min(width, height)
        return (height - side) / 2, (width - side) / 2, float(side), float(side)

    def box(self, crop: Tensor, width: int, height: int) -> Tensor:
        """`crop` (top, left, height, width as fractions of the image as `fit` frames it) in
        the pixels of an image of that size."""
        top, left, h, w = self.frame(width, height)
        return torch.tensor([top, left, 0.0, 0.0], dtype=torch.float64) + \
            crop.double() * torch.tensor([h, w, h, w], dtype=torch.float64)

    def cropped(self, i: int, crop: Tensor) -> Tensor:
        """Sample i's box `crop` (see `box`), cut from its stored resolution and resized to
        image_size by Pillow's bicubic filter (`resized_crops` on a tensor, within a level)."""
        # Pillow's draft decodes a JPEG at 1/2, 1/4 or 1/8 while the box keeps image_size pixels
        # or more a side (libjpeg scales its inverse DCT: a fraction of the work).
        img, (width, height) = self.pixels(i, math.ceil(self.size / float(crop[2:].min())))
        # The box is drawn at the full size, cut from the image as decoded.
        top, left, h, w = (self.box(crop, width, height) * torch.tensor(
            [img.height / height, img.width / width] * 2, dtype=torch.float64)).tolist()
        img = img.resize((self.size, self.size), Image.Resampling.BICUBIC,
                         box=(left, top, left + w, top + h))
        return torch.from_numpy(np.asarray(img, dtype=np.uint8).reshape(
            self.size, self.size, self.channels).transpose(2, 0, 1).copy())

    def jpeg_crop(self, i: int, crop: Tensor) -> tuple[Tensor, Tensor] | None:
        """Sample i's JPEG bytes and the box of `cropped` in its pixels, for the GPU's JPEG
        decoder; None where that decoder would not give decode_pixels' image (not a plain RGB or
        grey JPEG, or turned by its EXIF orientation) or would decode it on the host (not
        GPU_FRAMES), which `cropped` then decodes here."""
        data = self.raw(i)
        if frame_marker(data) not in GPU_FRAMES:
            return None
        with open_image(data) as img:
            if img.format != "JPEG" or img.mode not in ("RGB", "L") or \
                    img.getexif().get(ORIENTATION, 1) != 1:
                return None
            width, height = img.size
        return torch.frombuffer(bytearray(data), dtype=torch.uint8), self.box(crop, width, height)


# Baseline and extended Huffman JPEGs: what nvJPEG decodes on the GPU. It decodes progressive ones
# (SOF2) on the host, one image at a time on the training thread with a sync after each, and
# refuses lossless and arithmetic ones: the workers decode those, as on the CPU path.
GPU_FRAMES = (0xC0, 0xC1)
LOSSLESS_FRAMES = (0xC3, 0xC7, 0xCB, 0xCF)


def frame_marker(data: bytes) -> int | None:
    """A JPEG's start-of-frame marker (0xC0 baseline, 0xC2 progressive, ...), read from the
    segments before it; None if there is none."""
    pos = 2
    while pos + 4 <= len(data) and data[pos] == 0xFF:
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
        elif 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # not DHT, JPG, DAC
            return marker
        else:
            pos += 2 + int.from_bytes(data[pos + 2:pos + 4], "big")
    return None


@dataclass
class DecodeCounts:
    """Where the training process's streamed samples were decoded: by `decode` (nvJPEG on CUDA),
    by Pillow after `decode` refused them, or in the workers. A silent fall back shows here."""
    device: int = 0
    refused: int = 0
    workers: int = 0


COUNTS = DecodeCounts()
Decode = Callable[[list[Tensor]], list[Tensor]]


def nvjpeg(device: torch.device, channels: int) -> Decode:
    """torchvision's decode_jpeg on `device`, ordered against the caller's stream."""
    from torchvision.io import ImageReadMode, decode_jpeg

    mode = ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB
    side = torch.cuda.Stream(device)

    def decode(payloads: list[Tensor]) -> list[Tensor]:
        # torchvision 0.29 allocates the outputs on the current stream, then decodes on a private
        # stream that never waits for it: the caching allocator can hand it blocks that kernels
        # queued on the caller's stream (the last step's backward) still read, and nvJPEG
        # overwrites them (pytorch/vision#9606). Under a stream of our own, after the caller's
        # work, it only gets blocks no queued kernel reads; the caller takes the outputs back.
        caller = torch.cuda.current_stream(device)
        side.wait_stream(caller)
        with torch.cuda.stream(side), warnings.catch_warnings():
            # Deprecated for TorchCodec, which is not in requirements.lock (docs/data.md).
            warnings.filterwarnings("ignore", "The image decoding", DeprecationWarning)
            images = decode_jpeg(payloads, mode=mode, device=device)
        caller.wait_stream(side)
        for img in images:
            img.record_stream(caller)
        return images

    return decode


def decoded_or_refused(payloads: list[Tensor], decode: Decode) -> list[Tensor | None]:
    """decode(payloads), or, where it refuses the batch (torchvision fails the whole call for one
    image), each image alone: None for an image it refuses."""
    try:
        return list(decode(payloads))
    except RuntimeError:
        pass
    out: list[Tensor | None] = []
    for payload in payloads:
        try:
            out.append(decode([payload])[0])
        except RuntimeError:
            out.append(None)
    return out


def decoded_batch(pixels: Tensor, data: Tensor, lengths: Tensor, boxes: Tensor, size: int,
                  channels: int, device: torch.device, decode: Decode,
                  fallback: Callable[[int], Tensor]) -> Tensor:
    """A streamed batch (EncodedStream.collate) as uint8 (N, C, size, size) on `device`: samples
    with a box (jpeg_crop) decoded by `decode` and cut to their box there, in one batched resize;
    `fallback(k)` (Pillow's crop of the same box, or an error naming the sample) for those it
    refuses; the others came decoded (box -1), in `pixels`."""
    n = len(boxes)
    out = torch.empty(n, channels, size, size, dtype=torch.uint8, device=device)
    jpeg = boxes[:, 0] >= 0
    jpegs, decoded = jpeg.nonzero().flatten(), (~jpeg).nonzero().flatten()
    if len(decoded):
        out.index_copy_(0, decoded.to(device), pixels.to(device, non_blocking=True))
    images = decoded_or_refused(list(data.split(lengths.tolist())), decode) if len(jpegs) else []
    done = torch.tensor([img is not None for img in images], dtype=torch.bool)
    if done.any():
        out.index_copy_(0, jpegs[done].to(device), resized_crops(
            [img for img in images if img is not None], boxes[jpegs[done]], size))
    for k in jpegs[~done].tolist():
        out[k] = fallback(k).to(device)
    COUNTS.device += int(done.sum())
    COUNTS.refused += int((~done).sum())
    COUNTS.workers += len(decoded)
    return out


def resized_crops(images: list[Tensor], boxes: Tensor, size: int) -> Tensor:
    """uint8 (N, C, size, size): box k (top, left, height, width in pixels, fractions allowed) of
    uint8 (C, H, W) image k resized to size x size, on the images' device: what Pillow's bicubic
    resize with a box does (`cropped`), in float32 and batched, within a level of its fixed
    point, for the tensors' crops and the GPU's decodes."""
    n, c = len(images), images[0].shape[0]
    h, w = max(img.shape[1] for img in images), max(img.shape[2] for img in images)
    device = images[0].device
    if all(img.shape[1:] == (h, w) for img in images):
        x = torch.stack(images).float()
    else:  # zeros past each image, which no weight reads
        x = torch.zeros(n, c, h, w, device=device)
        for k, img in enumerate(images):
            x[k, :, :img.shape[1], :img.shape[2]] = img
    sides = torch.tensor([img.shape[1:] for img in images], device=device)  # (N, 2)
    boxes = boxes.to(device)
    # Across, then down, rounded to 8 bits between, as Pillow. Each pass reads rows of an
    # (N * side, the rest) view, tap by tap: every output pixel sums the same products in the
    # same order for any N or thread count.
    wide = _resample(x.permute(0, 3, 1, 2).reshape(n * w, c * h), boxes[:, 1], boxes[:, 3],
                     sides[:, 1], w, size).round_().clamp_(0, 255)  # (N * size, C * H)
    out = _resample(wide.view(n, size, c, h).permute(0, 3, 1, 2).reshape(n * h, size * c),
                    boxes[:, 0], boxes[:, 2], sides[:, 0], h, size)  # (N * size, size * C)
    return out.view(n, size, size, c).permute(0, 3, 1, 2).round_().clamp_(0, 255).to(torch.uint8)


def _resample(rows: Tensor, start: Tensor, length: Tensor, sides: Tensor, n_in: int,
              n_out: int) -> Tensor:
    """(N * n_out, F) from the (N * n_in, F) rows of N images (sides[k] of them real): [start,
    start + length) of each resampled to n_out."""
    n = len(start)
    taps, weights = _taps(start, length, sides, n_in, n_out)  # (N, n_out, T) each
    taps = (taps + n_in * torch.arange(n, device=rows.device)[:, None, None]).view(n * n_out, -1)
    taps, weights = taps.T.contiguous(), weights.view(n * n_out, -1).T.contiguous()[:, :, None]
    out = torch.zeros(n * n_out, rows.shape[1], device=rows.device)
    for t in range(len(taps)):
        out += rows.index_select(0, taps[t]) * weights[t]
    return out


def _taps(start: Tensor, length: Tensor, sides: Tensor, n_in: int,
          n_out: int) -> tuple[Tensor, Tensor]:
    """Pillow's resampling coefficients (Resample.c) for n_out pixels over [start, start +
    length) of an image of `sides` pixels: for each output pixel, the input pixels it reads and
    their weights."""
    scale = (length / n_out).float()  # input pixels per output pixel
    support = scale.clamp(min=1)[:, None, None]
    center = start.float()[:, None] + (torch.arange(n_out, device=start.device) + 0.5) * scale[:, None]
    reach = 2 * max(n_in / n_out, 1)  # the bicubic's support (2), widened, at its largest
    first = (center - reach).floor()[:, :, None]
    pixels = first + torch.arange(int(2 * reach) + 2, device=start.device)  # (N, n_out, T)
    d = ((pixels + 0.5 - center[:, :, None]) / support).abs()
    a = -0.5  # Pillow's bicubic
    weight = torch.where(d < 1, ((a + 2) * d - (a + 3)) * d * d + 1,
                         torch.where(d < 2, (((d - 5) * d + 8) * d - 4) * a, 0.0))
    weight = torch.where((pixels >= 0) & (pixels < sides[:, None, None]), weight, 0.0)
    return pixels.clamp(0, n_in - 1).long(), weight / weight.sum(-1, keepdim=True)


def is_sharded(prepared: Path, name: str) -> bool:
    return (prepared / name / "index.npy").exists()


def moved(src: Path, dest: Path) -> None:
    """A split written in `src` into `dest`, by renames (the same file system); its pieces'
    records stay behind."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in sorted(src.glob("shard-*.tar")) + [src / "index.npy"]:
        os.replace(path, dest / path.name)


def remove(folder: Path) -> None:
    """A split's shards and index, what write_split writes (and its temporary files), then the
    folder if that left it empty; anything else in it is kept."""
    for pattern in ("shard-*.tar", ".shard-*.tar.tmp", "shard-*.tar.json", "index.npy",
                    ".index.*tmp.npy"):
        for path in folder.glob(pattern):
            path.unlink()
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
