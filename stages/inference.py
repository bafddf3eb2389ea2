"""Inference, one path from an image file to class probabilities, for `python -m stages.predict`
and the served model (stages/serving/classifier.py): model.json read and checked (read_spec),
the ONNX graph run in onnxruntime (onnx_runner), decoded images made the model's input
(model_input, as training normalized them), its logits made probabilities, and the warning for
an image unlike the training ones (unlike_training). numpy only: no torch, MLflow or make
target here, so the served model ships this, what it imports, and nothing else.
"""

from __future__ import annotations

import json
import math
import reprlib
import threading
from pathlib import Path

import numpy as np

from stages.lib.images import DataError

MAX_SPEC_BYTES = 64 << 20


def read_spec(path: Path) -> dict:
    """model.json, checked before anything it sizes is allocated: each key against the bounds
    params.yaml has for it (data.channels, data.image_size, data.resize)."""

    def need(ok: bool, key: str, rule: str) -> None:
        if not ok:
            raise DataError(f"{path}: {key}={reprlib.repr(spec.get(key))} is invalid: {rule}; "
                            "export the model again (`dvc repro export`)")

    if path.stat().st_size > MAX_SPEC_BYTES:
        raise DataError(f"{path}: {path.stat().st_size} bytes, more than a model.json holds "
                        f"({MAX_SPEC_BYTES}); export the model again (`dvc repro export`)")
    try:
        spec = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e}); export the model again "
                        "(`dvc repro export`)") from None
    if not isinstance(spec, dict):
        raise DataError(f"{path}: not a JSON object; export the model again (`dvc repro export`)")
    shape = spec.get("input_shape")
    need(isinstance(shape, list) and len(shape) == 3 and all(type(d) is int for d in shape)
         and shape[1] == shape[2], "input_shape", "give [channels, size, size], whole numbers")
    need(spec.setdefault("resize", "squash") in ("squash", "center_crop"), "resize",
         "choose squash or center_crop")
    from stages.config import DataConfig, ParamsError

    try:
        DataConfig(channels=shape[0], image_size=shape[1])
    except ParamsError as e:  # the rule for the same value in params.yaml
        need(False, "input_shape", str(e).removeprefix("params.yaml: "))
    classes = spec.get("classes")
    need(isinstance(classes, list) and classes and all(isinstance(c, str) for c in classes),
         "classes", "give a non-empty list of strings, one label per class")
    for key in ("mean", "std"):
        v = spec.get(key)
        need(isinstance(v, list) and len(v) == shape[0] and all(
            type(x) in (int, float) and math.isfinite(x) and (key == "mean" or x > 0) for x in v),
             key, f"give {shape[0]} finite numbers (one per channel of input_shape)"
             + (", each > 0" if key == "std" else ""))
    return spec


def onnx_runner(model: Path, spec: dict, timeout_s: int):
    import onnxruntime as ort

    try:
        session = ort.InferenceSession(str(model), providers=ort.get_available_providers())
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own types for a bad file
        raise DataError(f"--model {model}: onnxruntime refused it "
                        f"({str(e).splitlines()[0]})") from None
    inputs, outputs = session.get_inputs(), session.get_outputs()
    want_in = ["batch", *spec["input_shape"]]
    if len(inputs) != 1 or inputs[0].type != "tensor(float)" or not fits(inputs[0].shape, want_in):
        raise DataError(f"{model.with_name('model.json')}: input_shape={spec['input_shape']} does "
                        f"not match what --model {model} takes "
                        f"({', '.join(f'{i.name} {i.type} {i.shape}' for i in inputs)}); export "
                        "the model again (`dvc repro export`)")
    if not outputs or not fits(outputs[0].shape, ["batch", len(spec["classes"])]):
        raise DataError(f"{model.with_name('model.json')}: classes lists "
                        f"{len(spec['classes'])} labels, --model {model} gives "
                        f"{outputs[0].shape if outputs else 'no output'}; export the model "
                        "again (`dvc repro export`)")
    name = inputs[0].name

    def run(x):
        # A graph can loop for ever (a Loop of 10^15 iterations): onnxruntime checks this flag
        # between nodes and iterations, so a timer can stop it from this thread.
        options = ort.RunOptions()
        timer = threading.Timer(timeout_s, lambda: setattr(options, "terminate", True))
        timer.start()
        try:
            return session.run(None, {name: x}, options)[0]
        except Exception as e:  # noqa: BLE001 - onnxruntime raises its own types
            if options.terminate:
                raise DataError(f"--model {model}: a batch of {len(x)} ran past --timeout "
                                f"{timeout_s} s and was stopped; if the model is just slow, "
                                "raise --timeout or lower --batch-size") from None
            raise DataError(f"--model {model}: onnxruntime failed running it "
                            f"({str(e).splitlines()[0]})") from None
        finally:
            timer.cancel()

    return run


def fits(declared: list | None, want: list) -> bool:
    """Whether an ONNX shape (ints, or names for dimensions set at run time) can be `want`."""
    return declared is None or (len(declared) == len(want) and all(
        not isinstance(d, int) or d == w for d, w in zip(declared, want, strict=True)))


# How far an image's mean brightness may lie from the training images', in their standard
# deviations: digits drawn light on dark lie within 0.2, the same drawn dark on light 1.1-1.4.
UNLIKE_TRAINING_STDS = 1.0


def unlike_training(image: np.ndarray, x: np.ndarray, spec: dict, colour: bool = False) -> str | None:
    """A warning when an image is clearly unlike what the model learned from, which a model
    answers as confidently as anything else, and wrongly: `image` as decode_image gives it,
    `x` as model_input normalized it. The figures first, then after ": it is " the reason.

    Three checks on what model.json records: the mean brightness far from the training mean
    (dark strokes on light paper for the digits model), no color at all (R = G = B in every
    pixel) for a model of 3 channels, which a user trains on color images (the digits given to
    a shapes model came back `square 0.9998`, each), and `colour` (images.has_colour of the
    file) for a model of 1 channel, trained on grayscale images (`data.channels: auto`: a
    color photo given to the Fashion-MNIST model came back `bag 0.3389`)."""
    offset = float(x.mean())  # the brightness against the training mean, in training stds
    if abs(offset) > UNLIKE_TRAINING_STDS:
        mean, std = np.mean(spec["mean"]), np.mean(spec["std"])
        return (f"its mean brightness {mean + offset * std:.2f} is far from the training "
                f"images' {mean:.2f} (std {std:.2f}, pixels 0-1): it is "
                f"{'brighter' if offset > 0 else 'darker'} than what the model learned from (the "
                "digits model learned light strokes on a dark background); its answer may be "
                "wrong")
    if len(image) == 3 and (image == image[:1]).all():
        return ("it is grayscale (no color in any pixel) and the model takes color (3 channels): "
                "it is unlike the images such a model learned from, unless they were grayscale "
                "too; its answer may be wrong")
    if len(image) == 1 and colour:
        return ("it is in color and the model takes grayscale (1 channel): it is unlike the "
                "images it learned from; its answer may be wrong")
    return None


def model_input(images: list[np.ndarray], spec: dict) -> np.ndarray:
    """The float32 NCHW batch the model takes, from decode_image's uint8 images: pixels scaled
    to [0, 1], then (x - mean) / std per channel, as training normalized them. The served model
    (stages/serving/classifier.py) calls this too: one path from image to input."""
    mean = np.asarray(spec["mean"], dtype=np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(spec["std"], dtype=np.float32).reshape(1, -1, 1, 1)
    return (np.stack(images).astype(np.float32) / 255 - mean) / std


def probabilities(logits: np.ndarray, n: int, spec: dict, model: str,
                  spec_path: str | Path) -> np.ndarray:
    """Each of `n` images' probability of every class, from the model's logits (checked to be
    one row per image and one column per class of model.json)."""
    logits = np.asarray(logits, dtype=np.float64)
    if logits.shape != (n, len(spec["classes"])):
        raise DataError(f"{model} gave logits of shape {list(logits.shape)} for {n} images and "
                        f"the {len(spec['classes'])} classes of {spec_path}; export the model "
                        "again (`dvc repro export`)")
    return softmax(logits)


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)
