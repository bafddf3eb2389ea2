"""python -m stages.predict PATH... : classify image files or folders with the exported model.

The preprocessing is the training one, read from the model.json beside the model: the same
decoding, mode conversion, resize policy, size and normalization.

    python -m stages.predict photo.jpg more_photos/ [--top-k 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from stages.images import DataError, decode_image, image_files


def collect(paths: list[str]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        out += image_files(p) if p.is_dir() else [p]
    return out


def load_runner(model: Path):
    """A function from a float32 NCHW batch to logits, for .onnx (onnxruntime) or .pt2."""
    if model.suffix == ".onnx":
        import onnxruntime as ort

        session = ort.InferenceSession(str(model), providers=ort.get_available_providers())
        name = session.get_inputs()[0].name
        return lambda x: session.run(None, {name: x})[0]
    if model.suffix == ".pt2":
        import torch

        program = torch.export.load(str(model)).module()
        return lambda x: program(torch.from_numpy(x)).detach().numpy()
    raise DataError(f"--model {model}: use the exported model.onnx or model.pt2")


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Classify images with the exported model.")
    ap.add_argument("paths", nargs="+", help="image files or folders (searched recursively)")
    ap.add_argument("--model", type=Path, default=Path("models/export/model.onnx"))
    ap.add_argument("--top-k", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args(argv)

    spec_path = args.model.with_name("model.json")
    if not args.model.exists() or not spec_path.exists():
        sys.exit(f"error: {args.model} or {spec_path} is missing; run `dvc repro export` first")
    spec = json.loads(spec_path.read_text())
    channels, size, _ = spec["input_shape"]
    classes = spec["classes"]
    mean = np.asarray(spec["mean"], dtype=np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(spec["std"], dtype=np.float32).reshape(1, -1, 1, 1)
    run = load_runner(args.model)
    k = max(1, min(args.top_k, len(classes)))

    failed = 0
    files = collect(args.paths)

    def emit_error(path: Path, reason: str) -> None:
        nonlocal failed
        failed += 1
        if args.json:
            print(json.dumps({"path": str(path), "error": reason}), flush=True)
        else:
            print(f"{path}\terror: {reason}", file=sys.stderr, flush=True)

    for start in range(0, len(files), args.batch_size):
        batch, paths = [], []
        for path in files[start:start + args.batch_size]:
            try:
                batch.append(decode_image(path, channels, size, spec.get("resize", "squash")))
                paths.append(path)
            except (DataError, OSError) as e:
                emit_error(path, str(e))
        if not batch:
            continue
        x = (np.stack(batch).astype(np.float32) / 255 - mean) / std
        probs = softmax(np.asarray(run(x), dtype=np.float64))
        for path, p in zip(paths, probs, strict=True):
            top = np.argsort(-p)[:k]
            if args.json:
                print(json.dumps({"path": str(path), "label": classes[top[0]],
                                  "confidence": float(p[top[0]]),
                                  "top_k": [{"label": classes[i], "p": float(p[i])} for i in top]}))
            else:
                print(f"{path}\t{classes[top[0]]}\t{p[top[0]]:.4f}")
    if not files:
        print("error: no image files found in " + " ".join(args.paths), file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
