"""Datasets as uint8 tensors (N, C, H, W): loading, splitting, batching and augmentation."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from stages.config import DataConfig
from stages.files import save_torch, write_json
from stages.images import IMAGE_EXTS, DataError, decode_many, image_files

SPLITS = ("train", "val", "test")


@dataclass
class Split:
    x: Tensor  # uint8 (N, C, H, W)
    y: Tensor  # int64 (N,)


def load_digits() -> tuple[Tensor, Tensor, list[str]]:
    """scikit-learn's 1,797 real handwritten 8x8 digits: offline, shipped with the package."""
    from sklearn.datasets import load_digits as sk_digits

    d = sk_digits()
    x = torch.from_numpy(np.round(d.images * (255 / 16)).astype(np.uint8)).unsqueeze(1)
    return x, torch.from_numpy(d.target.astype(np.int64)), [str(c) for c in d.target_names]


TORCHVISION = {"cifar10": "CIFAR10", "mnist": "MNIST", "fashion_mnist": "FashionMNIST"}


def load_torchvision(source: str, root: Path) -> tuple[dict[str, Split], list[str]]:
    """train and test splits of a torchvision dataset, downloaded into `root` when online."""
    import torchvision.datasets as tvd

    cls = getattr(tvd, TORCHVISION[source])
    try:
        parts = {name: cls(str(root), train=name == "train", download=True)
                 for name in ("train", "test")}
    except Exception as e:  # noqa: BLE001 - urllib, http and integrity errors alike
        if source == "cifar10":
            where = (f"put {cls.filename} (from {cls.url}) in {root}/, or its extracted "
                     f"{cls.base_folder}/ folder")
        else:
            files = ", ".join(name for name, _ in cls.resources)
            where = (f"put {files} (from {cls.mirrors[0]}), or the same files extracted, "
                     f"in {root}/{cls.__name__}/raw/")
        raise DataError(f"data.source={source}: could not load or download it into {root} "
                        f"({type(e).__name__}: {e}). Offline? {where}") from None
    out = {}
    for name, ds in parts.items():
        x = torch.as_tensor(np.asarray(ds.data))
        x = x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2)
        out[name] = Split(x.contiguous(), torch.as_tensor(np.asarray(ds.targets), dtype=torch.int64))
    return out, [str(c) for c in parts["train"].classes]


def list_folder(root: Path) -> tuple[list[str], dict[str | None, list[tuple[Path, int]]]]:
    """Class names (sorted sub-folder names) and (file, label) per given split: `None` when
    `root` holds class folders directly, "train"/"val"/"test" when it has those sub-folders."""
    if not root.is_dir():
        raise DataError(f"data.root={str(root)!r} is not a folder; put one sub-folder of images "
                        "per class there (data/raw/<name>/<class>/*.png)")
    given = {s: root / s for s in SPLITS if (root / s).is_dir()}
    if given and "train" not in given:
        raise DataError(f"{root}: has {', '.join(given)}/ but no train/ folder")
    top = given.get("train", root)
    classes = sorted(d.name for d in top.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise DataError(f"{top}: no class folders; expected {top}/<class>/<image> "
                        f"({', '.join(sorted(IMAGE_EXTS))})")
    if len(classes) == 1:
        raise DataError(f"{top}: only one class folder ({classes[0]!r}); a classifier needs two or more")
    files: dict[str | None, list[tuple[Path, int]]] = {}
    for split, folder in (given or {None: root}).items():
        unknown = {d.name for d in folder.iterdir() if d.is_dir() and not d.name.startswith(".")}
        unknown -= set(classes)
        if unknown:
            raise DataError(f"{folder}: class folders {sorted(unknown)} are not in {top}")
        files[split] = []
        for label, c in enumerate(classes):
            found = image_files(folder / c) if (folder / c).is_dir() else []
            if not found and split in (None, "train"):
                raise DataError(f"{folder / c}: class folder has no images "
                                f"({', '.join(sorted(IMAGE_EXTS))}); add images or remove it")
            files[split] += [(p, label) for p in found]
    return classes, files


def assign_splits(classes: list[str], files: dict[str | None, list[tuple[Path, int]]],
                  val_fraction: float, test_fraction: float,
                  seed: int) -> dict[str, list[tuple[Path, int]]]:
    """Given splits are kept; a missing val or test split is carved, stratified, out of train."""
    pool = files.get(None) or files["train"]
    need_val, need_test = "val" not in files, "test" not in files
    labels = torch.tensor([label for _, label in pool])
    try:
        parts = stratified_split(labels, val_fraction if need_val else 0.0,
                                 test_fraction if need_test else 0.0, seed)
    except ValueError as e:
        counts = {c: int((labels == i).sum()) for i, c in enumerate(classes)}
        raise DataError(f"cannot split {counts} images per class into train/val/test ({e}); "
                        "add images to the small classes or give train/val/test folders") from None
    out = {name: [pool[i] for i in parts[name].tolist()] for name in SPLITS}
    for name in ("val", "test"):
        if name in files:
            out[name] = files[name]
    return out


def decode_split(items: list[tuple[Path, int]], cfg: DataConfig, workers: int,
                 scratch: Path) -> tuple[Split, list[tuple[str, str]], list[tuple[str, str]]]:
    """Decode into a memory-mapped uint8 file, so memory stays bounded for any dataset size.
    Returns the split, the rejected (path, reason) and the accepted (path, sha256)."""
    from tqdm import tqdm

    shape = (len(items), cfg.channels, cfg.image_size, cfg.image_size)
    x = np.lib.format.open_memmap(scratch, mode="w+", dtype=np.uint8, shape=shape)
    labels, rejected, digests = [], [], []
    decoded = decode_many([p for p, _ in items], cfg.channels, cfg.image_size, cfg.resize, workers)
    for (path, label), (img, reason, digest) in tqdm(zip(items, decoded, strict=True),
                                                     total=len(items), desc=f"decode {scratch.stem}",
                                                     mininterval=2, disable=len(items) < 1000):
        if img is None:
            rejected.append((str(path), reason))
            continue
        x[len(labels)] = img
        labels.append(label)
        digests.append((str(path), digest))
    x.flush()
    return Split(torch.from_numpy(x[:len(labels)]), torch.tensor(labels, dtype=torch.int64)), \
        rejected, digests


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
    mean = total / n
    std = ((squares - n * mean.square()) / max(1, n - 1)).clamp_min(0).sqrt()
    counts = {name: {c: int((s.y == i).sum()) for i, c in enumerate(classes)}
              for name, s in splits.items()}
    return {
        "source": cfg.source,
        "classes": classes,
        "channels": cfg.channels,
        "image_size": cfg.image_size,
        "resize": cfg.resize,
        "mean": mean.tolist(),
        "std": std.clamp_min(1e-3).tolist(),
        "counts": counts,
        "sizes": {name: len(s.y) for name, s in splits.items()},
        "sha256": content_hash(splits),
    }


def save_prepared(out: Path, splits: dict[str, Split], meta: dict) -> None:
    for name, s in splits.items():
        save_torch(out / f"{name}.pt", {"x": s.x, "y": s.y})
    write_json(out / "meta.json", meta)


def load_meta(prepared: Path) -> dict:
    path = Path(prepared) / "meta.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: missing; run `dvc repro prepare` first")
    return json.loads(path.read_text())


def load_split(prepared: Path, name: str) -> Split:
    path = Path(prepared) / f"{name}.pt"
    if not path.exists():
        raise FileNotFoundError(f"{path}: missing; run `dvc repro prepare` first")
    # mmap: a large split is paged in as batches touch it, not read whole into memory.
    d = torch.load(path, weights_only=True, mmap=True)
    return Split(d["x"], d["y"])


def normalize(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """uint8 (N, C, H, W) on any device to normalized float; mean/std shaped (C,)."""
    return (x.float().div_(255) - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)


def _hash(seed: int, epoch: int, idx: Tensor, salt: int) -> Tensor:
    # splitmix-style integer mixing of (seed, epoch, sample index): a sample gets the same
    # augmentation whatever batch, worker, loader or rank draws it, so results do not depend
    # on num_workers and a resumed epoch replays exactly. int64 products wrap on every device.
    base = ((seed * 1_000_003 + epoch) * 7919 + salt) * 0x632BE59BD9B4E019 % 2**63
    z = idx.long() + base
    for _ in range(2):
        z = (z ^ (z >> 31)) * 0x5851F42D4C957F2D
    return (z ^ (z >> 29)).abs()


def augment(x: Tensor, idx: Tensor, seed: int, epoch: int, pad: int, hflip: bool) -> Tensor:
    """Batched random crop with zero padding (and optional flip), on whatever device x is."""
    n, _, h, w = x.shape
    if pad:
        xp = F.pad(x, (pad, pad, pad, pad))
        dy = _hash(seed, epoch, idx, 1) % (2 * pad + 1)
        dx = _hash(seed, epoch, idx, 2) % (2 * pad + 1)
        rows = (dy[:, None] + torch.arange(h, device=x.device))[:, :, None]  # (N, H, 1)
        cols = (dx[:, None] + torch.arange(w, device=x.device))[:, None, :]  # (N, 1, W)
        x = xp[torch.arange(n, device=x.device)[:, None, None], :, rows, cols]  # (N, H, W, C)
        x = x.permute(0, 3, 1, 2)
    if hflip:
        flip = (_hash(seed, epoch, idx, 3) % 2).bool().view(-1, 1, 1, 1)
        x = torch.where(flip, x.flip(-1), x)
    return x.contiguous()


def epoch_order(n: int, seed: int, epoch: int) -> Tensor:
    """The sample order of one epoch, a pure function of (seed, epoch): resume needs no RNG state."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=g)


class IndexedDataset(torch.utils.data.Dataset):
    """Samples with their index, so augmentation can be keyed by it after the transfer."""

    def __init__(self, split: Split):
        self.x, self.y = split.x, split.y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, int]:
        return self.x[i], self.y[i], i


def rank_order(n: int, seed: int, epoch: int, shuffle: bool, rank: int = 0,
               world: int = 1) -> Tensor:
    """This process's share of the epoch order: every `world`-th sample from `rank`, after
    dropping the tail that does not divide evenly (every rank must take the same number of
    steps, or DDP waits forever). The ranks' k-th batches together are exactly the
    single-process k-th batch of the global batch size."""
    order = epoch_order(n, seed, epoch) if shuffle else torch.arange(n)
    return order[: n - n % world][rank::world]


class EpochSampler(torch.utils.data.Sampler[int]):
    """The device path's order for the DataLoader path (sharded like DistributedSampler, with
    drop_last); set_epoch works with persistent workers."""

    def __init__(self, n: int, seed: int, shuffle: bool = True, rank: int = 0, world: int = 1):
        self.n, self.seed, self.shuffle, self.rank, self.world = n, seed, shuffle, rank, world
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(rank_order(self.n, self.seed, self.epoch, self.shuffle, self.rank,
                               self.world).tolist())

    def __len__(self) -> int:
        return self.n // self.world
