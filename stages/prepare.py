"""Stage prepare: the data source in params.data -> data/prepared/ (uint8 splits + meta.json).

The sources (`data.source`) are the registry in stages/sources.py. `--check [FOLDER]` only checks
an image folder's names and layout, before `dvc add` or `dvc repro` hash it (and fail or skip).
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from pathlib import Path

import torch

from stages.config import PREPARED, DataConfig, load_params
from stages.data import SPLITS, save_prepared
from stages.lib import shards
from stages.lib.cli import ArgumentParser, run_stage
from stages.lib.files import atomic_write_all, csv_text, json_text, text_writer
from stages.sources import (
    SOURCES,
    assign_splits,
    build_meta,
    check_rejected,
    leaks_in,
    list_folder,
    meta_of,
)


def main() -> None:
    ap = ArgumentParser(prog="python -m stages.prepare", description=__doc__.split("\n")[0])
    ap.add_argument("--check", nargs="?", const="", metavar="FOLDER",
                    help="check the names and layout of an image folder (default: data.root) "
                         "before `dvc add` or `dvc repro` hash it; reads no image, writes nothing")
    args = ap.parse_args()
    params = load_params()
    cfg = params.data
    if args.check is not None:
        if not args.check and cfg.source != "folder":
            print(f"data.source={cfg.source}: nothing to check (only a folder source is)")
            return
        root = args.check or cfg.root
        classes, files = list_folder(Path(root))
        print(f"{root}: {len(classes)} classes, {sum(map(len, files.values()))} image files; "
              "names and layout are fine")
        return
    # A folder listed once: at a million files the listing takes a while.
    listing = list_folder(Path(cfg.root)) if cfg.source == "folder" and cfg.format != "tensors" \
        else None
    if resolve_format(cfg, listing) == "shards":
        meta, rejected, leaks = write_shards(cfg, params.seed, PREPARED, *listing)
    else:
        try:
            loaded = SOURCES[cfg.source](cfg, params.seed, PREPARED)
            meta = build_meta(loaded.splits, loaded.classes, cfg)
            rejected, leaks = loaded.rejected, loaded.leaks
            meta["rejected"] = len(rejected)
            meta["duplicates_across_splits"] = len(leaks)
            save_prepared(PREPARED, loaded.splits, meta, reports(rejected, leaks))
            for name in SPLITS:  # an earlier run's shards would be read before these tensors
                shards.remove(PREPARED / name)
        finally:  # also on a failure: the folder source's memory-mapped decode files can be large
            for scratch in PREPARED.glob(".*.npy"):
                scratch.unlink()

    print(f"prepared {cfg.source}: " + ", ".join(f"{k} {v}" for k, v in meta["sizes"].items())
          + f"; {len(meta['classes'])} classes, {cfg.channels}x{cfg.image_size}x{cfg.image_size}")
    if rejected:
        print(f"warning: skipped {len(rejected)} unreadable files, listed in "
              f"{PREPARED / 'rejected.csv'}", file=sys.stderr)
    if leaks:
        print(f"warning: {len(leaks)} identical files appear in more than one split "
              f"(leakage), listed in {PREPARED / 'leakage.csv'}", file=sys.stderr)


def reports(rejected: list[tuple[str, str]], leaks: dict[str, list[tuple[str, str]]]) -> dict[str, str]:
    return {"rejected.csv": csv_text(["path", "reason"], rejected),
            "leakage.csv": csv_text(["sha256", "split", "path"],
                                    [(d, s, p) for d, v in leaks.items() for s, p in v])}


def resolve_format(cfg: DataConfig, listing: tuple[list[str], dict] | None) -> str:
    """data.format: auto writes shards where the decoded splits would take more than half the
    memory available now, and says which it picked and why (for a folder; the other sources are
    datasets of a few hundred MB, always tensors)."""
    if cfg.format != "auto" or listing is None:
        return "tensors" if cfg.format == "auto" else cfg.format
    _, files = listing
    decoded = sum(map(len, files.values())) * cfg.channels * cfg.image_size ** 2
    available = memory_available()
    picked = "shards" if decoded > available / 2 else "tensors"
    print(f"data.format: auto -> {picked}: decoded, the splits take {decoded / 2**20:,.0f} MiB, "
          f"{'over' if picked == 'shards' else 'within'} half of the {available / 2**30:,.1f} "
          "GiB of memory available", flush=True)
    return picked


def memory_available() -> int:
    """Bytes of memory available without swapping: the kernel's MemAvailable (free memory and
    the page cache it can drop), where there is one."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def write_shards(cfg: DataConfig, seed: int, out: Path, classes: list[str],
                 files: dict) -> tuple[dict, list, dict]:
    """The folder's splits as shards (stages/lib/shards.py), with meta.json and the reports."""
    items = assign_splits(classes, files, cfg.val_fraction, cfg.test_fraction, seed)
    workers = (os.cpu_count() or 1) if cfg.num_workers == "auto" else cfg.num_workers
    written, rejected, seen = {}, [], defaultdict(list)
    for name in SPLITS:
        written[name] = shards.write_split(out / name, items[name], cfg.channels, cfg.image_size,
                                           cfg.resize, cfg.store_size, workers)
        rejected += written[name].rejected
        for path, digest in written[name].accepted:
            seen[digest].append((name, path))
    check_rejected(rejected, sum(len(v) for v in items.values()), cfg)
    leaks = leaks_in(seen)
    total, squares = torch.from_numpy(written["train"].sums)
    meta = meta_of(total, squares, len(written["train"].index) * cfg.image_size ** 2,
                   {name: torch.from_numpy(w.index["label"]) for name, w in written.items()},
                   classes, cfg, shards.digest(out / name for name in SPLITS))
    meta |= {"format": "shards", "store_size": cfg.store_size,
             "shards": {name: len(list((out / name).glob("shard-*.tar"))) for name in SPLITS},
             "rejected": len(rejected), "duplicates_across_splits": len(leaks)}
    atomic_write_all({out / "meta.json": text_writer(json_text(meta))}
                     | {out / k: text_writer(v) for k, v in reports(rejected, leaks).items()})
    for name in SPLITS:  # an earlier run's tensors, of another format
        (out / f"{name}.pt").unlink(missing_ok=True)
    return meta, rejected, leaks


if __name__ == "__main__":
    run_stage(main)
