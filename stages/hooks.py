"""Where the platform reaches into a run: the experiment's two hooks, so that nothing here
imports the platform's sweeps, servers or team tools (docs/code-map.md; the third arrow is
stages/__init__.py's one line, the hand-off to the warm process).

- The tracker the stages log to: `reprotrain.tracking` (train, evaluate, export import it).
- Epoch reporting, below: a sweep (reprotrain/sweep/trial.py) names a callable in the
  environment, and train hands it the loop's `log`. Outside a sweep nothing is imported.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stages.loop import Log

# "module:function", called as function(log, rank, world) and returning the `log` the loop
# calls after each step and epoch. Through the environment: the sweep starts `dvc exp run`,
# which starts this stage, and no argument reaches it on that way.
REPORT_HOOK_ENV = "REPROTRAIN_REPORT_HOOK"


class Stopped(SystemExit):
    """A hook's stop of a run (a sweep's pruner): its exit code, and the tags that say why,
    which train sets on the run before it ends."""

    def __init__(self, code: int, tags: dict[str, str | int]):
        super().__init__(code)
        self.tags = tags


def reporting(log: Log, rank: int, world: int) -> Log:
    """`log`, or what the hook named in the environment makes of it."""
    hook = os.environ.get(REPORT_HOOK_ENV)
    if not hook:
        return log
    module, _, name = hook.partition(":")
    return getattr(importlib.import_module(module), name)(log, rank, world)
