"""Stage export: models/train/ -> models/export/ (ONNX, torch.export .pt2, safetensors, model.json).

Each format is checked against eager PyTorch on real test images at two batch sizes, since a
"dynamic" batch dimension can silently come out fixed.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch

from reprotrain import tracking
from stages import weights
from stages.config import (
    EVAL_DIR,
    EXPORT_DIR,
    MAX_EXPORT_BATCH,
    PREPARED,
    TRAIN_DIR,
    ParamsError,
    flatten,
    load_params,
)
from stages.data import load_meta, load_split, normalize
from stages.inference import model_kwargs, png_base64, quiet_type_hints
from stages.lib.cli import run_stage
from stages.lib.errors import UserError
from stages.lib.files import atomic_write, atomic_write_all, text_writer


def export_program(model: torch.nn.Module, example: torch.Tensor) -> torch.export.ExportedProgram:
    """One torch.export feeds both the .pt2 and ONNX. Without the nodes' stack traces: they hold
    absolute paths of this checkout and venv, so another clone would write other bytes."""
    batch = torch.export.Dim("batch", min=1, max=MAX_EXPORT_BATCH)
    program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    for node in program.graph.nodes:
        node.meta.pop("stack_trace", None)
    return program


def onnx_bytes(program: torch.export.ExportedProgram, opset: int) -> bytes:
    """The ONNX file, checked to be the opset asked for: where torch.onnx cannot convert to it,
    it logs the failure and keeps its own opset."""
    import onnx

    if opset > onnx.defs.onnx_opset_version():
        raise ParamsError(f"params.yaml: export.opset={opset} is invalid: onnx "
                          f"{onnx.__version__} knows opsets up to {onnx.defs.onnx_opset_version()}")
    proto = torch.onnx.export(program, dynamo=True, opset_version=opset, input_names=["image"],
                              output_names=["logits"], verbose=False).model_proto
    written = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    if written != opset:
        raise ParamsError(f"params.yaml: export.opset={opset} is invalid: torch.onnx could not "
                          f"convert this model to it (it wrote opset {written}); use {written}")
    onnx.checker.check_model(proto, full_check=True)
    return proto.SerializeToString()


def pt2_bytes(program: torch.export.ExportedProgram) -> bytes:
    # In memory: torch's zip writer aborts the process (a C++ throw in a destructor) when a
    # write to a file fails, on a full disk say; a failed write of these bytes is an OSError.
    # Through a file object: given a path, the archive's inner folder is named after the file.
    buf = io.BytesIO()
    torch.export.save(program, buf)
    return buf.getvalue()


def export_onnx(program: torch.export.ExportedProgram, path: Path, opset: int) -> None:
    data = onnx_bytes(program, opset)
    atomic_write(path, lambda p: p.write_bytes(data))


def export_pt2(program: torch.export.ExportedProgram, path: Path) -> None:
    data = pt2_bytes(program)
    atomic_write(path, lambda p: p.write_bytes(data))


def check_close(name: str, run, model: torch.nn.Module, images: torch.Tensor,
                batch_sizes: list[int], atol: float) -> dict:
    """Max abs difference vs eager at each batch size; any argmax disagreement is an error."""
    out = {}
    for bs in batch_sizes:
        x = images[:bs]
        with torch.no_grad():
            want = model(x).numpy()
        got = np.asarray(run(x))
        diff = float(np.abs(got - want).max())
        if got.shape != want.shape or diff > atol or (got.argmax(1) != want.argmax(1)).any():
            raise UserError(f"{name} disagrees with eager PyTorch at batch {bs}: max abs diff "
                            f"{diff:.2e} (export.atol {atol}), shape {got.shape}")
        out[f"{name}_max_abs_diff_b{bs}"] = diff
    return out


def main() -> None:
    params = load_params()
    cfg = params.export
    model, trained = weights.load(TRAIN_DIR / "model.pt")
    test = load_split(PREPARED, "test")
    if max(cfg.check_batch_sizes) > len(test.x):
        raise ParamsError(f"params.yaml: export.check_batch_sizes={cfg.check_batch_sizes} is "
                          f"invalid: the test split ({PREPARED / 'test.pt'}) has {len(test.x)} "
                          f"images; use batch sizes up to {len(test.x)}")
    images = normalize(test.x[:max(cfg.check_batch_sizes)], torch.tensor(trained.mean),
                       torch.tensor(trained.std))
    example = images[:2]  # batch > 1, or the exporters specialize the batch dimension to 1

    import onnxruntime as ort
    from safetensors.torch import save

    # Every file is made and checked in memory first, then all are written at once: a failed
    # check or write leaves the previous export whole.
    exported = export_program(model, example)
    onnx_model, pt2 = onnx_bytes(exported, cfg.opset), pt2_bytes(exported)
    safetensors = save({k: v.contiguous() for k, v in model.state_dict().items()})
    session = ort.InferenceSession(onnx_model, providers=["CPUExecutionProvider"])
    program = torch.export.load(io.BytesIO(pt2)).module()
    checks = check_close("onnx", lambda x: session.run(None, {"image": x.numpy()})[0], model,
                         images, cfg.check_batch_sizes, cfg.atol)
    checks |= check_close("pt2", lambda x: program(x).detach().numpy(), model, images,
                          cfg.check_batch_sizes, cfg.atol)

    description = json.dumps(trained.spec() | {
        "input": "float32 NCHW, pixels scaled to [0, 1], then (x - mean) / std per channel",
        "input_name": "image", "output_name": "logits", "onnx_opset": cfg.opset,
        "files": ["model.onnx", "model.pt2", "model.safetensors"], "checks": checks,
    }, indent=2) + "\n"
    atomic_write_all({EXPORT_DIR / name: text_writer(data) for name, data in
                      [("model.onnx", onnx_model), ("model.pt2", pt2),
                       ("model.safetensors", safetensors), ("model.json", description.encode())]})

    evaluation = json.loads((EVAL_DIR / "metrics.json").read_text())
    meta = load_meta(PREPARED)
    with tracking.experiment_run(params.mlflow, flatten(params), meta, TRAIN_DIR) as run:
        # DVC skips evaluate when its committed results are this very model's (a fresh clone
        # retrains to the same bytes): the run gets them here, as the figures it is exported with.
        if not run.has_metric("eval/accuracy"):
            run.log_evaluation(evaluation)
        for name in ("model.onnx", "model.json", "model.safetensors"):
            run.log_artifact(EXPORT_DIR / name, "export")
        # The served model: images in, labels out, over the ONNX file just written (no pickle,
        # no torch to load it). Named after what it is (`cnn-digits`), not MLflow's `model`:
        # the data it was trained on, as prepare recorded it.
        name = f"{trained.arch}-{meta['source']}"
        with quiet_type_hints():
            info = (run.log_served_model(name, **model_kwargs(EXPORT_DIR, png_base64(
                test.x[:2].numpy()))) if cfg.log_model else None)
        if cfg.register_as and info is not None:
            reg = run.register(info.model_uri, cfg.register_as, evaluation["accuracy"],
                               tracking.model_task(trained.spec()))
            if reg:
                print(f"registered {reg['name']} version {reg['version']} as candidate"
                      + (", now champion" if reg["champion"] else
                         f"; champion stays version {reg['previous_champion']}"
                         + (" (it answers other classes or inputs: `make serve` serves it; "
                            "export.register_as names another model)" if reg["other_task"]
                            else "")))
    print(f"exported ONNX, .pt2 and safetensors to {EXPORT_DIR}; eager vs exported within "
          f"{max(checks.values()):.1e} at batch sizes {cfg.check_batch_sizes}; test accuracy "
          f"{evaluation['accuracy']:.4f} ({EVAL_DIR / 'metrics.json'})")


if __name__ == "__main__":
    run_stage(main)
