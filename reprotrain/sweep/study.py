"""The Optuna study of a sweep and its database: the storage URI, opening it (with the heartbeat
that finds dead workers), creating the study with one waiting trial per slot, and the sampler
that draws each trial's point. The pruner is reprotrain/sweep/trial.py's: the training run applies it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from reprotrain import tracking
from reprotrain.sweep.spec import SAMPLERS, SweepError, warnings_quiet
from reprotrain.sweep.trial import STORAGE_ENV

SQLITE_FAQ = ("https://optuna.readthedocs.io/en/stable/faq.html#how-can-i-solve-the-error-that-"
              "occurs-when-performing-parallel-optimization-with-sqlite3")
CONNECT_TIMEOUT_S = 10  # to reach the study's database; PGCONNECT_TIMEOUT overrides


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
    from reprotrain.redact import masked_uri

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


def optuna_logging_quiet() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
