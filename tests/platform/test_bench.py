"""`python -m reprotrain.bench.training --quick` runs every row and writes the report. Timings are not
asserted: on shared machines they are noise; the ratios are for the report."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from reprotrain.bench.training import NOISY_SPREAD, QUICK_SKIPS, ROWS, markdown
from tests.conftest import ROOT, env_with, run


def test_quick_bench_runs_every_row_and_writes_its_outputs(tmp_path):
    out = tmp_path / "bench"
    run([sys.executable, "-m", "reprotrain.bench.training", "--quick", "--steps", "2",
         "--synthetic-size", "16",
         "--cifar-width", "8", "--out", str(out), "--json", str(tmp_path / "r.json")],
        ROOT, env=env_with(PYTHONPATH=str(ROOT)))
    report = json.loads((tmp_path / "r.json").read_text())
    assert {"device", "torch", "rows"} <= set(report)
    rows = report["rows"]
    expected = [r for r in ROWS if r not in QUICK_SKIPS]
    for dataset in ("digits", "cifar"):
        assert [r["name"] for r in rows if r["dataset"] == dataset] == expected
    for r in rows:
        assert {"name", "samples_per_s", "epoch_s", "peak_mem_mb", "ratio", "min_samples_per_s",
                "max_samples_per_s", "compile_s", "noisy"} <= set(r)
        assert r["samples_per_s"] > 0 and r["min_samples_per_s"] <= r["max_samples_per_s"]
    assert all(r["ratio"] == 1.0 for r in rows if r["name"] == "standard")
    text = (out / "report.md").read_text()
    assert "| standard (batch 32) |" in text and "vs standard" in text
    assert (out / "chart.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_on_the_prepared_split_puts_a_plain_loop_beside_the_repos(tmp_path):
    """Issue 57: the time of an epoch on a real dataset, the repo's loop against a textbook one
    on the same model and data. Here a small Fashion-MNIST, prepared as the train stage has it."""
    from tests.experiment.test_byod import _gzipped_fashion, prepare

    _gzipped_fashion(tmp_path / "fashion/FashionMNIST/raw")
    prepare(tmp_path, **{"data.source": "fashion_mnist", "data.root": str(tmp_path / "fashion"),
                         "model.width": "8"})
    out = tmp_path / "bench"
    run([sys.executable, "-m", "reprotrain.bench.training", "--datasets", "prepared", "--rows",
         "standard,plain,optimized", "--rounds", "1", "--steps", "3", "--batch-size", "16",
         "--out", str(out)], tmp_path, env=env_with(PYTHONPATH=str(ROOT)))
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["standard", "plain", "optimized"]
    for r in rows:  # 200 train images, a tenth of them carved out for validation
        assert r["about"] == {"source": "fashion_mnist", "train_images": 180, "shape": "1x16x16"}
        assert r["split_epoch_s"] == pytest.approx(180 / r["samples_per_s"])
        assert r["epoch_s"] == pytest.approx(48 / r["samples_per_s"])  # 3 steps of 16
    text = (out / "report.md").read_text()
    assert "**prepared** (fashion_mnist, 1x16x16)" in text and "| plain (batch 16) |" in text
    assert "one epoch of its 180 train images takes " in text and " s (plain), " in text


def test_unknown_row_is_refused():
    p = run([sys.executable, "-m", "reprotrain.bench.training", "--rows", "standard,turbo"], ROOT,
            env=env_with(PYTHONPATH=str(ROOT)), check=False)
    assert p.returncode == 2 and "unknown rows ['turbo']" in p.stderr


def test_report_warns_about_rows_whose_rounds_disagree():
    def row(name, lo, med, hi):
        return {"dataset": "cifar", "name": name, "batch_size": 32, "epoch_s": 1.0,
                "peak_mem_mb": 10.0, "samples_per_s": med, "ratio": med / 200,
                "min_samples_per_s": lo, "max_samples_per_s": hi, "compile_s": None,
                "noisy": (hi - lo) / med > NOISY_SPREAD}
    report = {"date": "2026-11-29", "device": "cpu", "device_name": "x86_64", "torch": "2",
              "threads": 2, "precision_auto": "bf16", "memory": "RSS",
              "settings": {"steps": 20, "batch_size": 32, "rounds": 5, "model": "cnn"},
              "rows": [row("standard", 190, 200, 210), row("optimized", 400, 560, 750)]}
    text = markdown(report)
    assert "Noisy: optimized varied by more than 25%" in text
    assert "Noisy: standard" not in text and "standard, optimized" not in text


def test_pipeline_bench_splits_a_real_stage_run_into_its_parts(tmp_path):
    from reprotrain.bench import pipeline as bench_pipeline
    from tests.conftest import copy_repo

    repo = copy_repo(tmp_path)
    m = bench_pipeline.run_stage(repo, "prepare")
    parts = [m[k] for k in bench_pipeline.PARTS]
    assert all(p >= 0 for p in parts) and m["loop_s"] == 0 and m["tracking_s"] == 0
    assert sum(parts) == pytest.approx(m["wall_s"], rel=1e-6)  # the parts add up to the wall
    assert m["startup_s"] > 0.1  # the interpreter and torch's import, before `main`
    report = {"HEAD": {"stages": {"prepare": m, "train": {**m, "loop_s": 2.0}}, "total_s": 10.0,
                       "loop_s": 2.0, "overhead_s": 8.0, "overhead_per_loop": 4.0}}
    text = bench_pipeline.markdown(report, "a CPU", 1)
    assert "| HEAD | prepare |" in text and "overhead 8.0 s = 4.00x the loop" in text


def test_storage_bench_times_both_remotes_and_leaves_nothing_behind(tmp_path):
    """A 2 MiB dataset and no training: both remotes' rows, then neither its temporary folder nor
    its S3 server (weed) is left."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "storage.md"
    p = run([sys.executable, "-m", "reprotrain.bench.storage", "--no-model", "--size-mb", "2",
             "--file-kb", "64", "--out", str(out)], ROOT,
            env=env_with(PYTHONPATH=str(ROOT), TMPDIR=str(tmp)))
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.read_text().splitlines()
            if line.startswith("| 2 MiB dataset")]
    assert [r[0].split(": ", 1)[1] for r in rows] == ["`dvc push`", "fresh clone, `dvc pull`"]
    for _, folder, s3, ratio in rows:
        # The cells are rounded to 0.1 s: the ratio lies between what their extremes give.
        s3_s, folder_s = float(s3.removesuffix(" s")), float(folder.removesuffix(" s"))
        assert (s3_s - 0.05) / (folder_s + 0.05) - 0.01 <= float(ratio) \
            <= (s3_s + 0.05) / max(folder_s - 0.05, 0.001) + 0.01
    assert "Model name" not in out.read_text() and "cores" in out.read_text()
    pid = int(re.search(r"weed pid (\d+), in (\S+)", p.stderr)[1])
    assert not Path(f"/proc/{pid}").exists()
    assert list(tmp.iterdir()) == []  # its folder, DVC's site cache and weed's sockets were in it


def test_storage_report_puts_training_beside_the_s3_restore():
    from reprotrain.bench.storage import markdown

    both = {"folder": [2.0], "s3": [3.0]}
    samples = {f"{k}/{r}": v for k in ("share", "exp_pull", "pull", "clone_restore", "data_push",
                                       "data_pull") for r, v in both.items()}
    report = {"samples": samples | {"clone_restore/s3": [4.0], "train": [100.0]}, "repeats": 1,
              "cpu": "a CPU", "outputs": {"files": 21, "mb": 0.9},
              "dataset": {"files": 4096, "mb": 1024, "file_kb": 256, "add_s": 9.0}}
    text = markdown(report)
    assert "| pipeline outputs (21 files, 0.9 MiB): push (`make share`) | 2.0 s | 3.0 s | 1.50 |" in text
    assert "| 1 GiB dataset (4096 files of 128-384 KiB): `dvc push` |" in text
    assert "| `git clone` to a restored model (`dvc exp run --pull`) | 2.0 s | 4.0 s | 2.00 |" in text
    assert "training takes 25.0x the S3 restore" in text and "a CPU; one run" in text
