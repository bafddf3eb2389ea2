"""Exports are the same bytes from any clone: nothing of this checkout's or venv's paths."""

from __future__ import annotations

import sys

import numpy as np
import onnxruntime as ort
import torch

from stages.config import ModelConfig
from stages.export import export_onnx, export_program, export_pt2
from stages.models import build_model
from tests.conftest import ROOT


def test_exports_hold_no_paths_and_keep_a_dynamic_batch(tmp_path):
    torch.manual_seed(0)
    model = build_model(ModelConfig(width=4), channels=1, num_classes=3).eval()
    example = torch.randn(2, 1, 16, 16)
    program = export_program(model, example)
    export_onnx(program, tmp_path / "m.onnx", opset=18)
    export_pt2(program, tmp_path / "m.pt2")
    venv = sys.prefix.encode()
    for name in ("m.onnx", "m.pt2"):
        data = (tmp_path / name).read_bytes()
        assert str(ROOT).encode() not in data and venv not in data, name
        assert b"site-packages" not in data, name
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    for batch in (1, 7):
        x = torch.randn(batch, 1, 16, 16)
        got = session.run(None, {"image": x.numpy()})[0]
        with torch.no_grad():
            np.testing.assert_allclose(got, model(x).numpy(), atol=1e-4)
    first = (tmp_path / "m.pt2").read_bytes()
    export_pt2(export_program(model, example), tmp_path / "m.pt2")  # a second export, same bytes
    assert (tmp_path / "m.pt2").read_bytes() == first
