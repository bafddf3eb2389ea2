"""Stage train: data/prepared/ -> models/train/ (model.pt, metrics.json, history.csv, made_on.json).

Also models/train/run.json, not a DVC output: the MLflow run that evaluate and export log into.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from reprotrain import tracking
from stages import distributed, hooks, weights
from stages.checkpoints import (
    CheckpointError,
    check_checkpoint_root,
    described,
    latest_checkpoint,
    open_run_dir,
    remove_run,
    tidy_other_runs,
)
from stages.config import PREPARED, TRAIN_DIR, Params, ParamsError, flatten, load_params, params_hash
from stages.data import load_meta, load_split, resolve_workers
from stages.lib.cli import STAGE_TIMES, run_stage
from stages.lib.errors import UserError
from stages.lib.files import atomic_write_all, csv_text, json_text, text_writer
from stages.lib.paths import repo_root
from stages.loop import Job, RunIO, TrainResult, train
from stages.metrics import HISTORY
from stages.models import build_model, count_params
from stages.runtime import made_on, resolve_device

# What decides the trained weights; the checkpoint folder is keyed by it, so a changed
# hyperparameter starts afresh and an unchanged one resumes.
TRAINING_KEYS = ("seed", "lr", "epochs", "batch_size", "model.", "train.")


def main() -> None:
    params = load_params()
    resolve_device(params.train.device)  # an unusable device fails now, not after the data loads
    check_checkpoint_root(repo_root() / params.train.checkpoint_dir, repo_root(), params.data.root)
    nproc = distributed.requested_processes(params.train, params.batch_size)
    if nproc > 1 and not distributed.under_torchrun():
        distributed.relaunch_under_torchrun(nproc, "stages.train")  # does not return
    with distributed.group(params.train) as (rank, world):
        train_stage(params, rank, world)


def train_stage(params: Params, rank: int, world: int) -> None:
    """Every process trains; rank 0 alone writes checkpoints, outputs and MLflow."""
    meta = load_meta(PREPARED)
    train_split, val_split = load_split(PREPARED, "train"), load_split(PREPARED, "val")

    torch.manual_seed(params.seed)
    model = build_model(params.model, meta["channels"], len(meta["classes"]), meta["image_size"])

    started = training_params(params)
    key, ckpt_dir, resume = checkpoint_run(started, meta, params.train.checkpoint_dir, rank,
                                           world)
    watch = ParamsWatch(Path("params.yaml"), started)

    tracked = tracking.start_run(params.mlflow, run_id=resume and resume.get("run_id"),
                                 tags=run_tags(key, meta, world)) if rank == 0 else \
        contextlib.nullcontext(tracking.Tracker("(rank 0 tracks)"))
    with tracked as run:
        if resume is None:
            run.log_params(flatten(params))
            run.log_dataset(meta, params.data.root)
        else:
            run.resume()
        # Under a sweep (`make sweep`) each epoch is also reported to its Optuna trial, whose
        # pruner may stop the run: it exits with its own code and DVC records nothing of it.
        log = hooks.reporting(watch.wrap(run.log), rank, world)
        try:
            job = Job(train=train_split, val=val_split, mean=meta["mean"], std=meta["std"],
                      cfg=params.train, lr=params.lr, epochs=params.epochs,
                      batch_size=params.batch_size, seed=params.seed, rank=rank, world=world)
            result = train(model, job, RunIO(log=log, ckpt_dir=ckpt_dir, resume=resume,
                                             extra_state={"run_id": run.run_id}))
        except hooks.Stopped as stop:
            run.set_tags(stop.tags)
            raise
        if rank != 0:
            return
        watch.check(force=True)  # the last chance before a result is recorded under its params
        write_outputs(result, params, meta, run, world)

    remove_run(ckpt_dir, repo_root())  # complete: model.pt holds the result
    workers = workers_used(params, result)
    plural = "" if workers == 1 else "s"
    print(f"trained {params.model.arch} on {result.device} ({result.precision}, {result.loader} "
          f"loader{f', {workers} worker{plural}' if result.loader != 'device' else ''}): best "
          f"val_acc {result.best_val_acc:.4f} at epoch "
          f"{result.best_epoch}, {result.loop_s:.1f}s")


def checkpoint_run(started: dict, meta: dict, checkpoint_dir: str, rank: int,
                   world: int) -> tuple[str, Path, dict | None]:
    """The run's checkpoint folder, keyed by what decides the weights (a changed
    hyperparameter starts afresh, an unchanged one resumes), and the checkpoint to resume."""
    decisive = {k: v for k, v in started.items()
                if k not in ("train.resume", "train.log_every", "train.checkpoint_dir")}
    if world > 1:  # so do the processes, torchrun's too (BatchNorm, dropout: docs/multinode.md)
        decisive["processes"] = world
    key = params_hash(decisive, meta["sha256"])
    workspace = repo_root()
    ckpt_dir = workspace / checkpoint_dir / key
    if started["train.resume"] == "never" and rank == 0 and ckpt_dir.exists() \
            and not remove_run(ckpt_dir, workspace):
        raise CheckpointError(f"train.resume: never, but {ckpt_dir} holds files this workspace "
                              "cannot prove it wrote; move or delete that folder yourself")
    if world == 1:
        resume = latest_checkpoint(ckpt_dir)
    else:  # rank 0's checkpoint for every rank: the others may run on machines without it
        resume = distributed.from_rank0(checkpoint_or_error(ckpt_dir) if rank == 0 else None)
    if resume is None and rank == 0:
        tidy_other_runs(ckpt_dir, workspace, described(decisive, meta))
        open_run_dir(ckpt_dir, workspace, described(decisive, meta))
    return key, ckpt_dir, resume


def workers_used(params: Params, result: TrainResult) -> int:
    """The loader's worker processes (train.num_workers, auto resolved); none on the device."""
    return 0 if result.loader == "device" else resolve_workers(params.train.num_workers)


def run_tags(key: str, meta: dict, world: int) -> dict:
    return {"git_commit": tracking.git_commit(), "dvc_exp_name": os.environ.get("DVC_EXP_NAME"),
            "dvc_baseline_rev": os.environ.get("DVC_EXP_BASELINE_REV"),
            "torch": torch.__version__, "python": platform.python_version(),
            "params_hash": key, "data_sha256": meta["sha256"], "host": platform.node(),
            "world_size": world}


def write_outputs(result: TrainResult, params: Params, meta: dict, run: tracking.Tracker,
                  world: int) -> None:
    """models/train/, and the same figures and files to the run."""
    # What is worth comparing between experiments; timings and ids go to MLflow only.
    metrics = {"best_val_acc": result.best_val_acc, "best_val_loss": result.best_val_loss,
               "best_epoch": result.best_epoch, "epochs_run": result.epochs_run,
               "num_params": count_params(result.model)}
    history = csv_text(HISTORY, ([round(r[k], 6) if isinstance(r[k], float) else r[k]
                                  for k in HISTORY] for r in result.history))
    where = made_on(torch.device(result.device), world)
    # All or none: a failed write must not leave a new model beside the previous metrics.
    atomic_write_all(weights.writes(TRAIN_DIR / "model.pt", result.model, params.model, meta,
                                       result.best_epoch)
                     | {TRAIN_DIR / "metrics.json": text_writer(json_text(metrics)),
                        TRAIN_DIR / "history.csv": text_writer(history),
                        TRAIN_DIR / "made_on.json": text_writer(json_text(where))})
    STAGE_TIMES["loop_s"] = result.loop_s
    # What each `auto` resolved to (the params keep `auto`: a reopened run's are compared).
    run.set_tags({"device": result.device, "precision": result.precision,
                  "loader": result.loader, "num_workers": workers_used(params, result),
                  "data.channels": meta["channels"], **where})
    run.log_metrics(metrics | {"train_s": result.loop_s, "samples_per_s":
                               statistics.median(r["samples_per_s"] for r in result.history)})
    for name in ("metrics.json", "history.csv", "made_on.json"):
        run.log_artifact(TRAIN_DIR / name, "train")
    tracking.link_model(run, TRAIN_DIR / "model.pt")


def checkpoint_or_error(ckpt_dir: Path) -> dict | None | CheckpointError:
    try:
        return latest_checkpoint(ckpt_dir)
    except CheckpointError as e:
        return e


def training_params(params: Params) -> dict:
    """The params train declares in dvc.yaml (seed, lr, epochs, batch_size, model, train)."""
    return {k: v for k, v in flatten(params).items() if k.startswith(TRAINING_KEYS)}


class ParamsWatch:
    """Fails the run when params.yaml's training params change under it. Two `dvc exp run` in
    one workspace: the second writes its params here before DVC refuses it as busy, and the
    first would train on, log and be recorded with the second's values."""

    SETTLE_S = 0.5

    def __init__(self, path: Path, started: dict):
        self.path, self.started = path, started
        self.seen = self._stamp()

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
            return st.st_mtime_ns, st.st_size
        except OSError:
            return None

    def _diff(self) -> str:
        try:
            now = training_params(load_params(self.path))
            return ", ".join(f"{k}: {v!r} -> {now.get(k)!r}" for k, v in self.started.items()
                             if now.get(k) != v)
        except ParamsError as e:
            return f"it no longer loads: {e}"

    def check(self, force: bool = False) -> None:
        stamp = self._stamp()
        if stamp == self.seen and not force:
            return  # a stat per log call; the YAML is parsed only when the file changed
        self.seen = stamp
        diff = self._diff()
        # An editor or `dvc exp run -S` truncates then writes: a read in between sees an empty
        # file, which loads as the defaults. Judge only a file that has stopped changing.
        while diff:
            time.sleep(self.SETTLE_S)
            stamp = self._stamp()
            if stamp == self.seen:
                break
            self.seen, diff = stamp, self._diff()
        if diff:
            raise UserError(f"{self.path} changed while training ({diff}): another `dvc exp "
                            "run` in this workspace wrote its params, and this run would be "
                            "recorded under them, so nothing was written. Run experiments side "
                            "by side with `dvc exp run --queue` (then `dvc queue start`) or "
                            "`dvc exp run --temp`, one at a time in the workspace")

    def wrap(self, log):
        def checked(metrics: dict, step: int, durable: bool = False) -> None:
            self.check()
            log(metrics, step, durable)

        return checked


if __name__ == "__main__":
    run_stage(main)
