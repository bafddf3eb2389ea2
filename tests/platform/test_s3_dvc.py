"""A DVC remote on S3, end to end, against a real S3 server (SeaweedFS, `make s3`'s): README's
recipe as written, a fresh clone restoring the models byte for byte without training, the keys
in no committed file, output or object, and a wrong or missing key as one line."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT, VENV_BIN, copy_repo, run
from tests.support.services import s3, s3_client_env  # noqa: F401 - the fixture

# A folder of its own in the session's bucket: other modules may keep DVC remotes there too.
REMOTE = "s3://team-dvc/test_s3_dvc"
STAGES = ("prepare", "train", "evaluate", "export")


@dataclass(frozen=True)
class Team:
    repo: Path
    remote_commit: str  # the commit that adds the remote, with the run's dvc.lock
    restore: str  # README's last line: what another clone runs
    key: str
    secret: str


def readme_recipe() -> list[str]:
    """The bash block after README's "A team's storage." paragraph, one command a line."""
    text = (ROOT / "README.md").read_text()
    block = text.split("**A team's storage.**", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return block.splitlines()


def as_run_here(line: str, s3) -> str:  # noqa: F811 - the fixture's value
    """A README line for this test's server and venv: its endpoint, bucket and keys."""
    return (line.replace("http://127.0.0.1:9000", s3.endpoint)
            .replace("s3://reprotrain/dvc", REMOTE)
            .replace(" KEY ", f" {s3.access_key} ").replace(" SECRET", f" {s3.secret_key}")
            .replace("make share", f"make -s share VENV={VENV_BIN.parent}")
            .replace("make repro", f"make -s repro VENV={VENV_BIN.parent}"))


def bash(line: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return run(["bash", "-eo", "pipefail", "-c", line], cwd, env=env)


@pytest.fixture(scope="module")
def team(tmp_path_factory, s3) -> Team:  # noqa: F811 - the fixture
    """A workspace with short params, then README's recipe: the remote and its keys, `make
    repro`, `make share`, the commit of .dvc/config and the run; then anything left committed."""
    tmp = tmp_path_factory.mktemp("s3dvc")
    repo = copy_repo(tmp / "repo", {"epochs": "2", "model.width": "8"})
    run(["dvc", "repro"], repo)
    recipe = readme_recipe()
    assert recipe[0].startswith("make s3 ") and recipe[-1].startswith("dvc exp run --pull ")
    for line in recipe[1:-1]:
        bash(as_run_here(line, s3), repo, s3_client_env(tmp))
    remote_commit = run(["git", "rev-parse", "HEAD"], repo).stdout.strip()
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "the rest", "--allow-empty"], repo)  # README committed the run
    return Team(repo=repo, remote_commit=remote_commit, restore=recipe[-1], key=s3.access_key,
                secret=s3.secret_key)


def outputs(repo: Path) -> list[Path]:
    """Every file of every stage's outputs in repo's dvc.lock, cached or not (run.json, which
    tracking writes beside them and DVC does not track, is no output)."""
    from omegaconf import OmegaConf

    lock = OmegaConf.to_container(OmegaConf.load(repo / "dvc.lock"))["stages"]
    paths = [repo / out["path"] for stage in lock.values() for out in stage.get("outs", [])]
    return sorted(f for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())


def hashes(repo: Path) -> dict[str, str]:
    return {str(p.relative_to(repo)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in outputs(repo)}


def clone(team: Team, dest: Path, commit: str = "HEAD") -> Path:
    run(["git", "clone", "-q", str(team.repo), str(dest)], dest.parent)
    run(["git", "checkout", "-q", commit], dest)
    assert not (dest / ".dvc/config.local").exists()  # the keys stayed behind
    return dest


def test_readme_recipe_pushed_the_run_and_a_fresh_clone_restores_it(team, tmp_path):
    """At the commit README's recipe made, `dvc exp run --pull` restores every stage from S3:
    no stage runs. (It committed only .dvc/config, beside a dvc.lock trained on another CPU:
    DVC could not pull that lock's models and retrained, never asking the run-cache.)"""
    expected = hashes(team.repo)
    c = clone(team, tmp_path / "clone", team.remote_commit)
    assert run(["git", "diff", "--quiet", team.remote_commit, "HEAD", "--", ".dvc/config"],
               team.repo, check=False).returncode == 0  # the remote is in what was committed
    p = bash(team.restore, c, s3_client_env(tmp_path, AWS_ACCESS_KEY_ID=team.key,
                                         AWS_SECRET_ACCESS_KEY=team.secret))
    # prepare may run again (cheap, and byte-identical: the hashes below), as it did on a CI
    # clone where DVC could not pull its data; the model stages must be restored.
    for stage in STAGES[1:]:
        assert f"Running stage '{stage}'" not in p.stdout, p.stdout
    assert "trained " not in p.stdout and "Unable to pull" not in p.stdout, p.stdout
    assert hashes(c) == expected
    for name in ("models/train/model.pt", "models/export/model.onnx", "models/train/metrics.json",
                 "models/eval/metrics.json"):
        assert name in expected


def test_a_clone_of_the_committed_run_pulls_it_and_reruns_nothing(team, tmp_path):
    expected = hashes(team.repo)
    c = clone(team, tmp_path / "clone")
    env = s3_client_env(tmp_path, AWS_ACCESS_KEY_ID=team.key, AWS_SECRET_ACCESS_KEY=team.secret)
    run(["dvc", "pull", "--run-cache"], c, env=env)
    p = run(["dvc", "repro"], c, env=env)
    for stage in STAGES:
        assert f"Stage '{stage}' didn't change, skipping" in p.stdout, p.stdout
    assert hashes(c) == expected
    assert run(["git", "status", "--porcelain"], c).stdout == ""


def test_the_keys_are_in_no_committed_file_no_output_and_no_object_in_the_bucket(team, s3):  # noqa: F811
    import boto3

    secrets = (team.key.encode(), team.secret.encode())
    local = team.repo / ".dvc/config.local"
    assert all(s in local.read_bytes() for s in secrets)  # where they are, so the greps mean it
    assert run(["git", "check-ignore", "-q", ".dvc/config.local"], team.repo,
               check=False).returncode == 0
    revs = run(["git", "rev-list", "--all"], team.repo).stdout.split()
    found = run(["git", "grep", "-l", "-F", "-e", team.key, "-e", team.secret, *revs], team.repo,
                check=False)
    assert found.returncode == 1 and not found.stdout, found.stdout  # 1: no match, in any commit
    tracked = run(["git", "ls-files"], team.repo).stdout.splitlines()
    cache = [p for p in (team.repo / ".dvc/cache").rglob("*") if p.is_file()]
    assert any("runs" in p.parts for p in cache)  # the run-cache entries, which travel too
    for path in [team.repo / f for f in tracked] + outputs(team.repo) + cache:
        if path.is_file():
            assert not any(s in path.read_bytes() for s in secrets), path

    bucket = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.access_key,
                          aws_secret_access_key=s3.secret_key, region_name="us-east-1")
    keys = [o["Key"] for page in bucket.get_paginator("list_objects_v2").paginate(
        Bucket="team-dvc", Prefix="test_s3_dvc/") for o in page.get("Contents", [])]
    assert any(k.startswith("test_s3_dvc/runs/") for k in keys), keys  # the run-cache went up
    for k in keys:
        body = bucket.get_object(Bucket="team-dvc", Key=k)["Body"].read()
        assert not any(s in body for s in secrets), k


def make_share(repo: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return run(["make", "-s", "share", f"VENV={VENV_BIN.parent}"], repo, env=env, check=False)


def error_lines(p: subprocess.CompletedProcess) -> list[str]:
    """stderr less make's own `make: *** [...] Error 1`."""
    return [line for line in p.stderr.splitlines() if line.strip() and not line.startswith("make:")]


def test_a_wrong_or_missing_key_fails_and_make_share_says_so_naming_the_remote(team, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(team.repo, repo, symlinks=True)
    run(["dvc", "remote", "modify", "--local", "team", "secret_access_key", "not-the-secret"], repo)
    env = s3_client_env(tmp_path)
    before = {f: (repo / f).read_bytes() for f in ("dvc.lock", ".dvc/config")}
    keys = "`dvc remote modify --local team access_key_id KEY`"

    # DVC's own commands fail, naming the 403 but not the remote: their words are not ours.
    pushed = run(["dvc", "push"], repo, env=env, check=False)
    assert pushed.returncode != 0 and "Forbidden" in pushed.stderr, pushed.stderr
    assert "Traceback" not in pushed.stderr
    c = clone(team, tmp_path / "clone")
    pulled = run(["dvc", "pull"], c, env=s3_client_env(tmp_path, AWS_ACCESS_KEY_ID=team.key,
                                                     AWS_SECRET_ACCESS_KEY="not-the-secret"),
                 check=False)
    assert pulled.returncode != 0 and "Forbidden" in pulled.stderr, pulled.stderr
    assert not (c / "models/train/model.pt").exists()

    p = make_share(repo, env)
    assert p.returncode == 2 and len(error_lines(p)) == 1, p.stderr
    line = error_lines(p)[0]
    assert line.startswith(f"error: the DVC remote 'team' ({REMOTE}) refused this machine's "
                           "credentials: Forbidden (The request signature"), line
    assert keys in line and line.endswith("then rerun `make share`"), line

    (repo / ".dvc/config.local").unlink()  # no key anywhere: botocore's traceback, before
    p = make_share(repo, env)
    assert p.returncode == 2 and error_lines(p) == [
        f"error: the DVC remote 'team' ({REMOTE}) needs credentials and this machine has none: "
        f"set its keys with {keys} and `dvc remote modify --local team secret_access_key SECRET` "
        "(or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY), then rerun `make share`"], p.stderr
    assert {f: (repo / f).read_bytes() for f in before} == before


def test_an_experiment_pushed_with_dvc_exp_push_comes_back_on_a_fresh_clone(team, tmp_path):
    """`dvc exp push` sends the experiment's commit to the git remote and its outputs to the S3
    remote; a teammate's fresh clone pulls and applies it, byte for byte, running nothing."""
    origin = tmp_path / "origin.git"
    run(["git", "clone", "-q", "--bare", str(team.repo), str(origin)], tmp_path)
    work = tmp_path / "work"  # a teammate's own clone, with the keys of README's recipe
    run(["git", "clone", "-q", str(origin), str(work)], tmp_path)
    keys = s3_client_env(tmp_path, AWS_ACCESS_KEY_ID=team.key, AWS_SECRET_ACCESS_KEY=team.secret)
    run(["dvc", "pull", "-q"], work, env=keys)
    # Only evaluate reruns (its params changed): cheap, and a new output to share.
    ran = run(["dvc", "exp", "run", "-n", "eval-10", "-S", "eval.misclassified_max=10"], work,
              env=keys)
    assert "Running stage 'evaluate'" in ran.stdout and "Running stage 'train'" not in ran.stdout
    expected = hashes(work)
    run(["dvc", "exp", "push", "origin", "eval-10"], work, env=keys)

    other = tmp_path / "other"
    run(["git", "clone", "-q", str(origin), str(other)], tmp_path)
    p = run(["bash", "-ec", "dvc exp pull origin eval-10 && dvc exp apply eval-10"], other,
            env=keys)
    assert "Running stage" not in p.stdout + p.stderr
    assert hashes(other) == expected
