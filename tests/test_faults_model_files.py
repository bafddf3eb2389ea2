"""Hostile and damaged model files: a malicious pickle, a hostile .pt2 or ONNX, a damaged
model.pt. They are refused in one line and their code never runs."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys

import pytest
import torch

from stages.checkpoints import latest_checkpoint
from stages.data import save_prepared
from stages.lib import files
from tests.conftest import ROOT, copy_params, env_with, run
from tests.training import fit_ckpt, linear_model
from tests.workspaces import (
    files_sha,
    one_error_line,
    predict,
    rewrite_zip,
)


class Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))  # would create the marker file when unpickled


def test_a_malicious_pickle_is_refused_and_never_runs(tmp_path, digits):
    marker = tmp_path / "pwned"
    work = tmp_path / "work"
    work.mkdir()
    copy_params(work)
    save_prepared(work / "data/prepared", *digits)
    (work / "models/train").mkdir(parents=True)
    with open(work / "models/train/model.pt", "wb") as f:
        pickle.dump({"model": Exploit(marker)}, f)
    # With a matching checksum: it is the loading that must refuse it.
    (work / "models/train/model.sha256").write_text(files_sha(work / "models/train/model.pt"))
    (work / "models/train/run.json").write_text('{"run_id": null}')
    p = run([sys.executable, "-m", "stages.evaluate"], work,
            env=env_with(PYTHONPATH=str(ROOT)), check=False)
    assert p.returncode == 1 and "refused to load" in p.stderr and "weights_only" in p.stderr
    assert not marker.exists()
    # The same file as the newest checkpoint, with a matching checksum: skipped, never run.
    ckpt = tmp_path / "ckpt"
    fit_ckpt(linear_model(), digits, ckpt, epochs=1)
    shutil.copy(work / "models/train/model.pt", ckpt / "epoch-0009.pt")
    (ckpt / "epoch-0009.sha256").write_text(files_sha(ckpt / "epoch-0009.pt"))
    with pytest.warns(UserWarning, match="epoch-0009.pt is unusable"):
        assert latest_checkpoint(ckpt)["epoch"] == 1
    assert not marker.exists()


def test_a_hostile_pt2_never_runs_its_code(tmp_path, exported):
    marker = tmp_path / "pwned"
    symbol = b"Symbol('s31', positive=True, integer=True)"
    hostile = {
        # torch.export.load retries a failed weights-only load with full unpickling...
        "pickled_inputs": lambda n, b: pickle.dumps((Exploit(marker), {}))
        if n.endswith("sample_inputs/model.pt") else b,
        # ...and evaluates the symbolic shapes with sympy, an eval.
        "sympy": lambda n, b: b.replace(symbol, b"(open('" + str(marker).encode() + b"', 'w')"
                                        b" and 0) or " + symbol) if n.endswith("models/model.json")
        else b,
    }
    good = json.loads(predict(tmp_path, "img0.png", "img1.png", "--json", "--model",
                              str(exported / "model.pt2")).stdout.splitlines()[0])
    for name, edit in hostile.items():
        rewrite_zip(exported / "model.pt2", exported / f"{name}.pt2", edit)
        target = exported / "model.pt2"
        shutil.copy(exported / f"{name}.pt2", target)
        p = predict(tmp_path, "img0.png", "img1.png", "--json", "--model", str(target))
        assert not marker.exists(), f"{name}: predict ran the file's code"
        assert p.returncode == 0 and json.loads(p.stdout.splitlines()[0]) == good, p.stderr
        # The fault is real: torch.export.load itself runs it.
        try:
            torch.export.load(str(exported / f"{name}.pt2")).module()
        except Exception:  # noqa: BLE001, S110 - whether it then fails does not matter
            pass
        assert marker.exists(), f"{name}: the hostile file is not hostile"
        marker.unlink()

    # A weight stored as a pickle: refused, never unpickled.
    import zipfile

    with zipfile.ZipFile(exported / "sympy.pt2") as z:
        cfg_name = next(n for n in z.namelist() if n.endswith("model_weights_config.json"))
        weight_name = cfg_name.replace("model_weights_config.json", "weight_0")

    def pickled_weight(n, b):
        if n == cfg_name:
            cfg = json.loads(b)
            cfg["config"]["0.0.weight"]["use_pickle"] = True
            return json.dumps(cfg).encode()
        return pickle.dumps(Exploit(marker)) if n == weight_name else b

    rewrite_zip(exported / "pickled_inputs.pt2", exported / "model.pt2", pickled_weight)
    p = predict(tmp_path, "img0.png", "--model", str(exported / "model.pt2"))
    assert p.returncode == 1 and "is a pickle, refused" in one_error_line(p.stderr)
    assert not marker.exists()


def test_a_hostile_onnx_reaching_outside_its_folder_is_one_line(tmp_path, exported):
    import onnx
    from onnx import TensorProto, helper

    secret = tmp_path / "secret.bin"
    secret.write_bytes(bytes(256 * 10 * 4))
    weight = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[256, 10],
                         data_location=TensorProto.EXTERNAL)
    for k, v in {"location": "../secret.bin", "offset": "0", "length": str(256 * 10 * 4)}.items():
        weight.external_data.add(key=k, value=v)
    graph = helper.make_graph(
        [helper.make_node("Flatten", ["image"], ["flat"]),
         helper.make_node("MatMul", ["flat", "w"], ["logits"])], "g",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["n", 1, 16, 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 10])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]),
              str(exported / "model.onnx"))
    p = predict(tmp_path, "img0.png", "--model", str(exported / "model.onnx"))
    assert p.returncode == 1 and "onnxruntime refused it" in one_error_line(p.stderr)


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


@pytest.mark.parametrize("damage", ["flip 4000 bytes", "truncate"])
def test_a_damaged_model_pt_fails_naming_it_and_logs_nothing(trained, tmp_path, mlflow_uri, damage):
    import mlflow

    w = tmp_path / "w"
    shutil.copytree(trained, w)
    model = w / "models/train/model.pt"
    data = bytearray(model.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        for i in range(4000):
            data[len(data) // 4 + i * 7 % (len(data) // 2)] ^= 0xFF
    model.write_bytes(bytes(data))
    p = run([sys.executable, "-m", "stages.evaluate"], w,
            env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri), check=False)
    line = one_error_line(p.stderr)
    assert p.returncode == 1 and "models/train/model.pt" in line and "checksum mismatch" in line
    assert not (w / "models/eval").exists()
    run_id = json.loads((w / "models/train/run.json").read_text())["run_id"]
    assert "eval/accuracy" not in mlflow.MlflowClient(mlflow_uri).get_run(run_id).data.metrics


def test_outputs_are_world_readable_also_safetensors(tmp_path):
    from safetensors.torch import save_file

    umask = os.umask(0o022)
    try:
        path = files.atomic_write(tmp_path / "model.safetensors",
                                  lambda p: save_file({"w": torch.zeros(3)}, p))
    finally:
        os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o644
