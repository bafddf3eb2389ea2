"""Hostile and damaged model files: a malicious pickle, a hostile .pt2 or ONNX, a
zip bomb, a graph that loops for ever, a forged model.json or checkpoint, a damaged model.pt. Each
is crafted for real from a real export and must end in one line naming the file, quickly, without
running its code or reading or allocating what the file claims."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
import time
import zipfile

import pytest
import torch

from stages.checkpoints import latest_checkpoint
from stages.config import ModelConfig, ParamsError
from stages.data import save_prepared
from stages.lib.files import save_torch_verified
from stages.weights import CheckpointRefused, load
from tests.conftest import ROOT, copy_params, env_with, run
from tests.support.training import cnn, fit_ckpt, linear_model
from tests.support.workspaces import (
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


GIB = 1 << 30


# predict, writing on its way out (atexit: also on `error:` and after a finished stage's exit) its own peak
# RSS, VmHWM: getrusage's would count the forking test process's too.
PEAK = ("import atexit, re, runpy, sys\n"
        "out = sys.argv.pop(1)\n"
        "atexit.register(lambda: open(out, 'w').write(re.search(r'VmHWM:\\s*(\\d+)',"
        " open('/proc/self/status').read())[1]))\n"
        "runpy.run_module('stages.predict', run_name='__main__')\n")


def measured(cwd, *args) -> tuple[subprocess.CompletedProcess, float, int]:
    """predict's result, wall seconds and peak RSS in bytes."""
    peak = cwd / "peak_kb"
    start = time.monotonic()
    p = run([sys.executable, "-c", PEAK, str(peak), *args], cwd,
            env=env_with(PYTHONPATH=str(ROOT)), check=False, timeout=120)
    return p, time.monotonic() - start, int(peak.read_text()) * 1024


@pytest.fixture(scope="module")
def onnx_bytes(tmp_path_factory) -> bytes:
    """A real ONNX export of the `exported` fixture's model (its dynamic batch is named)."""
    from stages.export import export_onnx, export_program

    path = tmp_path_factory.mktemp("onnx") / "model.onnx"
    export_onnx(export_program(cnn(width=8).eval(), torch.zeros(2, 1, 16, 16)), path, 18)
    return path.read_bytes()


@pytest.fixture
def with_onnx(exported, onnx_bytes):
    (exported / "model.onnx").write_bytes(onnx_bytes)
    return exported


def edit_json(path, **changes):
    spec = json.loads(path.read_text())
    spec.update(changes)
    path.write_text(json.dumps(spec))


def refused(*argv) -> str:
    """predict run in this process (an interpreter start per case would cost seconds): the user
    error it ends with, which run_stage prints as its one `error:` line."""
    from stages.lib.errors import UserError
    from stages.predict import main

    with pytest.raises(UserError) as e:
        main([str(a) for a in argv])
    assert "\n" not in str(e.value)
    return str(e.value)


def weights_config(pt2) -> str:
    with zipfile.ZipFile(pt2) as z:
        return next(n for n in z.namelist() if n.endswith("model_weights_config.json"))


# ------------------------------------------------------------ bombs


def test_a_pt2_zip_bomb_is_refused_without_inflating_it(tmp_path, exported):
    """The issue's bomb: one weight entry deflated from 2 GiB of zeros, 9 MB on disk."""
    from stages.predict import pt2_weights

    cfg_name = weights_config(exported / "model.pt2")
    weight = cfg_name.replace("model_weights_config.json", "weight_0")
    bomb = exported / "bomb.pt2"
    with zipfile.ZipFile(exported / "model.pt2") as src, \
            zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as out:
        for name in src.namelist():
            if name != weight:
                out.writestr(name, src.read(name), compress_type=zipfile.ZIP_STORED)
                continue
            with out.open(name, "w", force_zip64=True) as f:
                for _ in range(128):
                    f.write(bytes(1 << 24))
    with zipfile.ZipFile(bomb) as z, z.open(weight) as f:  # it is real: it does inflate
        assert z.getinfo(weight).file_size == 2 * GIB and bomb.stat().st_size < 16 << 20
        assert f.read(1 << 20) == bytes(1 << 20)

    p, _, peak = measured(tmp_path, "img0.png", "--model", str(bomb))
    line = one_error_line(p.stderr)
    assert p.returncode == 1 and str(bomb) in line and weight in line and "compressed" in line
    assert p.stdout == "" and peak < GIB, (peak, line)
    # Refused in well under a second once torch is imported, before reading a byte of it.
    start = time.monotonic()
    with pytest.raises(ValueError, match="weight_0 is compressed, 2147483648 bytes"):
        pt2_weights(bomb, lambda declared: None)
    assert time.monotonic() - start < 1


def test_a_pt2_weight_not_the_size_its_architecture_needs_is_refused(tmp_path, exported):
    """Every other way a weight's bytes or declared shape can differ from the architecture's
    parameter: each refused naming the file, the weight and what it needs; nothing predicted."""
    from torch._export.serde.serialize import _TORCH_TO_SERIALIZE_DTYPE

    cfg_name = weights_config(exported / "model.pt2")
    weight = cfg_name.replace("model_weights_config.json", "weight_0")

    def meta(edit):
        def rewrite(name, data):
            if name != cfg_name:
                return data
            cfg = json.loads(data)
            edit(cfg["config"]["0.0.weight"]["tensor_meta"])
            return json.dumps(cfg).encode()
        return rewrite

    def huge(tm):
        tm["sizes"][0]["as_int"] = 1 << 40
    cases = {
        # The pre-fix hole: a buffer larger than the tensor was accepted.
        "padded": (lambda n, b: b + bytes(1 << 20) if n == weight else b,
                   f"{weight} is stored, 1048864 bytes unpacked; expected 288 bytes"),
        "short": (lambda n, b: b[:100] if n == weight else b, "expected 288 bytes"),
        "huge shape": (meta(huge), "'0.0.weight' is torch.float32 [1099511627776, 1, 3, 3], the "
                                   "architecture needs torch.float32 [8, 1, 3, 3]"),
        "dtype": (meta(lambda tm: tm.update(dtype=_TORCH_TO_SERIALIZE_DTYPE[torch.float64])),
                  "'0.0.weight' is torch.float64"),
        "view": (meta(lambda tm: tm["storage_offset"].update(as_int=9)), "stored as a view"),
        "extra weight": (lambda n, b: json.dumps({"config": {
            **json.loads(b)["config"], "x": json.loads(b)["config"]["0.0.weight"]}}).encode()
            if n == cfg_name else b, "unexpected: ['x']"),
    }
    for case, (edit, expected) in cases.items():
        forged = exported / f"{case.replace(' ', '_')}.pt2"
        rewrite_zip(exported / "model.pt2", forged, edit)
        line = refused(tmp_path / "img0.png", "--model", forged)
        assert str(forged) in line and expected in line, (case, line)
    p = predict(tmp_path, "img0.png", "--model", str(exported / "padded.pt2"))
    assert p.returncode == 1 and "expected 288 bytes" in one_error_line(p.stderr)
    assert p.stdout == ""


def onnx_model(*nodes, inits=(), out_shape=("n", 10)) -> bytes:
    """A small real graph, image -> logits (Flatten, MatMul), or with `nodes` that make
    `logits` from `mm` (or `flat`)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal(
        (256, 10)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Flatten", ["image"], ["flat"]),
         helper.make_node("MatMul", ["flat", "w"], ["mm" if nodes else "logits"]), *nodes], "g",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["n", 1, 16, 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, list(out_shape))],
        [w, *inits])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return model.SerializeToString()


def test_an_onnx_loop_that_never_ends_is_stopped_at_the_timeout(tmp_path, exported):
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    body = helper.make_graph(
        [helper.make_node("Identity", ["cond"], ["cond_out"]),
         helper.make_node("Identity", ["v"], ["v_out"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [1])])
    (exported / "model.onnx").write_bytes(onnx_model(
        helper.make_node("Loop", ["trips", "go", "v0"], ["v_end"], body=body),
        helper.make_node("Add", ["mm", "v_end"], ["logits"]),
        inits=[numpy_helper.from_array(np.array(10**15, np.int64), "trips"),
               numpy_helper.from_array(np.array(True), "go"),
               numpy_helper.from_array(np.zeros(1, np.float32), "v0")]))
    start = time.monotonic()
    p = predict(tmp_path, "img0.png", "--model", str(exported / "model.onnx"), "--timeout", "2")
    line = one_error_line(p.stderr)
    assert p.returncode == 1 and str(exported / "model.onnx") in line, line
    assert "ran past --timeout 2 s" in line and "raise --timeout" in line
    assert time.monotonic() - start < 60 and p.stdout == ""


@pytest.mark.parametrize("shape_from", ["constant", "input"])
def test_an_onnx_constant_of_shape_of_a_trillion_elements_is_one_line(tmp_path, exported,
                                                                       shape_from):
    import numpy as np
    from onnx import helper, numpy_helper

    if shape_from == "constant":  # 10^12 floats, 4 TB
        shape = [numpy_helper.from_array(np.array([10**12], np.int64), "shape")]
        nodes = []
    else:  # computed at run time from the input: [n * 10^12, 1, 16, 16]
        shape = [numpy_helper.from_array(np.array([10**12, 1, 1, 1], np.int64), "k")]
        nodes = [helper.make_node("Shape", ["image"], ["s"]),
                 helper.make_node("Mul", ["s", "k"], ["shape"])]
    (exported / "model.onnx").write_bytes(onnx_model(
        *nodes, helper.make_node("ConstantOfShape", ["shape"], ["big"]),
        helper.make_node("ReduceSum", ["big"], ["total"], keepdims=0),
        helper.make_node("Add", ["mm", "total"], ["logits"]), inits=shape))
    p, wall_s, peak = measured(tmp_path, "img0.png", "--model", str(exported / "model.onnx"))
    line = one_error_line(p.stderr)
    assert p.returncode == 1 and str(exported / "model.onnx") in line and "onnxruntime" in line
    assert p.stdout == "" and peak < GIB and wall_s < 60, (peak, wall_s)


# ------------------------------------------------------------ model.json, bounded and checked


@pytest.mark.parametrize("suffix", [".pt2", ".safetensors", ".onnx"])
def test_model_json_is_checked_against_bounds_and_the_model_file(tmp_path, with_onnx, suffix):
    """Each key model.json can get wrong, with every model format: refused in one line naming
    model.json and the key, before any image is read or anything it sizes is allocated."""
    spec_path = with_onnx / "model.json"
    good = spec_path.read_text()
    classes = json.loads(good)["classes"]
    cases = [
        ({"input_shape": [1, 100000, 100000]}, "input_shape=[1, 100000, 100000] is invalid: "
                                               "data.image_size=100000 is invalid: must be 4..1024"),
        ({"input_shape": [2, 16, 16]}, "input_shape=[2, 16, 16] is invalid: data.channels=2"),
        ({"input_shape": [1, 16, 8]}, "input_shape=[1, 16, 8] is invalid: give [channels, size"),
        ({"input_shape": "16"}, "input_shape='16' is invalid"),
        ({"classes": classes[:9]}, "classes lists 9 labels"),
        ({"classes": [*classes, "extra"]}, "classes lists 11 labels"),
        ({"classes": list(range(10))}, "classes=[0, 1, 2, 3, 4, 5, ...] is invalid: give a "
                                       "non-empty list of strings"),
        ({"classes": []}, "classes=[] is invalid"),
        ({"mean": [0.5, 0.5]}, "mean=[0.5, 0.5] is invalid: give 1 finite numbers"),
        ({"std": [0]}, "std=[0] is invalid: give 1 finite numbers (one per channel of "
                       "input_shape), each > 0"),
        ({"mean": "0.5"}, "mean='0.5' is invalid"),
        ({"resize": "zoom"}, "resize='zoom' is invalid: choose squash or center_crop"),
    ]
    if suffix == ".onnx":  # also checked against the graph: it takes 16x16 pixels, 1 channel
        cases.append(({"input_shape": [3, 16, 16], "mean": [0] * 3, "std": [1] * 3},
                      "input_shape=[3, 16, 16] does not match what --model"))
    else:  # the architecture is built from model_params
        cases += [
            ({"model_params": {"arch": "cnn", "width": 10**6, "dropout": 0.1}},
             "model_params={'arch': 'cnn', 'dropout': 0.1, 'width': 1000000} is invalid: "
             "model.width=1000000 is invalid: must be 1..1024"),
            ({"model_params": {"arch": "cnn", "width": "8"}}, "model.width='8' must be int"),
            ({"model_params": {"arch": "cnn", "widht": 8}}, "unknown key 'model.widht'"),
            ({"model_params": {"arch": "cnn", "width": 16}}, "its weights do not fit the model"),
            ({"model_params": None}, "model_params=None is invalid"),
        ]
    model = with_onnx / f"model{suffix}"
    for change, expected in cases:
        spec_path.write_text(json.dumps({**json.loads(good), **change}))
        line = refused(tmp_path / "img0.png", "--model", model)
        assert expected in line, (change, line)
        assert str(spec_path) in line or (expected.startswith("its weights")
                                          and str(model) in line), line
    spec_path.write_text(good[:-5])
    assert f"{spec_path}: not valid JSON" in refused(tmp_path / "img0.png", "--model", model)
    if suffix == ".onnx":  # end to end (no torch to import): the one line, nothing on stdout
        p = predict(tmp_path, "img0.png", "--model", str(model))
        assert p.returncode == 1 and f"{spec_path}: not valid JSON" in one_error_line(p.stderr)
        assert p.stdout == ""
    spec_path.write_text(good)
    from stages.predict import main

    assert main([str(tmp_path / "img0.png"), str(tmp_path / "img1.png"), "--model", str(model)]) == 0


def test_a_huge_input_shape_is_refused_at_once(tmp_path, exported):
    """The issue's case: a MemoryError after 35 s; now refused before any image is decoded."""
    edit_json(exported / "model.json", input_shape=[3, 10**6, 10**6])
    p, wall_s, peak = measured(tmp_path, "img0.png", "--model", str(exported / "model.pt2"))
    assert p.returncode == 1 and "input_shape" in one_error_line(p.stderr)
    assert peak < GIB and wall_s < 30, (peak, wall_s)


def test_onnx_logits_of_another_width_than_the_classes_are_refused(tmp_path, exported):
    """A graph whose output width is set only at run time: checked on the logits themselves."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    (exported / "model.onnx").write_bytes(onnx_model(  # 11 columns, from the pixels' values
        helper.make_node("ReduceMax", ["image"], ["peak"], keepdims=0),
        helper.make_node("Mul", ["peak", "zero"], ["nought"]),
        helper.make_node("Add", ["nought", "eleven"], ["eleven_f"]),
        helper.make_node("Cast", ["eleven_f"], ["end"], to=TensorProto.INT64),
        helper.make_node("Unsqueeze", ["end", "axis"], ["ends"]),
        helper.make_node("Slice", ["flat", "axis", "ends", "columns"], ["logits"]),
        inits=[numpy_helper.from_array(np.array(0, np.float32), "zero"),
               numpy_helper.from_array(np.array(11, np.float32), "eleven"),
               numpy_helper.from_array(np.array([0], np.int64), "axis"),
               numpy_helper.from_array(np.array([1], np.int64), "columns")], out_shape=("n", "m")))
    line = refused(tmp_path / "img0.png", tmp_path / "img1.png", "--model", exported / "model.onnx")
    assert "gave logits of shape [2, 11] for 2 images and the 10 classes" in line
    assert str(exported / "model.json") in line


@pytest.mark.parametrize("forge", ["width", "channels", "classes", "weights"])
def test_a_forged_checkpoint_and_its_checksum_are_refused_in_one_line(tmp_path, digits, forge):
    """model.pt and its .sha256 sidecar forged together (the checksum then holds): the params
    stored in it are bounded, and the weights must match the architecture built from them
    before the architecture takes any memory (channels 10^6 would be a 1 GB first layer)."""
    _, meta = digits
    ckpt = {"model": cnn(width=8).state_dict(), "classes": meta["classes"], "channels": 1,
            "model_params": {"arch": "cnn", "width": 8, "dropout": 0.1}, "mean": meta["mean"],
            "std": meta["std"], "image_size": 16, "resize": "fit", "best_epoch": 1}
    forged = {"width": {"model_params": {"arch": "cnn", "width": 10**6, "dropout": 0.1}},
              "channels": {"channels": 10**6}, "classes": {"classes": meta["classes"] * 1000},
              "weights": {"model": {"x": torch.zeros(1)}}}[forge]
    path = save_torch_verified(tmp_path / "model.pt", {**ckpt, **forged})
    start = time.monotonic()
    with pytest.raises(CheckpointRefused) as e:
        load(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: its weights do not fit the model params stored with it (")
    assert "\n" not in msg and "dvc repro train" in msg and time.monotonic() - start < 2
    if forge == "width":
        assert "model.width=1000000 is invalid: must be 1..1024" in msg
    with pytest.raises(ParamsError, match="model.width=1025 is invalid: must be 1..1024"):
        ModelConfig(width=1025)  # params.yaml: the same bound before training starts
    model, _ = load(save_torch_verified(tmp_path / "good.pt", ckpt))
    assert not any(t.is_meta for t in model.state_dict().values())


# ------------------------------------------------------------ labels in the text output


def test_terminal_escape_sequences_in_class_labels_are_escaped_in_text(tmp_path, exported):
    hostile = ["\x1b]0;owned\x07\x1b[2J", "\x9b31mred", "a\tb\nc"]
    edit_json(exported / "model.json", classes=hostile * 3 + ["x"])  # the digit 0, 3, 6 or 9
    model = exported / "model.onnx"  # a real graph, and no torch to import: a quick start
    model.write_bytes(onnx_model())
    p = predict(tmp_path, "img0.png", "img1.png", "--model", str(model))
    assert p.returncode == 0, p.stderr
    rows = [line.split("\t") for line in p.stdout.splitlines()]
    assert len(rows) == 2 and all(len(r) == 3 for r in rows), p.stdout
    assert not any(c in p.stdout for c in "\x1b\x07\x9b"), p.stdout
    escaped = {"\\x1b]0;owned\\x07\\x1b[2J", "\\x9b31mred", "a\\tb\\nc", "x"}
    assert {r[1] for r in rows} <= escaped
    js = predict(tmp_path, "img0.png", "img1.png", "--json", "--model", str(model))
    labels = [json.loads(line)["label"] for line in js.stdout.splitlines()]
    assert [shown for shown in (r[1] for r in rows)] == [
        label.replace("\x1b", "\\x1b").replace("\x07", "\\x07").replace("\x9b", "\\x9b")
        .replace("\t", "\\t").replace("\n", "\\n") for label in labels]  # --json exact
