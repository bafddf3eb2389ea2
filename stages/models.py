"""Model builders and the registry `ARCHS` that `model.arch` names an entry of.

A new model is a builder here and its entry in `ARCHS`; `model.arch: <name>` in params.yaml
picks it. Nothing else lists the models: config reads the names from this file's source, so
`ARCHS` stays a dict written out with string keys. tests/experiment/test_contracts.py checks every entry
against this contract (all but `torch.compile`):

- Builder: `(cfg: ModelConfig, channels: int, num_classes: int, image_size: int) -> nn.Module`,
  and all it builds follows from those four: model.pt and model.json store `model_params` (the
  `model` section), the input shape and the class names, and evaluate, export, predict and
  serving rebuild the model from them alone. The image size may choose layers (resnet18's
  stem), not size them: a layer sized by it (an MLP's first) pools to a fixed size first. A new
  hyperparameter is a `ModelConfig` field with a default and a bound in its `__post_init__` (a
  forged file can name any value, and its skeleton is built before anything is checked), in
  params.yaml and in docs/params.md's parameter table (test_config.py checks both); the existing
  ones, `width` and `dropout`, a builder may ignore.
- Weights: same seed, same weights, bitwise. Build with torch's default initializers, drawing
  only from torch's global generator (train seeds it first), in a fixed order; no pretrained
  weights, no download, no files read.
- Meta device: it builds under `torch.device("meta")` (`skeleton`): no tensor is read or
  computed while building, since every file's claims are checked against the skeleton first.
- Input: float32 NCHW `(N, channels, S, S)`, normalized, for any batch N >= 1 and any image
  size S in data.image_size's range that the architecture admits (the small CNN pools twice).
  Output: float32 logits `(N, num_classes)`, no softmax (the loss and predict apply it).
- Output key: the last tensor of `state_dict()` is the output layer's bias, of shape
  `(num_classes,)`: `output_key` finds the number of classes in a file by it (a head without
  a bias, or a buffer registered after it, breaks this).
- state_dict: tensors only, none sharing memory with another (safetensors refuses shared
  tensors), the same names, shapes and dtypes on every build (`weights_mismatch`).
- Export: `torch.export` with a dynamic batch dimension (1 to `MAX_EXPORT_BATCH`, traced at
  batch 2) and ONNX (opset 18, through the same program) agree with eager within
  `export.atol` (1e-4) at two batch sizes: no Python branch or shape taken from the batch
  size, no `view(2, ...)`-style constants (use `flatten`).
- Training: every parameter gets a gradient from every forward pass (DDP's default), the
  module survives `copy.deepcopy` (EMA), `.to(memory_format=torch.channels_last)` and
  `torch.compile`; `train()`/`eval()` switch dropout and BatchNorm only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from stages.config import ModelConfig


def _block(c_in: int, c_out: int) -> nn.Sequential:
    # bias=False: the BatchNorm right after has its own shift.
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
                         nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


def small_cnn(cfg: ModelConfig, channels: int, num_classes: int, image_size: int) -> nn.Module:
    """A VGG-style CNN for small images (8 to 64 px): two pooled stages, global average pool."""
    w = cfg.width
    return nn.Sequential(
        _block(channels, w), _block(w, w), nn.MaxPool2d(2),
        _block(w, 2 * w), _block(2 * w, 2 * w), nn.MaxPool2d(2),
        _block(2 * w, 4 * w),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(cfg.dropout), nn.Linear(4 * w, num_classes),
    )


# From this size resnet18 keeps torchvision's ImageNet stem (a 7x7 stride-2 convolution and a
# max-pool: 4x smaller feature maps). Below it, the CIFAR stem keeps small images from pooling
# away; at 224 px it would cost about 16x the FLOPs.
IMAGENET_STEM_FROM = 128


def resnet18(cfg: ModelConfig, channels: int, num_classes: int, image_size: int) -> nn.Module:
    """torchvision's resnet18; for images under IMAGENET_STEM_FROM px a 3x3 stride-1 stem and no
    max-pool, as for CIFAR."""
    from torchvision.models import resnet18 as tv_resnet18

    m = tv_resnet18(num_classes=num_classes)
    if image_size < IMAGENET_STEM_FROM:
        m.conv1 = nn.Conv2d(channels, 64, 3, stride=1, padding=1, bias=False)
        m.maxpool = nn.Identity()
    elif channels != 3:
        m.conv1 = nn.Conv2d(channels, 64, 7, stride=2, padding=3, bias=False)
    m.fc = nn.Sequential(nn.Dropout(cfg.dropout), m.fc)
    return m


ARCHS: dict[str, Callable[[ModelConfig, int, int, int], nn.Module]] = {
    "cnn": small_cnn,
    "resnet18": resnet18,
}


def build_model(cfg: ModelConfig, channels: int, num_classes: int, image_size: int) -> nn.Module:
    if cfg.arch not in ARCHS:
        raise ValueError(f"unknown model.arch {cfg.arch!r}; choose from {sorted(ARCHS)}")
    return ARCHS[cfg.arch](cfg, channels, num_classes, image_size)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def loss_fn(label_smoothing: float = 0.0) -> nn.Module:
    """The loss, once: what training minimizes (with `train.label_smoothing`) and what
    validation and evaluate report (without: the loss of the logits as they are)."""
    return nn.CrossEntropyLoss(label_smoothing=label_smoothing)


def skeleton(cfg: ModelConfig, channels: int, num_classes: int, image_size: int) -> nn.Module:
    """The architecture on the meta device: every tensor's name, shape and dtype, and no memory.
    What a file claims is checked against it before anything of the claimed size is allocated
    or read (a forged file can claim any size)."""
    with torch.device("meta"):
        return build_model(cfg, channels, num_classes, image_size)


def output_key(model: nn.Module) -> str:
    """The output layer's bias, whose length is the number of classes: the last tensor of every
    architecture in ARCHS (a test checks)."""
    return next(reversed(model.state_dict()))


def described(weights: dict) -> dict[str, tuple[list[int], object]]:
    return {k: (list(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ([], type(v))
            for k, v in weights.items()}


def weights_mismatch(model: nn.Module, declared: dict[str, tuple[list[int], object]]) -> str | None:
    """How the tensors a file declares (name -> (shape, dtype)) differ from `model`'s, or None."""
    want = described(model.state_dict())
    missing, extra = sorted(want.keys() - declared.keys()), sorted(declared.keys() - want.keys())
    if missing or extra:
        return f"tensors missing: {missing[:3] or 'none'}, unexpected: {extra[:3] or 'none'}"
    for name, (shape, dtype) in want.items():
        if declared[name] != (shape, dtype):
            return (f"tensor {name!r} is {declared[name][1]} {declared[name][0]}, the architecture "
                    f"needs {dtype} {shape}")
    return None


def fill(model: nn.Module, weights: dict) -> nn.Module:
    """A skeleton given `weights`, which must match it exactly (names, shapes, dtypes)."""
    mismatch = weights_mismatch(model, described(weights))
    if mismatch:
        raise ValueError(mismatch)
    model.load_state_dict(weights, assign=True)
    return model.eval()
