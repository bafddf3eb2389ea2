"""Model builders and the registry `ARCHS` that `model.arch` names an entry of.

A new model: a function `(cfg, channels, num_classes) -> nn.Module` here, its entry in `ARCHS`,
its name in `config.ARCHS` (a test keeps the two equal); new hyperparameters go in `ModelConfig`.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable

import torch
from torch import nn

from stages.cli import UserError
from stages.config import ModelConfig
from stages.files import verify_digest


def _block(c_in: int, c_out: int) -> nn.Sequential:
    # bias=False: the BatchNorm right after has its own shift.
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
                         nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


def small_cnn(cfg: ModelConfig, channels: int, num_classes: int) -> nn.Module:
    """A VGG-style CNN for small images (8 to 64 px): two pooled stages, global average pool."""
    w = cfg.width
    return nn.Sequential(
        _block(channels, w), _block(w, w), nn.MaxPool2d(2),
        _block(w, 2 * w), _block(2 * w, 2 * w), nn.MaxPool2d(2),
        _block(2 * w, 4 * w),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(cfg.dropout), nn.Linear(4 * w, num_classes),
    )


def small_resnet18(cfg: ModelConfig, channels: int, num_classes: int) -> nn.Module:
    """torchvision's resnet18 for small inputs: a 3x3 stride-1 stem and no max-pool, as for CIFAR."""
    from torchvision.models import resnet18

    m = resnet18(num_classes=num_classes)
    m.conv1 = nn.Conv2d(channels, 64, 3, stride=1, padding=1, bias=False)
    m.maxpool = nn.Identity()
    m.fc = nn.Sequential(nn.Dropout(cfg.dropout), m.fc)
    return m


ARCHS: dict[str, Callable[[ModelConfig, int, int], nn.Module]] = {
    "cnn": small_cnn,
    "resnet18": small_resnet18,
}


def build_model(cfg: ModelConfig, channels: int, num_classes: int) -> nn.Module:
    if cfg.arch not in ARCHS:
        raise ValueError(f"unknown model.arch {cfg.arch!r}; choose from {sorted(ARCHS)}")
    return ARCHS[cfg.arch](cfg, channels, num_classes)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class CheckpointRefused(UserError, ValueError):
    pass


def load_checkpoint(path, map_location: str | torch.device = "cpu") -> dict:
    """Verified against the SHA-256 train wrote beside it (a damaged file would evaluate
    silently to a wrong figure), then weights_only=True: a checkpoint is data; a pickle that
    runs code is refused, no fallback."""
    try:
        verify_digest(path)
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: missing; run `dvc repro train` first") from None
    except ValueError as e:
        raise CheckpointRefused(f"{path}: {e}; restore it with `dvc checkout {path}` or "
                                "rebuild it with `dvc repro train`") from None
    except pickle.UnpicklingError as e:
        raise CheckpointRefused(f"{path}: refused to load, it is not a plain weights file "
                                f"(weights_only=True: {str(e).splitlines()[0]}). Rebuild it with "
                                "`dvc repro train`; never load it with weights_only=False") from None
    except (RuntimeError, EOFError) as e:  # a damaged archive that still matches its checksum
        raise CheckpointRefused(f"{path}: unreadable ({str(e).splitlines()[0]}); rebuild it "
                                "with `dvc repro train`") from None


def skeleton(cfg: ModelConfig, channels: int, num_classes: int) -> nn.Module:
    """The architecture on the meta device: every tensor's name, shape and dtype, and no memory.
    What a file claims is checked against it before anything of the claimed size is allocated
    or read (a forged file can claim any size)."""
    with torch.device("meta"):
        return build_model(cfg, channels, num_classes)


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


def load_trained(path) -> tuple[nn.Module, dict]:
    """The model saved by the train stage, rebuilt from the params stored with it, in eval mode.
    Its checksum can be forged with it: the params are bounded and the architecture is built on
    the meta device, so the weights must match it before it takes any memory."""
    ckpt = load_checkpoint(path)
    try:
        model = fill(skeleton(ModelConfig(**ckpt["model_params"]), ckpt["channels"],
                              len(ckpt["classes"])), ckpt["model"])
    except (AttributeError, KeyError, TypeError, ValueError, RuntimeError) as e:
        why = str(e).splitlines()[0].removeprefix("params.yaml: ")  # ModelConfig's ParamsError
        raise CheckpointRefused(f"{path}: its weights do not fit the model params stored with "
                                f"it ({why}); rebuild it with `dvc repro train`") from None
    return model, ckpt
