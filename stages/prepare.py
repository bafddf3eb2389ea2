"""Stage prepare: the data source in params.data -> data/prepared/ (uint8 splits + meta.json).

The sources (`data.source`) are the registry in stages/sources.py. `--check [FOLDER]` only checks
an image folder's names and layout, before `dvc add` or `dvc repro` hash it (and fail or skip).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import filelock
import torch

from stages.config import PREPARED, DataConfig, Params, load_params
from stages.data import SPLITS, save_prepared
from stages.lib import images, shards
from stages.lib.cli import ArgumentParser, run_stage
from stages.lib.errors import UserError
from stages.lib.files import atomic_write_all, csv_text, json_text, text_writer
from stages.sources import (
    SOURCES,
    build_meta,
    check_rejected,
    from_folder,
    leaks_in,
    list_folder,
    meta_of,
    resize_line,
    sample_folder,
    split_folder,
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
    with only_one(PREPARED):
        meta, rejected, leaks = prepare(params)
    print(f"prepared {cfg.source}: " + ", ".join(f"{k} {v}" for k, v in meta["sizes"].items())
          + f"; {len(meta['classes'])} classes, {meta['channels']}x{cfg.image_size}x{cfg.image_size}")
    if rejected:
        print(f"warning: skipped {len(rejected)} unreadable files, listed in "
              f"{PREPARED / 'rejected.csv'}", file=sys.stderr)
    if leaks:
        print(f"warning: {len(leaks)} identical files appear in more than one split "
              f"(leakage), listed in {PREPARED / 'leakage.csv'}", file=sys.stderr)


def prepare(params: Params) -> tuple[dict, list, dict]:
    """params.data's source into PREPARED: its meta, the files rejected, the leaks."""
    cfg = params.data
    remove_scratch(PREPARED)  # a killed run's (kill -9, the OOM killer)
    check_partial(partial_of(PREPARED))
    # A folder listed once: at a million files the listing takes a while.
    folder = split_folder(cfg, params.seed) if cfg.source == "folder" else None
    count = sum(map(len, folder[1].values())) if folder else None
    if folder:  # said before the decoding, which takes a while
        sizes, colour = sample_folder(folder[1]["train"])
        if cfg.channels == "auto":
            cfg = replace(cfg, channels=3 if colour else 1)
            print(f"data.channels: auto -> {cfg.channels}: {'some' if colour else 'none'} of "
                  f"{sum(sizes.values())} images sampled hold colour", flush=True)
    fmt = resolve_format(cfg, count)
    if folder and (line := resize_line(cfg, sizes)):
        print(line, flush=True)
    if fmt == "tensors" and count is not None:
        check_memory(cfg, count)
    if fmt == "shards":
        return write_shards(cfg, PREPARED, *folder)
    try:
        loaded = from_folder(cfg, params.seed, PREPARED, folder) if folder is not None \
            else SOURCES[cfg.source](cfg, params.seed, PREPARED)
        if loaded.native and (line := resize_line(cfg, {loaded.native: 1})):
            print(line)
        meta = build_meta(loaded.splits, loaded.classes, cfg)
        if cfg.channels == "auto":
            print(f"data.channels: auto -> {meta['channels']}: the source's own")
        meta["rejected"] = len(loaded.rejected)
        meta["duplicates_across_splits"] = len(loaded.leaks)
        save_prepared(PREPARED, loaded.splits, meta, reports(loaded.rejected, loaded.leaks))
        for name in SPLITS:  # an earlier run's shards would be read before these tensors
            shards.remove(PREPARED / name)
        shutil.rmtree(partial_of(PREPARED), ignore_errors=True)
        return meta, loaded.rejected, loaded.leaks
    finally:  # also on a failure: the folder source's memory-mapped decode files can be large
        remove_scratch(PREPARED)


def only_one(out: Path) -> filelock.AcquireReturnProxy:
    """A lock beside `out`, held by one prepare at a time (`with`): a second would write the
    same files as the first, and delete its scratch files. An OS lock (flock): the kernel
    releases it when its holder dies."""
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(out.with_name(f".{out.name}.lock"))
    try:
        return lock.acquire(timeout=0)
    except filelock.Timeout:
        raise UserError(f"{out}: another prepare is writing it (it holds {lock.lock_file}); wait "
                        "for it to end, or stop it, then rerun") from None


def remove_scratch(out: Path) -> None:
    """The decode's memory-mapped files (sources.decode_split) and half-written outputs in `out`:
    a run removes its own when done, the next run those of one that was killed."""
    for path in [*out.glob(".*.npy"), *out.glob(".*.tmp.*")]:
        path.unlink()


def reports(rejected: list[tuple[str, str]], leaks: dict[str, list[tuple[str, str]]]) -> dict[str, str]:
    return {"rejected.csv": csv_text(["path", "reason"], rejected),
            "leakage.csv": csv_text(["sha256", "split", "path"],
                                    [(d, s, p) for d, v in leaks.items() for s, p in v])}


def resolve_format(cfg: DataConfig, images: int | None) -> str:
    """data.format: auto writes shards where the decoded splits would take more than half the
    memory available now, and says which it picked and why (for a folder; the other sources are
    datasets of a few hundred MB, always tensors)."""
    if cfg.format != "auto" or images is None:
        return "tensors" if cfg.format == "auto" else cfg.format
    decoded = images * cfg.channels * cfg.image_size ** 2
    available = memory_available()
    picked = "shards" if decoded > available / 2 else "tensors"
    print(f"data.format: auto -> {picked}: decoded, the splits take {decoded / 2**20:,.0f} MiB, "
          f"{'over' if picked == 'shards' else 'within'} half of the {available / 2**30:,.1f} "
          "GiB of memory available", flush=True)
    return picked


def memory_available() -> int:
    """Bytes of memory this process can take without swapping or being killed: the kernel's
    MemAvailable (free memory and the page cache it can drop), or less where a memory cgroup it
    runs in (a container, a SLURM job, `systemd-run -p MemoryMax`) has less left."""
    try:
        with open("/proc/meminfo") as f:
            host = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min([host, *cgroup_memory_left()])


def cgroup_memory_left(proc: Path = Path("/proc/self")) -> list[int]:
    """What each memory cgroup enclosing the process `proc` leaves, from its own to the root of
    its hierarchy (a parent's limit binds its children): the limit (v1's memory.limit_in_bytes,
    v2's memory.max) less the usage, the page cache it can drop counted free, as MemAvailable
    counts it."""
    left = []
    for folder in cgroup_folders("memory", proc):
        for limit, usage, cache in (("memory.max", "memory.current", "inactive_file"),
                                    ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                     "total_inactive_file")):
            try:
                bound = (folder / limit).read_text().strip()
                used = int((folder / usage).read_text())
                stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines())
            except (OSError, ValueError):
                continue
            if bound != "max":
                left.append(max(0, int(bound) - used + int(stat.get(cache, 0))))
    return left


def cgroup_folders(controller: str, proc: Path = Path("/proc/self")) -> list[Path]:
    """The folders of the cgroups (v1's of `controller`, and v2's) that `proc` runs in and
    their ancestors, innermost first: /proc/PID/cgroup names the cgroup, mountinfo where its
    hierarchy is mounted (a container's mount starts at its own cgroup)."""
    try:
        groups = [line.split(":", 2) for line in (proc / "cgroup").read_text().splitlines()]
        mounts = [line.split(" - ") for line in (proc / "mountinfo").read_text().splitlines()]
    except OSError:  # not Linux
        return []
    folders = []
    for _, controllers, path in groups:
        for fields, fs in ((m[0].split(), m[1].split()) for m in mounts if len(m) == 2):
            v1 = fs[0] == "cgroup" and controller in fs[2].split(",") and \
                controller in controllers.split(",")
            if v1 or (fs[0] == "cgroup2" and not controllers):
                root, top = fields[3], Path(fields[4])
                folder = top / (Path(path).relative_to(root) if Path(path).is_relative_to(root)
                                else "")
                folders += [folder, *[p for p in folder.parents if p.is_relative_to(top)]]
                break
    return folders


def check_memory(cfg: DataConfig, images: int) -> None:
    """Decoded splits larger than memory, refused before any image is read: every epoch would
    read them from disk at random. Their scratch file's blocks are reserved before they are
    decoded into it (sources.decode_split), so a full disk stops them at once too."""
    decoded = images * cfg.channels * cfg.image_size ** 2
    if decoded > (available := memory_available()):
        raise UserError(f"{cfg.root}: decoded at data.image_size {cfg.image_size}, the "
                        f"{images:,} images take {decoded / 2**30:,.1f} GiB, more than the "
                        f"{available / 2**30:,.1f} GiB of memory available; set data.format: "
                        "shards (or auto) in params.yaml to keep them encoded and stream them")


def check_disk(cfg: DataConfig, images: int, need: int, out: Path) -> None:
    """Shards larger than the disk's free space, refused before any image is read; a killed
    run's shards count as written. `need`: the files' bytes, as they are or downsized."""
    partial = partial_of(out)
    written = sum(f.stat().st_size for f in partial.rglob("*") if f.is_file()) \
        if partial.is_dir() else 0
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if need - written > free:
        raise UserError(f"{out}: shards of the {images:,} images in {cfg.root} need about "
                        f"{(need - written) / 2**20:,.1f} MiB more, and its file system has "
                        f"{free / 2**20:,.1f} MiB free; free space there, or lower "
                        "data.store_size in params.yaml")


def partial_of(out: Path) -> Path:
    """Where shards are written before they move into `out`: DVC deletes a stage's outputs
    before it runs, so a killed run's whole shards wait here for the next."""
    return out.with_name(f".{out.name}.partial")


def check_partial(partial: Path) -> None:
    """prepare deletes its partial folder when it is done with it, or when it holds another
    run's shards: only one it made, which holds the `key` it writes there."""
    if partial.exists() and not (partial / "key").is_file():
        raise UserError(f"{partial}: prepare keeps a killed run's shards under this name, and "
                        "this is not one of its folders (it has no `key` file); move it away, "
                        "then rerun")


def fingerprint(items: dict[str, images.Files], cfg: DataConfig) -> tuple[str, int]:
    """One stat of every file gives what a killed run's shards are good for, the key (the same
    files, by name, size and time, in the same splits; the params that shape a shard; the code
    that writes one), and the files' bytes, what the shards need at most."""
    h = hashlib.sha256(json.dumps([cfg.channels, cfg.image_size, cfg.resize, cfg.store_size,
                                   cfg.shard_mb]).encode())
    for module in (shards, images):
        h.update(Path(module.__file__).read_bytes())
    size = 0
    for name in SPLITS:
        for path, label in items[name]:
            st = os.stat(path)
            size += st.st_size
            h.update(f"{name}\0{path}\0{label}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest(), size


def write_shards(cfg: DataConfig, out: Path, classes: list[str],
                 items: dict[str, images.Files]) -> tuple[dict, list, dict]:
    """The folder's splits (split_folder's) as shards (stages/lib/shards.py), with meta.json and
    the reports. Written in partial_of(out) first, and resumed there after a kill."""
    (key, need), partial = fingerprint(items, cfg), partial_of(out)
    check_disk(cfg, sum(map(len, items.values())), need, out)
    if not (partial / "key").is_file() or (partial / "key").read_text() != key:
        shutil.rmtree(partial, ignore_errors=True)  # another run's: other files or params
        partial.mkdir(parents=True)
        (partial / "key").write_text(key)
    written, rejected = {}, []
    for name in SPLITS:
        written[name] = shards.write_split(partial / name, items[name], cfg.channels,
                                           cfg.image_size, cfg.resize, cfg.store_size,
                                           cfg.shard_mb * 2**20, cfg.workers)
        if written[name].resumed:
            print(f"prepare: {name}: resumed after the {written[name].resumed} whole shards a "
                  f"killed run left in {partial / name}", flush=True)
        rejected += written[name].rejected
    check_rejected(rejected, sum(len(v) for v in items.values()), cfg)
    leaks = leaks_in(items, {name: (w.accepted, w.digests) for name, w in written.items()})
    total, squares = torch.from_numpy(written["train"].sums)
    meta = meta_of(total, squares, len(written["train"].index) * cfg.image_size ** 2,
                   {name: torch.from_numpy(w.index["label"]) for name, w in written.items()},
                   classes, cfg, shards.digest(partial / name for name in SPLITS))
    meta |= {"format": "shards", "store_size": cfg.store_size,
             "shards": {name: len(list((partial / name).glob("shard-*.tar"))) for name in SPLITS},
             "rejected": len(rejected), "duplicates_across_splits": len(leaks)}
    for name in SPLITS:
        shards.remove(out / name)
        shards.moved(partial / name, out / name)
        (out / f"{name}.pt").unlink(missing_ok=True)  # an earlier run's tensors, of another format
    atomic_write_all({out / "meta.json": text_writer(json_text(meta))}
                     | {out / k: text_writer(v) for k, v in reports(rejected, leaks).items()})
    shutil.rmtree(partial)
    return meta, rejected, leaks


if __name__ == "__main__":
    run_stage(main)
