"""`make ui` for real: a local MLflow UI on a store of this session, as a user starts it,
bound to loopback."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import ROOT, env_with
from tests.support.services import free_port
from tests.support.workspaces import closed_port


def log_of(line: str) -> Path:
    """The log named in `make ui`'s first line."""
    return Path(line.split("its log: ", 1)[1].split(")", 1)[0])


def test_make_ui_prints_its_addresses_together_once_it_answers(tmp_path, mlflow_uri):
    """No address before the server answers (one opened early is an error page), then the
    home and the runs table at once; its log in a private folder, never through a symlink
    planted at a guessable /tmp name."""
    import mlflow

    from stages.config import load_params

    db = tmp_path / "mlflow.db"
    shutil.copy(mlflow_uri.removeprefix("sqlite:///"), db)
    client, name = mlflow.MlflowClient(f"sqlite:///{db}"), load_params().mlflow.experiment
    exp = client.get_experiment_by_name(name)  # the shared store may hold it already
    exp_id = exp.experiment_id if exp else client.create_experiment(
        name, artifact_location=(tmp_path / "art").as_uri())
    port = free_port()
    planted = Path(tempfile.gettempdir()) / f"reprotrain-ui-{port}.log"
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched\n")
    planted.unlink(missing_ok=True)
    planted.symlink_to(victim)
    proc = subprocess.Popen([sys.executable, "-m", "reprotrain.team.ui", "--port", str(port)], cwd=ROOT,
                            env=env_with(MLFLOW_TRACKING_URI=f"sqlite:///{db}?timeout=60"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        lines, times = [], []
        for line in proc.stdout:
            lines.append(line.rstrip())
            times.append(time.monotonic())
            if line.startswith("http://"):
                break
        base = f"http://127.0.0.1:{port}"
        assert len(lines) == 3 and "http://" not in lines[0], lines
        assert lines[1].startswith(f"MLflow UI ready on {base} (Ctrl-C stops it)"), lines
        assert lines[2].startswith(f"{base}/#/experiments/{exp_id}/runs?"), lines
        assert times[2] - times[1] < 2, "the runs table's address came late"
        with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
            assert r.status == 200
        log = log_of(lines[0])
        assert log.is_file() and log.parent.stat().st_mode & 0o777 == 0o700
        assert victim.read_text() == "untouched\n" and planted.is_symlink()
    finally:
        planted.unlink(missing_ok=True)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_make_killed_ends_the_server_it_started(tmp_path):
    """SIGKILL of `make ui` (or `make server`: the same `started`) leaves nothing to stop the
    server, and it served on, holding the port, with no command left to Ctrl-C."""
    import psutil

    port = free_port()
    proc = subprocess.Popen(["make", "-s", "ui", f"UI_PORT={port}"], cwd=ROOT,
                            env=env_with(MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    everything = []
    try:
        for line in proc.stdout:  # make ends only when killed: the loop ends at the address
            if line.startswith(f"http://127.0.0.1:{port}"):
                break
        everything = psutil.Process(proc.pid).children(recursive=True)
        assert len(everything) >= 2, everything  # reprotrain.team.ui and the MLflow server, at least
        # Not MLflow's job runner and its seven consumers, which double a start's CPU.
        assert not [p for p in everything if "mlflow.server.jobs" in " ".join(p.cmdline())]
        proc.kill()  # make alone, as `kill -9` on its pid: reprotrain.team.ui's parent is gone
        proc.wait(timeout=30)
        gone, alive = psutil.wait_procs(everything, timeout=60)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        for p in everything:
            if p.is_running():
                p.kill()


def test_a_store_s_password_is_on_no_command_line_and_in_no_message(tmp_path):
    """MLFLOW_TRACKING_URI=postgresql://user:password@host/db: `mlflow ui --backend-store-uri
    URI` showed the password to every user of the machine (`ps`) for the UI's life."""
    import psutil

    secret = "store-S3cr3t"
    proc = subprocess.Popen([sys.executable, "-m", "reprotrain.team.ui", "--port", str(free_port()),
                             "--timeout", "20"], cwd=ROOT, env=env_with(
        MLFLOW_TRACKING_URI=f"postgresql://mlflow:{secret}@127.0.0.1:1/mlflow"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        seen, deadline = set(), time.monotonic() + 15
        while time.monotonic() < deadline and proc.poll() is None:
            for p in psutil.Process(proc.pid).children(recursive=True):
                try:
                    seen.add(" ".join(p.cmdline()))
                except psutil.NoSuchProcess:
                    continue
            time.sleep(0.5)
        assert any("mlflow" in c for c in seen), seen
        assert not [c for c in seen if secret in c], seen
        # At its --timeout: the runs table's lookup, which MLflow retries for about 100 s
        # against a store that does not answer, no longer keeps the process.
        out = proc.communicate(timeout=60)[0]
        assert secret not in out and "did not start" in out, out
        # A failed start keeps its log, named in the error: it says why.
        assert (log := Path(out.rsplit("its log: ", 1)[1].strip())).is_file(), out
        shutil.rmtree(log.parent)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_make_ui_binds_loopback_and_rejects_foreign_hosts(tmp_path):
    """Also: its last line is the runs table's address, printed once the server answers, and
    SIGTERM to make's group ends every server process, a clean stop that leaves no log."""
    import psutil

    port = closed_port()
    proc = subprocess.Popen(["make", "-s", "ui", f"UI_PORT={port}"], cwd=ROOT, env=env_with(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:  # make ends only when killed: the loop ends at the address
            lines.append(line.rstrip())
            if line.startswith(f"http://127.0.0.1:{port}"):
                break
        assert lines and lines[-1].startswith(f"http://127.0.0.1:{port}/#/experiments/"
                                              ) or "no experiment" in lines[-1], lines
        assert "workflowType=machine_learning" in lines[-1] or "no experiment" in lines[-1]
        assert not any("warning" in line.lower() for line in lines), lines
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            assert r.status == 200  # already answering when the address was printed
        bound = {c.laddr.ip for c in psutil.net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
        assert bound == {"127.0.0.1"}
        api = f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/search?max_results=1"
        with urllib.request.urlopen(api, timeout=10) as r:
            assert r.status == 200
        req = urllib.request.Request(api, headers={"Host": "evil.example.com"})  # DNS rebinding
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 403
        os.killpg(proc.pid, signal.SIGTERM)  # as `kill -- -PGID` or systemd stops a service
        rest = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
    # A clean stop: make ends as the signal ended it but reports no error (its command exits 0;
    # it was `make: *** [Makefile:..: ui] Error 143`), and the log's private folder is gone.
    assert proc.returncode == -signal.SIGTERM and "make: ***" not in rest, rest
    assert rest.strip() == "stopping the MLflow UI", rest
    assert not log_of(lines[0]).parent.exists(), lines[0]
    deadline = time.time() + 15
    while any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
              for c in psutil.net_connections("tcp")):
        assert time.time() < deadline, "the UI server outlived make ui"
        time.sleep(0.5)
    # The server closes its socket before it exits: its process may take a moment more (make ui
    # waits up to 5 s for it, then SIGKILLs it).
    while left := [p for p in psutil.process_iter(["cmdline"])
                   if str(port) in " ".join(p.info["cmdline"] or []) and "mlflow" in
                   " ".join(p.info["cmdline"] or [])]:
        assert time.time() < deadline + 10, f"the UI server outlived make ui: {left}"
        time.sleep(0.5)


def test_a_stop_while_the_ui_starts_is_clean_and_leaves_nothing(tmp_path):
    """SIGTERM to make (which passes it on) before the server answers: the server's group ends,
    no `make: ***` line nor traceback (it was `RuntimeError: generator didn't yield` after Ctrl-C),
    and no log folder is left in $TMPDIR."""
    import psutil

    port = free_port()
    proc = subprocess.Popen(["make", "-s", "ui", f"UI_PORT={port}"], cwd=ROOT,
                            env=env_with(MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        first = proc.stdout.readline()
        assert first.startswith("starting the MLflow UI"), first
        (command,) = psutil.Process(proc.pid).children()
        deadline = time.monotonic() + 10
        while not (servers := command.children(recursive=True)):  # started just after the line
            assert time.monotonic() < deadline, "the UI server did not start"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGTERM)  # make alone, as `kill PID` does
        rest = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGTERM and rest.strip() == "stopping the MLflow UI", rest
    gone, alive = psutil.wait_procs(servers, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    assert not log_of(first).parent.exists(), first
