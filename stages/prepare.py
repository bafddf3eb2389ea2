"""Stage prepare: the data source in params.data -> data/prepared/ (uint8 splits + meta.json).

The sources (`data.source`) are the registry in stages/sources.py. `--check [FOLDER]` only checks
an image folder's names and layout, before `dvc add` or `dvc repro` hash it (and fail or skip).
"""

from __future__ import annotations

import sys
from pathlib import Path

from stages.config import PREPARED, load_params
from stages.data import save_prepared
from stages.lib.cli import ArgumentParser, run_stage
from stages.lib.files import csv_text
from stages.sources import SOURCES, build_meta, list_folder


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
    try:
        loaded = SOURCES[cfg.source](cfg, params.seed, PREPARED)
        meta = build_meta(loaded.splits, loaded.classes, cfg)
        meta["rejected"] = len(loaded.rejected)
        meta["duplicates_across_splits"] = len(loaded.leaks)
        save_prepared(PREPARED, loaded.splits, meta, {
            "rejected.csv": csv_text(["path", "reason"], loaded.rejected),
            "leakage.csv": csv_text(["sha256", "split", "path"],
                                    [(d, s, p) for d, v in loaded.leaks.items() for s, p in v])})
    finally:  # also on a failure: the folder source's memory-mapped decode files can be large
        for scratch in PREPARED.glob(".*.npy"):
            scratch.unlink()

    print(f"prepared {cfg.source}: " + ", ".join(f"{k} {v}" for k, v in meta["sizes"].items())
          + f"; {len(loaded.classes)} classes, {cfg.channels}x{cfg.image_size}x{cfg.image_size}")
    if loaded.rejected:
        print(f"warning: skipped {len(loaded.rejected)} unreadable files, listed in "
              f"{PREPARED / 'rejected.csv'}", file=sys.stderr)
    if loaded.leaks:
        print(f"warning: {len(loaded.leaks)} identical files appear in more than one split "
              f"(leakage), listed in {PREPARED / 'leakage.csv'}", file=sys.stderr)


if __name__ == "__main__":
    run_stage(main)
