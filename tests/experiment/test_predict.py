"""`stages.predict`: its arguments checked in one line, the trained model.pt run as its
export would, names escaped in its text output. Bring your own data end to end: a folder of real
images through `dvc exp run`, then the exported model used by predict; and the registry's aliases."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, copy_repo, env_with, run
from tests.support.image_files import make_folder
from tests.support.workspaces import one_error_line, predict


@pytest.fixture(scope="module")
def shapes_repo(tmp_path_factory):
    repo = copy_repo(tmp_path_factory.mktemp("byod"))
    make_folder(repo / "data/raw/shapes", per_class=0,
                splits={"train": 40, "val": 8, "test": 12})
    p = run(["dvc", "exp", "run", "-S", "data.source=folder", "-S", "data.root=data/raw/shapes",
             "-S", "data.channels=3", "-S", "data.image_size=24", "-S", "epochs=15", "-S", "batch_size=16",
             "-S", "data.max_rejected_fraction=0.1", "-S", "export.register_as=shapes"],
            repo, env=env_with())
    return repo, p


def predict_in(repo, *args):
    return run([sys.executable, "-m", "stages.predict", *args], repo, env=env_with(), check=False)


def test_folder_of_images_trains_end_to_end_with_bad_files_reported(shapes_repo):
    repo, p = shapes_repo
    assert "skipped 3 unreadable files" in p.stderr
    rejected = (repo / "data/prepared/rejected.csv").read_text()
    assert "truncated.png" in rejected and "empty.png" in rejected
    meta = json.loads((repo / "data/prepared/meta.json").read_text())
    assert meta["sizes"] == {"train": 120, "val": 24, "test": 36}
    model = json.loads((repo / "models/export/model.json").read_text())
    assert model["classes"] == ["circle", "square", "triangle"] and model["input_shape"] == [3, 24, 24]
    assert "registered shapes version 1 as candidate, now champion" in p.stdout


def test_predict_reproduces_evaluate_accuracy(shapes_repo):
    repo, _ = shapes_repo
    p = predict_in(repo, "data/raw/shapes/test", "--json", "--top-k", "2")
    assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    assert len(rows) == 36
    assert all(len(r["top_k"]) == 2 and 0 < r["confidence"] <= 1 for r in rows)
    right = sum(r["label"] == Path(r["path"]).parent.name for r in rows)
    evaluated = json.loads((repo / "models/eval/metrics.json").read_text())["accuracy"]
    assert right / len(rows) == pytest.approx(evaluated)
    assert evaluated > 0.6  # 15 short epochs on 120 images: well above chance (0.33)

    pt2 = predict_in(repo, "data/raw/shapes/test", "--json", "--model", "models/export/model.pt2")
    assert [json.loads(x)["label"] for x in pt2.stdout.splitlines()] == [r["label"] for r in rows]
    text = predict_in(repo, "data/raw/shapes/test", "--top-k", "2").stdout.splitlines()
    assert [line.split("\t") for line in text] == [
        [r["path"], *(f for t in r["top_k"] for f in (t["label"], f"{t['p']:.4f}"))] for r in rows]


def test_predict_warns_when_the_shapes_model_is_given_the_grayscale_digits(shapes_repo):
    """docs/data.md's recipe, then README's predict on the digit samples: the shapes model (3
    channels, trained on color) answered each `square 0.9998` without a word. Each digit is
    flagged, the reason once; the shapes' own color test images pass quietly."""
    from PIL import Image

    repo, _ = shapes_repo
    p = predict_in(repo, str(ROOT / "data/samples"))
    assert p.returncode == 0 and len(p.stdout.splitlines()) == 10, p.stderr
    assert p.stderr.count("warning: ") == 10 and p.stderr.count("it is grayscale") == 10, p.stderr
    assert p.stderr.count("unless they were grayscale too") == 1  # the reason once
    row = json.loads(predict_in(repo, str(ROOT / "data/samples/3.png"), "--json").stdout)
    assert "grayscale" in row["warning"] and "unless they were grayscale" in row["warning"]
    color = [f for f in sorted((repo / "data/raw/shapes/test").rglob("*.*"))
             if Image.open(f).mode not in ("L", "LA", "I;16")]
    assert len(color) >= 24
    quiet = predict_in(repo, *map(str, color))
    assert quiet.returncode == 0 and "warning" not in quiet.stderr, quiet.stderr
    assert len(quiet.stdout.splitlines()) == len(color)


def test_predict_names_a_bad_file_and_still_predicts_the_others(shapes_repo):
    repo, _ = shapes_repo
    good = sorted((repo / "data/raw/shapes/test/square").iterdir())[:2]
    bad = repo / "data/raw/shapes/train/circle/truncated.png"
    p = predict_in(repo, str(good[0]), str(bad), str(good[1]))
    assert p.returncode == 1
    lines = p.stdout.splitlines()
    assert [line.split("\t")[0] for line in lines] == [str(good[0]), str(good[1])]
    assert all(line.split("\t")[1] in ("circle", "square", "triangle") for line in lines)
    assert f"{bad}\terror:" in p.stderr
    js = predict_in(repo, str(bad), str(good[0]), "--json")
    out = [json.loads(x) for x in js.stdout.splitlines()]
    assert js.returncode == 1 and "error" in out[0] and out[1]["path"] == str(good[0])


DIGITS = '{"classes": ["0", "1"], "input_shape": [1, 16, 16]}'


def test_registry_moves_champion_only_on_better_accuracy_of_the_same_task(mlflow_uri, tmp_path):
    import mlflow
    import torch

    from reprotrain.tracking.tracker import register_version

    mlflow.set_tracking_uri(mlflow_uri)
    client = mlflow.MlflowClient()
    exp = mlflow.create_experiment("registry-test", artifact_location=tmp_path.as_uri())
    versions = []
    for accuracy in (0.90, 0.85, 0.95):
        with mlflow.start_run(experiment_id=exp):
            info = mlflow.pytorch.log_model(torch.nn.Linear(2, 2), name="model",
                                            input_example=torch.zeros(2, 2).numpy(),
                                            pip_requirements=["torch"])
        versions.append(register_version(info.model_uri, "registry-test", accuracy, DIGITS))
        aliases = {a: int(client.get_model_version_by_alias("registry-test", a).version)
                   for a in ("candidate", "champion")}
        versions[-1]["aliases"] = aliases
    assert [v["champion"] for v in versions] == [True, False, True]
    assert versions[1]["aliases"] == {"candidate": 2, "champion": 1}
    assert versions[2]["aliases"] == {"candidate": 3, "champion": 3}
    # A model of other classes (docs/data.md's shapes), however accurate on its own test split,
    # never takes the alias that `make serve` serves to the digits' callers.
    other = register_version(info.model_uri, "registry-test", 1.0,
                             '{"classes": ["circle", "square"], "input_shape": [3, 32, 32]}')
    assert not other["champion"] and other["other_task"] and other["previous_champion"] == 3
    assert int(client.get_model_version_by_alias("registry-test", "champion").version) == 3


def test_predict_validates_its_arguments_in_one_line(tmp_path, exported):
    for args in (["--batch-size", "-1"], ["--batch-size", "0"], ["--top-k", "-1"],
                 ["--top-k", "x"]):
        p = predict(tmp_path, "img0.png", "--model", str(exported / "model.pt2"), *args)
        assert p.returncode == 2 and args[0] in one_error_line(p.stderr), (args, p.stderr)
        assert p.stdout == ""
    (tmp_path / "model.ckpt").write_bytes(b"x")
    p = predict(tmp_path, "img0.png", "--model", "model.ckpt")
    assert p.returncode == 1 and "not a model predict runs" in one_error_line(p.stderr)
    assert "missing" not in p.stderr
    (tmp_path / "model.pt").write_bytes(b"x")  # not train's: no checksum beside it
    p = predict(tmp_path, "img0.png", "--model", "model.pt")
    assert p.returncode == 1 and "model.pt: checksum missing" in one_error_line(p.stderr)


def test_predict_runs_the_trained_model_pt_as_its_export_would(trained, tmp_path):
    """Before export: model.pt describes itself (stages/weights.py), so predict needs no
    model.json; the labels are the model's own, evaluated in fp32 as evaluate does."""
    from stages import weights

    samples = sorted((ROOT / "data/samples").glob("*.png"))
    p = predict(tmp_path, *map(str, samples), "--json", "--model",
                str(trained / "models/train/model.pt"))
    assert p.returncode == 0, p.stderr
    got = [json.loads(line) for line in p.stdout.splitlines()]
    net, stored = weights.load(trained / "models/train/model.pt")
    from stages.predict import decode_image, model_input

    x = model_input([decode_image(f, 1, stored.image_size, stored.resize) for f in samples],
                    {"mean": stored.mean, "std": stored.std})
    want = net(torch.from_numpy(x)).softmax(1).max(1)
    assert [g["label"] for g in got] == [stored.classes[i] for i in want.indices]
    assert [g["confidence"] for g in got] == pytest.approx(want.values.tolist(), abs=1e-6)


def test_predict_text_output_escapes_tabs_and_newlines_in_names(tmp_path, exported):
    odd = tmp_path / "a\tb\nc.png"
    shutil.copy(tmp_path / "img0.png", odd)
    p = predict(tmp_path, str(odd), "img1.png", "--model", str(exported / "model.safetensors"))
    assert p.returncode == 0, p.stderr
    rows = [line.split("\t") for line in p.stdout.splitlines()]
    assert len(rows) == 2 and all(len(r) == 3 for r in rows)
    assert rows[0][0] == str(odd).replace("\t", "\\t").replace("\n", "\\n")
    js = predict(tmp_path, str(odd), "--json", "--model", str(exported / "model.safetensors"))
    assert json.loads(js.stdout)["path"] == str(odd)
