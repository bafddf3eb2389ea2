"""A warm process for the pipeline's stages: torch, MLflow and the exporter imported once, and
each stage forked from it with the caller's arguments, folder, environment and streams.

DVC runs every stage as `python -m stages.<name>`, a fresh process that imports torch, MLflow
and, in train and export, torch's compiler and ONNX's exporter again: 2 to 6 s a stage, more
than the training loop of a small experiment. So a stage that finds a warm process connects to
it over a unix socket, and it forks a child that runs the stage. One that finds none runs as it
always did, and starts one in the background if another stage came for it within IDLE_S: a
pipeline's second stage does, a lone command never pays for a warm process it would not use. One
that finds it still importing waits for it (wait_for_start). The caller waits, forwards its
signals (Ctrl-C, SIGTERM, Ctrl-Z) to the child, and ends with the child's status; a caller
killed with SIGKILL takes the child with it. A stage runs the same code either
way, and writes the same bytes (tests/platform/test_warm.py).

Only libraries are imported ahead, never this project's code: a child imports `stages` from
the caller's checkout, so an edited stage runs as edited. A warm process serves only callers
that would have imported those libraries alike: the same interpreter and installed packages,
the files Python runs as it starts (`sitecustomize`, `usercustomize`, `.pth`), this file, user,
namespaces, cgroup, CPU affinity, nice value, scheduling policy, I/O priority, resource limits
and environment (less the variables that name a run: DVC's, MLflow's tracking URI and logins, S3
keys, SLURM's). Any difference starts another. It exits after IDLE_S seconds without a caller,
or once the checkout it runs from is gone. `REPROTRAIN_WARM=0` turns it off; distributed workers
(torchrun's) and a caller under `chrt -R` always run cold.

Standard library only (and filelock, for its lock), and run as a script (`python warm.py serve
...`, its folder taken off sys.path at once), so that the warm process holds no module of the
checkout that happened to start it. Not with `python -P`: a child would inherit
sys.flags.safe_path, and pass -P on to the Python processes it starts (multiprocessing, torch's
compile workers), as a fresh stage does not.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # before any other import: stages/lib must not shadow a module
    del sys.path[0]

import contextlib
import hashlib
import json
import os
import resource
import select
import shutil
import signal
import socket
import struct
import subprocess
import sysconfig
import time
import typing
from pathlib import Path

# The pipeline's stages; `python -m stages.predict` and the team's tools always run cold.
STAGES = {f"stages.{s}" for s in ("params", "prepare", "train", "evaluate", "export")}
# What the stages import that costs seconds: torch, MLflow with its sqlite store and pyfunc
# flavour, torch.export and the ONNX exporter with its op library, the stratified split's
# scikit-learn. Not matplotlib (0.3 s): its import reads ./matplotlibrc and the user's, which
# must be the caller's folder and HOME, not this one's. Not torch's compiler either: only a
# private module loads it, and its config derives a debug folder from the working folder;
# AdamW's first step imports it in the child (1.1 s).
PRELOAD = ("numpy", "torch", "omegaconf", "torch.export", "torch.onnx",
           "onnxscript", "onnxscript.function_libs.torch_lib.ops", "mlflow", "mlflow.pyfunc",
           "mlflow.store.tracking.sqlalchemy_store", "sklearn.model_selection",
           "safetensors.torch")
# And one cache: MLflow's map of installed packages, which export's `log_model` reads (every
# package's file list: 0.5-2 s) to check the served model's requirements. It depends only on
# the installed packages, which are part of the key. Private to MLflow (no public way to fill
# it): skipped if it moved; tests/test_private_names.py pins it.
PREWARM = (("mlflow.utils.requirements_utils", "_init_packages_to_modules_map"),)
IDLE_S = 300.0
# How long a stage waits for a warm process still importing before it imports for itself: a
# warm start takes about 10 s on an idle 2-core machine, several times that under load.
START_WAIT_S = 60.0
# Variables read when used, never as a library loads: a caller may differ in them and still be
# served (a child runs with the caller's environment). Everything else in the environment is
# part of the warm process's key; of MLflow's, only the two its import reads. Families by their
# prefix, the rest by exact name: a prefix as short as `TEMP` or `_` would exempt variables no
# one listed (`_PYTHON_SYSCONFIGDATA_NAME`, which imports read).
RUN_FAMILIES = ("DVC_", "REPROTRAIN_", "GIT_", "MAKE", "CELERY_", "SLURM_", "AWS_", "PG",
                "PYTEST_", "MLFLOW_", "_MLFLOW_", "_OLD_VIRTUAL_",
                # a login's, a terminal's and an editor's session: each ssh, tmux pane or IDE
                # terminal differs in them
                "SSH_", "TMUX", "XDG_SESSION_", "VSCODE_", "TERM_SESSION_")
RUN_NAMES = {"MFLAGS", "VENV", "PATH", "TMPDIR", "TEMP", "TMP", "PWD", "OLDPWD", "SHLVL", "_",
             "COLUMNS", "LINES", "GPG_TTY", "WINDOWID", "INVOCATION_ID", "STY", "WINDOW",
             # a shell's prompt and an activated venv's marks (`. .venv/bin/activate`): no
             # library reads them, and make/DVC and the user's shell differ in them
             "PS1", "PS2", "PS3", "PS4", "PROMPT_COMMAND", "VIRTUAL_ENV", "VIRTUAL_ENV_PROMPT",
             # set by a stage for the processes it starts; read by CUDA and Inductor when used
             "CUBLAS_WORKSPACE_CONFIG", "TORCHINDUCTOR_CACHE_DIR"}
IMPORT_VARIABLES = ("MLFLOW_CONFIGURE_LOGGING", "MLFLOW_LOGGING_LEVEL", "MLFLOW_DISABLE_TELEMETRY")
# Set by an import to a value of its process alone (MLflow's telemetry session): never handed on.
PER_PROCESS = ("_MLFLOW_TELEMETRY_SESSION_ID",)
# Ctrl-Z (SIGTSTP) and `fg`/`bg` (SIGCONT) too: job control stops and resumes the stage as cold.
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
           signal.SIGUSR2, signal.SIGTSTP, signal.SIGCONT)
# How often an idle warm process checks that the checkout it runs from is still there.
TICK_S = 5.0
HEADER = struct.Struct("!I")


# A finished stage's exit status: set, the last exit handler ends the process with it.
_finished: int | None = None


def finish(code: int) -> typing.NoReturn:
    """Exit with `code` as usual (threads joined, exit handlers run), then skip the teardown."""
    global _finished
    _finished = code
    sys.exit(code)


def end_finished() -> None:
    """The first exit handler registered, so the last to run (atexit's order is last in, first
    out): once a stage has finished, end the process here, before the interpreter frees its
    modules. logging's handler runs after this one where logging was imported first: its
    shutdown is called here. A stage run here, not in a warm process, finished through
    stages/lib/cli.py's run_stage, which records its status there."""
    code = _finished if _finished is not None else \
        getattr(sys.modules.get("stages.lib.cli"), "finished", None)
    if code is None:
        return
    if "logging" in sys.modules:
        sys.modules["logging"].shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:  # None: started with the stream closed
                stream.flush()
        except BrokenPipeError:
            code = 120  # what the interpreter returns when its final flush fails
        except (OSError, ValueError):
            pass
    os._exit(code)


def hand_off_stage() -> None:
    """`import stages` calls this first (stages/__init__.py). For `python -m stages.<stage>`:
    the exit handler that runs last, registered before any library registers its own (it ends a
    finished stage without the interpreter's teardown), then the hand-off below."""
    if sys.argv[:1] != ["-m"] or "-m" not in sys.orig_argv:
        return
    import atexit

    atexit.register(end_finished)
    module = sys.orig_argv[sys.orig_argv.index("-m") + 1]
    if module.count(".") == 1:
        hand_off(module)


def hand_off(module: str) -> None:
    """Called as `python -m <module>` starts: run it in the warm process and exit with its
    status, or return (start one for the next stage, where none serves) to run it here."""
    # Interpreter options (`python -u -m ...`, -O, -W, -X) would not reach the warm process.
    if module not in STAGES or os.environ.get("REPROTRAIN_WARM", "1") == "0" \
            or "TORCHELASTIC_RUN_ID" in os.environ or sys.orig_argv[1:2] != ["-m"]:
        return
    try:
        # `chrt -R`: a warm process started from here would run at the default policy, not this
        if os.sched_getscheduler(0) & os.SCHED_RESET_ON_FORK:
            return
        path = socket_path()
        # params imports no torch: cold, it is done before any wait would be.
        conn = connect(path) or (wait_for_start(path) if module != "stages.params" else None)
        if conn is None:
            seen = path.with_suffix(".seen")
            if seen.exists() and time.time() - seen.stat().st_mtime < IDLE_S:
                first = not path.with_suffix(".log").exists()  # for this environment
                start(path)
                if first and sys.stderr.isatty():  # for the person at a terminal, not a log
                    sys.stderr.write(
                        "note: started a warm process (torch and MLflow imported once, about "
                        "1 GB) that runs the next stages and exits after 5 idle minutes; "
                        "REPROTRAIN_WARM=0 runs every stage cold (docs/pipeline.md)\n")
            else:
                seen.touch()
            return
    except (OSError, AttributeError, ValueError, subprocess.SubprocessError):
        return  # no private folder, a read-only venv, not Linux: run cold
    ignored = [s for s in SIGNALS if signal.getsignal(s) == signal.SIG_IGN]
    forwarded = sorted(set(SIGNALS) - set(ignored))
    # Held from the request on: a Ctrl-C before the stage started waits for the forwarders.
    signal.pthread_sigmask(signal.SIG_BLOCK, forwarded)
    with conn:
        try:
            request = {"module": module, "argv": sys.argv[1:], "cwd": os.getcwd(),
                       "env": dict(os.environ), "path": sys.path, "umask": os.umask(0o22),
                       "ignored": ignored}
            os.umask(request["umask"])
            payload = json.dumps(request).encode()
            socket.send_fds(conn, [HEADER.pack(len(payload))], [0, 1, 2])
            conn.sendall(payload)
            if conn.recv(1) != b"+":  # the warm process could not take it: nothing ran
                signal.pthread_sigmask(signal.SIG_UNBLOCK, forwarded)
                return
        except (OSError, ValueError):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, forwarded)
            return

        def forward(sig: int, _frame: object) -> None:
            with contextlib.suppress(OSError):
                conn.send(bytes([sig]))
            if sig == signal.SIGTSTP:  # stopped too, as the shell's job control expects
                signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)  # returns once continued (SIGCONT, forwarded too)
                signal.signal(sig, forward)
        for sig in forwarded:
            signal.signal(sig, forward)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, forwarded)
        status = recv_exactly(conn, 4)
        if len(status) < 4:  # the warm process died under the stage
            sys.stderr.write("error: the stage's warm process ended without its status; "
                             "rerun, or set REPROTRAIN_WARM=0 to run stages cold\n")
            os._exit(1)
    code = os.waitstatus_to_exitcode(struct.unpack("!i", status)[0])
    if code < 0:  # killed by a signal: end the same way, as DVC and the shell expect
        with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


def wait_for_start(path: Path) -> socket.socket | None:
    """A connection to the warm process that an earlier stage started and that is still
    importing, once it serves; None if there is none, it ends, or START_WAIT_S pass. Its
    imports are mostly done by then: importing them all again here (a cold train or export)
    would take longer, and on two cores would slow both down."""
    try:
        pid = int(path.with_suffix(".pid").read_text())
    except (OSError, ValueError):
        return None
    cmdline = Path(f"/proc/{pid}/cmdline")
    deadline = time.monotonic() + START_WAIT_S
    try:
        while time.monotonic() < deadline:
            try:  # a pid file may outlive its process (SIGKILL), the pid be another's since
                if str(path).encode() not in cmdline.read_bytes():
                    return None
            except OSError:
                return None
            conn = connect(path)
            if conn is not None:
                return conn
            time.sleep(0.1)
    except KeyboardInterrupt:  # Ctrl-C while waiting: end as a stage killed by it does
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return None


def socket_path() -> Path:
    """The socket for this caller's key, in a folder of this user's only, inside the venv (one
    place for every checkout and HOME that uses it; never a guessable name in /tmp)."""
    folder = Path(sys.prefix) / "var" / "reprotrain-warm"
    folder.parent.mkdir(mode=0o700, exist_ok=True)
    folder.mkdir(mode=0o700, exist_ok=True)
    st = folder.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{folder} is not this user's alone")
    path = folder / f"{key()}.sock"
    if len(os.fsencode(path)) > 100:  # a socket's path holds 107 bytes
        raise OSError(f"{path} is too long for a socket")
    return path


def key() -> str:
    """What a forked child inherits from the warm process instead of from its caller."""
    def read(p: str) -> str:
        try:
            return os.readlink(p) if p.startswith("/proc/self/ns/") else Path(p).read_text()
        except OSError:
            return ""
    site = sysconfig.get_paths()["purelib"]
    parts = [sys.executable, sys.prefix, sys.version, sys.flags, sys._xoptions, sys.warnoptions,
             os.stat(site).st_mtime_ns,
             hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
             os.getuid(), os.getgid(), sorted(os.getgroups()), sorted(os.sched_getaffinity(0)),
             [read(f"/proc/self/ns/{n}") for n in ("net", "mnt", "user", "ipc", "uts", "pid")],
             read("/proc/self/cgroup"), os.getpriority(os.PRIO_PROCESS, 0),
             # inherited by the warm process from the caller that starts it, as the nice value
             os.sched_getscheduler(0), os.sched_getparam(0), io_priority(),
             startup_files(site_folders()),
             [resource.getrlimit(getattr(resource, n)) for n in dir(resource)
              if n.startswith("RLIMIT_")],
             sorted((k, v) for k, v in os.environ.items()
                    if k in IMPORT_VARIABLES or not (k in RUN_NAMES or k.startswith(RUN_FAMILIES))),
             # MLflow's import turns its telemetry off under pytest (a variable that names
             # the test, so only whether it is set)
             "PYTEST_CURRENT_TEST" in os.environ]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:20]


# ioprio_get(2) has no libc wrapper and Python no binding: the raw syscall, by this machine's
# number (x86_64's table; aarch64 and riscv64 share the generic one). Elsewhere the I/O
# priority is no part of the key.
IOPRIO_GET = {"x86_64": 252, "aarch64": 31, "riscv64": 31}


def io_priority() -> int | None:
    """This process's I/O scheduling class and level (`ionice`'s), None where unknown."""
    import ctypes

    number = IOPRIO_GET.get(os.uname().machine)
    if number is None:
        return None
    value = ctypes.CDLL(None, use_errno=True).syscall(  # IOPRIO_WHO_PROCESS, this process
        ctypes.c_long(number), ctypes.c_long(1), ctypes.c_long(0))
    return None if value < 0 else value


def site_folders() -> list[str]:
    """The folders whose `.pth` files Python runs as it starts."""
    import site

    return [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE
                                       else [])]


def startup_files(folders: list[str]) -> list[tuple[str, str]]:
    """What ran as this interpreter started, before any stage code: the `.pth` files of
    `folders`, and `sitecustomize` and `usercustomize` where they were found. By content, not
    size and mtime: they are a few small files, read in microseconds, and an edit that keeps the
    size within the file system's clock tick (a flag from 0 to 1) would keep size and mtime.
    What they import in turn is not followed, but for installed packages (the site folder's
    mtime in the key)."""
    files = [p for folder in folders for p in sorted(Path(folder).glob("*.pth"))]
    files += [Path(m.__file__) for m in map(sys.modules.get, ("sitecustomize", "usercustomize"))
              if getattr(m, "__file__", None)]
    return [(str(p), hashlib.sha256(p.read_bytes()).hexdigest()) for p in files]


def connect(path: Path) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
    except OSError:
        conn.close()
        return None
    if not same_user(conn):
        conn.close()
        return None
    return conn


def same_user(conn: socket.socket) -> bool:
    """Whether the process at the other end of `conn` runs as this user (SO_PEERCRED)."""
    return struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1] \
        == os.getuid()


def recv_exactly(conn: socket.socket, size: int) -> bytes:
    """`size` bytes from `conn`, or fewer if it closes first."""
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def start(path: Path) -> None:
    """A warm process for this key, in the background, in a session of its own and without the
    caller's streams (a pipe it held open would keep the caller's reader waiting). Files of
    keys unused for a day go first: every environment once seen leaves its log and mark."""
    for old in path.parent.glob("*.*"):
        with contextlib.suppress(OSError):
            if old.suffix in (".log", ".seen") and time.time() - old.stat().st_mtime > 86400:
                old.unlink()
            elif old.suffix == ".tmp" and time.time() - old.stat().st_mtime > 86400:
                shutil.rmtree(old)  # left by a warm process killed with SIGKILL
    log = os.fdopen(os.open(path.with_suffix(".log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT
                            | os.O_NOFOLLOW, 0o600), "ab")
    with log:
        subprocess.Popen([sys.executable, __file__, "serve", str(path)],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd="/",
                         start_new_session=True)  # in no caller's folder: it outlives them


def serve(path: Path) -> None:
    """Import the libraries, then fork a child per caller until IDLE_S pass without one."""
    from filelock import FileLock, Timeout

    # Held until this process exits. A child forked below holds none of it: filelock's at-fork
    # hook closes the lock's descriptor in the child (tests/platform/test_warm.py checks it),
    # which a stage that outlived this process would keep locked: no second one could start.
    lock = FileLock(path.with_suffix(".lock"), mode=0o600)  # opened O_NOFOLLOW, as flock
    try:
        lock.acquire(blocking=False)
    except Timeout:
        return  # another caller started one first
    started, owner = time.monotonic(), os.getpid()
    set_name("reprotrain-warm")
    # Stoppable, with its files, from the moment it is one: `make test` may stop it mid-import.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    pid_file = path.with_suffix(".pid")  # what `make test` stops: never a stage forked from it
    pid_file.write_text(f"{os.getpid()}\n")
    own_tmp = path.with_suffix(".tmp")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mine = None
    try:
        set_by_imports = warm_up(own_tmp)
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            print("warm: an import initialized CUDA; not serving", flush=True)
            return
        tmp = path.with_suffix(f".{os.getpid()}")
        tmp.unlink(missing_ok=True)
        server.bind(str(tmp))
        mine = os.stat(tmp).st_ino
        server.listen(64)
        os.replace(tmp, path)  # callers find it only once everything is imported
        print(f"warm: serving {path.name} {time.monotonic() - started:.1f} s after start",
              flush=True)
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the children reap themselves
        # From here a SIGTERM only wakes the loop: raised amid callers it lands mostly inside
        # os.fork, whose at-fork hooks swallow exceptions, and the process would serve on.
        wake, woken = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(woken)
        signal.signal(signal.SIGTERM, lambda *_: None)
        last = time.monotonic()
        while True:
            ready = select.select([server, wake], [], [], TICK_S)[0]
            if wake in ready:
                break
            if not ready:
                # Idle; or the checkout it runs from was deleted (a sweep worker's clone):
                # nothing there can call it again.
                if time.monotonic() - last > IDLE_S or not os.path.exists(__file__):
                    break
                continue
            last = time.monotonic()
            conn, _ = server.accept()
            if os.fork() == 0:
                signal.set_wakeup_fd(-1)
                server.close()
                for fd in (wake, woken):  # the lock's: closed by filelock as it forked
                    os.close(fd)
                for sig in (signal.SIGCHLD, signal.SIGTERM):
                    signal.signal(sig, signal.SIG_DFL)
                try:
                    run_for(conn, set_by_imports, str(own_tmp))
                except SystemExit:
                    if _finished is None:
                        os._exit(1)
                    raise  # the stage's process, done: out through the interpreter's exit
                except BaseException:
                    sys.excepthook(*sys.exc_info())  # into the log
                os._exit(1)
            conn.close()
    finally:
        server.close()  # no caller connects to a process on its way out
        if os.getpid() == owner:  # not a stage's process leaving through these frames
            with contextlib.suppress(OSError):
                if os.stat(path).st_ino == mine:
                    path.unlink()
            for suffix in (".seen", ".pid", ".lock"):  # the log stays: a line per start
                path.with_suffix(suffix).unlink(missing_ok=True)
            shutil.rmtree(own_tmp, ignore_errors=True)


def warm_up(own_tmp: Path) -> dict[str, str]:
    """Import the libraries; return what the imports set in the environment (scikit-learn's
    KMP_* switches), which a cold stage passes on too."""
    import importlib

    # CUDA cannot cross a fork: an import that asks whether there is a GPU asks NVML instead.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    # The imports get a temp folder of this process's own, not its first caller's (TMPDIR is no
    # part of the key): what they derive from it (Inductor's cache folder) a child gets with
    # its caller's temp folder in this one's place, as a cold import would have derived it.
    own_tmp.mkdir(mode=0o700, exist_ok=True)
    os.environ["TMPDIR"] = str(own_tmp)
    before = dict(os.environ)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    for module, function in PREWARM:
        with contextlib.suppress(Exception):
            getattr(sys.modules[module], function)()
    return {k: v for k, v in os.environ.items() if before.get(k) != v and k not in PER_PROCESS}


def run_for(conn: socket.socket, set_by_imports: dict[str, str], tmp: str) -> None:
    """In a fork per caller: the stage in a child of its own, its signals forwarded, its status
    sent back; the stage is killed with its process group if the caller goes."""
    if not same_user(conn):
        return
    header, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
    if len(header) != HEADER.size or len(fds) != 3:
        return
    (size,) = HEADER.unpack(header)
    payload = recv_exactly(conn, size)
    if len(payload) < size:
        return
    request = json.loads(payload)
    if not os.path.isdir(request["cwd"]):
        conn.send(b"-")
        return
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        conn.close()
        stage(request, fds, set_by_imports, tmp, parent)
    try:
        with contextlib.suppress(OSError):  # its own group from the start, whichever runs first
            os.setpgid(pid, pid)
        for fd in fds:
            os.close(fd)
        child = os.pidfd_open(pid)  # Linux 5.3: on an older kernel the caller runs cold
        conn.send(b"+")
        while True:
            ready = select.select([conn, child], [], [])[0]
            if child in ready:
                conn.send(struct.pack("!i", os.waitpid(pid, 0)[1]))
                return
            signals = conn.recv(64)
            if not signals:  # the caller is gone: so is its stage, as a killed process group
                raise ConnectionError("the caller is gone")
            for sig in signals:  # to the stage, as they reached its caller
                if sig in (signal.SIGTSTP, signal.SIGCONT):  # as the terminal stops a whole
                    os.killpg(pid, sig)  # job: what the stage started stops with it
                else:
                    os.kill(pid, sig)
    except BaseException:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            conn.send(b"-")  # before "+": nothing ran, the caller runs cold
        raise


def stage(request: dict, fds: list[int], set_by_imports: dict[str, str], tmp: str,
          parent: int) -> typing.NoReturn:
    """The stage, as `python -m module` would run it in the caller's place; ends in finish()."""
    import ctypes

    # Gone with the process that watches it for its caller, however that one ends.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)
    import random
    import runpy
    import tempfile

    set_name(request["module"])  # `stages.train` in `top` and `ps -e`, as far as 15 bytes go
    with contextlib.suppress(OSError):  # its own group: what it starts goes with it
        os.setpgid(0, 0)
    for fd, std in zip(fds, (0, 1, 2), strict=True):
        os.dup2(fd, std)
        os.close(fd)
    if not (sys.stdout.write_through or sys.stdout.line_buffering):
        sys.stdout.reconfigure(line_buffering=sys.stdout.isatty())
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # found again from the caller's TMPDIR
    callers_tmp = tempfile.gettempdir()
    for k, v in set_by_imports.items():
        os.environ.setdefault(k, v.replace(tmp, callers_tmp))
    sys.path[:] = request["path"]
    sys.argv[:] = ["-m", *request["argv"]]
    for sig in SIGNALS:  # as the caller had them: Python's Ctrl-C, or ignored (`nohup`, `&`)
        signal.signal(sig, signal.SIG_IGN if sig in request["ignored"] else
                      signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    # A fresh process's randomness: seeds of its own, as each import draws them, never the warm
    # process's. (String hashes keep the warm process's: docs/pipeline.md.)
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(int.from_bytes(os.urandom(8), "little"))
    if "multiprocessing" in sys.modules:  # the key a fresh process's workers authenticate with
        sys.modules["multiprocessing"].current_process().authkey = os.urandom(32)
    if "mlflow.telemetry" in sys.modules:  # a session of its own, or the caller's, as cold
        with contextlib.suppress(Exception):
            sys.modules["mlflow.telemetry"].set_telemetry_client()
    code: object = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as Python ends on an uncaught Ctrl-C
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    # Out through the frames the fork left (serve cleans up in the warm process only) to the
    # interpreter's exit, whose last handler, end_finished, skips the teardown.
    finish(code or 0)


def set_name(name: str) -> None:
    """The name `top`, `ps -e` and `pgrep` show (the process's comm, at most 15 bytes); the
    command line stays the warm process's: changing it needs a package the lock lacks."""
    import ctypes

    ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    import atexit

    atexit.register(end_finished)  # before the imports register theirs: it runs last
    serve(Path(sys.argv[2]))
