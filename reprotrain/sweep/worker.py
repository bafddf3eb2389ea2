"""One worker, on any engine: its own clone of the remote at the sweep's commit, then waiting
trials claimed one by one, each a `dvc exp run` whose experiment is pushed and whose objective
goes to the study, while a heartbeat says the worker is alive."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from reprotrain import tracking
from reprotrain.sweep.spec import SweepError, is_finite, warnings_quiet
from reprotrain.sweep.study import reach_storage, sampler_for, shown, storage_uri, suggest
from reprotrain.sweep.trial import hook_env
from stages.checkpoints import remove_run
from stages.config import load_params


def worker(study_name: str, workdir: Path, keep: bool = False) -> None:
    """Claim waiting trials and run each as a DVC experiment, until none is waiting or running."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    uri = storage_uri(None, 1)
    try:
        plain = optuna.load_study(study_name=study_name, storage=reach_storage(uri))
    except KeyError:
        raise SweepError(f"no study {study_name!r} in {shown(uri)}") from None
    spec, about = plain.user_attrs["sweep"], plain.user_attrs
    storage = reach_storage(uri, spec)
    study = optuna.load_study(study_name=study_name, storage=storage)
    study_id = storage.get_study_id_from_name(study_name)
    me = f"{platform.node()}:{os.getpid()}"
    clone = clone_at(about["remote"], about["commit"], workdir / study_name / me.replace(":", "-"))
    dvc_remote = use_dvc_remote(clone, about.get("dvc_remote", ""))
    print(f"worker {me}: {clone} at {about['commit'][:7]}", flush=True)
    while (trial_id := claim(study, storage, study_id, spec["heartbeat_s"])) is not None:
        with heartbeat(storage, trial_id, spec["heartbeat_s"]):
            study.sampler = sampler_for(spec, storage.get_trial_number_from_id(trial_id))
            trial = optuna.Trial(study, trial_id)
            trial.set_user_attr("worker", me)
            if os.environ.get("SLURM_ARRAY_JOB_ID"):  # what `scancel` takes
                trial.set_user_attr("slurm_task", f"{os.environ['SLURM_ARRAY_JOB_ID']}_"
                                                  f"{os.environ['SLURM_ARRAY_TASK_ID']}")
            run_trial(study, storage, trial, clone, spec, about, dvc_remote)
    if not keep:
        shutil.rmtree(clone, ignore_errors=True)


def claim(study, storage, study_id: int, wait_s: float) -> int | None:
    """A waiting trial, now RUNNING for this worker alone (the database flips its state once);
    None when none waits and none runs. While others run, wait: one of them may be a dead
    worker's, failed and queued again once its heartbeat is older than the grace period."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.storages import fail_stale_trials
    from optuna.trial import TrialState

    while True:
        with warnings_quiet():
            fail_stale_trials(study)
        for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
            with contextlib.suppress(UpdateFinishedTrialError):
                if storage.set_trial_state_values(trial_id, TrialState.RUNNING):
                    return trial_id
        if not study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING)):
            return None
        time.sleep(wait_s)


@contextlib.contextmanager
def heartbeat(storage, trial_id: int, every_s: float):
    stop = threading.Event()

    def beat() -> None:
        while True:
            with contextlib.suppress(Exception):  # a missed beat is late, not fatal
                storage.record_heartbeat(trial_id)
            if stop.wait(every_s):
                return

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def run_trial(study, storage, trial, clone: Path, spec: dict, about: dict, dvc_remote: bool) -> None:
    """One trial: a DVC experiment up to the objective's stage, pushed, its objective told."""
    from optuna.trial import TrialState

    values = suggest(trial, spec["space"])
    name = f"{study.study_name}-{trial.number}"
    trial.set_user_attr("dvc_exp", name)
    reset(clone, about["commit"])
    sets = [f"{k}={v if isinstance(v, str) else json.dumps(v)}"
            for k, v in {**spec["params"], **values}.items()]
    env = {**os.environ, **hook_env(study.study_name, trial.number),
           tracking.PARENT_RUN_ENV: about.get("mlflow_parent_run") or ""}
    t0 = time.perf_counter()
    out = exp_run(f"trial {trial.number}", name, sets, spec["objective"]["stage"], clone, env,
                  dvc_remote)
    trial.set_user_attr("run_s", round(time.perf_counter() - t0, 1))
    if out.returncode != 0:
        # The train stage exits trial.PRUNED_EXIT, which DVC does not pass on: the stage
        # marks the trial instead.
        attrs = storage.get_trial(storage.get_trial_id_from_study_id_trial_number(
            storage.get_study_id_from_name(study.study_name), trial.number)).user_attrs
        if "pruned_at_epoch" in attrs:
            study.tell(trial, state=TrialState.PRUNED)
            return
        trial.set_user_attr("fail_reason", last_error(out.stdout))
        study.tell(trial, state=TrialState.FAIL)
        return
    # "Running stage 'train'" only when it trained: a run-cache restore prints "is cached".
    trial.set_user_attr("retrained", "Running stage 'train'" in out.stdout)
    pushed = logged([dvc(), "exp", "push", *([] if dvc_remote else ["--no-cache"]), "origin", name],
                    clone, env)
    shared = logged([sys.executable, "-m", "reprotrain.team.share"], clone, env) if dvc_remote else pushed
    obj = spec["objective"]
    value = json.loads((clone / obj["file"]).read_text()).get(obj["metric"])
    if pushed.returncode or shared.returncode:
        why = "push: " + last_error(pushed.stdout + shared.stdout)
    elif not is_finite(value, float):
        why = f"{obj['file']} has {obj['metric']}={value!r}, not a finite number"
    else:
        study.tell(trial, float(value))
        return
    trial.set_user_attr("fail_reason", why)
    study.tell(trial, state=TrialState.FAIL)


def exp_run(label: str, name: str, sets: list[str], stage: str, clone: Path, env: dict,
            dvc_remote: bool) -> subprocess.CompletedProcess:
    """The trial's `dvc exp run`. With a DVC remote, `--pull --allow-missing` first: DVC pulls
    the deps of the stages that run and nothing of those it skips, so a clone fetches
    data/prepared for train, not also the dataset folder an unchanged prepare read. Where the
    trial's point is the commit's own, DVC skips `stage` too, without its outputs: they are
    pulled. Plain `--pull` where that fails, or where the remote lacks what a skipped stage
    made (data/prepared never pushed: DVC cannot check out the running stage's dep, and says
    so); it fetches the folder and reruns prepare, or trains, where it must. Once a clone at
    most: the clone keeps data/prepared, and the trial's push shares it."""
    for pull in (["--pull", "--allow-missing"], ["--pull"]) if dvc_remote else ([],):
        argv = [dvc(), "exp", "run", *pull, "-n", name, *[a for s in sets for a in ("-S", s)],
                stage]
        print(f"{label}: {' '.join(argv[1:])}", flush=True)
        out = logged(argv, clone, env)
        if "--allow-missing" not in pull:
            return out
        if out.returncode:
            if "Checkout failed for following targets" not in out.stdout:
                return out
            continue
        if all((clone / path).exists() for path in outputs(clone, stage)):
            return out
        if logged([dvc(), "pull", stage], clone, env).returncode == 0:
            return out
        logged([dvc(), "exp", "remove", name], clone, env)  # the experiment took its name
    return out


def outputs(clone: Path, stage: str) -> list[str]:
    """The paths dvc.lock names as `stage`'s outputs."""
    from ruamel.yaml import YAML

    lock = YAML(typ="safe").load((clone / "dvc.lock").read_text())
    return [o["path"] for o in lock["stages"].get(stage, {}).get("outs", [])]


def reset(clone: Path, commit: str) -> None:
    """Each trial starts from the commit. A pruned trial leaves the lock entry of the trial
    before it, whose outputs DVC removed: a later trial of that point would find the stage
    "unchanged" and pull the cached outputs alone, without metrics.json. And its checkpoint,
    which a later trial of its point would resume into the pruned trial's MLflow run."""
    for name in ("params.yaml", "dvc.lock"):  # deleted: git restores them whatever its index says
        (clone / name).unlink(missing_ok=True)
    subprocess.run(["git", "-C", str(clone), "reset", "-q", "--hard", commit], check=True)
    # Only run folders this clone wrote: train.checkpoint_dir may be a folder others share.
    root = clone / load_params(clone / "params.yaml").train.checkpoint_dir
    for run_dir in root.iterdir() if root.is_dir() else ():
        remove_run(run_dir, clone.resolve())


def logged(argv: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    """Run it, its output to this worker's log (stdout) as it comes, and kept for reading."""
    env = {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"}
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        lines.append(line)
    sys.stdout.flush()
    return subprocess.CompletedProcess(argv, proc.wait(), "".join(lines))


def last_error(output: str) -> str:
    """The cause: a stage's own one-line `error: ...` before DVC's `ERROR: failed to reproduce`."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    ours = [ln for ln in lines if ln.startswith(("error:", "fatal:"))]
    theirs = [ln for ln in lines if ln.startswith("ERROR")]
    return (ours or theirs or lines or ["no output"])[-1][:300]


def dvc() -> str:
    return str(Path(sys.executable).parent / "dvc")


def clone_at(remote: str, commit: str, folder: Path) -> Path:
    """A clone of the remote at the sweep's commit: this worker's own workspace."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    git = ["git", "-C", str(folder)]
    for argv in (["git", "clone", "-q", remote, str(folder)], [*git, "checkout", "-q", commit]):
        p = subprocess.run(argv, capture_output=True, text=True)
        if p.returncode:
            raise SweepError(f"{' '.join(argv[:3])}: {last_error(p.stderr)}")
    # `dvc exp run` commits: a container or a fresh node may have no git identity.
    if subprocess.run([*git, "config", "user.email"], capture_output=True).returncode:
        subprocess.run([*git, "config", "user.name", "reprotrain sweep"], check=True)
        subprocess.run([*git, "config", "user.email", "sweep@localhost"], check=True)
    return folder


# What a worker's clone may be told of the coordinator's DVC remote through the study, which
# the team's database keeps: where and how to connect (an S3 endpoint, its region, a private
# CA), never a key.
SHARED_OPTIONS = ("url", "endpointurl", "region", "profile", "ssl_verify")
# An S3 remote's keys, which `dvc remote modify --local` keeps in .dvc/config.local (git does
# not carry it to the workers' clones): they travel in the workers' environment instead, as the
# variables boto3 reads (local processes inherit it; sbatch exports it to the tasks).
KEY_ENV = {"access_key_id": "AWS_ACCESS_KEY_ID", "secret_access_key": "AWS_SECRET_ACCESS_KEY",
           "session_token": "AWS_SESSION_TOKEN"}


def default_dvc_remote(repo: Path) -> tuple[str, dict]:
    """The workspace's default DVC remote, its name and options (.dvc/config and config.local)."""
    from dvc.repo import Repo

    with Repo(str(repo)) as r:
        name = r.config["core"].get("remote") or ""
        return name, dict(r.config["remote"].get(name, {})) if name else {}


def shared_dvc_remote(repo: Path) -> dict[str, str]:
    """The default DVC remote's URL and connection options, for clones that lack it: one added
    with `dvc remote add -d --local` lives in .dvc/config.local, which git does not carry (and
    committing .dvc/config would move HEAD, away from the earlier experiments' commit). Empty when
    there is none, or when its URL holds a password or a token (the study's attributes are no
    place for them)."""
    from reprotrain.redact import holds_credentials

    name, conf = default_dvc_remote(repo)
    if holds_credentials(str(conf.get("url", ""))):
        print(f"warning: the DVC remote {name!r} has a password or a token in its URL, so "
              "workers get no DVC remote from here; commit a remote without it", file=sys.stderr)
        return {}
    return shared_options(conf)


def remote_for_clones(repo: Path) -> str:
    """The commands that give a clone of `repo` its default DVC remote where git does not carry
    it (`dvc remote add -d --local`, alone or over a committed default), ending in ` && `; empty
    where the committed default is that remote, or where its URL holds a password."""
    from dvc.repo import Repo

    from reprotrain.redact import holds_credentials

    def default(config: dict) -> dict[str, str]:
        name = config.get("core", {}).get("remote") or ""
        return shared_options(dict(config.get("remote", {}).get(name, {}))) if name else {}

    with Repo(str(repo)) as r:
        ours, theirs = default(r.config), default(r.config.load_config_to_level("local"))
    if not ours.get("url") or ours == theirs or holds_credentials(ours["url"]):
        return ""
    steps = [f"dvc remote add -d --local sweep {shlex.quote(ours.pop('url'))}"]
    steps += [f"dvc remote modify --local sweep {k} {shlex.quote(v)}" for k, v in ours.items()]
    return " && ".join(steps) + " && "


def shared_options(conf: dict) -> dict[str, str]:
    return {k: str(conf[k]).lower() if isinstance(conf[k], bool) else str(conf[k])
            for k in SHARED_OPTIONS if k in conf}


def dvc_remote_keys(repo: Path) -> dict[str, str]:
    """The default S3 remote's keys as AWS_* variables for the workers, where the environment
    does not already set them."""
    _, conf = default_dvc_remote(repo)
    if not str(conf.get("url", "")).startswith("s3://"):
        return {}
    return {env: str(conf[k]) for k, env in KEY_ENV.items() if k in conf and env not in os.environ}


def use_dvc_remote(clone: Path, remote: dict[str, str] | str) -> bool:
    """The coordinator's default DVC remote (`remote`), as the clone's local default, unless the
    clone's own default is that one (same URL and options: then it keeps every option it has).
    The workspace's default may be a --local one over another committed default (docs/sweeps.md's
    folder over README's S3 remote): the workers used the committed one, whose keys they lacked,
    while the workspace pulled from its own. Without `remote` (its URL held a password), the
    clone's own. A study made before the options travelled holds the bare URL."""
    options = {"url": remote} if isinstance(remote, str) else dict(remote)
    own = shared_options(default_dvc_remote(clone)[1])
    if not options.get("url") or all(own.get(k) == v for k, v in options.items()):
        return has_dvc_remote(clone)
    subprocess.run([dvc(), "remote", "add", "-q", "-d", "--local", "sweep", options.pop("url")],
                   cwd=clone, check=True, capture_output=True)
    for key, value in options.items():
        subprocess.run([dvc(), "remote", "modify", "-q", "--local", "sweep", key, value],
                       cwd=clone, check=True, capture_output=True)
    return True


def has_dvc_remote(clone: Path) -> bool:
    p = subprocess.run([dvc(), "remote", "default"], cwd=clone, capture_output=True, text=True)
    return p.returncode == 0 and bool(p.stdout.strip())
