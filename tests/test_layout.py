"""The shape of the code: the experiment in stages/, the platform in reprotrain/, and the hooks
between them (docs/code-map.md)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from importlib.util import find_spec

from reprotrain.bench.imports import closure, crossing, graph, lines, packages_of, sources, summary
from tests.conftest import ROOT


def test_every_module_the_makefile_runs_exists():
    modules = set(re.findall(r"\$\(PY\) -m ((?:stages|reprotrain)[\w.]*)",
                             (ROOT / "Makefile").read_text()))
    assert {"stages.params", "reprotrain.tracking.sync", "reprotrain.sweep"} <= modules
    for module in modules:
        spec = find_spec(module)
        assert spec and (spec.submodule_search_locations is None or
                         find_spec(f"{module}.__main__")), f"`python -m {module}` cannot run"


def test_the_experiment_reaches_the_platform_only_through_its_hooks():
    """The tracker the stages log to, and the warm hand-off's one line; the sweep's reporting
    hook is named in the environment, so it is no arrow at all."""
    assert crossing(graph(sources())) == [
        ("stages", "reprotrain.warm"), ("stages.evaluate", "reprotrain.tracking"),
        ("stages.export", "reprotrain.tracking"), ("stages.train", "reprotrain.tracking")]


def test_the_experiment_is_small_and_mostly_what_a_fork_edits():
    n = lines()
    assert n["all of stages/"] == n["the experiment (stages/ less the platform)"] <= 6500, n
    assert 4 * n["of which the five a fork edits"] >= n["all of stages/"], n


def test_the_experiments_tests_start_no_service():
    """tests/experiment/ runs without the platform's services (PostgreSQL, an MLflow server, S3,
    SLURM: the fixtures of tests/support/services.py and slurm_cluster.py); tests/platform/
    starts them."""
    for path in sorted((ROOT / "tests/experiment").glob("test_*.py")):
        used = {a.name for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) and node.module in (
                    "tests.support.services", "tests.support.slurm_cluster") for a in node.names}
        assert used <= {"free_port"}, (path.name, used)


def test_readme_is_a_how_to_of_at_most_250_lines():
    """Measurements and the long forms live in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_the_top_of_stages_holds_the_experiment_and_the_tools_have_packages():
    edges = graph(sources())
    top = {m.removeprefix("stages.") for m in edges if m.count(".") == 1} - \
        {m.removeprefix("stages.") for m in packages_of(edges)}
    assert {"params", "prepare", "train", "evaluate", "export", "predict", "models", "sources",
            "loop", "config"} <= top
    assert summary(edges)["top_level_modules"] <= 22, sorted(top)
    assert {"reprotrain.tracking", "reprotrain.sweep", "reprotrain.serving", "reprotrain.team",
            "reprotrain.bench", "stages.lib"} <= packages_of(edges)
    assert summary(edges)["cycles"] == 0


def test_the_code_maps_picture_draws_from_this_checkout(tmp_path):
    """docs/code-map.md's command, as written: it drew nothing once stages/__init__ imported."""
    out = tmp_path / "imports.png"
    p = subprocess.run([sys.executable, "-m", "reprotrain.bench.imports", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", p.stderr
    assert p.stdout.startswith("modules=") and "cycles=0" in p.stdout.splitlines()[0]


def test_no_module_of_stages_imports_the_tests():
    """stages/ and reprotrain/ are the shipped packages: tests/ is not installed beside them."""
    found = []
    for path in sorted([*(ROOT / "stages").rglob("*.py"), *(ROOT / "reprotrain").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                      if n == "tests" or n.startswith("tests.")]
    assert not found, found


def test_a_submodule_not_yet_imported_still_imports_from_its_package():
    """tracking's lazy names (its __getattr__) must not stand in the way of its own modules."""
    p = subprocess.run([sys.executable, "-c", "from reprotrain.tracking import sync; "
                        "from reprotrain.serving import registry; from reprotrain.sweep import spec; "
                        "print(sync.__name__, registry.__name__, spec.__name__)"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.stdout.split() == ["reprotrain.tracking.sync", "reprotrain.serving.registry",
                                "reprotrain.sweep.spec"], p.stderr


def test_the_sweeps_processes_import_no_torch():
    """The launcher and each worker start in a third of a second, not 2.5 s: torch is the
    trials' (`dvc exp run`'s stages), not theirs."""
    p = subprocess.run([sys.executable, "-c", "import sys; from reprotrain.sweep import launch, report, "
                        "slurm, study, trial, worker; print(sorted({'torch', 'mlflow'} & set(sys.modules)))"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == "[]", (p.stdout, p.stderr)


def test_the_served_models_code_copy_is_what_it_imports():
    """The served model runs away from the checkout on the copy of stages/ saved with it: every
    module it imports, transitively, and the registries config reads as text."""
    from stages.inference import PACKAGE

    needed = {m.removeprefix("stages.").replace(".", "/") for m in
              closure(graph(sources()), "stages.served_model", lambda m: False)}
    packages = {"__init__.py", "lib/__init__.py"}
    assert set(PACKAGE) == {f"{m}.py" for m in needed - {"served_model"}} | packages | \
        {"models.py", "sources.py"}


def test_every_test_the_docs_name_exists():
    """docs/guarantees.md and docs/code-map.md name the test that keeps each promise
    (`test_x.py::test_y`, or `::test_z` for another of the same file): a renamed or deleted
    test would leave a row that nothing keeps."""
    where = {p.name: p for p in (ROOT / "tests").rglob("test_*.py")}  # names are unique
    for doc in ("docs/guarantees.md", "docs/code-map.md"):
        named, file = 0, None
        for ref in re.findall(r"`((?:test_\w+\.py)?(?:::\w+)?)`", (ROOT / doc).read_text()):
            head, _, name = ref.partition("::")
            file = head or file
            assert file in where, f"{doc}: no tests/**/{file}"
            if name:
                tree = ast.parse(where[file].read_text())
                assert name in {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}, \
                    f"{doc}: no {name} in tests/{file}"
                named += 1
        assert named >= (150 if doc.endswith("guarantees.md") else 1), (doc, named)


def test_every_code_block_of_the_docs_is_closed():
    """An unclosed fence renders the rest of a page as code, and its code as prose (server.md's
    bench recipe once swallowed the next section)."""
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        fences = [n for n, line in enumerate(doc.read_text().splitlines(), 1)
                  if line.lstrip().startswith("```")]
        assert len(fences) % 2 == 0, f"{doc.name}: a code block opened at line {fences[-1]} never ends"


def test_no_function_of_the_shipped_code_is_over_80_lines():
    """A function is read on one screen and a half at most (issue 58): its physical lines from
    `def` to its last, decorators left out, under stages/ and the platform's reprotrain/ (where
    it exists). A longer one splits into named helpers."""
    long = []
    for folder in (ROOT / name for name in ("stages", "reprotrain")):
        for path in sorted(folder.rglob("*.py")) if folder.is_dir() else []:
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                        node.end_lineno - node.lineno + 1 > 80:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                                f"({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long
