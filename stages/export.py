"""Stage export: models/train/ -> models/export/ (ONNX, torch.export .pt2, safetensors, model.json).

Each format is checked against eager PyTorch on real test images at two batch sizes, since a
"dynamic" batch dimension can silently come out fixed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from stages import tracking
from stages.config import EVAL_DIR, EXPORT_DIR, PREPARED, TRAIN_DIR, flatten, load_params, run_stage
from stages.data import load_meta, load_split, normalize
from stages.files import atomic_write, write_json
from stages.models import load_trained


def export_program(model: torch.nn.Module, example: torch.Tensor) -> torch.export.ExportedProgram:
    """One torch.export feeds both the .pt2 and ONNX. Without the nodes' stack traces: they hold
    absolute paths of this checkout and venv, so another clone would write other bytes."""
    batch = torch.export.Dim("batch", min=1, max=65536)
    program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    for node in program.graph.nodes:
        node.meta.pop("stack_trace", None)
    return program


def export_onnx(program: torch.export.ExportedProgram, path: Path, opset: int) -> None:
    import onnx

    onnx_program = torch.onnx.export(program, dynamo=True, opset_version=opset,
                                     input_names=["image"], output_names=["logits"], verbose=False)
    atomic_write(path, lambda p: onnx.save(onnx_program.model_proto, str(p)))
    onnx.checker.check_model(str(path), full_check=True)


def export_pt2(program: torch.export.ExportedProgram, path: Path) -> None:
    def write(p: Path) -> None:
        # Through a file object: given a path, the archive's inner folder is named after the
        # (random) temp file, and the same program would never give the same bytes.
        with open(p, "wb") as f:
            torch.export.save(program, f)

    atomic_write(path, write)


def check_close(name: str, run, model: torch.nn.Module, images: torch.Tensor,
                batch_sizes: list[int], atol: float) -> dict:
    """Max abs difference vs eager at each batch size; any argmax disagreement is an error."""
    out = {}
    for bs in batch_sizes:
        x = images[:bs]
        if len(x) < bs:
            raise ValueError(f"export.check_batch_sizes: {bs} exceeds the {len(images)} test images")
        with torch.no_grad():
            want = model(x).numpy()
        got = np.asarray(run(x))
        diff = float(np.abs(got - want).max())
        if got.shape != want.shape or diff > atol or (got.argmax(1) != want.argmax(1)).any():
            raise RuntimeError(f"{name} disagrees with eager PyTorch at batch {bs}: max abs diff "
                               f"{diff:.2e} (export.atol {atol}), shape {got.shape}")
        out[f"{name}_max_abs_diff_b{bs}"] = diff
    return out


def main() -> None:
    params = load_params()
    cfg = params.export
    model, ckpt = load_trained(TRAIN_DIR / "model.pt")
    test = load_split(PREPARED, "test")
    images = normalize(test.x[:max(cfg.check_batch_sizes)], torch.tensor(ckpt["mean"]),
                       torch.tensor(ckpt["std"]))
    example = images[:2]  # batch > 1, or the exporters specialize the batch dimension to 1
    EXPORT_DIR.mkdir(parents=True, exist_ok=True)

    from safetensors.torch import save_file

    atomic_write(EXPORT_DIR / "model.safetensors",
                 lambda p: save_file({k: v.contiguous() for k, v in model.state_dict().items()}, p))
    exported = export_program(model, example)
    export_onnx(exported, EXPORT_DIR / "model.onnx", cfg.opset)
    export_pt2(exported, EXPORT_DIR / "model.pt2")

    import onnxruntime as ort

    session = ort.InferenceSession(str(EXPORT_DIR / "model.onnx"), providers=["CPUExecutionProvider"])
    program = torch.export.load(str(EXPORT_DIR / "model.pt2")).module()
    checks = check_close("onnx", lambda x: session.run(None, {"image": x.numpy()})[0], model,
                         images, cfg.check_batch_sizes, cfg.atol)
    checks |= check_close("pt2", lambda x: program(x).detach().numpy(), model, images,
                          cfg.check_batch_sizes, cfg.atol)

    write_json(EXPORT_DIR / "model.json", {
        "arch": ckpt["model_params"]["arch"], "model_params": ckpt["model_params"],
        "classes": ckpt["classes"], "mean": ckpt["mean"], "std": ckpt["std"],
        "input_shape": [ckpt["channels"], ckpt["image_size"], ckpt["image_size"]],
        "resize": ckpt["resize"],
        "input": "float32 NCHW, pixels scaled to [0, 1], then (x - mean) / std per channel",
        "input_name": "image", "output_name": "logits", "onnx_opset": cfg.opset,
        "files": ["model.onnx", "model.pt2", "model.safetensors"], "checks": checks,
    })

    evaluation = json.loads((EVAL_DIR / "metrics.json").read_text())
    with tracking.experiment_run(params.mlflow, flatten(params), load_meta(PREPARED), TRAIN_DIR) as run:
        # DVC skips evaluate when its committed results are this very model's (a fresh clone
        # retrains to the same bytes): the run gets them here, as the figures it is exported with.
        if not run.has_metric("eval/accuracy"):
            run.log_evaluation(evaluation)
        for name in ("model.onnx", "model.json", "model.safetensors"):
            run.log_artifact(EXPORT_DIR / name, "export")
        # Named after what it is (`cnn-digits`), not MLflow's default `model`.
        name = f"{ckpt['model_params']['arch']}-{params.data.source}"
        info = run.log_pytorch_model(model, example.numpy(), name) if cfg.log_model else None
        if cfg.register_as and info is not None:
            reg = run.register(info.model_uri, cfg.register_as, evaluation["accuracy"])
            if reg:
                print(f"registered {reg['name']} version {reg['version']} as candidate"
                      + (", now champion" if reg["champion"] else
                         f"; champion stays version {reg['previous_champion']}"))
    print(f"exported ONNX, .pt2 and safetensors to {EXPORT_DIR}; eager vs exported within "
          f"{max(checks.values()):.1e} at batch sizes {cfg.check_batch_sizes}; test accuracy "
          f"{evaluation['accuracy']:.4f} ({EVAL_DIR / 'metrics.json'})")


if __name__ == "__main__":
    run_stage(main)
