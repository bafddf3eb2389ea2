"""wids (WebDataset's indexed reader) against this repo's shard reader, on one prepared split.

    python -m reprotrain.bench.wids data/prepared/train [--workers 0 1 2] [--lru 10] [--nofile 64]

Both read the same tar files (prepare's are in WebDataset's layout) and decode with the same
function; each variant runs one shuffled epoch in a fresh process. Columns: the hash of the
(index, label, pixels) sequence, samples/s, peak RSS of the main process and of its largest
worker. `--damaged` instead reads a copy of the split whose second shard is cut in half.
wids is not a dependency: install it aside (docs/data.md) and put it on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from stages.batches import EpochSampler, StreamedDataset
from stages.data import Split
from stages.lib.images import decode_pixels, fit
from stages.lib.shards import ShardImages, shard_name

PIP = "pip install --target DIR wids==0.1.11 braceexpand, then PYTHONPATH=DIR"


def linked(split: Path, out: Path, damaged: bool) -> Path:
    """The split's files linked into `out`, with wids' JSON index: wids writes a `<shard>.lock`
    beside each shard it opens, which must not land in data/prepared (a DVC output). `damaged`:
    shard 1 a copy cut in half, as a disk or a copy can leave it."""
    out.mkdir()
    for path in split.iterdir():
        (out / path.name).symlink_to(path.resolve())
    if damaged:
        cut = (split / shard_name(1)).read_bytes()
        (out / shard_name(1)).unlink()
        (out / shard_name(1)).write_bytes(cut[:len(cut) // 2])
    counts = np.bincount(np.load(split / "index.npy")["shard"].astype(np.int64))
    (out / "wids.json").write_text(json.dumps({
        "__kind__": "wids-shard-index-v1", "wids_version": 1, "name": split.name,
        "shardlist": [{"url": shard_name(i), "nsamples": int(n)} for i, n in enumerate(counts)]}))
    return out


class Wids(torch.utils.data.Dataset):
    """wids.ShardListDataset, keyed and decoded as StreamedDataset without a crop: the image as
    ShardImages.decoded decodes it (decode_pixels, then fit), and the label in its `.cls`."""

    def __init__(self, folder: Path, meta: dict, lru: int):
        import wids  # main() checked it, with the pip line

        self.ds = wids.ShardListDataset(str(folder / "wids.json"), cache_dir=str(folder),
                                        lru_size=lru, transformations=[self.decode])
        self.meta = meta

    def decode(self, sample: dict) -> tuple[torch.Tensor, torch.Tensor]:
        img, _ = decode_pixels(sample[".png"].getvalue(), self.meta["channels"])
        return (torch.from_numpy(np.array(fit(img, self.meta["image_size"], self.meta["resize"]))),
                torch.tensor(int(sample[".cls"].read())))

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        return (*self.ds[key[0]], key[0])


def one(split: Path, reader: str, workers: int, lru: int, batch: int, damaged: bool) -> dict:
    """One epoch in this process (a fresh one per variant: peak RSS is per process)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = linked(split, Path(tmp) / split.name, damaged)
        meta = json.loads((split.parent / "meta.json").read_text())
        # train's own dataset (StreamedDataset over ShardImages) on the same linked files
        x = ShardImages(folder, meta["channels"], meta["image_size"], meta["resize"])
        ds = StreamedDataset(Split(x, x.labels()), seed=42) if reader == "repo" else Wids(folder, meta, lru)
        # train's (seed, epoch) sampler; in order for the damaged read
        sampler = EpochSampler(len(ds), seed=42, shuffle=not damaged, keyed=True)
        loader = torch.utils.data.DataLoader(ds, batch_size=batch, sampler=sampler,
                                             num_workers=workers)
        h, start = hashlib.sha256(), time.perf_counter()
        try:
            for x, y, i in loader:
                h.update(i.numpy().tobytes() + y.numpy().tobytes() + x.numpy().tobytes())
        except Exception as e:  # the last line of what the user reads
            return {"error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1][:200]}"}
        seconds = time.perf_counter() - start
    rss = [resource.getrusage(w).ru_maxrss / 1024 for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return {"hash": h.hexdigest()[:8], "per_s": len(ds) / seconds, "rss": rss[0],
            "worker_rss": rss[1] if workers else 0.0}


def run(args: argparse.Namespace, reader: str, workers: int, damaged: bool = False) -> dict:
    """`one` in a fresh interpreter, under `--nofile` when given."""
    def limit() -> None:
        if args.nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, args.nofile))

    cmd = [sys.executable, "-m", "reprotrain.bench.wids", str(args.split), "--one", reader,
           "--workers", str(workers), "--lru", str(args.lru), "--batch-size", str(args.batch_size)]
    got = subprocess.run(cmd + ["--damaged"] * damaged, capture_output=True, text=True,
                         preexec_fn=limit)
    if got.returncode:
        return {"error": (got.stderr.strip().splitlines() or ["?"])[-1][:160]}
    return json.loads(got.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m reprotrain.bench.wids", description=__doc__.split("\n")[0])
    ap.add_argument("split", type=Path, help="a split prepared as shards, e.g. data/prepared/train")
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--lru", type=int, default=10, help="wids' lru_size (its default: 10)")
    ap.add_argument("--nofile", type=int, default=0, help="run each variant under this ulimit -n")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--damaged", action="store_true")
    ap.add_argument("--one", choices=("repo", "wids"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.split, args.one, args.workers[0], args.lru, args.batch_size,
                             args.damaged)))
        return
    try:
        import wids
    except ImportError:
        sys.exit(f"error: wids is not importable; {PIP} (not a dependency of this project)")
    print(f"wids {wids.__version__}, torch {torch.__version__}, {args.split}, "
          f"{len(list(args.split.glob('shard-*.tar')))} shards, lru_size {args.lru}, "
          f"ulimit -n {args.nofile or resource.getrlimit(resource.RLIMIT_NOFILE)[0]}")
    if args.damaged:
        for reader in ("repo", "wids"):
            print(f"{reader}: {run(args, reader, 0, damaged=True).get('error', 'no error')}")
        return
    print("| reader | workers | round | order hash | samples/s | peak RSS MB | worker RSS MB |")
    print("|---|---|---|---|---|---|---|")
    for r in range(args.rounds):  # alternated: the machine's load drifts
        for workers in args.workers:
            for reader in ("repo", "wids"):
                g = run(args, reader, workers)
                row = [g.get("hash", "failed"), f"{g['per_s']:,.0f}", f"{g['rss']:.0f}",
                       f"{g['worker_rss']:.0f}"] if "hash" in g else [f"failed: {g['error']}", "", "", ""]
                print(f"| {reader} | {workers} | {r + 1} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
