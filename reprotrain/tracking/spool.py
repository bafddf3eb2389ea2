"""The outage path: a run logged into the local spool (.mlflow-spool/, an embedded store of its
own) while the tracking server does not answer, and the spool replayed when a stage finds the
server answering again (at most REPLAY_S; `make sync`, reprotrain/tracking/sync.py, sends the
rest). The Tracker switches to the spool; stores.py says where it is and what an outage is.
"""

from __future__ import annotations

import platform
import sys
import time

from reprotrain.redact import masked_uri
from reprotrain.tracking.names import EXPERIMENT_TAGS, run_name
from reprotrain.tracking.stores import (
    SERVER_RUN,
    SPOOL,
    SYNCED,
    is_server,
    mark_failing,
    outage,
    reason,
    refusal,
    spool_file,
    spool_synced,
    spool_uri,
    store_lock,
)
from stages.lib.paths import repo_root

REPLAY_S = 30  # a stage replays the spool for at most this long before its own work


def open_spool_run(experiment: str, run_id: str | None, name: str, server: str):
    """Open the spool's run for `run_id` (a run of the server, or one spooled before), or a
    new one; the fluent API's tracking URI is the spool's already."""
    import mlflow

    client = mlflow.MlflowClient()
    with store_lock(spool_uri()):
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            location = (repo_root() / SPOOL / "artifacts").as_uri()
            exp_id = client.create_experiment(experiment, artifact_location=location,
                                              tags=EXPERIMENT_TAGS)
        else:
            exp_id = exp.experiment_id
            if exp.lifecycle_stage == "deleted":
                client.restore_experiment(exp_id)
    (spool_file().parent / "unsynced").touch()
    found = None
    if run_id:
        runs = client.search_runs([exp_id], filter_string=f"tags.`{SERVER_RUN}` = '{run_id}'",
                                  max_results=1)
        found = runs[0].info.run_id if runs else None
        if found is None:
            try:
                found = client.get_run(run_id).info.run_id  # a run spooled at its start
            except Exception:  # noqa: BLE001 - a run of the server: continued below
                pass
    if found:
        if SYNCED in client.get_run(found).data.tags:  # reopened: sync sends it again
            client.delete_tag(found, SYNCED)
        return mlflow.start_run(run_id=found)
    return mlflow.start_run(experiment_id=exp_id, run_name=name or run_name(),
                            tags={SERVER_RUN: run_id or "", "reprotrain.spooled_for": masked_uri(server),
                                  "reprotrain.spooled_on": platform.node()})


def replay_spool(uri: str) -> None:
    """A stage that finds the server answering sends what was spooled first (at most
    REPLAY_S; `make sync` sends the rest). Never fails the stage."""
    marker = spool_file().parent / "unsynced"
    if not is_server(uri) or not marker.exists():
        return
    from reprotrain.tracking.sync import Busy, sync

    started = time.time()
    try:
        report = sync(spool_uri(), uri, budget_s=REPLAY_S, unsynced_only=True, wait_s=REPLAY_S)
    except Busy as e:  # a `make sync` holds the spool: it sends what this replay would
        print(f"note: {e}; this stage goes on", file=sys.stderr)
        return
    except Exception as e:  # noqa: BLE001 - the stage's own run comes first
        if outage(e):  # the stage's run goes to the spool too: its one line says why
            mark_failing(uri, e)
            return
        print(f"warning: replaying the spool {SPOOL}/ to {masked_uri(uri)} failed "
              f"({refusal(e) or reason(e)}); `make sync` retries it", file=sys.stderr)
        return
    if not report.left:
        spool_synced(started)
    if report.runs or report.left:
        print(report.line(f"{SPOOL}/", masked_uri(uri)), file=sys.stderr)
