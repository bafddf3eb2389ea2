"""Resumable training checkpoints: written atomically with a checksum, the newest usable one read
back; the run folders that hold them, and which of those this project may remove.

What goes into one is decided by the loop (`loop.checkpoint_state` and `loop.restore`); this
module only keeps the files safe.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

from stages.config import EVAL_DIR, EXPORT_DIR, PREPARED, TRAIN_DIR, ParamsError
from stages.lib.errors import StageWarning, UserError
from stages.lib.files import digest_path, save_torch_verified, verify_digest, write_json

# Everything a run folder ever holds: checkpoints, their checksums, the ownership record, and
# atomic_write's temp files of each. Removal deletes these and nothing else.
RUN_FILE = re.compile(r"(epoch-\d{4}\.(pt|sha256)|owner\.json)"
                      r"|\.(epoch-\d{4}|owner)\.[A-Za-z0-9_]+\.tmp\.(pt|sha256|json)")
RUN_KEY = re.compile(r"[0-9a-f]{16}")  # config.params_hash
# Unfinished runs of other params: the newest few are always kept (parallel queued experiments
# write theirs every epoch); older ones go once untouched this long.
KEEP_OTHER_RUNS = 3
STALE_RUN_S = 7 * 24 * 3600


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
            import torch  # here: the sweep's worker removes run folders without it

            state = torch.load(path, map_location="cpu", weights_only=True)
            state["path"] = str(path)
            return state
        except Exception as e:  # noqa: BLE001 - any unreadable checkpoint: fall back to the previous
            warnings.warn(f"checkpoint {path} is unusable ({type(e).__name__}: {e}); "
                          "falling back to an older one", StageWarning, stacklevel=2)
    if found:
        raise CheckpointError(f"no usable checkpoint among {', '.join(str(p) for p in found)}; "
                              "to start this run afresh, set train.resume: never")
    return None


def check_checkpoint_root(root: Path, workspace: Path, data_root: str) -> None:
    """Refuse a train.checkpoint_dir where run folders would sit beside files that are not
    runs: the repository or a folder above it, git's or DVC's folders, another repository, the
    pipeline's data and outputs, or a folder holding files git tracks."""
    root, workspace = root.resolve(), workspace.resolve()

    def refuse(why: str) -> None:
        raise ParamsError(f"params.yaml: train.checkpoint_dir resolves to {root}, which {why}; "
                          "give it a folder of its own, such as .checkpoints (the default)")

    if root == workspace or workspace.is_relative_to(root):
        refuse("is or contains this repository")
    if any(root.is_relative_to(workspace / d) for d in (".git", ".dvc")):
        refuse("is inside a folder git or DVC owns")
    if any((root / marker).exists() for marker in (".git", ".dvc", "dvc.yaml")):
        refuse("is another repository")
    for tracked in (PREPARED, TRAIN_DIR, EVAL_DIR, EXPORT_DIR, Path(data_root)):
        path = (workspace / tracked).resolve()
        if root.is_relative_to(path) or path.is_relative_to(root):
            refuse(f"overlaps {tracked}, a folder of the pipeline that DVC tracks")
    if root.is_relative_to(workspace) and root.is_dir():
        listed = subprocess.run(["git", "ls-files", "-z", "--", str(root)], cwd=workspace,
                                capture_output=True, text=True)
        if listed.returncode == 0 and listed.stdout:
            refuse(f"holds files git tracks ({listed.stdout.split(chr(0))[0]})")


def described(decisive: dict, meta: dict) -> dict:
    """What owner.json records of a run, for the note that names what another run differs in:
    the params that key it, and the data it trained on (the key holds the data's sha256; the
    source, channels and size say which data, the sha256's head any other change)."""
    return decisive | {f"data.{k}": meta.get(k) for k in ("source", "channels", "image_size")} \
        | {"data.sha256": str(meta.get("sha256"))[:12]}


def open_run_dir(run_dir: Path, workspace: Path, decisive: dict) -> None:
    """Claim a new run folder: owner.json, written before any checkpoint, is what later proves
    that this workspace made it (a shared checkpoint folder holds other projects' too)."""
    write_json(run_dir / "owner.json", {"made_by": "reprotrain train", "workspace": str(workspace),
                                        "key": run_dir.name, "params": decisive})


def owned(run_dir: Path, workspace: Path) -> bool:
    """True only for a run folder this workspace wrote: named by a params hash, its owner.json
    naming this workspace and that hash, and nothing in it but run files."""
    if run_dir.is_symlink() or not run_dir.is_dir() or not RUN_KEY.fullmatch(run_dir.name):
        return False
    if not all(RUN_FILE.fullmatch(p.name) and p.is_file() and not p.is_symlink()
               for p in run_dir.iterdir()):
        return False
    try:
        owner = json.loads((run_dir / "owner.json").read_text())
        return owner["workspace"] == str(workspace) and owner["key"] == run_dir.name
    except (OSError, ValueError, KeyError, TypeError):
        return False


def remove_run(run_dir: Path, workspace: Path) -> bool:
    """Delete a run folder file by file, only when `owned`; anything else is kept."""
    if not owned(run_dir, workspace):
        return False
    for p in run_dir.iterdir():
        p.unlink(missing_ok=True)
    run_dir.rmdir()
    return True


def _last_write(folder: Path) -> float:
    return max((p.stat().st_mtime for p in folder.iterdir()), default=folder.stat().st_mtime)


def tidy_other_runs(run_dir: Path, workspace: Path, decisive: dict) -> None:
    """Changed params start afresh in their own folder (so parallel queued experiments never
    mix). This workspace's unfinished runs of other params are kept to be resumed, the newest
    few always, older ones until untouched for STALE_RUN_S; one note names the newest and what
    differs. Folders it cannot prove it wrote are never touched."""
    if not run_dir.parent.is_dir():
        return
    others = sorted((d for d in run_dir.parent.iterdir() if d != run_dir and owned(d, workspace)),
                    key=_last_write, reverse=True)
    stale = [d for d in others[KEEP_OTHER_RUNS:] if time.time() - _last_write(d) > STALE_RUN_S]
    removed = [d for d in stale if remove_run(d, workspace)]
    kept = [d for d in others if d not in removed and any(d.glob("epoch-*.pt"))]
    if removed:
        print(f"note: removed {len(removed)} unfinished runs of other params untouched for "
              f"{STALE_RUN_S // 86400} days from {run_dir.parent}", file=sys.stderr)
    if kept:
        theirs = json.loads((kept[0] / "owner.json").read_text())["params"]
        diff = ", ".join(f"{k}: {theirs.get(k)!r} -> {v!r}" for k, v in decisive.items()
                         if theirs.get(k) != v)
        more = f" (and {len(kept) - 1} older)" if len(kept) > 1 else ""
        print(f"note: starting afresh; an unfinished run with other params is kept in "
              f"{kept[0]}{more} ({diff}). Restore those params to resume it.", file=sys.stderr)
