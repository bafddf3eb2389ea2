"""Real services for the team set-up tests: a throwaway PostgreSQL cluster in a temp folder, on a
free loopback port. `.ci/run` installs Debian's postgresql where it is missing."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def free_port() -> int:
    """A loopback port nothing listens on now (closed again when the socket goes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def postgres_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


def as_postgres(*argv: str | Path) -> list[str]:
    """initdb and the server refuse to run as root: they run as Debian's `postgres` user."""
    argv = [str(a) for a in argv]
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


@contextmanager
def postgres_cluster(folder: Path) -> Iterator[str]:
    """A PostgreSQL server on loopback for the duration; yields its URI without a database
    (`f"{uri}/name"` after `create_database(uri, "name")`). Trust auth: loopback, a test."""
    bin_dir = postgres_bin()
    if bin_dir is None or (os.geteuid() == 0 and shutil.which("runuser") is None):
        pytest.skip("needs PostgreSQL's binaries (Debian's postgresql; .ci/run installs it)")
    folder.mkdir(parents=True, exist_ok=True)
    data, sockets = folder / "pgdata", folder / "pgsock"
    sockets.mkdir(exist_ok=True)
    if os.geteuid() == 0:
        for p in (folder, sockets):
            shutil.chown(p, "postgres")
        for parent in folder.parents:  # pytest's tmp folders are 0700: postgres must get through
            if parent == Path("/tmp") or parent == Path("/"):
                break
            parent.chmod(parent.stat().st_mode | 0o711)
    subprocess.run(as_postgres(bin_dir / "initdb", "-D", data, "-U", "postgres", "-A", "trust",
                               "--no-sync", "-E", "UTF8"), check=True, capture_output=True)
    port = free_port()
    options = (f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1 -c fsync=off "
               "-c synchronous_commit=off -c full_page_writes=off")
    subprocess.run(as_postgres(bin_dir / "pg_ctl", "-D", data, "-o", options, "-l",
                               folder / "postgres.log", "-w", "-t", "60", "start"),
                   check=True, capture_output=True)
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}"
    finally:
        subprocess.run(as_postgres(bin_dir / "pg_ctl", "-D", data, "-m", "immediate", "stop"),
                       capture_output=True)


def create_database(uri: str, name: str) -> str:
    """A new empty database on the cluster; returns its URI."""
    import psycopg

    with psycopg.connect(f"{uri}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"{uri}/{name}"


@pytest.fixture(scope="session")
def postgres(tmp_path_factory) -> Iterator[str]:
    """One cluster for the test session (each test creates its own database)."""
    with postgres_cluster(tmp_path_factory.mktemp("postgres")) as uri:
        yield uri
