"""`make sweep`: an Optuna study whose trials are DVC experiments, run by workers on any engine.

    python -m stages.sweep run sweeps/lr.yaml --trials 8 --workers 2 --launcher local --remote origin
    python -m stages.sweep worker --study NAME     # what every engine starts, N times
    python -m stages.sweep status --study NAME     # the table and the picture, at any time

The study lives in a database (REPROTRAIN_SWEEP_STORAGE: PostgreSQL for parallel workers) and
holds everything a worker needs: the sweep file, the git remote and the pinned commit. `run`
checks the sweep file, creates the study with one waiting trial per slot, opens the MLflow
parent run, starts the workers (local processes or a SLURM array) and prints a line per change.
A worker clones the remote at the commit (one workspace runs one experiment at a time: DVC's
lock), then claims waiting trials one by one: `dvc exp run --pull -n <study>-<n> -S ...`,
`dvc exp push`, `make share`, the objective from the metrics file to the study. Its heartbeat
marks it alive; a trial whose worker died is failed by the next worker that looks and queued
again (Optuna's RetryHeartbeatStaleTrialCallback).
"""

from __future__ import annotations

import contextlib
import difflib
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from stages import tracking
from stages.checkpoints import remove_run
from stages.config import ParamsError, check_params, load_params, read_params, unknown_key
from stages.lib.cli import ArgumentParser, UserError
from stages.lib.strict_yaml import YamlError, read_yaml
from stages.sweep.trial import PRUNERS, STORAGE_ENV, STUDY_ENV, TRIAL_ENV

SAMPLERS = {"tpe": "TPESampler", "random": "RandomSampler"}
SWEEP_KEYS = {"objective", "trials", "sampler", "pruner", "params", "space", "heartbeat_s",
              "grace_s", "retries"}
SPACE_TYPES = ("float", "int", "choice")
PER_EPOCH = ("val_acc", "val_loss")  # history.csv columns the train stage can report
SQLITE_FAQ = ("https://optuna.readthedocs.io/en/stable/faq.html#how-can-i-solve-the-error-that-"
              "occurs-when-performing-parallel-optimization-with-sqlite3")
WORKDIR = Path(".dvc/tmp/sweeps")  # clones and logs of local workers; git and DVC ignore it
# Each trial is a DVC experiment (a git ref on the remote), an MLflow run and hours of compute:
# a thousand is a large search; a bigger one is several studies, each a decision.
MAX_TRIALS = 1000
MAX_WORKERS = 256  # a SLURM array's tasks; local workers are bounded by this machine's cores
CONNECT_TIMEOUT_S = 10  # to reach the study's database; PGCONNECT_TIMEOUT overrides
MAX_OPTION = 1_000_000  # any sampler or pruner number (n_startup_trials, n_warmup_steps, ...)
BOUNDS = {"trials": (1, MAX_TRIALS), "heartbeat_s": (1, 600), "grace_s": (1, 3600),
          "retries": (0, 10)}
BOUND_WHY = {"trials": "; for more, run several studies",
             "heartbeat_s": " (a worker also waits this long between looks for a trial)",
             "grace_s": " (a dead worker's trial waits this long before it is retried)",
             "retries": " (retries of a trial whose worker died)"}


class SweepError(UserError):
    """A sweep file, storage or remote problem, named before any work starts."""


# ---------------------------------------------------------------- the sweep file


def load_sweep(path: Path, trials: int | None = None, params_file: Path = Path("params.yaml"),
               dvc_yaml: Path = Path("dvc.yaml")) -> dict[str, Any]:
    """The sweep file, every key checked against params.yaml's schema and Optuna; one line per
    mistake, each naming the file and key, all of them at once."""
    if not path.exists():
        raise SweepError(f"{path}: not found (sweeps/lr.yaml is the example)")
    try:
        raw = read_yaml(path)
    except YamlError as e:
        raise SweepError(str(e)) from None
    where = str(path)
    if not isinstance(raw, dict):
        raise SweepError(f"{where}: must be a mapping (see sweeps/lr.yaml)")
    errors: list[str] = []
    _known_keys(where, "", raw, SWEEP_KEYS, errors)
    spec = {"objective": raw.get("objective"), "trials": raw.get("trials") if trials is None else trials,
            "sampler": raw.get("sampler") or {"name": "tpe", "seed": 0},
            "pruner": raw.get("pruner") or {"name": "none"}, "params": raw.get("params") or {},
            "space": raw.get("space"), "heartbeat_s": raw.get("heartbeat_s", 30),
            "grace_s": raw.get("grace_s", 120), "retries": raw.get("retries", 2)}
    for key, (low, high) in BOUNDS.items():
        value = spec[key]
        if value is None and any(f"did you mean {key!r}?" in e for e in errors):
            continue  # `trails: 8`: its line already says it
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            named = f"TRIALS={value}" if key == "trials" and trials is not None else \
                f"{where}: {key}={value!r}"
            errors.append(f"{named} must be a whole number from {low} to {high}{BOUND_WHY[key]}")
    if not errors and spec["grace_s"] <= spec["heartbeat_s"]:
        errors.append(f"{where}: grace_s={spec['grace_s']} must exceed heartbeat_s="
                      f"{spec['heartbeat_s']}, or live workers would look dead")
    spec["objective"] = _objective(where, spec["objective"], dvc_yaml, errors)
    spec["sampler"] = _optuna_part(where, "sampler", spec["sampler"], SAMPLERS, errors)
    spec["pruner"] = _optuna_part(where, "pruner", spec["pruner"], PRUNERS, errors)
    _space(where, spec["space"], spec["params"], params_file, errors)
    if errors:
        # run_stage prints the first line after "error: "; every mistake gets a line of its own.
        raise SweepError("\nerror: ".join(errors))
    return spec


def _known_keys(where: str, prefix: str, raw: dict, known: set[str], errors: list[str]) -> bool:
    """Every unknown key, a line each (stages.config's own words); True when there was none."""
    unknown = [unknown_key(where, str(key), sorted(known), prefix) for key in raw if key not in known]
    errors += unknown
    return not unknown


def _objective(where: str, raw: Any, dvc_yaml: Path, errors: list[str]) -> dict:
    if not isinstance(raw, dict):
        errors.append(f"{where}: objective must be a mapping: file, metric, direction, per_epoch")
        return {}
    _known_keys(where, "objective.", raw, {"file", "metric", "direction", "per_epoch"}, errors)
    metrics = metrics_files(dvc_yaml)
    obj = {"file": raw.get("file"), "metric": raw.get("metric"),
           "direction": raw.get("direction", "maximize"), "per_epoch": raw.get("per_epoch")}
    if obj["file"] not in metrics:
        errors.append(f"{where}: objective.file={obj['file']!r} is not a metrics file of "
                      f"dvc.yaml; choose one of {', '.join(metrics)}")
    elif not isinstance(obj["metric"], str) or not obj["metric"]:
        errors.append(f"{where}: objective.metric must name a key of {obj['file']}")
    elif (shown := Path(obj["file"])).exists() and obj["metric"] not in json.loads(shown.read_text()):
        keys = list(json.loads(shown.read_text()))
        close = difflib.get_close_matches(obj["metric"], keys, n=1)
        errors.append(f"{where}: objective.metric={obj['metric']!r} is not in {shown}; "
                      + (f"did you mean {close[0]!r}?" if close else f"it has {', '.join(keys)}"))
    if obj["direction"] not in ("maximize", "minimize"):
        errors.append(f"{where}: objective.direction={obj['direction']!r}: use maximize or minimize")
    obj["per_epoch"] = obj["per_epoch"] or ("val_acc" if obj["direction"] == "maximize" else "val_loss")
    if obj["per_epoch"] not in PER_EPOCH:
        errors.append(f"{where}: objective.per_epoch={obj['per_epoch']!r}: the train stage "
                      f"reports {' or '.join(PER_EPOCH)} after each epoch")
    obj["stage"] = metrics.get(obj["file"])
    return obj


def metrics_files(dvc_yaml: Path) -> dict[str, str]:
    """Each metrics file of dvc.yaml, and the stage that writes it (a trial runs up to it)."""
    from ruamel.yaml import YAML

    stages = YAML(typ="safe").load(dvc_yaml.read_text())["stages"]
    return {path: name for name, stage in stages.items() for entry in stage.get("metrics", [])
            for path in (entry if isinstance(entry, dict) else {entry: None})}


def _optuna_part(where: str, key: str, raw: Any, names: dict[str, str], errors: list[str]) -> dict:
    """`sampler:` or `pruner:`: a name, and that Optuna class's own keyword arguments."""
    import inspect

    import optuna

    if not isinstance(raw, dict) or raw.get("name") not in names:
        got = raw.get("name") if isinstance(raw, dict) else raw
        errors.append(f"{where}: {key}.name={got!r} is unknown; choose one of {', '.join(names)}")
        return raw if isinstance(raw, dict) else {}
    cls = getattr(optuna.samplers if key == "sampler" else optuna.pruners, names[raw["name"]])
    options = {k: v for k, v in raw.items() if k != "name"}
    for option, value in options.items():
        # Optuna checks few ranges: n_ei_candidates: 1e9 would spend hours on each sample.
        low, high = (0, 2**32 - 1) if option == "seed" else (0, MAX_OPTION)
        if _is(value, float) and not low <= value <= high:
            errors.append(f"{where}: {key}.{option}={value!r} must be from {low} to {high}"
                          + (" (numpy's seeds)" if option == "seed" else ""))
            return dict(raw)
    try:
        inspect.signature(cls).bind(**options)
        with warnings_quiet():
            cls(**options)  # Optuna checks its ranges (n_warmup_steps >= 0, ...) here
    except (TypeError, ValueError) as e:
        errors.append(f"{where}: {key} {raw['name']}: {e} (see optuna.{cls.__module__.split('.')[1]}"
                      f".{cls.__name__})")
    return dict(raw)


def _space(where: str, space: Any, fixed: Any, params_file: Path, errors: list[str]) -> None:
    """Every swept and fixed key is a params.yaml key, and every value the sweep can set (the
    bounds, each choice) passes params.yaml's own checks: they own every params value's range."""
    if not isinstance(space, dict) or not space:
        errors.append(f"{where}: space must map params.yaml keys to ranges, e.g. "
                      "lr: {type: float, low: 1.0e-4, high: 0.1, log: true}")
        space = {}
    if not isinstance(fixed, dict):
        errors.append(f"{where}: params must map params.yaml keys to values")
        fixed = {}
    base = read_params(params_file)
    good_fixed = {}
    for key, value in fixed.items():
        if _check_value(where, f"params.{key}", base, {}, key, value, errors):
            good_fixed[key] = value
    for key, dist in space.items():
        name = f"space.{key}"
        if not isinstance(dist, dict) or dist.get("type") not in SPACE_TYPES:
            errors.append(f"{where}: {name} needs type: {', '.join(SPACE_TYPES)}, e.g. "
                          "{type: float, low: 1.0e-4, high: 0.1, log: true}")
            continue
        if dist["type"] == "choice":
            if not _known_keys(where, f"{name}.", dist, {"type", "values"}, errors):
                continue
            values = dist.get("values")
            if not isinstance(values, list) or not values:
                errors.append(f"{where}: {name}.values must be a non-empty list")
                continue
        else:
            if not _known_keys(where, f"{name}.", dist, {"type", "low", "high", "log", "step"}, errors):
                continue
            values = _range(where, name, dist, errors)
            if values is None:
                continue
        for v in values:
            if not _check_value(where, name, base, good_fixed, key, v, errors):
                break  # one line per key: its low and high would repeat the same rule


def _range(where: str, name: str, dist: dict, errors: list[str]) -> list | None:
    """A float or int range's low and high, or None after a line saying what is wrong."""
    low, high, step, log = dist.get("low"), dist.get("high"), dist.get("step"), dist.get("log")
    kind = float if dist["type"] == "float" else int
    if not all(_is(v, kind) for v in (low, high)):
        problem = f"needs low and high, {dist['type']}s; got low={low!r}, high={high!r}"
    elif low >= high:
        problem = f"low={low!r} must be below high={high!r}"
    elif log not in (None, True, False):
        problem = f"log={log!r} must be true or false"
    elif log and low <= 0:
        problem = f"log: true needs low > 0, got low={low!r}"
    elif log and step:
        problem = "step and log: true exclude each other (Optuna)"
    elif step is not None and not (_is(step, kind) and 0 < step <= high - low):
        problem = f"step={step!r} must be a{'n int' if kind is int else ' number'} above 0 and " \
                  f"at most high - low = {high - low!r}"
    elif not _drawable(kind, low, high, step, log):
        problem = f"step={step!r} is too fine for low={low!r} and high={high!r}: Optuna " \
                  "cannot make a range of it; use a coarser step"
    else:
        return [low, high]
    errors.append(f"{where}: {name}: {problem}")
    return None


def _drawable(kind: type, low: float, high: float, step: float | None, log: Any) -> bool:
    """Optuna makes the range as a worker would: it divides high - low by step in 28 digits,
    and a step as fine as 1e-300 failed only there, each worker dying on its first trial."""
    from optuna.distributions import FloatDistribution, IntDistribution

    try:
        with warnings_quiet():  # "the range is not divisible by step": Optuna trims high
            (FloatDistribution if kind is float else IntDistribution)(
                low, high, log=bool(log), step=step if kind is float else step or 1)
    except (ValueError, ArithmeticError):  # decimal.InvalidOperation is an ArithmeticError
        return False
    return True


def _is(value: Any, kind: type) -> bool:
    ok = (int, float) if kind is float else (int,)
    return isinstance(value, ok) and not isinstance(value, bool) and math.isfinite(value)


def _check_value(where: str, name: str, base: dict, fixed: dict, key: str, value: Any,
                 errors: list[str]) -> bool:
    """params.yaml with the fixed params and `key: value` set, through params.yaml's checks."""
    raw = json.loads(json.dumps(base))
    for k, v in {**fixed, key: value}.items():
        section = raw
        *parents, leaf = str(k).split(".")
        for p in parents:
            section = section.setdefault(p, {}) if isinstance(section.get(p, {}), dict) else {}
        section[leaf] = v
    try:
        check_params(raw)
    except ParamsError as e:
        errors.append(f"{where}: {name}: {str(e).removeprefix('params.yaml: ')}")
        return False
    return True


# ---------------------------------------------------------------- the storage and the study


def storage_uri(given: str | None, workers: int) -> str:
    uri = given or os.environ.get(STORAGE_ENV, "")
    if not uri:
        raise SweepError(f"no storage for the study: STORAGE=postgresql://user@host/db (or "
                         f"{STORAGE_ENV}); sqlite:///sweep.db for WORKERS=1")
    if not uri.startswith(("postgresql", "mysql", "sqlite:///")):
        raise SweepError(f"STORAGE={shown(uri)}: use a database URI, postgresql://... (or "
                         "sqlite:///FILE for one worker)")
    if uri.startswith("sqlite") and workers > 1:
        raise SweepError(f"STORAGE={shown(uri)} with {workers} workers: Optuna's FAQ says not to "
                         f"share SQLite between parallel workers ({SQLITE_FAQ}); use PostgreSQL, "
                         "or WORKERS=1")
    path = uri.removeprefix("sqlite:///")
    if uri.startswith("sqlite:///") and not path.startswith("/"):
        # Each worker runs in its own clone: a relative file would be a new, empty one there.
        uri = f"sqlite:///{Path(path).resolve()}"
    return uri


def shown(uri: str) -> str:
    """The URI (or a message naming it) without its password, in any of its forms: it goes into
    messages and MLflow tags."""
    from stages.lib.redact import masked_uri

    return masked_uri(uri)


def bound_connect_time() -> None:
    """psycopg waits 130 s for a database host that never answers. libpq's own variable bounds
    it, here and in every process this one starts (workers, their trials' train stage, which
    opens the study too); a URI's `?connect_timeout=` still wins. MySQL drivers wait 10 s."""
    os.environ.setdefault("PGCONNECT_TIMEOUT", str(CONNECT_TIMEOUT_S))


def open_storage(uri: str, spec: dict | None = None):
    """Optuna's RDB storage; with `spec`, with the heartbeat that lets dead workers be found."""
    import optuna

    if spec is None:
        return optuna.storages.RDBStorage(uri)
    with warnings_quiet():
        retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=spec["retries"])
        return optuna.storages.RDBStorage(uri, heartbeat_interval=spec["heartbeat_s"],
                                          grace_period=spec["grace_s"],
                                          heartbeat_stale_trial_callback=retry)


def reach_storage(uri: str, spec: dict | None = None):
    """open_storage, or one line: unreachable, wrong password, no such database."""
    try:
        return open_storage(uri, spec)
    except Exception as e:  # noqa: BLE001 - SQLAlchemy's and each driver's own errors
        raise SweepError(f"cannot open the study storage {shown(uri)}: "
                         f"{tracking.reason(e)}") from None


@contextlib.contextmanager
def warnings_quiet():
    """Optuna marks heartbeats and retries experimental; that is not news to a user."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def create_study(uri: str, name: str, spec: dict, about: dict):
    """The study, its sweep and whereabouts in its user attributes, and one waiting trial per
    slot: workers claim those and never create more, so the study ends with exactly `trials`
    (plus the retries of trials whose worker died)."""
    import optuna

    try:
        study = optuna.create_study(study_name=name, storage=open_storage(uri),
                                    direction=spec["objective"]["direction"])
    except optuna.exceptions.DuplicatedStudyError:
        raise SweepError(f"a study named {name!r} exists in {shown(uri)}; pick another with "
                         "STUDY=...") from None
    except Exception as e:  # noqa: BLE001 - unreachable, wrong password, no such database
        raise SweepError(f"cannot open the study storage {shown(uri)}: "
                         f"{shown(tracking.reason(e))}") from None
    study.set_user_attr("sweep", spec)
    for key, value in about.items():
        study.set_user_attr(key, value)
    for _ in range(spec["trials"]):
        study.enqueue_trial({})
    return study


def sampler_for(spec: dict, number: int):
    """A sampler per trial, seeded by (seed, trial number): the random start-up trials are the
    same points whichever worker runs them, and WORKERS=1 repeats a whole sweep."""
    import optuna

    options = {k: v for k, v in spec["sampler"].items() if k != "name"}
    if options.get("seed") is not None:
        options["seed"] = (options["seed"] * 100_003 + number) % 2**32  # numpy's seeds
    with warnings_quiet():
        return getattr(optuna.samplers, SAMPLERS[spec["sampler"]["name"]])(**options)


def suggest(trial, space: dict) -> dict[str, Any]:
    out = {}
    for key, d in space.items():
        if d["type"] == "choice":
            out[key] = trial.suggest_categorical(key, d["values"])
        elif d["type"] == "int":
            out[key] = trial.suggest_int(key, d["low"], d["high"], step=d.get("step") or 1,
                                         log=bool(d.get("log")))
        else:
            out[key] = trial.suggest_float(key, d["low"], d["high"], step=d.get("step"),
                                           log=bool(d.get("log")))
    return out


# ---------------------------------------------------------------- the worker


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
    argv = [dvc(), "exp", "run", *(["--pull"] if dvc_remote else []), "-n", name,
            *[a for s in sets for a in ("-S", s)], spec["objective"]["stage"]]
    env = {**os.environ, STUDY_ENV: study.study_name, TRIAL_ENV: str(trial.number),
           tracking.PARENT_RUN_ENV: about.get("mlflow_parent_run") or ""}
    print(f"trial {trial.number}: {' '.join(argv[1:])}", flush=True)
    t0 = time.perf_counter()
    out = logged(argv, clone, env)
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
    shared = logged([sys.executable, "-m", "stages.team.share"], clone, env) if dvc_remote else pushed
    obj = spec["objective"]
    value = json.loads((clone / obj["file"]).read_text()).get(obj["metric"])
    if pushed.returncode or shared.returncode:
        why = "push: " + last_error(pushed.stdout + shared.stdout)
    elif not _is(value, float):
        why = f"{obj['file']} has {obj['metric']}={value!r}, not a finite number"
    else:
        study.tell(trial, float(value))
        return
    trial.set_user_attr("fail_reason", why)
    study.tell(trial, state=TrialState.FAIL)


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


def shared_dvc_remote(repo: Path) -> str:
    """The URL of the workspace's default DVC remote, for clones that lack it: one added with
    `dvc remote add -d --local` lives in .dvc/config.local, which git does not carry (and
    committing .dvc/config would move HEAD, so earlier experiments leave `make exps`). "" when
    there is none, or when its URL holds a password (the study's attributes are no place for it)."""
    import urllib.parse

    from dvc.repo import Repo

    with Repo(str(repo)) as r:
        name = r.config["core"].get("remote")
        url = r.config["remote"].get(name, {}).get("url", "") if name else ""
    if urllib.parse.urlsplit(url).password:
        print(f"warning: the DVC remote {name!r} has a password in its URL, so workers get no "
              "DVC remote from here; commit a remote without it", file=sys.stderr)
        return ""
    return url


def use_dvc_remote(clone: Path, url: str) -> bool:
    """The clone's own default DVC remote, or else the coordinator's (`url`), as a local one."""
    if has_dvc_remote(clone):
        return True
    if url:
        subprocess.run([dvc(), "remote", "add", "-q", "-d", "--local", "sweep", url], cwd=clone,
                       check=True, capture_output=True)
    return bool(url)


def has_dvc_remote(clone: Path) -> bool:
    p = subprocess.run([dvc(), "remote", "default"], cwd=clone, capture_output=True, text=True)
    return p.returncode == 0 and bool(p.stdout.strip())


# ---------------------------------------------------------------- launching and watching


def pinned_commit(remote: str) -> tuple[str, str]:
    """The remote's URL and HEAD's commit, which must be on it: every worker clones it there."""
    def git(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *argv], capture_output=True, text=True)

    from stages.lib.redact import holds_password

    url = git("remote", "get-url", remote).stdout.strip() or remote
    if holds_password(url):
        # Every worker's `git clone URL` shows it in `ps`, each clone keeps it in .git/config and
        # the study keeps it for every user of its storage.
        raise SweepError(f"REMOTE={shown(remote)}: its URL {shown(url)} holds a password, which "
                         "the workers' `git clone` would show to every user: let git find it "
                         "instead (a credential helper, or an SSH URL with a key)")
    commit = git("rev-parse", "HEAD").stdout.strip()
    listed = git("ls-remote", url)
    if listed.returncode:
        raise SweepError(f"REMOTE={shown(remote)}: {last_error(listed.stderr)}; give a git remote "
                         "the workers can clone (a name from `git remote -v`, or a URL)")
    tips = {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}
    if commit not in tips and not any(git("merge-base", "--is-ancestor", commit, t).returncode == 0
                                      for t in tips):
        raise SweepError(f"HEAD {commit[:7]} is not on REMOTE={shown(remote)}: `git push "
                         f"{shown(remote)}` it first; every worker clones that commit from there")
    if git("status", "--porcelain", "--untracked-files=no").stdout.strip():
        print(f"warning: uncommitted changes are not part of the sweep: workers run {commit[:7]}",
              file=sys.stderr)
    return url, commit


class Local:
    """N worker processes on this machine, each in its own session (a kill takes its children)."""

    def __init__(self, argv: list[str], workers: int, log_dir: Path, env: dict):
        self.procs = []
        for i in range(workers):
            with open(log_dir / f"worker-{i}.log", "w") as log:
                self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                   env=env, start_new_session=True))

    def alive(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def lost(self) -> list[str]:
        return [f"worker {i} exited {p.returncode}" for i, p in enumerate(self.procs)
                if p.returncode not in (None, 0)]

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)


class Slurm:
    """An array job whose tasks are workers (stages/sweep/slurm.py: sbatch, squeue/sacct, scancel)."""

    def __init__(self, argv: list[str], workers: int, log_dir: Path, env: dict, name: str):
        from stages.sweep import slurm

        self.slurm = slurm
        self.job = slurm.submit_array(argv, workers, Path.cwd(), log_dir, env, name)
        print(f"SLURM array job {self.job}: {workers} tasks", flush=True)

    def alive(self) -> bool:
        tasks = self.slurm.states(self.job)  # {} while the array is not expanded yet: pending
        return not tasks or any(s not in self.slurm.DONE for s in tasks.values())

    def lost(self) -> list[str]:
        return [f"task {i} {s}" for i, s in self.slurm.states(self.job).items() if s != "COMPLETED"]

    def stop(self) -> None:
        self.slurm.cancel(self.job)


def run(path: Path, trials: int | None, workers: int, launcher: str, storage: str | None,
        remote: str, study: str | None, workdir: Path) -> None:
    spec = load_sweep(path, trials)  # a bad file fails here, before anything starts
    if launcher not in ("local", "slurm"):
        raise SweepError(f"LAUNCHER={launcher!r}: use local or slurm")
    check_workers(workers, spec["trials"], launcher)
    uri = storage_uri(storage, workers)
    url, commit = pinned_commit(remote)
    params = load_params()
    name = study or f"{path.stem}-{time.strftime('%m%d-%H%M%S')}"
    about = {"remote": url, "commit": commit, "sweep_file": str(path),
             "dvc_remote": shared_dvc_remote(Path.cwd())}
    print(plan(name, spec, params, commit, workers, launcher, uri), flush=True)
    optuna_logging_quiet()  # "A new study created in RDB": the line above said it
    optuna_study = create_study(uri, name, spec, about)
    log_dir = (workdir / name).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"study {name} in {shown(uri)}: {spec['trials']} trials of {commit[:7]} on {workers} "
          f"{launcher} workers; logs in {log_dir}", flush=True)
    with tracking.start_run(params.mlflow, name=name, tags={
            "sweep_file": str(path), "optuna_study": name, "optuna_storage": shown(uri),
            "sweep_space": json.dumps(spec["space"])}) as parent:
        optuna_study.set_user_attr("mlflow_parent_run", parent.run_id or "")
        parent.log_params({f"sweep.{k}": v for k, v in flat_spec(spec).items()})
        argv = [sys.executable, "-m", "stages.sweep", "worker", "--study", name,
                "--workdir", str(workdir.resolve())]
        env = {**os.environ, STORAGE_ENV: uri,
               "MLFLOW_TRACKING_URI": tracking.tracking_uri(params.mlflow)}
        engine = Local(argv, workers, log_dir, env) if launcher == "local" else \
            Slurm(argv, workers, log_dir, env, name)
        try:
            watch(optuna_study, spec, engine)
        except BaseException:
            engine.stop()
            raise
        trials = optuna_study.get_trials(deepcopy=False)
        counts = Counter(t.state.name for t in trials)
        parent.log_metrics({"trials_complete": counts["COMPLETE"], "trials_pruned":
                            counts["PRUNED"], "trials_failed": counts["FAIL"],
                            "restored": sum(not t.user_attrs.get("retrained", True) for t in trials)})
        if counts["COMPLETE"]:
            parent.log_metrics({"best_value": optuna_study.best_value})
        picture = plot(optuna_study, spec, log_dir / "trials.png")
        parent.log_artifact(picture)
    print(summary(optuna_study, spec), flush=True)
    print(f"picture: {picture}")
    pull(optuna_study, spec)
    unfinished = counts["WAITING"] + counts["RUNNING"]
    if unfinished:
        raise SweepError(f"{unfinished} trials never ended ({', '.join(engine.lost()) or 'workers gone'});"
                         f" start more workers: {STORAGE_ENV}=... python -m stages.sweep worker "
                         f"--study {name}")


def optuna_logging_quiet() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)


def check_workers(workers: int, trials: int, launcher: str) -> None:
    cores = os.cpu_count() or 1
    if not 1 <= workers <= MAX_WORKERS:
        raise SweepError(f"WORKERS={workers} must be from 1 to {MAX_WORKERS}")
    if workers > trials:
        raise SweepError(f"WORKERS={workers} is more than TRIALS={trials}: the others would find "
                         f"no trial to run; use WORKERS={trials} or fewer")
    if launcher == "local" and workers > cores:
        # Each local worker trains on this machine: more of them than cores only slows all.
        raise SweepError(f"WORKERS={workers} local workers: this machine has {cores} cores; use "
                         f"WORKERS={cores} or fewer, or LAUNCHER=slurm")


def plan(name: str, spec: dict, params, commit: str, workers: int, launcher: str, uri: str) -> str:
    """What the sweep will do, in one line, before it starts: no secrets (the storage's kind)."""
    epochs = spec["space"].get("epochs")
    epochs = f"{epochs['low']}-{epochs['high']}" if epochs and "low" in epochs else \
        "/".join(map(str, epochs["values"])) if epochs else spec["params"].get("epochs", params.epochs)
    obj = spec["objective"]
    swept = ", ".join(spec["space"])
    kind = uri.split(":", 1)[0].split("+", 1)[0]
    return (f"sweep {name}: {spec['trials']} trials x {epochs} epochs of {commit[:7]} over {swept}, "
            f"{obj['direction']} {obj['metric']} ({obj['file']}), {workers} {launcher} "
            f"worker{'s' if workers > 1 else ''}, study in {kind} storage")


def flat_spec(spec: dict) -> dict[str, Any]:
    from stages.config import flatten

    return {k: json.dumps(v) if isinstance(v, list | dict) else v for k, v in flatten(spec).items()}


def watch(study, spec: dict, engine) -> None:
    """A line per change (done, running, pruned, failed, the best so far) until the workers end."""
    last = None
    while True:
        running = engine.alive()
        line = progress(study, spec)
        if line != last:
            print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)
            last = line
        if not running:
            return
        time.sleep(1)


def progress(study, spec: dict) -> str:
    trials = study.get_trials(deepcopy=False)
    c = Counter(t.state.name for t in trials)
    retried = retries(trials)  # a failed trial queued again is done once its retry is
    done = c["COMPLETE"] + c["PRUNED"] + c["FAIL"] - retried
    line = (f"{done}/{spec['trials']} done: {c['COMPLETE']} complete, {c['PRUNED']} pruned, "
            f"{c['FAIL']} failed ({retried} retried), {c['RUNNING']} running, "
            f"{c['WAITING']} waiting")
    if c["COMPLETE"]:
        best = study.best_trial
        line += f"; best {spec['objective']['metric']} {best.value:.4f} (trial {best.number}: " \
                f"{fmt(best.params)})"
    return line


def retries(trials) -> int:
    return sum("failed_trial" in t.system_attrs for t in trials)


def fmt(params: dict) -> str:
    return " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def summary(study, spec: dict) -> str:
    """One line per trial: its state, objective, point and what happened to it."""
    trials = study.get_trials(deepcopy=False)
    retried_as = {t.system_attrs["failed_trial"]: t.number for t in trials
                  if "failed_trial" in t.system_attrs}
    metric = spec["objective"]["metric"]
    width = max(7, len(metric))
    rows = []
    for t in trials:
        if t.state.name == "COMPLETE":
            note = "trained" if t.user_attrs.get("retrained") else "restored from the run-cache"
        elif t.state.name == "PRUNED":
            note = f"pruned after epoch {t.user_attrs.get('pruned_at_epoch')}"
        elif t.state.name == "FAIL":
            note = t.user_attrs.get("fail_reason") or \
                f"its worker {t.user_attrs.get('worker', '?')} stopped sending heartbeats"
            if t.number in retried_as:
                note += f"; retried as trial {retried_as[t.number]}"
        else:
            note = t.state.name.lower()
        value = f"{t.value:.4f}" if t.value is not None else "-"
        secs = t.user_attrs.get("run_s")
        rows.append(f"  {t.number:>3} {t.state.name:<8} {value:>{width}} {fmt(t.params):<28} "
                    f"{f'{secs:.0f}s' if secs else '':>5} {note}")
    c = Counter(t.state.name for t in trials)
    restored = sum(t.state.name == "COMPLETE" and not t.user_attrs.get("retrained") for t in trials)
    return "\n".join([f"study {study.study_name}: {c['COMPLETE']} complete ({restored} restored from "
                      f"the run-cache), {c['PRUNED']} pruned, {c['FAIL']} failed",
                      f"  {'#':>3} {'state':<8} {metric:>{width}} "
                      f"{'params':<28} {'time':>5}", *rows])


def plot(study, spec: dict, out: Path) -> Path:
    """The objective per trial (best so far as a line, pruned trials at their last reported
    figure) and against each swept parameter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    trials = study.get_trials(deepcopy=False)
    done = [t for t in trials if t.state.name == "COMPLETE"]
    pruned = [t for t in trials if t.state.name == "PRUNED" and t.intermediate_values]
    obj = spec["objective"]
    keys = list(spec["space"])
    fig, axes = plt.subplots(1, 1 + len(keys), figsize=(5 * (1 + len(keys)), 4), squeeze=False)
    ax = axes[0][0]
    ax.scatter([t.number for t in done], [t.value for t in done], label="complete")
    last = [t.intermediate_values[max(t.intermediate_values)] for t in pruned]
    ax.scatter([t.number for t in pruned], last, marker="x", color="tab:red",
               label=f"pruned (last {obj['per_epoch']})")
    best, line = None, []
    pick = max if obj["direction"] == "maximize" else min
    for t in sorted(done, key=lambda t: t.number):
        best = t.value if best is None else pick(best, t.value)
        line.append((t.number, best))
    if line:
        ax.step(*zip(*line, strict=True), where="post", color="tab:green", label="best so far")
    failed = [t.number for t in trials if t.state.name == "FAIL"]
    for n in failed:
        ax.axvline(n, color="grey", linestyle=":", label="failed" if n == failed[0] else None)
    # A loss spans decades (2.3 for an lr that learns nothing, 0.02 for a good one): on a linear
    # axis every good trial sits on one flat line at the bottom.
    shown_values = [t.value for t in done] + last
    y_log = bool(shown_values) and min(shown_values) > 0 and max(shown_values) >= 10 * min(shown_values)
    ax.set(xlabel="trial", ylabel=obj["metric"], title=f"{study.study_name}: {obj['metric']} per trial")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # trial numbers, not 0.2, 0.4, ...
    ax.legend(fontsize=8)
    for ax in axes[0] if y_log else ():
        ax.set_yscale("log")
    for ax, key in zip(axes[0][1:], keys, strict=True):
        ax.scatter([t.params[key] for t in done if key in t.params],
                   [t.value for t in done if key in t.params], label="complete")
        ax.scatter([t.params[key] for t in pruned], last, marker="x", color="tab:red", label="pruned")
        # An empty axis spans 0..1, which a log scale cannot draw (every trial failed).
        if log_axis(spec["space"][key]) and any(key in t.params for t in done + pruned):
            ax.set_xscale("log")
        ax.set(xlabel=key, ylabel=obj["metric"], title=f"{obj['metric']} against {key}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out)
    return out


def log_axis(dist: dict) -> bool:
    """A log range, or choices that are positive numbers spanning 100x or more."""
    values = dist.get("values") or []
    numbers = values and all(_is(v, float) and v > 0 for v in values)
    return bool(dist.get("log")) or bool(numbers and max(values) >= 100 * min(values))


def pull(study, spec: dict) -> None:
    """Every complete trial's experiment into this workspace, for `make exps`."""
    names = [t.user_attrs["dvc_exp"] for t in study.get_trials(deepcopy=False)
             if t.state.name == "COMPLETE"]
    if not names:
        return
    remote = study.user_attrs["remote"]
    p = subprocess.run([dvc(), "exp", "pull", *([] if has_dvc_remote(Path.cwd()) else ["--no-cache"]),
                        remote, *names], capture_output=True, text=True)
    if p.returncode:
        print(f"warning: dvc exp pull: {last_error(p.stdout + p.stderr)}", file=sys.stderr)
        return
    obj = spec["objective"]
    order = "desc" if obj["direction"] == "maximize" else "asc"
    print(f"pulled {len(names)} experiments; sorted by the objective: make exps "
          f"EXPS_SORT={obj['file']}:{obj['metric']} EXPS_ORDER={order}")


def status(study_name: str, workdir: Path) -> None:
    import optuna

    uri = storage_uri(None, 1)
    try:
        study = optuna.load_study(study_name=study_name, storage=reach_storage(uri))
    except KeyError:
        raise SweepError(f"no study {study_name!r} in {shown(uri)}") from None
    spec = study.user_attrs["sweep"]
    print(progress(study, spec))
    print(summary(study, spec))
    print(f"picture: {plot(study, spec, workdir / study_name / 'trials.png')}")


def main() -> None:
    parser = ArgumentParser(prog="python -m stages.sweep", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="check the sweep file, create the study, start the workers")
    r.add_argument("sweep", type=Path)
    r.add_argument("--trials", type=int)
    r.add_argument("--workers", type=int, default=1)
    r.add_argument("--launcher", default="local")
    r.add_argument("--storage", help=f"a database URI (default: ${STORAGE_ENV})")
    r.add_argument("--remote", default="origin", help="the git remote every worker clones")
    r.add_argument("--study", help="its name (default: the file's name and the time)")
    r.add_argument("--workdir", type=Path, default=WORKDIR)
    w = sub.add_parser("worker", help="run trials of a study (storage from $" + STORAGE_ENV + ")")
    w.add_argument("--study", required=True)
    w.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "sweeps")
    w.add_argument("--keep", action="store_true", help="keep the clone afterwards")
    s = sub.add_parser("status", help="the study's trials and picture")
    s.add_argument("--study", required=True)
    s.add_argument("--workdir", type=Path, default=WORKDIR)
    a = parser.parse_args()
    bound_connect_time()
    if a.command == "run":
        run(a.sweep, a.trials, a.workers, a.launcher, a.storage, a.remote, a.study, a.workdir)
    elif a.command == "worker":
        worker(a.study, a.workdir, a.keep)
    else:
        status(a.study, a.workdir)

