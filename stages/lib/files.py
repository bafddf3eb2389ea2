"""Atomic file writes: an output is either the old file or the complete new one, never half."""

from __future__ import annotations

import csv
import errno
import hashlib
import io
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

# What a write can meet that the user must fix: the cause and the fix, for one line.
WRITE_ERRORS = {
    errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file size limit reached (`ulimit -f`, or the file system's largest file)",
    errno.EACCES: "permission denied", errno.EPERM: "operation not permitted (an immutable or "
    "protected folder)", errno.EROFS: "read-only file system",
}


def write_error(e: BaseException, path: Path, scratch: bool = False) -> OSError | None:
    """The one-line OSError for a failed write of `path`, or None when the cause is not one of
    WRITE_ERRORS. Searches the chain: torch's zip writer turns an ENOSPC into a RuntimeError."""
    while e is not None and not (isinstance(e, OSError) and e.errno in WRITE_ERRORS):
        e = e.__context__ or e.__cause__
    if e is None:
        return None
    fix = {errno.ENOSPC: "Free space on the disk of {}", errno.EDQUOT: "Free space on the disk of {}",
           errno.EFBIG: "Raise the limit (`ulimit -f unlimited`) or move {} to another disk"
           }.get(e.errno, "Make {} writable for this user").format(path.parent)
    kept = "(a scratch file, removed)" if scratch else f"the previous {path.name}, if any, is intact"
    return OSError(e.errno, f"{WRITE_ERRORS[e.errno]} while writing {path}; {kept}. {fix} and rerun")


def atomic_write(path: str | Path, write: Callable[[Path], Any]) -> Path:
    """Call `write(tmp_path)`, fsync, then rename over `path` (same folder, so rename is atomic)."""
    path = Path(path)
    _replace_all([(_write_temp(path, write), path)])
    return path


def atomic_write_all(writes: dict[Path, Callable[[Path], Any]]) -> None:
    """atomic_write for files that belong together: every temp file is written before any is
    renamed, so a failed write leaves all the previous files as they were."""
    done: list[tuple[Path, Path]] = []
    try:
        for path, write in writes.items():
            done.append((_write_temp(Path(path), write), Path(path)))
    except BaseException:
        for tmp, _ in done:
            tmp.unlink(missing_ok=True)
        raise
    _replace_all(done)


def _replace_all(done: list[tuple[Path, Path]]) -> None:
    """Rename each temp file over its path. A rename fails too where the previous file is
    immutable or append-only (EPERM): the files renamed before it are put back from hard links
    of their previous versions, so a set stays the previous set, and no temp file is left."""
    kept: dict[Path, Path] = {}  # path -> its previous version under a second name
    renamed: list[Path] = []
    path = done[0][1]
    try:
        for _, path in done if len(done) > 1 else ():
            if path.exists():
                backup = path.with_name(f".{path.stem}.{os.urandom(4).hex()}.prev{path.suffix}")
                try:
                    os.link(path, backup)
                    kept[path] = backup
                except OSError:  # no hard links here, or the file is immutable: its rename says
                    pass
        for tmp, path in done:
            os.replace(tmp, path)
            renamed.append(path)
    except BaseException as e:
        for p in renamed:
            if p in kept:
                os.replace(kept.pop(p), p)
        for tmp, _ in done:
            tmp.unlink(missing_ok=True)
        for backup in kept.values():
            backup.unlink(missing_ok=True)
        if (error := write_error(e, path)) is not None:
            raise error from e
        raise
    for backup in kept.values():
        backup.unlink(missing_ok=True)


def _write_temp(path: Path, write: Callable[[Path], Any]) -> Path:
    """`write` into a synced temp file beside `path`; on failure, the temp is gone."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}",
                                    dir=path.parent)
        os.close(fd)
        tmp = Path(name)
        umask = os.umask(0)
        os.umask(umask)
        write(tmp)
        # After the write: mkstemp's 0600 would make outputs private, and a writer that
        # replaces the file (safetensors does) brings its own 0600 back.
        os.chmod(tmp, 0o666 & ~umask)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    except BaseException as e:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        if not isinstance(e, KeyboardInterrupt) and _interrupted(e):
            # Ctrl-C inside torch.save surfaces as its zip writer's RuntimeError
            # (inline_container.cc): keep it a Ctrl-C, so the run ends KILLED, not FAILED.
            raise KeyboardInterrupt from None
        if (error := write_error(e, path)) is not None:
            raise error from e
        raise
    return tmp


def _interrupted(e: BaseException | None) -> bool:
    while e is not None:
        if isinstance(e, KeyboardInterrupt):
            return True
        e = e.__context__
    return False


def file_hash(path: str | Path, algorithm: str = "sha256") -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, algorithm).hexdigest()


def digest_path(path: str | Path) -> Path:
    """The SHA-256 beside a file: `epoch-0003.pt` -> `epoch-0003.sha256`."""
    return Path(path).with_suffix(".sha256")


def save_torch_verified(path: str | Path, obj: Any) -> Path:
    """save_torch, then its SHA-256 beside it, as a pair (see `verified_writes`)."""
    atomic_write_all(verified_writes(path, obj))
    return Path(path)


def verified_writes(path: str | Path, obj: Any) -> dict[Path, Callable[[Path], Any]]:
    """For atomic_write_all: the torch file and its SHA-256, renamed last (a file without one
    was never finished); a failed checksum write keeps the previous file too."""
    digest = {}

    def write(p: Path) -> None:
        torch_writer(obj)(p)
        digest["sha256"] = file_hash(p)

    return {Path(path): write, digest_path(path): lambda p: p.write_text(digest["sha256"] + "\n")}


def verify_digest(path: str | Path) -> None:
    """Raises ValueError unless `path` matches the SHA-256 written beside it."""
    digest = digest_path(path)
    if not digest.exists():
        raise ValueError(f"checksum missing: no {digest} (its write never finished)")
    if digest.read_text().strip() != file_hash(path):
        raise ValueError(f"checksum mismatch with {digest} (truncated or corrupted)")


def json_text(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str) + "\n"


def write_json(path: str | Path, obj: Any) -> Path:
    return atomic_write(path, text_writer(json_text(obj)))


def write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, text_writer(text))


def text_writer(text: str | bytes) -> Callable[[Path], Any]:
    """The write of write_text (or of bytes), for atomic_write_all."""
    return lambda p: p.write_bytes(text) if isinstance(text, bytes) else p.write_text(text)


def csv_text(header: list[str], rows: Iterable[Sequence]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    return buf.getvalue()


def write_csv(path: str | Path, header: list[str], rows: Iterable[Sequence]) -> Path:
    return write_text(path, csv_text(header, rows))


def save_torch(path: str | Path, obj: Any) -> Path:
    """torch.save, atomically. Through a file object: given a path, torch names the archive's
    inner folder after the (random) temp file, and identical data would hash differently."""
    return atomic_write(path, torch_writer(obj))


def torch_writer(obj: Any) -> Callable[[Path], None]:
    """The write of save_torch, for atomic_write_all."""

    import torch  # here: a command that writes JSON, not tensors (the sweep's), needs none

    def write(p: Path) -> None:
        with open(p, "wb") as f:
            torch.save(obj, f)

    return write
