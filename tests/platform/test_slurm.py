"""The SLURM launcher against a real one-node cluster (munged, slurmctld, slurmd on loopback)."""

from __future__ import annotations

import time

import pytest

from reprotrain.sweep import slurm as launcher
from stages.lib.errors import UserError
from tests.support.slurm_cluster import slurm  # noqa: F401


@pytest.fixture
def cluster(slurm, monkeypatch):  # noqa: F811
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    return slurm


def test_an_array_job_runs_the_command_once_per_task(cluster, tmp_path):
    work, logs = tmp_path / "work", tmp_path / "logs"
    work.mkdir()
    script = 'echo "$SLURM_ARRAY_TASK_ID $SWEEP_NOTE" > "task-$SLURM_ARRAY_TASK_ID.txt"; echo done'
    job = launcher.submit_array(["sh", "-c", script], 2, work, logs,
                                {"SWEEP_NOTE": "a,b=c d"}, "sweep-test")
    assert launcher.wait(job, timeout_s=60) == {0: "COMPLETED", 1: "COMPLETED"}
    assert {p.name: p.read_text() for p in work.iterdir()} == {
        "task-0.txt": "0 a,b=c d\n", "task-1.txt": "1 a,b=c d\n"}
    # one log per task, named after the job and the task
    assert sorted(p.name for p in logs.iterdir()) == [f"sweep-test-{job}_0.out",
                                                       f"sweep-test-{job}_1.out"]
    assert (logs / f"sweep-test-{job}_1.out").read_text() == "done\n"


def test_a_cancelled_task_shows_as_cancelled(cluster, tmp_path):
    job = launcher.submit_array(["sleep", "120"], 2, tmp_path, tmp_path / "logs", {}, "cancel-test")
    try:
        deadline = time.monotonic() + 30
        while launcher.states(job) != {0: "RUNNING", 1: "RUNNING"}:
            assert time.monotonic() < deadline, launcher.states(job)
            time.sleep(0.2)
        launcher.cancel(job, 1)
        deadline = time.monotonic() + 30
        while launcher.states(job)[1] != "CANCELLED":
            assert time.monotonic() < deadline, launcher.states(job)
            time.sleep(0.2)
        assert launcher.states(job)[0] == "RUNNING"  # the other task goes on
    finally:
        launcher.cancel(job)
    assert launcher.wait(job, timeout_s=30) == {0: "CANCELLED", 1: "CANCELLED"}


def test_a_refused_submission_is_one_line(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("SBATCH_PARTITION", "nonesuch")
    with pytest.raises(UserError, match=r"sbatch refused the array job 'x': .*[Ii]nvalid partition"
                                        r".*SBATCH_PARTITION") as e:
        launcher.submit_array(["true"], 1, tmp_path, tmp_path / "logs", {}, "x")
    assert "\n" not in str(e.value)


def test_without_sbatch_the_error_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH with no SLURM on it
    with pytest.raises(UserError, match=r"^sbatch not found on PATH: .*apt-get install slurm-client"
                                        r".*LAUNCHER=local$"):
        launcher.submit_array(["true"], 1, tmp_path, tmp_path / "logs", {}, "x")
