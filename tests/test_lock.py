"""requirements.lock is pyproject.toml's dependencies, resolved and pinned with hashes: a test
fails as soon as the two disagree, naming the package and the fix (`make lock`)."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import time
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from stages.lib.pip_progress import narrate
from tests.conftest import ROOT

FIX = "run `make lock` and commit requirements.lock"


def pyproject_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]


def lock_entries() -> dict[str, dict]:
    """name -> version, hash count and whether pyproject.toml asks for it directly."""
    entries: dict[str, dict] = {}
    current = None
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        pin = re.match(r"^([A-Za-z0-9_.\-]+)==([^ ;\\]+)", line)
        if pin:
            current = canonicalize_name(pin[1])
            entries[current] = {"version": pin[2], "hashes": 0, "direct": False}
        elif current and "--hash=sha256:" in line:
            entries[current]["hashes"] += 1
        elif current and re.search(r"(via|#)\s+reprotrain \(pyproject\.toml\)", line):
            entries[current]["direct"] = True
    return entries


def test_the_lock_pins_every_dependency_of_pyproject_within_its_range():
    lock = lock_entries()
    for req in pyproject_requirements():
        name = canonicalize_name(req.name)
        assert name in lock, f"pyproject.toml asks for {req} but requirements.lock lacks it: {FIX}"
        version = lock[name]["version"]
        assert req.specifier.contains(version, prereleases=True), \
            f"requirements.lock pins {name}=={version}, outside pyproject.toml's {req}: {FIX}"


def test_the_lock_holds_nothing_pyproject_no_longer_asks_for():
    wanted = {canonicalize_name(r.name) for r in pyproject_requirements()}
    direct = {name for name, e in lock_entries().items() if e["direct"]}
    assert direct == wanted, f"direct dependencies differ: {sorted(direct ^ wanted)}: {FIX}"


def test_every_pin_is_exact_and_hashed():
    lock = lock_entries()
    assert len(lock) > 50 and "torch" in lock
    unhashed = sorted(name for name, e in lock.items() if not e["hashes"])
    assert not unhashed, f"pins without hashes: {unhashed}: {FIX}"


def test_the_lock_resolves_under_committed_constraints_only():
    """`make lock` once read a machine-local pip constraints file: its output then depended on
    the machine. It names only files in the repo."""
    header = (ROOT / "requirements.lock").read_text().split("\n\n")[0]
    makefile = (ROOT / "Makefile").read_text()
    lock_rule = makefile[makefile.index("\nlock:"):].split("\n\n")[0]
    constraints = re.findall(r"--constraint (\S+)", lock_rule)
    assert constraints == ["lock-constraints.txt"] and (ROOT / constraints[0]).is_file(), lock_rule
    assert "/etc/" not in lock_rule and "wildcard" not in lock_rule, lock_rule
    assert "-c lock-constraints.txt" in (ROOT / "requirements.lock").read_text(), header


def test_make_clean_removes_scratch_and_keeps_runs_data_and_models(tmp_path):
    from tests.conftest import copy_repo, run

    repo = copy_repo(tmp_path / "repo")
    scratch = [".checkpoints/abc/epoch-0001.pt", "dvc_plots/index.html", "bench/results.csv",
               "stages/__pycache__/x.pyc", ".pytest_cache/v"]
    kept = ["mlflow.db", "mlartifacts/1/x", "data/prepared/train.pt", "models/train/model.pt",
            ".dvc/cache/files/md5/ab/cdef"]
    for f in scratch + kept:
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        (repo / f).write_text("x")
    p = run(["make", "clean"], repo)
    assert not [f for f in scratch if (repo / f).exists()], p.stdout
    assert all((repo / f).exists() for f in kept) and "kept: mlflow.db" in p.stdout
    assert run(["git", "status", "--porcelain"], repo).stdout == ""  # nothing tracked went


def test_setup_says_what_pip_does_through_its_silences(tmp_path):
    """`make setup`'s pip output, read by stages.lib.pip_progress: a numbered line per package, a
    line while pip is silent (minutes, unpacking torch), a count instead of pip's list. Real
    pip installs a wheel built here into a new venv; then pip's silence, made by waiting."""
    project = tmp_path / "tiny"
    (project / "tiny").mkdir(parents=True)
    (project / "tiny/__init__.py").write_text("")
    (project / "pyproject.toml").write_text('[project]\nname = "tiny"\nversion = "1.0"\n')
    wheels, venv = tmp_path / "wheels", tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", wheels, project], check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    pip = subprocess.Popen([venv / "bin/python", "-m", "pip", "install", "--no-index",
                            "--progress-bar", "off", "--find-links", wheels, "tiny"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    said = subprocess.run([sys.executable, "-m", "stages.lib.pip_progress", "--total", "1"],
                          stdin=pip.stdout, cwd=ROOT, capture_output=True, text=True, check=True)
    assert pip.wait() == 0
    lines = said.stdout.splitlines()
    assert lines[0].startswith("[1/1] Processing ") and "tiny" in lines[0], lines
    assert "unpacking 1 packages into .venv" in said.stdout
    assert re.fullmatch(r"installed 1 packages in 0:\d\d", lines[-1]), lines

    def silent_pip():
        yield "Collecting torch==2.14.1\n"
        yield "Installing collected packages: torch, triton\n"
        time.sleep(1.6)  # pip unpacking in silence
        yield "Successfully installed torch-2.14.1 triton-3.8.0\n"

    out = io.StringIO()
    narrate(silent_pip(), total=2, out=out, quiet_s=0.5)
    said = out.getvalue()
    assert "  ... pip is unpacking 2 packages into .venv (0:0" in said, said
    assert said.rstrip().endswith("installed 2 packages in 0:01"), said
