"""params.yaml validation: bad input fails naming the key and the fix, before any work."""

from __future__ import annotations

import dataclasses

import pytest

from stages.config import ARCHS, Params, ParamsError, flatten, load_params
from tests.conftest import ROOT, committed, copy_params, set_params


def write(tmp_path, text: str):
    p = tmp_path / "params.yaml"
    p.write_text(text)
    return p


def test_repo_params_load_and_cover_the_whole_schema(tmp_path):
    params = load_params(copy_params(tmp_path))
    assert isinstance(params, Params)
    # Every schema key is spelled out in params.yaml, so users see (and `-S` can set) all of them.
    from omegaconf import OmegaConf

    def keys(d, prefix=""):
        out = set()
        for k, v in d.items():
            out |= keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}"}
        return out

    raw = OmegaConf.to_container(OmegaConf.create(committed("params.yaml").decode()))
    assert keys(raw) == set(flatten(Params()))


def test_top_level_keys_that_dvc_exp_run_S_needs(tmp_path):
    params = load_params(copy_params(tmp_path))
    for key in ("seed", "lr", "epochs", "batch_size"):
        assert key in flatten(params)


def test_scientific_notation_is_a_float(tmp_path):
    assert load_params(write(tmp_path, "lr: 1e-3\n")).lr == pytest.approx(0.001)


@pytest.mark.parametrize("text, expected", [
    ("lrr: 0.1\n", "did you mean 'lr'"),
    ("train:\n  warmup_epoch: 1\n", "did you mean 'train.warmup_epochs'"),
    ("trian:\n  lr: 1\n", "did you mean 'train'"),
    ("lr: '1e-3'\n", "lr='1e-3' must be float, not str (remove the quotes)"),
    ("epochs: 2.5\n", "epochs=2.5 must be int"),
    ("train:\n  ema: 1\n", "train.ema=1 must be bool"),
    ("lr: -0.1\n", "lr=-0.1 is invalid: must be > 0"),
    ("lr: 0\n", "lr=0"),
    ("epochs: 0\n", "epochs=0 is invalid: must be >= 1"),
    ("data:\n  val_fraction: 1.5\n", "data.val_fraction=1.5 is invalid: must be in (0, 1)"),
    ("data:\n  test_fraction: 0\n", "data.test_fraction=0"),
    ("data:\n  val_fraction: 0.5\n  test_fraction: 0.5\n", "must leave training data"),
    ("model:\n  arch: vgg99\n", f"model.arch='vgg99' is invalid: choose one of {', '.join(ARCHS)}"),
    ("data:\n  source: imagenet\n", "data.source='imagenet' is invalid"),
    ("train:\n  precision: fp8\n", "train.precision='fp8'"),
    ("train:\n  compile: fast\n", "train.compile='fast'"),
    ("train: 3\n", "'train' must be a section"),
])
def test_bad_params_fail_naming_the_key(tmp_path, text, expected):
    with pytest.raises(ParamsError) as err:
        load_params(write(tmp_path, text))
    assert expected in str(err.value)
    assert "params.yaml" in str(err.value)


def test_union_fields_accept_each_form(tmp_path):
    p = load_params(write(tmp_path, "train:\n  compile: reduce-overhead\n  num_workers: 3\n"))
    assert p.train.compile == "reduce-overhead" and p.train.num_workers == 3
    assert load_params(write(tmp_path, "train:\n  compile: true\n")).train.compile is True


@pytest.mark.parametrize("text, expected", [
    # A suggestion ends its own sentence: no "?." (issue 22's third walk met one).
    ("lrr: 0.05\n", "did you mean 'lr'? `dvc exp run -S` wrote this value into params.yaml"),
    ("lr: '1e-3'\n", "(remove the quotes). `dvc exp run -S` wrote this value into params.yaml"),
])
def test_a_workspace_exp_run_says_how_to_undo_what_it_wrote(tmp_path, monkeypatch, text,
                                                            expected):
    # As the params stage of a workspace `dvc exp run` sees it: DVC_EXP_NAME set, run from the
    # workspace root.
    write(tmp_path, text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DVC_EXP_NAME", "beery-stay")
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    with pytest.raises(ParamsError) as err:
        load_params("params.yaml")
    assert expected in str(err.value)
    assert "?." not in str(err.value)
    assert "`git checkout -- params.yaml`" in str(err.value)


def test_missing_file_says_where_to_run(tmp_path):
    with pytest.raises(ParamsError, match="not found; run from the repository root"):
        load_params(tmp_path / "nope.yaml")


def test_flatten_names_match_yaml(tmp_path):
    """The dotted names MLflow, DVC's -S and the checkpoint key use are the YAML's own paths:
    checked against the file as YAML reads it, not against the schema."""
    import yaml

    def leaves(node: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in node.items():
            out |= leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value}
        return out

    path = copy_params(tmp_path)
    set_params(path, {"train.warmup_epochs": "2.5", "model.width": "48"})  # not the defaults
    flat = flatten(load_params(path))
    assert flat == leaves(yaml.safe_load(path.read_text()))
    assert flat["train.warmup_epochs"] == 2.5 and flat["model.width"] == 48
    assert all(not dataclasses.is_dataclass(v) for v in flat.values())


def test_every_param_is_explained_in_the_readme():
    readme = (ROOT / "docs/params.md").read_text()
    missing = [k for k in flatten(Params()) if f"| `{k}` |" not in readme]
    assert not missing, f"document these params in docs/params.md: {missing}"


def test_each_registry_holds_exactly_the_choices_the_config_accepts(tmp_path):
    """config reads the models' and sources' names from their registries' source (tests/
    test_contracts.py checks each entry)."""
    from stages import config, models, optim, sources

    assert list(models.ARCHS) == list(config.ARCHS)
    assert list(optim.SCHEDULES) == list(config.SCHEDULES)
    assert list(sources.SOURCES) == list(config.SOURCES)
    with pytest.raises(ParamsError, match=f"model.arch='vit'.*choose one of {', '.join(ARCHS)}"):
        load_params(write(tmp_path, "model:\n  arch: vit\n"))


def test_the_params_doc_names_no_choice_that_is_gone():
    """docs/params.md may name some models and sources or none (their registries own the lists:
    adding one touches no other file), but none that is not registered. It names every schedule."""
    import re

    from stages import config

    rows = {line.split("|")[1].strip(" `"): line.split("|")[3]
            for line in (ROOT / "docs/params.md").read_text().splitlines()
            if line.startswith("| `") and line.count("|") >= 4}
    for key, choices in (("model.arch", config.ARCHS), ("data.source", config.SOURCES)):
        gone = set(re.findall(r"`(\w+)`", rows.get(key, ""))) - set(choices)
        assert not gone, f"docs/params.md's row for {key} names {sorted(gone)}, not registered"
    missing = [c for c in config.SCHEDULES if f"`{c}`" not in rows["train.schedule"]]
    assert not missing, f"docs/params.md's row for train.schedule does not name {missing}"


def test_defaults_agree_in_the_schema_params_yaml_and_the_readme(tmp_path):
    """The schema's defaults are the shipped params.yaml and docs/params.md's default column."""
    import re

    assert load_params(copy_params(tmp_path)) == Params()
    rows = re.findall(r"^\| `([\w.]+)` \| ([^|]*) \|", (ROOT / "docs/params.md").read_text(), re.M)
    documented = {key: default.strip() for key, default in rows}
    for key, value in flatten(Params()).items():
        shown = str(value).lower() if isinstance(value, bool) else str(value)
        assert key in documented, f"docs/params.md's parameter table lacks {key}"
        assert documented[key] in (shown, f"`{shown}`", f"'{shown}'", '""' * (value == "")), \
            f"docs/params.md says {key} defaults to {documented[key]!r}; the schema says {value!r}"


def test_a_finished_stage_exits_without_losing_anything(tmp_path):
    """run_stage skips the interpreter's teardown: a thread still writing, an exit handler and
    unflushed output must all come out as on a normal exit, with exit status 0, and an idle
    thread pool (MLflow's, Inductor's) must not keep it waiting."""
    import os
    import subprocess
    import sys

    script = tmp_path / "stage.py"
    script.write_text(f"""
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from stages.lib.cli import run_stage
out = Path({str(tmp_path)!r})
pool = ThreadPoolExecutor(1)

def late_writer():
    time.sleep(0.5)
    (out / "thread.txt").write_text("written")

def main():
    threading.Thread(target=late_writer).start()
    pool.submit(print, end="")  # its worker stays, idle, until the pool is shut down
    atexit.register(lambda: (out / "atexit.txt").write_text("ran"))
    print("no newline, still buffered", end="")
    sys.stderr.write("to stderr")

run_stage(main)
raise SystemExit("run_stage returned: the stage did not exit")
""")
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**{k: v for k, v in os.environ.items()
                                               if k != "PYTHONUNBUFFERED"},  # really buffered
                                            "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "no newline, still buffered"
    assert done.stderr.endswith("to stderr")
    assert (tmp_path / "thread.txt").read_text() == "written"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
