"""The served model, logged as code (MLflow models-from-code): images in, label and
probabilities out, over the artifacts model.onnx and model.json.

    {"inputs": ["<base64 of a PNG, JPEG, ...>", ...]}
    -> {"predictions": [{"label": "7", "probability": 0.998, "probabilities": {"0": ..., ...}}]}

A record gets a "warning" too when its image is unlike the training images (the check and the
words of `stages.predict`'s warning).

Each image is decoded, resized and normalized by the functions `python -m stages.predict` uses,
and the graph runs in onnxruntime: no torch here, so a server loads it in a second. MLflow runs
this file to load the model; `make serve` (stages/serving/app.py) runs the checkout's copy, never the
one stored with a registered model, and takes only model.onnx and model.json from the registry.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

from stages import predict as shared  # the functions `python -m stages.predict` runs
from stages.lib.images import ACCEPTED, DataError, decode_image, open_image

# Bounds on one request: its images, each image's pixels and all its images' pixels (read from
# the headers, before any image is decoded: Pillow's own bomb limit only warns up to 179
# megapixels, and 64 small PNGs of 4096x4096 zeros cost 13 s to decode), a batch's run time.
# `make serve` also bounds the request's bytes (MAX_BODY_BYTES in stages/serving/app.py).
MAX_IMAGES = 1024
MAX_PIXELS = 4096 * 4096
MAX_REQUEST_PIXELS = 2 * MAX_PIXELS
TIMEOUT_S = 30
FIX = f"send a list of base64-encoded image files ({ACCEPTED}) as {{\"inputs\": [...]}}"


class BadInput(MlflowException):
    """A 400 with one line that names the image and the problem. MLflow's scoring server
    prepends the whole request to a model's error message ("Failed to predict data '<every
    image>'"): this message ignores that assignment."""

    def __init__(self, line: str):
        self._line = " ".join(line.split())  # one line, whatever a decoder's message held
        super().__init__(self._line, error_code=INVALID_PARAMETER_VALUE)

    @property
    def message(self) -> str:
        return self._line

    @message.setter
    def message(self, _: str) -> None:
        pass


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
                       "image may have (MAX_PIXELS in stages/serving/served_model.py); resize it first")
    return width * height


class ImageClassifier(mlflow.pyfunc.PythonModel):
    def load_context(self, context: mlflow.pyfunc.PythonModelContext) -> None:
        self.spec_path = Path(context.artifacts["model.json"])
        self.onnx_path = Path(context.artifacts["model.onnx"])
        self.spec = shared.read_spec(self.spec_path)
        self.run = shared.onnx_runner(self.onnx_path, self.spec, TIMEOUT_S)

    def predict(self, model_input: list[str | bytes]) -> list[dict[str, str | float | dict[str, float]]]:
        """One record per image: `label`, its `probability`, and `probabilities` by class name."""
        if not isinstance(model_input, list):
            raise BadInput(f"inputs is a {type(model_input).__name__}, not a list; {FIX}")
        if not model_input:
            raise BadInput(f"no images: inputs is an empty list; {FIX}")
        if len(model_input) > MAX_IMAGES:
            raise BadInput(f"{len(model_input)} images in one request, over {MAX_IMAGES} "
                           "(MAX_IMAGES in stages/serving/served_model.py); send them in smaller batches")
        channels, size, _ = self.spec["input_shape"]
        files = [image_bytes(item, i) for i, item in enumerate(model_input)]
        total = 0
        for i, data in enumerate(files):  # every header first: a refusal decodes nothing
            total += pixels(data, i)
            if total > MAX_REQUEST_PIXELS:
                raise BadInput(f"images 0 to {i}: {total:,} pixels together, over the "
                               f"{MAX_REQUEST_PIXELS:,} one request may have (MAX_REQUEST_PIXELS "
                               "in stages/serving/served_model.py); send fewer or smaller images")
        images = []
        for i, data in enumerate(files):
            try:
                images.append(decode_image(data, channels, size, self.spec["resize"]))
            except DataError as e:  # a fixed message: never a decoder's words
                raise BadInput(f"image {i}: not a readable image ({e})") from None
            except Exception:  # noqa: BLE001 - whatever else fails on a crafted file
                raise BadInput(f"image {i}: not a readable image (it does not decode); "
                               f"{FIX}") from None
        x = shared.model_input(images, self.spec)
        probs = shared.probabilities(self.run(x), len(x), self.spec, str(self.onnx_path),
                                     self.spec_path)
        classes = self.spec["classes"]
        out = []
        for p, offset in zip(probs, shared.brightness_offset(x), strict=True):
            warning = shared.unlike_training(offset, self.spec)
            out.append({"label": classes[p.argmax()], "probability": float(p.max()),
                        "probabilities": dict(zip(classes, map(float, p), strict=True))}
                       | ({"warning": warning} if warning else {}))
        return out


mlflow.models.set_model(ImageClassifier())
