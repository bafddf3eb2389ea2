"""The make targets that manage a workspace, run for real: `make share` without a usable
remote, `make verify` on another thread count, `make setup` with a wrong `python3` and through
pip's silences, `make clean`. Each explains itself in one line and says the way on."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reprotrain.pip_progress import narrate
from tests.conftest import ROOT, VENV_BIN, copy_params, env_with, run

# ------------------------------------------------------------ make share, make verify

# A stage whose outputs depend on torch's thread count, as real training does in its last bits.
THREADS_STAGE = """\
stages:
  work:
    cmd: python -c "import json, torch; t = torch.get_num_threads();
      open('model.bin', 'w').write(str(t)); json.dump(dict(threads=t), open('metrics.json', 'w'))"
    outs:
      - model.bin
    metrics:
      - metrics.json:
          cache: false
"""


def make(repo: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The repo's own Makefile, on the venv the tests run in."""
    return run(["make", "-s", *args, f"VENV={VENV_BIN.parent}"], repo, env=env_with(**env),
               check=False)


def last_lines(p: subprocess.CompletedProcess) -> list[str]:
    """stderr less make's own `make: *** [...] Error 1`: the recipe's words."""
    return [line for line in p.stderr.splitlines() if line.strip() and not line.startswith("make:")]


@pytest.fixture(scope="module")
def dvc_repo(tmp_path_factory) -> Path:
    """A git + DVC repo with this Makefile and stages/, one stage run and committed."""
    repo = tmp_path_factory.mktemp("dvc_repo")
    for name in ("Makefile", "requirements.lock", ".dvc/config"):
        (repo / name).parent.mkdir(exist_ok=True)
        shutil.copy2(ROOT / name, repo / name)  # the lock as installed: make installs nothing
    shutil.copytree(ROOT / "stages", repo / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    copy_params(repo)  # make repro and make verify check it before DVC reads it
    (repo / "dvc.yaml").write_text(THREADS_STAGE)
    run(["git", "init", "-q", "-b", "main"], repo)
    run(["dvc", "init", "-q", "--force"], repo)
    shutil.copy2(ROOT / ".dvc/config", repo / ".dvc/config")
    run(["dvc", "repro", "-q"], repo, env=env_with(OMP_NUM_THREADS="1"))
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "init"], repo)
    return repo


def workspace_state(repo: Path) -> dict:
    return {"files": {f: (repo / f).read_bytes() for f in ("dvc.lock", "model.bin", "metrics.json",
                                                         ".dvc/config")},
            "git": run(["git", "status", "--porcelain"], repo).stdout,
            "cache": sorted(p.name for p in (repo / ".dvc/cache").rglob("*") if p.is_file())}


def test_make_share_sends_every_runs_outputs_not_only_the_workspaces(tmp_path):
    """Every run-cache entry `make share` sends comes with what it names, folders too: a clone
    asking for params this machine ran before the workspace's last run restores that run,
    running nothing (it used to send only the workspace's folders; the clone reran the stage
    after DVC's "Some of the cache files do not exist neither locally nor on remote")."""
    w = tmp_path / "w"
    w.mkdir()
    for name in ("Makefile", "requirements.lock"):
        shutil.copy2(ROOT / name, w / name)
    shutil.copytree(ROOT / "stages", w / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    run(["git", "init", "-q", "-b", "main"], w)
    run(["dvc", "init", "-q"], w)
    (w / "params.yaml").write_text("n: 1\n")
    (w / "dvc.yaml").write_text(
        "stages:\n  count:\n    cmd: mkdir -p out && seq ${n} > out/seq.txt && echo ${n} > n.txt\n"
        "    params: [n]\n    outs: [out, n.txt]\n")
    run(["dvc", "repro", "-q"], w)
    run(["git", "add", "-A"], w)
    run(["git", "commit", "-qm", "n=1"], w)
    for n in ("2", "3"):  # experiments, each applied to the workspace as it ends
        run(["dvc", "exp", "run", "-q", "-S", f"n={n}"], w)
    run(["dvc", "remote", "add", "-d", "team", str(tmp_path / "remote")], w)
    run(["git", "commit", "-qam", "a remote"], w)
    p = make(w, "share")
    assert p.returncode == 0 and "WARNING" not in p.stderr, p.stdout + p.stderr
    # n=3's n.txt, out/seq.txt and out's .dir; then n=1's and n=2's, less n=1's seq.txt
    # (the bytes of its n.txt, sent already).
    assert "pushed 3 files of the workspace's data and outputs, then the run-cache (3 entries) " \
           "and 5 more files it names" in p.stdout, p.stdout

    c = tmp_path / "clone"
    run(["git", "clone", "-q", str(w), str(c)], tmp_path)
    for n in ("1", "2", "3"):
        p = run(["dvc", "exp", "run", "--pull", "-S", f"n={n}"], c)
        assert "Running stage 'count'" not in p.stdout and "WARNING" not in p.stderr, \
            p.stdout + p.stderr
        assert (c / "out/seq.txt").read_text().split() == [str(i) for i in range(1, int(n) + 1)]


TOKEN = "ghp_t0kenInTheRemoteUrl"


@pytest.mark.parametrize("remote, expected", [
    (None, "error: no DVC remote to share to: add one with `dvc remote add -d NAME URL`"),
    ("s3://bucket/x", "error: the DVC remote 'r' (s3://bucket/x) needs credentials and this "
                      "machine has none: set its keys with `dvc remote modify --local r "
                      "access_key_id KEY`"),
    ("http://127.0.0.1:{port}/x", "error: could not push to the DVC remote 'r' "
                                  "(http://127.0.0.1:{port}/x): 1 files failed to upload "
                                  "(Cannot connect to host 127.0.0.1:{port}"),
    ("{tmp}/file/under", "error: could not push to the DVC remote 'r' ({tmp}/file/under): "
                         "[Errno 20] Not a directory: '{tmp}/file/under/"),
    # a token in the URL (issue 55): shown nowhere, DVC's own words included
    (f"https://alice:{TOKEN}@127.0.0.1:{{port}}/dvc", "error: could not push to the DVC remote "
     "'r' (https://***@127.0.0.1:{port}/dvc): 1 files failed to upload (Cannot connect to host "
     "127.0.0.1:{port}"),
])
def test_make_share_without_a_usable_remote_is_one_line(dvc_repo, tmp_path, remote, expected):
    from tests.support.workspaces import closed_port

    repo = tmp_path / "repo"
    shutil.copytree(dvc_repo, repo, symlinks=True)
    (tmp_path / "file").write_text("a file, not a folder")
    fill = {"port": closed_port(), "tmp": tmp_path}
    if remote:
        run(["dvc", "remote", "add", "--local", "-d", "r", remote.format(**fill)], repo)
    before = workspace_state(repo)
    # No AWS keys from the caller or ~/.aws, and no lookup of EC2's metadata address: nothing
    # leaves loopback.
    p = make(repo, "share", AWS_ACCESS_KEY_ID="", AWS_SECRET_ACCESS_KEY="",
             AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=str(tmp_path / "no-aws"),
             AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-aws"))
    assert p.returncode == 2 and last_lines(p) == last_lines(p)[-1:], p.stderr
    assert last_lines(p)[0].startswith(expected.format(**fill)), p.stderr
    assert TOKEN not in p.stdout + p.stderr, p.stderr
    assert workspace_state(repo) == before  # nothing lost, nothing half-pushed locally


def test_no_target_that_takes_a_url_echoes_its_recipe(tmp_path):
    """make, without -s as a user and CI run it, echoes a recipe line before running it, and CI
    logs keep it: `make sweep REMOTE=https://TOKEN@...` showed the token before the sweep refused
    it masked (issue 55). The targets that take a URL or DSN, or read one, echo nothing; each
    still refuses the value, masked."""
    from tests.conftest import copy_repo
    from tests.support.workspaces import closed_port

    repo = copy_repo(tmp_path / "repo")
    port = closed_port()
    run(["dvc", "remote", "add", "--local", "-d", "r", f"https://alice:{TOKEN}@127.0.0.1:{port}/dvc"], repo)
    (repo / "sent.txt").write_text("a file for `make share` to push")
    run(["dvc", "add", "sent.txt"], repo)
    unreachable = f"http://127.0.0.1:{port}"
    for target, said in (
            (["sweep", f"REMOTE=https://{TOKEN}@127.0.0.1:{port}/team/repo.git", "TRIALS=1",
              "STORAGE=postgresql://optuna@127.0.0.1:1/sweeps"], "error: REMOTE=https://***@"),
            (["sync", f"FROM=postgresql://u:{TOKEN}@127.0.0.1:1/mlflow"], "does not answer"),
            (["server", f"DB=postgresql://u:{TOKEN}@127.0.0.1:1/mlflow", "ARTIFACTS=art"],
             "error: DB=postgresql://***@127.0.0.1:1/mlflow holds a password"),
            (["share"], "error: could not push to the DVC remote 'r' (https://***@")):
        p = run(["make", *target, f"VENV={VENV_BIN.parent}"], repo, check=False,
                env=env_with(MLFLOW_TRACKING_URI=unreachable))
        out = p.stdout + p.stderr
        assert p.returncode == 2 and said in p.stderr and TOKEN not in out, (target, out)
        assert "-m stages." not in out, (target, out)  # no recipe line


def test_make_verify_on_another_thread_count_names_the_outputs_and_the_way_back(dvc_repo, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(dvc_repo, repo, symlinks=True)
    before = workspace_state(repo)
    p = make(repo, "verify", OMP_NUM_THREADS="1")
    assert p.returncode == 0 and "verified: every output is byte-identical" in p.stdout, p.stderr

    p = make(repo, "verify", OMP_NUM_THREADS="2")
    assert p.returncode == 2 and len(last_lines(p)) == 1, p.stderr
    line = last_lines(p)[0]
    assert line.startswith("error: NOT reproduced: a rerun changed metrics.json, model.bin. "), line
    assert "thread count (OMP_NUM_THREADS)" in line
    assert (repo / "model.bin").read_text() == "2"  # the rerun's outputs, as the line says
    back = line.split("to get the previous ones back: ")[1]
    assert back == "git checkout -- dvc.lock metrics.json && dvc checkout"
    run(["bash", "-c", back], repo)  # the advice, as a user pastes it
    assert workspace_state(repo) | {"cache": []} == before | {"cache": []}
    assert "up to date" in run(["dvc", "status"], repo).stdout


# train's shape where `make repro` looks: weights and the made_on.json the real function writes.
MADE_ON_STAGE = """\
stages:
  train:
    cmd: mkdir -p models/train && python -c "import json, torch; from stages.runtime import made_on;
      t = torch.get_num_threads(); open('models/train/model.bin', 'w').write(str(t));
      open('models/train/made_on.json', 'w').write(json.dumps(made_on(torch.device('cpu'))))"
    params:
      - seed
    outs:
      - models/train/model.bin
      - models/train/made_on.json
"""


def test_make_repro_says_when_the_model_was_made_under_another_thread_count(dvc_repo, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(dvc_repo, repo, symlinks=True)
    (repo / "dvc.yaml").write_text(MADE_ON_STAGE)
    p = make(repo, "repro", OMP_NUM_THREADS="1")
    assert p.returncode == 0 and "note:" not in p.stdout + p.stderr, p.stdout + p.stderr
    params = (repo / "params.yaml").read_text()
    (repo / "params.yaml").write_text(params.replace("seed: 42", "seed: 7"))
    assert make(repo, "repro", OMP_NUM_THREADS="2").returncode == 0
    (repo / "params.yaml").write_text(params)  # back: DVC restores the 1-thread run from its cache

    p = make(repo, "repro", OMP_NUM_THREADS="2")
    assert p.returncode == 0, p.stderr
    assert (repo / "models/train/model.bin").read_text() == "1"  # restored, not rerun
    notes = [line for line in p.stdout.splitlines() if line.startswith("note:")]
    assert len(notes) == 1, p.stdout
    assert " with 1 thread (made_on.json), here training runs on " in notes[0], notes[0]
    assert notes[0].endswith(" with 2 threads: a rerun gives other last bits (`make verify` "
                             "would name them). DVC restores outputs made on any machine from "
                             "its run-cache; `dvc repro -f train` remakes them here"), notes[0]
    p = make(repo, "repro", OMP_NUM_THREADS="1")  # the machine that made them: nothing to say
    assert p.returncode == 0 and "note:" not in p.stdout + p.stderr, p.stdout


# ------------------------------------------------------------ make exps

# A stage with the pipeline's shape where make exps looks: a params dep, the data folder
# `data.root` names as a dep, a metrics file.
EXPS_STAGE = """\
stages:
  train:
    cmd: python -c "import json; json.dump(dict(accuracy=0.5), open('metrics.json', 'w'))"
    deps:
      - ${data.root}
    params:
      - lr
      - data.root
    metrics:
      - metrics.json:
          cache: false
"""


def test_make_exps_keeps_earlier_commits_experiments_and_shows_no_hashes(tmp_path):
    """docs/data.md's recipe in brief, with real experiments: one on the digits, then a dataset
    folder `dvc add`ed and committed (here at the top: its column is then named `shapes`), then
    one on it. `make exps` showed the second only (the commit hid the first) and a `shapes`
    column holding a 40-character hash, past its 120 columns."""
    repo = tmp_path / "repo"
    for name in ("Makefile", "requirements.lock", ".dvc/config"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, repo / name)  # the lock as installed: make installs nothing
    copy_params(repo)
    (repo / "dvc.yaml").write_text(EXPS_STAGE)
    (repo / "data/raw/digits").mkdir(parents=True)
    (repo / "data/raw/digits/README.md").write_text("data.root's default\n")
    run(["git", "init", "-q", "-b", "main"], repo)
    run(["dvc", "init", "-q", "--force"], repo)
    shutil.copy2(ROOT / ".dvc/config", repo / ".dvc/config")
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "init"], repo)
    run(["dvc", "exp", "run", "-n", "on-digits", "-S", "lr=0.01"], repo)
    (repo / "shapes/circle").mkdir(parents=True)
    (repo / "shapes/circle/001.png").write_bytes(b"a file to hash")
    run(["dvc", "add", "shapes"], repo)
    run(["git", "add", "shapes.dvc", ".gitignore"], repo)
    run(["git", "commit", "-qm", "add shapes"], repo)
    run(["dvc", "exp", "run", "-n", "on-shapes", "-S", "data.root=shapes"], repo)
    assert "shapes" in run(["dvc", "exp", "show", "--csv"], repo).stdout.splitlines()[0].split(",")

    p = make(repo, "exps")
    table = p.stdout.splitlines()
    assert p.returncode == 0 and max(map(len, table)) <= 120, p.stdout + p.stderr
    assert table[0].split() == ["Experiment", "test_acc", "lr", "epochs", "batch_size",
                                "data.root"], p.stdout
    rows = {line.split()[0]: line.split()[1:] for line in table[1:]}
    assert rows["on-digits"] == ["0.5", "0.01", "30", "64", "data/raw/digits"], p.stdout
    assert rows["on-shapes"] == ["0.5", "0.01", "30", "64", "shapes"], p.stdout
    first = run(["git", "rev-parse", "--short", "HEAD~1"], repo).stdout.strip()
    assert list(rows) == ["workspace", "main", "on-shapes", first, "on-digits"], p.stdout
    assert not re.search(r"[0-9a-f]{32}", p.stdout), p.stdout


# ------------------------------------------------------------ a wrong Python

def test_make_refuses_a_wrong_python_and_never_reuses_its_venv(tmp_path):
    """A `python3` that is 3.7 first on PATH: one line, no .venv; a .venv left by it (no
    stamp) is made again by the right Python. In a copy of the Makefile: the real .venv is
    never touched."""
    work, bin_dir = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    bin_dir.mkdir()
    shutil.copy(ROOT / "Makefile", work)
    (work / "reprotrain").mkdir()  # what `make setup` runs from the checkout: pip's narrator
    for name in ("__init__.py", "pip_progress.py"):
        shutil.copy(ROOT / "reprotrain" / name, work / "reprotrain" / name)
    (work / "requirements.lock").write_text("# nothing to install\n")
    fake = bin_dir / "python3"
    fake.write_text('#!/bin/sh\necho "Python 3.7.17"\n')
    fake.chmod(0o755)
    env = {**env_with(), "PATH": f"{bin_dir}:{os.environ['PATH']}"}

    p = run(["make", "-s", "setup"], work, env=env, check=False)
    assert p.returncode == 2 and last_lines(p) == [
        f"error: Python >= 3.11 needed, but python3 is 3.7.17 ({fake}); pick another: "
        "make PYTHON=python3.11"], p.stderr
    assert not (work / ".venv").exists()

    (work / ".venv/bin").mkdir(parents=True)  # what a 3.7 left: a venv, and no stamp
    shutil.copy(fake, work / ".venv/bin/python")
    p = run(["make", "-s", "setup", f"PYTHON={sys._base_executable}"], work, env=env, check=False)
    assert p.returncode == 0, p.stderr
    made = run([str(work / ".venv/bin/python"), "--version"], work).stdout
    assert made.startswith(f"Python {sys.version_info.major}.{sys.version_info.minor}.")
    assert (work / ".venv/.installed").exists()


def test_a_clone_sharing_the_venv_installs_nothing_until_its_lock_changes(tmp_path):
    """A CI runner's or a second checkout's fresh files with .venv linked in: newer than the
    stamp, the same lock, nothing to install. A reinstall would point the venv's editable
    install at that clone and change site-packages under every warm process's key. Dry runs:
    the tests' venv is never touched."""
    for name in ("Makefile", "requirements.lock"):
        shutil.copy(ROOT / name, tmp_path / name)  # files as new as a fresh clone's
    (tmp_path / ".venv").symlink_to(VENV_BIN.parent)
    assert run(["make", "-s", "-n", "setup"], tmp_path).stdout == ""
    with open(tmp_path / "requirements.lock", "a") as lock:
        lock.write("# a change\n")
    planned = run(["make", "-s", "-n", "setup"], tmp_path).stdout
    assert "pip install --progress-bar off --require-hashes" in planned, planned


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
    """`make setup`'s pip output, read by reprotrain.pip_progress: a numbered line per package, a
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

    def narrated_install() -> str:
        """Real pip installing tiny into the venv, read by pip_progress: what it says."""
        pip = subprocess.Popen([venv / "bin/python", "-m", "pip", "install", "--no-index",
                                "--progress-bar", "off", "--find-links", wheels, "tiny"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        said = subprocess.run([sys.executable, "-m", "reprotrain.pip_progress", "--total", "1"],
                              stdin=pip.stdout, cwd=ROOT, capture_output=True, text=True,
                              check=True)
        assert pip.wait() == 0
        return said.stdout

    said = narrated_install()
    lines = said.splitlines()
    assert lines[0].startswith("[1/1] Processing ") and "tiny" in lines[0], lines
    assert "unpacking 1 packages into .venv" in said
    assert re.fullmatch(r"installed 1 packages in 0:\d\d", lines[-1]), lines
    # Again, as after a `git pull` that touched the lock's time only: pip installs nothing.
    assert narrated_install() == "nothing to install: the lock's 1 packages are in .venv already\n"

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


@pytest.mark.parametrize("record", ["[]", "null", '"x"', "1", "{}", '{"gpu": ""}',
                                    '{"threads": 2}', "", "\xff\xfe", None])
def test_make_repros_note_says_nothing_of_a_record_it_cannot_read(tmp_path, monkeypatch, record):
    # Issue 42.10, second pass: `[]` failed make repro with a traceback.
    from reprotrain.team.verify import made_elsewhere

    monkeypatch.chdir(tmp_path)
    copy_params(tmp_path)
    made_on = tmp_path / "made_on.json"
    if record is None:
        made_on.mkdir()
    else:
        made_on.write_text(record, errors="surrogateescape")
    assert made_elsewhere(made_on) is None


def test_make_repros_note_on_a_machine_that_cannot_train_as_params_say(tmp_path, monkeypatch):
    # A teammate's GPU run, restored on a machine without CUDA: a note, never a failed make repro.
    import torch

    from reprotrain.team.verify import made_elsewhere

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: train.device=cuda trains")

    monkeypatch.chdir(tmp_path)
    params = copy_params(tmp_path)
    params.write_text(params.read_text().replace("  device: auto", "  device: cuda"))
    made_on = tmp_path / "made_on.json"
    made_on.write_text('{"gpu": "NVIDIA H200\\u001b[31m"}')
    note = made_elsewhere(made_on)
    assert note.startswith(f"note: {tmp_path}/ was made on NVIDIA H200?[31m (made_on.json); it "
                           "could not be trained again here: params.yaml: train.device='cuda' "
                           "but CUDA is not available"), note
