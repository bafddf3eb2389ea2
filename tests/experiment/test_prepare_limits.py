"""prepare on a limited or shared machine: killed (kill -9, the OOM killer), in a memory cgroup
(a container, a SLURM job), under a process limit, on a small disk, twice at once. Real
cgroups, real `prlimit`, a real small file system; each skips, saying why, where this machine
has none to give."""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import ROOT, env_with, run, set_params
from tests.support.image_files import make_folder, noise_folder
from tests.support.workspaces import folder_workspace, one_error_line

MiB = 2**20
# A stage run cold, in the process the test starts: a warm process would run it outside the
# cgroup or limit the test puts it in. One thread for the libraries' pools, so that the tasks a
# process-count limit counts are the same on any machine.
COLD = {"REPROTRAIN_WARM": "0", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT)}
PREPARE = [sys.executable, "-m", "stages.prepare"]


def children(pid: int) -> set[int]:
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.add(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_killed_prepare_takes_its_workers_along_and_its_rerun_removes_its_scratch(tmp_path):
    """kill -9 (as the OOM killer kills) of prepare while its 2 workers decode: the workers die
    with it, and the pipe of its stdout ends (`prepare | cat` returns); the next run, in the
    format the refusal advises, removes the scratch files the killed one left."""
    w = folder_workspace(tmp_path / "w")
    noise_folder(w / "raw", 40)
    set_params(w / "params.yaml", {"data.format": "tensors", "data.channels": "3",
                                   "data.image_size": "256", "data.store_size": "256"})
    p = subprocess.Popen(PREPARE, cwd=w, env=env_with(**COLD), stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while len(workers := children(p.pid)) < 2:
            assert p.poll() is None and time.monotonic() < deadline, "prepare ended first"
            time.sleep(0.01)
        os.kill(p.pid, signal.SIGKILL)  # prepare alone, not its process group
        p.wait()
        ended, left = False, workers
        deadline = time.monotonic() + 10
        while (not ended or left) and time.monotonic() < deadline:
            if select.select([p.stdout], [], [], 0.1)[0]:  # what `| cat` waits for: EOF
                ended = not os.read(p.stdout.fileno(), 65536)
            left = {pid for pid in workers if alive(pid)}
        assert ended and not left, f"workers {left} outlived prepare, holding its stdout"
    finally:
        for pid in workers:  # by id: only those this test saw start
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        p.stdout.close()
    prep = w / "data/prepared"
    assert list(prep.glob(".*.npy")), "the killed run was meant to leave its scratch files"
    set_params(w / "params.yaml", {"data.format": "shards"})
    run(PREPARE, w, env=env_with(**COLD))
    assert not list(prep.glob(".*.npy")) and (prep / "train/index.npy").exists()


def test_a_store_size_below_the_image_size_is_refused_where_shards_may_be_written():
    from stages.config import ParamsError, check_params

    for fmt in ("auto", "shards"):
        with pytest.raises(ParamsError, match=re.escape(
                "params.yaml: data.store_size=256 is invalid: below data.image_size 512, shards "
                "would keep every image smaller than training reads it, to be upsampled; set "
                "data.store_size to 512 or more")):
            check_params({"data": {"source": "folder", "format": fmt, "image_size": 512}})
    assert check_params({"data": {"source": "folder", "format": "tensors",
                                  "image_size": 512}}).data.store_size == 256


@contextmanager
def cgroup(controller: str, settings: dict[str, str], parent: Path | None = None) -> Iterator[Path]:
    """A new cgroup (v1) of `controller` inside `parent`, or inside this process's own, with
    `settings` written; removed after, its processes (this test's) killed first."""
    try:
        if parent is None:
            own = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text()
                       .splitlines() if controller in line.split(":")[1].split(","))
            parent = Path("/sys/fs/cgroup", controller, own.lstrip("/"))
        folder = parent / f"reprotrain-test-{os.urandom(4).hex()}"
        folder.mkdir()
    except (OSError, StopIteration) as e:
        pytest.skip(f"no {controller} cgroup (v1) can be made here: {e}")
    try:
        for name, value in settings.items():
            (folder / name).write_text(value)
        yield folder
    finally:
        for _ in range(100):
            for pid in (folder / "cgroup.procs").read_text().split():
                os.kill(int(pid), signal.SIGKILL)
            try:
                folder.rmdir()
                break
            except OSError:
                time.sleep(0.05)


def in_cgroup(folder: Path, cmd: list[str]) -> list[str]:
    """`cmd` run in the cgroup: a shell that moves itself there, then becomes `cmd`."""
    return ["sh", "-c", f'echo $$ > {folder}/cgroup.procs && exec "$@"', "sh", *cmd]


def test_the_memory_left_is_the_least_that_any_enclosing_cgroup_leaves():
    """cgroup_memory_left reads /proc/PID/cgroup and mountinfo, then each memory cgroup from the
    process's own up: a 1 GiB cgroup inside a 200 MiB one leaves about 200 MiB."""
    from stages.prepare import cgroup_folders, cgroup_memory_left

    with cgroup("memory", {"memory.limit_in_bytes": str(200 * MiB)}) as outer, \
            cgroup("memory", {"memory.limit_in_bytes": str(1024 * MiB)}, outer) as inner:
        sleeper = subprocess.Popen(in_cgroup(inner, ["sleep", "60"]))
        try:
            deadline = time.monotonic() + 10
            while str(sleeper.pid) not in (inner / "cgroup.procs").read_text().split():
                assert time.monotonic() < deadline
                time.sleep(0.01)
            proc = Path(f"/proc/{sleeper.pid}")
            assert cgroup_folders("memory", proc)[:2] == [inner, outer]
            left = cgroup_memory_left(proc)
        finally:
            sleeper.kill()
            sleeper.wait()
    assert 180 * MiB < min(left) <= 200 * MiB, [n / MiB for n in left]
    assert 800 * MiB < left[0] <= 1024 * MiB, [n / MiB for n in left]


def test_prepare_in_a_memory_cgroup_sizes_the_splits_against_its_limit(tmp_path):
    """In a 1 GiB cgroup on a host of many GiB: 300 images of 3 MiB decoded are shards for
    `auto` (the host's memory would have said tensors), and refused, said first, as tensors."""
    from stages.prepare import memory_available

    n, limit = 300, 1024 * MiB
    assert n * 3 * MiB < memory_available() / 2, "the host must have room for them"
    w = folder_workspace(tmp_path / "w")
    make_folder(w / "raw", n // 3, bad=False)
    set_params(w / "params.yaml", {"data.channels": "3", "data.image_size": "1024",
                                   "data.store_size": "1024"})
    said = {}
    with cgroup("memory", {"memory.limit_in_bytes": str(limit)}) as folder:
        for fmt in ("tensors", "auto"):
            set_params(w / "params.yaml", {"data.format": fmt})
            said[fmt] = run(in_cgroup(folder, PREPARE), w, env=env_with(**COLD), check=False)
    line = one_error_line(said["tensors"].stderr)
    available = float(re.search(r"more than the ([\d.]+) GiB of memory available", line)[1])
    assert said["tensors"].returncode == 1 and "raw: decoded at data.image_size 1024, the 300 " \
        "images take 0.9 GiB" in line and available < 1, line
    out = said["auto"].stdout
    assert said["auto"].returncode == 0 and re.match(
        r"data\.format: auto -> shards: decoded, the splits take 900 MiB, over half of the "
        r"0\.\d GiB of memory available", out), out + said["auto"].stderr
    assert (w / "data/prepared/train/index.npy").exists()


def test_workers_past_the_cores_are_refused_in_one_line():
    from stages.config import ParamsError, check_params, worker_bound

    cores = len(os.sched_getaffinity(0))
    assert worker_bound()[0] == cores or os.getuid() != 0
    for key in ("data", "train"):
        with pytest.raises(ParamsError, match=re.escape(
                f"params.yaml: {key}.num_workers=1000 is invalid: at most {cores} here (the CPU "
                "cores this process may use); use auto or fewer")):
            check_params({key: {"num_workers": 1000}})
        assert getattr(check_params({key: {"num_workers": cores}}), key).num_workers == cores


def test_workers_past_the_process_limit_are_refused_in_one_line_naming_it(tmp_path):
    """Under `prlimit --nproc=2`, as root of a user namespace of its own (a rootless
    container's; the machine's root forks past the limit) where prepare is the one process (one
    thread): data.num_workers: 2 is refused before anything forks."""
    if not shutil.which("unshare") or subprocess.run(
            ["unshare", "--user", "--map-root-user", "true"], capture_output=True).returncode:
        pytest.skip("runs prepare in a user namespace of its own: `unshare --user` is refused here")
    w = folder_workspace(tmp_path / "w")
    make_folder(w / "raw", 10, bad=False)
    set_params(w / "params.yaml", {"data.num_workers": "2"})
    p = run(["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child",
             "--mount-proc", "prlimit", "--nproc=2", *PREPARE], w, env=env_with(**COLD),
            check=False, timeout=300)
    assert p.returncode == 1 and one_error_line(p.stderr) == "error: params.yaml: " \
        "data.num_workers=2 is invalid: at most 1 here (`ulimit -u` is 2, and this user runs 1 " \
        "processes and threads already); use auto or fewer", p.stderr


def test_a_fork_refused_by_the_process_limit_ends_prepare_in_one_line_leaving_no_worker(tmp_path):
    """A pids cgroup (`docker --pids-limit`, SLURM) with room for prepare and one worker of
    its 2: one line, exit 1, and not one process left in the cgroup."""
    w = folder_workspace(tmp_path / "w")
    make_folder(w / "raw", 10, bad=False)
    with cgroup("pids", {"pids.max": "2"}) as folder:  # prepare's one thread, one worker
        p = run(in_cgroup(folder, PREPARE), w, env=env_with(**COLD), check=False, timeout=300)
        left = (folder / "cgroup.procs").read_text().split()
    assert p.returncode == 1 and one_error_line(p.stderr) == "error: could not start 2 worker " \
        "processes (Resource temporarily unavailable): the process or memory limit (`ulimit -u`, " \
        "a container's) is reached; set data.num_workers lower in params.yaml", p.stderr
    assert not left, f"processes {left} outlived prepare"


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="mounts a small tmpfs in a mount namespace of its own: needs root")
def test_shards_that_outgrow_the_disk_when_re_encoded_name_the_shard_and_the_fix(tmp_path):
    """JPEGs at quality 5, larger than data.store_size, are stored downsized at quality 95:
    several times their files' bytes, which the disk check counts. The full disk is one line
    naming the shard and what to do, and the half-written shard is removed."""
    from PIL import Image

    w = folder_workspace(tmp_path / "w")
    noise_folder(w / "raw", 20)
    for f in (w / "raw").rglob("*.jpg"):
        Image.open(f).save(f, quality=5)
    files = sum(f.stat().st_size for f in (w / "raw").rglob("*.jpg"))
    set_params(w / "params.yaml", {"data.format": "shards", "data.channels": "3",
                                   "data.store_size": "200", "data.image_size": "32"})
    (w / "data").mkdir()
    size_kb = files // 1024 + 256
    # data/ on a tmpfs seen by this command alone (unshare's private propagation), listed after.
    p = run(["unshare", "--mount", "sh", "-c", f'mount -t tmpfs -o size={size_kb}k tmpfs data && '
             '{ "$0" -m stages.prepare; rc=$?; ls -a data/.prepared.partial/train; exit $rc; }',
             sys.executable], w, env=env_with(**COLD), check=False)
    assert p.returncode == 1 and re.fullmatch(
        r"error: disk full while writing data/\.prepared\.partial/train/\.shard-\d{6}\.tar\.tmp; "
        r"\(a scratch file, removed\)\. Free space on the disk of data/\.prepared\.partial/train "
        r"and rerun", one_error_line(p.stderr)), p.stderr
    assert ".." in p.stdout and ".tmp" not in p.stdout, p.stdout  # listed, no half shard


def test_a_second_prepare_in_the_same_folder_is_refused_while_the_first_runs(tmp_path):
    w = folder_workspace(tmp_path / "w")
    noise_folder(w / "raw", 40)
    set_params(w / "params.yaml", {"data.format": "shards", "data.channels": "3",
                                   "data.shard_mb": "1"})
    first = subprocess.Popen(PREPARE, cwd=w, env=env_with(**COLD), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list((w / "data/.prepared.partial").glob("train/.shard-*.tmp")):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.01)
        first.send_signal(signal.SIGSTOP)  # mid-split, for as long as the second takes
        second = run(PREPARE, w, env=env_with(**COLD), check=False)
    finally:
        first.send_signal(signal.SIGCONT)
        out, err = first.communicate(timeout=300)
    assert second.returncode == 1 and one_error_line(second.stderr) == "error: data/prepared: " \
        "another prepare is writing it (it holds data/.prepared.lock); wait for it to end, or " \
        "stop it, then rerun", second.stderr
    assert first.returncode == 0, err
