"""The sweep file (sweeps/*.yaml): read strictly, every key checked against params.yaml's schema
and Optuna's own classes, before anything starts; and the search space it declares."""

from __future__ import annotations

import contextlib
import difflib
import json
import math
from pathlib import Path
from typing import Any

from reprotrain.sweep.trial import PRUNERS
from stages.config import ParamsError, check_params, read_params, unknown_key
from stages.lib.errors import UserError
from stages.lib.strict_yaml import YamlError, read_yaml

SAMPLERS = {"tpe": "TPESampler", "random": "RandomSampler"}
SWEEP_KEYS = {"objective", "trials", "sampler", "pruner", "params", "space", "heartbeat_s",
              "grace_s", "retries"}
SPACE_TYPES = ("float", "int", "choice")
PER_EPOCH = ("val_acc", "val_loss")  # history.csv columns the train stage can report
# Each trial is a DVC experiment (a git ref on the remote), an MLflow run and hours of compute:
# a thousand is a large search; a bigger one is several studies, each a decision.
MAX_TRIALS = 1000
MAX_OPTION = 1_000_000  # any sampler or pruner number (n_startup_trials, n_warmup_steps, ...)
BOUNDS = {"trials": (1, MAX_TRIALS), "heartbeat_s": (1, 600), "grace_s": (1, 3600),
          "retries": (0, 10)}
BOUND_WHY = {"trials": "; for more, run several studies",
             "heartbeat_s": " (a worker also waits this long between looks for a trial)",
             "grace_s": " (a dead worker's trial waits this long before it is retried)",
             "retries": " (retries of a trial whose worker died)"}


class SweepError(UserError):
    """A sweep file, storage or remote problem, named before any work starts."""


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
        if is_finite(value, float) and not low <= value <= high:
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
    if not all(is_finite(v, kind) for v in (low, high)):
        problem = f"needs low and high, {dist['type']}s; got low={low!r}, high={high!r}"
    elif low >= high:
        problem = f"low={low!r} must be below high={high!r}"
    elif log not in (None, True, False):
        problem = f"log={log!r} must be true or false"
    elif log and low <= 0:
        problem = f"log: true needs low > 0, got low={low!r}"
    elif log and step:
        problem = "step and log: true exclude each other (Optuna)"
    elif step is not None and not (is_finite(step, kind) and 0 < step <= high - low):
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


def is_finite(value: Any, kind: type) -> bool:
    """A finite number of `kind`: an int is a float too, a bool is neither."""
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


@contextlib.contextmanager
def warnings_quiet():
    """Optuna marks heartbeats and retries experimental; that is not news to a user."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
