"""Export and every stage's writes: exports are the same bytes from any clone and
readable by all, the opset and check batch sizes are checked, and every write on a full, size
limited or forbidden disk is one line that keeps the previous outputs. Each fault is real: a
small tmpfs, `ulimit -f`, an immutable folder."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from stages.config import ModelConfig
from stages.export import export_onnx, export_program, export_pt2
from stages.lib import files
from stages.models import build_model
from tests.conftest import ROOT, copy_params, env_with, set_params
from tests.support.workspaces import one_error_line


def test_exports_hold_no_paths_and_keep_a_dynamic_batch(tmp_path):
    torch.manual_seed(0)
    model = build_model(ModelConfig(width=4), channels=1, num_classes=3, image_size=16).eval()
    example = torch.randn(2, 1, 16, 16)
    program = export_program(model, example)
    export_onnx(program, tmp_path / "m.onnx", opset=18)
    export_pt2(program, tmp_path / "m.pt2")
    venv = sys.prefix.encode()
    for name in ("m.onnx", "m.pt2"):
        data = (tmp_path / name).read_bytes()
        assert str(ROOT).encode() not in data and venv not in data, name
        assert b"site-packages" not in data, name
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    for batch in (1, 7):
        x = torch.randn(batch, 1, 16, 16)
        got = session.run(None, {"image": x.numpy()})[0]
        with torch.no_grad():
            np.testing.assert_allclose(got, model(x).numpy(), atol=1e-4)
    first = (tmp_path / "m.pt2").read_bytes()
    export_pt2(export_program(model, example), tmp_path / "m.pt2")  # a second export, same bytes
    assert (tmp_path / "m.pt2").read_bytes() == first


def test_outputs_are_world_readable_also_safetensors(tmp_path):
    from safetensors.torch import save_file

    umask = os.umask(0o022)
    try:
        path = files.atomic_write(tmp_path / "model.safetensors",
                                  lambda p: save_file({"w": torch.zeros(3)}, p))
    finally:
        os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o644


def stage(w: Path, name: str, mlflow_uri: str, fsize: int | None = None,
          check: bool = False) -> subprocess.CompletedProcess:
    """`python -m stages.<name>` in w; with fsize, under `ulimit -f` (bytes)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    p = subprocess.run([sys.executable, "-m", f"stages.{name}"], cwd=w, capture_output=True,
                       text=True, timeout=300, preexec_fn=limit if fsize else None,
                       env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri))
    assert not check or p.returncode == 0, p.stderr[-3000:]
    return p


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under folder, temp and scratch files included."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def failed_keeping(p: subprocess.CompletedProcess, folder: Path, before: dict[str, bytes]) -> str:
    """Exit 1 with one error line, every previous file byte-identical and nothing added."""
    line = one_error_line(p.stderr)
    assert p.returncode == 1, p.stderr
    assert snapshot(folder) == before
    return line


@pytest.fixture(scope="module")
def exported_ws(trained, tmp_path_factory, mlflow_uri):  # noqa: F811
    """A trained, evaluated and exported workspace (export.log_model off: faster)."""
    w = tmp_path_factory.mktemp("exported") / "w"
    shutil.copytree(trained, w)
    set_params(w / "params.yaml", {"export.log_model": "false"})
    stage(w, "evaluate", mlflow_uri, check=True)
    stage(w, "export", mlflow_uri, check=True)
    return w


def copy_of(exported_ws: Path, dest: Path, **params: str) -> Path:
    shutil.copytree(exported_ws, dest, dirs_exist_ok=True)
    text = (dest / "params.yaml").read_text()
    if "check_batch_sizes" in params:  # a block list in the file: set_params edits one line
        text = text.replace("  check_batch_sizes:\n  - 1\n  - 7\n",
                            f"  check_batch_sizes: {params.pop('check_batch_sizes')}\n")
        (dest / "params.yaml").write_text(text)
    set_params(dest / "params.yaml", params)
    return dest


def onnx_opset(path: Path) -> int:
    import onnx

    return next(o.version for o in onnx.load(str(path)).opset_import if o.domain in ("", "ai.onnx"))


# ------------------------------------------------------------ export.opset


@pytest.mark.parametrize("opset, expected", [
    (17, "export.opset=17 is invalid: must be >= 18, the oldest opset torch.onnx writes"),
    (99, "export.opset=99 is invalid: onnx 1."),
])
def test_an_opset_the_exporter_cannot_write_fails_and_keeps_the_export(
        exported_ws, tmp_path, mlflow_uri, opset, expected):
    w = copy_of(exported_ws, tmp_path / "w", **{"export.opset": str(opset)})
    before = snapshot(w / "models/export")
    p = stage(w, "export", mlflow_uri)
    assert expected in failed_keeping(p, w / "models/export", before)
    assert onnx_opset(w / "models/export/model.onnx") == 18


def test_the_onnx_file_has_the_opset_model_json_names(exported_ws, tmp_path, mlflow_uri):
    assert onnx_opset(exported_ws / "models/export/model.onnx") == 18
    w = copy_of(exported_ws, tmp_path / "w", **{"export.opset": "20"})
    stage(w, "export", mlflow_uri, check=True)
    assert json.loads((w / "models/export/model.json").read_text())["onnx_opset"] == 20
    assert onnx_opset(w / "models/export/model.onnx") == 20


def test_an_export_that_logs_the_model_prints_no_mlflow_info_line(exported_ws, tmp_path, mlflow_uri):
    """Issue 57: every export printed `INFO mlflow.models.signature: Running the predict
    function to generate output based on input example`."""
    w = copy_of(exported_ws, tmp_path / "w", **{"export.log_model": "true"})
    p = stage(w, "export", mlflow_uri, check=True)
    assert "mlflow.models.signature" not in p.stderr and " INFO " not in p.stderr, p.stderr


# ------------------------------------------------------------ export.check_batch_sizes


@pytest.mark.parametrize("sizes, expected", [
    ("[1, 100000]", "export.check_batch_sizes=[1, 100000] is invalid: give at least two "
                    "different batch sizes from 1 to 65536"),
    ("[1, 7, 1000]", "export.check_batch_sizes=[1, 7, 1000] is invalid: the test split "
                     "(data/prepared/test.pt) has 360 images; use batch sizes up to 360"),
])
def test_check_batch_sizes_beyond_the_test_split_fail_before_any_write(
        exported_ws, tmp_path, mlflow_uri, sizes, expected):
    w = copy_of(exported_ws, tmp_path / "w", check_batch_sizes=sizes)
    before = snapshot(w / "models/export")
    assert expected in failed_keeping(stage(w, "export", mlflow_uri), w / "models/export", before)


# ------------------------------------------------------------ full, limited, forbidden disks


@contextmanager
def small_disk(path: Path, size_kb: int):
    """A real tmpfs of size_kb at path (root only; skips elsewhere)."""
    path.mkdir(parents=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if p.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def fill(disk: Path, leave: int) -> None:
    """Fill disk up, then give back `leave` bytes (whole pages)."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:  # unbuffered: close has nothing left to fail on
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    os.truncate(filler, max(0, filler.stat().st_size - leave))


def export_size(w: Path) -> int:
    return sum(p.stat().st_size for p in (w / "models/export").iterdir())


def test_export_on_a_full_disk_is_one_line_and_keeps_the_export(exported_ws, tmp_path, mlflow_uri):
    # Room for some of the new files, not all: none may replace its previous one.
    size = export_size(exported_ws)
    with small_disk(tmp_path / "disk", 4096) as disk:
        w = copy_of(exported_ws, disk / "w")
        before = snapshot(w / "models/export")
        fill(disk, size // 2)
        line = failed_keeping(stage(w, "export", mlflow_uri), w / "models/export", before)
    assert "disk full while writing models/export/model." in line
    assert "is intact. Free space on the disk of" in line


def test_export_past_the_file_size_limit_is_one_line_and_keeps_the_export(
        exported_ws, tmp_path, mlflow_uri):
    w = copy_of(exported_ws, tmp_path / "w")
    before = snapshot(w / "models/export")
    largest = max(p.stat().st_size for p in (w / "models/export").iterdir())
    p = stage(w, "export", mlflow_uri, fsize=largest // 2)
    line = failed_keeping(p, w / "models/export", before)
    assert "file size limit reached" in line and "ulimit -f unlimited" in line


@contextmanager
def immutable(folder: Path):
    p = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
    if p.returncode:
        pytest.skip(f"cannot make a folder immutable here: {p.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_export_into_a_forbidden_folder_is_one_line_and_keeps_the_export(
        exported_ws, tmp_path, mlflow_uri):
    w = copy_of(exported_ws, tmp_path / "w")
    before = snapshot(w / "models/export")
    with immutable(w / "models/export"):  # root ignores modes, not the immutable flag: EPERM
        line = failed_keeping(stage(w, "export", mlflow_uri), w / "models/export", before)
    assert "operation not permitted" in line and "models/export" in line
    assert "writable for this user" in line


@pytest.mark.parametrize("locked", ["model.onnx", "model.pt2", "model.json"])
def test_export_over_an_immutable_file_keeps_the_whole_previous_export(
        exported_ws, tmp_path, mlflow_uri, locked):
    """The rename fails, not the write: the files renamed before it are put back (another
    opset, so each new file differs), and no temp file is left."""
    w = copy_of(exported_ws, tmp_path / "w", **{"export.opset": "20"})
    before = snapshot(w / "models/export")
    with immutable(w / "models/export" / locked):
        line = failed_keeping(stage(w, "export", mlflow_uri), w / "models/export", before)
    assert "operation not permitted" in line and f"models/export/{locked}" in line


@pytest.mark.parametrize(("name", "locked"), [("train", "metrics.json"), ("train", "history.csv"),
                                             ("evaluate", "metrics.json"),
                                             ("evaluate", "misclassified.png")])
def test_a_stage_over_an_immutable_output_keeps_all_its_previous_outputs(
        exported_ws, tmp_path, mlflow_uri, name, locked):
    """train's model.pt, checksum, metrics.json and history.csv are one set, as are evaluate's
    five outputs: a new model never sits beside the previous run's metrics."""
    w = copy_of(exported_ws, tmp_path / "w", **({"lr": "0.01"} if name == "train" else {}))
    out = w / "models" / ("train" if name == "train" else "eval")
    if name == "evaluate":  # the same model evaluates to the same bytes: make any new file show
        for f in out.iterdir():
            f.write_bytes(b"previous " + f.name.encode())
    before = snapshot(out)
    with immutable(out / locked):
        line = failed_keeping(stage(w, name, mlflow_uri), out, before)
    assert "operation not permitted" in line and f"{out.relative_to(w)}/{locked}" in line


# ------------------------------------------------------------ prepare (folder source), any write


@pytest.fixture
def folder_ws(tmp_path):
    """An image folder of 3 classes x 100 PNGs (32x32: 1 KiB a decoded image), and the params
    to prepare it."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in ("a", "b", "c"):
        (tmp_path / "raw" / c).mkdir(parents=True)
        for i in range(100):
            Image.fromarray(rng.integers(0, 255, (32, 32), dtype=np.uint8)).save(
                tmp_path / "raw" / c / f"{i}.png")
    copy_params(tmp_path)
    set_params(tmp_path / "params.yaml", {"data.source": "folder", "data.root": str(tmp_path / "raw"),
                                          "data.image_size": "32", "data.num_workers": "1"})
    return tmp_path


@pytest.mark.parametrize("free_kb, fails_at", [
    (100, ".train.npy"),  # the 210 KiB scratch file of the train split cannot be reserved
    (400, "train.pt"),  # the 300 KiB scratch files fit, the split then written does not
])
def test_prepare_on_a_full_disk_is_one_line_and_keeps_the_data(folder_ws, mlflow_uri,
                                                               free_kb, fails_at):
    with small_disk(folder_ws / "disk", 2048) as disk:
        shutil.copy(folder_ws / "params.yaml", disk)
        stage(disk, "prepare", mlflow_uri, check=True)
        before = snapshot(disk / "data")
        fill(disk, free_kb * 1024)
        line = failed_keeping(stage(disk, "prepare", mlflow_uri), disk / "data", before)
    assert f"disk full while writing data/prepared/{fails_at}" in line, line


def test_prepare_past_the_file_size_limit_is_one_line_and_keeps_the_data(folder_ws, mlflow_uri):
    stage(folder_ws, "prepare", mlflow_uri, check=True)
    before = snapshot(folder_ws / "data")
    p = stage(folder_ws, "prepare", mlflow_uri, fsize=100 * 1024)
    line = failed_keeping(p, folder_ws / "data", before)
    assert "file size limit reached" in line and "data/prepared/.train.npy" in line


@pytest.mark.parametrize("locked", ["meta.json", "rejected.csv", "val.pt"])
def test_prepare_over_an_immutable_file_keeps_the_previous_data(folder_ws, mlflow_uri, locked):
    """New splits never sit beside the previous meta.json: all of data/prepared or none."""
    stage(folder_ws, "prepare", mlflow_uri, check=True)
    before = snapshot(folder_ws / "data")
    set_params(folder_ws / "params.yaml", {"seed": "7"})  # another split: every file differs
    with immutable(folder_ws / "data/prepared" / locked):
        line = failed_keeping(stage(folder_ws, "prepare", mlflow_uri), folder_ws / "data", before)
    assert "operation not permitted" in line and f"data/prepared/{locked}" in line


@pytest.mark.parametrize("fault", ["read-only disk", "full disk"])
def test_a_torch_save_that_fails_is_one_oserror_and_keeps_the_file(tmp_path, fault):
    """torch.save turns a full disk into its zip writer's RuntimeError; checkpoints and the
    prepared splits are written with it."""
    import torch

    from stages.lib import files

    with small_disk(tmp_path / "disk", 256) as disk:
        (disk / "model.pt").write_bytes(b"previous")
        if fault == "read-only disk":
            subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        else:
            fill(disk, 0)
        with pytest.raises(OSError) as err:
            files.save_torch(disk / "model.pt", {"x": torch.zeros(100_000)})
        assert (disk / "model.pt").read_bytes() == b"previous"
        assert {p.name for p in disk.iterdir()} - {"filler"} == {"model.pt"}  # no temp file
    assert str(disk / "model.pt") in err.value.strerror and "the previous model.pt" in err.value.strerror
    assert err.value.errno == (errno.EROFS if fault == "read-only disk" else errno.ENOSPC)


def test_a_model_and_its_checksum_are_replaced_together_or_not_at_all(tmp_path):
    """train's model.pt and model.sha256: a checksum that cannot be written (here immutable: the
    rename fails) must not leave the new model beside the previous checksum."""
    import torch

    from stages.lib import files

    model = files.save_torch_verified(tmp_path / "model.pt", {"x": torch.zeros(10)})
    before = snapshot(tmp_path)
    with immutable(tmp_path / "model.sha256"), pytest.raises(OSError) as err:
        files.save_torch_verified(model, {"x": torch.ones(10)})
    assert snapshot(tmp_path) == before  # both previous files, no temp or backup left
    files.verify_digest(model)
    assert err.value.errno == errno.EPERM and str(tmp_path / "model.sha256") in err.value.strerror
