"""models/train/model.pt, the trained model: train writes it; evaluate, export, predict and
bench/serving.py read it. Its format is `TrainedModel`, here and nowhere else.

The file describes itself: the weights of the uncompiled module, plus all it takes to rebuild
and feed the model. Nothing run-specific (run id, timings): the same params, seed and machine
give the same bytes, so a rerun leaves dvc.lock unchanged. Its SHA-256 goes beside it
(model.sha256), and every read verifies it.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stages.config import ModelConfig
from stages.lib.errors import UserError
from stages.lib.files import verified_writes, verify_digest
from stages.models import fill, skeleton


class CheckpointRefused(UserError, ValueError):
    pass


@dataclass(frozen=True, kw_only=True)
class TrainedModel:
    weights: dict[str, torch.Tensor]  # the state_dict of the uncompiled module
    model_params: dict  # params.yaml's `model` section, as a dict
    classes: list[str]  # class names, in output order
    mean: list[float]  # per channel, of the training split: (x - mean) / std
    std: list[float]
    channels: int
    image_size: int
    resize: str  # how prepare brought images to image_size
    best_epoch: int

    @property
    def arch(self) -> str:
        return self.model_params["arch"]

    def spec(self) -> dict:
        """What a runner needs to feed the model, as export's model.json states it."""
        return {"arch": self.arch, "model_params": self.model_params, "classes": self.classes,
                "mean": self.mean, "std": self.std,
                "input_shape": [self.channels, self.image_size, self.image_size],
                "resize": self.resize}


def writes(path: Path, model: nn.Module, model_cfg: ModelConfig, meta: dict,
           best_epoch: int) -> dict[Path, Callable[[Path], Any]]:
    """model.pt and its checksum, for files.atomic_write_all with the results that go with them.
    `meta`: the prepared data's meta.json (classes, normalization, image geometry)."""
    trained = TrainedModel(weights=model.state_dict(), model_params=dataclasses.asdict(model_cfg),
                           classes=meta["classes"], mean=meta["mean"], std=meta["std"],
                           channels=meta["channels"], image_size=meta["image_size"],
                           resize=meta["resize"], best_epoch=best_epoch)
    return verified_writes(path, _to_file(trained))


def load(path: Path) -> tuple[nn.Module, TrainedModel]:
    """The model rebuilt from the params stored with it, in eval mode. Its checksum can be
    forged with it: the params are bounded and the architecture is built on the meta device, so
    the weights must match it before it takes any memory."""
    stored = _read(path)
    try:
        trained = TrainedModel(**{f.name: stored[_KEYS.get(f.name, f.name)]
                                  for f in dataclasses.fields(TrainedModel)})
        model = fill(skeleton(ModelConfig(**trained.model_params), trained.channels,
                              len(trained.classes), trained.image_size), trained.weights)
    except (AttributeError, KeyError, TypeError, ValueError, RuntimeError) as e:
        why = str(e).splitlines()[0].removeprefix("params.yaml: ")  # ModelConfig's ParamsError
        raise CheckpointRefused(f"{path}: its weights do not fit the model params stored with "
                                f"it ({why}); rebuild it with `dvc repro train`") from None
    return model, trained


_KEYS = {"weights": "model"}  # field -> key in the file, where they differ


def _to_file(trained: TrainedModel) -> dict:
    return {_KEYS.get(f.name, f.name): getattr(trained, f.name)
            for f in dataclasses.fields(TrainedModel)}


def _read(path: Path) -> dict:
    """Verified against its SHA-256 (a damaged file would evaluate silently to a wrong figure),
    then weights_only=True: the file is data; a pickle that runs code is refused, no fallback."""
    try:
        verify_digest(path)
        return torch.load(path, map_location="cpu", weights_only=True)
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
