"""reprotrain. At the top: the five DVC stages (params, prepare, train, evaluate, export),
`python -m stages.predict`, and the experiment they run, what a fork changes (config, models,
sources, data, batches, loop, optim, metrics, checkpoints, weights, runtime, report,
distributed). The team's tools live in packages: tracking, sweep, serving, team, bench, and lib
for plumbing that knows no params schema.
"""

import importlib.abc
import sys

# `python -m stages.<stage>`, as DVC runs it: in the warm process where one serves, which has
# torch and MLflow imported already (stages/lib/warm.py); otherwise here, as usual.
if sys.argv[:1] == ["-m"] and "-m" in sys.orig_argv \
        and sys.orig_argv[sys.orig_argv.index("-m") + 1].count(".") == 1:
    from stages.lib.warm import hand_off

    hand_off(sys.orig_argv[sys.orig_argv.index("-m") + 1])

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


def _runs(module: str) -> bool:
    """Whether `python -m module` does something: a package with __main__, or a script."""
    from importlib.util import find_spec

    spec = find_spec(module)
    if spec.submodule_search_locations:
        return find_spec(f"{module}.__main__") is not None
    with open(spec.origin) as f:
        return 'if __name__ == "__main__":' in f.read()


class _Moved(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix("stages.")
        if fullname.startswith("stages.") and old in MOVED:
            new = f"stages.{MOVED[old]}"
            how = f"run `python -m {new}` or import {new}" if _runs(new) else f"import {new}"
            raise ModuleNotFoundError(f"{fullname} moved to {new}: {how}", name=fullname)
        return None


sys.meta_path.append(_Moved())


def moved_attribute(package: str, name: str):
    """For a package that was one module before the move (stages.serving, sweep, tracking): an
    old `from stages.serving import load_champion` names the module that holds it now."""
    import importlib
    import pkgutil

    if not name.startswith("_"):
        modules = [f"{package}.{m.name}" for m in pkgutil.iter_modules(
            importlib.import_module(package).__path__) if m.name != "__main__"]
        if f"{package}.{name}" in modules:  # `from stages.tracking import sync`: the module itself
            return importlib.import_module(f"{package}.{name}")
        holding = [m for m in modules if name in vars(importlib.import_module(m))]
        # The module that defines it, before those that import it.
        for module in sorted(holding, key=lambda m: getattr(
                vars(sys.modules[m])[name], "__module__", None) != m):
            raise ImportError(f"{package}.{name} moved to {module}.{name}: import it from there",
                              name=package)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")


def __getattr__(name: str):
    if name in MOVED:  # `from stages import sync`
        raise ImportError(f"stages.{name} moved to stages.{MOVED[name]}: import it from there",
                          name=f"stages.{name}")
    raise AttributeError(f"module 'stages' has no attribute {name!r}")
