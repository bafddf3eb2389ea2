"""python -m stages.predict PATH... : classify image files or folders with the exported model.

The preprocessing is the training one, read from the model.json beside the model: the same
decoding, mode conversion, resize policy, size and normalization.

    python -m stages.predict photo.jpg more_photos/ [--top-k 3] [--json]

No model file runs code here, whatever its origin: .onnx runs in onnxruntime (a graph of
standard operators), .pt2 and .safetensors give only tensors, which fill the architecture
named in model.json.
"""

from __future__ import annotations

import json
import re
import sys
import zipfile
from pathlib import Path

import numpy as np

from stages.config import ArgumentParser, positive_int, run_stage
from stages.images import DataError, decode_image, image_files

MODEL_SUFFIXES = (".onnx", ".pt2", ".safetensors")


def collect(paths: list[str]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        out += image_files(p) if p.is_dir() else [p]
    return out


def load_runner(model: Path, spec: dict):
    """A function from a float32 NCHW batch to logits."""
    if model.suffix == ".onnx":
        import onnxruntime as ort

        try:
            session = ort.InferenceSession(str(model), providers=ort.get_available_providers())
        except Exception as e:  # noqa: BLE001 - onnxruntime raises its own types for a bad file
            raise DataError(f"--model {model}: onnxruntime refused it "
                            f"({str(e).splitlines()[0]})") from None
        name = session.get_inputs()[0].name
        return lambda x: session.run(None, {name: x})[0]
    return eager_runner(model, spec, pt2_weights(model) if model.suffix == ".pt2" else
                        safetensors_weights(model))


def pt2_weights(path: Path) -> dict:
    """The weights of a torch.export archive, read as plain tensors. Never torch.export.load on
    a file from elsewhere: it evaluates code the file carries (symbolic shapes through sympy,
    guard code through exec, and pickled weights or sample inputs when a weights-only load
    fails)."""
    import torch
    from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE

    try:
        with zipfile.ZipFile(path) as z:
            config_name = next(n for n in z.namelist()
                               if n.endswith("/data/weights/model_weights_config.json"))
            folder = config_name.removesuffix("model_weights_config.json")
            weights = {}
            for fqn, meta in json.loads(z.read(config_name))["config"].items():
                tm = meta.get("tensor_meta")
                if meta.get("use_pickle") or tm is None:
                    raise DataError(f"--model {path}: weight {fqn!r} is a pickle, refused "
                                    "(unpickling can run code); export the model again")
                dtype = _SERIALIZE_TO_TORCH_DTYPE[tm["dtype"]]
                raw = bytearray(z.read(folder + meta["path_name"]))
                flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
                weights[fqn] = flat.as_strided([d["as_int"] for d in tm["sizes"]],
                                               [d["as_int"] for d in tm["strides"]],
                                               tm["storage_offset"]["as_int"])
            return weights
    except (StopIteration, KeyError, TypeError, ValueError, RuntimeError, zipfile.BadZipFile,
            json.JSONDecodeError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"--model {path}: not a torch.export archive with plain weights "
                        f"({type(e).__name__}: {e}); export the model again") from None


def safetensors_weights(path: Path) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise DataError(f"--model {path}: unreadable safetensors file ({e})") from None


def eager_runner(model: Path, spec: dict, weights: dict):
    """The architecture model.json names, filled with `weights` (strictly: every tensor, each
    of the right shape)."""
    import torch

    from stages.config import ModelConfig
    from stages.models import build_model

    try:
        net = build_model(ModelConfig(**spec["model_params"]), spec["input_shape"][0],
                          len(spec["classes"]))
        net.load_state_dict(weights)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise DataError(f"--model {model}: its weights do not fit the model that "
                        f"{model.with_name('model.json')} describes "
                        f"({str(e).splitlines()[0]})") from None
    net.eval()

    def run(x):
        with torch.inference_mode():
            return net(torch.from_numpy(x)).numpy()

    return run


def shown(path: Path) -> str:
    """A path for the tab-separated text output: control characters (a tab or a newline in a
    file name would break the columns) escaped as \\t, \\n, \\xNN; --json has them exact."""
    escapes = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}
    return re.sub(r"[\x00-\x1f\x7f]", lambda m: escapes.get(m[0], f"\\x{ord(m[0]):02x}"),
                  str(path))


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m stages.predict",
                        description="Classify images with the exported model.")
    ap.add_argument("paths", nargs="+", help="image files or folders (searched recursively)")
    ap.add_argument("--model", type=Path, default=Path("models/export/model.onnx"),
                    help="an exported model.onnx, model.pt2 or model.safetensors, with its "
                         "model.json beside it")
    ap.add_argument("--top-k", type=positive_int, default=1)
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.add_argument("--batch-size", type=positive_int, default=64)
    args = ap.parse_args(argv)
    if args.model.suffix not in MODEL_SUFFIXES:
        raise DataError(f"--model {args.model}: not an exported model; predict runs "
                        f"models/export/model{', model'.join(MODEL_SUFFIXES)} (made by `dvc "
                        "repro export`), each with its model.json")

    spec_path = args.model.with_name("model.json")
    for needed in (args.model, spec_path):
        if not needed.is_file():
            raise DataError(f"{needed} is missing; run `dvc repro export` first")
    spec = json.loads(spec_path.read_text())
    channels, size, _ = spec["input_shape"]
    classes = spec["classes"]
    mean = np.asarray(spec["mean"], dtype=np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(spec["std"], dtype=np.float32).reshape(1, -1, 1, 1)
    run = load_runner(args.model, spec)
    k = min(args.top_k, len(classes))

    failed = 0
    files = collect(args.paths)

    def emit_error(path: Path, reason: str) -> None:
        nonlocal failed
        failed += 1
        if args.json:
            print(json.dumps({"path": str(path), "error": reason}), flush=True)
        else:
            print(f"{shown(path)}\terror: {reason}", file=sys.stderr, flush=True)

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
                print(f"{shown(path)}\t{classes[top[0]]}\t{p[top[0]]:.4f}")
    if not files:
        print("error: no image files found in " + " ".join(args.paths), file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    run_stage(lambda: sys.exit(main()))
