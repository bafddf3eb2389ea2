"""python -m reprotrain.bench.data [--sizes 10000,100000,1000000] [--no-s3] (`make bench-data
SIZES=...`): shards at scale (docs/data.md, "Datasets larger than memory"), one row per dataset
size N, each size made, measured and deleted before the next. Its table and a JSON of every
measurement go to bench/data/. The columns of a row:
- the JPEGs: N synthetic ones in 10 class folders (sides of 64-256 px, quality 85, a stripe
  orientation and tint per class, a function of `--seed`), their bytes and the seconds 2
  processes took to write them;
- `python -m stages.prepare` with `data.format: shards` (2 workers, `data.image_size: 32`):
  seconds, peak memory of it and its workers (sampled every 0.2 s: the sums of their PSS and of
  its anonymous part; the main process's own peak RSS), the bytes and files of data/prepared;
  the same for `data.format: tensors` where the decoded split takes under a quarter of the
  memory available;
- DVC: `dvc add data/prepared` (`cache.type: hardlink`: a million images take two copies of the
  disk, not four), then `dvc push` and, the cache and data/prepared deleted, `dvc pull`, to a
  folder remote and to S3 on loopback (SeaweedFS, `make s3`'s): seconds and objects;
- training samples/s and peak PSS, `--rounds` rounds alternating the variants, each in a
  process of its own (with its DataLoader workers; the load average before it is in the JSON):
  `--steps` steps of `--batch` after `--warmup`, the `cnn` (width 16, fp32, AdamW,
  channels_last), of
  - stream: train's loader over the shards (`loader_batches`: `StreamedDataset`'s
    random-resized crop in the workers), then `augment`'s flip and `normalize`;
  - imagefolder: `torchvision.datasets.ImageFolder` over the JPEGs, v2's RandomResizedCrop(32,
    scale 0.35-1) and flip, the same DataLoader settings;
  - tensors: the tensors prepared above through `device_batches`, the same flip.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from multiprocessing import Pool
from pathlib import Path

import numpy as np

from reprotrain.bench.pipeline import timed
from reprotrain.bench.storage import dvc

ROOT = Path(__file__).resolve().parents[2]
CLASSES, BUCKET = 10, "bench"
VARIANTS = ("stream", "imagefolder", "tensors")
KNOBS = {"image-size": 32, "rounds": 3, "steps": 30, "warmup": 5, "batch": 128, "workers": 2,
         "seed": 0}


def draw(root: Path, seed: int, i: int) -> int:
    """Image i written, a function of (seed, i); returns its bytes."""
    from PIL import Image

    rng = np.random.default_rng([seed, i])
    c = i % CLASSES
    w, h = rng.integers(64, 257, 2)
    angle = np.pi * c / CLASSES + rng.normal(0, 0.05)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    stripes = np.sin((xx * np.cos(angle) + yy * np.sin(angle)) * rng.uniform(0.15, 0.35)
                     + rng.uniform(0, 2 * np.pi))
    tint = np.array([c * 37 % 256, (c * 91 + 60) % 256, (c * 151 + 120) % 256], np.float32)
    # Light noise: at quality 85 heavier noise doubles the JPEGs, and 1M of them must fit.
    pixels = 128 + 0.4 * (tint - 128) + 60 * stripes[..., None] + rng.normal(0, 4, (h, w, 3))
    path = root / f"class{c}" / f"{i:07d}.jpg"
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path, "JPEG", quality=85)
    return path.stat().st_size


def generate(root: Path, n: int, seed: int) -> dict:
    for c in range(CLASSES):
        (root / f"class{c}").mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with Pool(2) as pool:
        size = sum(pool.imap_unordered(functools.partial(draw, root, seed), range(n), 512))
    return {"gen_s": time.perf_counter() - start, "bytes": size}


class Peak(threading.Thread):
    """Peak memory of a process and its descendants, sampled every 0.2 s: the sums of their
    RSS, PSS (a page shared by n of them counted 1/n in each: forked workers share most of
    theirs) and anonymous PSS, and the top process's own peak RSS (VmHWM, exact)."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.done = pid, threading.Event()
        self.peak = dict.fromkeys(("Rss", "Pss", "Pss_Anon", "VmHWM"), 0)

    def run(self) -> None:
        import psutil

        top = psutil.Process(self.pid)
        while not self.done.is_set():
            now = dict.fromkeys(self.peak, 0)
            try:
                for p in [top, *top.children(recursive=True)]:
                    text = Path(f"/proc/{p.pid}/smaps_rollup").read_text()
                    if p.pid == self.pid:
                        text += Path(f"/proc/{p.pid}/status").read_text()
                    for line in text.splitlines():
                        key, _, value = line.partition(":")
                        if key in now:
                            now[key] += int(value.split()[0]) * 1024
            except (psutil.Error, OSError, IndexError):
                pass  # a worker that exited between the listing and the read
            self.peak = {k: max(v, now[k]) for k, v in self.peak.items()}
            self.done.wait(0.2)


def measured(argv: list[str], cwd: Path, env: dict[str, str]) -> dict:
    """Seconds, stdout and peak memory of a command; a failure stops the bench with its output."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    peak = Peak(proc.pid)
    peak.start()
    out, err = proc.communicate()
    seconds = time.perf_counter() - start
    peak.done.set()
    peak.join()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed (exit {proc.returncode}):\n{out[-3000:]}\n"
                           f"{err[-3000:]}")
    return {"s": seconds, "rss": peak.peak["Rss"], "pss": peak.peak["Pss"],
            "anon": peak.peak["Pss_Anon"], "hwm": peak.peak["VmHWM"], "out": out}


def tree(folder: Path) -> tuple[int, int]:
    files = [p for p in folder.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def prepare(ws: Path, raw: Path, fmt: str, image_size: int, env: dict[str, str]) -> dict:
    """A workspace of the committed params.yaml, prepared from `raw` in format `fmt`."""
    import yaml

    from stages.lib.strict_yaml import read_yaml

    ws.mkdir(parents=True)
    (ws / "params.yaml").write_text(subprocess.run(
        ["git", "show", "HEAD:params.yaml"], cwd=ROOT, check=True, capture_output=True,
        text=True).stdout)
    params = read_yaml(ws / "params.yaml")
    params["data"] |= {"source": "folder", "root": str(raw), "format": fmt, "channels": 3,
                       "image_size": image_size, "num_workers": 2}
    (ws / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    got = measured([sys.executable, "-m", "stages.prepare"], ws, env)
    files, size = tree(ws / "data/prepared")
    return {**got, "out": got["out"][-500:], "files": files, "bytes": size}


def remotes(ws: Path, tmp: Path, env: dict[str, str], s3: bool) -> dict:
    """data/prepared added, then pushed to and pulled from each remote in turn."""
    from reprotrain.team import s3 as s3_server

    timed(dvc("init", "--no-scm", "-q"), ws, env)
    timed(dvc("config", "cache.type", "hardlink"), ws, env)
    expected = tree(ws / "data/prepared")
    got = {"add_s": timed(dvc("add", "data/prepared"), ws, env)[0]}
    timed(dvc("remote", "add", "folder", str(tmp / "remote")), ws, env)
    server = s3_server.start(tmp / "s3", buckets=(BUCKET,)) if s3 else None
    try:
        if server:
            env = env | server.env()
            timed(dvc("remote", "add", "s3", f"s3://{BUCKET}/dvc"), ws, env)
            timed(dvc("remote", "modify", "s3", "endpointurl", server.endpoint), ws, env)
        for name in ("folder", "s3") if server else ("folder",):
            got[f"push_{name}_s"] = timed(dvc("push", "-r", name), ws, env)[0]
            got[f"objects_{name}"] = tree(tmp / "remote")[0] if name == "folder" else \
                s3_objects(server)
            shutil.rmtree(ws / ".dvc/cache")
            shutil.rmtree(ws / "data/prepared")
            got[f"pull_{name}_s"] = timed(dvc("pull", "-r", name), ws, env)[0]
            if tree(ws / "data/prepared") != expected:
                raise RuntimeError(f"`dvc pull` from the {name} remote restored other files")
            shutil.rmtree(tmp / "remote", ignore_errors=True)  # the disk: one copy at a time
    finally:
        if server:
            s3_server.stop(server)
            shutil.rmtree(tmp / "s3", ignore_errors=True)
    return got


def s3_objects(server) -> int:
    import boto3

    client = boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1",
                          aws_access_key_id=server.access_key,
                          aws_secret_access_key=server.secret_key)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
    return sum(page.get("KeyCount", 0) for page in pages)


def batches(variant: str, prepared: Path, raw: Path, batch: int, workers: int, seed: int):
    """Normalized (x, y) batches for ever, as train makes them (loop.py's forward_backward)."""
    import torch
    from torchvision import datasets
    from torchvision.transforms import v2

    from stages.batches import augment, device_batches, loader_batches, plan_batches
    from stages.data import load_meta, load_split, normalize

    meta, cpu = load_meta(prepared), torch.device("cpu")
    mean, std = torch.tensor(meta["mean"]), torch.tensor(meta["std"])
    if variant == "imagefolder":
        crop = v2.Compose([v2.RandomResizedCrop(32, scale=(0.35, 1.0)), v2.RandomHorizontalFlip(),
                           v2.ToImage(), v2.ToDtype(torch.float32, scale=True)])
        dl = torch.utils.data.DataLoader(
            datasets.ImageFolder(str(raw), transform=crop), batch_size=batch, shuffle=True,
            num_workers=workers, pin_memory=False, persistent_workers=workers > 0,
            prefetch_factor=4 if workers else None, drop_last=True,
            generator=torch.Generator().manual_seed(seed))
        while True:
            for x, y in dl:
                yield (x - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1), y
    split = load_split(prepared, "train")
    plan = plan_batches(len(split.y), batch, 1, 1)
    args = (split, plan, cpu, seed, True, 0, 1)
    # The stream's crop as imagefolder's (train.augment_crop_scale: [0.35, 1.0]).
    source = device_batches(*args) if variant == "tensors" else \
        loader_batches(*args, workers, ((0.35, 1.0), (3 / 4, 4 / 3)), streamed=True)
    for epoch in itertools.count():
        for x, y, idx in source(epoch):
            yield normalize(augment(x, idx, seed, epoch, 0, True), mean, std), y


def train_variant(a: argparse.Namespace) -> dict:
    import torch

    from stages.config import ModelConfig
    from stages.models import build_model, loss_fn

    torch.manual_seed(a.seed)
    model = build_model(ModelConfig(arch="cnn", width=16), 3, CLASSES, a.image_size)
    model = model.to(memory_format=torch.channels_last).train()
    opt, criterion = torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn()
    source = batches(a.variant, a.prepared, a.raw, a.batch, a.workers, a.seed)
    for step in range(a.warmup + a.steps):
        if step == a.warmup:  # the workers' start and first batches are behind us
            start, cpu = time.perf_counter(), cpu_seconds()
        x, y = next(source)
        loss = criterion(model(x.contiguous(memory_format=torch.channels_last)), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    n = a.steps * a.batch
    return {"samples_s": n / (time.perf_counter() - start),
            "cpu_ms": (cpu_seconds() - cpu) * 1000 / n}


def cpu_seconds() -> float:
    """CPU time of this process and its workers: unlike samples/s, it hardly moves when a
    neighbour takes cores."""
    import psutil

    me = psutil.Process()
    return sum(sum(p.cpu_times()[:2]) for p in [me, *me.children(recursive=True)])


def throughput(prepared: dict[str, Path], raw: Path, a: argparse.Namespace,
               env: dict[str, str]) -> dict:
    runs: dict[str, list] = {v: [] for v in prepared}
    for r in range(a.rounds):
        order = list(prepared)[r % len(prepared):] + list(prepared)[:r % len(prepared)]
        for v in order:  # rotated: a busy neighbour slows no variant alone
            argv = [sys.executable, "-m", "reprotrain.bench.data", f"--variant={v}",
                    f"--prepared={prepared[v]}", f"--raw={raw}",
                    *(f"--{k}={getattr(a, k.replace('-', '_'))}" for k in KNOBS)]
            load = os.getloadavg()[0]  # the machine is shared: a figure comes with its load
            got = measured(argv, ROOT, env)
            speed = json.loads(got.pop("out").splitlines()[-1])
            runs[v].append({**got, **speed, "load": load})
            say(f"    round {r + 1} {v}: {runs[v][-1]['samples_s']:.0f} samples/s, peak PSS "
                f"{mb(got['pss'])}, load {load:.1f}")
    return runs


def one_size(n: int, tmp: Path, a: argparse.Namespace, env: dict[str, str]) -> dict:
    raw = tmp / "raw"
    row: dict = {"images": n, **generate(raw, n, a.seed)}
    say(f"  {n}: generated {mb(row['bytes'])} in {row['gen_s']:.0f} s")
    row["shards"] = prepare(tmp / "shards", raw, "shards", a.image_size, env)
    say(f"  {n}: shards prepared in {row['shards']['s']:.0f} s")
    # ImageFolder reads the JPEGs; the shards' meta.json gives it the same mean and std.
    prepared = dict.fromkeys(("stream", "imagefolder"), tmp / "shards/data/prepared")
    # Tensors only where the decoded split sits in memory with room to spare.
    from stages.prepare import memory_available

    if n * 3 * a.image_size ** 2 < memory_available() / 4:
        row["tensors"] = prepare(tmp / "tensors", raw, "tensors", a.image_size, env)
        prepared["tensors"] = tmp / "tensors/data/prepared"
    row["train"] = throughput(prepared, raw, a, env)
    shutil.rmtree(raw)  # the JPEGs: no copy of them is needed past training, and disk is tight
    shutil.rmtree(tmp / "tensors", ignore_errors=True)
    row["dvc"] = remotes(tmp / "shards", tmp, env, a.s3)
    return row


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def mb(b: float) -> str:
    return f"{b / 2**30:.2f} GB" if b >= 2**30 else f"{b / 2**20:.0f} MB"


def speeds(runs: list[dict]) -> str:
    xs = [r["samples_s"] for r in runs]
    spread = f" ({min(xs):,.0f}-{max(xs):,.0f})" if len(xs) > 1 else ""
    return f"{statistics.median(xs):,.0f}{spread}"


def memory(m: dict) -> str:
    return f"{m['s']:.0f} s, {mb(m['pss'])} / {mb(m['anon'])} ({mb(m['hwm'])})"


def markdown(report: dict) -> str:
    head = ["images", "JPEGs, generated in", "prepare shards: time, PSS / anon (main's RSS)",
            "shards", "prepare tensors", "dvc add", "folder: push / pull (objects)",
            "S3: push / pull", "stream img/s", "ImageFolder img/s", "stream / ImageFolder",
            "tensors img/s", "CPU ms per sample: stream / ImageFolder / tensors",
            "train PSS: stream / ImageFolder / tensors"]
    lines = [f"`make bench-data`: {report['cpu']}, {report['date']} (UTC), load "
             f"{report['load']:.1f} at the start; {report['rounds']} rounds of {report['steps']} "
             f"steps of {report['batch']}, {report['workers']} workers, median (min-max); memory: "
             "peaks summed over the process and its workers.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["rows"]:
        d, tr = r["dvc"], r["train"]
        median = {v: statistics.median(x["samples_s"] for x in runs) for v, runs in tr.items()}
        push = {k: f"{d[f'push_{k}_s']:.1f} s / {d[f'pull_{k}_s']:.1f} s ({d[f'objects_{k}']})"
                if f"push_{k}_s" in d else "-" for k in ("folder", "s3")}
        lines.append("| " + " | ".join([
            f"{r['images']:,}", f"{mb(r['bytes'])}, {r['gen_s']:.0f} s", memory(r["shards"]),
            f"{mb(r['shards']['bytes'])}, {r['shards']['files']} files",
            memory(r["tensors"]) if "tensors" in r else "-", f"{d['add_s']:.1f} s",
            push["folder"], push["s3"], speeds(tr["stream"]), speeds(tr["imagefolder"]),
            f"{median['stream'] / median['imagefolder']:.2f}",
            speeds(tr["tensors"]) if "tensors" in tr else "-",
            " / ".join(f"{statistics.median(x['cpu_ms'] for x in tr[v]):.2f}" for v in VARIANTS
                       if v in tr),
            " / ".join(mb(statistics.median(x["pss"] for x in tr[v])) for v in VARIANTS
                       if v in tr)]) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m reprotrain.bench.data", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000", help="dataset sizes, in images")
    ap.add_argument("--no-s3", dest="s3", action="store_false", help="the folder remote only")
    for name, default in KNOBS.items():
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--out", type=Path, default=Path("bench/data"))
    # One training variant in this process (the bench runs each so).
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--prepared", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--raw", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.variant:
        print(json.dumps(train_variant(a)))
        return
    sizes = [int(s) for s in a.sizes.split(",")]
    if min(sizes) < 1000 or a.rounds < 1 or a.steps < 1:
        ap.error("--sizes of 1000 images or more, --rounds and --steps >= 1")
    tmp = Path(tempfile.mkdtemp(prefix="bench-data-"))
    (tmp / "tmp").mkdir()
    # Stages run cold (no warm process), so their memory is their own; nothing of the caller's
    # DVC, MLflow or AWS settings, and DVC's site cache and temporary files in our folder.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DVC_", "MLFLOW_", "AWS_"))}
    env |= {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
            "PYTHONPATH": str(ROOT), "REPROTRAIN_WARM": "0", "TMPDIR": str(tmp / "tmp"),
            "DVC_SITE_CACHE_DIR": str(tmp / "dvc-site-cache"), "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": str(tmp / "no-aws"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "no-aws")}
    from reprotrain.bench import cpu_label

    report = {"cpu": cpu_label(), "date": datetime.now(UTC).strftime("%Y-%m-%d"),
              "load": os.getloadavg()[0], "rows": [], "s3": a.s3,
              **{k.replace("-", "_"): getattr(a, k.replace("-", "_")) for k in KNOBS}}
    try:
        for n in sizes:
            size_tmp = tmp / f"n{n}"
            report["rows"].append(one_size(n, size_tmp, a, env))
            shutil.rmtree(size_tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = markdown(report)
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "report.md").write_text(text + "\n")
    (a.out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {a.out / 'report.md'} and {a.out / 'results.json'}")


if __name__ == "__main__":
    main()
