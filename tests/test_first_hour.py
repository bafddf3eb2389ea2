"""What a new user meets in the first hour, tested the way they met it."""

from __future__ import annotations

import shutil
import sys

from tests.conftest import ROOT, committed, copy_repo, run, set_params


def test_the_suite_ignores_the_experiment_in_progress(tmp_path):
    """`dvc exp run -S lr=0.01` leaves its params (and results) in the workspace; a hand edit
    of epochs too. The tests read params, lock and results as committed, and pass."""
    clone = copy_repo(tmp_path / "clone")
    shutil.copytree(ROOT / "tests", clone / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    run(["git", "add", "tests"], clone)
    run(["git", "commit", "-qm", "tests"], clone)
    set_params(clone / "params.yaml", {"lr": "0.01", "epochs": "7"})
    (clone / "models/eval/metrics.json").write_text('{"accuracy": 0.5}\n')
    p = run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
             "tests/test_config.py", "-k", "defaults_agree or whole_schema"], clone, check=False)
    assert p.returncode == 0, p.stdout[-2000:]
    assert "2 passed" in p.stdout
    copied = run([sys.executable, "-c", "import sys; from pathlib import Path; "
                  "from tests.conftest import copy_repo; "
                  "sys.stdout.write(copy_repo(Path(sys.argv[1])).joinpath('params.yaml').read_text())",
                  str(tmp_path / "copy")], clone).stdout
    assert "lr: 0.01" not in copied and "epochs: 7" not in copied
    assert copied.encode() == committed("params.yaml")
