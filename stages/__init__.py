"""reprotrain. At the top: the five DVC stages (params, prepare, train, evaluate, export),
`python -m stages.predict`, and the experiment they run, what a fork changes (config, models,
sources, data, batches, loop, optim, metrics, checkpoints, weights, runtime, report,
distributed). The team's tools live in packages: tracking, sweep, serving, team, bench, and lib
for plumbing that knows no params schema.
"""

import importlib.abc
import sys

# Modules that moved into packages: `python -m stages.sync` or `from stages import sync` names
# the new place instead of failing with a bare "No module named".
MOVED = {
    "cli": "lib.cli", "files": "lib.files", "images": "lib.images", "redact": "lib.redact",
    "pip_progress": "lib.pip_progress", "stores": "tracking.stores", "sync": "tracking.sync",
    "trial": "sweep.trial", "slurm": "sweep.slurm", "served_model": "serving.served_model",
    "serve": "serving.app", "server": "team.server", "ui": "team.ui", "share": "team.share",
    "verify": "team.verify", "bench_pipeline": "bench.pipeline", "bench_serve": "bench.serving",
    "bench_sweep": "bench.sweep", "model_file": "weights",
}


class _Moved(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix("stages.")
        if fullname.startswith("stages.") and old in MOVED:
            new = f"stages.{MOVED[old]}"
            raise ModuleNotFoundError(f"{fullname} moved to {new}: run `python -m {new}` or "
                                      f"import {new}", name=fullname)
        return None


sys.meta_path.append(_Moved())


def __getattr__(name: str):
    if name in MOVED:  # `from stages import sync`
        raise ImportError(f"stages.{name} moved to stages.{MOVED[name]}: import it from there",
                          name=f"stages.{name}")
    raise AttributeError(f"module 'stages' has no attribute {name!r}")
