"""Inference, one path from an image file to class probabilities, for `python -m stages.predict`
and the served model: model.json read and checked (read_spec), the ONNX graph run in
onnxruntime (onnx_runner), decoded images made the model's input (model_input, as training
normalized them), its logits made probabilities, and the warning for an image unlike the
training ones (unlike_training). numpy only: no torch, MLflow or make target here, so the served
model ships this, what it imports, and nothing else.

The served model (below): base64 image files in, one record per image out, over a model.onnx and
its model.json (`Classifier`). `make serve` (reprotrain/serving/app.py) serves it under uvicorn;
the model MLflow serves in a container (stages/served_model.py) wraps the same class; export
logs it (`model_kwargs`), with two test images as its example (`png_base64`).

    {"inputs": ["<base64 of a PNG, JPEG, ...>", ...]}
    -> {"predictions": [{"label": "7", "probability": 0.998, "probabilities": {"0": ..., ...}}]}

A record gets a "warning" too when its image is unlike the training images (the check and the
words of `stages.predict`'s warning).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import logging
import math
import reprlib
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from stages.lib.images import ACCEPTED, DataError, decode_image, has_colour, open_image

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
    (Classifier, below) calls this too: one path from image to input."""
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


# Bounds on one request: its images, each image's pixels and all its images' pixels (read from
# the headers, before any image is decoded: Pillow's own bomb limit only warns up to 179
# megapixels, and 64 small PNGs of 4096x4096 zeros cost 13 s to decode), a batch's run time.
# `make serve` also bounds the request's bytes (MAX_BODY_BYTES in reprotrain/serving/app.py).
MAX_IMAGES = 1024
MAX_PIXELS = 4096 * 4096
MAX_REQUEST_PIXELS = 2 * MAX_PIXELS
TIMEOUT_S = 30
FIX = f"send a list of base64-encoded image files ({ACCEPTED}) as {{\"inputs\": [...]}}"
HERE = "stages/inference.py"


class BadInput(ValueError):
    """A request refused in one line that names the image and the problem: a 400."""

    def __init__(self, line: str):
        super().__init__(" ".join(line.split()))  # one line, whatever a decoder's message held


def image_bytes(item: Any, i: int) -> bytes:
    """An image file's bytes: given as such (in Python), or base64 text (over HTTP; line breaks,
    as MLflow and `base64` write them, allowed)."""
    if isinstance(item, bytes):
        return item
    if not isinstance(item, str):
        raise BadInput(f"image {i}: a JSON {type(item).__name__}, not a string; {FIX}")
    try:
        return base64.b64decode("".join(item.split()), validate=True)
    except (binascii.Error, ValueError):
        raise BadInput(f"image {i}: not base64 text ({item[:20]!r}...); {FIX}") from None


def pixels(data: bytes, i: int) -> int:
    """An image's pixels, from its header: nothing is decoded."""
    if not data:
        raise BadInput(f"image {i}: not a readable image (empty: 0 bytes); {FIX}")
    try:
        with open_image(data) as img:
            width, height = img.size
    except DataError as e:  # a fixed message: never a decoder's words
        raise BadInput(f"image {i}: not a readable image ({e})") from None
    if width * height > MAX_PIXELS:
        raise BadInput(f"image {i}: {width}x{height} pixels, over the {MAX_PIXELS:,} a served "
                       f"image may have (MAX_PIXELS in {HERE}); resize it first")
    return width * height


class Classifier:
    """A model.onnx and its model.json, checked as predict checks them (a bad file is one line
    at start, not a dead server), then called with a request's images."""

    def __init__(self, spec_path: Path, onnx_path: Path):
        self.spec_path, self.onnx_path = spec_path, onnx_path
        self.spec = read_spec(spec_path)
        self.run = onnx_runner(onnx_path, self.spec, TIMEOUT_S)

    def __call__(self, inputs: list[str | bytes]) -> list[dict[str, Any]]:
        """One record per image: `label`, its `probability`, and `probabilities` by class name."""
        if not isinstance(inputs, list):
            raise BadInput(f"inputs is a {type(inputs).__name__}, not a list; {FIX}")
        if not inputs:
            raise BadInput(f"no images: inputs is an empty list; {FIX}")
        if len(inputs) > MAX_IMAGES:
            raise BadInput(f"{len(inputs)} images in one request, over {MAX_IMAGES} "
                           f"(MAX_IMAGES in {HERE}); send them in smaller batches")
        channels, size, _ = self.spec["input_shape"]
        files = [image_bytes(item, i) for i, item in enumerate(inputs)]
        total = 0
        for i, data in enumerate(files):  # every header first: a refusal decodes nothing
            total += pixels(data, i)
            if total > MAX_REQUEST_PIXELS:
                raise BadInput(f"images 0 to {i}: {total:,} pixels together, over the "
                               f"{MAX_REQUEST_PIXELS:,} one request may have (MAX_REQUEST_PIXELS "
                               f"in {HERE}); send fewer or smaller images")
        images = []
        for i, data in enumerate(files):
            try:
                images.append(decode_image(data, channels, size, self.spec["resize"]))
            except DataError as e:  # a fixed message: never a decoder's words
                raise BadInput(f"image {i}: not a readable image ({e})") from None
            except Exception:  # noqa: BLE001 - whatever else fails on a crafted file
                raise BadInput(f"image {i}: not a readable image (it does not decode); "
                               f"{FIX}") from None
        x = model_input(images, self.spec)
        probs = probabilities(self.run(x), len(x), self.spec, str(self.onnx_path),
                              self.spec_path)
        classes = self.spec["classes"]
        out = []
        for p, image, xi, data in zip(probs, images, x, files, strict=True):
            warning = unlike_training(image, xi, self.spec, channels == 1 and has_colour(data))
            out.append({"label": classes[p.argmax()], "probability": float(p.max()),
                        "probabilities": dict(zip(classes, map(float, p), strict=True))}
                       | ({"warning": warning} if warning else {}))
        return out


# How export logs the served model, and `make serve` saves it afresh.
SERVED_MODEL = Path(__file__).with_name("served_model.py")
FILES = ("model.onnx", "model.json")
# What the served model imports, at the versions of this environment (requirements.lock): the
# model's requirements.txt, which a container built from it installs.
REQUIREMENTS = ("mlflow", "onnxruntime", "pillow", "numpy", "omegaconf")
# The modules of stages/ it imports, transitively, and the two that config reads as text (the
# registries of models and sources): tests/test_layout.py checks the list against the import graph,
# tests/platform/test_serving.py loads a saved model away from the checkout.
PACKAGE = ("__init__.py", "config.py", "inference.py", "models.py", "sources.py", "lib/__init__.py",
           "lib/errors.py", "lib/images.py", "lib/paths.py", "lib/strict_yaml.py")
STAGES = SERVED_MODEL.parent


def png_base64(images) -> list[str]:
    """uint8 (N, C, H, W) images as base64 PNG files: the model's input example."""
    from PIL import Image

    out = []
    for img in images:
        buf = io.BytesIO()
        arr = img.transpose(1, 2, 0)
        Image.fromarray(arr[:, :, 0] if arr.shape[2] == 1 else arr).save(buf, format="PNG")
        out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return out


def model_kwargs(folder: Path, example: list[str] | None = None,
                 package: Path | None = None) -> dict:
    """Arguments of mlflow.pyfunc.log_model/save_model for the served model over `folder`'s
    model.onnx and model.json; with `package` (a copy of what it imports from stages/) inside."""
    return {"python_model": str(SERVED_MODEL),
            "artifacts": {name: str(folder / name) for name in FILES},
            "input_example": example,
            "pip_requirements": [f"{p}=={version(p)}" for p in REQUIREMENTS],
            "code_paths": [str(package)] if package else None}


def package_copy(dest: Path) -> Path:
    """The modules of stages/ that the served model imports, as a package in `dest`."""
    package = dest / "stages"
    package.mkdir(parents=True)
    for name in PACKAGE:
        (package / name).parent.mkdir(exist_ok=True)
        shutil.copy2(STAGES / name, package / name)
    # Not the checkout's: its hand-off to a warm process has no place in a served model.
    (package / "__init__.py").write_text('"""reprotrain\'s inference, as the served model runs it."""\n')
    return package


@contextmanager
def quiet_type_hints() -> Iterator[None]:
    """MLflow logs that it cannot check the elements of a `str | bytes` list: served_model.py
    checks each image itself."""
    logger = logging.getLogger("mlflow.types.type_hints")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
