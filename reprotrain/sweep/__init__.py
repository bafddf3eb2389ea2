"""`make sweep`: an Optuna study whose trials are DVC experiments, run by workers on any engine.

    python -m reprotrain.sweep run sweeps/lr.yaml --trials 8 --workers 2 --launcher local --remote origin
    python -m reprotrain.sweep worker --study NAME     # what every engine starts, N times
    python -m reprotrain.sweep status --study NAME     # the table and the picture, at any time

The study lives in a database (REPROTRAIN_SWEEP_STORAGE: PostgreSQL for parallel workers) and
holds everything a worker needs: the sweep file, the git remote and the pinned commit. `run`
checks the sweep file, creates the study with one waiting trial per slot, opens the MLflow
parent run, starts the workers (local processes or a SLURM array) and prints a line per change.
A worker clones the remote at the commit (one workspace runs one experiment at a time: DVC's
lock), then claims waiting trials one by one: `dvc exp run --pull --allow-missing -n <study>-<n> -S ...`,
`dvc exp push`, `make share`, the objective from the metrics file to the study. Its heartbeat
marks it alive; a trial whose worker died is failed by the next worker that looks and queued
again (Optuna's RetryHeartbeatStaleTrialCallback).

The modules, each importing only those above it:
    trial.py    what a training run reports to its trial, and the pruner (the train stage's side)
    spec.py     the sweep file: reading and checking it, the search space; SweepError
    study.py    the study's storage, creating the study, the sampler and each trial's point
    worker.py   one worker: its clone, `dvc exp run` per trial, the heartbeat, the objective told
    report.py   progress lines, the table of trials, the picture, `status`, pulling experiments
    slurm.py    SLURM's client commands (sbatch, squeue/sacct, scancel)
    launch.py   `run`: the pinned commit, the engines that start workers (Local, Slurm), watching
    __main__.py the command line: run, worker, status
"""
