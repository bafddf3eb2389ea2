"""Resumable training checkpoints: written atomically with a checksum, the newest usable one read back.

What goes into one is decided by the loop (`loop.checkpoint_state` and `loop.restore`); this
module only keeps the files safe.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from stages.config import UserError
from stages.files import digest_path, save_torch_verified, verify_digest


class CheckpointError(UserError, RuntimeError):
    pass


def save_checkpoint(state: dict, ckpt_dir: Path, epoch: int, keep: int = 2) -> Path:
    """Atomic (temp file, then rename) with a checksum beside it; the last `keep` are kept."""
    path = ckpt_dir / f"epoch-{epoch:04d}.pt"
    save_torch_verified(path, state)
    for old in sorted(ckpt_dir.glob("epoch-*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
        digest_path(old).unlink(missing_ok=True)
    return path


def latest_checkpoint(ckpt_dir: Path) -> dict | None:
    """The newest checkpoint that verifies and loads; a broken one is skipped with a warning.
    None when there is none; an error when there are some but none is usable: a silent restart
    from scratch would throw away the run."""
    for stale in ckpt_dir.glob(".*.tmp.pt"):  # left by a kill mid-write: never used, removed
        stale.unlink(missing_ok=True)
    found = sorted(ckpt_dir.glob("epoch-*.pt"), reverse=True)
    for path in found:
        try:
            verify_digest(path)
            state = torch.load(path, map_location="cpu", weights_only=True)
            state["path"] = str(path)
            return state
        except Exception as e:  # noqa: BLE001 - any unreadable checkpoint: fall back to the previous
            warnings.warn(f"checkpoint {path} is unusable ({type(e).__name__}: {e}); "
                          "falling back to an older one", stacklevel=2)
    if found:
        raise CheckpointError(f"no usable checkpoint among {', '.join(str(p) for p in found)}; "
                              "to start this run afresh, set train.resume: never")
    return None
