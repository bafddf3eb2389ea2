"""What a new user meets in the first hour, tested the way they met it."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

from PIL import Image

from stages.data import load_split
from tests.conftest import (
    ROOT,
    VENV_BIN,
    committed,
    copy_params,
    copy_repo,
    env_with,
    rendered_dom,
    run,
    set_params,
)


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
             "tests/experiment/test_config.py", "-k", "defaults_agree or whole_schema"], clone, check=False)
    assert p.returncode == 0, p.stdout[-2000:]
    assert "2 passed" in p.stdout
    copied = run([sys.executable, "-c", "import sys; from pathlib import Path; "
                  "from tests.conftest import copy_repo; "
                  "sys.stdout.write(copy_repo(Path(sys.argv[1])).joinpath('params.yaml').read_text())",
                  str(tmp_path / "copy")], clone).stdout
    assert "lr: 0.01" not in copied and "epochs: 7" not in copied
    assert copied.encode() == committed("params.yaml")


def test_the_way_back_to_main_works_where_main_was_never_built(tmp_path):
    """README's way back, on a clone whose DVC cache never held main's models: only an
    experiment with other params ran here."""
    repo = copy_repo(tmp_path / "repo", {"epochs": "2", "model.width": "8"})
    main_params = (repo / "params.yaml").read_text()
    run(["dvc", "exp", "run", "-S", "lr=0.01"], repo)
    assert "lr: 0.01" in (repo / "params.yaml").read_text()
    way_back = re.search(r"```bash\n(git checkout -- params.yaml dvc.lock models && dvc repro)\n```",
                         (ROOT / "README.md").read_text())[1]
    p = run(["bash", "-c", way_back], repo)
    assert "Running stage 'train'" in p.stdout  # retrained: nothing to restore it from
    assert (repo / "params.yaml").read_text() == main_params
    assert run(["dvc", "status"], repo).stdout.strip() == "Data and pipelines are up to date."
    test = load_split(repo / "data/prepared", "test")
    Image.fromarray(test.x[0, 0].numpy()).save(tmp_path / "digit.png")
    p = run([sys.executable, "-m", "stages.predict", str(tmp_path / "digit.png"), "--json"], repo)
    assert json.loads(p.stdout)["label"] in [str(d) for d in range(10)]


def test_workspace_runs_are_named_apart(tmp_path, monkeypatch):
    """Five `dvc repro` runs with other lr and epochs were all `workspace@967714c`."""
    from reprotrain.tracking import run_name

    copy_params(tmp_path)
    run(["git", "init", "-q"], tmp_path)
    run(["git", "add", "params.yaml"], tmp_path)
    run(["git", "commit", "-qm", "params"], tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    names = []
    for edit in ({}, {"lr": "0.01"}, {"lr": "0.01", "epochs": "5"}, {"train.warmup_epochs": "2"}):
        copy_params(tmp_path)
        set_params(tmp_path / "params.yaml", edit)
        names.append(run_name())
    commit = run(["git", "rev-parse", "--short=7", "HEAD"], tmp_path).stdout.strip()
    assert names[0].startswith(f"workspace@{commit} ") and names[1].startswith("lr=0.01 ")
    # What differs first: the UI's runs table shows about 20 characters of a name.
    assert names[2].startswith(f"lr=0.01 epochs=5 workspace@{commit} ")
    assert names[3].startswith(f"train.warmup_epochs=2 workspace@{commit} ")
    assert len(set(n.rsplit(" ", 1)[0] for n in names)) == 4  # apart even within one second
    monkeypatch.setenv("DVC_EXP_NAME", "lated-dita")
    assert run_name() == "lated-dita"


def test_predict_warns_on_digits_drawn_dark_on_light(tmp_path, exported):
    """The shipped samples (test-split digits, light on dark) pass quietly; the same drawn the
    way people draw, dark on light, are flagged, in the text and in --json."""
    from PIL import ImageOps

    model = exported / "model.safetensors"
    samples = sorted((ROOT / "data/samples").glob("*.png"))
    assert [p.stem for p in samples] == [str(d) for d in range(10)]
    for p in samples:
        ImageOps.invert(Image.open(p).convert("L")).save(tmp_path / f"inv{p.name}")
    args = [sys.executable, "-m", "stages.predict", "--model", str(model)]
    env = env_with(PYTHONPATH=str(ROOT))
    quiet = run([*args, *map(str, samples)], tmp_path, env=env)
    assert "warning" not in quiet.stderr and len(quiet.stdout.splitlines()) == 10
    dark = run([*args, *map(str, sorted(tmp_path.glob("inv*.png")))], tmp_path, env=env)
    assert dark.stderr.count("warning: ") == 10 and "brighter than what the model learned" \
        in dark.stderr, dark.stderr
    assert dark.stderr.count("light strokes on a dark background") == 1  # the reason once
    rows = [json.loads(ln) for ln in run([*args, "--json", str(tmp_path / "inv3.png")], tmp_path,
                                         env=env).stdout.splitlines()]
    assert "far from the training images'" in rows[0]["warning"]


def data_recipe() -> str:
    """docs/data.md's "Bring your own data" block, as a user pastes it."""
    text = (ROOT / "docs/data.md").read_text()
    return text.split("## Bring your own data", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_dvc_sees_every_dvc_file_the_data_recipe_makes_in_data_raw():
    """`/data/raw/*` in .gitignore made DVC's ignore check answer true for `data/raw/` itself:
    DVC never read `data/raw/<name>.dvc`, and its next checkout deleted the folder."""
    from dvc.repo import Repo

    with Repo(str(ROOT)) as repo:
        assert not repo.scm.is_ignored(f"{ROOT}/data/raw/")
        assert not repo.scm.is_ignored(f"{ROOT}/data/raw/shapes.dvc")
        assert repo.scm.is_ignored(f"{ROOT}/data/raw/cifar-10-python.tar.gz")  # downloads stay out


def test_the_data_recipe_as_written_trains_on_the_folder_and_keeps_every_file(tmp_path):
    """docs/data.md's block, line for line, on a fresh copy: the folder in data/raw/ trains the
    model and stays whole; DVC watches it and `make share` sends it. Then the other places a
    user puts data: at the top of the repo, and outside it (by absolute path)."""
    from tests.support.image_files import CLASSES, make_folder

    repo = copy_repo(tmp_path / "repo")
    (repo / ".venv").symlink_to(VENV_BIN.parent)  # `make share` on the tests' venv
    make_folder(repo / "data/raw/shapes", per_class=15, bad=False)
    before = files_of(repo / "data/raw/shapes")
    p = run(["bash", "-eo", "pipefail", "-c", data_recipe()], repo)
    assert files_of(repo / "data/raw/shapes") == before
    assert "Running stage 'train'" in p.stdout
    assert json.loads((repo / "data/prepared/meta.json").read_text())["classes"] == list(CLASSES)
    assert run(["git", "status", "--porcelain", "data/raw"], repo).stdout == ""  # all committed

    # DVC watches the folder: an edit shows, and the remote gets it.
    victim = next(iter(sorted((repo / "data/raw/shapes/circle").iterdir())))
    victim.unlink()
    assert "data/raw/shapes.dvc" in run(["dvc", "status"], repo).stdout
    run(["dvc", "checkout", "data/raw/shapes.dvc"], repo)
    assert files_of(repo / "data/raw/shapes") == before
    store = tmp_path / "store"
    run(["dvc", "remote", "add", "-d", "--local", "storage", str(store)], repo)
    run(["make", "-s", "share"], repo)
    dir_md5 = re.search(r"md5: (\w+\.dir)", (repo / "data/raw/shapes.dvc").read_text())[1]
    assert (store / "files/md5" / dir_md5[:2] / dir_md5[2:]).is_file()

    # At the top of the repository, and outside it: the same model, every file kept.
    shutil.copytree(repo / "data/raw/shapes", repo / "shapes")
    outside = shutil.copytree(repo / "data/raw/shapes", tmp_path / "elsewhere/shapes")
    run(["bash", "-eo", "pipefail", "-c", "dvc add shapes && git add shapes.dvc .gitignore && "
         "git commit -qm 'shapes at the top' && dvc exp run -S data.root=shapes"], repo)
    assert files_of(repo / "shapes") == before
    refused = run(["dvc", "add", str(outside)], repo, check=False)
    assert "outside of DVC project" in refused.stderr  # docs/data.md says so, and what to do
    run(["dvc", "exp", "run", "-S", f"data.root={outside}"], repo)
    assert files_of(outside) == files_of(repo / "shapes") == files_of(repo / "data/raw/shapes") \
        == before
    assert json.loads((repo / "data/prepared/meta.json").read_text())["classes"] == list(CLASSES)


def test_the_confusion_chart_writes_every_nonzero_count_and_has_no_bare_checkbox(tmp_path):
    """The plots page of main's committed results: DVC's `confusion` template put a bare
    `showValues` checkbox above the F1 chart, and its two off-diagonal 1s were near-white beside
    a diagonal of 36. Each nonzero cell now has its count written in it and a color apart from
    the empty cells'."""
    from collections import Counter

    repo = copy_repo(tmp_path / "repo")
    run(["dvc", "plots", "show", "-o", str(tmp_path / "plots")], repo, env=env_with())
    dom = rendered_dom(tmp_path / "plots/index.html", tmp_path)
    assert dom.count('class="marks"') == 5 and 'type="checkbox"' not in dom, dom[-3000:]

    def cell(label: str) -> tuple[tuple[str, str], int]:
        f = dict(part.split(": ") for part in label.split("; "))
        return (f["actual"], f["predicted"]), int(f["count"])

    rows = (repo / "models/eval/confusion.csv").read_text().splitlines()[1:]
    counts = Counter(tuple(row.split(",")) for row in rows)
    assert any(a != p for a, p in counts) and min(counts.values()) == 1  # small errors to show
    texts = re.findall(r'<text aria-label="([^"]*count: \d+)"[^>]*>(\d+)</text>', dom)
    assert all(cell(label)[1] == int(text) for label, text in texts)  # each count in its cell
    assert dict(cell(label) for label, _ in texts) == dict(counts), texts
    fills = {cell(label): fill for label, fill in re.findall(
        r'<path aria-label="([^"]*count: \d+)"[^>]*aria-roledescription="rect mark"[^>]*fill="([^"]+)"',
        dom)}
    assert len(fills) == 100  # every cell of 10 x 10, empty ones too
    empty = {fill for (_, n), fill in fills.items() if n == 0}
    ones = {fill for (_, n), fill in fills.items() if n == 1}
    assert len(empty) == 1 and len(ones) == 1 and empty != ones, (empty, ones)


def test_a_lock_whose_models_no_one_shared_says_so_before_training(tmp_path):
    """A clone whose committed dvc.lock names models this machine cannot have (trained elsewhere,
    never shared): DVC prints "Unable to pull" and trains again; `make repro` says why first. Not
    when the lock is another run's (other params), where training is what anyone expects."""
    repo = copy_repo(tmp_path / "repo", {"epochs": "2", "model.width": "8"})
    make = ["make", "-s", "repro", f"VENV={Path(sys.executable).parent.parent}"]
    first = run(make, repo)
    assert "no copy of what dvc.lock names" not in first.stdout  # main's lock: other params
    run(["git", "commit", "-qam", "a run"], repo)
    shutil.rmtree(repo / ".dvc/cache")  # as on another machine: the lock, and nothing it names
    for out in ("data/prepared", "models/train/model.pt", "models/export"):
        shutil.rmtree(repo / out) if (repo / out).is_dir() else (repo / out).unlink()
    again = run(make, repo).stdout
    note = "train: no copy of what dvc.lock names for these params and code (models/train/"
    assert note in again and again.index(note) < again.index("trained cnn"), again
    assert "and 4 more) is here or on a DVC remote" in again  # sha256, made_on, metrics, history
    assert again.count("no copy of what dvc.lock names") == 1
    # Other data with the same training params (a folder, shards): training anew is expected,
    # and it said the lock's models were never shared.
    shutil.rmtree(repo / ".dvc/cache")
    set_params(repo / "params.yaml", {"data.val_fraction": "0.15"})
    other = run(make, repo).stdout
    assert "trained cnn" in other and "no copy of what dvc.lock names" not in other, other
