"""Data sources for the prepare stage: each reads its data into uint8 train/val/test splits.

A new source is a function here and its entry in `SOURCES`; `data.source: <name>` in
params.yaml picks it. Nothing else lists the sources: config reads the names from this file's
source, so `SOURCES` stays a dict written out with string keys. tests/experiment/test_contracts.py checks
every entry against this contract (a source that needs files it cannot write offline adds a
writer of small ones there):

- Signature: `(cfg: DataConfig, seed: int, scratch: Path) -> Loaded`. It reads `data.root`
  (its raw data, or where a download goes: a folder of its own, prepare's only data
  dependency in dvc.yaml) and the `data` section only; `scratch` is
  data/prepared/, where it may put memory-mapped `.<name>.npy` files (prepare removes them).
  One whose raw data is not under `data.root` (digits: scikit-learn's file) adds its case to
  `raw_data` below, the path MLflow's dataset record names (else that names `data.root`).
- Splits: `Loaded.splits` holds exactly "train", "val" and "test" (`data.SPLITS`), each a
  `Split` with `x` uint8 `(N, data.channels, data.image_size, data.image_size)` (auto: the
  source's own channels) and `y` int64
  `(N,)` in `0..len(classes) - 1`; every class is in train. A dataset's own test split is kept;
  otherwise val and test are carved out stratified by `data.val_fraction`/`test_fraction`
  (`from_arrays` does both, and `resize` the `data.resize` policy).
- Classes: `Loaded.classes`, two or more distinct names in label order; they become
  meta.json's and model.json's labels.
- Determinism: the same raw data, `data` section and seed give the same splits, to the byte
  (meta.json's sha256 and dvc.lock), on any machine and any number of workers: no unseeded
  randomness, no order from the file system or from threads.
- Failure: a problem with the user's data or setup is a `DataError` that names the file or
  key and says what to do (offline: which files to put where); unreadable images go to
  `Loaded.rejected`, identical files in two splits to `Loaded.leaks`.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from stages.config import DataConfig
from stages.data import SPLITS, Split
from stages.lib.files import write_error
from stages.lib.images import (
    DIGEST,
    IMAGE_EXTS,
    DataError,
    Files,
    check_tree,
    decode_many,
    has_colour,
    image_files,
    open_image,
)
from stages.lib.paths import repo_root


@dataclass
class Loaded:
    splits: dict[str, Split]
    classes: list[str]
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    leaks: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # sha256: (split, path)
    native: tuple[int, int] | None = None  # (width, height) of every raw image, where one size


def from_digits(cfg: DataConfig, seed: int, scratch: Path) -> Loaded:
    x, y, classes = load_digits()
    return Loaded(from_arrays(x, y, cfg, seed), classes, native=(x.shape[-1], x.shape[-2]))


def from_torchvision(source: str, cfg: DataConfig, seed: int, scratch: Path) -> Loaded:
    parts, classes = load_torchvision(source, Path(cfg.root))
    x = parts["train"].x
    return Loaded(from_arrays(x, parts["train"].y, cfg, seed, parts["test"]), classes,
                  native=(x.shape[-1], x.shape[-2]))


def from_folder(cfg: DataConfig, seed: int, scratch: Path,
                folder: tuple[list[str], dict[str, Files]] | None = None) -> Loaded:
    """Class sub-folders of images under `data.root` (`folder`: split_folder's, when done),
    optionally already split into train/val/test; decoded into memory-mapped files in `scratch`."""
    classes, items = folder or split_folder(cfg, seed)
    if cfg.channels == "auto":  # prepare resolves it first, and says so
        cfg = replace(cfg, channels=3 if sample_folder(items["train"])[1] else 1)
    scratch.mkdir(parents=True, exist_ok=True)
    splits, rejected, accepted = {}, [], {}
    for name in SPLITS:
        splits[name], bad, accepted[name] = decode_split(items[name], cfg, cfg.workers,
                                                         scratch / f".{name}.npy")
        rejected += bad
    check_rejected(rejected, sum(len(v) for v in items.values()), cfg)
    return Loaded(splits, classes, rejected, leaks_in(items, accepted))


def sample_folder(items: Files, sample: int = 256) -> tuple[dict[tuple[int, int], int], bool]:
    """How many of up to `sample` files, evenly spread over `items`, have each (width, height),
    and whether any holds colour: prepare's resize line and data.channels: auto, in seconds for
    any number of files."""
    sizes: dict[tuple[int, int], int] = {}
    colour = False
    for i in np.unique(np.linspace(0, len(items) - 1, min(sample, len(items))).astype(int)):
        path = items.path(int(i))
        try:
            with open_image(path) as img:
                sizes[img.size] = sizes.get(img.size, 0) + 1
            colour = colour or has_colour(path)
        except (DataError, OSError):  # decoding lists it in rejected.csv
            pass
    return sizes, colour


def resize_line(cfg: DataConfig, sizes: dict[tuple[int, int], int]) -> str | None:
    """One line when prepare resizes the images, saying from what to what and the key that
    keeps the native size; None when they are data.image_size already."""
    size = cfg.image_size
    if not sizes or set(sizes) == {(size, size)}:
        return None
    if len(sizes) == 1 and (native := next(iter(sizes)))[0] == native[1]:
        return (f"prepare: resizing {native[0]}x{native[1]} -> {size}x{size} (data.image_size; "
                f"-S data.image_size={native[0]} keeps the native size)")
    (w, h), n = max(sizes.items(), key=lambda kv: kv[1])
    return (f"prepare: resizing {len(sizes)} sizes (the most common {w}x{h}, {n} of "
            f"{sum(sizes.values())} sampled) -> {size}x{size} by data.resize: {cfg.resize} "
            "(data.image_size)")


def check_rejected(rejected: list[tuple[str, str]], total: int, cfg: DataConfig) -> None:
    if total and len(rejected) / total > cfg.max_rejected_fraction:
        listing = "; ".join(f"{p}: {r}" for p, r in rejected[:5])
        raise DataError(f"{len(rejected)} of {total} images in {Path(cfg.root)} could not be read "
                        f"({len(rejected) / total:.1%} > data.max_rejected_fraction "
                        f"{cfg.max_rejected_fraction}); first: {listing}")


# Which of a split's files were decoded (their positions in its Files) and their digests (DIGEST).
Accepted = tuple[np.ndarray, np.ndarray]


def leaks_in(items: dict[str, Files], accepted: dict[str, Accepted]) -> dict[str, list[tuple[str, str]]]:
    """Identical files (by sha256) in more than one split: {hex digest: [(split, path), ...]},
    in the order the splits list them. Files are matched by their digests' first 8 bytes, sorted
    as integers, then by the whole digest: for a million files, 30 MB of arrays for a moment
    rather than copies of every digest."""
    names, sizes = list(accepted), [len(d) for _, d in accepted.values()]
    if sum(sizes) < 2:
        return {}
    heads = np.concatenate([d.view(np.uint64)[::4] for _, d in accepted.values()])
    split, start = np.repeat(np.arange(len(names), dtype=np.int8), sizes), np.cumsum([0, *sizes])
    order = np.argsort(heads, kind="stable")
    same = heads[order[1:]] == heads[order[:-1]]
    groups: dict[bytes, list[tuple[str, int]]] = {}
    for i in np.unique(order[np.r_[same, False] | np.r_[False, same]]).tolist():  # in order
        name, at = names[split[i]], i - start[split[i]]
        groups.setdefault(accepted[name][1][at].tobytes(), []).append((name, at))
    return {d.hex(): [(name, items[name].path(int(accepted[name][0][at]))) for name, at in group]
            for d, group in groups.items() if len({name for name, _ in group}) > 1}


SOURCES: dict[str, Callable[[DataConfig, int, Path], Loaded]] = {
    "digits": from_digits,  # scikit-learn's handwritten digits: offline, shipped with the package
    "folder": from_folder,
    "cifar10": partial(from_torchvision, "cifar10"),
    "mnist": partial(from_torchvision, "mnist"),
    "fashion_mnist": partial(from_torchvision, "fashion_mnist"),
}


def raw_data(source: str, root: str) -> Path:
    """Where a source's raw data lives on this machine, which the run's dataset record names:
    scikit-learn ships the digits; every other source reads `data.root`."""
    return digits_file() if source == "digits" else (repo_root() / root).resolve()


def digits_file() -> Path:
    """scikit-learn's handwritten digits as it ships them, found without importing scikit-learn
    (seconds)."""
    return Path(importlib.util.find_spec("sklearn").submodule_search_locations[0],
                "datasets", "data", "digits.csv.gz")


def from_arrays(x: Tensor, y: Tensor, cfg: DataConfig, seed: int,
                test: Split | None = None) -> dict[str, Split]:
    """Resize, then split stratified; a dataset's own test split is kept as given."""
    channels = x.shape[1] if cfg.channels == "auto" else cfg.channels
    x = resize(x, cfg.image_size, channels)
    parts = stratified_split(y, cfg.val_fraction, 0.0 if test else cfg.test_fraction, seed)
    splits = {name: Split(x[parts[name]], y[parts[name]]) for name in SPLITS}
    if test:
        splits["test"] = Split(resize(test.x, cfg.image_size, channels), test.y)
    return splits


def load_digits() -> tuple[Tensor, Tensor, list[str]]:
    """scikit-learn's 1,797 real handwritten 8x8 digits: offline, shipped with the package. Read
    from its file as `sklearn.datasets.load_digits` does, without importing scikit-learn."""
    with gzip.open(digits_file(), "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    images = data[:, :-1].reshape(-1, 8, 8)
    x = torch.from_numpy(np.round(images * (255 / 16)).astype(np.uint8)).unsqueeze(1)
    return x, torch.from_numpy(data[:, -1].astype(np.int64)), [str(c) for c in range(10)]


TORCHVISION = {"cifar10": "CIFAR10", "mnist": "MNIST", "fashion_mnist": "FashionMNIST"}


def load_torchvision(source: str, root: Path) -> tuple[dict[str, Split], list[str]]:
    """train and test splits of a torchvision dataset, downloaded into `root` when online."""
    import torchvision.datasets as tvd

    cls = getattr(tvd, TORCHVISION[source])
    own = {cls.base_folder, cls.filename} if source == "cifar10" else {cls.__name__}
    others = sorted(p.name for p in root.iterdir() if p.name not in own
                    and not p.name.startswith(".")) if root.is_dir() else []
    if others:  # prepare depends on all of data.root (dvc.yaml): they would rerun it
        raise DataError(f"data.root={str(root)!r} holds {', '.join(others[:3])}"
                        f"{', ...' if len(others) > 3 else ''} beside {source}'s files; prepare "
                        f"depends on the whole folder, so give {source} one of its own: "
                        f"-S data.root=data/raw/{source}")
    if source != "cifar10" and (found := idx_files(cls, root / cls.__name__ / "raw")):
        return found, list(cls.classes)
    if source == "cifar10" and (archive := root / cls.filename).is_file() \
            and not (root / cls.base_folder).is_dir():
        from torchvision.datasets.utils import calculate_md5

        if (md5 := calculate_md5(str(archive))) != cls.tgz_md5:
            raise DataError(f"{archive}: found, but its md5 is {md5}, not torchvision's "
                            f"{cls.tgz_md5}: a partial or other download; put the file from "
                            f"{cls.url} there, or its extracted {cls.base_folder}/ folder")
    try:
        parts = {name: cls(str(root), train=name == "train", download=True)
                 for name in ("train", "test")}
    except Exception as e:  # noqa: BLE001 - urllib, http and integrity errors alike
        if source == "cifar10":
            where = (f"put {cls.filename} (from {cls.url}) in {root}/, or its extracted "
                     f"{cls.base_folder}/ folder")
        else:
            files = ", ".join(name for name, _ in cls.resources)
            where = (f"put {files} (from {cls.mirrors[0]}, or a distribution's copies), "
                     f"compressed or not, in {root}/{cls.__name__}/raw/")
        reason = " ".join(str(e).split())  # torchvision's messages span lines
        raise DataError(f"data.source={source}: its files are not in {root} and the download "
                        f"failed ({type(e).__name__}: {reason}). Offline? {where}") from None
    out = {}
    for name, ds in parts.items():
        x = torch.as_tensor(np.asarray(ds.data))
        x = x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2)
        out[name] = Split(x.contiguous(), torch.as_tensor(np.asarray(ds.targets), dtype=torch.int64))
    return out, [str(c) for c in parts["train"].classes]


def idx_files(cls: type, raw: Path) -> dict[str, Split] | None:
    """An MNIST-like dataset's four IDX files in `raw`, each extracted or gzipped: torchvision
    checks only the MD5 of its own downloads' .gz files, and a distribution compresses them
    again (same content, another MD5). Read in place, so prepare writes nothing in data.root,
    its dependency. None when none is there (a download's turn)."""
    names = [name.removesuffix(".gz") for name, _ in cls.resources]
    paths = {n: next((p for p in (raw / n, raw / f"{n}.gz") if p.is_file()), None) for n in names}
    if not any(paths.values()):
        return None
    missing = [n for n, p in paths.items() if p is None]
    if missing:
        raise DataError(f"{raw}: has {', '.join(p.name for p in paths.values() if p)} but not "
                        f"{', '.join(missing)} (or its .gz); put it there")
    arrays = [read_idx(paths[n]) for n in names]
    out = {}
    for name, x, y in (("train", *arrays[:2]), ("test", *arrays[2:])):
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y) or int(y.max()) >= len(cls.classes):
            raise DataError(f"{raw}: {name}'s images {x.shape} and labels {y.shape} (up to "
                            f"{int(y.max())}) do not match {cls.__name__}'s "
                            f"{len(cls.classes)} classes; replace them with the original files")
        out[name] = Split(torch.from_numpy(x.copy()).unsqueeze(1),
                          torch.from_numpy(y.astype(np.int64)))
    return out


def read_idx(path: Path) -> np.ndarray:
    """A uint8 IDX file (MNIST's format: two zero bytes, type 0x08, the number of dimensions,
    each a big-endian uint32, the data), gzipped or not."""
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise DataError(f"{path}: found, but it cannot be read ({type(e).__name__}: {e}); "
                        "replace it with the original file") from None
    ndim = data[3] if len(data) > 3 else 0
    dims = np.frombuffer(data[4:4 + 4 * ndim], dtype=">u4").tolist() if ndim else []
    if data[:3] != b"\0\0\x08" or len(dims) != ndim or len(data) != 4 + 4 * ndim + int(np.prod(dims)):
        raise DataError(f"{path}: found, but it is not a whole uint8 IDX file ({len(data)} bytes, "
                        f"header {data[:4].hex()} {dims}): truncated or another file; replace "
                        "it with the original file")
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def list_folder(root: Path) -> tuple[list[str], dict[str | None, Files]]:
    """Class names (sorted sub-folder names) and (file, label) per given split: `None` when
    `root` holds class folders directly, "train"/"val"/"test" when it has those sub-folders.
    The folders in `root` are either all split names or all class names: a class named `test`
    beside others would otherwise be taken for the test split."""
    if not root.is_dir():
        raise DataError(f"data.root={str(root)!r} is not a folder; put one sub-folder of images "
                        "per class there (data/raw/<name>/<class>/*.png)")
    check_tree(root)
    folders = {d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")}
    given = {s: root / s for s in SPLITS if s in folders}
    if given and folders - set(SPLITS):
        raise DataError(f"{root}: holds split folders ({', '.join(given)}) beside other folders "
                        f"({', '.join(sorted(folders - set(SPLITS)))}); the folders in data.root "
                        "are either all splits (train/, val/, test/, each holding class folders) "
                        "or all classes: rename a class named " + " or ".join(given)
                        + f", or move the classes into {root / 'train'}/")
    if given and "train" not in given:
        raise DataError(f"{root}: has {', '.join(s + '/' for s in given)} but no train/ folder; "
                        "split folders need train/ (a missing val/ or test/ is carved out of it)")
    top = given.get("train", root)
    classes = sorted(d.name for d in top.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        named = (f"; if {', '.join(given)} are class names, rename them: in data.root they name "
                 "splits") if given else ""
        raise DataError(f"{top}: no class folders; expected {top}/<class>/<image> "
                        f"({', '.join(sorted(IMAGE_EXTS))}){named}")
    if len(classes) == 1:
        raise DataError(f"{top}: only one class folder ({classes[0]!r}); a classifier needs two or more")
    files: dict[str | None, Files] = {}
    for split, folder in (given or {None: root}).items():
        unknown = {d.name for d in folder.iterdir() if d.is_dir() and not d.name.startswith(".")}
        unknown -= set(classes)
        if unknown:
            raise DataError(f"{folder}: class folders {sorted(unknown)} are not in {top}")
        per_class = []
        for label, c in enumerate(classes):
            found = image_files(folder / c) if (folder / c).is_dir() else []
            if not found and split in (None, "train"):
                raise DataError(f"{folder / c}: class folder has no images "
                                f"({', '.join(sorted(IMAGE_EXTS))}); add images or remove it")
            per_class.append(Files.of(found, label))
        files[split] = Files.joined(per_class)
    return classes, files


def split_folder(cfg: DataConfig, seed: int) -> tuple[list[str], dict[str, Files]]:
    """data.root's classes and its files in train, val and test (list_folder, assign_splits)."""
    classes, files = list_folder(Path(cfg.root))
    return classes, assign_splits(classes, files, cfg.val_fraction, cfg.test_fraction, seed)


def assign_splits(classes: list[str], files: dict[str | None, Files], val_fraction: float,
                  test_fraction: float, seed: int) -> dict[str, Files]:
    """Given splits are kept; a missing val or test split is carved, stratified, out of train."""
    pool = files[None] if None in files else files["train"]
    need_val, need_test = "val" not in files, "test" not in files
    labels = torch.from_numpy(pool.labels)
    try:
        parts = stratified_split(labels, val_fraction if need_val else 0.0,
                                 test_fraction if need_test else 0.0, seed)
    except ValueError as e:
        counts = {c: int((labels == i).sum()) for i, c in enumerate(classes)}
        raise DataError(f"cannot split {counts} images per class into train/val/test ({e}); "
                        "add images to the small classes or give train/val/test folders") from None
    out = {name: pool[parts[name].numpy()] for name in SPLITS}
    for name in ("val", "test"):
        if name in files:
            out[name] = files[name]
    return out


def decode_split(items: Files, cfg: DataConfig, workers: int,
                 scratch: Path) -> tuple[Split, list[tuple[str, str]], Accepted]:
    """Decode into a memory-mapped uint8 file, so memory stays bounded for any dataset size.
    Returns the split, the rejected (path, reason) and the accepted files."""
    from tqdm import tqdm

    shape = (len(items), cfg.channels, cfg.image_size, cfg.image_size)
    try:
        x = np.lib.format.open_memmap(scratch, mode="w+", dtype=np.uint8, shape=shape)
        # open_memmap makes a sparse file: on a full disk, writing its pages would kill the
        # process with SIGBUS. Its blocks reserved now, a full disk is an ENOSPC here.
        with open(scratch, "rb+") as f:
            os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
    except OSError as e:
        scratch.unlink(missing_ok=True)
        raise (write_error(e, scratch, scratch=True) or e) from e
    labels, rejected, kept, digests = [], [], [], []
    decoded = decode_many((p for p, _ in items), cfg.channels, cfg.image_size, cfg.resize, workers)
    for i, ((path, label), (img, reason, digest)) in enumerate(tqdm(
            zip(items, decoded, strict=True), total=len(items), desc=f"decode {scratch.stem}",
            mininterval=2, disable=len(items) < 1000)):
        if img is None:
            rejected.append((path, reason))
            continue
        x[len(labels)] = img
        labels.append(label)
        kept.append(i)
        digests.append(digest)
    x.flush()
    return Split(torch.from_numpy(x[:len(labels)]), torch.tensor(labels, dtype=torch.int64)), \
        rejected, (np.array(kept, dtype=np.int64), np.array(digests, dtype=DIGEST).reshape(-1))


def resize(x: Tensor, size: int, channels: int) -> Tensor:
    """uint8 (N, C, H, W) to (N, channels, size, size), antialiased."""
    if x.shape[1] != channels:
        x = x.expand(-1, channels, -1, -1) if x.shape[1] == 1 else \
            x.float().mul(torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)).sum(1, True)
    if tuple(x.shape[-2:]) != (size, size):
        x = F.interpolate(x.float(), size=(size, size), mode="bilinear", antialias=True,
                          align_corners=False)
    return x.round().clamp(0, 255).to(torch.uint8).contiguous()


def stratified_split(y: Tensor, val_fraction: float, test_fraction: float,
                     seed: int) -> dict[str, Tensor]:
    """Indices per split: the same seed gives the same split, each class in proportion."""
    from sklearn.model_selection import train_test_split

    idx = np.arange(len(y))
    labels = y.numpy()
    rest, test = train_test_split(idx, test_size=test_fraction, stratify=labels,
                                  random_state=seed) if test_fraction else (idx, idx[:0])
    train, val = train_test_split(rest, test_size=val_fraction / (1 - test_fraction),
                                  stratify=labels[rest], random_state=seed) \
        if val_fraction else (rest, idx[:0])
    return {name: torch.from_numpy(np.sort(part)) for name, part in
            zip(SPLITS, (train, val, test), strict=True)}


def content_hash(splits: dict[str, Split]) -> str:
    h = hashlib.sha256()
    for name in SPLITS:
        x = splits[name].x.numpy()
        for i in range(0, len(x), 4096):  # chunks: no second copy of a large split
            h.update(memoryview(np.ascontiguousarray(x[i:i + 4096])).cast("B"))
        h.update(splits[name].y.numpy().tobytes())
    return h.hexdigest()


def build_meta(splits: dict[str, Split], classes: list[str], cfg: DataConfig) -> dict:
    # Normalization statistics from the train split only: val/test must not leak into them.
    # In chunks, in float64: the split may be a memory-mapped file larger than RAM.
    x = splits["train"].x
    total = torch.zeros(x.shape[1], dtype=torch.float64)
    squares = torch.zeros_like(total)
    for i in range(0, len(x), 4096):
        chunk = x[i:i + 4096].to(torch.float64).div_(255)
        total += chunk.sum(dim=(0, 2, 3))
        squares += chunk.square().sum(dim=(0, 2, 3))
    n = len(x) * x.shape[2] * x.shape[3]
    return meta_of(total, squares, n, {name: s.y for name, s in splits.items()}, classes, cfg,
                   content_hash(splits))


def meta_of(total: Tensor, squares: Tensor, n: int, labels: dict[str, Tensor],
            classes: list[str], cfg: DataConfig, sha256: str) -> dict:
    """meta.json from the train split's per-channel pixel sums (float64, pixels in [0, 1]) over
    its `n` pixels a channel, and every split's labels."""
    mean = total / n
    std = ((squares - n * mean.square()) / max(1, n - 1)).clamp_min(0).sqrt()
    return {
        "source": cfg.source,
        "classes": classes,
        "channels": len(total),  # data.channels resolved
        "image_size": cfg.image_size,
        "resize": cfg.resize,
        "mean": mean.tolist(),
        "std": std.clamp_min(1e-3).tolist(),
        "counts": {name: {c: int((y == i).sum()) for i, c in enumerate(classes)}
                   for name, y in labels.items()},
        "sizes": {name: len(y) for name, y in labels.items()},
        "sha256": sha256,
    }
