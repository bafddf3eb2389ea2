"""What the served model answers: base64 image files in, one record per image out, over a
model.onnx and its model.json. No MLflow here: `make serve` (stages/serving/app.py) serves this
under uvicorn and answers in a fraction of a second, and the model MLflow serves in a container
(stages/serving/served_model.py) wraps the same class.

    {"inputs": ["<base64 of a PNG, JPEG, ...>", ...]}
    -> {"predictions": [{"label": "7", "probability": 0.998, "probabilities": {"0": ..., ...}}]}

A record gets a "warning" too when its image is unlike the training images (the check and the
words of `stages.predict`'s warning). Each image is decoded, resized and normalized by the
functions `python -m stages.predict` uses, and the graph runs in onnxruntime.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Any

from stages import inference  # the functions `python -m stages.predict` runs too
from stages.lib.images import ACCEPTED, DataError, decode_image, has_colour, open_image

# Bounds on one request: its images, each image's pixels and all its images' pixels (read from
# the headers, before any image is decoded: Pillow's own bomb limit only warns up to 179
# megapixels, and 64 small PNGs of 4096x4096 zeros cost 13 s to decode), a batch's run time.
# `make serve` also bounds the request's bytes (MAX_BODY_BYTES in stages/serving/app.py).
MAX_IMAGES = 1024
MAX_PIXELS = 4096 * 4096
MAX_REQUEST_PIXELS = 2 * MAX_PIXELS
TIMEOUT_S = 30
FIX = f"send a list of base64-encoded image files ({ACCEPTED}) as {{\"inputs\": [...]}}"
HERE = "stages/serving/classifier.py"


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
        self.spec = inference.read_spec(spec_path)
        self.run = inference.onnx_runner(onnx_path, self.spec, TIMEOUT_S)

    def __call__(self, model_input: list[str | bytes]) -> list[dict[str, Any]]:
        """One record per image: `label`, its `probability`, and `probabilities` by class name."""
        if not isinstance(model_input, list):
            raise BadInput(f"inputs is a {type(model_input).__name__}, not a list; {FIX}")
        if not model_input:
            raise BadInput(f"no images: inputs is an empty list; {FIX}")
        if len(model_input) > MAX_IMAGES:
            raise BadInput(f"{len(model_input)} images in one request, over {MAX_IMAGES} "
                           f"(MAX_IMAGES in {HERE}); send them in smaller batches")
        channels, size, _ = self.spec["input_shape"]
        files = [image_bytes(item, i) for i, item in enumerate(model_input)]
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
        x = inference.model_input(images, self.spec)
        probs = inference.probabilities(self.run(x), len(x), self.spec, str(self.onnx_path),
                                     self.spec_path)
        classes = self.spec["classes"]
        out = []
        for p, image, xi, data in zip(probs, images, x, files, strict=True):
            warning = inference.unlike_training(image, xi, self.spec,
                                                channels == 1 and has_colour(data))
            out.append({"label": classes[p.argmax()], "probability": float(p.max()),
                        "probabilities": dict(zip(classes, map(float, p), strict=True))}
                       | ({"warning": warning} if warning else {}))
        return out
