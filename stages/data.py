"""The prepared data's format, shared by every stage: uint8 splits (N, C, H, W) with labels, and
meta.json. Where it comes from is `sources.py` (the prepare stage); how training batches and
augments it is `batches.py`; which loader reads it is `resolve_loader`."""

from __future__ import annotations

import json
import math
import os
import pickle
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from stages.config import TrainConfig
from stages.lib import shards
from stages.lib.errors import KILLED_WORKER, UserError
from stages.lib.files import atomic_write_all, json_text, text_writer, torch_writer

SPLITS = ("train", "val", "test")


@runtime_checkable
class Images(Protocol):
    """A split's images as every loader, validation, evaluate and export read them: uint8
    (N, C, H, W); x[i], x[a:b] and x[indices] are those images as a tensor. A tensor is one;
    shards.ShardImages another, which also decodes and crops a sample for train.loader: stream."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    def __len__(self) -> int: ...
    def __getitem__(self, key: int | slice | Tensor) -> Tensor: ...


@dataclass
class Split:
    x: Images
    y: Tensor  # int64 (N,)
    format: str = "tensors"  # data.format as prepare wrote it: which loaders read x


def save_prepared(out: Path, splits: dict[str, Split], meta: dict,
                  texts: dict[str, str] | None = None) -> None:
    """The splits, meta.json and `texts` (name -> content) written all or none: a failed write
    must not leave new splits beside the previous meta.json."""
    writes: dict[Path, Callable[[Path], Any]] = {
        out / f"{name}.pt": torch_writer({"x": s.x, "y": s.y}) for name, s in splits.items()}
    writes[out / "meta.json"] = text_writer(json_text(meta))
    for name, text in (texts or {}).items():
        writes[out / name] = text_writer(text)
    atomic_write_all(writes)


def load_meta(prepared: Path) -> dict:
    path = Path(prepared) / "meta.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: missing; run `dvc repro prepare` first")
    return json.loads(path.read_text())


def load_split(prepared: Path, name: str) -> Split:
    """A split as prepare wrote it (data.format): its tensors, or its shards read as indexed."""
    meta = load_meta(prepared)
    if shards.is_sharded(Path(prepared), name) and meta.get("format") == "shards":
        x = shards.ShardImages(Path(prepared) / name, meta["channels"], meta["image_size"],
                               meta["resize"])
        return Split(x, checked_labels(x.labels(), len(meta["classes"]), x.folder / "index.npy"),
                     "shards")
    path = Path(prepared) / f"{name}.pt"
    if not path.exists():
        raise FileNotFoundError(f"{path}: missing; run `dvc repro prepare` first")
    # mmap: a large split is paged in as batches touch it, not read whole into memory.
    try:
        d = torch.load(path, weights_only=True, mmap=True)
        x, y = d["x"], d["y"]
    except (RuntimeError, OSError, EOFError, KeyError, TypeError, pickle.UnpicklingError) as e:
        raise UserError(f"{path}: unreadable ({type(e).__name__}: {str(e).splitlines()[0]}); "
                        f"restore it with `dvc checkout {prepared}` or rebuild it with "
                        "`dvc repro -f prepare`") from None
    return Split(x, checked_labels(y, len(meta["classes"]), path))


def checked_labels(y: Tensor, classes: int, path: Path) -> Tensor:
    """y, when every label is one of meta.json's classes; the first that is not fails here, named
    with its row, not as an index error in the loss."""
    bad = ((y < 0) | (y >= classes)).nonzero().flatten()
    if len(bad):
        row = int(bad[0])
        raise UserError(f"{path}: row {row} has label {int(y[row])}, and meta.json lists "
                        f"{classes} classes (labels 0 to {classes - 1}); rebuild it with `dvc "
                        "repro -f prepare`")
    return y


def resolve_loader(cfg: TrainConfig, splits: list[Split]) -> str:
    """train.loader, `auto` resolved: stream for shards; device for tensors within the budget."""
    sharded = splits[0].format == "shards"
    if cfg.loader == "auto" and not sharded:
        size_mb = sum(math.prod(s.x.shape) * s.x.dtype.itemsize for s in splits) / 2**20
        return "device" if size_mb <= cfg.device_data_budget_mb else "dataloader"
    if cfg.loader != "auto" and sharded != (cfg.loader == "stream"):
        held, reads = ("shards", "tensors") if sharded else ("tensors", "shards")
        raise UserError(f"params.yaml: train.loader={cfg.loader!r} reads {reads}, and "
                        f"data/prepared/ holds {held} (data.format); use train.loader: auto")
    return "stream" if sharded else cfg.loader


def resolve_workers(num_workers: int | str, local_world: int | None = None) -> int:
    """A process's DataLoader workers; `auto` shares the node's cores among the `local_world`
    training processes on it (torchrun's LOCAL_WORLD_SIZE): 8 ranks would otherwise fork 8
    each."""
    if num_workers != "auto":
        return int(num_workers)
    ranks = local_world or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # One core stays with each training process; more than 8 workers rarely pays for small images.
    return max(0, min(8, (os.cpu_count() or 1) // ranks - 1))


def in_batches(split: Split, batch_size: int, cfg: TrainConfig) -> Iterable[Tensor]:
    """The split's images in order, `batch_size` at a time, on every pass over it. A streamed
    split's (train.loader) are decoded by train.num_workers DataLoader processes, a batch each,
    kept up between passes: validation and evaluate would otherwise decode it on one core."""
    batches = _Batches(split.x, batch_size)
    if resolve_loader(cfg, [split]) != "stream" or not (workers := resolve_workers(cfg.num_workers)):
        return batches
    return WorkerBatches(torch.utils.data.DataLoader(batches, batch_size=None, num_workers=workers,
                                                     persistent_workers=True,
                                                     timeout=BATCH_TIMEOUT_S))


# A batch the workers have not handed over in this long is lost: a worker is stuck, or torch's
# hand-over failed inside one (out of descriptors, say), which only that worker's stderr shows,
# and the training process would wait for ever. Generous: the first batch starts the workers.
BATCH_TIMEOUT_S = 600


def from_workers(loader: torch.utils.data.DataLoader) -> Iterator:
    """A DataLoader's batches, a worker's error as one line: torch raises it again here with the
    worker's whole traceback as its message, and a batch that never came as a timeout."""
    try:
        yield from loader
    except Exception as e:
        lines = str(e).strip().splitlines()
        if len(lines) > 1 and lines[0].startswith("Caught ") and "DataLoader worker" in lines[0]:
            # The traceback's last line, "module.Name: message": this project's error by its
            # message alone, another's with its name.
            name, _, message = lines[-1].partition(": ")
            raise UserError(message if isinstance(e, UserError) else
                            f"a DataLoader worker failed: {name.rpartition('.')[2]}: {message}") \
                from None
        if isinstance(e, RuntimeError) and str(e).startswith("DataLoader timed out"):
            raise UserError(f"no batch from the DataLoader workers in {loader.timeout:g} s: one is "
                            "stuck or lost a batch (its error, if any, is above; `ulimit -n` too "
                            "low shows as 'Too many open files'); rerun, and training resumes "
                            "from its last checkpoint") from None
        if isinstance(e, EOFError | ConnectionError):
            # A worker killed as it handed a batch over: the batch's shared memory comes through
            # a connection to that worker, which broke before torch's own word for the death
            # (its SIGCHLD handler's error, raised wherever this process was, even inside a
            # tracking call that took it for its own failure).
            raise UserError(f"a DataLoader worker died handing a batch over ({type(e).__name__}); "
                            f"{KILLED_WORKER}") from None
        raise


@dataclass
class WorkerBatches:
    """A DataLoader's batches on every pass over them, a worker's error as one line."""
    loader: torch.utils.data.DataLoader

    def __iter__(self) -> Iterator:
        return from_workers(self.loader)


@dataclass
class _Batches(torch.utils.data.Dataset):
    x: Images
    size: int

    def __len__(self) -> int:
        return -(-len(self.x) // self.size)

    def __getitem__(self, k: int) -> Tensor:
        return self.x[k * self.size:(k + 1) * self.size]

    def __iter__(self) -> Iterator[Tensor]:
        return (self[k] for k in range(len(self)))


def normalize(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """uint8 (N, C, H, W) on any device to normalized float; mean/std shaped (C,)."""
    return (x.float().div_(255) - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)
