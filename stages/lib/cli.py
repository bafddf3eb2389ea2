"""How a stage runs as a command: one-line errors and exit codes, a fast exit, timings for the
pipeline bench, and argparse helpers.

Nothing here writes or changes an output, so no stage lists this module in dvc.yaml: editing
an error message or a CLI helper reruns nothing (tests/experiment/test_dvc_yaml.py keeps it that way).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time
import typing
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from stages.lib.errors import KILLED_WORKER, StageWarning, UserError, worker_died

# Where a stage's time goes, for `python -m reprotrain.bench.training --pipeline`: seconds in MLflow calls
# (imports included) and in the training loop; the rest of `main` is the stage's own work.
STAGE_TIMES = {"tracking_s": 0.0, "loop_s": 0.0}
# Libraries that cost a second or more to import: which of them a stage loaded (names looked up
# in sys.modules; tests/test_private_names.py checks that each still exists).
HEAVY_IMPORTS = ("sklearn", "scipy", "torch.onnx", "mlflow", "matplotlib", "onnxruntime",
                 "torchvision")


# A finished stage's exit status, read by the exit handler that runs last (end_finished in
# reprotrain/warm.py, registered as `stages` is imported), which then skips the teardown.
finished: int | None = None
_timing: set[str] = set()  # phases being timed: a nested `timed` of the same phase adds nothing


@contextmanager
def timed(phase: str) -> Iterator[None]:
    if phase in _timing:
        yield
        return
    start = time.perf_counter()
    _timing.add(phase)
    try:
        yield
    finally:
        _timing.discard(phase)
        STAGE_TIMES[phase] += time.perf_counter() - start


python_format = warnings.formatwarning


def one_line_warning(message, category, filename, lineno, line=None) -> str:
    """This project's warnings (StageWarning) as one line, like its errors; another library's
    keep Python's form, whose file and line a bug report needs."""
    if issubclass(category, StageWarning):
        return f"warning: {message}\n"
    return python_format(message, category, filename, lineno, line)


def run_stage(main: Callable[[], None]) -> None:
    """A stage's entry point: a user error, a missing input or a full disk ends it with one
    line that says what to do; a warning is one line too."""
    entered = time.time()
    warnings.formatwarning = one_line_warning
    if os.environ.get("DVC_EXP_BASELINE_REV"):  # set by `dvc exp run`, for every stage it runs
        restat_stale_git_entries()
    try:
        main()
    except (UserError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    except BrokenPipeError:
        if not stdout_gone():
            raise
        # Its reader stopped early (`| head`): the end a tool killed by SIGPIPE has, quietly.
        # Stdout then points at /dev/null, so the exit's flush of what is left fails no more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(128 + signal.SIGPIPE)
    except KeyboardInterrupt:
        # Ctrl-C is a choice, not a crash: one line, and the shell's 130.
        print("error: interrupted (Ctrl-C); outputs are unchanged or complete, never half "
              "written; rerun to continue (training resumes from its last checkpoint)",
              file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    except RuntimeError as e:
        if not worker_died(e):
            raise
        sys.exit(f"error: {str(e).strip().rstrip('.')}; {KILLED_WORKER}")
    except OSError as e:
        from stages.lib.files import WRITE_ERRORS

        if e.errno not in WRITE_ERRORS:
            raise
        sys.exit(f"error: {e.strerror}" + (f": {e.filename}" if e.filename else ""))
    if os.environ.get("REPROTRAIN_TIMINGS"):  # set by the pipeline bench, with the spawn time
        record = {"stage": Path(sys.argv[0]).stem, "main_s": time.time() - entered,
                  "warm": in_warm_child(),
                  "startup_s": entered - float(os.environ.get("REPROTRAIN_T0", entered)),
                  **STAGE_TIMES, "imported": [m for m in HEAVY_IMPORTS if m in sys.modules]}
        with open(os.environ["REPROTRAIN_TIMINGS"], "a") as f:
            f.write(json.dumps(record) + "\n")
    # Without the interpreter's teardown, which spends 1-2 s per stage freeing torch's and
    # MLflow's modules and writes nothing: every output is already closed and renamed.
    global finished
    finished = 0
    sys.exit(0)


def in_warm_child() -> bool:
    """Whether this process is a stage forked from a warm process (reprotrain/warm.py serve)."""
    return len(sys.orig_argv) > 3 and Path(sys.orig_argv[-3]).name == "warm.py" \
        and sys.orig_argv[-2] == "serve"


def restat_stale_git_entries() -> None:
    """Make git look again at each tracked file whose content is not what git's index holds.

    `dvc exp run` stashes the workspace, resets it to HEAD and restores it within a second
    (scmrepo), and leaves git's index holding HEAD's blob beside the restored file's stat. Git
    compares whole seconds and sizes, so where the sizes agree it takes the file as unchanged:
    `git status` hides the experiment's change and `git checkout -- FILE` restores nothing,
    also after the experiment failed or was refused. An mtime a whole second away from the one
    git recorded makes git hash the file again; the content is left as it is."""
    def git(*args: str, stdin: bytes = b"") -> bytes:
        return subprocess.run(["git", *args], input=stdin, capture_output=True, check=True,
                              timeout=60).stdout
    try:
        entries = [e.split(b"\t", 1) for e in git("ls-files", "--stage", "-z").split(b"\0") if e]
        files = [(meta.split(b" ")[1], path) for meta, path in entries
                 if meta.startswith((b"100644 ", b"100755 ")) and b"\n" not in path
                 and os.path.isfile(path)]
        hashed = git("hash-object", "--stdin-paths", stdin=b"\n".join(p for _, p in files)).split()
    except (OSError, subprocess.SubprocessError, IndexError):
        return  # not a git checkout, or git unusable: there is no index to mislead
    for (blob, path), content in zip(files, hashed, strict=True):
        if blob != content:
            later = max(time.time(), os.stat(path).st_mtime_ns // 10**9 + 1)
            os.utime(path, (later, later))


def stdout_gone() -> bool:
    """Whether stdout is a pipe nobody reads any more (poll says POLLERR), rather than some
    other pipe or socket that broke."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # no stdout, or not a file
        return False


STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def stop_on_signals() -> None:
    """SIGTERM (`kill`, systemd, or make passing its own on), SIGHUP (a closed terminal) and
    SIGQUIT (Ctrl-\\) stop a long-running command as Ctrl-C does: a KeyboardInterrupt, so that
    its `finally` stops the servers it started in sessions of their own, which Python's default
    death would leave running. Only the first of them: `kill` of make's whole group reaches this
    process twice (make passes its SIGTERM on), and a second, or a Ctrl-C after a SIGTERM, would
    cut the first one's clean-up short."""
    def interrupt(signum, frame) -> None:
        for sig in STOPS:
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt

    for sig in STOPS:
        signal.signal(sig, interrupt)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, like every other error (exit code 2)."""

    def error(self, message: str) -> typing.NoReturn:
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


