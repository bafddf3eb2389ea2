"""A real image-folder dataset the tests draw: circles, squares and triangles in every file
format and Pillow mode prepare must read, plus the broken files real folders contain."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

CLASSES = ("circle", "square", "triangle")
# (extension, mode) pairs cycled through; prepare converts each to the target mode.
FORMATS = [(".png", "RGB"), (".jpg", "RGB"), (".png", "L"), (".png", "RGBA"), (".png", "P"),
           (".jpeg", "CMYK"), (".png", "I;16"), (".bmp", "RGB"), (".webp", "RGB"),
           (".tif", "RGB"), (".png", "LA")]


def draw(shape: str, rng: random.Random, size: int = 32) -> Image.Image:
    img = Image.new("RGB", (size, size), tuple(rng.randrange(0, 60) for _ in range(3)))
    d = ImageDraw.Draw(img)
    r = rng.randrange(7, 13)
    cx, cy = rng.randrange(r + 1, size - r - 1), rng.randrange(r + 1, size - r - 1)
    color = tuple(rng.randrange(150, 256) for _ in range(3))
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=color)
    elif shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=color)
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=color)
    return img


def save(img: Image.Image, path: Path, mode: str) -> None:
    if mode == "P":
        p = img.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
        p.save(path, transparency=p.getpixel((0, 0)))  # the background's palette entry
    elif mode == "I;16":
        arr = np.asarray(img.convert("L"), dtype=np.uint16) * 257
        Image.fromarray(arr).save(path)  # uint16: a 16-bit grayscale PNG
    else:
        img.convert(mode).save(path)


def make_folder(root: Path, per_class: int, seed: int = 0, splits: dict[str, int] | None = None,
                bad: bool = True) -> dict[str, int]:
    """Write the dataset; returns how many good images each split (or "all") got."""
    rng = random.Random(seed)
    counts = {}
    layout = splits or {"": per_class}
    for split, n in layout.items():
        for c in CLASSES:
            folder = root / split / c
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                ext, mode = FORMATS[(i + CLASSES.index(c)) % len(FORMATS)]
                save(draw(c, rng), folder / f"{c}_{i:03d}{ext}", mode)
        counts[split or "all"] = n * len(CLASSES)
    if bad:
        target = root / ("train" if splits else "") / "circle"
        (target / "empty.png").write_bytes(b"")
        good = (target / "circle_000.png").read_bytes()
        (target / "truncated.png").write_bytes(good[: len(good) // 2])
        (target / "notes.jpg").write_text("not an image")
        hidden = target / ".thumbnails"
        hidden.mkdir()
        (hidden / "thumb.png").write_bytes(good)
        (target / ".hidden.png").write_bytes(good)
    return counts


# An Encapsulated PostScript drawing: Pillow's EPS decoder hands such a file to Ghostscript.
EPS = (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\n%%EndComments\n"
       b"newpath 0 0 moveto 16 16 lineto stroke\nshowpage\n%%EOF\n")


def fake_ghostscript(folder: Path) -> Path:
    """A `gs` in `folder` (put it first on the PATH) that appends each command line it gets to
    the file returned, then fails as the real one does on a file it refuses. This machine has
    no Ghostscript: the stand-in shows whether a reader would run it."""
    folder.mkdir(parents=True, exist_ok=True)
    record = folder / "gs-called"
    (folder / "gs").write_text(f'#!/bin/sh\necho "$@" >> "{record}"\nexit 1\n')
    (folder / "gs").chmod(0o755)
    return record


def many_scan_jpeg(scans: int, size: int = 4096) -> bytes:
    """A valid grayscale progressive JPEG of size x size zeros with `scans` AC scans of 6 bytes
    each (their entropy data left out: libjpeg reads it as zeros, a run of empty blocks). Each
    scan is a pass over every block of the image: about 2 ms at 4096x4096 here."""
    import struct

    def segment(marker: int, payload: bytes) -> bytes:
        return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload

    blocks = (size // 8) ** 2
    return (b"\xff\xd8" + segment(0xDB, b"\x00" + b"\x01" * 64)
            + segment(0xC2, struct.pack(">BHHB", 8, size, size, 1) + b"\x01\x11\x00")
            + segment(0xC4, b"\x00" + bytes([1] + [0] * 15) + b"\x00")  # DC: one code, '0'
            + segment(0xC4, b"\x10" + bytes([1] + [0] * 15) + b"\xe0")  # AC: EOB run, '0'
            + segment(0xDA, b"\x01\x01\x00\x00\x00\x00") + b"\x00" * (blocks // 8)  # DC scan
            + segment(0xDA, b"\x01\x01\x00\x01\x3f\x00") * scans + b"\xff\xd9")


def noise_folder(root, per_class: int, side: int = 256, ext: str = "jpg") -> None:
    """JPEGs of noise, about 100 KB each at 256 px: a few to a 1 MiB shard (PNGs: 200 KB)."""
    rng = np.random.default_rng(0)
    for c in ("a", "b", "c"):
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / c / f"{i:03d}.{ext}", quality=90)


def lossless_jpeg(pixels: np.ndarray) -> bytes:
    """A grey (H, W) uint8 image as a lossless JPEG (SOF3, predictor 1: the left neighbour),
    which Pillow reads and libjpeg-turbo will not turn to RGB (torchvision's decode_jpeg with
    mode RGB refuses it), as nvJPEG refuses it."""
    import struct

    def segment(marker: int, payload: bytes) -> bytes:
        return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload

    x = pixels.astype(np.int32)
    pred = np.concatenate([np.r_[128, x[:-1, 0]][:, None], x[:, :-1]], axis=1)
    bits = []
    for d in (x - pred).ravel().tolist():  # its category (4 bits, one code each), then its bits
        cat = abs(d).bit_length()
        bits.append(format(cat, "04b") + (format(d if d >= 0 else d + (1 << cat) - 1,
                                                 f"0{cat}b") if cat else ""))
    s = "".join(bits)
    s += "1" * (-len(s) % 8)
    data = int(s, 2).to_bytes(len(s) // 8, "big").replace(b"\xff", b"\xff\x00")
    h, w = pixels.shape
    return (b"\xff\xd8" + segment(0xC4, b"\x00" + bytes([0, 0, 0, 9] + [0] * 12) + bytes(range(9)))
            + segment(0xC3, struct.pack(">BHHB", 8, h, w, 1) + b"\x01\x11\x00")
            + segment(0xDA, b"\x01\x01\x00\x01\x00\x00") + data + b"\xff\xd9")
