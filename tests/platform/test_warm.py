"""The warm process (reprotrain/warm.py): a stage forked from it runs the caller's code in the
caller's folder, writes the bytes a cold stage writes, and goes when its caller goes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import uuid
from pathlib import Path

import pytest

from reprotrain import warm
from tests.conftest import ROOT, VENV_BIN, copy_params, copy_repo, env_with, run
from tests.support.workspaces import interruptible, one_error_line, wait_for_checkpoint, workspace

TINY = {"epochs": "3", "model.width": "8"}


def serving(sock: Path) -> bool:
    """Whether a warm process answers at `sock` (a socket file can outlive its process)."""
    import socket

    with socket.socket(socket.AF_UNIX) as s:
        return s.connect_ex(str(sock)) == 0


def socket_of(cwd: Path, env: dict) -> Path:
    """The warm process's socket for a stage run in `cwd` with `env`."""
    return Path(run([sys.executable, "-c", "from reprotrain.warm import socket_path; "
                     "print(socket_path())"], cwd, env).stdout.strip())


def warmed(cwd: Path, env: dict) -> Path:
    """The warm process for this environment, serving: started by a second stage, as in a
    pipeline (the first only marks its environment as seen)."""
    sock = socket_of(cwd, env)
    for _ in range(2):
        if not serving(sock):
            run([sys.executable, "-m", "stages.params"], cwd, env)
    deadline = time.time() + 180
    while not serving(sock):
        assert time.time() < deadline, f"no warm process at {sock}"
        time.sleep(0.2)
    return sock


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def stage_processes(folder: Path) -> list[int]:
    """Python processes working in `folder`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cwd").resolve() == folder.resolve() \
                    and b"python" in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:
            pass
    return found


def test_a_warm_pipeline_writes_the_bytes_a_cold_one_writes(tmp_path, mlflow_uri):
    repo = copy_repo(tmp_path / "repo", TINY)
    timings = tmp_path / "timings.jsonl"
    env = env_with(MLFLOW_TRACKING_URI=mlflow_uri, REPROTRAIN_TIMINGS=str(timings))
    run(["dvc", "repro"], repo, env_with(**env, REPROTRAIN_WARM="0"))
    assert {r["stage"]: r["warm"] for r in records(timings)} == dict.fromkeys(
        ["params", "prepare", "train", "evaluate", "export"], False)
    outputs = sorted(p for p in (repo / "models").rglob("*") if p.is_file()
                     and p.name != "run.json")  # run.json names the MLflow run: never the same
    cold = {p: p.read_bytes() for p in [*outputs, repo / "dvc.lock"]}

    warmed(repo, env)
    timings.unlink()
    run(["dvc", "repro", "--force"], repo, env)
    assert {r["stage"]: r["warm"] for r in records(timings)} == dict.fromkeys(
        ["params", "prepare", "train", "evaluate", "export"], True)
    assert sorted(p for p in (repo / "models").rglob("*") if p.is_file()
                  and p.name != "run.json") == outputs
    changed = [str(p.relative_to(repo)) for p, b in cold.items() if p.read_bytes() != b]
    assert changed == []  # dvc.lock too: a forced warm rerun is byte for byte the cold run


def test_a_warm_stage_runs_the_callers_code_and_ends_as_a_cold_one_does(tmp_path):
    repo = copy_repo(tmp_path / "repo")
    env = env_with()
    warmed(repo, env)
    params = repo / "stages/params.py"
    params.write_text(params.read_text().replace(
        'if __name__ == "__main__":', 'print("edited in this checkout")\n\nif __name__ == "__main__":'))
    assert "edited in this checkout" in run([sys.executable, "-m", "stages.params"], repo, env).stdout
    (repo / "params.yaml").write_text((repo / "params.yaml").read_text().replace("lr: 0.003", "lr: -1"))
    both = [run([sys.executable, "-m", "stages.params"], repo, env_with(**env, REPROTRAIN_WARM=w),
                check=False) for w in ("0", "1")]
    assert [p.returncode for p in both] == [1, 1]
    assert both[0].stderr == both[1].stderr and "lr" in one_error_line(both[1].stderr)


def test_ctrl_c_reaches_a_warm_stage_and_sigkill_takes_it_with_its_caller(tmp_path, digits,
                                                                         mlflow_uri):
    w = workspace(tmp_path / "w", digits, epochs="40", batch_size="16")
    env = env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri)
    warmed(w, env)

    def train() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=w, env=env,
                                text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True, preexec_fn=interruptible)
    proc = train()
    wait_for_checkpoint(proc, w)
    assert [p for p in stage_processes(w) if p != proc.pid]  # the stage runs in another process
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends: the whole group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted (Ctrl-C)" in one_error_line(err)

    proc = train()  # the stage itself killed (the OOM killer): its caller ends the same way
    wait_for_checkpoint(proc, w, epoch=3)
    (stage,) = [p for p in stage_processes(w) if p != proc.pid]
    os.kill(stage, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL and "Traceback" not in err, err

    proc = train()  # resumes, then its caller is killed as `kill -9` or a CI timeout would
    wait_for_checkpoint(proc, w, epoch=5)
    proc.kill()
    proc.wait()
    deadline = time.time() + 10
    while stage_processes(w):
        assert time.time() < deadline, f"left running: {stage_processes(w)}"
        time.sleep(0.1)


def test_only_what_imports_read_decides_which_warm_process_serves(monkeypatch):
    before = warm.key()
    for name, value in {"DVC_ROOT": "/elsewhere", "MLFLOW_TRACKING_URI": "http://x",
                        "AWS_SECRET_ACCESS_KEY": "s", "SLURM_JOB_ID": "7",
                        # a login's, terminal's, editor's session (issue 42.7, second pass)
                        "SSH_CONNECTION": "10.0.0.1 5 10.0.0.2 22", "TMUX_PANE": "%3",
                        "XDG_SESSION_ID": "4", "VSCODE_GIT_IPC_HANDLE": "/run/x.sock",
                        "GPG_TTY": "/dev/pts/3", "WINDOWID": "7", "INVOCATION_ID": "ab"}.items():
        monkeypatch.setenv(name, value)  # they name a run: the same warm process serves it
    assert warm.key() == before
    for name in ("_PYTHON_SYSCONFIGDATA_NAME", "TEMPLATE_PATH", "PATHEXT"):  # no family of those
        with monkeypatch.context() as m:
            m.setenv(name, "x")
            assert warm.key() != before, name
    threads = str(int(os.environ.get("OMP_NUM_THREADS", "1")) + 1)
    monkeypatch.setenv("OMP_NUM_THREADS", threads)  # read as torch loads: another warm process
    assert warm.key() != before


def test_no_socket_in_a_folder_others_can_enter(monkeypatch):
    import tempfile

    tmp_path = Path(tempfile.mkdtemp())  # short: pytest's folders are too long for a socket
    try:
        folder = tmp_path / "var/reprotrain-warm"
        folder.mkdir(parents=True, mode=0o755)
        folder.chmod(0o755)
        monkeypatch.setattr(sys, "prefix", str(tmp_path))
        with pytest.raises(PermissionError, match="not this user's alone"):
            warm.socket_path()
        folder.chmod(0o700)
        assert warm.socket_path().parent == folder
    finally:
        shutil.rmtree(tmp_path)


def test_a_lone_stage_starts_no_warm_process_and_a_second_one_does(tmp_path):
    repo = copy_repo(tmp_path / "repo")
    env = env_with(WARM_TEST_RUN=uuid.uuid4().hex)  # an environment no warm process has served
    sock = socket_of(repo, env)
    run([sys.executable, "-m", "stages.params"], repo, env)
    time.sleep(2)
    assert not serving(sock) and not [p for p in Path("/proc").glob("[0-9]*/cmdline")
                                      if str(sock).encode() in p.read_bytes()]
    run([sys.executable, "-m", "stages.params"], repo, env)  # within IDLE_S: now it is worth one
    assert not serving(sock)  # it runs cold, the warm process imports in the background
    # The next stage that imports torch, at once: it waits for the imports under way rather
    # than do them again beside them.
    timings = tmp_path / "timings.jsonl"
    run([sys.executable, "-m", "stages.prepare"], repo, env_with(**env, REPROTRAIN_TIMINGS=str(timings)))
    assert [r["warm"] for r in records(timings)] == [True]
    run([sys.executable, "-u", "-m", "stages.params"], repo,  # an option it would not have
        env_with(**env, REPROTRAIN_TIMINGS=str(timings)))
    assert [r["warm"] for r in records(timings)] == [True, False]
    # Its 1 GB serves no other. A SIGTERM amid callers lands mostly inside os.fork, whose hooks
    # once swallowed the exit (the CI failure of the session-stop test below).
    callers = threading.Event()
    threading.Thread(target=lambda: [serving(sock) for _ in iter(callers.is_set, True)],
                     daemon=True).start()
    time.sleep(1)
    os.kill(int(sock.with_suffix(".pid").read_text()), signal.SIGTERM)
    deadline = time.time() + 30
    try:
        while sock.exists() or sock.with_suffix(".pid").exists():  # it takes its files with it
            assert time.time() < deadline, "a SIGTERM amid callers left the warm process serving"
            time.sleep(0.1)
    finally:
        callers.set()


# A params stage that reports what its process inherited, as a user's own code in a stage would
# see it: the variables the warm process's imports set, its seeds, flags and name.
PROBE = '''
import importlib, json, multiprocessing, os, sys
from reprotrain.warm import PRELOAD
from stages.lib.cli import in_warm_child
for name in PRELOAD:  # a cold process imports what the warm one has: both then set the same
    importlib.import_module(name)
import torch
torch.compiler.reset()  # what AdamW's first step does: TORCHINDUCTOR_CACHE_DIR from the TMPDIR
def opened():
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # listdir's own, closed
            pass
    return found
print("probe:" + json.dumps({
    "env": {k: v for k, v in os.environ.items() if k.startswith(("TORCHINDUCTOR_", "KMP_"))},
    "seed": torch.initial_seed(), "rand": torch.rand(1).item(), "safe_path": sys.flags.safe_path,
    "comm": open("/proc/self/comm").read().strip(), "warm": in_warm_child(),
    "authkey": multiprocessing.current_process().authkey.hex(),
    "policy": os.sched_getscheduler(0), "ionice": os.popen(f"ionice -p {os.getpid()}").read(),
    "opened": opened()}))
'''


@pytest.fixture(scope="module")
def probe_repo(tmp_path_factory) -> tuple[Path, dict]:
    """A checkout whose params stage is PROBE, and an environment of its own: its warm process
    serves only this module's tests. Outside pytest, as a user's stage runs."""
    repo = copy_repo(tmp_path_factory.mktemp("probe") / "repo")
    params = repo / "stages/params.py"
    params.write_text(params.read_text().replace('if __name__ == "__main__":',
                                                 f'{PROBE}\nif __name__ == "__main__":'))
    return repo, {k: v for k, v in env_with(WARM_TEST_RUN=uuid.uuid4().hex).items()
                  if k != "PYTEST_CURRENT_TEST"}


def probe(repo: Path, env: dict, warm_: bool = True, prefix: tuple[str, ...] = ()) -> dict:
    out = run([*prefix, sys.executable, "-m", "stages.params"], repo,
              {**env, "REPROTRAIN_WARM": "1" if warm_ else "0"}).stdout
    return json.loads(out.split("probe:")[1].splitlines()[0])


def short_tmp() -> Path:
    """A folder whose path fits a socket's (pytest's own are too long for the warm folder's)."""
    import tempfile

    return Path(tempfile.mkdtemp())


def test_a_warm_stage_derives_what_imports_set_from_its_own_callers_temp_folder(probe_repo):
    # Issue 42.1: the warm process's imports set TORCHINDUCTOR_CACHE_DIR from its first caller's
    # TMPDIR, and a later caller's warm export failed once that folder was gone. A warm stage
    # derives it, as a cold one, from its own caller's.
    repo, env = probe_repo
    first, later = short_tmp(), short_tmp()
    try:
        sock = warmed(repo, {**env, "TMPDIR": str(first)})
        shutil.rmtree(first)
        first.write_text("no longer a folder")
        warm_, cold = (probe(repo, {**env, "TMPDIR": str(later)}, w) for w in (True, False))
        assert serving(sock) and warm_["warm"] and not cold["warm"]
        assert warm_["env"]["TORCHINDUCTOR_CACHE_DIR"].startswith(f"{later}/")
        assert warm_["env"] == cold["env"]
    finally:
        first.unlink(missing_ok=True)
        shutil.rmtree(later)


def test_shell_prompts_and_an_activated_venv_share_the_warm_process_of_make_and_dvc(tmp_path):
    # Issue 42.7 / 41.7: `make repro` and then `dvc exp run` in an activated venv started two.
    env = env_with()
    plain = socket_of(ROOT, env)
    activated = run(["bash", "-c", f'. "{VENV_BIN}/activate" && export PS1 && python -c '
                     '"from reprotrain.warm import socket_path; print(socket_path())"'],
                    ROOT, env).stdout.strip()
    (tmp_path / "Makefile").write_text(
        f"all:\n\t@cd {ROOT} && python -c 'from reprotrain.warm import socket_path; "
        "print(socket_path())'\n")
    made = run(["make", "-s", "-C", str(tmp_path)], ROOT, env).stdout.strip()
    assert activated == made == str(plain)


def test_a_warm_process_ends_soon_after_its_checkout_is_deleted(tmp_path):
    # Issue 41.7: a sweep worker's warm process outlived its deleted clone by 5 minutes.
    repo = copy_repo(tmp_path / "repo")
    sock = warmed(repo, env_with(WARM_TEST_RUN=uuid.uuid4().hex))
    pid = int(sock.with_suffix(".pid").read_text())
    shutil.rmtree(repo)
    deadline = time.time() + 30
    while Path(f"/proc/{pid}").exists() and str(sock).encode() in \
            Path(f"/proc/{pid}/cmdline").read_bytes():
        assert time.time() < deadline, "the warm process outlived its checkout"
        time.sleep(0.2)
    assert not sock.exists()


def test_a_test_session_stops_the_warm_processes_its_tests_started_and_no_other(tmp_path):
    # Issue 41.7: README's `pytest -m "not slow"` left two warm processes behind.
    repo = copy_repo(tmp_path / "repo")
    shutil.copytree(ROOT / "tests", repo / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    nested = uuid.uuid4().hex
    (repo / "tests/test_starts_one.py").write_text(
        "from tests.conftest import ROOT, env_with\nfrom tests.platform.test_warm import warmed\n\n\n"
        f"def test_starts_one():\n    warmed(ROOT, env_with(WARM_TEST_RUN='{nested}'))\n")
    started = socket_of(repo, env_with(WARM_TEST_RUN=nested))
    users = {k: v for k, v in env_with(WARM_TEST_RUN=uuid.uuid4().hex).items()
             if k != "REPROTRAIN_TEST_SESSION"}  # as from a shell, not from this session
    own = warmed(repo, users)
    run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/test_starts_one.py"], repo, env_with())
    deadline = time.time() + 30
    while serving(started) or started.with_suffix(".pid").exists():  # its files go with it
        assert time.time() < deadline, "the session left its warm process running"
        time.sleep(0.2)
    assert serving(own)  # the user's own warm process serves on
    os.kill(int(own.with_suffix(".pid").read_text()), signal.SIGTERM)


def test_a_warm_process_holds_its_lock_alone_and_a_second_leaves_at_once(probe_repo):
    # One warm process per key: its lock (filelock's flock, taken without waiting). A stage forked
    # from it must not hold the lock's descriptor (filelock's at-fork hook closes it in the
    # child; serve once closed it itself): a stage that outlived its warm process would keep the
    # key locked, and no other warm process could start for it until that stage ended.
    repo, env = probe_repo
    sock = warmed(repo, env)
    lock, pid = os.path.realpath(sock.with_suffix(".lock")), int(sock.with_suffix(".pid").read_text())
    held = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            held.append(os.readlink(fd))
    assert lock in held
    stage = probe(repo, env)
    assert stage["warm"] and lock not in stage["opened"], stage["opened"]
    second = subprocess.run([sys.executable, warm.__file__, "serve", str(sock)], cwd=repo, env=env,
                            capture_output=True, text=True, timeout=60)
    assert second.returncode == 0 and second.stdout == "", second
    assert serving(sock) and int(sock.with_suffix(".pid").read_text()) == pid


def test_a_warm_stage_shows_its_own_name(probe_repo):
    repo, env = probe_repo
    sock = warmed(repo, env)
    pid = int(sock.with_suffix(".pid").read_text())
    assert Path(f"/proc/{pid}/comm").read_text().strip() == "reprotrain-warm"
    assert probe(repo, env)["comm"] == "stages.params"  # as `top` and `ps -e` show it


def test_the_first_start_says_what_it_is_and_how_to_turn_it_off_on_a_terminal(tmp_path):
    import pty

    repo = copy_repo(tmp_path / "repo")
    env = env_with(WARM_TEST_RUN=uuid.uuid4().hex)
    sock = socket_of(repo, env)
    run([sys.executable, "-m", "stages.params"], repo, env)  # a lone stage starts none
    leader, follower = pty.openpty()
    try:
        subprocess.run([sys.executable, "-m", "stages.params"], cwd=repo, env=env,
                       stdout=subprocess.DEVNULL, stderr=follower, check=True, timeout=120)
        os.close(follower)
        try:
            said = os.read(leader, 4096).decode()
        except OSError:  # EIO: the terminal closed with nothing written
            said = ""
    finally:
        os.close(leader)
    assert "warm process" in said and "REPROTRAIN_WARM=0" in said and len(said.splitlines()) == 1
    deadline = time.time() + 180
    while not sock.with_suffix(".pid").exists():
        assert time.time() < deadline
        time.sleep(0.2)
    os.kill(int(sock.with_suffix(".pid").read_text()), signal.SIGTERM)


def test_a_warm_stage_draws_its_own_seeds_and_passes_no_interpreter_flags_on(probe_repo):
    # Issue 42.5: children had the warm process's torch seed, and sys.flags.safe_path (-P).
    repo, env = probe_repo
    warmed(repo, env)
    one, two = probe(repo, env), probe(repo, env)
    assert one["seed"] != two["seed"] and one["rand"] != two["rand"]
    assert one["authkey"] != two["authkey"]  # multiprocessing's, which its workers check
    assert one["safe_path"] is two["safe_path"] is False


def test_ctrl_z_stops_a_warm_stage_and_fg_resumes_it(tmp_path, digits, mlflow_uri):
    # Issue 42.6: Ctrl-Z stopped the caller while the stage trained on.
    w = workspace(tmp_path / "w", digits, epochs="40", batch_size="16")
    env = env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri)
    warmed(w, env)
    proc = subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=w, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            # a job of this session, as a shell makes one: the kernel does not
                            # stop a group without a parent in the session (an orphaned one)
                            process_group=0, preexec_fn=interruptible)
    try:
        wait_for_checkpoint(proc, w)
        (stage,) = [p for p in stage_processes(w) if p != proc.pid]

        def state(pid: int) -> str:
            return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]

        def wait_for(pid: int, stopped: bool) -> None:
            deadline = time.time() + 10
            while (state(pid) == "T") != stopped:
                assert time.time() < deadline, f"{pid} is {state(pid)}"
                time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTSTP)  # what Ctrl-Z in a terminal sends: the whole group
        wait_for(proc.pid, stopped=True)
        wait_for(stage, stopped=True)
        os.killpg(proc.pid, signal.SIGCONT)  # `fg`
        wait_for(stage, stopped=False)
        wait_for_checkpoint(proc, w, epoch=3)  # and it trains on
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_changed_sitecustomize_starts_another_warm_process(tmp_path, digits, mlflow_uri):
    # Issue 55.5: the key covered PYTHONPATH but not the files Python runs as it starts, and a
    # warm train ran the sitecustomize it started with, since changed: another model.pt than cold.
    w = workspace(tmp_path / "w", digits)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("")
    env = env_with(PYTHONPATH=f"{site}:{ROOT}", MLFLOW_TRACKING_URI=mlflow_uri)
    sock = warmed(w, env)
    (site / "sitecustomize.py").write_text("import torch\ntorch.set_default_dtype(torch.float64)\n")
    try:
        models = []
        for warm_ in ("1", "0"):
            run([sys.executable, "-m", "stages.train"], w, env_with(**env, REPROTRAIN_WARM=warm_))
            models.append((w / "models/train/model.pt").read_bytes())
        assert models[0] == models[1]
    finally:
        os.kill(int(sock.with_suffix(".pid").read_text()), signal.SIGTERM)


def test_the_pth_files_are_part_of_the_key_by_content(tmp_path):
    # Issue 55.5: an edit that keeps a .pth file's size and mtime still starts another.
    pth = tmp_path / "a.pth"
    pth.write_text("import os; os.environ.setdefault('X', '0')\n")
    before, stat = warm.startup_files([str(tmp_path)]), pth.stat()
    pth.write_text("import os; os.environ.setdefault('X', '1')\n")
    os.utime(pth, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert warm.startup_files([str(tmp_path)]) != before
    assert sysconfig.get_paths()["purelib"] in warm.site_folders()  # this venv's, which runs them


@pytest.mark.skipif(not (shutil.which("chrt") and shutil.which("ionice")), reason="needs util-linux")
def test_a_stage_keeps_its_callers_scheduling_policy_and_io_class(probe_repo, tmp_path):
    # Issue 55.6: `chrt -i 0 ionice -c3 python -m stages.train` ran its warm stage as SCHED_OTHER
    # with I/O class none. (The batch policy here, not idle: idle starves on a busy machine; the
    # key takes any policy.)
    repo, env = probe_repo
    warmed(repo, env)
    assert probe(repo, env)["warm"]
    under = probe(repo, env, prefix=("chrt", "--batch", "0", "ionice", "-c3"))
    assert (under["policy"], under["ionice"].strip()) == (os.SCHED_BATCH, "idle")
    # `chrt -R`: a warm process started from there would run at the policy reset: always cold
    copy_params(tmp_path)
    reset = ("chrt", "-R", "--batch", "0")
    env = env_with(PYTHONPATH=str(ROOT), WARM_TEST_RUN=uuid.uuid4().hex)
    sock = Path(run([*reset, sys.executable, "-c", "from reprotrain.warm import socket_path; "
                     "print(socket_path())"], tmp_path, env).stdout.strip())
    for _ in range(2):  # the second would start one
        run([*reset, sys.executable, "-m", "stages.params"], tmp_path, env)
    assert not sock.with_suffix(".seen").exists() and not sock.with_suffix(".pid").exists()
