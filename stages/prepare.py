"""Stage prepare: the data source in params.data -> data/prepared/ (uint8 splits + meta.json).

Sources: `digits` (scikit-learn, offline), `folder` (class sub-folders of images under
`data.root`, optionally already split into train/val/test), and the torchvision datasets
`cifar10`, `mnist`, `fashion_mnist` (downloaded into `data.root`).
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from pathlib import Path

from stages.config import load_params, run_stage
from stages.data import (
    SPLITS,
    Split,
    assign_splits,
    build_meta,
    decode_split,
    list_folder,
    load_digits,
    load_torchvision,
    resize,
    save_prepared,
    stratified_split,
)
from stages.files import write_csv
from stages.images import DataError

OUT = Path("data/prepared")


def from_arrays(x, y, cfg, seed: int, test=None) -> dict[str, Split]:
    """Resize, then split stratified; a dataset's own test split is kept as given."""
    x = resize(x, cfg.image_size, cfg.channels)
    parts = stratified_split(y, cfg.val_fraction, 0.0 if test else cfg.test_fraction, seed)
    splits = {name: Split(x[parts[name]], y[parts[name]]) for name in SPLITS}
    if test:
        splits["test"] = Split(resize(test.x, cfg.image_size, cfg.channels), test.y)
    return splits


def from_folder(cfg, seed: int) -> tuple[dict[str, Split], list[str], list, dict]:
    root = Path(cfg.root)
    classes, files = list_folder(root)
    items = assign_splits(classes, files, cfg.val_fraction, cfg.test_fraction, seed)
    workers = (os.cpu_count() or 1) if cfg.num_workers == "auto" else cfg.num_workers
    OUT.mkdir(parents=True, exist_ok=True)
    splits, rejected, seen = {}, [], defaultdict(list)
    for name in SPLITS:
        scratch = OUT / f".{name}.npy"
        splits[name], bad, accepted = decode_split(items[name], cfg, workers, scratch)
        rejected += bad
        for path, digest in accepted:
            seen[digest].append((name, path))
    total = sum(len(v) for v in items.values())
    if total and len(rejected) / total > cfg.max_rejected_fraction:
        listing = "; ".join(f"{p}: {r}" for p, r in rejected[:5])
        raise DataError(f"{len(rejected)} of {total} images in {root} could not be read "
                        f"({len(rejected) / total:.1%} > data.max_rejected_fraction "
                        f"{cfg.max_rejected_fraction}); first: {listing}")
    leaks = {d: v for d, v in seen.items() if len({s for s, _ in v}) > 1}
    return splits, classes, rejected, leaks


def main() -> None:
    params = load_params()
    cfg = params.data
    rejected, leaks = [], {}

    if cfg.source == "digits":
        x, y, classes = load_digits()
        splits = from_arrays(x, y, cfg, params.seed)
    elif cfg.source == "folder":
        splits, classes, rejected, leaks = from_folder(cfg, params.seed)
    else:
        parts, classes = load_torchvision(cfg.source, Path(cfg.root))
        splits = from_arrays(parts["train"].x, parts["train"].y, cfg, params.seed, parts["test"])

    meta = build_meta(splits, classes, cfg)
    meta["rejected"] = len(rejected)
    meta["duplicates_across_splits"] = len(leaks)
    save_prepared(OUT, splits, meta)
    write_csv(OUT / "rejected.csv", ["path", "reason"], rejected)
    write_csv(OUT / "leakage.csv", ["sha256", "split", "path"],
               [(d, s, p) for d, v in leaks.items() for s, p in v])
    for scratch in OUT.glob(".*.npy"):
        scratch.unlink()

    print(f"prepared {cfg.source}: " + ", ".join(f"{k} {v}" for k, v in meta["sizes"].items())
          + f"; {len(classes)} classes, {cfg.channels}x{cfg.image_size}x{cfg.image_size}")
    if rejected:
        print(f"warning: skipped {len(rejected)} unreadable files, listed in {OUT / 'rejected.csv'}",
              file=sys.stderr)
    if leaks:
        print(f"warning: {len(leaks)} identical files appear in more than one split (leakage), "
              f"listed in {OUT / 'leakage.csv'}", file=sys.stderr)


if __name__ == "__main__":
    run_stage(main)
