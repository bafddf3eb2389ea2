"""`make sync`: copy MLflow runs from a local store onto the tracking server, exactly once.

    python -m reprotrain.tracking.sync [--from sqlite:///path/mlflow.db] [--budget-s SECONDS]

By default the source is the spool (.mlflow-spool/), where a stage logs while the server does
not answer; `--from` moves a machine's embedded store up instead (a week of offline runs). The
target is MLFLOW_TRACKING_URI. What is copied: each run's params, every metric step with its
timestamp, tags, artifacts, datasets, its logged models (files and all) and their registered
versions with their aliases. A spooled run that continues a run the server has (tag
`reprotrain.server_run_id`) is merged into it; any other run becomes a new run on the server,
tagged `reprotrain.source_run` = `<host>:<store>#<run id>`: where it came from, and how a second
sync finds it. Everything is skipped that the target already holds (a metric step, an artifact
of that path and size, a dataset, a model or version tagged with its source), so a second sync,
or one after a sync killed halfway, lands each thing once. A run sent whole is marked so in the
spool (`reprotrain.synced`), and the spool's runs with that mark are not read again: a spool
sent already is said from its sqlite file alone, without MLflow or a request (FROM= the spool's
file checks each run again). MLflow has no such mover (mlflow #2910); this is one module on
MlflowClient, with an explicit URI for each store.
"""

from __future__ import annotations

import errno
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from reprotrain.redact import masked, masked_uri
from reprotrain.tracking import stores
from stages.lib.cli import ArgumentParser, positive_int, run_stage
from stages.lib.errors import UserError

# A progress bar per file, and MLflow's "View run" and "View experiment" lines for each run it
# ends, would bury the one line sync prints.
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")

SOURCE_RUN = "reprotrain.source_run"  # on a run sync created: where it came from
SOURCE_MODEL = "reprotrain.source_model"
SOURCE_VERSION = "reprotrain.source_version"
ALIASES_SET = "reprotrain.aliases_set"  # a version's aliases were decided (killed before: again)
# Marks of the source that stay behind: the spool's own bookkeeping.
LOCAL_TAGS = (stores.SERVER_RUN, stores.SYNCED)
BATCH = 1000  # MLflow's limit of metrics per log_batch
# What an MLflow sqlite store has (of this project's MLflow): a file without them is no store.
STORE_TABLES = frozenset({"alembic_version", "experiments", "experiment_tags", "runs", "metrics",
                          "latest_metrics", "params", "tags", "registered_models",
                          "model_versions"})


class Busy(UserError):
    """Another sync holds the source's lock."""


@dataclass
class Report:
    runs: int = 0  # runs that got something
    skipped: int = 0  # runs the target already held whole
    left: int = 0  # runs not reached before the time budget ran out
    steps: int = 0
    artifacts: int = 0
    versions: int = 0
    conflicts: list[str] = field(default_factory=list)

    def line(self, source: str, target: str) -> str:
        done = (f"synced {self.runs} run(s) from {source} to {target}: {self.steps} metric "
                f"steps, {self.artifacts} artifacts, {self.versions} model versions; "
                f"{self.skipped} run(s) already there")
        if self.left:
            done += f"; {self.left} run(s) left for the next `make sync`"
        return done


def label(uri: str) -> str:
    """Where a run comes from, as a tag: this host and the store, never a password."""
    return f"{platform.node()}:{masked_uri(uri).split('?')[0]}"


@contextmanager
def _lock(source: str, wait_s: float | None) -> Iterator[None]:
    """One sync of a store at a time (a `make sync`, a stage's replay): each finds what the
    target holds, then creates the rest, then marks the run sent, and two at once would both
    find nothing and both create. filelock's OS lock (flock) on a file beside the store, which
    the kernel releases when its holder dies and never opens through a link. `wait_s`: how
    long to wait for the holder (None: until it is done); then Busy."""
    from filelock import FileLock, Timeout

    if (db := stores.sqlite_file(source)) is None:
        yield
        return
    path = db.with_name(db.name + ".sync-lock")
    lock = FileLock(path)
    try:
        try:
            lock.acquire(timeout=0)
        except Timeout:
            if wait_s is not None:
                lock.acquire(timeout=wait_s)
            else:
                print(f"another sync of {db.parent.name}/{db.name} is running: waiting for it "
                      "to finish", file=sys.stderr, flush=True)
                lock.acquire()
    except Timeout:
        raise Busy(f"another sync of {db.parent.name}/{db.name} is running") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(f"{path} is a symbolic link, not the lock sync keeps there; "
                            "remove it and rerun") from None
        if os.path.lexists(path):  # there, but not ours to lock: syncing without it could double
            raise UserError(f"cannot open the sync lock {path} ({e.strerror}); make it "
                            "writable or remove it, then rerun") from None
        yield  # a read-only store's folder: nothing of it is marked, a rerun skips all
        return
    try:
        yield
    finally:
        lock.release()


def damage(db: Path) -> str | None:
    """What makes `db` no readable MLflow store (None: nothing): empty, not SQLite, damaged
    pages, a table gone. Read-only: the file is never changed here."""
    import sqlite3

    if db.stat().st_size == 0:
        return "it is empty (0 bytes)"
    try:
        con = sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True)
        try:
            checked = con.execute("PRAGMA quick_check").fetchone()[0]
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        finally:
            con.close()
    except sqlite3.DatabaseError as e:
        return f"sqlite: {e}"
    if checked != "ok":
        return f"sqlite: {checked}"
    missing = sorted(STORE_TABLES - tables)
    return f"its table(s) {', '.join(missing)} are missing" if missing else None


def _schema_head() -> str:
    # Private to MLflow (no public name for this MLflow's schema revision); pinned by
    # tests/test_private_names.py.
    from mlflow.store.db.utils import _get_latest_schema_revision

    return _get_latest_schema_revision()


def _other_schema(db: Path) -> str | None:
    """The store's schema revision when it is not this MLflow's (None: it is). Read-only."""
    import sqlite3

    con = sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True)
    try:
        found = con.execute("SELECT version_num FROM alembic_version").fetchone()
    finally:
        con.close()
    found = found[0] if found else "none"
    return None if found == _schema_head() else found


def _check_source(source: str) -> None:
    """A damaged source ends the sync in one line. The spool is moved aside first (and kept):
    MLflow would otherwise make a fresh store in its place at the next stage, or fail in a
    traceback on every sync."""
    if (db := stores.sqlite_file(source)) is None or not db.is_file():
        return
    if (problem := damage(db)) is None:
        if other := _other_schema(db):
            # Not damaged: MLflow refuses it, and sync said the server had failed.
            raise UserError(f"{db} was written by another MLflow (its schema {other}, this one's "
                            f"{_schema_head()}); nothing was synced, it is kept: sync it with "
                            "the MLflow that wrote it (its requirements.lock), or, if older, "
                            "upgrade a copy (`mlflow db upgrade sqlite:///COPY`) and sync that")
        return
    if db != stores.spool_file():
        raise UserError(f"FROM={masked_uri(source)}: {db} is not a readable MLflow store "
                        f"({problem}); nothing was synced")
    kept = db.with_name(f"{db.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
    db.rename(kept)
    (db.parent / "unsynced").unlink(missing_ok=True)
    raise UserError(f"the spool {db} is damaged ({problem}); nothing was synced, and it is kept "
                    f"aside as {kept} (stages spool to a new one): restore it from a backup "
                    "into place, or delete it, then rerun make sync")


def sync(source: str, target: str, budget_s: float | None = None,
         unsynced_only: bool = False, wait_s: float | None = None) -> Report:
    """Copy every active run of `source` onto `target`; stop between runs after `budget_s`.
    `unsynced_only`: leave out runs marked synced in the source (the spool's own mark).
    One sync of `source` at a time: wait up to `wait_s` (None: as long as it takes) for
    another, then Busy."""
    with _lock(source, wait_s):
        _check_source(source)
        return _sync(source, target, budget_s, unsynced_only)


def _sync(source: str, target: str, budget_s: float | None, unsynced_only: bool) -> Report:
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    src, dst = MlflowClient(source), MlflowClient(target)
    origin, report = label(source), Report()
    deadline = time.monotonic() + budget_s if budget_s else None
    for exp in src.search_experiments(view_type=ViewType.ACTIVE_ONLY):
        runs = _all_runs(src, exp.experiment_id)
        if unsynced_only:
            sent = {r.info.run_id for r in runs if r.data.tags.get(stores.SYNCED) == _mark(r, target)}
            report.skipped += len(sent)
            runs = [r for r in runs if r.info.run_id not in sent]
        if not runs:
            continue
        exp_id = _experiment(dst, exp)
        for i, run in enumerate(runs):
            if deadline and time.monotonic() > deadline:
                report.left += len(runs) - i
                break
            _sync_run(src, dst, run, exp_id, origin, report)
            if run.info.status != "RUNNING" and source == stores.spool_uri():
                # Reopening a spooled run (a later stage) clears the mark: it is sent again.
                src.set_tag(run.info.run_id, stores.SYNCED, _mark(run, target))
    return report


def _mark(run, target: str) -> str:
    return _mark_of(run.info.end_time, target)


def _mark_of(end_time: int | None, target: str) -> str:
    return f"{masked_uri(target)}@{end_time}"


def spooled(db: Path, target: str) -> tuple[int, int] | None:
    """(runs the spool `db` has to send to `target`, runs it sent there whole), read with
    sqlite alone: no MLflow, no server, milliseconds. None when the file cannot say (damaged,
    not a store): the sync itself then names what is wrong. What is to send, as _sync's
    `unsynced_only` finds it: an active run of an active experiment without the mark of its
    end on this target (a run still RUNNING has none)."""
    import sqlite3

    if damage(db) is not None:
        return None
    try:
        con = sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True)
        try:
            rows = con.execute(
                "SELECT r.end_time, t.value FROM runs r JOIN experiments e "
                "ON e.experiment_id = r.experiment_id LEFT JOIN tags t ON t.run_uuid = "
                "r.run_uuid AND t.key = ? WHERE r.lifecycle_stage = 'active' AND "
                "e.lifecycle_stage = 'active'", (stores.SYNCED,)).fetchall()
        finally:
            con.close()
    except sqlite3.Error:
        return None
    sent = sum(value == _mark_of(end, target) for end, value in rows)
    return len(rows) - sent, sent


def _all_runs(client, exp_id: str) -> list:
    runs, token = [], None
    while True:
        page = client.search_runs([exp_id], order_by=["attributes.start_time ASC"],
                                  max_results=1000, page_token=token)
        runs += page
        token = page.token
        if not token:
            return runs


def _experiment(dst, exp) -> str:
    """The target's experiment of that name: made with the source's tags when missing."""
    from mlflow.exceptions import MlflowException

    found = dst.get_experiment_by_name(exp.name)
    if found is None:
        try:
            return dst.create_experiment(exp.name, tags=exp.tags)
        except MlflowException:  # another sync or stage made it first
            found = dst.get_experiment_by_name(exp.name)
    if found.lifecycle_stage == "deleted":
        # Restoring it would bring back every run deleted with it: an admin's decision.
        raise UserError(f"the experiment {exp.name!r} was deleted on the server (id "
                        f"{found.experiment_id}); nothing was synced into it, the source is kept: "
                        "ask the server's admin to restore it (`mlflow experiments restore "
                        f"--experiment-id {found.experiment_id}`) or to purge it (`mlflow gc`), "
                        "then rerun make sync")
    return found.experiment_id


def _target_run(src, dst, run, exp_id: str, origin: str):
    """The target's run for `run`: (its Run, merged into a run the server had, made now)."""
    from mlflow.exceptions import MlflowException

    continues = run.data.tags.get(stores.SERVER_RUN)
    if continues:
        try:
            have = dst.get_run(continues)
            if have.info.lifecycle_stage == "active":
                return have, True, False
        except MlflowException:  # not on this server: the spooled part becomes a run of its own
            pass
    key = f"{origin}#{run.info.run_id}"
    found = _one_run(dst, exp_id, key)
    if found:
        return dst.get_run(found.info.run_id), False, False
    tags = {k: v for k, v in run.data.tags.items() if k not in LOCAL_TAGS} | {SOURCE_RUN: key}
    dst.create_run(exp_id, start_time=run.info.start_time, tags=tags, run_name=run.info.run_name)
    # Made now: it holds its tags and nothing else, which the search's answer shows.
    return _one_run(dst, exp_id, key), False, True


def _one_run(dst, exp_id: str, key: str):
    """The target's run tagged `key` (its Run as search_runs answers it), made one: MLflow
    retries a POST whose answer was lost (a proxy's 504 after the server made the run), and
    the retry makes a second one. The first by id is kept and the others deleted
    (restorable): the source holds all they could have."""
    found = sorted(dst.search_runs([exp_id], filter_string=f"tags.`{SOURCE_RUN}` = '{key}'",
                                   max_results=100), key=lambda r: r.info.run_id)
    for extra in found[1:]:
        dst.delete_run(extra.info.run_id)
    return found[0] if found else None


def _log(dst, run_id: str, params: list, tags: list, metrics: list) -> None:
    """Params, tags and metrics in the fewest log_batch requests: MLflow takes at most 100
    params, 100 tags and 1000 entries in all per request."""
    while params or tags or metrics:
        p, t = params[:100], tags[:100]
        m = metrics[:BATCH - len(p) - len(t)]
        dst.log_batch(run_id, params=p, tags=t, metrics=m)
        params, tags, metrics = params[len(p):], tags[len(t):], metrics[len(m):]


def _sync_run(src, dst, run, exp_id: str, origin: str, report: Report) -> None:
    from mlflow.entities import Metric, Param, RunTag

    run_id = run.info.run_id
    have, merged, made = _target_run(src, dst, run, exp_id, origin)
    target = have.info.run_id
    before = report.steps + report.artifacts + report.versions

    params = [Param(k, v) for k, v in run.data.params.items() if k not in have.data.params]
    report.conflicts += [f"{target}: param {k}" for k, v in run.data.params.items()
                         if have.data.params.get(k, v) != v]
    # A tag naming the run itself (training_run_id of a run spooled from its start) names
    # its copy here.
    named = {k: target if v == run_id else v for k, v in run.data.tags.items()}
    tags = [RunTag(k, v) for k, v in named.items()
            if k not in LOCAL_TAGS and have.data.tags.get(k) != v and not
            (merged and k.startswith("mlflow."))]  # a merged run keeps its name and source
    if merged and have.data.tags.get("reprotrain.replayed_from") is None:
        tags.append(RunTag("reprotrain.replayed_from", f"{origin}#{run_id}"))
    metrics = []
    for key in run.data.metrics:
        # Merged: the run's own steps (a step is logged once per key; a resume or a retry
        # after the server went away may have sent one twice). Copied: an exact copy. A run
        # made now has none: nothing to ask the server.
        ident = (lambda m: m.step) if merged else (lambda m: (m.step, m.timestamp, repr(m.value)))
        there = set() if made else {ident(m) for m in dst.get_metric_history(target, key)}
        metrics += [Metric(key, m.value, m.timestamp, m.step)
                    for m in src.get_metric_history(run_id, key) if ident(m) not in there]
    _log(dst, target, params, tags, metrics)
    report.steps += len(metrics)

    _sync_datasets(dst, run, have, made)
    report.artifacts += _sync_artifacts(src, dst, run_id, target, made)
    report.versions += _sync_models(src, dst, run, target, exp_id, origin, made)
    # Last: a sync killed before this leaves the target RUNNING, and the next one ends it.
    if run.info.status != "RUNNING" and (have.info.status == "RUNNING" or made):
        dst.set_terminated(target, run.info.status, run.info.end_time)
    if report.steps + report.artifacts + report.versions > before or made or params or tags:
        report.runs += 1
    else:
        report.skipped += 1


def _sync_datasets(dst, run, have, made: bool) -> None:
    there = set() if made else {(d.dataset.name, d.dataset.digest)
                                for d in have.inputs.dataset_inputs}
    new = [d for d in run.inputs.dataset_inputs if (d.dataset.name, d.dataset.digest) not in there]
    if new:
        dst.log_inputs(have.info.run_id, datasets=new)


def _files(client, run_id: str, path: str | None = None) -> dict[str, int]:
    out = {}
    for f in client.list_artifacts(run_id, path):
        out |= _files(client, run_id, f.path) if f.is_dir else {f.path: f.file_size}
    return out


def _sync_artifacts(src, dst, run_id: str, target: str, made: bool) -> int:
    there = {} if made else _files(dst, target)
    new = [p for p, size in _files(src, run_id).items() if there.get(p) != size]
    with tempfile.TemporaryDirectory() as tmp:
        for path in new:
            local = src.download_artifacts(run_id, path, tmp)
            dst.log_artifact(target, local, os.path.dirname(path) or None)
    return len(new)


def _sync_models(src, dst, run, target: str, exp_id: str, origin: str, made: bool) -> int:
    """The run's logged models (MLflow 3 keeps their files apart from the run's artifacts),
    then their registered versions. A run `made` now has neither on the target."""
    import mlflow
    from mlflow.entities import LoggedModelStatus
    from mlflow.models import Model

    run_id = run.info.run_id
    mine = {} if made else {m.tags.get(SOURCE_MODEL): m for m in dst.search_logged_models(
        [exp_id], filter_string=f"source_run_id = '{target}'")}
    ids = {}
    for model in src.search_logged_models([run.info.experiment_id],
                                          filter_string=f"source_run_id = '{run_id}'"):
        key = f"{origin}#{model.model_id}"
        copy = mine.get(key)
        if copy is None and (server_model := model.tags.get(stores.SERVER_MODEL)):
            copy = _logged_model(dst, server_model)  # export logged it there before a failure
        if copy is None:
            copy = dst.create_logged_model(exp_id, name=model.name, source_run_id=target,
                                           tags={**model.tags, SOURCE_MODEL: key},
                                           params=model.params, model_type=model.model_type)
        if copy.status != LoggedModelStatus.READY:  # made, or a sync killed mid-upload
            with tempfile.TemporaryDirectory() as tmp:
                local = mlflow.artifacts.download_artifacts(artifact_uri=model.artifact_location,
                                                            dst_path=tmp)
                if (Path(local) / "MLmodel").exists():  # it names its run and model: the copy's
                    meta = Model.load(Path(local) / "MLmodel")
                    meta.run_id, meta.model_id = target, copy.model_id
                    meta.save(Path(local) / "MLmodel")
                dst.log_model_artifacts(copy.model_id, local)
            dst.finalize_logged_model(copy.model_id, LoggedModelStatus.READY)
        ids[model.model_id] = copy.model_id
    return _sync_versions(src, dst, run_id, target, ids, origin, new_run=made)


def _logged_model(dst, model_id: str):
    """The target's logged model `model_id`, or None when it does not have it."""
    from mlflow.exceptions import MlflowException

    try:
        return dst.get_logged_model(model_id)
    except MlflowException as e:
        if e.error_code not in ("RESOURCE_DOES_NOT_EXIST", "PERMISSION_DENIED", "NOT_FOUND"):
            raise
        return None


def _sync_versions(src, dst, run_id: str, target: str, ids: dict[str, str], origin: str,
                   new_run: bool) -> int:
    from mlflow.exceptions import MlflowException

    from reprotrain.tracking.names import TASK, promotes

    made = 0
    versions = sorted(src.search_model_versions(f"run_id = '{run_id}'"),
                      key=lambda v: v.creation_timestamp)
    if not versions:
        return 0
    there = [] if new_run else dst.search_model_versions(f"run_id = '{target}'")
    mine = {v.tags.get(SOURCE_VERSION): v for v in there}
    # Versions export registered on the server itself before it failed (a tag or an alias
    # call): by their logged model; the spool's version of it is the same one.
    direct = {(v.name, v.model_id or v.source.removeprefix("models:/")): v for v in there
              if SOURCE_VERSION not in v.tags}
    for v in versions:
        key = f"{origin}#{v.name}/{v.version}"
        mapped = ids.get(v.model_id or v.source.removeprefix("models:/"))
        copy = mine.get(key) or direct.pop((v.name, mapped), None)
        if copy is not None and copy.tags.get(SOURCE_VERSION) != key:
            for k, value in {**v.tags, SOURCE_VERSION: key}.items():
                if copy.tags.get(k) != value:
                    dst.set_model_version_tag(v.name, copy.version, k, value)
        if copy is None:
            try:
                dst.create_registered_model(v.name)
            except MlflowException as e:
                if e.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
            # A version of a logged model names it in its source (`models:/m-...`).
            model_id = ids.get(v.model_id or v.source.removeprefix("models:/"))
            source = f"models:/{model_id}" if model_id else v.source
            dst.create_model_version(v.name, source, run_id=target, model_id=model_id,
                                     tags={**v.tags, SOURCE_VERSION: key},
                                     description=v.description, await_creation_for=0)
            # A retried POST whose answer was lost makes a second version: the first is kept.
            copies = sorted((c for c in dst.search_model_versions(f"run_id = '{target}'")
                             if c.name == v.name and c.tags.get(SOURCE_VERSION) == key),
                            key=lambda c: int(c.version))
            for extra in copies[1:]:
                dst.delete_model_version(v.name, extra.version)
            copy = copies[0]
            made += 1
        if copy.tags.get(ALIASES_SET):
            continue
        aliases = src.get_model_version(v.name, v.version).aliases
        for alias in aliases:
            if alias != "champion" or promotes(dst, v.name, v.tags.get("eval.accuracy"),
                                               v.tags.get(TASK))[0]:
                dst.set_registered_model_alias(v.name, alias, copy.version)
        dst.set_model_version_tag(v.name, copy.version, ALIASES_SET, "true")
    return made


def _failure(e: Exception, source: str, target: str) -> str:
    """A sync that the server refused or failed, or whose source store failed, in one line; what
    else fails is a bug, and raises."""
    import requests
    import sqlalchemy.exc
    from mlflow.exceptions import MlflowException

    if not isinstance(e, MlflowException | requests.RequestException | sqlalchemy.exc.SQLAlchemyError):
        raise e
    kept = "the source is kept" if source != stores.spool_uri() else f"the spool {stores.SPOOL}/ is kept"
    said = masked(stores.reason(e))
    if isinstance(e, sqlalchemy.exc.SQLAlchemyError):
        return f"reading {masked_uri(source).split('?')[0]} failed ({said}); {kept}"
    if refused := stores.refusal(e):  # a login or a permission: says whose, and how to get it
        return f"{refused}; nothing more was synced, {kept}"
    if stores.outage(e):
        if stores.ARTIFACTS_API in str(e):  # the server answers; the store behind it does not
            said = stores.outage_cause(e)
        return (f"the MLflow server {masked_uri(target)} failed ({said}); nothing is lost, "
                f"{kept}: rerun make sync when it answers")
    return f"the MLflow server {masked_uri(target)} refused the sync ({said}); {kept}"


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m reprotrain.tracking.sync",
                        description="Copy runs from a local MLflow store onto the tracking server.")
    ap.add_argument("--from", dest="source", default="",
                    help="a local store, e.g. sqlite:///path/mlflow.db (default: the spool)")
    ap.add_argument("--budget-s", type=positive_int, default=None,
                    help="stop between runs after this many seconds (default: no limit)")
    args = ap.parse_args(argv)
    target = os.environ.get("MLFLOW_TRACKING_URI", "")
    if not target:
        raise UserError("MLFLOW_TRACKING_URI is not set: set it to the tracking server to sync "
                        "to, e.g. MLFLOW_TRACKING_URI=http://host:5000 make sync")
    if problem := stores.http_settings():
        raise UserError(f"{problem}; nothing was synced")
    source = args.source or stores.spool_uri()
    if not args.source and not stores.spool_file().exists():
        print(f"nothing to sync: no spool at {stores.spool_file().parent} (no run was logged "
              "while the server was down)")
        return
    if (db := stores.sqlite_file(source)) is not None and not db.is_file():
        raise UserError(f"FROM={source}: no such file {db}; give the mlflow.db of the runs "
                        "to move, e.g. FROM=sqlite:///$HOME/old-clone/mlflow.db")
    if masked_uri(source) == masked_uri(target):
        raise UserError(f"FROM={masked_uri(source)} is MLFLOW_TRACKING_URI itself: nothing to move")
    if not args.source and (counts := spooled(stores.spool_file(), target)) and not counts[0]:
        # Every spooled run is on this server already (marked when sent): said without MLflow's
        # import or a request. FROM=sqlite:///$PWD/.mlflow-spool/mlflow.db checks each again.
        stores.spool_synced(time.time())
        print(Report(skipped=counts[1]).line(f"{stores.SPOOL}/", masked_uri(target)))
        return
    if stores.is_server(target) and not stores.reachable(target):
        raise UserError(f"the MLflow server {masked_uri(target)} does not answer (or "
                        "answers 5xx, as a proxy before a stopped one does): start it (make "
                        "server) or check MLFLOW_TRACKING_URI, then rerun make sync; the spool "
                        "is kept")
    started = time.time()
    try:
        # The spool: only its runs not yet sent whole to this target (as a stage's replay).
        report = sync(source, target, args.budget_s, unsynced_only=not args.source)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - narrowed below: the server's or the store's answers
        raise UserError(_failure(e, source, target)) from None
    if not args.source and not report.left:
        stores.spool_synced(started)
    for conflict in report.conflicts[:5]:
        print(f"warning: kept the server's value of {conflict} (MLflow params are immutable)")
    shown = args.source and masked_uri(source).split("?")[0] or f"{stores.SPOOL}/"
    print(report.line(shown, masked_uri(target)))


if __name__ == "__main__":
    run_stage(main)
