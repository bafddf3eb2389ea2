"""What users name their data: symlinked folders, names that are not UTF-8, class
names that look like markup or like split folders. Each injected for real: real folders and files
with those names, the real stages, a real `dvc`, a real browser where one is here."""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from PIL import Image

from stages.lib.images import DataError
from stages.report import confusion_csv, confusion_png, misclassified_png, per_class_csv
from stages.sources import list_folder
from tests.conftest import ROOT, copy_params, copy_repo, env_with, rendered_dom, run, set_params
from tests.support.image_files import make_folder
from tests.support.workspaces import one_error_line

# Folder names users give classes that mean something to matplotlib, HTML, CSV, printf or format.
MARKUP = ["$", "$$", "$_$", "<b>", "&amp;", "a\nb", "%s", "{}", "<!--<script>",
          "<img src=x onerror=document.title='pwned'>", r"\frac{1}{0}"]


def prepare(cwd, *args, **params) -> subprocess.CompletedProcess:
    copy_params(cwd)
    set_params(cwd / "params.yaml", {"data.source": "folder", "data.image_size": "16", **params})
    return run([sys.executable, "-m", "stages.prepare", *args], cwd,
               env=env_with(PYTHONPATH=str(ROOT)), check=False)


def dvc_repo(path, dep: str):
    """A DVC project with one stage that depends on the folder `dep`, as prepare does."""
    path.mkdir(exist_ok=True)
    run(["git", "init", "-q"], path)
    run(["dvc", "init", "-q"], path)
    (path / "dvc.yaml").write_text(f"stages:\n  read:\n    cmd: 'true'\n    deps:\n      - {dep}\n")
    return path


def hashed_files(path, dep: str) -> int:
    """How many files DVC hashed in `dep` (dvc.lock after a real `dvc repro`)."""
    from omegaconf import OmegaConf

    run(["dvc", "repro", "-q"], path)
    lock = OmegaConf.load(path / "dvc.lock")
    return next(d.nfiles for d in lock.stages.read.deps if d.path == dep)


# ------------------------------------------------------------------ symlinks DVC cannot see


def test_symlinked_folders_are_refused_exactly_where_dvc_does_not_hash(tmp_path):
    repo = dvc_repo(tmp_path / "repo", "data/raw")
    raw = repo / "data/raw"
    make_folder(raw, per_class=4, bad=False)  # circle, square, triangle: 12 images
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(raw / "triangle", outside / "triangle")
    (raw / "triangle").symlink_to(outside / "triangle")  # a linked class folder
    shutil.copy(raw / "circle/circle_000.png", outside / "one.png")
    (raw / "circle/linked.png").symlink_to(outside / "one.png")  # a linked file: DVC follows it

    # DVC hashes the linked file but not the linked folder: a change there reruns nothing.
    assert hashed_files(repo, "data/raw") == 4 + 1 + 4
    shutil.copy(outside / "one.png", outside / "triangle/new.png")  # a new image there
    assert "up to date" in run(["dvc", "status"], repo).stdout
    (outside / "triangle/new.png").unlink()
    p = prepare(repo, "--check", **{"data.root": "data/raw"})
    assert p.returncode == 1
    line = one_error_line(p.stderr)
    assert "'data/raw/triangle' is a symlink to a folder" in line and str(outside) in line
    assert "copy or move the folder into data/raw" in line

    # Deeper down too: a linked folder inside a class folder.
    (raw / "triangle").unlink()
    shutil.copytree(outside / "triangle", raw / "triangle")
    (raw / "square/more").symlink_to(outside / "triangle")
    assert hashed_files(repo, "data/raw") == 4 + 1 + 4 + 4
    with pytest.raises(DataError, match=re.escape(f"'{raw}/square/more' is a symlink to a folder")):
        list_folder(raw)

    # Without linked folders, prepare reads exactly the files DVC hashes.
    (raw / "square/more").unlink()
    classes, files = list_folder(raw)
    assert len(files[None]) == hashed_files(repo, "data/raw") == 13
    assert str(raw / "circle/linked.png") in [f for f, _ in files[None]]


@pytest.mark.parametrize("link", ["circle/gone.png", "square/.hidden", "triangle/loop"])
def test_a_broken_symlink_dvc_fails_on_is_refused_naming_it(tmp_path, link):
    """prepare would skip it, but DVC fails hashing data.root on it ('unexpected error')."""
    repo = dvc_repo(tmp_path / "repo", "data/raw")
    raw = repo / "data/raw"
    make_folder(raw, per_class=4, bad=False)
    target = "loop" if link.endswith("loop") else str(tmp_path / "moved.png")  # loop: to itself
    (raw / link).symlink_to(target)
    dvc = run(["dvc", "status"], repo, check=False)
    assert dvc.returncode != 0 and "unexpected error" in dvc.stderr, dvc.stderr
    p = prepare(repo, **{"data.root": "data/raw"})
    assert p.returncode == 1
    line = one_error_line(p.stderr)
    assert f"'data/raw/{link}' is a symlink to" in line and "which does not exist" in line, line
    assert not (repo / "data/prepared").exists()


# ------------------------------------------------------------------ names that are not UTF-8


def test_names_that_are_not_utf8_are_refused_naming_them_before_anything_is_written(tmp_path):
    raw = tmp_path / "raw"
    make_folder(raw, per_class=6, bad=False)
    prepared = tmp_path / "data/prepared"
    prepared.mkdir(parents=True)
    (prepared / "meta.json").write_text("the previous prepare's\n")
    latin1 = os.fsencode(raw) + b"/caf\xe9"  # a class folder named in Latin-1
    os.mkdir(latin1)
    shutil.copy(raw / "circle/circle_000.png", os.fsdecode(latin1 + b"/img.png"))
    for args in ((), ("--check",)):
        p = prepare(tmp_path, *args, **{"data.root": str(raw)})
        assert p.returncode == 1
        line = one_error_line(p.stderr)
        assert f"'{raw}/caf\\xe9'" in line and "not UTF-8" in line and "convmv" in line
    assert (prepared / "meta.json").read_text() == "the previous prepare's\n"
    assert os.listdir(prepared) == ["meta.json"]

    # One file among good ones, even one prepare would skip (hidden): DVC hashes it all the same.
    shutil.rmtree(latin1)
    for name in (b"/circle/\xff.png", b"/circle/.\xff"):
        open(os.fsencode(raw) + name, "wb").close()
        with pytest.raises(DataError, match=re.escape(repr(os.fsencode(raw) + name)[1:])):
            list_folder(raw)
        os.remove(os.fsencode(raw) + name)
    assert len(list_folder(raw)[1][None]) == 18


def test_dvc_fails_on_such_a_name_without_naming_it_and_the_check_names_it(tmp_path):
    """README's way out: `dvc add` and `dvc repro` fail while hashing, before prepare runs, naming
    no file; `python -m stages.prepare --check [FOLDER]` names it."""
    repo = dvc_repo(tmp_path, "data/raw")
    make_folder(repo / "data/raw", per_class=3, bad=False)
    open(os.fsencode(repo) + b"/data/raw/square/\xe9t\xe9.png", "wb").close()
    for dvc in (["dvc", "repro"], ["dvc", "add", "data/raw"]):
        p = run(dvc, repo, check=False)
        assert p.returncode != 0 and "'utf-8' codec can't encode character" in p.stderr
        assert "square" not in p.stderr  # DVC names no file: hence the check
    p = prepare(repo, "--check", "data/raw")
    assert p.returncode == 1
    assert "'data/raw/square/\\xe9t\\xe9.png'" in one_error_line(p.stderr)
    os.remove(os.fsencode(repo) + b"/data/raw/square/\xe9t\xe9.png")
    p = prepare(repo, "--check", "data/raw")
    assert p.returncode == 0 and "data/raw: 3 classes, 9 image files; names and layout are fine" \
        in p.stdout


# ------------------------------------------------------------------ class names that look like splits


def test_a_class_named_like_a_split_is_explained_not_taken_for_a_split(tmp_path):
    raw = tmp_path / "raw"
    make_folder(raw, per_class=3, bad=False)
    shutil.copytree(raw / "circle", raw / "test")  # a class named "test" beside the others
    p = prepare(tmp_path, "--check", **{"data.root": str(raw)})
    assert p.returncode == 1
    line = one_error_line(p.stderr)
    assert "split folders (test) beside other folders (circle, square, triangle)" in line
    assert "rename a class named test" in line

    # Only split names at the top, holding images instead of class folders: say it.
    shutil.rmtree(raw)
    for name in ("train", "test"):
        make_folder(tmp_path / "tmp", per_class=3, bad=False)
        shutil.move(tmp_path / "tmp/circle", raw / name)
        shutil.rmtree(tmp_path / "tmp")
    with pytest.raises(DataError, match="if train, test are class names, rename them"):
        list_folder(raw)
    (raw / "train").rename(raw / "val")
    with pytest.raises(DataError, match="has val/, test/ but no train/ folder; split folders need"):
        list_folder(raw)
    # A class named "train" one level down is just a class.
    shutil.rmtree(raw)
    make_folder(raw / "train", per_class=3, bad=False)
    shutil.copytree(raw / "train/circle", raw / "train/train")
    assert list_folder(raw)[0] == ["circle", "square", "train", "triangle"]


# ------------------------------------------------------------------ class names that look like markup


def predictions(k: int):
    y = torch.arange(k).repeat(3)
    pred = (y + torch.arange(len(y)) % 2) % k  # every other one wrong
    return y, pred, torch.nn.functional.one_hot(pred, k).float()


def test_markup_class_names_are_text_in_the_pictures_and_the_tables(tmp_path):
    from stages.report import classification_metrics

    y, pred, logits = predictions(len(MARKUP))
    x = torch.randint(0, 256, (len(y), 1, 8, 8), dtype=torch.uint8)
    (tmp_path / "confusion.png").write_bytes(confusion_png(y, pred, MARKUP))
    (tmp_path / "misclassified.png").write_bytes(misclassified_png(x, y, pred, MARKUP, 36))
    for name in ("confusion.png", "misclassified.png"):
        Image.open(tmp_path / name).verify()
    _, per_class = classification_metrics(logits, y, MARKUP)
    (tmp_path / "per_class.csv").write_text(per_class_csv(per_class))
    (tmp_path / "confusion.csv").write_text(confusion_csv(y, pred, MARKUP))
    with open(tmp_path / "per_class.csv", newline="") as f:
        assert [r["class"] for r in csv.DictReader(f)] == MARKUP
    with open(tmp_path / "confusion.csv", newline="") as f:
        assert [r["actual"] for r in csv.DictReader(f)] == [MARKUP[i] for i in y]


def test_the_plots_page_keeps_every_chart_whatever_the_class_names(tmp_path):
    repo = copy_repo(tmp_path / "repo")
    from stages.report import classification_metrics

    y, pred, logits = predictions(len(MARKUP))
    (repo / "models/eval/per_class.csv").write_text(
        per_class_csv(classification_metrics(logits, y, MARKUP)[1]))
    (repo / "models/eval/confusion.csv").write_text(confusion_csv(y, pred, MARKUP))
    run(["dvc", "plots", "show", "-o", str(tmp_path / "plots")], repo, env=env_with())
    dom = rendered_dom(tmp_path / "plots/index.html", tmp_path)
    # All five charts drawn (loss, accuracy, lr, confusion, F1 per class), the images shown, and
    # no label ran as markup.
    assert dom.count('class="marks"') == 5, dom[-3000:]
    assert "_confusion.png" in dom and "_misclassified.png" in dom
    assert "<title>DVC Plot</title>" in dom
