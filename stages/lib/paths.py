"""Where the real workspace is, for every module that writes beside it (the MLflow store, the
spool, checkpoints, the data root)."""

from __future__ import annotations

import os
from pathlib import Path


def repo_root() -> Path:
    """The real workspace: DVC sets DVC_ROOT to it, also for --temp/--queue runs in a copy."""
    return Path(os.environ.get("DVC_ROOT") or Path.cwd()).resolve()
