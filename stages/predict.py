"""python -m stages.predict PATH... : classify image files or folders with the exported model
(or the trained models/train/model.pt, before export).

The preprocessing is the training one, read from the model.json beside the model (or from
model.pt itself): the same decoding, mode conversion, resize policy, size and normalization.

    python -m stages.predict photo.jpg more_photos/ [--top-k 3] [--json]

No model file runs code here, whatever its origin: .onnx runs in onnxruntime (a graph of
standard operators), .pt2, .safetensors and .pt give only tensors, which fill the architecture
named in model.json (or stored in model.pt).
"""

from __future__ import annotations

import json
import math
import re
import reprlib
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from stages.config import ParamsError
from stages.inference import model_input, onnx_runner, probabilities, read_spec, unlike_training
from stages.lib.cli import ArgumentParser, positive_int, run_stage
from stages.lib.errors import UserError
from stages.lib.images import DataError, decode_image, has_colour, image_files

MODEL_SUFFIXES = (".onnx", ".pt2", ".safetensors")


def collect(paths: list[str]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        out += map(Path, image_files(p)) if p.is_dir() else [p]
    return out


# model.json lists one label per class: 64 MiB is millions of them, and a bound on what is read.
def load_runner(model: Path, spec: dict, timeout_s: int):
    """A function from a float32 NCHW batch to logits."""
    if model.suffix == ".onnx":
        return onnx_runner(model, spec, timeout_s)
    return eager_runner(model, spec)


def eager_runner(model: Path, spec: dict):
    """The architecture model.json names, filled with the file's weights: each declared tensor
    is checked against the architecture (name, shape, dtype) before any is read, and no more is
    read than the architecture needs."""

    from stages.config import ModelConfig, check_schema
    from stages.models import fill, output_key, skeleton, weights_mismatch

    spec_path = model.with_name("model.json")
    params = spec.get("model_params")
    try:
        if not isinstance(params, dict):
            raise ParamsError("params.yaml: give the model section of params.yaml as an object")
        check_schema(params, ModelConfig, "model.")  # types and unknown keys, as in params.yaml
        net = skeleton(ModelConfig(**params), spec["input_shape"][0], len(spec["classes"]),
                       spec["input_shape"][1])
    except ParamsError as e:
        raise DataError(f"{spec_path}: model_params={reprlib.repr(params)} is invalid: "
                        f"{str(e).removeprefix('params.yaml: ')}; export the model again "
                        "(`dvc repro export`)") from None

    def check(declared: dict) -> None:
        out = declared.get(output_key(net), ([None], None))[0]
        if out[:1] != [len(spec["classes"])]:
            raise DataError(f"{spec_path}: classes lists {len(spec['classes'])} labels, "
                            f"--model {model} has {out[:1]} outputs; export the model again "
                            "(`dvc repro export`)")
        mismatch = weights_mismatch(net, declared)
        if mismatch:
            raise DataError(f"--model {model}: its weights do not fit the model that {spec_path} "
                            f"describes ({mismatch}); export the model again "
                            "(`dvc repro export`)")

    weights = (pt2_weights if model.suffix == ".pt2" else safetensors_weights)(model, check)
    return torch_runner(fill(net, weights))


def trained_runner(model: Path):
    """The trained model.pt, before export: the description stored with it (stages/weights.py)
    stands in for model.json. It is verified and read as data, like the exported files."""
    from stages import weights

    net, trained = weights.load(model)
    return trained.spec(), torch_runner(net)


def torch_runner(net):
    import torch

    def run(x):
        with torch.inference_mode():
            return net(torch.from_numpy(x)).numpy()

    return run


# The dtypes a model's weights may be stored in, as each file format names them: .pt2's codes
# (the archive schema's ScalarType, fixed by the format) and safetensors' names (its spec). The
# libraries' own tables are private; tests/test_private_names.py checks these against them.
FILE_DTYPES = {"uint8": (1, "U8"), "int8": (2, "I8"), "int16": (3, "I16"), "int32": (4, "I32"),
               "int64": (5, "I64"), "float16": (6, "F16"), "float32": (7, "F32"),
               "float64": (8, "F64"), "bool": (12, "BOOL"), "bfloat16": (13, "BF16")}


def file_dtype(fmt: str, code: int | str) -> object:
    """The torch dtype a file's dtype code or name stands for; any other, as the file wrote it
    (the weights check then refuses it, naming it)."""
    import torch

    column = 0 if fmt == "pt2" else 1
    return next((getattr(torch, name) for name, codes in FILE_DTYPES.items()
                 if codes[column] == code), code)


def pt2_weights(path: Path, check: Callable[[dict], None]) -> dict:
    """The weights of a torch.export archive, read as plain tensors: `check` sees every tensor's
    declared name, shape and dtype first; then each entry is read only if it is stored
    uncompressed (no bomb: never more bytes than the file has) and is exactly its tensor's size.
    Never torch.export.load on a file from elsewhere: it evaluates code the file carries
    (symbolic shapes through sympy, guard code through exec, and pickled weights or sample
    inputs when a weights-only load fails)."""
    import torch

    try:
        with zipfile.ZipFile(path) as z:
            config_name = next(n for n in z.namelist()
                               if n.endswith("/data/weights/model_weights_config.json"))
            folder = config_name.removesuffix("model_weights_config.json")
            config = json.loads(stored(z, config_name, None))["config"]
            declared = {}
            for fqn, meta in config.items():
                tm = meta.get("tensor_meta")
                if meta.get("use_pickle") or tm is None:
                    raise DataError(f"--model {path}: weight {fqn!r} is a pickle, refused "
                                    "(unpickling can run code); export the model again")
                sizes = [d["as_int"] for d in tm["sizes"]]
                if ([d["as_int"] for d in tm["strides"]] != list(torch.empty(sizes, device="meta")
                                                                  .stride())
                        or tm["storage_offset"]["as_int"] != 0):
                    raise DataError(f"--model {path}: weight {fqn!r} is stored as a view, not as "
                                    "plain contiguous data; export the model again")
                declared[fqn] = (sizes, file_dtype("pt2", tm["dtype"]))
            check(declared)
            weights = {}
            for fqn, meta in config.items():
                sizes, dtype = declared[fqn]
                raw = bytearray(stored(z, folder + meta["path_name"],
                                       math.prod(sizes) * dtype.itemsize))
                weights[fqn] = (torch.frombuffer(raw, dtype=dtype) if raw else
                                torch.empty(0, dtype=dtype)).view(sizes)
            return weights
    except (StopIteration, KeyError, TypeError, ValueError, RuntimeError, EOFError,
            zipfile.BadZipFile, json.JSONDecodeError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"--model {path}: not a torch.export archive with plain weights "
                        f"({type(e).__name__}: {e}); export the model again") from None


def stored(z: zipfile.ZipFile, name: str, size: int | None) -> bytes:
    """An entry torch.export.save wrote (uncompressed), of exactly `size` bytes when given."""
    info = z.getinfo(name)
    if info.compress_type != zipfile.ZIP_STORED or (size is not None and info.file_size != size):
        raise DataError(f"--model {z.filename}: entry {name} is "
                        f"{'compressed' if info.compress_type else 'stored'}, {info.file_size} "
                        f"bytes unpacked; expected {size if size is not None else 'any number of'}"
                        " bytes stored uncompressed, as torch.export.save writes; export the "
                        "model again")
    with z.open(info) as f:
        return f.read(info.file_size)


def safetensors_weights(path: Path, check: Callable[[dict], None]) -> dict:
    """The tensors of a safetensors file; `check` sees their names, shapes and dtypes first
    (the header, read without the data)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            declared = {}
            for name in f.keys():  # noqa: SIM118 - safe_open is no mapping
                part = f.get_slice(name)
                declared[name] = (part.get_shape(), file_dtype("safetensors", part.get_dtype()))
            check(declared)
            return {name: f.get_tensor(name) for name in declared}
    except (SafetensorError, OSError) as e:
        raise DataError(f"--model {path}: unreadable safetensors file ({e})") from None


def shown(text: str | Path) -> str:
    """A path or a label for the tab-separated text output: control characters (a tab or a
    newline would break the columns, an escape sequence would drive the terminal; C1 controls
    such as \\x9b start one too) escaped as \\t, \\n, \\xNN; --json has them exact."""
    escapes = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}
    return re.sub(r"[\x00-\x1f\x7f-\x9f]", lambda m: escapes.get(m[0], f"\\x{ord(m[0]):02x}"),
                  str(text))


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m stages.predict",
                        description="Classify images with the exported model.")
    ap.add_argument("paths", nargs="+", help="image files or folders (searched recursively)")
    ap.add_argument("--model", type=Path, default=Path("models/export/model.onnx"),
                    help="an exported model.onnx, model.pt2 or model.safetensors, with its "
                         "model.json beside it, or the trained models/train/model.pt")
    ap.add_argument("--top-k", type=positive_int, default=1,
                    help="the K most likely classes of each image, with their probabilities "
                         "(default 1)")
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.add_argument("--batch-size", type=positive_int, default=64,
                    help="images per run of the model (default 64); lower it to use less memory")
    ap.add_argument("--timeout", type=positive_int, default=60, metavar="SECONDS",
                    help="the most one batch may run in onnxruntime (a graph can loop for ever)")
    args = ap.parse_args(argv)
    if args.model.suffix == ".pt":
        spec, run = trained_runner(args.model)
        spec_path = args.model
    elif args.model.suffix not in MODEL_SUFFIXES:
        raise DataError(f"--model {args.model}: not a model predict runs: the exported "
                        f"models/export/model{', model'.join(MODEL_SUFFIXES)} (made by `dvc "
                        "repro export`, each with its model.json), or the trained "
                        "models/train/model.pt")
    else:
        spec_path = args.model.with_name("model.json")
        for needed in (args.model, spec_path):
            if not needed.is_file():
                raise DataError(f"{needed} is missing; run `dvc repro export` first")
        spec = read_spec(spec_path)
        run = load_runner(args.model, spec, args.timeout)
    channels, size, _ = spec["input_shape"]
    classes = spec["classes"]
    k = min(args.top_k, len(classes))

    failed, warned = 0, set()
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
                batch.append(decode_image(path, channels, size, spec["resize"]))
                paths.append(path)
            except (DataError, OSError) as e:
                emit_error(path, str(e))
        if not batch:
            continue
        x = model_input(batch, spec)
        probs = probabilities(run(x), len(x), spec, f"--model {args.model}", spec_path)
        for path, p, image, xi in zip(paths, probs, batch, x, strict=True):
            top = np.argsort(-p)[:k]
            warning = unlike_training(image, xi, spec, channels == 1 and has_colour(path))
            if args.json:
                print(json.dumps({"path": str(path), "label": classes[top[0]],
                                  "confidence": float(p[top[0]]),
                                  "top_k": [{"label": classes[i], "p": float(p[i])} for i in top]}
                                 | ({"warning": warning} if warning else {})))
            else:
                if warning:  # each reason once, then the figures only
                    figures, _, reason = warning.partition(": it is ")
                    print(f"warning: {shown(path)}: "
                          f"{figures if reason in warned else warning}", file=sys.stderr)
                    warned.add(reason)
                print("\t".join([shown(path), *(f"{shown(classes[i])}\t{p[i]:.4f}" for i in top)]))
    if not files:
        print("error: no image files found in " + " ".join(args.paths), file=sys.stderr)
        return 1
    return 1 if failed else 0


def cli() -> None:
    if sys.stdout is None:  # started with fd 1 closed: Python drops every print silently
        raise UserError("stdout is closed (>&-): predict has nowhere to write its answers; "
                        "redirect it, e.g. > answers.tsv")
    code = main()
    sys.stdout.flush()  # here, not at exit: a reader gone (`| head`) is then run_stage's quiet end
    sys.exit(code)


if __name__ == "__main__":
    run_stage(cli)
