"""requirements.lock is pyproject.toml's dependencies, resolved and pinned with hashes: a test
fails as soon as the two disagree, naming the package and the fix (`make lock`)."""

from __future__ import annotations

import re
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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
