"""A training run that is one trial of an Optuna study (`make sweep`, reprotrain/sweep/): after each
epoch it reports its validation figure to the trial, and stops when the study's pruner says so.

The sweep's worker installs `reporting` as the train stage's hook (stages/hooks.py) through the
environment, with the study and trial; train imports nothing of the sweep, and outside a sweep
optuna is never imported. A pruned run raises `Pruned`, a SystemExit with its own code: its stop
depended on other trials, so its outputs are not a function of its inputs, and DVC records
nothing of a failed stage (no dvc.lock entry, no run-cache entry, no experiment). The MLflow
run ends KILLED, tagged `pruned` by the train stage.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from stages.hooks import REPORT_HOOK_ENV, Stopped

if TYPE_CHECKING:  # the sweep's processes import no torch
    from stages.loop import Log

# The worker names the trial through the environment; the storage URI may hold a password,
# which is why it is never an argument (visible in `ps`) nor written to a file.
STORAGE_ENV = "REPROTRAIN_SWEEP_STORAGE"
STUDY_ENV = "REPROTRAIN_SWEEP_STUDY"
TRIAL_ENV = "REPROTRAIN_SWEEP_TRIAL"
PRUNED_EXIT = 75  # EX_TEMPFAIL: not an error; the study chose to stop this trial
PRUNERS = {"median": "MedianPruner", "successive_halving": "SuccessiveHalvingPruner",
           "none": "NopPruner"}


class Pruned(Stopped):
    def __init__(self, epoch: int):
        super().__init__(PRUNED_EXIT, {"pruned": "true", "pruned_at_epoch": epoch})
        self.epoch = epoch


def hook_env(study: str, trial: int) -> dict[str, str]:
    """What the trial's `dvc exp run` needs in its environment: `reporting` as train's hook,
    and the trial it reports to."""
    return {REPORT_HOOK_ENV: f"{__name__}:reporting", STUDY_ENV: study, TRIAL_ENV: str(trial)}


def build_pruner(spec: dict[str, Any]):
    """The pruner of a sweep file's `pruner:` section (`name` plus Optuna's own arguments)."""
    import optuna

    options = {k: v for k, v in spec.items() if k != "name"}
    return getattr(optuna.pruners, PRUNERS[spec["name"]])(**options)


def open_trial():
    """The running trial this process trains, and the history column it reports."""
    import optuna

    storage = optuna.storages.RDBStorage(os.environ[STORAGE_ENV])
    name = os.environ[STUDY_ENV]
    # The sampler is the worker's business; this side only reports, so it never samples.
    study = optuna.load_study(study_name=name, storage=storage,
                              sampler=optuna.samplers.RandomSampler())
    sweep = study.user_attrs["sweep"]
    study.pruner = build_pruner(sweep["pruner"])
    trial_id = storage.get_trial_id_from_study_id_trial_number(
        storage.get_study_id_from_name(name), int(os.environ[TRIAL_ENV]))
    return optuna.Trial(study, trial_id), sweep["objective"]["per_epoch"]


def reporting(log: Log, rank: int, world: int) -> Log:
    """`log`, and under a sweep: each epoch's figure to the trial, then the pruner's verdict.
    Rank 0 alone talks to the study; every rank stops at the same epoch."""
    trial, figure = open_trial() if rank == 0 else (None, "")

    def reported(metrics: dict[str, float], step: int, durable: bool = False) -> None:
        log(metrics, step, durable)  # first: the curve holds the epoch that stopped the run
        if not durable:  # an epoch's row; step logs go on
            return
        stop = False
        if trial is not None:
            trial.report(metrics[figure], step)
            stop = trial.should_prune()
            if stop:
                trial.set_user_attr("pruned_at_epoch", step)
        if world > 1:
            import torch.distributed

            decision = [stop]
            torch.distributed.broadcast_object_list(decision, src=0)
            stop = decision[0]
        if stop:
            raise Pruned(step)

    return reported
