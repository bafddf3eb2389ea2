"""Stage prepare: the data source in params.data -> data/prepared/ (uint8 splits + meta.json)."""

from __future__ import annotations

import sys
from pathlib import Path

from stages.config import ParamsError, load_params
from stages.data import (
    SPLITS,
    Split,
    build_meta,
    load_digits,
    resize,
    save_prepared,
    stratified_split,
)

OUT = Path("data/prepared")


def main() -> None:
    params = load_params()
    cfg = params.data

    x, y, classes = load_digits()
    x = resize(x, cfg.image_size, cfg.channels)
    parts = stratified_split(y, cfg.val_fraction, cfg.test_fraction, params.seed)
    splits = {name: Split(x[parts[name]], y[parts[name]]) for name in SPLITS}

    meta = build_meta(splits, classes, cfg)
    save_prepared(OUT, splits, meta)
    print(f"prepared {cfg.source}: " + ", ".join(f"{k} {v}" for k, v in meta["sizes"].items())
          + f"; {len(classes)} classes, {cfg.channels}x{cfg.image_size}x{cfg.image_size}")


if __name__ == "__main__":
    try:
        main()
    except ParamsError as e:
        sys.exit(f"error: {e}")
