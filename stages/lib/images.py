"""Image files in: finding them, decoding every mode Pillow reads, the same way for prepare and predict."""

from __future__ import annotations

import ctypes
import errno
import gc
import hashlib
import io
import multiprocessing
import os
import signal
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import TypeVar

import numpy as np
from PIL import Image, ImageOps

from stages.lib.errors import UserError

T, R = TypeVar("T"), TypeVar("R")
# Files' SHA-256 digests side by side in one array: prepare compares a million of them for
# leakage, which as hex strings in tuples would take 110 MB more.
DIGEST = np.dtype("V32")

# The image files read, by extension, and the one Pillow decoder each may use. Only these decode,
# whatever a file's name or first bytes claim: Pillow's EPS decoder runs Ghostscript on the file
# (a served image would run it on the server), and its dozens of other decoders are code no
# dataset needs. `Image.open` is always given `formats=DECODERS`.
IMAGE_FORMATS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".bmp": "BMP", ".webp": "WEBP",
                 ".tif": "TIFF", ".tiff": "TIFF"}
IMAGE_EXTS = set(IMAGE_FORMATS)
DECODERS = sorted(set(IMAGE_FORMATS.values()))
ACCEPTED = ", ".join(DECODERS)
# The largest image file read: each is read whole (hashed, then decoded), in every worker at
# once. Larger files (a 40000x40000 TIFF, a stray disk image) are rejected and listed.
MAX_IMAGE_BYTES = 256 * 2**20
# The most scans a JPEG may have. libjpeg decodes a progressive JPEG a scan at a time, each a pass
# over every block of the image, and sets no limit; a scan can be 6 bytes, so 10,000 scans of a
# 4096x4096 image in 133 kB cost 15 s of CPU (an 8 MiB request to `make serve`, 20 minutes).
# Encoders write about 10 (jpegtran -progressive: 10 for colour, 6 for grey).
MAX_JPEG_SCANS = 100
# The longest side read. Resizing to image_size allocates a filter tap per source pixel the
# scale spans: a 33 kB PNG of 1x16,777,216 pixels (within serve's MAX_PIXELS) took 5 s and
# 650 MB, and a 74-byte one of 1x100,000,000 ended prepare in a MemoryError. JPEG's own
# limit, which no photo or scan reaches.
MAX_SIDE = 65_535


class DataError(UserError, ValueError):
    """A problem with the user's data; the message names the file or folder and the fix."""


def is_hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def shown(path: str | Path) -> str:
    """A file name as one quoted line whatever its bytes: those outside printable ASCII as
    \\xNN, as `ls -b` shows them."""
    return repr(os.fsencode(path))[1:]


def check_tree(root: Path) -> None:
    """Refuse, naming them, the entries below `root` that DVC cannot hash, before prepare reads
    what DVC would not see. DVC (3.67) fails on a name that is not UTF-8 without naming it, and
    skips every symlinked folder (it follows symlinked files): images in one would never rerun
    prepare when they change. Hidden folders prepare skips as well."""
    not_utf8, linked, dangling = [], [], []
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:  # the bytes Python keeps as surrogates
                not_utf8.append(path)
            if name in dirs and os.path.islink(path) and not is_hidden(Path(path), root):
                linked.append(path)
            elif os.path.islink(path) and not os.path.exists(path):  # DVC fails hashing it
                dangling.append(path)
    if not_utf8:
        more = f" and {len(not_utf8) - 5} more" if len(not_utf8) > 5 else ""
        raise DataError(f"{', '.join(map(shown, not_utf8[:5]))}{more}: names that are not UTF-8, "
                        "which DVC cannot hash (`dvc add` and `dvc repro` fail with \"'utf-8' "
                        "codec can't encode character\", naming no file); rename them to UTF-8, "
                        f"e.g. `convmv -r -f latin1 -t utf-8 --notest {root}` if they are Latin-1")
    if dangling:
        more = f" (and {len(dangling) - 1} more)" if len(dangling) > 1 else ""
        raise DataError(f"{shown(dangling[0])} is a symlink to {shown(os.readlink(dangling[0]))}, "
                        f"which does not exist{more}: DVC fails hashing {root} on it; restore "
                        "its target or remove the link")
    if linked:
        more = f" (and {len(linked) - 1} more)" if len(linked) > 1 else ""
        raise DataError(f"{shown(linked[0])} is a symlink to a folder (to {shown(os.readlink(linked[0]))})"
                        f"{more}: DVC does not hash linked folders, so changed or new images there "
                        f"would never rerun prepare; copy or move the folder into {root} (or "
                        "`dvc import` it), or point data.root at the real folder")


def image_files(folder: str | Path) -> list[str]:
    """Image files below `folder`, in the order of their sorted Paths (a folder's entries by name,
    each sub-folder's files at its name), skipping hidden files and folders and not entering linked
    folders (check_tree refuses those). Strings: at a million files a Path costs several times its
    string, and prepare holds them all."""
    with os.scandir(folder) as it:
        entries = sorted(it, key=lambda e: e.name)
    found = []
    for e in entries:
        if e.name.startswith("."):
            continue
        if e.is_dir(follow_symlinks=False):
            found += image_files(e.path)
        elif e.is_file() and os.path.splitext(e.name)[1].lower() in IMAGE_EXTS:
            found.append(e.path)
    return found


@dataclass(frozen=True)
class Files:
    """Image files and their labels, side by side in two arrays. A million paths as strings in
    tuples would take 250 MB, and the pages of each tuple a process touches after it forked its
    workers are copied, refcounts being writes; in arrays they take a tenth of that, read only.
    Iterates as (path, label) pairs; an array of positions or a slice picks a subset."""
    paths: np.ndarray  # file system paths, encoded (os.fsencode)
    labels: np.ndarray  # int64

    @classmethod
    def of(cls, paths: list[str], label: int) -> Files:
        return cls(np.array([os.fsencode(p) for p in paths], dtype=np.bytes_).reshape(-1),
                   np.full(len(paths), label, dtype=np.int64))

    @classmethod
    def joined(cls, parts: list[Files]) -> Files:
        return cls(np.concatenate([f.paths for f in parts]), np.concatenate([f.labels for f in parts]))

    def __len__(self) -> int:
        return len(self.labels)

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return zip(map(os.fsdecode, self.paths), map(int, self.labels), strict=True)

    def __getitem__(self, picked: np.ndarray | slice) -> Files:
        return Files(self.paths[picked], self.labels[picked])

    def path(self, i: int) -> str:
        return os.fsdecode(self.paths[i])


def _to_8bit(img: Image.Image) -> Image.Image:
    """16-bit and 32-bit grayscale scaled, not clipped, to 8 bits."""
    arr = np.asarray(img, dtype=np.float64)
    if img.mode == "F" and arr.size and arr.max() <= 1.0:
        arr = arr * 255
    elif img.mode.startswith("I;16") or (arr.size and arr.max() > 255):
        arr = arr / 257
    return Image.fromarray(np.clip(np.round(arr), 0, 255).astype(np.uint8), "L")


def to_mode(img: Image.Image, mode: str) -> Image.Image:
    """Any Pillow mode to "L" or "RGB". Transparency is composited onto black, the colour of
    the zero padding augmentation adds."""
    if img.mode in ("I", "F") or img.mode.startswith("I;16"):
        img = _to_8bit(img)
    if img.mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (0, 0, 0, 255))
        img = Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert(mode)


def check_size(path: str | Path) -> None:
    """Before reading a file whole: its size (through symlinks) within MAX_IMAGE_BYTES."""
    n = os.stat(path).st_size
    if n > MAX_IMAGE_BYTES:
        raise DataError(f"{n / 2**20:,.0f} MiB, over the {MAX_IMAGE_BYTES // 2**20} MiB limit "
                        "for one image file (MAX_IMAGE_BYTES in stages/lib/images.py)")


def open_image(source: str | Path | bytes) -> Image.Image:
    """The image in a file or its bytes, header read, pixels not yet decoded: only the formats of
    IMAGE_FORMATS are tried. Raises DataError with a fixed message: Pillow's own name temporary
    files, command lines and object addresses, which a served reply must not echo."""
    try:
        readable = io.BytesIO(source) if isinstance(source, bytes) else source
        img = Image.open(readable, formats=DECODERS)
    except Image.DecompressionBombError:
        raise DataError("a decompression bomb: its header declares more pixels than Pillow "
                        f"decodes ({2 * Image.MAX_IMAGE_PIXELS:,})") from None
    except (OSError, SyntaxError, ValueError) as e:  # UnidentifiedImageError is an OSError
        if isinstance(e, OSError) and e.errno is not None:
            raise  # the file unreadable (permissions, I/O), not its contents: the system's words
        raise DataError(f"not an image file of a format read here ({ACCEPTED}); convert it, "
                        "e.g. to PNG") from None
    if img.format in ("JPEG", "MPO") and (scans := jpeg_scans(img.fp)) > MAX_JPEG_SCANS:
        img.close()
        raise DataError(f"a JPEG of {scans:,} scans, over the {MAX_JPEG_SCANS} read here "
                        "(MAX_JPEG_SCANS in stages/lib/images.py); save it again, e.g. as PNG")
    return img


def jpeg_scans(fp) -> int:
    """A JPEG's start-of-scan markers (FF DA), counted in C over the file, its position kept.
    Entropy-coded data never holds FF DA (an FF there is followed by 00); metadata may, so a
    real file can count a few more than it has, never fewer."""
    at, n, last = fp.tell(), 0, b""
    fp.seek(0)
    while chunk := fp.read(2**20):
        n += (last + chunk).count(b"\xff\xda")  # a marker split across two reads counts once
        last = chunk[-1:]
    fp.seek(at)
    return n


def decode_image(source: str | Path | bytes, channels: int, size: int,
                 resize: str) -> np.ndarray:
    """uint8 (C, size, size) from a file or its bytes. Raises DataError with the reason for an
    unreadable file."""
    return fit(decode_pixels(source, channels)[0], size, resize)


def decode_pixels(source: str | Path | bytes, channels: int, draft: int = 0
                  ) -> tuple[Image.Image, tuple[int, int]]:
    """The whole image, decoded and checked, in "L" or "RGB" at its own size, and that size
    (width, height); with `draft`, a JPEG at the smallest of 1/2, 1/4 or 1/8 of it whose sides
    stay at least `draft` (libjpeg scales the inverse DCT: a quarter of the work for a crop to a
    small size), and still its full size, the one a crop box is drawn at."""
    if not isinstance(source, bytes):
        check_size(source)
    empty = len(source) == 0 if isinstance(source, bytes) else Path(source).stat().st_size == 0
    if empty:
        raise DataError("empty file (0 bytes)")
    with open_image(source) as opened:
        if max(opened.size) > MAX_SIDE:
            raise DataError(f"{opened.width}x{opened.height} pixels: a side over {MAX_SIDE:,} "
                            "(MAX_SIDE in stages/lib/images.py); crop or resize it first")
        try:
            full = opened.size
            if draft:
                opened.draft(opened.mode, (draft, draft))
            opened.load()  # decode it all now: a truncated file fails here, never padded silently
            img = ImageOps.exif_transpose(opened)
            turned = img.size != opened.size  # by its EXIF orientation: a quarter turn
            return to_mode(img, "L" if channels == 1 else "RGB"), full[::-1] if turned else full
        except Exception:  # noqa: BLE001 - a decoder fails with any type on a crafted file
            if draft:  # libjpeg scales only a DCT: a lossless JPEG (SOF3) decodes at full size
                return decode_pixels(source, channels)
            raise DataError(f"a damaged or truncated {opened.format} file: its header reads but "
                            "its pixels do not decode; save or copy it again") from None


# How far apart red, green and blue may be in a grey pixel: JPEG's chroma rounding leaves a
# grey photo saved in colour a few levels apart.
GREY_LEVELS = 8


def has_colour(source: str | Path | bytes) -> bool:
    """Whether an image holds colour (a pixel whose red, green and blue differ by more than
    GREY_LEVELS): what data.channels: auto goes by, and predict's check for a grayscale model."""
    a = np.asarray(decode_pixels(source, 3, draft=64)[0], dtype=np.int16)
    return int((a.max(axis=2) - a.min(axis=2)).max()) > GREY_LEVELS


def fit(img: Image.Image, size: int, resize: str) -> np.ndarray:
    """uint8 (C, size, size): `data.resize`'s policy, squash or center_crop."""
    if resize == "center_crop":
        img = ImageOps.fit(img, (size, size), Image.Resampling.BICUBIC)
    else:
        img = img.resize((size, size), Image.Resampling.BICUBIC)
    channels = 1 if img.mode == "L" else 3
    return np.asarray(img, dtype=np.uint8).reshape(size, size, channels).transpose(2, 0, 1)


def _decode_one(args: tuple[str, int, int, str]) -> tuple[np.ndarray | None, str, bytes]:
    path, channels, size, resize = args
    try:
        check_size(path)
        data = Path(path).read_bytes()  # read once: hashed for leakage, then decoded
        return decode_image(data, channels, size, resize), "", hashlib.sha256(data).digest()
    except (DataError, OSError) as e:
        return None, str(e), b""


def decode_many(paths: Iterable[str], channels: int, size: int, resize: str,
                workers: int) -> Iterator[tuple[np.ndarray | None, str, bytes]]:
    """(image or None, reason if rejected, SHA-256 of the file), in order, decoded in parallel."""
    return parallel_map(_decode_one, ((p, channels, size, resize) for p in paths), workers)


def parallel_map(fn: Callable[[T], R], jobs: Iterable[T], workers: int) -> Iterator[R]:
    """fn over jobs in `workers` processes, results in order, a few chunks in flight at a time:
    Executor.map (before Python 3.14) takes every job at once, a future and a copy of its
    arguments per chunk, which for a million images is memory that grows with the dataset."""
    if workers <= 1:
        yield from map(fn, jobs)
        return
    jobs = iter(jobs)
    # The workers fork from this process: what it holds now, moved out of the collector's reach,
    # is never marked by a collection in either, and stays shared instead of copied page by page
    # (Python's gc documentation). prepare is short-lived: nothing frozen needs collecting.
    gc.freeze()
    before = set(multiprocessing.active_children())
    try:
        with ProcessPoolExecutor(max_workers=workers, initializer=_worker_start,
                                 initargs=(os.getpid(),)) as pool:
            pending: deque[Future[list[R]]] = deque()
            while True:
                while len(pending) < 4 * workers and (chunk := list(islice(jobs, 32))):
                    pending.append(pool.submit(_each, fn, chunk))
                if not pending:
                    return
                yield from pending.popleft().result()
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.ENOMEM):
            raise
        # A fork refused. The pool forks all its workers at its first job and, when one fork
        # fails, leaves those it started waiting for work, and this process's exit for them.
        for p in set(multiprocessing.active_children()) - before:
            p.kill()
            p.join()
        raise UserError(f"could not start {workers} worker processes ({e.strerror}): the "
                        "process or memory limit (`ulimit -u`, a container's) is reached; set "
                        "data.num_workers lower in params.yaml") from None


def _worker_start(parent: int) -> None:
    """A pool worker's first step. It ignores Ctrl-C: the main process stops the workers, with
    one line instead of a KeyboardInterrupt traceback from each. And it dies with the main
    process, killed too (kill -9, the OOM killer): an orphan would decode on for nobody, holding
    its memory and the caller's stdout (`prepare | cat` would never end)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent, signal.SIGKILL)


# Looked up here, not in a forked child: another thread may hold a lock the child would need to
# import or load anything.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def die_with_parent(parent: int, sig: int) -> None:
    """`sig` to this process when `parent` dies, even by SIGKILL (Linux's PR_SET_PDEATHSIG)."""
    if _prctl is not None:
        _prctl(1, sig)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        os.kill(os.getpid(), sig)


def _each(fn: Callable[[T], R], chunk: list[T]) -> list[R]:
    return [fn(job) for job in chunk]
