"""Bring your own data end to end: a folder of real images through `dvc exp run`, then the
exported model used by `stages.predict`; and the model registry's aliases."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import copy_repo, env_with, run
from tests.images import make_folder

pytestmark = pytest.mark.slow


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


def predict(repo, *args):
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
    p = predict(repo, "data/raw/shapes/test", "--json", "--top-k", "2")
    assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    assert len(rows) == 36
    assert all(len(r["top_k"]) == 2 and 0 < r["confidence"] <= 1 for r in rows)
    right = sum(r["label"] == Path(r["path"]).parent.name for r in rows)
    evaluated = json.loads((repo / "models/eval/metrics.json").read_text())["accuracy"]
    assert right / len(rows) == pytest.approx(evaluated)
    assert evaluated > 0.6  # 15 short epochs on 120 images: well above chance (0.33)

    pt2 = predict(repo, "data/raw/shapes/test", "--json", "--model", "models/export/model.pt2")
    assert [json.loads(x)["label"] for x in pt2.stdout.splitlines()] == [r["label"] for r in rows]
    text = predict(repo, "data/raw/shapes/test", "--top-k", "2").stdout.splitlines()
    assert [line.split("\t") for line in text] == [
        [r["path"], *(f for t in r["top_k"] for f in (t["label"], f"{t['p']:.4f}"))] for r in rows]


def test_predict_names_a_bad_file_and_still_predicts_the_others(shapes_repo):
    repo, _ = shapes_repo
    good = sorted((repo / "data/raw/shapes/test/square").iterdir())[:2]
    bad = repo / "data/raw/shapes/train/circle/truncated.png"
    p = predict(repo, str(good[0]), str(bad), str(good[1]))
    assert p.returncode == 1
    lines = p.stdout.splitlines()
    assert [line.split("\t")[0] for line in lines] == [str(good[0]), str(good[1])]
    assert all(line.split("\t")[1] in ("circle", "square", "triangle") for line in lines)
    assert f"{bad}\terror:" in p.stderr
    js = predict(repo, str(bad), str(good[0]), "--json")
    out = [json.loads(x) for x in js.stdout.splitlines()]
    assert js.returncode == 1 and "error" in out[0] and out[1]["path"] == str(good[0])


def test_registry_moves_champion_only_on_better_accuracy(mlflow_uri, tmp_path):
    import mlflow
    import torch

    from stages.tracking.tracker import register_version

    mlflow.set_tracking_uri(mlflow_uri)
    client = mlflow.MlflowClient()
    exp = mlflow.create_experiment("registry-test", artifact_location=tmp_path.as_uri())
    versions = []
    for accuracy in (0.90, 0.85, 0.95):
        with mlflow.start_run(experiment_id=exp):
            info = mlflow.pytorch.log_model(torch.nn.Linear(2, 2), name="model",
                                            input_example=torch.zeros(2, 2).numpy(),
                                            pip_requirements=["torch"])
        versions.append(register_version(info.model_uri, "registry-test", accuracy))
        aliases = {a: int(client.get_model_version_by_alias("registry-test", a).version)
                   for a in ("candidate", "champion")}
        versions[-1]["aliases"] = aliases
    assert [v["champion"] for v in versions] == [True, False, True]
    assert versions[1]["aliases"] == {"candidate": 2, "champion": 1}
    assert versions[2]["aliases"] == {"candidate": 3, "champion": 3}
