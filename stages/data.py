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
    rest, test = train_test_split(idx, test_size=test_fraction, stratify=labels, random_state=seed)
    train, val = train_test_split(rest, test_size=val_fraction / (1 - test_fraction),
                                  stratify=labels[rest], random_state=seed)
    return {name: torch.from_numpy(np.sort(part)) for name, part in
            zip(SPLITS, (train, val, test), strict=True)}


def content_hash(splits: dict[str, Split]) -> str:
    h = hashlib.sha256()
    for name in SPLITS:
        h.update(splits[name].x.numpy().tobytes())
        h.update(splits[name].y.numpy().tobytes())
    return h.hexdigest()


def build_meta(splits: dict[str, Split], classes: list[str], cfg: DataConfig) -> dict:
    # Normalization statistics from the train split only: val/test must not leak into them.
    train = splits["train"].x.float().div(255)
    counts = {name: {c: int((s.y == i).sum()) for i, c in enumerate(classes)}
              for name, s in splits.items()}
    return {
        "source": cfg.source,
        "classes": classes,
        "channels": cfg.channels,
        "image_size": cfg.image_size,
        "mean": train.mean(dim=(0, 2, 3)).tolist(),
        "std": train.std(dim=(0, 2, 3)).clamp_min(1e-3).tolist(),
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
    d = torch.load(path, weights_only=True)
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


class EpochSampler(torch.utils.data.Sampler[int]):
    """The same (seed, epoch) order as the device path; set_epoch works with persistent workers."""

    def __init__(self, n: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle, self.epoch = n, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = epoch_order(self.n, self.seed, self.epoch) if self.shuffle else torch.arange(self.n)
        return iter(order.tolist())

    def __len__(self) -> int:
        return self.n
