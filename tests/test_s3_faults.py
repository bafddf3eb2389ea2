"""Faults of a team's S3 storage, each one line naming the remote or the bucket and what to do,
never a botocore traceback, and nothing half pushed (issue 33, item 5), against a real S3 server
(SeaweedFS, stages/team/s3.py): a missing bucket, the server down before or killed during a
push, a bucket over its quota, a certificate from a private CA, and `make server`'s check of
its artifact bucket. A workspace of a few small files and a one-stage `dvc.yaml` is enough:
`make share` runs `python -m stages.team.share`, as here."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stages.team.s3 import S3, start, stop
from tests.conftest import ROOT, run
from tests.support.services import free_port, s3, server_env  # noqa: F401 - the fixture
from tests.test_s3_dvc import client_env


def workspace(path: Path, s3: S3, url: str, files: int = 5, size: int = 1000) -> Path:  # noqa: F811
    """git and DVC, `files` random files in data/, a stage copying them to out/ (run, so the
    run-cache has an entry), committed; the remote `team` at `url` on `s3`, its keys local."""
    path.mkdir(parents=True)
    env = client_env(path)
    run(["git", "init", "-q", "-b", "main"], path, env=env)
    run(["dvc", "init", "-q"], path, env=env)
    (path / "data").mkdir()
    for i in range(files):
        (path / "data" / f"{i:04}.bin").write_bytes(os.urandom(size))
    (path / "dvc.yaml").write_text("stages:\n  copy:\n    cmd: cp -r data out\n    deps: [data]\n"
                                   "    outs: [out]\n")
    run(["dvc", "repro", "-q"], path, env=env)
    for line in (["dvc", "remote", "add", "-d", "team", url],
                 ["dvc", "remote", "modify", "team", "endpointurl", s3.endpoint],
                 ["dvc", "remote", "modify", "--local", "team", "access_key_id", s3.access_key],
                 ["dvc", "remote", "modify", "--local", "team", "secret_access_key", s3.secret_key],
                 ["git", "add", "-A"], ["git", "commit", "-qm", "data"]):
        run(line, path, env=env)
    return path


def share(w: Path, **env: str) -> subprocess.CompletedProcess:
    """What `make share` runs, in `w`."""
    return run([sys.executable, "-m", "stages.team.share"], w, check=False,
               env=client_env(w.parent, PYTHONPATH=str(ROOT), **env))


def one_line(p: subprocess.CompletedProcess) -> str:
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    return lines[0]


def client(s3: S3, **kw):  # noqa: F811
    import boto3

    return boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.access_key,
                        aws_secret_access_key=s3.secret_key, region_name="us-east-1", **kw)


def keys(s3: S3, bucket: str, prefix: str = "") -> set[str]:  # noqa: F811
    c = client(s3, verify=str(s3.ca) if s3.ca else None)
    return {o["Key"] for page in c.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix) for o in page.get("Contents", [])}


def files(w: Path) -> dict[str, str]:
    return {str(p.relative_to(w)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted((w / "out").rglob("*")) if p.is_file()}


def pulled(w: Path, dest: Path, **env: str) -> subprocess.CompletedProcess:
    """A clone of `w` with its keys, `dvc pull`ed: what another machine gets from the remote."""
    run(["git", "clone", "-q", str(w), str(dest)], dest.parent)
    shutil.copy(w / ".dvc/config.local", dest / ".dvc/config.local")
    return run(["dvc", "pull"], dest, env=client_env(dest.parent, **env), check=False)


def test_a_missing_bucket_is_one_line_naming_it_and_is_not_created(s3, tmp_path):  # noqa: F811
    w = workspace(tmp_path / "w", s3, "s3://no-such-bucket/dvc")

    # DVC's own words: neither the remote nor what to do.
    p = run(["dvc", "push"], w, env=client_env(tmp_path), check=False)
    assert p.returncode == 255 and p.stderr.startswith(
        "ERROR: unexpected error - The specified bucket does not exist: An error occurred "
        "(NoSuchBucket) when calling the ListObjectsV2 operation"), p.stderr

    assert one_line(share(w)) == (
        "error: the DVC remote 'team' (s3://no-such-bucket/dvc) names the bucket "
        f"'no-such-bucket', which does not exist on {s3.endpoint}: create it (`aws s3 mb "
        "s3://no-such-bucket`, or ask whoever runs the S3 server) or point the remote at one "
        "that does (`dvc remote modify team url s3://BUCKET/PATH`), then rerun `make share`")
    # Before, the run-cache's upload (s3fs) made the bucket with these keys, and pushed there.
    assert "no-such-bucket" not in {b["Name"] for b in client(s3).list_buckets()["Buckets"]}
