"""params.yaml that only fails late or splits the stages from DVC: YAML bombs, interpolation,
out-of-range seeds and process counts, and the advice after a refused `dvc exp run -S`. Each is
a real file given to a real stage process, which must end in one line before any work."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from stages.config import ParamsError, load_params
from stages.lib.strict_yaml import MAX_YAML_BYTES
from tests.conftest import ROOT, copy_params, copy_repo, env_with, run, set_params
from tests.training import fit, linear_model

LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True))


def workspace(tmp_path, text: str | None = None, **values: str):
    """A folder holding only params.yaml: the repo's, edited, or `text` itself."""
    copy_params(tmp_path)
    if text is not None:
        (tmp_path / "params.yaml").write_text(text)
    if values:
        set_params(tmp_path / "params.yaml", values)
    return tmp_path


def refused(path, stage: str, expected: str, seconds: float = 30, **env: str) -> str:
    """Run the stage for real; it must fail in one line naming `expected`, quickly, writing nothing."""
    t = time.perf_counter()
    # The timeout kills a stage that spins (an unbounded alias expansion ran for minutes).
    p = run([sys.executable, "-m", f"stages.{stage}"], path,
            env=env_with(PYTHONPATH=str(ROOT), **env), check=False, timeout=seconds)
    assert p.returncode == 1, p.stderr
    assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("error: "), p.stderr
    assert expected in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert sorted(f.name for f in path.iterdir()) == ["params.yaml"]  # no data, models, mlflow.db
    assert time.perf_counter() - t < seconds
    return p.stderr


# ------------------------------------------------------------ 1: YAML bombs


def test_a_billion_laughs_params_yaml_fails_every_stage_within_seconds(tmp_path):
    path = workspace(tmp_path, LAUGHS)
    assert len(LAUGHS) < 2000  # the 1.9 KB file that expands to 9**9 values
    for stage in ("prepare", "train"):  # every stage reads params.yaml through load_params
        err = refused(path, stage, "params.yaml: expands to over", seconds=20)
        assert "YAML aliases" in err


@pytest.mark.parametrize("target", ["repro", "verify"])
def test_make_refuses_a_billion_laughs_before_dvc_expands_it(tmp_path, target):
    """DVC reads params.yaml whole before any stage runs and expands every alias (gigabytes,
    minutes): `make repro` and `make verify` check it first. The timeout fails the test where
    DVC gets the file."""
    for name in ("Makefile", "requirements.lock", "dvc.yaml"):
        shutil.copy2(ROOT / name, tmp_path / name)  # copy2: the venv's stamp stays the newer
    run(["dvc", "init", "-q", "--no-scm"], tmp_path)
    workspace(tmp_path, LAUGHS + (ROOT / "params.yaml").read_text())
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
        load_params(workspace(tmp_path, text) / "params.yaml")


def test_aliases_within_bounds_still_load(tmp_path):
    text = (ROOT / "params.yaml").read_text().replace("  accumulate: 1\n", "  accumulate: &one 1\n")
    text = text.replace("  - 1\n  - 7\n", "  - *one\n  - 7\n")
    assert load_params(workspace(tmp_path, text) / "params.yaml").export.check_batch_sizes == [1, 7]


# ------------------------------------------------------------ 2: interpolation


def test_interpolated_epochs_never_train(tmp_path):
    """`EP=3 dvc repro` would have trained 3 epochs under the key of the literal text."""
    err = refused(workspace(tmp_path, epochs="${oc.decode:${oc.env:EP,1}}"), "train",
                  "params.yaml: epochs='${oc.decode:${oc.env:EP,1}}': interpolation", EP="3")
    assert "write the value itself" in err


def test_an_environment_variable_never_reaches_mlflow(tmp_path):
    err = refused(workspace(tmp_path, **{"mlflow.experiment": "x-${oc.env:SECRET}"}), "prepare",
                  "mlflow.experiment='x-${oc.env:SECRET}'", SECRET="s3cr3t-value")
    assert "s3cr3t-value" not in err


@pytest.mark.parametrize("line, edited, expected", [
    ("root: data/raw", "root: ${mlflow.experiment}", "data.root='${mlflow.experiment}'"),
    ("root: data/raw", "root: '\\${escaped}'", "data.root="),
    ("  - 7\n", "  - ${oc.env:B,7}\n", "export.check_batch_sizes[1]='${oc.env:B,7}'"),
    ("experiment: reprotrain", "experiment: '???'", "mlflow.experiment='???'"),  # "the default"
    ("width: 32", "width: ${oc.env:W", "model.width='${oc.env:W'"),  # unclosed: OmegaConf can't parse
])
def test_every_omegaconf_expression_is_refused_naming_the_key(tmp_path, line, edited, expected):
    text = (ROOT / "params.yaml").read_text()
    assert text.count(line) == 1
    with pytest.raises(ParamsError, match=re.escape(expected)) as err:
        load_params(workspace(tmp_path, text.replace(line, edited)) / "params.yaml")
    assert "write the value itself" in str(err.value)


# ------------------------------------------------------------ 3: values that only failed late


@pytest.mark.parametrize("seed, stage", [(2**32, "prepare"), (2**64, "train")])
def test_a_seed_out_of_range_fails_naming_the_range(tmp_path, seed, stage):
    refused(workspace(tmp_path, seed=str(seed)), stage, f"seed={seed} is invalid: must be in 0..4294967295")


def test_the_largest_seed_works_in_every_consumer(tmp_path, digits):
    # prepare: scikit-learn's split and numpy; the loop: torch's generators, the augmentation
    # hash, the DataLoader's generator and its workers' numpy seeds.
    run([sys.executable, "-m", "stages.prepare"], workspace(tmp_path, seed=str(2**32 - 1)),
        env=env_with(PYTHONPATH=str(ROOT)))
    assert (tmp_path / "data/prepared/meta.json").exists()
    for loader in ("device", "dataloader"):
        fit(linear_model(), digits, n=64, seed=2**32 - 1, loader=loader, num_workers=0,
            augment_crop_pad=1, augment_hflip=True)


def test_more_processes_than_cores_never_start(tmp_path):
    cores = len(os.sched_getaffinity(0))
    err = refused(workspace(tmp_path, batch_size="64000", **{"train.nproc_per_node": "1000"}),
                  "train", "train.nproc_per_node=1000 is invalid")
    assert f"{cores} CPU cores" in err


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores for 2 processes")
def test_a_batch_that_does_not_split_among_the_processes_fails_before_launch(tmp_path):
    err = refused(workspace(tmp_path, batch_size="63", **{"train.nproc_per_node": "2"}),
                  "train", "batch_size=63 is invalid: must be a multiple of train.nproc_per_node=2")
    assert "rank" not in err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_more_processes_than_gpus_fail_before_launch(tmp_path):
    gpus = torch.cuda.device_count()
    if len(os.sched_getaffinity(0)) <= gpus:
        pytest.skip("needs more cores than GPUs")
    refused(workspace(tmp_path, batch_size=str(64 * (gpus + 1)),
                      **{"train.nproc_per_node": str(gpus + 1)}),
            "train", f"each process takes a GPU of its own and {gpus} are visible")


# ------------------------------------------------------------ 4: the advice after a refused -S


@pytest.mark.slow
def test_the_advice_after_a_refused_exp_run_restores_params_yaml(tmp_path):
    """`fp32`-long values: DVC can leave git's index with the new file's stat and the old
    content, so git sees params.yaml clean and `git checkout params.yaml` restored nothing.
    Whether the index goes stale depends on DVC's timing; the advice must work either way."""
    repo = copy_repo(tmp_path / "repo")
    committed = run(["git", "show", "HEAD:params.yaml"], repo).stdout
    p = run(["dvc", "exp", "run", "-S", "train.precision=fp12"], repo, check=False)
    assert p.returncode != 0
    assert "precision: fp12" in (repo / "params.yaml").read_text()
    advice = re.search(r"run `([^`]+)` to restore", p.stdout + p.stderr)
    assert advice, p.stdout + p.stderr
    run(["bash", "-c", advice.group(1)], repo)  # exactly as printed
    assert (repo / "params.yaml").read_text() == committed
    assert run(["git", "status", "--porcelain"], repo).stdout == ""
    assert subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=repo).returncode == 0
