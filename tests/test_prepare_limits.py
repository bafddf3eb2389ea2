"""prepare on a limited or shared machine: killed (kill -9, the OOM killer), in a memory cgroup
(a container, a SLURM job), under a process limit, on a small disk, twice at once. Real
cgroups, real `prlimit`, a real small file system; each skips, saying why, where this machine
has none to give."""

from __future__ import annotations

import os
import re
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
from tests.support.image_files import make_folder
from tests.support.workspaces import folder_workspace, one_error_line

MiB = 2**20
# A stage run cold, in the process the test starts: a warm process would run it outside the
# cgroup or limit the test puts it in. One thread for the libraries' pools, so that the tasks a
# process-count limit counts are the same on any machine.
COLD = {"REPROTRAIN_WARM": "0", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT)}
PREPARE = [sys.executable, "-m", "stages.prepare"]


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
