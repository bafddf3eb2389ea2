"""Fault injection: each case injects the fault for real (a real process, file, port or signal)
and asserts that nothing is lost and the message says what to do."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from stages import files
from stages.checkpoints import CheckpointError, latest_checkpoint, save_checkpoint
from stages.data import save_prepared
from stages.loop import OutOfMemory
from tests.conftest import ROOT, copy_params, copy_repo, env_with, run, set_params
from tests.training import cnn, fit, fit_ckpt, linear_model, same_weights

# ------------------------------------------------------------ 1, 2: broken checkpoint files


def test_kill_during_a_checkpoint_write_loses_nothing(digits, tmp_path):
    full = fit_ckpt(cnn(), digits, tmp_path / "full", epochs=3)
    part = tmp_path / "part"
    fit_ckpt(cnn(), digits, part, epochs=3)
    last = (part / "epoch-0003.pt").read_bytes()
    # What a kill leaves behind: the epoch-3 temp file complete but not renamed, a second one
    # cut mid-file, and (killed between rename and checksum) a renamed file without checksum.
    (part / "epoch-0003.pt").unlink()
    (part / "epoch-0003.sha256").unlink()
    (part / ".epoch-0003.abc123.tmp.pt").write_bytes(last)
    (part / ".epoch-0003.def456.tmp.pt").write_bytes(last[: len(last) // 3])
    (part / "epoch-0003.pt").write_bytes(last)
    with pytest.warns(UserWarning, match="epoch-0003.pt is unusable.*checksum missing"):
        state = latest_checkpoint(part)
    assert state["epoch"] == 2
    assert not list(part.glob(".*.tmp.pt"))  # stale temp files cleaned up
    resumed = fit_ckpt(cnn(seed=5), digits, part, epochs=3, resume=state)
    assert same_weights(full.model, resumed.model)


@pytest.mark.parametrize("damage", ["truncate", "bitflip"])
def test_damaged_latest_checkpoint_falls_back_with_a_warning(digits, tmp_path, damage):
    fit_ckpt(linear_model(), digits, tmp_path, epochs=2)
    latest = tmp_path / "epoch-0002.pt"
    data = bytearray(latest.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 100]
    else:
        data[len(data) // 2] ^= 0x01
    latest.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="epoch-0002.pt is unusable"):
        assert latest_checkpoint(tmp_path)["epoch"] == 1


def test_no_usable_checkpoint_fails_naming_the_files_never_restarts_silently(digits, tmp_path):
    fit_ckpt(linear_model(), digits, tmp_path, epochs=2)
    for p in tmp_path.glob("epoch-*.pt"):
        p.write_bytes(p.read_bytes()[:50])
    with pytest.warns(UserWarning), pytest.raises(CheckpointError) as err:
        latest_checkpoint(tmp_path)
    assert "epoch-0001.pt" in str(err.value) and "train.resume: never" in str(err.value)


# ------------------------------------------------------------ 7: a malicious pickle


class Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))  # would create the marker file when unpickled


def test_a_malicious_pickle_is_refused_and_never_runs(tmp_path, digits):
    marker = tmp_path / "pwned"
    work = tmp_path / "work"
    work.mkdir()
    copy_params(work)
    save_prepared(work / "data/prepared", *digits)
    (work / "models/train").mkdir(parents=True)
    with open(work / "models/train/model.pt", "wb") as f:
        pickle.dump({"model": Exploit(marker)}, f)
    # With a matching checksum: it is the loading that must refuse it.
    (work / "models/train/model.sha256").write_text(files_sha(work / "models/train/model.pt"))
    (work / "models/train/run.json").write_text('{"run_id": null}')
    p = run([sys.executable, "-m", "stages.evaluate"], work,
            env=env_with(PYTHONPATH=str(ROOT)), check=False)
    assert p.returncode == 1 and "refused to load" in p.stderr and "weights_only" in p.stderr
    assert not marker.exists()
    # The same file as the newest checkpoint, with a matching checksum: skipped, never run.
    ckpt = tmp_path / "ckpt"
    fit_ckpt(linear_model(), digits, ckpt, epochs=1)
    shutil.copy(work / "models/train/model.pt", ckpt / "epoch-0009.pt")
    (ckpt / "epoch-0009.sha256").write_text(files_sha(ckpt / "epoch-0009.pt"))
    with pytest.warns(UserWarning, match="epoch-0009.pt is unusable"):
        assert latest_checkpoint(ckpt)["epoch"] == 1
    assert not marker.exists()


def files_sha(path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest() + "\n"


# ------------------------------------------------------------ 8: bad params, before any work


@pytest.mark.parametrize("edit, expected", [
    ({"lrr": None}, "unknown key 'lrr'; did you mean 'lr'"),
    ({"epochs": "'ten'"}, "epochs='ten' must be int"),
    ({"lr": "'1e-3'"}, "lr='1e-3' must be float, not str (remove the quotes)"),
    ({"lr": "-0.1"}, "lr=-0.1 is invalid: must be > 0"),
    ({"model.arch": "vgg99"}, "model.arch='vgg99' is invalid"),
    ({"data.source": "imagenet"}, "data.source='imagenet' is invalid"),
])
def test_bad_params_fail_before_any_work(tmp_path, edit, expected):
    copy_params(tmp_path)
    if "lrr" in edit:
        with open(tmp_path / "params.yaml", "a") as f:
            f.write("lrr: 0.1\n")
    else:
        set_params(tmp_path / "params.yaml", edit)
    for stage in ("prepare", "train"):
        t = time.perf_counter()
        p = run([sys.executable, "-m", f"stages.{stage}"], tmp_path,
                env=env_with(PYTHONPATH=str(ROOT)), check=False)
        assert p.returncode == 1 and expected in p.stderr, p.stderr
        assert "Traceback" not in p.stderr
        assert not (tmp_path / "data").exists() and not (tmp_path / "models").exists()
        assert time.perf_counter() - t < 60


# ------------------------------------------------------------ 10, 11: out of memory, disk full


class OOMAfter(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        if self.training:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.inner(x)


def test_out_of_memory_suggests_batch_size_and_accumulation(digits):
    with pytest.raises(OutOfMemory) as err:
        fit(OOMAfter(linear_model()), digits, n=64)
    assert "Lower batch_size" in str(err.value) and "train.accumulate" in str(err.value)


def test_disk_full_while_writing_a_checkpoint_keeps_the_previous(digits, tmp_path, monkeypatch):
    fit_ckpt(linear_model(), digits, tmp_path, epochs=1)
    before = (tmp_path / "epoch-0001.pt").read_bytes()
    real_save = torch.save

    def full_disk(obj, f):
        real_save(obj, f)
        f.truncate(100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.torch, "save", full_disk)
    with pytest.raises(OSError) as err:
        save_checkpoint({"x": torch.zeros(3)}, tmp_path, 2)
    assert err.value.errno == errno.ENOSPC
    assert "disk full while writing" in str(err.value) and "epoch-0002.pt" in str(err.value)
    assert (tmp_path / "epoch-0001.pt").read_bytes() == before
    assert not (tmp_path / "epoch-0002.pt").exists() and not list(tmp_path.glob(".*tmp*"))
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path)["epoch"] == 1


# ------------------------------------------------------------ 4, 5, 6: stages and tracking


def workspace(path, digits, **params):
    path.mkdir(parents=True, exist_ok=True)
    copy_params(path)
    set_params(path / "params.yaml", {"epochs": "3", "model.width": "8", **params})
    save_prepared(path / "data/prepared", *digits)
    return path


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the socket goes


@pytest.mark.slow
def test_tracking_outage_never_stops_training(tmp_path, digits, mlflow_uri):
    a = workspace(tmp_path / "a", digits)
    b = workspace(tmp_path / "b", digits)
    run([sys.executable, "-m", "stages.train"], a,
        env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri))
    down = f"http://127.0.0.1:{closed_port()}"
    t = time.perf_counter()
    p = run([sys.executable, "-m", "stages.train"], b,
            env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=down))
    assert time.perf_counter() - t < 120
    assert p.stderr.count("is unavailable") == 1, p.stderr  # one warning, not one per metric
    assert json.loads((b / "models/train/metrics.json").read_text())["epochs_run"] == 3
    assert json.loads((b / "models/train/run.json").read_text())["run_id"] is None
    wa = torch.load(a / "models/train/model.pt", weights_only=True)["model"]
    wb = torch.load(b / "models/train/model.pt", weights_only=True)["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_two_processes_log_to_one_new_sqlite_store_at_once(tmp_path, digits):
    import mlflow

    store = tmp_path / "shared/mlflow.db"
    uri = f"sqlite:///{store}?timeout=60"
    dirs = [workspace(tmp_path / f"w{i}", digits, seed=str(i), **{"train.log_every": "1"})
            for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=d, text=True,
                              env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=uri),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for d in dirs]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert "unavailable" not in err and "failed" not in err, err
    client = mlflow.MlflowClient(f"sqlite:///{store}")
    for d in dirs:
        run_id = json.loads((d / "models/train/run.json").read_text())["run_id"]
        assert client.get_run(run_id).info.status == "FINISHED"
        assert len(client.get_metric_history(run_id, "val/acc")) == 3
        steps = len(client.get_metric_history(run_id, "train/loss_step"))
        assert steps == 3 * 20  # every step of 3 epochs x 20 steps, none lost


def lock_entries(lock) -> dict:
    """dvc.lock's stages but the params check (it has no outputs and passes on any valid edit)."""
    from omegaconf import OmegaConf

    text = lock.read_text() if hasattr(lock, "read_text") else lock.decode()
    stages = OmegaConf.to_container(OmegaConf.create(text))["stages"]
    return {k: v for k, v in stages.items() if k != "params"}


@pytest.mark.slow
def test_a_failing_stage_leaves_dvc_lock_and_marks_the_run_failed(tmp_path):
    repo = copy_repo(tmp_path / "repo", {"epochs": "2"})
    env = env_with()
    run(["dvc", "repro"], repo, env=env)
    lock = (repo / "dvc.lock").read_bytes()
    model = (repo / "models/train/model.pt").read_bytes()
    set_params(repo / "params.yaml", {"lr": "1e30"})  # diverges: a non-finite loss
    p = run(["dvc", "repro"], repo, env=env, check=False)
    assert p.returncode != 0 and "non-finite loss at step" in p.stderr
    # Every stage's entry as it was; only the params check, which passed, records the new lr.
    assert lock_entries(repo / "dvc.lock") == lock_entries(lock)

    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    exp = client.get_experiment_by_name("reprotrain")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
    assert runs[0].info.status == "FAILED" and runs[1].info.status == "FINISHED"
    # The failed run's outputs are gone (DVC removes outs before a stage), the previous model is
    # in the cache: restoring the params restores it without training.
    set_params(repo / "params.yaml", {"lr": "0.003"})
    p = run(["dvc", "repro"], repo, env=env)
    assert "Restored stage 'train' from run-cache" in p.stdout or "didn't change" in p.stdout
    assert (repo / "models/train/model.pt").read_bytes() == model


@pytest.mark.slow
def test_sigterm_marks_the_run_killed(tmp_path, digits, mlflow_uri):
    w = workspace(tmp_path / "w", digits, epochs="50", batch_size="16")
    proc = subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=w,
                            env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not list(w.glob(".checkpoints/*/epoch-0001.sha256")):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    state = latest_checkpoint(next(w.glob(".checkpoints/*")))
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err

    import mlflow

    assert mlflow.MlflowClient(mlflow_uri).get_run(state["run_id"]).info.status == "KILLED"


# ------------------------------------------------------------ 12: the UI binds loopback only


@pytest.mark.slow
def test_make_ui_binds_loopback_and_rejects_foreign_hosts(tmp_path):
    """Also: its last line is the runs table's address, printed once the server answers, and
    SIGTERM to make ends every server process."""
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
        assert not any("Warning" in line for line in lines), lines
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
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    deadline = time.time() + 15
    while any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
              for c in psutil.net_connections("tcp")):
        assert time.time() < deadline, "the UI server outlived make ui"
        time.sleep(0.5)
    assert not [p for p in psutil.process_iter(["cmdline"])
                if str(port) in " ".join(p.info["cmdline"] or []) and "mlflow" in
                " ".join(p.info["cmdline"] or [])]


# ------------------------------------------------------------ 13: hostile and damaged model files


def one_error_line(stderr: str) -> str:
    """The error, alone on the last line; before it at most progress lines, no traceback."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() or "Traceback" in line]
    assert errors == lines[-1:] and lines[-1].startswith("error: "), stderr
    return lines[-1]


@pytest.fixture
def exported(tmp_path, digits):
    """What export writes, for a small real model: model.pt2, model.safetensors, model.json,
    and two real test images."""
    from PIL import Image
    from safetensors.torch import save_file

    from stages.export import export_program, export_pt2

    splits, meta = digits
    out = tmp_path / "export"
    out.mkdir()
    model = cnn(width=8).eval()
    export_pt2(export_program(model, torch.zeros(2, 1, 16, 16)), out / "model.pt2")
    save_file(model.state_dict(), out / "model.safetensors")
    (out / "model.json").write_text(json.dumps({
        "model_params": {"arch": "cnn", "width": 8, "dropout": 0.1}, "classes": meta["classes"],
        "mean": meta["mean"], "std": meta["std"], "input_shape": [1, 16, 16]}))
    for i in range(2):
        Image.fromarray(splits["test"].x[i, 0].numpy()).save(tmp_path / f"img{i}.png")
    return out


def predict(tmp_path, *args):
    return run([sys.executable, "-m", "stages.predict", *args], tmp_path,
               env=env_with(PYTHONPATH=str(ROOT)), check=False)


def rewrite_zip(src, dst, edit):
    import zipfile

    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w") as out:
        for name in z.namelist():
            out.writestr(name, edit(name, z.read(name)))


def test_a_hostile_pt2_never_runs_its_code(tmp_path, exported):
    marker = tmp_path / "pwned"
    symbol = b"Symbol('s31', positive=True, integer=True)"
    hostile = {
        # torch.export.load retries a failed weights-only load with full unpickling...
        "pickled_inputs": lambda n, b: pickle.dumps((Exploit(marker), {}))
        if n.endswith("sample_inputs/model.pt") else b,
        # ...and evaluates the symbolic shapes with sympy, an eval.
        "sympy": lambda n, b: b.replace(symbol, b"(open('" + str(marker).encode() + b"', 'w')"
                                        b" and 0) or " + symbol) if n.endswith("models/model.json")
        else b,
    }
    good = json.loads(predict(tmp_path, "img0.png", "img1.png", "--json", "--model",
                              str(exported / "model.pt2")).stdout.splitlines()[0])
    for name, edit in hostile.items():
        rewrite_zip(exported / "model.pt2", exported / f"{name}.pt2", edit)
        target = exported / "model.pt2"
        shutil.copy(exported / f"{name}.pt2", target)
        p = predict(tmp_path, "img0.png", "img1.png", "--json", "--model", str(target))
        assert not marker.exists(), f"{name}: predict ran the file's code"
        assert p.returncode == 0 and json.loads(p.stdout.splitlines()[0]) == good, p.stderr
        # The fault is real: torch.export.load itself runs it.
        try:
            torch.export.load(str(exported / f"{name}.pt2")).module()
        except Exception:  # noqa: BLE001, S110 - whether it then fails does not matter
            pass
        assert marker.exists(), f"{name}: the hostile file is not hostile"
        marker.unlink()

    # A weight stored as a pickle: refused, never unpickled.
    import zipfile

    with zipfile.ZipFile(exported / "sympy.pt2") as z:
        cfg_name = next(n for n in z.namelist() if n.endswith("model_weights_config.json"))
        weight_name = cfg_name.replace("model_weights_config.json", "weight_0")

    def pickled_weight(n, b):
        if n == cfg_name:
            cfg = json.loads(b)
            cfg["config"]["0.0.weight"]["use_pickle"] = True
            return json.dumps(cfg).encode()
        return pickle.dumps(Exploit(marker)) if n == weight_name else b

    rewrite_zip(exported / "pickled_inputs.pt2", exported / "model.pt2", pickled_weight)
    p = predict(tmp_path, "img0.png", "--model", str(exported / "model.pt2"))
    assert p.returncode == 1 and "is a pickle, refused" in one_error_line(p.stderr)
    assert not marker.exists()


def test_a_hostile_onnx_reaching_outside_its_folder_is_one_line(tmp_path, exported):
    import onnx
    from onnx import TensorProto, helper

    secret = tmp_path / "secret.bin"
    secret.write_bytes(bytes(256 * 10 * 4))
    weight = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[256, 10],
                         data_location=TensorProto.EXTERNAL)
    for k, v in {"location": "../secret.bin", "offset": "0", "length": str(256 * 10 * 4)}.items():
        weight.external_data.add(key=k, value=v)
    graph = helper.make_graph(
        [helper.make_node("Flatten", ["image"], ["flat"]),
         helper.make_node("MatMul", ["flat", "w"], ["logits"])], "g",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["n", 1, 16, 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 10])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]),
              str(exported / "model.onnx"))
    p = predict(tmp_path, "img0.png", "--model", str(exported / "model.onnx"))
    assert p.returncode == 1 and "onnxruntime refused it" in one_error_line(p.stderr)


def test_predict_validates_its_arguments_in_one_line(tmp_path, exported):
    for args in (["--batch-size", "-1"], ["--batch-size", "0"], ["--top-k", "-1"],
                 ["--top-k", "x"]):
        p = predict(tmp_path, "img0.png", "--model", str(exported / "model.pt2"), *args)
        assert p.returncode == 2 and args[0] in one_error_line(p.stderr), (args, p.stderr)
        assert p.stdout == ""
    (tmp_path / "model.pt").write_bytes(b"x")
    p = predict(tmp_path, "img0.png", "--model", "model.pt")
    assert p.returncode == 1 and "not an exported model" in one_error_line(p.stderr)
    assert "missing" not in p.stderr


def test_predict_text_output_escapes_tabs_and_newlines_in_names(tmp_path, exported):
    odd = tmp_path / "a\tb\nc.png"
    shutil.copy(tmp_path / "img0.png", odd)
    p = predict(tmp_path, str(odd), "img1.png", "--model", str(exported / "model.safetensors"))
    assert p.returncode == 0, p.stderr
    rows = [line.split("\t") for line in p.stdout.splitlines()]
    assert len(rows) == 2 and all(len(r) == 3 for r in rows)
    assert rows[0][0] == str(odd).replace("\t", "\\t").replace("\n", "\\n")
    js = predict(tmp_path, str(odd), "--json", "--model", str(exported / "model.safetensors"))
    assert json.loads(js.stdout)["path"] == str(odd)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, digits, mlflow_uri):
    """A real tiny training run: models/train/ with its MLflow run."""
    w = workspace(tmp_path_factory.mktemp("trained"), digits, epochs="2")
    run([sys.executable, "-m", "stages.train"], w,
        env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri))
    return w


@pytest.mark.parametrize("damage", ["flip 4000 bytes", "truncate"])
def test_a_damaged_model_pt_fails_naming_it_and_logs_nothing(trained, tmp_path, mlflow_uri, damage):
    import mlflow

    w = tmp_path / "w"
    shutil.copytree(trained, w)
    model = w / "models/train/model.pt"
    data = bytearray(model.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        for i in range(4000):
            data[len(data) // 4 + i * 7 % (len(data) // 2)] ^= 0xFF
    model.write_bytes(bytes(data))
    p = run([sys.executable, "-m", "stages.evaluate"], w,
            env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri), check=False)
    line = one_error_line(p.stderr)
    assert p.returncode == 1 and "models/train/model.pt" in line and "checksum mismatch" in line
    assert not (w / "models/eval").exists()
    run_id = json.loads((w / "models/train/run.json").read_text())["run_id"]
    assert "eval/accuracy" not in mlflow.MlflowClient(mlflow_uri).get_run(run_id).data.metrics


def test_a_truncated_prepared_split_fails_naming_it(tmp_path, digits):
    w = workspace(tmp_path / "w", digits)
    split = w / "data/prepared/train.pt"
    split.write_bytes(split.read_bytes()[:5000])
    p = run([sys.executable, "-m", "stages.train"], w, env=env_with(PYTHONPATH=str(ROOT)),
            check=False)
    assert p.returncode == 1 and "data/prepared/train.pt: unreadable" in one_error_line(p.stderr)


# ------------------------------------------------------------ 14: racing experiments, Ctrl-C


def wait_for_checkpoint(proc, w, epoch: int = 1) -> None:
    deadline = time.time() + 300
    while not list(w.glob(f".checkpoints/*/epoch-{epoch:04d}.sha256")):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)


def interruptible() -> None:
    """In the child: Ctrl-C as in a terminal. A shell without job control starts background
    commands (and everything they start) with SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_params_changed_under_a_training_run_fail_it_naming_the_cause(tmp_path, digits, mlflow_uri):
    import mlflow

    w = workspace(tmp_path / "w", digits, epochs="40", batch_size="16")
    proc = subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=w, text=True,
                            env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for_checkpoint(proc, w)
    run_id = latest_checkpoint(next(w.glob(".checkpoints/*")))["run_id"]
    set_params(w / "params.yaml", {"lr": "0.01"})  # what a second `dvc exp run -S lr=0.01` does
    _, err = proc.communicate(timeout=300)
    line = one_error_line(err)
    assert proc.returncode == 1 and "lr: 0.003 -> 0.01" in line
    assert "--queue" in line and "--temp" in line
    assert not (w / "models/train/model.pt").exists()
    run_info = mlflow.MlflowClient(mlflow_uri).get_run(run_id)
    assert run_info.info.status == "FAILED" and "val/best_acc" not in run_info.data.metrics


def test_a_params_file_caught_mid_write_is_not_taken_for_a_change(tmp_path):
    """CI caught the watch reading params.yaml between the truncate and the write of an edit:
    the empty file loaded as the defaults, and a run was failed for changes nobody made."""
    import threading

    from stages.cli import UserError
    from stages.config import load_params
    from stages.train import ParamsWatch, training_params

    path = copy_params(tmp_path)
    set_params(path, {"epochs": "40"})  # not the default, which an empty file loads as
    text = path.read_text()
    watch = ParamsWatch(path, training_params(load_params(path)))
    path.write_text("")  # the editor has truncated; its write lands 0.1 s later
    threading.Timer(0.1, path.write_text, [text]).start()
    watch.check()  # raises UserError if it judged the empty file
    set_params(path, {"lr": "0.01"})
    with pytest.raises(UserError, match=r"lr: 0\.003 -> 0\.01"):
        watch.check()


@pytest.mark.slow
def test_ctrl_c_in_train_is_one_line_and_the_run_killed(tmp_path, digits, mlflow_uri):
    import mlflow

    w = workspace(tmp_path / "w", digits, epochs="40", batch_size="16")
    proc = subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=w, text=True,
                            env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=interruptible)
    wait_for_checkpoint(proc, w)
    run_id = latest_checkpoint(next(w.glob(".checkpoints/*")))["run_id"]
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends: the whole group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted (Ctrl-C)" in one_error_line(err)
    assert mlflow.MlflowClient(mlflow_uri).get_run(run_id).info.status == "KILLED"


def folder_workspace(w):
    """params.yaml for an image folder in w/raw, decoded by two worker processes."""
    w.mkdir()
    copy_params(w)
    set_params(w / "params.yaml", {"data.source": "folder", "data.root": "raw",
                                   "data.num_workers": "2"})
    return w


def test_ctrl_c_in_prepare_is_one_line(tmp_path):
    import numpy as np
    from PIL import Image

    w = folder_workspace(tmp_path / "w")
    rng = np.random.default_rng(0)
    for c in ("circle", "square", "triangle"):  # noise decodes slowly: seconds of decoding
        (w / "raw" / c).mkdir(parents=True)
        for j in range(4):
            src = w / "raw" / c / f"{j}.png"
            Image.fromarray(rng.integers(0, 255, (400, 400, 3), dtype=np.uint8)).save(src)
            for i in range(150):
                os.link(src, src.with_name(f"{j}_{i}.png"))
    proc = subprocess.Popen([sys.executable, "-m", "stages.prepare"], cwd=w, text=True,
                            env=env_with(PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=interruptible)
    deadline = time.time() + 120
    while not list(w.glob("data/prepared/.*.npy")):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.02)
    time.sleep(1.5)  # decoding in the workers (a Ctrl-C while they fork is lost in CPython)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted (Ctrl-C)" in one_error_line(err)
    assert not (w / "data/prepared/train.pt").exists()


def test_ctrl_c_during_a_file_write_stays_a_ctrl_c_and_keeps_the_previous(tmp_path, monkeypatch):
    import threading

    path = tmp_path / "big.pt"
    path.write_bytes(b"previous")
    big = {f"t{i}": torch.zeros(1_000_000) for i in range(12)}
    real_save = torch.save

    class SlowDisk:  # each write takes 50 ms: the Ctrl-C lands mid-write on any machine
        def __init__(self, f):
            self.f = f

        def write(self, b):
            time.sleep(0.05)
            return self.f.write(b)

        def flush(self):
            self.f.flush()

    monkeypatch.setattr(files.torch, "save", lambda obj, f: real_save(obj, SlowDisk(f)))
    timer = threading.Timer(0.15, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    # Interrupted mid-record, torch.save's zip writer fails with an inline_container.cc
    # RuntimeError: that would mark the MLflow run FAILED, not KILLED.
    try:
        with pytest.raises(KeyboardInterrupt):
            files.save_torch(path, big)
    finally:
        timer.join()  # never a stray Ctrl-C for the next test
    assert path.read_bytes() == b"previous" and not list(tmp_path.glob(".*tmp*"))


# ------------------------------------------------------------ 15: params, prepare, tracking


@pytest.mark.parametrize("text, expected", [
    ("lr: 0.1\nlr: 0.2\n", "params.yaml: line 2: found duplicate key lr"),
    ("lr: [0.1\n", "params.yaml: line 2: expected ',' or ']'"),
])
def test_a_yaml_error_in_params_is_one_line_naming_the_line(tmp_path, text, expected):
    (tmp_path / "params.yaml").write_text(text)
    p = run([sys.executable, "-m", "stages.prepare"], tmp_path,
            env=env_with(PYTHONPATH=str(ROOT)), check=False)
    assert p.returncode == 1 and expected in one_error_line(p.stderr)


@pytest.mark.parametrize("edit, expected", [
    ({"train.warmup_epochs": ".inf"}, "train.warmup_epochs=inf must be a finite number"),
    ({"lr": ".inf"}, "lr=inf must be a finite number"),
    ({"train.min_lr": ".nan"}, "train.min_lr=nan must be a finite number"),
    ({"train.device": "cpu:abc"}, "train.device='cpu:abc' is invalid"),
    ({"train.device": "mps"}, "MPS (Apple GPUs, macOS) is not available"),
    ({"train.device": "cuda"}, "CUDA is not available on this machine"),
])
def test_values_that_would_fail_later_are_refused_before_the_data_loads(tmp_path, edit, expected):
    if "cuda" in expected and torch.cuda.is_available() or \
            "MPS" in expected and torch.backends.mps.is_available():
        pytest.skip("the device exists here")
    copy_params(tmp_path)
    set_params(tmp_path / "params.yaml", edit)
    # No data/prepared at all: the refusal must come first.
    p = run([sys.executable, "-m", "stages.train"], tmp_path,
            env=env_with(PYTHONPATH=str(ROOT)), check=False)
    assert p.returncode == 1 and expected in one_error_line(p.stderr)


def test_an_oversized_image_file_is_rejected_and_listed(tmp_path):
    from stages.images import MAX_IMAGE_BYTES
    from tests.images import make_folder

    w = folder_workspace(tmp_path / "w")
    make_folder(w / "raw", per_class=30, bad=False)
    sparse = tmp_path / "disk.img"
    with open(sparse, "wb") as f:
        f.truncate(8 * 2**30)  # 8 GiB that take no disk: read whole, a MemoryError
    assert sparse.stat().st_size > MAX_IMAGE_BYTES
    (w / "raw/circle/huge.png").symlink_to(sparse)
    p = run([sys.executable, "-m", "stages.prepare"], w, env=env_with(PYTHONPATH=str(ROOT)),
            check=False)
    assert p.returncode == 0 and "Traceback" not in p.stderr and "MemoryError" not in p.stderr
    assert "skipped 1 unreadable files" in p.stderr
    rejected = (w / "data/prepared/rejected.csv").read_text()
    assert "huge.png" in rejected and "limit" in rejected


def test_a_read_only_mlflow_store_is_one_warning(tmp_path, mlflow_uri, capfd):
    import mlflow

    from stages import tracking
    from stages.config import MlflowConfig

    db = tmp_path / "mlflow.db"  # a store that has served runs, then became read-only
    shutil.copy(mlflow_uri.removeprefix("sqlite:///"), db)
    mlflow.MlflowClient(f"sqlite:///{db}").create_experiment(
        "read-only", artifact_location=(tmp_path / "art").as_uri())
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///file:{db}?mode=ro&uri=true"
    try:
        with pytest.warns(UserWarning) as caught, tracking.start_run(MlflowConfig("read-only")) as r:
            r.log_metrics({"a": 1.0})
    finally:
        del os.environ["MLFLOW_TRACKING_URI"]
    assert [str(w.message) for w in caught if "MLflow" in str(w.message)] == [
        next(str(w.message) for w in caught if "readonly database" in str(w.message))]
    assert "\n" not in str(caught[0].message)
    out = capfd.readouterr()
    assert "Traceback" not in out.err and "SQL" not in out.err, out.err


def test_a_class_absent_from_the_test_split_is_named_and_left_out_of_macro_f1(digits, capsys):
    from stages.report import classification_metrics

    splits, meta = digits
    test = splits["test"]
    keep = test.y != 9
    y = test.y[keep]
    logits = torch.nn.functional.one_hot(y, 10).float() * 10  # every prediction right
    metrics, per_class = classification_metrics(logits, y, meta["classes"])
    assert metrics["accuracy"] == 1.0 and metrics["macro_f1"] == 1.0  # not 0.9
    assert per_class["9"]["support"] == 0
    err = capsys.readouterr().err
    assert "1 classes have no test images (9)" in err


def test_outputs_are_world_readable_also_safetensors(tmp_path):
    from safetensors.torch import save_file

    umask = os.umask(0o022)
    try:
        path = files.atomic_write(tmp_path / "model.safetensors",
                                  lambda p: save_file({"w": torch.zeros(3)}, p))
    finally:
        os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o644
