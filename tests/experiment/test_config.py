"""params.yaml validation: bad input fails naming the key and the fix, before any work.
Also what would only fail late or split the stages from DVC: YAML errors and bombs,
interpolation, values that fail later, out-of-range seeds and process counts, and the advice
after a refused `dvc exp run -S`. Most are a real file given to a real stage process."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from stages.config import ARCHS, Params, ParamsError, flatten, load_params
from stages.lib.strict_yaml import MAX_YAML_BYTES
from tests.conftest import ROOT, committed, copy_params, copy_repo, env_with, run, set_params
from tests.support.training import fit, linear_model
from tests.support.workspaces import one_error_line


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
    ("train:\n  augment_crop_scale: [0.5]\n", "train.augment_crop_scale=[0.5] is invalid: give "
     "[min, max] areas with 0 < min <= max <= 1 ([1.0, 1.0]: off)"),
    ("train:\n  augment_crop_scale: [0.9, 0.3]\n", "train.augment_crop_scale=[0.9, 0.3]"),
    ("train:\n  augment_crop_scale: [0, 1]\n", "train.augment_crop_scale=[0.0, 1.0]"),
    ("train:\n  augment_crop_ratio: [1.5, 0.5]\n", "train.augment_crop_ratio=[1.5, 0.5] is "
     "invalid: give [min, max] aspect ratios (width/height) with 0 < min <= max"),
])
def test_bad_params_fail_naming_the_key(tmp_path, text, expected):
    with pytest.raises(ParamsError) as err:
        load_params(write(tmp_path, text))
    assert expected in str(err.value)
    assert "params.yaml" in str(err.value)


def test_only_a_quoted_number_is_told_to_lose_its_quotes(tmp_path):
    # `-S epochs=abc` writes `epochs: abc`: no quotes anywhere to remove.
    with pytest.raises(ParamsError) as err:
        load_params(write(tmp_path, "epochs: abc\n"))
    assert str(err.value) == "params.yaml: epochs='abc' must be int, not str"


def test_union_fields_accept_each_form(tmp_path):
    p = load_params(write(tmp_path, "train:\n  compile: reduce-overhead\n  num_workers: 1\n"))
    assert p.train.compile == "reduce-overhead" and p.train.num_workers == 1
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
    thread pool (MLflow's, Inductor's) must not keep it waiting. The teardown itself (an
    object's finalizer as the modules are freed) never runs."""
    import os
    import subprocess
    import sys

    script = tmp_path / "stage.py"
    script.write_text(f"""
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from reprotrain import warm
from stages.lib.cli import run_stage
atexit.register(warm.end_finished)  # as stages/__init__.py does for `python -m stages.<module>`
out = Path({str(tmp_path)!r})
pool = ThreadPoolExecutor(1)

class Teardown:
    def __del__(self):
        (out / "teardown.txt").write_text("freed")

kept = Teardown()

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
    assert not (tmp_path / "teardown.txt").exists()


LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True))


def with_params(tmp_path, text: str | None = None, **values: str):
    """A folder holding only params.yaml: the repo's, edited, or `text` itself."""
    copy_params(tmp_path)
    if text is not None:
        (tmp_path / "params.yaml").write_text(text)
    if values:
        set_params(tmp_path / "params.yaml", values)
    return tmp_path


def refused(path, stage: str, expected: str, seconds: float = 90, **env: str) -> str:
    """Run the stage for real; it must fail in one line naming `expected`, quickly, writing nothing."""
    t = time.perf_counter()
    # The timeout kills a stage that spins (an unbounded alias expansion ran for minutes). A
    # stage may first wait for a warm process still importing (reprotrain/warm.py, up to 60 s).
    p = run([sys.executable, "-m", f"stages.{stage}"], path,
            env=env_with(PYTHONPATH=str(ROOT), **env), check=False, timeout=seconds)
    assert p.returncode == 1, p.stderr
    assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("error: "), p.stderr
    assert expected in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert sorted(f.name for f in path.iterdir()) == ["params.yaml"]  # no data, models, mlflow.db
    assert time.perf_counter() - t < seconds
    return p.stderr


# ------------------------------------------------------------ YAML bombs


def test_a_billion_laughs_params_yaml_fails_every_stage_within_seconds(tmp_path):
    path = with_params(tmp_path, LAUGHS)
    assert len(LAUGHS) < 2000  # the 1.9 KB file that expands to 9**9 values
    for stage in ("prepare", "train"):  # every stage reads params.yaml through load_params
        err = refused(path, stage, "params.yaml: expands to over")
        assert "YAML aliases" in err


@pytest.mark.parametrize("target", ["repro", "verify"])
def test_make_refuses_a_billion_laughs_before_dvc_expands_it(tmp_path, target):
    """DVC reads params.yaml whole before any stage runs and expands every alias (gigabytes,
    minutes): `make repro` and `make verify` check it first. The timeout fails the test where
    DVC gets the file."""
    for name in ("Makefile", "requirements.lock", "dvc.yaml"):
        shutil.copy2(ROOT / name, tmp_path / name)  # the lock as installed: make installs nothing
    run(["dvc", "init", "-q", "--no-scm"], tmp_path)
    with_params(tmp_path, LAUGHS + committed("params.yaml").decode())
    t = time.perf_counter()
    # timeout kills make's whole process group: a DVC that got the file would spin on.
    p = run(["timeout", "-s", "KILL", "30", "make", "-s", target, f"VENV={sys.prefix}"], tmp_path,
            check=False, env=env_with(PYTHONPATH=str(ROOT)))
    words = [line for line in p.stderr.splitlines() if not line.startswith("make:")]
    assert p.returncode != 0 and words, p.stderr
    assert words[0].startswith("error: params.yaml: expands to over"), p.stderr
    assert len(words) == 1 and time.perf_counter() - t < 30


@pytest.mark.parametrize("text, expected", [
    ("seed: &s [*s]\n", "an alias inside itself"),  # a recursive alias
    ("seed: " + "[" * 20_000 + "]" * 20_000 + "\n", "nested too deeply"),
    ("#" * (MAX_YAML_BYTES + 1) + "\n", "larger than 64 KiB"),
])
def test_yaml_too_deep_recursive_or_too_large_is_refused(tmp_path, text, expected):
    with pytest.raises(ParamsError, match=re.escape(expected)):
        load_params(with_params(tmp_path, text) / "params.yaml")


def test_aliases_within_bounds_still_load(tmp_path):
    text = committed("params.yaml").decode().replace("  accumulate: 1\n", "  accumulate: &one 1\n")
    text = text.replace("  - 1\n  - 7\n", "  - *one\n  - 7\n")
    assert load_params(with_params(tmp_path, text) / "params.yaml").export.check_batch_sizes == [1, 7]


# ------------------------------------------------------------ interpolation


def test_interpolated_epochs_never_train(tmp_path):
    """`EP=3 dvc repro` would have trained 3 epochs under the key of the literal text."""
    err = refused(with_params(tmp_path, epochs="${oc.decode:${oc.env:EP,1}}"), "train",
                  "params.yaml: epochs='${oc.decode:${oc.env:EP,1}}': interpolation", EP="3")
    assert "write the value itself" in err


def test_an_environment_variable_never_reaches_mlflow(tmp_path):
    err = refused(with_params(tmp_path, **{"mlflow.experiment": "x-${oc.env:SECRET}"}), "prepare",
                  "mlflow.experiment='x-${oc.env:SECRET}'", SECRET="s3cr3t-value")
    assert "s3cr3t-value" not in err


@pytest.mark.parametrize("line, edited, expected", [
    ("root: data/raw/digits", "root: ${mlflow.experiment}", "data.root='${mlflow.experiment}'"),
    ("root: data/raw/digits", "root: '\\${escaped}'", "data.root="),
    ("  - 7\n", "  - ${oc.env:B,7}\n", "export.check_batch_sizes[1]='${oc.env:B,7}'"),
    ("experiment: reprotrain", "experiment: '???'", "mlflow.experiment='???'"),  # "the default"
    ("width: 32", "width: ${oc.env:W", "model.width='${oc.env:W'"),  # unclosed: OmegaConf can't parse
])
def test_every_omegaconf_expression_is_refused_naming_the_key(tmp_path, line, edited, expected):
    text = committed("params.yaml").decode()
    assert text.count(line) == 1
    with pytest.raises(ParamsError, match=re.escape(expected)) as err:
        load_params(with_params(tmp_path, text.replace(line, edited)) / "params.yaml")
    assert "write the value itself" in str(err.value)


# ------------------------------------------------------------ values that only failed late


@pytest.mark.parametrize("seed, stage", [(2**32, "prepare"), (2**64, "train")])
def test_a_seed_out_of_range_fails_naming_the_range(tmp_path, seed, stage):
    refused(with_params(tmp_path, seed=str(seed)), stage, f"seed={seed} is invalid: must be in 0..4294967295")


def test_the_largest_seed_works_in_every_consumer(tmp_path, digits):
    # prepare: scikit-learn's split and numpy; the loop: torch's generators, the augmentation
    # hash, the DataLoader's generator and its workers' numpy seeds.
    run([sys.executable, "-m", "stages.prepare"], with_params(tmp_path, seed=str(2**32 - 1)),
        env=env_with(PYTHONPATH=str(ROOT)))
    assert (tmp_path / "data/prepared/meta.json").exists()
    for loader in ("device", "dataloader"):
        fit(linear_model(), digits, n=64, seed=2**32 - 1, loader=loader, num_workers=0,
            augment_crop_pad=1, augment_hflip=True)


def test_more_processes_than_cores_never_start(tmp_path):
    cores = len(os.sched_getaffinity(0))
    err = refused(with_params(tmp_path, batch_size="64000", **{"train.nproc_per_node": "1000"}),
                  "train", "train.nproc_per_node=1000 is invalid")
    assert f"{cores} CPU cores" in err


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores for 2 processes")
def test_a_batch_that_does_not_split_among_the_processes_fails_before_launch(tmp_path):
    err = refused(with_params(tmp_path, batch_size="63", **{"train.nproc_per_node": "2"}),
                  "train", "batch_size=63 is invalid: must be a multiple of train.nproc_per_node=2")
    assert "rank" not in err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_more_processes_than_gpus_fail_before_launch(tmp_path):
    gpus = torch.cuda.device_count()
    if len(os.sched_getaffinity(0)) <= gpus:
        pytest.skip("needs more cores than GPUs")
    refused(with_params(tmp_path, batch_size=str(64 * (gpus + 1)),
                      **{"train.nproc_per_node": str(gpus + 1)}),
            "train", f"each process takes a GPU of its own and {gpus} are visible")


# ------------------------------------------------------------ the advice after a refused -S


def test_the_advice_after_a_refused_exp_run_restores_params_yaml(tmp_path):
    """`fp32`-long values: DVC can leave git's index with the new file's stat and the old
    content, so git sees params.yaml clean and `git checkout params.yaml` restored nothing.
    Whether the index goes stale depends on DVC's timing; the advice must work either way."""
    repo = copy_repo(tmp_path / "repo")
    committed = run(["git", "show", "HEAD:params.yaml"], repo).stdout
    p = run(["dvc", "exp", "run", "-S", "train.precision=fp12"], repo, check=False)
    assert p.returncode != 0
    assert "precision: fp12" in (repo / "params.yaml").read_text()
    advice = re.search(r"or `([^`]+)` for the committed values", p.stdout + p.stderr)
    assert advice, p.stdout + p.stderr
    run(["bash", "-c", advice.group(1)], repo)  # exactly as printed
    assert (repo / "params.yaml").read_text() == committed
    assert run(["git", "status", "--porcelain"], repo).stdout == ""
    assert subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=repo).returncode == 0


@pytest.mark.parametrize("edit, expected", [
    ({"lrr": None}, "unknown key 'lrr'; did you mean 'lr'"),
    ({"epochs": "'ten'"}, "epochs='ten' must be int"),
    ({"lr": "'1e-3'"}, "lr='1e-3' must be float, not str (remove the quotes)"),
    ({"lr": "-0.1"}, "lr=-0.1 is invalid: must be > 0"),
    ({"model.arch": "vgg99"}, "model.arch='vgg99' is invalid"),
    ({"data.source": "imagenet"}, "data.source='imagenet' is invalid"),
])
def test_bad_params_fail_before_any_work(tmp_path, edit, expected):
    copy_params(tmp_path)
    if "lrr" in edit:
        with open(tmp_path / "params.yaml", "a") as f:
            f.write("lrr: 0.1\n")
    else:
        set_params(tmp_path / "params.yaml", edit)
    for stage in ("prepare", "train"):
        t = time.perf_counter()
        p = run([sys.executable, "-m", f"stages.{stage}"], tmp_path,
                env=env_with(PYTHONPATH=str(ROOT)), check=False)
        assert p.returncode == 1 and expected in p.stderr, p.stderr
        assert "Traceback" not in p.stderr
        assert not (tmp_path / "data").exists() and not (tmp_path / "models").exists()
        assert time.perf_counter() - t < 60


@pytest.mark.parametrize("text, expected", [
    ("lr: 0.1\nlr: 0.2\n", "params.yaml: line 2: found duplicate key lr"),
    ("lr: [0.1\n", "params.yaml: line 2: expected ',' or ']'"),
])
def test_a_yaml_error_in_params_is_one_line_naming_the_line(tmp_path, text, expected):
    (tmp_path / "params.yaml").write_text(text)
    p = run([sys.executable, "-m", "stages.prepare"], tmp_path,
            env=env_with(PYTHONPATH=str(ROOT)), check=False)
    assert p.returncode == 1 and expected in one_error_line(p.stderr)


@pytest.mark.parametrize("edit, expected", [
    ({"train.warmup_epochs": ".inf"}, "train.warmup_epochs=inf must be a finite number"),
    ({"lr": ".inf"}, "lr=inf must be a finite number"),
    ({"train.min_lr": ".nan"}, "train.min_lr=nan must be a finite number"),
    ({"train.device": "cpu:abc"}, "train.device='cpu:abc' is invalid"),
    ({"train.device": "mps"}, "MPS (Apple GPUs, macOS) is not available"),
    ({"train.device": "cuda"}, "CUDA is not available on this machine"),
])
def test_values_that_would_fail_later_are_refused_before_the_data_loads(tmp_path, edit, expected):
    if "cuda" in expected and torch.cuda.is_available() or \
            "MPS" in expected and torch.backends.mps.is_available():
        pytest.skip("the device exists here")
    copy_params(tmp_path)
    set_params(tmp_path / "params.yaml", edit)
    # No data/prepared at all: the refusal must come first.
    p = run([sys.executable, "-m", "stages.train"], tmp_path,
            env=env_with(PYTHONPATH=str(ROOT)), check=False)
    assert p.returncode == 1 and expected in one_error_line(p.stderr)
