"""Stage train: data/prepared/ -> models/train/ (model.pt, metrics.json, history.csv).

Also models/train/run.json, not a DVC output: the MLflow run that evaluate and export log into.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import shutil
import statistics
import sys
from pathlib import Path

import torch

from stages import distributed, tracking
from stages.checkpoints import latest_checkpoint
from stages.config import (
    PREPARED,
    STAGE_TIMES,
    TRAIN_DIR,
    Params,
    flatten,
    load_params,
    params_hash,
    repo_root,
    run_stage,
)
from stages.data import load_meta, load_split
from stages.files import save_torch, write_csv, write_json
from stages.loop import train
from stages.models import build_model, count_params

# What decides the trained weights; the checkpoint folder is keyed by it, so a changed
# hyperparameter starts afresh and an unchanged one resumes.
TRAINING_KEYS = ("seed", "lr", "epochs", "batch_size", "model.", "train.")
# history.csv: the per-epoch figures that compare across machines and reruns; the timings of
# each epoch (samples_per_s, epoch_s, peak_mem_mb) go to MLflow only.
HISTORY = ["epoch", "train_loss", "train_acc", "val_loss", "val_acc", "lr", "grad_norm"]


def main() -> None:
    params = load_params()
    nproc = distributed.requested_processes(params.train)
    if nproc > 1 and not distributed.under_torchrun():
        distributed.relaunch_under_torchrun(nproc, "stages.train")  # does not return
    rank, world = distributed.init(params.train)
    try:
        train_stage(params, rank, world)
    finally:
        distributed.shutdown()


def train_stage(params: Params, rank: int, world: int) -> None:
    """Every process trains; rank 0 alone writes checkpoints, outputs and MLflow."""
    meta = load_meta(PREPARED)
    train_split, val_split = load_split(PREPARED, "train"), load_split(PREPARED, "val")

    torch.manual_seed(params.seed)
    model = build_model(params.model, meta["channels"], len(meta["classes"]))

    decisive = {k: v for k, v in flatten(params).items() if k.startswith(TRAINING_KEYS)
                and k not in ("train.resume", "train.log_every", "train.checkpoint_dir")}
    key = params_hash(decisive, meta["sha256"])
    ckpt_dir = repo_root() / params.train.checkpoint_dir / key
    if params.train.resume == "never" and rank == 0:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    if world > 1:
        torch.distributed.barrier()  # every rank reads the checkpoints rank 0 left in place
    resume = latest_checkpoint(ckpt_dir)
    if resume is None and rank == 0:
        _note_other_unfinished_runs(ckpt_dir, decisive)
        write_json(ckpt_dir / "params.json", decisive)

    tags = {"git_commit": tracking.git_commit(), "dvc_exp_name": os.environ.get("DVC_EXP_NAME"),
            "dvc_baseline_rev": os.environ.get("DVC_EXP_BASELINE_REV"),
            "torch": torch.__version__, "python": platform.python_version(),
            "params_hash": key, "data_sha256": meta["sha256"], "host": platform.node(),
            "world_size": world}
    tracked = tracking.start_run(params.mlflow, run_id=resume and resume.get("run_id"),
                                 tags=tags) if rank == 0 else \
        contextlib.nullcontext(tracking.Tracker("(rank 0 tracks)"))
    with tracked as run:
        if resume is None:
            run.log_params(flatten(params))
            run.log_dataset(meta, params.data.root)
        result = train(model, train_split, val_split, meta["mean"], meta["std"], params.train,
                       lr=params.lr, epochs=params.epochs, batch_size=params.batch_size,
                       seed=params.seed, log=run.log, ckpt_dir=ckpt_dir, resume=resume,
                       extra_state={"run_id": run.run_id}, rank=rank, world=world)
        if rank != 0:
            return

        # The checkpoint describes itself: weights of the uncompiled module plus all it takes
        # to rebuild and feed the model. Nothing run-specific (run id, timings): the same
        # params, seed and machine give the same bytes, so a rerun leaves dvc.lock unchanged.
        checkpoint = {"model": result.model.state_dict(),
                      "model_params": dataclasses.asdict(params.model),
                      "classes": meta["classes"], "mean": meta["mean"], "std": meta["std"],
                      "channels": meta["channels"], "image_size": meta["image_size"],
                      "resize": meta["resize"], "best_epoch": result.best_epoch}
        save_torch(TRAIN_DIR / "model.pt", checkpoint)
        # What is worth comparing between experiments; timings and ids go to MLflow only.
        metrics = {"best_val_acc": result.best_val_acc, "best_val_loss": result.best_val_loss,
                   "best_epoch": result.best_epoch, "epochs_run": result.epochs_run,
                   "num_params": count_params(result.model)}
        write_json(TRAIN_DIR / "metrics.json", metrics)
        write_csv(TRAIN_DIR / "history.csv", HISTORY,
                  ([round(r[k], 6) if isinstance(r[k], float) else r[k] for k in HISTORY]
                   for r in result.history))
        STAGE_TIMES["loop_s"] = result.train_s
        run.set_tags({"device": result.device, "precision": result.precision,
                      "loader": result.loader})
        run.log_metrics(metrics | {"train_s": result.train_s, "samples_per_s":
                                   statistics.median(r["samples_per_s"] for r in result.history)})
        for name in ("metrics.json", "history.csv"):
            run.log_artifact(TRAIN_DIR / name, "train")
        tracking.link_model(run, TRAIN_DIR / "model.pt")

    shutil.rmtree(ckpt_dir, ignore_errors=True)  # complete: model.pt holds the result
    print(f"trained {params.model.arch} on {result.device} ({result.precision}, "
          f"{result.loader} loader): best val_acc {result.best_val_acc:.4f} at epoch "
          f"{result.best_epoch}, {result.train_s:.1f}s")


def _note_other_unfinished_runs(ckpt_dir: Path, decisive: dict) -> None:
    """Changed params start afresh in their own folder (so parallel queued experiments never
    mix); an unfinished run of other params is kept and named, with what differs."""
    for other in sorted(ckpt_dir.parent.glob("*/params.json")):
        if other.parent == ckpt_dir or not any(other.parent.glob("epoch-*.pt")):
            continue
        theirs = json.loads(other.read_text())
        diff = ", ".join(f"{k}: {theirs.get(k)!r} -> {v!r}" for k, v in decisive.items()
                         if theirs.get(k) != v)
        print(f"note: starting afresh; an unfinished run with other params is kept in "
              f"{other.parent} ({diff}). Restore those params to resume it.", file=sys.stderr)


if __name__ == "__main__":
    run_stage(main)
