"""dvc.yaml declares, for every stage, its module and every stages/ module it imports: a missing
one would let the run-cache restore outputs that a code change made stale."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from reprotrain.bench.imports import closure, cycles, graph, module_file, sources
from stages import config
from tests.conftest import ROOT, copy_repo, env_with, run

# The platform never decides an output: tracking logs to MLflow and writes only side files that
# no stage reads back as an input, the sweep's trial hook only stops a pruned trial, serving logs
# the served model to MLflow, the warm process runs a stage as a fresh process would
# (tests/platform/test_warm.py). Editing it reruns no stage (dvc.yaml says why, and
# tests/platform/test_team_code_decides_no_output.py proves the outputs the same bytes with every store).
TEAM = ("reprotrain",)
# Modules of the experiment that change no output either: stages/__init__.py (the hand-off to
# the warm process), stages/lib/cli.py (exit codes, one-line errors, argparse helpers),
# stages/lib/errors.py (the error class they print), stages/hooks.py (a sweep's reporting hook,
# which can only stop a run).
NO_OUTPUT_EFFECT = {"stages", "stages.hooks", "stages.lib.cli", "stages.lib.errors"}


def team(module: str) -> bool:
    return any(module == t or module.startswith(t + ".") for t in TEAM)


def outside(module: str) -> bool:
    return module in NO_OUTPUT_EFFECT or team(module)


def stage_imports(module: str) -> set[str]:
    """The files of stages/ that `stages.<module>` imports, transitively, less the team's
    packages and NO_OUTPUT_EFFECT."""
    edges = graph(sources())
    return {module_file(m) for m in closure(edges, f"stages.{module}", outside) if not outside(m)}


def dvc_stages() -> dict:
    return OmegaConf.to_container(OmegaConf.load(ROOT / "dvc.yaml"))["stages"]


def test_every_stage_depends_on_exactly_the_code_it_runs():
    stages = dvc_stages()
    assert list(stages) == ["params", "prepare", "train", "evaluate", "export"]
    for name, stage in stages.items():
        assert stage["cmd"] == f"python -m stages.{name}"
        deps = set(stage["deps"])
        assert "requirements.lock" in deps, f"stage {name}: library versions change results"
        code = {d for d in deps if d.startswith("stages/")}
        missing, extra = stage_imports(name) - code, code - stage_imports(name)
        assert not missing, f"stage {name}: add {sorted(missing)} to its deps in dvc.yaml"
        # An extra one would rerun the stage for changes that cannot affect it.
        assert not extra, f"stage {name}: it never imports {sorted(extra)}; drop them from its deps"


def test_the_cli_module_changes_no_output():
    """What lets dvc.yaml leave stages/lib/cli.py out: it writes no file and imports no module that
    could (only the standard library, and stages.lib.files for its error numbers). It runs git only
    to read the index (`restat_stale_git_entries`), and touches mtimes, never contents."""
    tree = ast.parse((ROOT / "stages/lib/cli.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names} | {n.module for n in ast.walk(tree)
                                     if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "argparse", "atexit", "json", "os", "select", "signal",
                        "subprocess", "sys", "threading", "time", "typing", "warnings",
                        "collections.abc",
                        "contextlib", "pathlib", "stages.lib.errors", "stages.lib.files"}, imported
    errors = ast.parse((ROOT / "stages/lib/errors.py").read_text())
    assert not [n for n in ast.walk(errors) if isinstance(n, ast.Import | ast.ImportFrom)]
    # The warm process imports only the standard library and filelock (its lock): it holds no
    # module of this project, so each stage it forks imports the caller's own code.
    tree = ast.parse((ROOT / "reprotrain/warm.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names} | {n.module.split(".")[0] for n in ast.walk(tree)
                                     if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= sys.stdlib_module_names | {"__future__", "filelock"}, imported


def test_a_training_only_change_never_reruns_prepare():
    prepare = set(dvc_stages()["prepare"]["deps"])
    for module in ("loop", "batches", "optim", "checkpoints", "runtime", "models", "train"):
        assert f"stages/{module}.py" not in prepare
    # ...and evaluation and export never depend on the training loop.
    for stage in ("evaluate", "export"):
        assert not {"stages/loop.py", "stages/batches.py", "stages/optim.py"} & \
            set(dvc_stages()[stage]["deps"])


def test_the_code_writes_where_dvc_yaml_says():
    stages = dvc_stages()
    outs = {name: [next(iter(o)) if isinstance(o, dict) else o
                   for kind in ("outs", "metrics", "plots") for o in stage.get(kind, [])]
            for name, stage in stages.items()}
    assert outs["prepare"] == [str(config.PREPARED)]
    assert {str(Path(o).parent) for o in outs["train"]} == {str(config.TRAIN_DIR)}
    assert {str(Path(o).parent) for o in outs["evaluate"]} == {str(config.EVAL_DIR)}
    assert outs["export"] == [str(config.EXPORT_DIR)]
    assert str(config.PREPARED) in stages["train"]["deps"]


def test_a_dataset_added_beside_the_digits_leaves_their_prepare_up_to_date(tmp_path):
    """Issue 57: prepare depended on all of data/raw, so a user's dataset there changed the
    digits' prepare hash, and a clone's `dvc exp run --pull` pulled it and reran prepare."""
    from tests.support.image_files import make_folder

    repo = copy_repo(tmp_path)
    env = env_with()
    run(["dvc", "repro", "prepare"], repo, env=env)
    make_folder(repo / "data/raw/shapes", per_class=2, bad=False)
    p = run(["dvc", "status", "prepare"], repo, env=env)
    assert "Data and pipelines are up to date." in p.stdout, p.stdout


# The params keys no training reads, and the stage that declares each (mlflow: none, since
# where a run is logged changes no output). Every other key decides the weights.
NOT_TRAINING = {"data": "prepare", "eval": "evaluate", "export": "export", "mlflow": None}


def test_every_params_key_is_declared_by_the_stages_it_decides():
    """A new top-level key must reach train's dvc.yaml params and TRAINING_KEYS (the
    checkpoint folder's key), or be classed here as another stage's: missed, DVC restores
    stale weights and a checkpoint resumes across different values."""
    import dataclasses

    from stages.train import TRAINING_KEYS

    keys = [f.name for f in dataclasses.fields(config.Params)]
    training = [k for k in keys if k not in NOT_TRAINING]
    assert sorted(k.rstrip(".") for k in TRAINING_KEYS) == sorted(training), \
        "a params key is neither in stages/train.py's TRAINING_KEYS nor in NOT_TRAINING here"
    assert sorted(dvc_stages()["train"]["params"]) == sorted(training), \
        "dvc.yaml's train params differ from the keys that decide the weights"
    for key, stage in NOT_TRAINING.items():
        assert key in keys, f"NOT_TRAINING names {key}, which Params no longer has"
        if stage:
            assert key in dvc_stages()[stage]["params"], f"dvc.yaml: add {key} to {stage}'s params"


def test_the_stages_import_each_other_without_a_cycle():
    """Imports inside functions included: a cycle means the modules cannot be read, tested or
    changed one at a time (tracking and sync once imported each other)."""
    assert not cycles(graph(sources()))


def test_the_experiment_never_imports_the_teams_tools():
    """Only the stages reach into the team's packages (to log, and the sweep's hook): the
    experiment's own modules, which a fork edits, stay free of them."""
    edges = graph(sources())
    stages = {f"stages.{s}" for s in dvc_stages()} | {"stages.predict"}
    for module, imported in edges.items():
        if module.count(".") == 1 and module not in stages and not team(module):
            assert not {m for m in imported if team(m)}, f"{module} imports the team's tools"


def test_line_charts_legends_tell_the_dashed_field_from_the_solid(tmp_path):
    """DVC dashes the second field of a chart ([8, 8]); at Vega's default legend symbol (10 px)
    both fields looked solid, so nothing said which curve was validation (issue 22's third walk)."""
    repo = copy_repo(tmp_path / "repo")
    run(["dvc", "plots", "show", "-o", str(tmp_path / "plots")], repo, env=env_with())
    page = (tmp_path / "plots/index.html").read_text()
    specs = [json.loads(line.split("=", 1)[1].strip().removesuffix(";"))
             for line in page.splitlines() if line.strip().startswith("var spec = ")]
    dashed = {s["title"]["text"]: s for s in specs if "field" in s.get("encoding", {}).get("strokeDash", {})}
    assert set(dashed) == {"loss per epoch (log scale)", "accuracy per epoch"}, list(dashed)
    for title, spec in dashed.items():
        period = max(sum(d) for d in spec["encoding"]["strokeDash"]["scale"]["range"])
        # A stroke symbol is sqrt(symbolSize) long: it must hold a dash, its gap and more.
        assert spec["config"]["legend"]["symbolSize"] ** 0.5 > period, title
    assert dashed["loss per epoch (log scale)"]["encoding"]["y"]["scale"] == {"type": "log"}
    assert dashed["accuracy per epoch"]["encoding"]["y"]["scale"] == {"zero": False}


def test_the_committed_lock_names_the_committed_code():
    """A stage's file changed without relocking (stages/train.py once): every fresh clone's
    `make repro` retrained, and README's S3 restore with it. Only committed bytes count: the
    workspace's outputs (a model retrained on this CPU after `make repro`) are not the lock's."""
    import hashlib

    from tests.conftest import committed

    lock = OmegaConf.to_container(OmegaConf.create(committed("dvc.lock").decode()))["stages"]
    in_git = set(subprocess.run(["git", "ls-tree", "-r", "--name-only", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.split())
    outs = {out["path"]: out["md5"] for stage in lock.values() for out in stage.get("outs", [])}
    deps = [(name, dep) for name, stage in lock.items() for dep in stage.get("deps", [])]
    stale = [f"{name}: {dep['path']}" for name, dep in deps if dep["path"] in in_git
             and hashlib.md5(committed(dep["path"])).hexdigest() != dep["md5"]]
    # A stage's output read by a later stage: the lock must name the same bytes on both sides.
    stale += [f"{name}: {dep['path']} (an output of another stage)" for name, dep in deps
              if dep["path"] in outs and outs[dep["path"]] != dep["md5"]]
    assert not stale, f"dvc.lock names other code for {stale}: `dvc repro`, then commit dvc.lock"
