"""`make sweep` for real: an Optuna study on PostgreSQL, local worker processes each in its own
clone of a bare git remote, S3 (or a folder) as the DVC remote, one worker killed mid-trial."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from reprotrain.sweep.spec import SweepError, load_sweep
from tests.conftest import ROOT, copy_repo, env_with, run
from tests.support.services import create_database, postgres, s3, s3_client_env  # noqa: F401
from tests.support.slurm_cluster import slurm  # noqa: F401

GOOD, BAD = 0.01, 1.0e-5  # BAD learns nothing in an epoch: the median pruner stops it
# Random points seeded per trial number: trials 0-2 GOOD, 3 BAD, 4-7 GOOD (seed 10; see
# reprotrain.sweep.study.sampler_for), so trials 0 and 1 train side by side, later ones repeat them, and
# trial 3 starts once one of them is complete: the pruner has a curve to judge it by.
TINY = f"""
objective: {{file: models/train/metrics.json, metric: best_val_acc, direction: maximize}}
trials: 8
sampler: {{name: random, seed: 10}}
pruner: {{name: median, n_startup_trials: 1, n_warmup_steps: 0}}
params: {{epochs: 2, model.width: 8, data.image_size: 8, train.warmup_epochs: 0.0}}
space:
  lr: {{type: choice, values: [{GOOD}, {BAD}]}}
heartbeat_s: 1
grace_s: 4
"""
NO_DB = "postgresql://nobody@127.0.0.1:1/none"  # never reached: the refusal comes first


def sweep_file(folder: Path, text: str) -> Path:
    path = folder / "sweep.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("edit, message", [
    ("lrr: {type: float, low: 0.001, high: 0.1}",
     "space.lrr: unknown key 'lrr'; did you mean 'lr'?"),
    ("train.optimiser: {type: choice, values: [sgd]}",
     "space.train.optimiser: unknown key 'train.optimiser'; did you mean 'train.optimizer'?"),
    ("lr: {type: float, low: 0.1, high: 0.001}", "space.lr: low=0.1 must be below high=0.001"),
    ("lr: {type: float, low: 0.0, high: 0.1, log: true}", "space.lr: log: true needs low > 0"),
    ("lr: {type: float, low: -1.0, high: 0.1}", "space.lr: lr=-1.0 is invalid: must be > 0"),
    ("epochs: {type: float, low: 1.0, high: 5.0}", "space.epochs: epochs=1.0 must be int"),
    ("train.optimizer: {type: choice, values: [adamw, lion]}",
     "space.train.optimizer: train.optimizer='lion' is invalid: choose one of adamw, sgd"),
    ("lr: {type: loguniform, low: 0.001, high: 0.1}", "space.lr needs type: float, int, choice"),
])
def test_a_bad_space_fails_naming_the_key(tmp_path, edit, message):
    text = TINY.split("space:")[0] + f"space:\n  {edit}\n"
    with pytest.raises(SweepError) as e:
        load_sweep(sweep_file(tmp_path, text))
    assert message in str(e.value) and str(e.value).count("\n") == 0, str(e.value)


@pytest.mark.parametrize("old, new, message", [
    ("name: random", "name: annealing", "sampler.name='annealing' is unknown; choose one of tpe, random"),
    ("name: median", "name: hyperband2", "pruner.name='hyperband2' is unknown"),
    ("n_warmup_steps: 0", "n_warmup_step: 0", "pruner median: got an unexpected keyword argument"),
    ("metric: best_val_acc", "metric: best_val_ac", "objective.metric='best_val_ac' is not in "
     "models/train/metrics.json; did you mean 'best_val_acc'?"),
    ("file: models/train/metrics.json", "file: models/train/history.csv",
     "objective.file='models/train/history.csv' is not a metrics file of dvc.yaml"),
    ("trials: 8", "trails: 8", "unknown key 'trails'; did you mean 'trials'?"),
    ("model.width: 8", "model.widht: 8", "params.model.widht: unknown key 'model.widht'"),
    ("grace_s: 4", "grace_s: 1", "grace_s=1 must exceed heartbeat_s=1"),
])
def test_a_bad_sweep_file_fails_naming_the_key(tmp_path, old, new, message):
    assert old in TINY
    with pytest.raises(SweepError) as e:
        load_sweep(sweep_file(tmp_path, TINY.replace(old, new)))
    assert message in str(e.value) and str(e.value).count("\n") == 0, str(e.value)


def test_the_shipped_sweep_file_is_valid():
    spec = load_sweep(ROOT / "sweeps/lr.yaml")
    assert spec["space"]["lr"]["log"] and spec["objective"]["stage"] == "train"


def test_outside_a_sweep_training_logs_as_before(monkeypatch):
    """No hook in the environment: the loop's `log` itself; train imports no sweep, no optuna."""
    from stages import hooks

    monkeypatch.delenv(hooks.REPORT_HOOK_ENV, raising=False)
    code = ("import sys; from stages import hooks, train; from stages.loop import no_log; "
            "assert hooks.reporting(no_log, rank=0, world=1) is no_log; "
            "print(sorted(m for m in sys.modules if 'sweep' in m or m.startswith('optuna')))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.stdout.strip() == "[]", p.stderr


def test_parallel_workers_on_sqlite_are_refused_in_one_line(tmp_path):
    p = run([sys.executable, "-m", "reprotrain.sweep", "run", "sweeps/lr.yaml", "--workers", "2",
             "--storage", f"sqlite:///{tmp_path}/study.db"], ROOT, check=False)
    assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
    assert "2 workers: Optuna's FAQ says not to share SQLite" in p.stderr
    assert "optuna.readthedocs.io/en/stable/faq.html" in p.stderr
    assert not (tmp_path / "study.db").exists()  # refused before anything started


def test_a_bad_sweep_file_fails_before_the_storage_is_touched(tmp_path):
    bad = sweep_file(tmp_path, TINY.replace("lr:", "lrr:"))
    p = run([sys.executable, "-m", "reprotrain.sweep", "run", str(bad), "--storage",
             "postgresql://nobody@127.0.0.1:1/none"], ROOT, check=False)
    assert p.returncode == 1 and p.stderr.startswith("error: ") and p.stderr.count("\n") == 1
    assert "space.lrr: unknown key 'lrr'; did you mean 'lr'?" in p.stderr


def exp_ref(ls_remote: str, trial) -> str:
    """The ref of a trial's experiment in `git ls-remote`'s output."""
    (ref,) = [ln.split()[1] for ln in ls_remote.splitlines()
              if ln.endswith(f"/{trial.user_attrs['dvc_exp']}")]
    return ref


def trials_of(uri: str, study: str):
    """The study's trials, over connections closed after use. The tests poll this five times
    a second: storages with a pool each kept theirs open, 6 more a second, until PostgreSQL
    refused the sweep under test ("too many clients already": max_connections is 100)."""
    import optuna
    from sqlalchemy.pool import NullPool

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(uri, engine_kwargs={"poolclass": NullPool})
    return optuna.load_study(study_name=study, storage=storage).get_trials()


def training_trial(uri: str, study: str, deadline_s: float):
    """A running trial of the GOOD point that has reported an epoch: one mid-training."""
    end = time.time() + deadline_s
    while time.time() < end:
        try:
            trials = trials_of(uri, study)
        except KeyError:  # not created yet
            trials = []
        with_epochs = [t for t in trials if t.state.name == "RUNNING"
                       and t.intermediate_values and t.params.get("lr") == GOOD]
        if with_epochs:
            return with_epochs[0]
        time.sleep(0.2)
    raise AssertionError("no trial reached its first epoch")


def project(tmp_path: Path, sweep: str, s3=None) -> Path:  # noqa: F811 - the fixture's value
    """A user's repo with a DVC remote and a bare repository as `origin`. The remote is a folder,
    or with `s3` docs/data.md's recipe: a bucket, its endpoint committed, its keys --local."""
    repo = copy_repo(tmp_path / "repo")
    if s3 is None:
        run(["dvc", "remote", "add", "-d", "storage", str(tmp_path / "dvc-remote")], repo)
    else:
        run(["dvc", "remote", "add", "-d", "team", f"s3://team-dvc/{tmp_path.name}"], repo)
        run(["dvc", "remote", "modify", "team", "endpointurl", s3.endpoint], repo)
        run(["dvc", "remote", "modify", "--local", "team", "access_key_id", s3.access_key], repo)
        run(["dvc", "remote", "modify", "--local", "team", "secret_access_key", s3.secret_key],
            repo)
    (repo / "sweeps/tiny.yaml").write_text(sweep)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "a DVC remote and a sweep"], repo)
    run(["git", "clone", "-q", "--bare", str(repo), str(tmp_path / "origin.git")], tmp_path)
    run(["git", "remote", "add", "origin", str(tmp_path / "origin.git")], repo)
    return repo


def bucket(s3, prefix: str) -> dict[str, bytes]:  # noqa: F811 - the fixture's value
    """Every object under `prefix` of the DVC bucket: key -> bytes."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.access_key,
                          aws_secret_access_key=s3.secret_key, region_name="us-east-1")
    keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(
        Bucket="team-dvc", Prefix=prefix) for o in page.get("Contents", [])]
    return {k: client.get_object(Bucket="team-dvc", Key=k)["Body"].read() for k in keys}


def sweep(repo: Path, env: dict, study: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "reprotrain.sweep", "run", "sweeps/tiny.yaml",
                             "--workers", "2", "--study", study, *args], cwd=repo, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(coordinator: subprocess.Popen) -> str:
    try:
        out, _ = coordinator.communicate(timeout=600)
    finally:
        coordinator.terminate()  # it stops its workers (SIGTERM to each one's process group)
        coordinator.wait(60)
    print(out)
    return out


def test_a_sweep_on_two_workers_prunes_restores_and_survives_a_killed_worker(tmp_path, postgres,  # noqa: F811
                                                                             s3):  # noqa: F811
    """On an S3 DVC remote whose keys only the coordinator's .dvc/config.local holds: the
    workers get them in their environment, and another machine restores the best trial."""
    repo = project(tmp_path, TINY, s3)
    uri = create_database(postgres, "sweep", schema=False)
    study = "tiny"
    coordinator = sweep(repo, s3_client_env(tmp_path, REPROTRAIN_SWEEP_STORAGE=uri), study)
    try:
        # SIGKILL to the worker's process group: as a node, a pod or the OOM killer takes a
        # worker with everything it started.
        victim = training_trial(uri, study, deadline_s=240)
        os.killpg(int(victim.user_attrs["worker"].split(":")[1]), signal.SIGKILL)
        killed = victim.number
    finally:
        out = finish(coordinator)
    assert coordinator.returncode == 0, out[-5000:]

    # Every trial ended; the killed one failed through its heartbeat and ran again elsewhere,
    # after it had ended (never twice at once); none is missing.
    trials = {t.number: t for t in trials_of(uri, study)}
    assert {t.state.name for t in trials.values()} <= {"COMPLETE", "PRUNED", "FAIL"}
    assert set(range(8)) <= set(trials)
    failed = [t for t in trials.values() if t.state.name == "FAIL"]
    assert [t.number for t in failed] == [killed], out[-5000:]
    (retry,) = [t for t in trials.values() if t.system_attrs.get("failed_trial") == killed]
    assert retry.state.name == "COMPLETE" and retry.params == trials[killed].params
    assert retry.datetime_start >= trials[killed].datetime_complete
    assert f"retried as trial {retry.number}" in out and "stopped sending heartbeats" in out

    # A point that had been trained and pushed is a run-cache restore, with the same result.
    complete = [t for t in trials.values() if t.state.name == "COMPLETE"]
    trained = [t for t in complete if t.user_attrs["retrained"]]
    restored = [t for t in complete if not t.user_attrs["retrained"]]
    assert trained and restored, out[-5000:]
    assert {t.value for t in restored} <= {t.value for t in trained}
    assert f"({len(restored)} restored from the run-cache)" in out

    # The pruned trials (BAD after a GOOD one completed) left no experiment, lock or run-cache
    # entry; their MLflow runs end KILLED, tagged, with the curve up to the stop.
    pruned = [t for t in trials.values() if t.state.name == "PRUNED"]
    assert pruned and all(t.params["lr"] == BAD for t in pruned), out[-5000:]
    refs = run(["git", "ls-remote", str(tmp_path / "origin.git")], tmp_path).stdout
    for t in complete:
        assert f"/{t.user_attrs['dvc_exp']}\n" in refs
    for t in pruned:
        assert f"/{t.user_attrs['dvc_exp']}\n" not in refs
    stored = bucket(s3, f"{tmp_path.name}/")
    cached_lrs = {YAML(typ="safe").load(body)["params"]["params.yaml"].get("lr")
                  for key, body in stored.items() if key.startswith(f"{tmp_path.name}/runs/")}
    assert BAD not in cached_lrs and GOOD in cached_lrs, cached_lrs
    # Every complete trial's outputs are in the bucket: each file its dvc.lock names for the
    # stages it ran (up to the objective's; the later ones are the sweep commit's).
    for t in complete:
        lock = YAML(typ="safe").load(run(["git", "show", f"{exp_ref(refs, t)}:dvc.lock"],
                                         tmp_path / "origin.git").stdout)
        for o in (o for name in ("prepare", "train") for o in lock["stages"][name]["outs"]):
            md5 = o["md5"]
            manifest = stored.get(f"{tmp_path.name}/files/md5/{md5[:2]}/{md5[2:]}")
            assert manifest is not None, (t.number, o["path"])
            if md5.endswith(".dir"):
                for entry in json.loads(manifest):
                    assert f"{tmp_path.name}/files/md5/{entry['md5'][:2]}/{entry['md5'][2:]}" \
                        in stored, (t.number, o["path"], entry["relpath"])

    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{repo / 'mlflow.db'}")
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    (parent,) = [r for r in runs if r.info.run_name == study]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    names = {r.info.run_name for r in children}
    assert {t.user_attrs["dvc_exp"] for t in trained + pruned} <= names
    for t in pruned:
        (r,) = [r for r in children if r.info.run_name == t.user_attrs["dvc_exp"]]
        assert r.data.tags["pruned"] == "true" and r.info.status == "KILLED"
        history = mlflow.MlflowClient().get_metric_history(r.info.run_id, "val/acc")
        assert len(history) == t.user_attrs["pruned_at_epoch"] == 1
    assert parent.data.params["sweep.trials"] == "8"

    # What a person reads: every complete trial pulled back, `make exps` sorted by the
    # objective, the picture, a progress line per change.
    listed = run(["dvc", "exp", "list", "--name-only"], repo).stdout.split()
    assert {t.user_attrs["dvc_exp"] for t in complete} <= set(listed)
    (repo / ".venv").symlink_to(Path(sys.executable).parents[1])
    table = run(["make", "-s", "exps", "EXPS_SORT=models/train/metrics.json:best_val_acc"],
                repo).stdout
    shown = [float(line.split()[1]) for line in table.splitlines()[1:]
             if line.startswith(f"{study}-")]
    assert len(shown) == len(complete) and shown == sorted(shown, reverse=True), table
    assert (repo / f".dvc/tmp/sweeps/{study}/trials.png").stat().st_size > 10_000
    progress = [ln for ln in out.splitlines() if re.match(r"\d\d:\d\d:\d\d \d/8 done", ln)]
    assert len(progress) == len(set(progress)) >= 5, out  # a line per change, and only then
    assert re.search(r"8/8 done: \d complete, \d pruned, 1 failed \(1 retried\), 0 running, "
                     r"0 waiting; best best_val_acc 0\.\d{4} \(trial \d: lr=0.01\)", progress[-1])

    # Another machine: a fresh clone of the git remote, the keys in its environment only,
    # restores the best trial's model with the lines the sweep printed, and trains nothing.
    import optuna

    best = optuna.load_study(study_name=study, storage=uri).best_trial
    exp = best.user_attrs["dvc_exp"]
    line = next(ln for ln in out.splitlines() if ln.startswith(f"best: {exp};"))
    other = tmp_path / "other"
    run(["git", "clone", "-q", str(tmp_path / "origin.git"), str(other)], tmp_path)
    keys = s3_client_env(tmp_path, AWS_ACCESS_KEY_ID=s3.access_key,
                         AWS_SECRET_ACCESS_KEY=s3.secret_key)
    restored_here = run(["bash", "-ec", line.split(": ", 2)[2]], other, env=keys)
    assert "Running stage" not in restored_here.stdout + restored_here.stderr
    lock = YAML(typ="safe").load((other / "dvc.lock").read_text())
    (model,) = [o for o in lock["stages"]["train"]["outs"] if o["path"] == "models/train/model.pt"]
    assert hashlib.md5((other / "models/train/model.pt").read_bytes()).hexdigest() == model["md5"]
    assert json.loads((other / "models/train/metrics.json").read_text())["best_val_acc"] == \
        best.value


def test_a_sweep_on_slurm_retries_the_trial_of_a_cancelled_task(tmp_path, postgres, slurm,  # noqa: F811
                                                                 monkeypatch):
    """The same workers as SLURM array tasks on a one-node cluster (munged, slurmctld, slurmd on
    loopback); `scancel` of the task that is training is a dead worker."""
    from reprotrain.sweep import slurm as launcher

    repo = project(tmp_path, TINY.replace("trials: 8", "trials: 4"))
    uri = create_database(postgres, "slurm_sweep", schema=False)
    env = env_with(REPROTRAIN_SWEEP_STORAGE=uri, **slurm)
    coordinator = sweep(repo, env, "onslurm", "--launcher", "slurm")
    try:
        victim = training_trial(uri, "onslurm", deadline_s=240)
        job, task = victim.user_attrs["slurm_task"].split("_")
        for k, v in slurm.items():  # scancel finds the cluster through SLURM_CONF
            monkeypatch.setenv(k, v)
        launcher.cancel(job, int(task))
    finally:
        out = finish(coordinator)
    assert coordinator.returncode == 0, out[-5000:]
    assert f"SLURM array job {job}: 2 tasks" in out
    trials = {t.number: t for t in trials_of(uri, "onslurm")}
    assert trials[victim.number].state.name == "FAIL"
    (retry,) = [t for t in trials.values() if t.system_attrs.get("failed_trial") == victim.number]
    assert retry.state.name == "COMPLETE" and retry.params == victim.params
    assert retry.datetime_start >= trials[victim.number].datetime_complete
    assert {t.state.name for t in trials.values()} <= {"COMPLETE", "PRUNED", "FAIL"}
    assert set(range(4)) <= set(trials)
    assert all(t.user_attrs["slurm_task"].startswith(f"{job}_") for t in trials.values())
    assert launcher.states(job)[int(task)] == "CANCELLED"


@pytest.mark.parametrize("old, new, message", [
    ("heartbeat_s: 1", "heartbeat_s: 1000000000", "heartbeat_s=1000000000 must be a whole number "
     "from 1 to 600"),
    ("grace_s: 4", "grace_s: 1000000000", "grace_s=1000000000 must be a whole number from 1 to 3600"),
    ("grace_s: 4", "grace_s: 4\nretries: 1000000000", "retries=1000000000 must be a whole number "
     "from 0 to 10"),
    ("trials: 8", "trials: 1000000000", "trials=1000000000 must be a whole number from 1 to 1000"),
    ("n_warmup_steps: 0", "n_warmup_steps: 1000000000",
     "pruner.n_warmup_steps=1000000000 must be from 0 to 1000000"),
    ("lr: {type: choice", "epochs: {type: int, low: 1, high: 100000000000000000000}\n  lr: {type: choice",
     "space.epochs: epochs=100000000000000000000 is invalid: must be >= 1 and <= 10000"),
    ("lr: {type: choice", "epochs: {type: int, low: 1, high: 5, step: -2}\n  lr: {type: choice",
     "space.epochs: step=-2 must be an int above 0 and at most high - low = 4"),
])
def test_every_number_of_a_sweep_file_is_bounded(tmp_path, old, new, message):
    """A sweep that would run for ever, never notice a dead worker or retry without end is
    refused before it starts; the params' own ranges (epochs) come from params.yaml's schema."""
    assert old in TINY
    with pytest.raises(SweepError) as e:
        load_sweep(sweep_file(tmp_path, TINY.replace(old, new)))
    assert message in str(e.value) and str(e.value).count("\n") == 0, str(e.value)


def test_a_range_optuna_cannot_draw_from_is_refused_before_it_starts(tmp_path):
    """`step: 1.0e-300` passed every check, then each worker died on its first trial with a
    decimal.InvalidOperation traceback (Optuna divides high - low by step in 28 digits), the
    trial stayed RUNNING and the sweep said to start more workers."""
    old = f"lr: {{type: choice, values: [{GOOD}, {BAD}]}}"
    assert old in TINY
    with pytest.raises(SweepError) as e:
        load_sweep(sweep_file(tmp_path, TINY.replace(
            old, "lr: {type: float, low: 0.001, high: 0.1, step: 1.0e-300}")))
    assert str(e.value) == (f"{tmp_path / 'sweep.yaml'}: space.lr: step=1e-300 is too fine for "
                            "low=0.001 and high=0.1: Optuna cannot make a range of it; use a "
                            "coarser step"), str(e.value)


def test_every_mistake_of_a_sweep_file_gets_its_line(tmp_path):
    bad = TINY.replace("trials: 8", "trails: 8").replace("name: random", "name: annealing") \
        .replace("grace_s: 4", "grace_s: 1000000000").replace("width: 8", "width: 0")
    p = run([sys.executable, "-m", "reprotrain.sweep", "run", str(sweep_file(tmp_path, bad)),
             "--storage", NO_DB], ROOT, check=False)
    lines = p.stderr.splitlines()
    assert p.returncode == 1 and len(lines) == 4 and all(ln.startswith("error: ") for ln in lines), \
        p.stderr
    for part in ("unknown key 'trails'; did you mean 'trials'?", "sampler.name='annealing'",
                 "grace_s=1000000000 must be", "params.model.width: model.width=0 is invalid"):
        assert sum(part in ln for ln in lines) == 1, (part, p.stderr)


@pytest.mark.parametrize("args, message", [
    (["--trials", "1000000000"], "TRIALS=1000000000 must be a whole number from 1 to 1000; for "
     "more, run several studies"),
    (["--trials", "2", "--workers", "3"], "WORKERS=3 is more than TRIALS=2"),
    (["--trials", "256", "--workers", "256"], "WORKERS=256 local workers: this machine has"),
    (["--workers", "100000", "--launcher", "slurm"], "WORKERS=100000 must be from 1 to 256"),
])
def test_trials_and_workers_are_bounded_before_anything_starts(tmp_path, args, message):
    """TRIALS=1000000000 once enqueued 5,504 trials in a minute and took the study's name."""
    storage = f"sqlite:///{tmp_path}/study.db" if "--workers" not in args else NO_DB
    p = run([sys.executable, "-m", "reprotrain.sweep", "run", "sweeps/lr.yaml", *args, "--storage",
             storage], ROOT, check=False, timeout=60)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and message in p.stderr, p.stderr
    assert not (tmp_path / "study.db").exists()


def test_a_hung_storage_ends_the_sweep_in_seconds_with_one_line(tmp_path):
    """A database host that takes the connection and never answers (a hung server, a firewall
    that drops): psycopg's default wait is 130 s, and then a traceback."""
    import socket

    repo = copy_repo(tmp_path / "repo")
    run(["git", "clone", "-q", "--bare", str(repo), str(tmp_path / "origin.git")], tmp_path)
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen()  # never accepted: the kernel completes the handshake, nobody answers
        port = hung.getsockname()[1]
        t0 = time.monotonic()
        p = run([sys.executable, "-m", "reprotrain.sweep", "run", "sweeps/lr.yaml", "--trials", "3",
                 "--remote", str(tmp_path / "origin.git"), "--study", "hung", "--storage",
                 f"postgresql://optuna@127.0.0.1:{port}/sweeps"], repo, check=False, timeout=60)
        took = time.monotonic() - t0
    assert p.returncode == 1 and took < 40, (took, p.stdout, p.stderr)
    assert p.stderr.startswith("error: cannot open the study storage") and \
        p.stderr.count("\n") == 1, p.stderr
    # What it was about to do, said before it started: the plan, without secrets.
    (plan,) = [ln for ln in p.stdout.splitlines() if ln.startswith("sweep hung:")]
    assert "3 trials x 10 epochs" in plan and "minimize best_val_loss" in plan, plan
    assert "1 local worker" in plan and "postgresql storage" in plan and "optuna@" not in plan


def test_one_worker_is_singular_and_the_docs_sqlite_study_is_ignored_by_git():
    """Issue 57: `on 1 local workers`, and docs/sweeps.md's `sqlite:///sweep.db` left an
    untracked file in `git status`."""
    from reprotrain.sweep.launch import workers_text

    assert workers_text(1, "local") == "1 local worker"
    assert workers_text(4, "slurm") == "4 slurm workers"
    assert subprocess.run(["git", "check-ignore", "-q", "sweep.db"], cwd=ROOT).returncode == 0


def test_the_trials_table_shows_the_objective_s_whole_name():
    """The header was cut to `best_va`; the values line up under the whole name."""
    import optuna
    from optuna.distributions import FloatDistribution

    from reprotrain.sweep.report import summary

    study = optuna.create_study(direction="minimize")
    for lr, loss in ((0.003, 0.0213), (0.03, 0.0871)):
        study.add_trial(optuna.trial.create_trial(
            params={"lr": lr}, distributions={"lr": FloatDistribution(1e-4, 0.1, log=True)},
            value=loss, user_attrs={"retrained": True, "run_s": 40.0}))
    # A pruned trial's value is the epoch's val_loss the pruner judged, which can look better
    # than a complete trial's best: it goes in the note, not under the objective's name.
    study.add_trial(optuna.trial.create_trial(
        params={"lr": 0.01}, distributions={"lr": FloatDistribution(1e-4, 0.1, log=True)},
        value=0.0199, state=optuna.trial.TrialState.PRUNED,
        user_attrs={"pruned_at_epoch": 9, "run_s": 30.0}))
    spec = {"objective": {"metric": "best_val_loss", "direction": "minimize",
                          "per_epoch": "val_loss"}}
    header, *rows = summary(study, spec).splitlines()[1:]
    assert "best_val_loss" in header.split(), header
    end = header.index("best_val_loss") + len("best_val_loss")
    assert [row[:end].split()[-1] for row in rows] == ["0.0213", "0.0871", "-"], (header, rows)
    assert rows[2].endswith("pruned after epoch 9 (val_loss 0.0199 then)"), rows[2]


def test_the_shipped_sweeps_rank_by_validation_loss():
    """On the digits most trials reach best_val_acc 1.0: a tie the study broke by order. The
    validation loss tells them apart (docs/sweeps.md has a sweep that shows it)."""
    for name in ("lr.yaml", "lr_grid.yaml"):
        obj = load_sweep(ROOT / "sweeps" / name)["objective"]
        assert (obj["metric"], obj["direction"], obj["per_epoch"]) == \
            ("best_val_loss", "minimize", "val_loss"), (name, obj)


def test_a_local_dvc_remote_reaches_the_workers_clones(tmp_path):
    """`dvc remote add -d --local` commits nothing (HEAD stays, earlier experiments stay in
    `make exps`), but git does not carry .dvc/config.local: the workers' clones get its URL."""
    from reprotrain.sweep.worker import has_dvc_remote, shared_dvc_remote, use_dvc_remote

    repo = tmp_path / "repo"
    run(["git", "init", "-q", str(repo)], tmp_path)
    run(["dvc", "init", "-q"], repo)
    run(["git", "commit", "-qm", "dvc init"], repo)
    run(["dvc", "remote", "add", "-d", "--local", "storage", "../store"], repo)
    shared = shared_dvc_remote(repo)
    assert shared == {"url": str(tmp_path / "store")}  # absolute: a clone lives elsewhere
    run(["git", "clone", "-q", str(repo), str(tmp_path / "clone")], tmp_path)
    assert not has_dvc_remote(tmp_path / "clone")
    assert use_dvc_remote(tmp_path / "clone", shared) and has_dvc_remote(tmp_path / "clone")


@pytest.mark.parametrize("pushed, lr", [("raw.dvc prepare", "0.01"), ("raw.dvc", "0.01"),
                                        ("raw.dvc prepare", "0.1"), ("raw.dvc prepare train", "0.1")])
def test_a_trial_pulls_what_its_stages_read_not_the_dataset_prepare_read(tmp_path, pushed, lr):
    """A dataset folder `dvc add`ed and prepared: a worker's clone gets data/prepared for
    train from the DVC remote, never the source images (which a large dataset would have each
    worker download beside its shards). Where no one pushed data/prepared, the trial pulls the
    folder and reruns prepare; at the commit's own point (lr 0.1) it pulls the commit's model,
    or trains where no one pushed it: as plain `--pull` did."""
    from reprotrain.sweep.worker import exp_run

    repo = tmp_path / "repo"
    run(["git", "init", "-q", str(repo)], tmp_path)
    run(["dvc", "init", "-q"], repo)
    (repo / "raw").mkdir()
    (repo / "raw/0.jpg").write_bytes(b"the source image")
    (repo / "params.yaml").write_text("lr: 0.1\n")
    (repo / "dvc.yaml").write_text(
        "stages:\n"
        "  prepare: {cmd: mkdir -p prepared && tac raw/0.jpg > prepared/shard.tar && echo >>"
        " prepared/shard.tar, deps: [raw], outs: [prepared]}\n"
        "  train: {cmd: cat prepared/shard.tar params.yaml > model.pt, deps: [prepared],"
        " params: [lr], outs: [model.pt]}\n")
    run(["dvc", "add", "-q", "raw"], repo)
    run(["dvc", "remote", "add", "-d", "store", "../store"], repo)
    run(["dvc", "repro", "-q"], repo)
    run(["dvc", "push", "-q", *pushed.split()], repo)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "a prepared dataset"], repo)
    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(repo), str(clone)], tmp_path)

    out = exp_run("trial 0", "lr-0", [f"lr={lr}"], "train", clone, env_with(), dvc_remote=True)
    assert out.returncode == 0, out.stdout
    assert (clone / "model.pt").read_bytes() == f"the source image\nlr: {lr}\n".encode()
    assert run(["dvc", "exp", "list", "--name-only"], clone).stdout.split() == ["lr-0"]
    source = hashlib.md5(b"the source image").hexdigest()
    in_cache = (clone / ".dvc/cache/files/md5" / source[:2] / source[2:]).exists()
    assert ("Running stage 'prepare'" in out.stdout) == (pushed == "raw.dvc"), out.stdout
    # Trained unless the commit's model was there to pull.
    assert ("Running stage 'train'" in out.stdout) == ("train" not in pushed), out.stdout
    # The folder came where prepare reran, and for the commit's unpushed model (plain --pull).
    fetched = pushed == "raw.dvc" or (lr == "0.1" and "train" not in pushed)
    assert (clone / "raw").exists() == in_cache == fetched, out.stdout


def test_a_local_s3_remote_reaches_the_workers_with_its_endpoint_and_keys_apart(tmp_path, s3,  # noqa: F811
                                                                                monkeypatch):
    """An S3 remote added --local: the study carries its URL and endpoint but no key (the team's
    database keeps it); the keys go to the workers in their environment, and a worker's clone
    pulls what the workspace pushed."""
    from reprotrain.sweep.worker import dvc_remote_keys, shared_dvc_remote, use_dvc_remote

    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    repo = tmp_path / "repo"
    run(["git", "init", "-q", str(repo)], tmp_path)
    run(["dvc", "init", "-q"], repo)
    (repo / "data.txt").write_text("what a trial needs\n")
    run(["dvc", "add", "-q", "data.txt"], repo)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "data"], repo)
    url = f"s3://team-dvc/{tmp_path.name}"
    for args in (["add", "-d", "--local", "team", url],
                 ["modify", "--local", "team", "endpointurl", s3.endpoint],
                 ["modify", "--local", "team", "access_key_id", s3.access_key],
                 ["modify", "--local", "team", "secret_access_key", s3.secret_key]):
        run(["dvc", "remote", *args], repo)
    run(["dvc", "push", "-q"], repo, env=s3_client_env(tmp_path))

    shared = shared_dvc_remote(repo)
    assert shared == {"url": url, "endpointurl": s3.endpoint}
    keys = dvc_remote_keys(repo)
    assert keys == {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}
    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(repo), str(clone)], tmp_path)
    assert use_dvc_remote(clone, shared)
    assert s3.secret_key not in (clone / ".dvc/config.local").read_text()
    run(["dvc", "pull", "-q"], clone, env=s3_client_env(tmp_path, **keys))
    assert (clone / "data.txt").read_text() == "what a trial needs\n"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "set-by-the-user")  # the environment's keys win
    assert "AWS_ACCESS_KEY_ID" not in dvc_remote_keys(repo)


def test_a_git_remote_with_a_password_is_refused_unseen(tmp_path):
    """Workers clone the remote's URL: a token in it would be on every worker's `git clone`
    command line (`ps`), in each clone's .git/config and in the study for every user of its
    storage. Refused before any work, without showing it, whether REMOTE names it or is it."""
    repo = copy_repo(tmp_path / "repo")
    token, url = "ghp_S3cr3tT0ken", "https://sweeper:ghp_S3cr3tT0ken@127.0.0.1:1/team/repo.git"
    # Then a token as an https URL's user name, refused alike (and never shown: test_redact.py).
    bare = url.replace("sweeper:", "")
    run(["git", "remote", "add", "origin", url], repo)
    for origin, remote in ((url, "origin"), (url, url), (bare, "origin"), (bare, bare)):
        run(["git", "remote", "set-url", "origin", origin], repo)
        p = run([sys.executable, "-m", "reprotrain.sweep", "run", "sweeps/lr.yaml", "--trials", "1",
                 "--remote", remote, "--study", "token", "--storage",
                 "postgresql://optuna@127.0.0.1:1/sweeps"], repo, check=False, timeout=120)
        assert p.returncode == 1 and token not in p.stdout + p.stderr, (p.stdout, p.stderr)
        assert p.stderr.startswith("error: REMOTE=") and "holds a password or a token" in \
            p.stderr and "https://***@127.0.0.1:1/team/repo.git" in p.stderr and \
            p.stderr.count("\n") == 1, p.stderr


def test_a_local_default_dvc_remote_wins_over_the_committed_one_in_the_workers_clones(tmp_path):
    """README's S3 block commits an S3 default whose keys stay --local; docs/sweeps.md's recipe
    then makes a folder the workspace's default with `dvc remote add -d --local`. The workers'
    clones kept the committed S3 default, without keys, and every trial failed `Unable to locate
    credentials`: they use the remote the workspace uses."""
    from reprotrain.sweep.worker import (
        dvc_remote_keys,
        remote_for_clones,
        shared_dvc_remote,
        use_dvc_remote,
    )

    repo = tmp_path / "repo"
    run(["git", "init", "-q", str(repo)], tmp_path)
    run(["dvc", "init", "-q"], repo)
    (repo / "data.txt").write_text("what a trial needs\n")
    run(["dvc", "add", "-q", "data.txt"], repo)
    run(["dvc", "remote", "add", "-d", "team", "s3://team-dvc/none"], repo)
    run(["dvc", "remote", "modify", "team", "endpointurl", "http://127.0.0.1:1"], repo)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "data and an S3 remote"], repo)
    run(["dvc", "remote", "modify", "--local", "team", "access_key_id", "KEY"], repo)
    run(["dvc", "remote", "modify", "--local", "team", "secret_access_key", "SECRET"], repo)
    run(["dvc", "remote", "add", "-d", "--local", "storage", str(tmp_path / "store")], repo)
    run(["dvc", "push", "-q"], repo)  # to the folder, the workspace's default

    shared = shared_dvc_remote(repo)
    assert shared == {"url": str(tmp_path / "store")} and dvc_remote_keys(repo) == {}
    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(repo), str(clone)], tmp_path)
    assert use_dvc_remote(clone, shared)
    pulled = run(["dvc", "pull"], clone, env=s3_client_env(tmp_path), check=False)
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    assert (clone / "data.txt").read_text() == "what a trial needs\n"
    # The sweep's last line, which restores the best trial on another machine, gives that
    # machine's clone the same remote first (its `dvc pull` went to the committed one).
    reader = tmp_path / "reader"
    run(["git", "clone", "-q", str(repo), str(reader)], tmp_path)
    run(["bash", "-ec", remote_for_clones(repo) + "dvc pull -q"], reader,
        env=s3_client_env(tmp_path))
    assert (reader / "data.txt").read_text() == "what a trial needs\n"

    # Where the workspace uses the committed default, the clone keeps its own (every option).
    run(["dvc", "remote", "default", "--local", "--unset"], repo)
    assert remote_for_clones(repo) == ""
    again = tmp_path / "again"
    run(["git", "clone", "-q", str(repo), str(again)], tmp_path)
    assert use_dvc_remote(again, shared_dvc_remote(repo))
    assert not (again / ".dvc/config.local").exists()


@pytest.mark.parametrize("url", ["https://ghp_S3cr3tT0ken@127.0.0.1:9/dvcstore",
                                 "https://u:S3cr3tT0ken@127.0.0.1:9/dvcstore"])
def test_a_dvc_remote_with_a_token_or_password_in_its_url_never_reaches_the_study(tmp_path,
                                                                                 capsys, url):
    # Issue 42.3, second pass: only a password was refused; a token as the user name went into
    # the study's attributes and every worker's config.
    from reprotrain.sweep.worker import shared_dvc_remote

    run(["git", "init", "-q", str(tmp_path)], tmp_path)
    run(["dvc", "init", "-q"], tmp_path)
    run(["dvc", "remote", "add", "-d", "--local", "r", url], tmp_path)
    assert shared_dvc_remote(tmp_path) == {}
    said = capsys.readouterr().err
    assert "password or a token in its URL" in said and "S3cr3tT0ken" not in said


def test_a_sweep_whose_every_trial_failed_exits_1_naming_the_cause(tmp_path):
    """Every trial failed `Unable to locate credentials` (an S3 remote without keys), and `make
    sweep` exited 0: now 1, with one line that names the first failed trial's cause."""
    repo = project(tmp_path, TINY.replace("trials: 8", "trials: 2"))
    run(["dvc", "remote", "add", "-d", "team", "s3://team-dvc/none"], repo)  # no keys anywhere
    run(["dvc", "remote", "modify", "team", "endpointurl", "http://127.0.0.1:1"], repo)
    run(["git", "commit", "-qm", "an S3 remote", ".dvc/config"], repo)
    run(["git", "push", "-q", "origin", "HEAD"], repo)
    env = s3_client_env(tmp_path, REPROTRAIN_SWEEP_STORAGE=f"sqlite:///{tmp_path}/study.db")
    p = run([sys.executable, "-m", "reprotrain.sweep", "run", "sweeps/tiny.yaml", "--workers", "1",
             "--study", "nokeys"], repo, env=env, check=False)
    assert p.returncode == 1 and p.stderr.count("\n") == 1, (p.stdout[-3000:], p.stderr)
    assert p.stderr.startswith("error: no trial of study nokeys completed: 2 failed") and \
        "Unable to locate credentials" in p.stderr, p.stderr
    assert "; give the DVC remote its keys: `dvc remote modify --local team access_key_id" in \
        p.stderr, p.stderr
    assert "study nokeys: 0 complete (0 restored from the run-cache), 0 pruned, 2 failed" in p.stdout
    assert (repo / ".dvc/tmp/sweeps/nokeys/trials.png").stat().st_size > 5_000  # in words


def test_the_picture_of_a_sweep_without_a_complete_trial_says_so():
    """Every trial failed: the picture had empty axes from -0.05 to 0.05 and a legend of
    markers drawn nowhere. It says that no trial completed, and why the first one failed."""
    import optuna
    from optuna.distributions import FloatDistribution

    from reprotrain.sweep.report import figure

    study = optuna.create_study(study_name="nokeys", direction="minimize")
    for lr in (0.003, 0.03):
        study.add_trial(optuna.trial.create_trial(
            params={"lr": lr}, distributions={"lr": FloatDistribution(1e-4, 0.1, log=True)},
            state=optuna.trial.TrialState.FAIL, user_attrs={
                "fail_reason": "ERROR: Failed to reproduce experiment '60e73b1': Unable to "
                               "locate credentials"}))
    spec = {"objective": {"metric": "best_val_loss", "direction": "minimize",
                          "per_epoch": "val_loss"},
            "space": {"lr": {"type": "float", "low": 1e-4, "high": 0.1, "log": True}}}
    fig = figure(study, spec)
    words = " ".join(t.get_text() for ax in fig.axes for t in [ax.title, *ax.texts])
    assert "no trial completed" in words and "Unable to locate credentials" in words, words
    assert not any(ax.axison for ax in fig.axes)  # no axis of numbers that no trial has
