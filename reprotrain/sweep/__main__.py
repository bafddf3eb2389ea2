"""`python -m reprotrain.sweep run|worker|status` (`make sweep`)."""

from __future__ import annotations

import os
from pathlib import Path

from reprotrain import sweep
from reprotrain.sweep.launch import WORKDIR, run
from reprotrain.sweep.report import status
from reprotrain.sweep.study import bound_connect_time
from reprotrain.sweep.trial import STORAGE_ENV
from reprotrain.sweep.worker import worker
from stages.lib.cli import ArgumentParser, run_stage


def main() -> None:
    parser = ArgumentParser(prog="python -m reprotrain.sweep", description=sweep.__doc__.splitlines()[0])
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


run_stage(main)
