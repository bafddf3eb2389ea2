"""dvc.yaml declares, for every stage, its module and every stages/ module it imports: a missing
one would let the run-cache restore outputs that a code change made stale."""

from __future__ import annotations

import ast

from omegaconf import OmegaConf

from tests.conftest import ROOT


def stage_imports(module: str) -> set[str]:
    """stages/*.py files imported by `module`, transitively."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        tree = ast.parse((ROOT / "stages" / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "stages":
                    todo += [a.name for a in node.names]
                elif node.module.startswith("stages."):
                    todo.append(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                todo += [a.name.split(".")[1] for a in node.names if a.name.startswith("stages.")]
    return {f"stages/{n}.py" for n in seen}


def test_every_stage_depends_on_all_the_code_it_runs():
    stages = OmegaConf.to_container(OmegaConf.load(ROOT / "dvc.yaml"))["stages"]
    assert list(stages) == ["prepare", "train", "evaluate", "export"]
    for name, stage in stages.items():
        assert stage["cmd"] == f"python -m stages.{name}"
        deps = set(stage["deps"])
        assert "requirements.lock" in deps, f"stage {name}: library versions change results"
        missing = stage_imports(name) - deps
        assert not missing, f"stage {name}: add {sorted(missing)} to its deps in dvc.yaml"
