"""The shape of stages/: the experiment at the top, the team's tools in packages, and every
module path a user could have typed before the move still answering."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from importlib.util import find_spec

import pytest

from stages import MOVED
from stages.bench.imports import graph, packages_of, sources, summary
from tests.conftest import ROOT


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_names_its_new_place(old):
    with pytest.raises(ModuleNotFoundError, match=rf"^stages\.{old} moved to stages\.{MOVED[old]}: "):
        importlib.import_module(f"stages.{old}")
    assert find_spec(f"stages.{MOVED[old]}"), f"stages.{MOVED[old]} does not exist"


def test_python_m_on_an_old_path_says_the_command_that_runs_now():
    p = subprocess.run([sys.executable, "-m", "stages.sync", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert "stages.sync moved to stages.tracking.sync: run `python -m stages.tracking.sync`" in p.stderr


def test_every_module_the_makefile_runs_exists():
    modules = set(re.findall(r"\$\(PY\) -m (stages[\w.]*)", (ROOT / "Makefile").read_text()))
    assert {"stages.params", "stages.tracking.sync", "stages.sweep"} <= modules
    for module in modules:
        spec = find_spec(module)
        assert spec and (spec.submodule_search_locations is None or
                         find_spec(f"{module}.__main__")), f"`python -m {module}` cannot run"


def test_the_top_of_stages_holds_the_experiment_and_the_tools_have_packages():
    edges = graph(sources())
    top = {m.removeprefix("stages.") for m in edges if m.count(".") == 1} - \
        {m.removeprefix("stages.") for m in packages_of(edges)}
    assert {"params", "prepare", "train", "evaluate", "export", "predict", "models", "sources",
            "loop", "config"} <= top
    assert summary(edges)["top_level_modules"] <= 20, sorted(top)
    assert {"stages.tracking", "stages.sweep", "stages.serving", "stages.team", "stages.bench",
            "stages.lib"} <= packages_of(edges)
    assert summary(edges)["cycles"] == 0


@pytest.mark.parametrize("package,name,home", [
    ("serving", "load_champion", "serving.registry"), ("tracking", "replay_spool", "tracking.spool"),
    ("sweep", "load_sweep", None)])
def test_a_name_from_a_module_that_became_a_package_names_its_new_module(package, name, home):
    """README once showed `from stages.serving import load_champion`: it names where it lives."""
    with pytest.raises(ImportError) as e:
        exec(f"from stages.{package} import {name}")
    where = re.match(rf"stages\.{package}\.{name} moved to (stages\.[\w.]+)\.{name}: import it",
                     str(e.value))
    assert where, e.value
    assert home is None or where[1] == f"stages.{home}"
    assert find_spec(where[1])


def test_a_moved_library_module_is_not_offered_to_run():
    with pytest.raises(ModuleNotFoundError, match="moved to stages.lib.cli: import stages.lib.cli$"):
        importlib.import_module("stages.cli")


def test_no_module_of_stages_imports_the_tests():
    """stages/ is the shipped package: tests/ is not installed beside it."""
    found = []
    for path in sorted((ROOT / "stages").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                      if n == "tests" or n.startswith("tests.")]
    assert not found, found


def test_a_submodule_not_yet_imported_still_imports_from_its_package():
    """The packages' __getattr__ (old names) must not stand in the way of their own modules."""
    p = subprocess.run([sys.executable, "-c", "from stages.tracking import sync; "
                        "from stages.serving import registry; from stages.sweep import spec; "
                        "print(sync.__name__, registry.__name__, spec.__name__)"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.stdout.split() == ["stages.tracking.sync", "stages.serving.registry",
                                "stages.sweep.spec"], p.stderr
