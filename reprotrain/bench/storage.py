"""python -m reprotrain.bench.storage: a DVC remote in a local folder against S3 on loopback
(SeaweedFS's `weed mini`, `make s3`'s), side by side in one run (docs/data.md, "What S3 costs",
has the figures and the command).

Rows, each timed on both remotes, S3 over the folder in the last column:
- the default pipeline's outputs (params.yaml as committed): `make share` from the clone that
  trained them; a fresh clone's `dvc exp run --pull` at the commit that added the remotes, before
  the run's (README's recipe), and `dvc pull` at the run's commit;
- a folder dataset (`data/raw/images/`, random bytes of photo-like sizes from a fixed seed,
  `dvc add`ed): `dvc push` and a fresh clone's `dvc pull`;
- from `git clone` to a restored model through the run-cache, against training it (`git clone`
  and `dvc repro` with no remote).

Every repeat starts from nothing: a clone of HEAD that trains, its own S3 server and remote
folder. Everything lives in one temporary folder (DVC's site cache and the commands' TMPDIR
too), removed at the end, and the dataset's copies are deleted as soon as no row needs them, so
the disk holds about four of them at a time.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from reprotrain.bench.pipeline import timed
from reprotrain.team import s3 as s3_server

REMOTES = ("folder", "s3")
BUCKET = "bench"
IMAGES = "data/raw/images"
CLASSES = 10
GIT_ID = {"GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@reprotrain.invalid",
          "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@reprotrain.invalid"}
# Row keys, in the table's order, with their labels.
MODEL_ROWS = {
    "share": "pipeline outputs: push (`make share`)",
    "exp_pull": "pipeline outputs: fresh clone at the remotes' commit, `dvc exp run --pull`",
    "pull": "pipeline outputs: fresh clone at the run's commit, `dvc pull`",
}
DATA_ROWS = {
    "data_push": "dataset: `dvc push`",
    "data_pull": "dataset: fresh clone, `dvc pull`",
}
CLONE_ROWS = {
    "clone_restore": "`git clone` to a restored model (`dvc exp run --pull`)",
}


def bench_env(tmp: Path, s3: s3_server.S3) -> dict[str, str]:
    """The caller's environment less its DVC, MLflow and AWS settings; this venv first on the
    PATH (DVC runs stage commands with it); the server's keys and nothing from ~/.aws; DVC's
    site cache and the commands' temporary files (torch's inductor cache, a `.ses` file that one
    of the stages leaves) in our folder, so nothing stays behind and no repeat reads another's."""
    (tmp / "tmp").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DVC_", "MLFLOW_", "AWS_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env |= GIT_ID | s3.env() | {
        "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": str(tmp / "no-aws"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "no-aws"),
        "DVC_SITE_CACHE_DIR": str(tmp / "dvc-site-cache"), "TMPDIR": str(tmp / "tmp")}
    env.pop("MLFLOW_S3_ENDPOINT_URL")  # the stages log to the clone's own sqlite store
    return env


def dvc(*argv: str) -> list[str]:
    return [str(Path(sys.executable).parent / "dvc"), *argv]


def clone(src: Path, dest: Path, env: dict[str, str], commit: str = "HEAD") -> float:
    """A fresh clone at `commit`: seconds from `git clone` to the commit checked out."""
    t1, _ = timed(["git", "clone", "-q", str(src), str(dest)], dest.parent, env)
    t2, _ = timed(["git", "checkout", "-q", commit], dest, env)
    return t1 + t2


def make_dataset(folder: Path, size_mb: int, file_kb: int, seed: int) -> int:
    """`size_mb` MiB of incompressible files (as JPEGs are) in CLASSES class folders, each file's
    size drawn from 0.5 to 1.5 times `file_kb` KiB; the same bytes for the same seed. Returns
    the number of files."""
    import numpy as np

    rng = np.random.default_rng(seed)
    left, n = size_mb * 2**20, 0
    while left > 0:
        size = min(left, int(rng.integers(file_kb * 512, file_kb * 1536 + 1)))
        path = folder / f"class{n % CLASSES}" / f"{n:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.bytes(size))
        left, n = left - size, n + 1
    return n


def digest(folder: Path) -> str:
    h = hashlib.md5()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(folder)).encode() + f.read_bytes())
    return h.hexdigest()


def add_remotes(project: Path, env: dict[str, str], s3: s3_server.S3, folder: Path) -> str:
    """Both remotes in the project's committed .dvc/config (the keys stay in the environment);
    returns that commit: README's recipe restores at it, before the run is committed."""
    timed(dvc("remote", "add", "folder", str(folder)), project, env)
    timed(dvc("remote", "add", "s3", f"s3://{BUCKET}/dvc"), project, env)
    timed(dvc("remote", "modify", "s3", "endpointurl", s3.endpoint), project, env)
    timed(["git", "commit", "-qm", "the remotes", ".dvc/config"], project, env)
    return timed(["git", "rev-parse", "HEAD"], project, env)[1].strip()


def use_remote(repo: Path, name: str, env: dict[str, str]) -> None:
    """The default remote of this clone only (.dvc/config.local): `make share` and `dvc exp run
    --pull` take the default one."""
    timed(dvc("remote", "default", "--local", name), repo, env)


def model_rows(tmp: Path, source: Path, s3: s3_server.S3,
               env: dict[str, str]) -> tuple[dict, dict, Path]:
    """The pipeline's rows and the training one; returns them, what the local cache held after
    the run (files, MiB: what `make share` pushes) and the project that trained."""
    project = tmp / "project"
    t_clone = clone(source, project, env)
    t_repro, _ = timed(dvc("repro"), project, env)
    times = {"train": t_clone + t_repro}
    model = (project / "models/train/model.pt").read_bytes()
    remote_commit = add_remotes(project, env, s3, tmp / "remote")
    for name in REMOTES:
        use_remote(project, name, env)
        times[f"share/{name}"], _ = timed([sys.executable, "-m", "reprotrain.team.share"], project, env)
    timed(["git", "commit", "-q", "--allow-empty", "-am", "the run"], project, env)
    cached = [p for p in (project / ".dvc/cache").rglob("*") if p.is_file()]
    outputs = {"files": len(cached), "mb": sum(p.stat().st_size for p in cached) / 2**20}
    for name in REMOTES:
        c = tmp / f"exp-pull-{name}"
        t_clone = clone(project, c, env, remote_commit)
        use_remote(c, name, env)
        t, out = timed(dvc("exp", "run", "--pull"), c, env)
        if "Running stage 'train'" in out or (c / "models/train/model.pt").read_bytes() != model:
            raise RuntimeError(f"`dvc exp run --pull` from the {name} remote trained instead of "
                               f"restoring:\n{out[-3000:]}")
        times[f"exp_pull/{name}"], times[f"clone_restore/{name}"] = t, t_clone + t
        shutil.rmtree(c)
    for name in REMOTES:
        c = tmp / f"pull-{name}"
        clone(project, c, env)
        times[f"pull/{name}"], _ = timed(dvc("pull", "-r", name), c, env)
        if (c / "models/train/model.pt").read_bytes() != model:
            raise RuntimeError(f"`dvc pull` from the {name} remote restored another model")
        shutil.rmtree(c)
    return times, outputs, project


def data_rows(tmp: Path, project: Path, env: dict[str, str], size_mb: int, file_kb: int,
              seed: int) -> tuple[dict, dict]:
    """The dataset's rows, and what it was (files, MiB, seconds of `dvc add`)."""
    images = project / IMAGES
    n = make_dataset(images, size_mb, file_kb, seed)
    expected = digest(images)
    t_add, _ = timed(dvc("add", IMAGES), project, env)
    timed(["git", "add", "-A", "data/raw"], project, env)
    timed(["git", "commit", "-qm", "a dataset"], project, env)
    times = {}
    for name in REMOTES:
        times[f"data_push/{name}"], _ = timed(dvc("push", "-r", name, f"{IMAGES}.dvc"), project, env)
    # The pushed copies are all the pulls need: the workspace's and the cache's go now.
    shutil.rmtree(images)
    shutil.rmtree(project / ".dvc/cache")
    for name in REMOTES:
        c = tmp / f"data-{name}"
        clone(project, c, env)
        times[f"data_pull/{name}"], _ = timed(dvc("pull", "-r", name, f"{IMAGES}.dvc"), c, env)
        if digest(c / IMAGES) != expected:
            raise RuntimeError(f"`dvc pull` from the {name} remote restored other bytes")
        shutil.rmtree(c)
        if name == "folder":
            shutil.rmtree(tmp / "remote")
    return times, {"files": n, "mb": size_mb, "file_kb": file_kb, "add_s": t_add}


def one_repeat(tmp: Path, source: Path, size_mb: int, file_kb: int, seed: int,
               model: bool) -> tuple[dict, dict]:
    """Every row once, from nothing: a clone of HEAD, a fresh S3 server and remote folder."""
    s3 = s3_server.start(tmp / "s3", buckets=(BUCKET,))
    print(f"  S3 on {s3.endpoint}: weed pid {s3.proc.pid}, in {tmp}", file=sys.stderr, flush=True)
    try:
        env = bench_env(tmp, s3)
        info: dict = {}
        if model:
            times, info["outputs"], project = model_rows(tmp, source, s3, env)
        else:
            times, project = {}, tmp / "project"
            clone(source, project, env)
            add_remotes(project, env, s3, tmp / "remote")
        if size_mb:
            more, info["dataset"] = data_rows(tmp, project, env, size_mb, file_kb, seed)
            times |= more
        return times, info
    finally:
        s3_server.stop(s3)


def bench(source: Path, size_mb: int, file_kb: int, seed: int, repeats: int,
          model: bool) -> dict:
    samples: dict[str, list[float]] = {}
    info: dict = {}
    for i in range(repeats):
        with tempfile.TemporaryDirectory(prefix="bench-storage-") as tmp:
            times, info = one_repeat(Path(tmp), source, size_mb, file_kb, seed, model)
        for key, seconds in times.items():
            samples.setdefault(key, []).append(seconds)
        print(f"  repeat {i + 1}/{repeats}: " + ", ".join(f"{k} {v:.1f} s" for k, v in
                                                         times.items()), file=sys.stderr, flush=True)
    from reprotrain.bench import cpu_label

    return {"samples": samples, **info, "repeats": repeats, "cpu": cpu_label()}


def cell(xs: list[float]) -> str:
    med = statistics.median(xs)
    return f"{med:.1f} s" + (f" ({min(xs):.1f}-{max(xs):.1f})" if len(xs) > 1 else "")


def markdown(report: dict) -> str:
    s, d, o = report["samples"], report.get("dataset"), report.get("outputs")
    n = report["repeats"]
    lines = [f"DVC remote in a local folder against S3 on loopback (SeaweedFS `weed mini`), "
             f"{report['cpu']}; {'median (min-max) of ' + str(n) + ' repeats' if n > 1 else 'one run'}"
             ".", "", "| what | folder remote | S3 on loopback | S3 / folder |", "|---|---|---|---|"]
    # What was moved, said once: in the first row of its group.
    labels = dict(MODEL_ROWS)
    if o:
        labels["share"] = labels["share"].replace(
            "pipeline outputs", f"pipeline outputs ({o['files']} files, {o['mb']:.1f} MiB)", 1)
    if d:
        mb = f"{d['mb'] / 1024:g} GiB" if d["mb"] >= 1024 else f"{d['mb']} MiB"
        labels |= {k: v.replace("dataset", f"{mb} dataset", 1) for k, v in DATA_ROWS.items()}
        labels["data_push"] = labels["data_push"].replace(
            "dataset", f"dataset ({d['files']} files of {d['file_kb'] // 2}-"
                       f"{d['file_kb'] * 3 // 2} KiB)", 1)
    labels |= CLONE_ROWS
    for key, label in labels.items():
        if f"{key}/folder" not in s:
            continue
        f, o = s[f"{key}/folder"], s[f"{key}/s3"]
        lines.append(f"| {label} | {cell(f)} | {cell(o)} | "
                     f"{statistics.median(o) / statistics.median(f):.2f} |")
    if "train" in s:
        restore = statistics.median(s["clone_restore/s3"])
        train = statistics.median(s["train"])
        lines.append(f"| `git clone` to a trained model (`dvc repro`, no remote) | {cell(s['train'])} "
                     f"| | training takes {train / restore:.1f}x the S3 restore |")
    if d:
        lines += ["", f"`dvc add` of the dataset (hashing it into the local cache): "
                      f"{d['add_s']:.1f} s."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m reprotrain.bench.storage", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=1024,
                        help="the dataset's size in MiB (0: no dataset rows)")
    parser.add_argument("--file-kb", type=int, default=256,
                        help="the dataset's mean file size in KiB (sizes from half to 1.5 times it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--no-model", action="store_true",
                        help="only the dataset's rows: no training, no pipeline outputs")
    parser.add_argument("--out", type=Path, help="also write the table here (markdown)")
    a = parser.parse_args()
    if a.size_mb < 0 or a.file_kb < 2 or a.repeats < 1 or (a.no_model and not a.size_mb):
        parser.error("--size-mb >= 0 (> 0 with --no-model), --file-kb >= 2, --repeats >= 1")
    report = bench(Path.cwd(), a.size_mb, a.file_kb, a.seed, a.repeats, not a.no_model)
    text = markdown(report)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
