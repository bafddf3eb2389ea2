"""Serving the champion from the team's registry: a real `mlflow server --app-name basic-auth` on
a real PostgreSQL, artifacts proxied by it, each client logged in with MLFLOW_TRACKING_USERNAME
and MLFLOW_TRACKING_PASSWORD. Export logs and registers the served model (code, no pickle)
there; `make serve` loads it and answers over real HTTP as `stages.predict` does, refuses bad
input with a 400 and goes on, never runs code from the registry, and stops on Ctrl-C; a
read-only user serves but cannot register; a wrong password or a server that is down is one
line; its Dockerfile. And the readers' bounds, in the server and in `stages.predict` on the
same model: the image formats decoded (never Ghostscript), bodies and pixels, a stdout closed
early."""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import pickle
import re
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from reprotrain.processes import answers
from stages.data import save_prepared
from stages.inference import PACKAGE
from tests.conftest import ROOT, VENV_BIN, copy_params, env_with, run, set_params
from tests.support.image_files import EPS, fake_ghostscript, many_scan_jpeg
from tests.support.services import (
    create_database,
    free_port,
    mlflow_server,
    postgres,  # noqa: F401 - the fixture
)

NAME = "serve-test"
SAMPLES = sorted((ROOT / "data/samples").glob("*.png"), key=lambda p: int(p.stem))


@pytest.fixture(scope="module")
def registry(postgres, tmp_path_factory):  # noqa: F811 - the fixture imported above
    """The team's server for this module (`make server`: basic-auth, PostgreSQL, artifacts
    proxied): started once, its champion shared by the tests."""
    db = create_database(postgres, f"serve_{secrets.token_hex(4)}")
    with mlflow_server(db, tmp_path_factory.mktemp("registry")) as s:
        yield s


@pytest.fixture(scope="module")
def champion(tmp_path_factory, digits, registry):
    """A workspace whose tiny real model was trained, evaluated and exported by the server's
    admin, logged in: export logged the served model and registered it as champion of NAME on
    the server. The workspace has the Makefile, to run `make serve` in it as a user does."""
    w = tmp_path_factory.mktemp("serve")
    copy_params(w)
    for name in ("Makefile", "requirements.lock"):  # the lock as installed: nothing to install
        shutil.copy2(ROOT / name, w / name)
    set_params(w / "params.yaml", {"epochs": "2", "model.width": "8", "export.register_as": NAME})
    save_prepared(w / "data/prepared", *digits)
    env = registry.client_env(PYTHONPATH=str(ROOT))
    for stage in ("train", "evaluate", "export"):
        p = run([sys.executable, "-m", f"stages.{stage}"], w, env=env)
        assert "Warning" not in p.stderr, p.stderr  # logged and registered, nothing spooled
    assert f"registered {NAME} version 1 as candidate, now champion" in p.stdout
    return w, env


@pytest.fixture
def logged_in(champion, registry, monkeypatch):
    """This process as the workspace's user: in it, logged in to the server as its admin."""
    import mlflow

    w, env = champion
    monkeypatch.chdir(w)  # its params.yaml names the registered model
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(key, env[key])
    mlflow.set_tracking_uri(registry.uri)
    return w, env


def make_serve(port: int) -> list[str]:
    """`make serve` as a user types it, on the venv the tests run in."""
    return ["make", "-s", "serve", f"PORT={port}", f"VENV={VENV_BIN.parent}"]


@contextmanager
def serving(w: Path, env: dict, port: int | None = None) -> Iterator[dict]:
    """`make serve` in `w` on `port` (a free one by default), in its own process group as a
    terminal would run it; yields once it printed its curl line, stopped at the end (if a test
    did not)."""
    port = port or free_port()
    # SIGINT as a terminal leaves it: a suite started in the background (`make test &`)
    # inherits it ignored, and the server would never see the Ctrl-C under test.
    proc = subprocess.Popen(make_serve(port), cwd=w, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:  # stopped, pass or fail
        lines = []
        for line in proc.stdout:  # the curl line comes once the server answers
            lines.append(line)
            if line.startswith("curl "):
                break
        assert lines and lines[-1].startswith("curl "), "".join(lines) + proc.stderr.read()
        yield {"base": f"http://127.0.0.1:{port}", "port": port, "proc": proc, "out": lines}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)


def log_of(line: str) -> Path:
    """The log named in `make serve`'s first line."""
    return Path(line.split("(its log: ", 1)[1].split(")", 1)[0])


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def post(base: str, body: bytes | str | dict) -> tuple[int, dict | str]:
    conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=60)
    data = json.dumps(body) if isinstance(body, dict) else body
    conn.request("POST", "/invocations", data, {"Content-Type": "application/json"})
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    try:
        return r.status, json.loads(text)
    except json.JSONDecodeError:
        return r.status, text


def predict_json(w: Path, env: dict, paths: list[Path], model: Path | None = None) -> list[dict]:
    p = run([sys.executable, "-m", "stages.predict", *map(str, paths), "--json", "--top-k", "100"],
            w, env=env)
    return [json.loads(line) for line in p.stdout.splitlines()]


def assert_same(served: list[dict], predicted: list[dict]) -> None:
    assert len(served) == len(predicted)
    for s, p in zip(served, predicted, strict=True):
        assert s["label"] == p["label"]
        assert s["probability"] == pytest.approx(p["confidence"], abs=1e-5)
        assert s["probabilities"] == pytest.approx({t["label"]: t["p"] for t in p["top_k"]},
                                                   abs=1e-5)


@pytest.fixture(scope="module")
def ghostscript(tmp_path_factory):
    """The record of a stand-in `gs` that the server and predict find first on their PATH."""
    return fake_ghostscript(tmp_path_factory.mktemp("gs"))


def with_ghostscript(env: dict, called: Path) -> dict:
    return dict(env, PATH=f"{called.parent}{os.pathsep}{env['PATH']}")


@pytest.fixture(scope="module")
def server(champion, ghostscript, tmp_path_factory):
    """`make serve` of the server's champion, logged in as its admin; stopped with Ctrl-C by
    test_ctrl_c_stops_the_server. A symlink waits at the log's old, guessable name
    (test_the_log_is_private)."""
    w, env = champion
    port = free_port()
    planted = Path(tempfile.gettempdir()) / f"reprotrain-serve-{port}.log"
    victim = tmp_path_factory.mktemp("victim") / "victim.txt"
    victim.write_text("untouched\n")
    planted.unlink(missing_ok=True)
    planted.symlink_to(victim)
    try:
        with serving(w, with_ghostscript(env, ghostscript) | {
                "AWS_SECRET_ACCESS_KEY": "planted-cloud-key"}, port) as s:
            yield s | {"planted": planted, "victim": victim}
    finally:
        planted.unlink(missing_ok=True)


def test_export_logs_the_served_model_as_code_with_an_example(logged_in, tmp_path):
    import mlflow
    from omegaconf import OmegaConf

    mlmodel = mlflow.artifacts.download_artifacts(f"models:/{NAME}@champion/MLmodel",
                                                  dst_path=str(tmp_path))
    pyfunc = OmegaConf.load(mlmodel).flavors.python_function
    assert pyfunc.model_code_path.endswith("stages/served_model.py")
    assert "python_model" not in pyfunc  # no cloudpickle of the model object
    assert set(pyfunc.artifacts) == {"model.onnx", "model.json"}
    example = json.loads(Path(mlflow.artifacts.download_artifacts(
        f"models:/{NAME}@champion/input_example.json", dst_path=str(tmp_path))).read_text())
    images = [Image.open(io.BytesIO(base64.b64decode(s))) for s in example]
    assert len(images) == 2 and images[0].size == (16, 16)  # two real test images, as PNG
    sig = mlflow.models.get_model_info(f"models:/{NAME}@champion").signature
    assert sig is not None and sig.inputs is not None and sig.outputs is not None


def test_a_models_own_test_image_makes_the_example_request_of_a_non_digits_model(logged_in,
                                                                                  tmp_path):
    """Issue 57: a Fashion model's `make serve` printed its example with data/samples/7.png, a
    digit. A model of other classes gets one of its own test images, from its input example."""
    from reprotrain.serving.app import curl_line
    from reprotrain.serving.registry import example_image

    png = example_image(NAME, 1, tmp_path)
    assert png == tmp_path / "example.png" and Image.open(png).size == (16, 16)
    assert f"$(base64 -w0 {png})" in curl_line("http://127.0.0.1:1", png)
    assert example_image(NAME, 99, tmp_path / "none") is None  # no such version: the fallback


def test_the_printed_curl_line_works_as_printed(server, champion):
    p = subprocess.run(["bash", "-c", server["out"][-1]], cwd=champion[0], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    (answer,) = json.loads(p.stdout)["predictions"]
    assert set(answer) == {"label", "probability", "probabilities"}
    assert answer["probabilities"][answer["label"]] == answer["probability"]


def test_served_answers_equal_predict(server, champion):
    w, env = champion
    status, body = post(server["base"], {"inputs": [b64(p.read_bytes()) for p in SAMPLES]})
    assert status == 200, body
    assert_same(body["predictions"], predict_json(w, env, SAMPLES))


def test_the_champion_is_registered_on_the_server_and_nothing_stays_local(logged_in, registry):
    import mlflow

    w, env = logged_in
    client = mlflow.MlflowClient()
    version = client.get_model_version_by_alias(NAME, "champion")
    assert version.version == "1" and version.source.startswith("models:/")
    run_ = client.get_run(version.run_id)
    assert run_.info.artifact_uri.startswith("mlflow-artifacts:/")  # proxied by the server
    assert {a.path for a in client.list_artifacts(run_.info.run_id, "export")} >= {
        "export/model.onnx", "export/model.json"}
    assert not (w / "mlflow.db").exists() and not list(w.glob("**/mlartifacts"))
    for f in w.rglob("*"):
        assert not f.is_file() or registry.password.encode() not in f.read_bytes(), f


def test_make_serve_answers_ping_and_says_what_it_serves(server, registry, champion):
    with urllib.request.urlopen(f"{server['base']}/ping", timeout=30) as r:
        assert r.status == 200
    said = "".join(server["out"])
    assert said.startswith(f"serving {NAME} version 1 (champion) on {server['base']}: 10 classes "
                           "(0, 1, 2, 3, 4, 5, 6, 7, 8, 9), from run "), said  # issue 57
    run_id = json.loads((champion[0] / "models/train/run.json").read_text())["run_id"]
    assert f"from run {run_id} (" in said, said
    assert registry.password not in said
    # The model server, which decodes what any client sends, holds no login to the registry.
    (pid,) = [pid for pid, cmd in command_lines().items()
              if b"--serve-folder\0" in cmd and f"--port\0{server['port']}\0".encode() in cmd]
    environ = Path(f"/proc/{pid}/environ").read_bytes()
    assert registry.password.encode() not in environ and b"MLFLOW_TRACKING_PASSWORD" not in environ
    assert b"planted-cloud-key" not in environ  # nor any other secret of its environment


def request(base: str, method: str, path: str, body: bytes = b"",
            content_type: str | None = "application/json") -> tuple[int, bytes, str]:
    """The status, the body and the path a redirect points to ("" if none); no Content-Type
    header at all when `content_type` is None."""
    conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=60)
    conn.request(method, path, body, {} if content_type is None else {"Content-Type": content_type})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, data, urllib.parse.urlsplit(r.getheader("location", "")).path


# Where make serve answers otherwise than `mlflow models serve`, on purpose: (ours, MLflow's)
# status. Each row's reason is in docs/serving.md's table of answers; every other request in
# `asked` must get MLflow's status (and, for a 200, its body).
DIFFERENT = {
    "Application/JSON": (200, 415),  # media types are case-insensitive (RFC 9110 8.3.1)
    "Charset=utf-8": (200, 415),  # so are parameter names
    'charset="utf-8"': (200, 415),  # a quoted value is the same value (RFC 9110 5.6.6)
    "an empty parameter": (200, 415),  # `type/subtype;` is valid (RFC 9110 8.3.1's grammar)
    "UTF-16": (400, 200),  # JSON between systems is UTF-8 (RFC 8259 8.1); MLflow guesses
    "text/csv": (415, 400),  # no CSV can ever be served by this model: the format is wrong
    "a CSV of images": (415, 400),  # not even one column of base64 images
    "no Content-Type": (415, 500),  # MLflow fails on it (None.split): a client error, not 5xx
    "/docs": (404, 200),  # FastAPI's Swagger page, scripts from a CDN; not MLflow's protocol
    "/redoc": (404, 200),  # the same page's other style
    "/openapi.json": (404, 200),  # their schema, which has no request body
}


def test_make_serve_answers_as_mlflow_models_serve_of_the_saved_model(server, in_workspace,
                                                                       tmp_path):
    """The container runs MLflow's scoring server on the saved model (`--dockerfile`): the same
    answers for the same images, the same 400 for a bad one, the same status for each way of
    asking."""
    in_workspace(["--save", str(tmp_path / "model")])
    port = free_port()
    log = tmp_path / "mlflow-serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m",
                                 str(tmp_path / "model"), "--env-manager", "local", "-h",
                                 "127.0.0.1", "-p", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, env=env_with(), start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while not answers(f"{base}/ping"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        dark = Image.eval(Image.open(SAMPLES[7]).convert("L"), lambda v: 255 - v)
        good = {"inputs": [b64(p.read_bytes()) for p in SAMPLES] + [b64(png(dark))]}
        ours, theirs = post(server["base"], good), post(base, good)
        assert ours[0] == theirs[0] == 200 and ours[1] == theirs[1], (ours, theirs)
        assert "warning" in ours[1]["predictions"][-1]
        bad = {"inputs": [b64(SAMPLE), "this is not base64!"]}
        ours, theirs = post(server["base"], bad), post(base, bad)
        assert ours[0] == theirs[0] == 400, (ours, theirs)
        assert ours[1] == {k: theirs[1][k] for k in ("error_code", "message")}, (ours, theirs)
        one = json.dumps({"inputs": [b64(SAMPLE)], "params": {}}).encode()
        asked = {"version": ("GET", "/version", b"", "application/json"),
                 "ping": ("GET", "/health", b"", "application/json"),
                 "extra keys": ("POST", "/invocations", one, "application/json"),
                 "utf-8 named": ("POST", "/invocations", one, "application/json; charset=utf-8"),
                 "latin-1": ("POST", "/invocations", one, "application/json; charset=latin-1"),
                 "text": ("POST", "/invocations", one, "text/plain"),
                 "a GET": ("GET", "/invocations", b"", "application/json"),
                 "a HEAD": ("HEAD", "/ping", b"", "application/json"),
                 "nowhere": ("GET", "/nowhere", b"", "application/json"),
                 # issue 42 item 8: the requests where the two servers differed, each now the
                 # same or in DIFFERENT; and the other spellings of a media type found beside
                 "UTF-8 BOM": ("POST", "/invocations", b"\xef\xbb\xbf" + one, "application/json"),
                 "two BOMs": ("POST", "/invocations", b"\xef\xbb\xbf" * 2 + one,
                              "application/json"),
                 "format=pandas-split": ("POST", "/invocations", one,
                                         "application/json; format=pandas-split"),
                 "Application/JSON": ("POST", "/invocations", one, "Application/JSON"),
                 "Charset=utf-8": ("POST", "/invocations", one, "application/json; Charset=utf-8"),
                 'charset="utf-8"': ("POST", "/invocations", one,
                                     'application/json; charset="utf-8"'),
                 "an empty parameter": ("POST", "/invocations", one, "application/json;"),
                 "UTF-16": ("POST", "/invocations", one.decode().encode("utf-16"),
                            "application/json"),
                 "text/csv": ("POST", "/invocations", one, "text/csv"),
                 "a CSV of images": ("POST", "/invocations", f"inputs\n{b64(SAMPLE)}\n".encode(),
                                     "text/csv"),
                 "/invocations/": ("POST", "/invocations/", one, "application/json"),
                 "/ping/": ("GET", "/ping/", b"", "application/json"),
                 "no Content-Type": ("POST", "/invocations", one, None),
                 "/docs": ("GET", "/docs", b"", "application/json"),
                 "/redoc": ("GET", "/redoc", b"", "application/json"),
                 "/openapi.json": ("GET", "/openapi.json", b"", "application/json")}
        wrong = []  # every case that fails, not only the first
        for case, args in asked.items():
            (status, ours, to), (expected, theirs, their_to) = (request(server["base"], *args),
                                                                request(base, *args))
            if ((status, expected) != DIFFERENT.get(case, (expected, expected))
                    or (status == expected == 200 and ours != theirs)
                    or to != their_to):  # a redirect to the same path
                wrong.append((case, status, ours[:200], to, expected, theirs[:200], their_to))
        assert not wrong, "\n".join(map(repr, wrong))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def make_serve_fails(w: Path, env: dict) -> tuple[str, float]:
    """`make serve` that never serves: its one line on stderr (make's own `make: ***` line
    aside) and how long it took."""
    start = time.monotonic()
    p = run(make_serve(free_port()), w, env=env, check=False, timeout=120)
    took = time.monotonic() - start
    assert p.returncode != 0 and "curl " not in p.stdout, p.stdout
    lines = [line for line in p.stderr.splitlines() if line.strip() and not line.startswith("make")]
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    return lines[0], took


def test_a_refused_login_is_one_line_naming_it_not_a_retrain(champion, registry, monkeypatch):
    """A wrong password, no login, a user kept from the model: each says so, never "no
    champion ... run `make repro`"."""
    import mlflow.server

    w, env = champion
    lookup = f"error: cannot look up the champion of registered model '{NAME}' at {registry.uri}: "
    line, _ = make_serve_fails(w, dict(env, MLFLOW_TRACKING_PASSWORD="wrong-password-123"))
    assert line == (f"{lookup}the server refused the login of '{registry.user}': set "
                    "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD to your user on it")
    line, _ = make_serve_fails(w, {k: v for k, v in env.items()
                                   if k not in ("MLFLOW_TRACKING_USERNAME",
                                                "MLFLOW_TRACKING_PASSWORD")})
    assert line.startswith(f"{lookup}the server needs a login: set MLFLOW_TRACKING_USERNAME"), line

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", registry.user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", registry.password)
    auth = mlflow.server.get_app_client("basic-auth", tracking_uri=registry.uri)
    auth.create_user("outsider", "outsider-password-1")
    auth.grant_user_permission("outsider", "registered_model", NAME, "DENY")
    line, _ = make_serve_fails(w, dict(env, MLFLOW_TRACKING_USERNAME="outsider",
                                       MLFLOW_TRACKING_PASSWORD="outsider-password-1"))
    assert line == (f"{lookup}user 'outsider' may not read it: ask the server's admin for READ "
                    "on the registered model")


def test_the_server_down_when_make_serve_starts_is_one_quick_line(champion):
    w, env = champion
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens: a server that is down
    line, took = make_serve_fails(w, dict(env, MLFLOW_TRACKING_URI=down))
    assert line == (f"error: the tracking server at {down} does not answer, so the champion of "
                    f"registered model '{NAME}' cannot be looked up; start it (`make server`, "
                    "docs/server.md) or set MLFLOW_TRACKING_URI to one that runs")
    assert took < 60, took


def test_a_read_only_user_serves_the_champion_but_cannot_register(champion, registry, tmp_path,
                                                                  monkeypatch):
    import mlflow
    import mlflow.server

    w, env = champion
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", registry.user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", registry.password)
    auth = mlflow.server.get_app_client("basic-auth", tracking_uri=registry.uri)
    auth.create_user("viewer", "viewer-password-1")  # READ is the server's default permission
    reader = dict(env, MLFLOW_TRACKING_USERNAME="viewer",
                  MLFLOW_TRACKING_PASSWORD="viewer-password-1")
    client = mlflow.MlflowClient(registry.uri)
    before = client.search_model_versions(f"name = '{NAME}'")
    with serving(w, reader) as served:
        status, body = post(served["base"], {"inputs": [b64(SAMPLE)]})
        assert status == 200 and len(body["predictions"]) == 1, body
    # The same export as the admin's, as the reader: the stage ends, one line says why nothing
    # was registered, and the champion stays the admin's.
    mine = tmp_path / "w"
    shutil.copytree(w, mine)
    p = run([sys.executable, "-m", "stages.export"], mine, env=reader)
    warned = [line for line in p.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warned) == 1 and "user 'viewer' may not write here" in warned[0], p.stderr
    assert "UserWarning" not in p.stderr, p.stderr  # one line, not Python's file, line and source
    assert "registered" not in p.stdout and "Traceback" not in p.stderr
    assert client.search_model_versions(f"name = '{NAME}'") == before
    assert client.get_model_version_by_alias(NAME, "champion").version == "1"


def png(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=kw.pop("format", "PNG"), **kw)
    return buf.getvalue()


def bomb_png(width: int, height: int) -> bytes:
    """A 100-byte PNG that declares width x height pixels."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def tall_png(height: int) -> bytes:
    """A whole PNG of 1 x height black pixels: 33 kB for 16,777,216."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0\0" * height, 9)) + chunk(b"IEND", b""))


SAMPLE = (ROOT / "data/samples/4.png").read_bytes()
BAD = {
    "not base64": ({"inputs": ["this is not base64!"]}, "image 0: not base64"),
    "not an image": ({"inputs": [b64(SAMPLE), b64(b"GIF89a? no, just text")]},
                     "image 1: not a readable image"),
    "truncated png": ({"inputs": [b64(SAMPLE[: len(SAMPLE) // 2])]}, "image 0: not a readable"),
    "decompression bomb": ({"inputs": [b64(bomb_png(100_000, 100_000))]},
                           "image 0: not a readable image (a decompression bomb"),
    "postscript": ({"inputs": [b64(SAMPLE), b64(EPS)]},
                   "image 1: not a readable image (not an image file of a format read here "
                   "(BMP, JPEG, PNG, TIFF, WEBP)"),
    "an empty file": ({"inputs": [""]}, "image 0: not a readable image (empty"),
    "json nested 100000 deep": ("[" * 100_000, "nested too deeply"),
    "huge dimensions": ({"inputs": [b64(bomb_png(5000, 5000))]}, "image 0: 5000x5000 pixels"),
    # Within MAX_PIXELS, but its resize to the model's size took 5 s and 650 MB.
    "a side too long": ({"inputs": [b64(tall_png(16_777_216))]},
                        "image 0: not a readable image (1x16777216 pixels: a side over 65,535"),
    "empty list": ({"inputs": []}, "no images"),
    "thousands of images": ({"inputs": [b64(SAMPLE)] * 3000}, "3000 images in one request"),
    "a number": ({"inputs": [b64(SAMPLE), 7]}, "image 1: a JSON int, not a string"),
    "no inputs key": ({"instances": [b64(SAMPLE)]}, "has no key 'inputs' (it has 'instances')"),
    "many long keys": ({f"{i:06d}" + "k" * 100_000: 1 for i in range(50)},
                       "has no key 'inputs' (it has '000000kkkkkkkkkkkkkk', "),
    "inputs not a list": ({"inputs": {"image": b64(SAMPLE)}}, "inputs is a dict, not a list"),
    "not json": ("inputs=" + b64(SAMPLE), "not valid JSON (Expecting value: line 1 column 1"),
    "a json list": ("[1, 2]", "a JSON list, not an object with the key 'inputs'"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_gets_a_400_naming_it_and_the_server_goes_on(server, case):
    body, says = BAD[case]
    status, answer = post(server["base"], body)
    assert status == 400, answer
    assert says in answer["message"], answer["message"][:500]
    # One line, the request never repeated (MLflow's own server put it into its 400s), and never
    # a decoder's or a subprocess's words: temporary files, command lines, addresses.
    assert "\n" not in answer["message"] and len(answer["message"]) < 400, answer["message"]
    assert not re.search(r"/tmp|tmp[a-z0-9_]{6}| at 0x|Error\b|-dSAFER", answer["message"]), \
        answer["message"]
    status, good = post(server["base"], {"inputs": [b64(SAMPLE)]})
    assert status == 200 and len(good["predictions"]) == 1


def test_postscript_never_runs_ghostscript_in_the_server_nor_in_predict(server, champion,
                                                                         ghostscript, tmp_path):
    """Pillow's EPS decoder runs `gs` on the file: a client of `make serve` would run it on
    the server, and a PostScript file named digit.png would run it in predict."""
    status, answer = post(server["base"], {"inputs": [b64(EPS)]})
    assert status == 400 and "format read here" in answer["message"], answer
    w, env = champion
    (tmp_path / "digit.png").write_bytes(EPS)
    p = run([sys.executable, "-m", "stages.predict", str(tmp_path / "digit.png")], w,
            env=with_ghostscript(env, ghostscript), check=False)
    assert not ghostscript.exists(), f"Ghostscript ran: {ghostscript.read_text()}"
    assert p.returncode == 1 and p.stdout == "", p.stderr
    assert p.stderr == (f"{tmp_path / 'digit.png'}\terror: not an image file of a format read "
                        "here (BMP, JPEG, PNG, TIFF, WEBP); convert it, e.g. to PNG\n")


def test_a_jpeg_of_many_scans_is_refused_before_it_is_decoded(server, champion, tmp_path):
    """A progressive JPEG is decoded a scan at a time, each a pass over the whole image, and
    libjpeg sets no limit: 10,000 scans of a 4096x4096 image in 133 kB cost 15 s of the
    server's CPU (an 8 MiB body, 20 minutes), and as long in predict and prepare."""
    bomb = many_scan_jpeg(10_000)
    t0 = time.monotonic()
    status, answer = post(server["base"], {"inputs": [b64(bomb)]})
    assert status == 400 and answer["message"] == (
        "image 0: not a readable image (a JPEG of 10,001 scans, over the 100 read here "
        "(MAX_JPEG_SCANS in stages/lib/images.py); save it again, e.g. as PNG)"), answer
    assert time.monotonic() - t0 < 3
    status, answer = post(server["base"], {"inputs": [b64(many_scan_jpeg(8, size=64))]})
    assert status == 200, answer  # a usual progressive JPEG has about 10
    w, env = champion
    (tmp_path / "digit.jpg").write_bytes(bomb)
    p = run([sys.executable, "-m", "stages.predict", str(tmp_path / "digit.jpg")], w, env=env,
            check=False, timeout=60)
    assert p.returncode == 1 and p.stderr.endswith(
        "error: a JPEG of 10,001 scans, over the 100 read here (MAX_JPEG_SCANS in "
        "stages/lib/images.py); save it again, e.g. as PNG\n"), p.stderr


def answer_of(s: socket.socket) -> bytes:
    """All the server sends before it closes the connection."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_a_body_over_the_limit_gets_a_413_before_it_is_all_read(server):
    from reprotrain.serving.app import MAX_BODY_BYTES

    host, port = "127.0.0.1", server["port"]
    head = f"POST /invocations HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    # A declared length over the limit: refused with 1 KiB of it sent, the rest never read.
    with socket.create_connection((host, port), timeout=20) as s:
        s.sendall(f"{head}Content-Length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode() + b"[" * 1024)
        answer = answer_of(s)
        assert answer.startswith(b"HTTP/1.1 413 ") and b"MAX_BODY_BYTES" in answer, answer
    # No length (chunked): refused one byte past the limit, the body's end never sent.
    with socket.create_connection((host, port), timeout=20) as s:
        s.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
        chunk = b"a" * 2**20
        for _ in range(MAX_BODY_BYTES // len(chunk)):
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        s.sendall(b"1\r\na\r\n")
        answer = answer_of(s)
        assert answer.startswith(b"HTTP/1.1 413 ") and b"MAX_BODY_BYTES" in answer, answer
    status, good = post(server["base"], {"inputs": [b64(SAMPLE)]})
    assert status == 200 and len(good["predictions"]) == 1


def test_a_400_never_echoes_the_request(server):
    """MLflow's scoring server put the request into its 400s: a body that is not UTF-8 (a gzip
    file, Latin-1) came back as Python's repr, twice, with a UnicodeDecodeError (8 MB in, 80 MB
    and 3.6 s out), and {"inputs": "<1 MB>"} came back whole."""
    status, answer = post(server["base"], b'{"inputs": ["' + b"\xff" * 1_000_000 + b'"]}')
    assert status == 400 and answer["message"] == (
        "the request is not UTF-8 text (byte 13 is not); send JSON, {\"inputs\": [<base64 "
        "image file>, ...]}, uncompressed"), answer
    status, answer = post(server["base"], {"inputs": "A" * 1_000_000})
    assert status == 400 and len(json.dumps(answer)) < 2000, len(json.dumps(answer))
    assert answer["message"].startswith("inputs is a str, not a list; send a list")
    status, answer = post(server["base"], {"inputs": [b64(SAMPLES[7].read_bytes())]})
    assert status == 200, answer  # and it goes on


def test_the_pixels_of_a_request_are_bounded_before_any_is_decoded(server):
    """64 all-zero 4096x4096 PNGs are 1.4 MB of request and 13 s of decoding: each alone is
    allowed, together they are refused from their headers."""
    zeros = png(Image.new("L", (4096, 4096)))
    start = time.monotonic()
    status, answer = post(server["base"], {"inputs": [b64(zeros)] * 64})
    took = time.monotonic() - start
    assert status == 400 and "pixels together, over the 33,554,432" in answer["message"], answer
    assert answer["message"].startswith("images 0 to 2: ")
    assert took < 5, f"{took:.1f} s: the images were decoded"


def test_an_image_unlike_training_is_answered_with_predicts_warning(server, champion, tmp_path):
    """A digit drawn dark on light: predict warns on it, and the served answer carries the
    same warning; a usual digit gets none."""
    w, env = champion
    dark_on_light = tmp_path / "7.png"
    Image.eval(Image.open(ROOT / "data/samples/7.png").convert("L"), lambda v: 255 - v) \
        .save(dark_on_light)
    images = [dark_on_light, ROOT / "data/samples/7.png"]
    status, body = post(server["base"], {"inputs": [b64(p.read_bytes()) for p in images]})
    assert status == 200, body
    predicted = predict_json(w, env, images)
    assert "warning" in predicted[0] and "warning" not in predicted[1]
    assert body["predictions"][0]["warning"] == predicted[0]["warning"]
    assert "brighter than what the model learned from" in body["predictions"][0]["warning"]
    assert "warning" not in body["predictions"][1]


@pytest.mark.parametrize("unbuffered", ["", "1"], ids=["buffered", "unbuffered"])
def test_predict_into_a_pipe_closed_early_ends_quietly(champion, unbuffered):
    """`python -m stages.predict data/samples/ | head -3`: the reader gone, predict ends as a
    tool killed by SIGPIPE does, with no traceback (output buffered or, as under
    PYTHONUNBUFFERED, written line by line)."""
    w, env = champion
    read, write = os.pipe()
    os.close(read)  # nobody reads: the first write fails
    try:
        p = subprocess.run([sys.executable, "-m", "stages.predict", str(ROOT / "data/samples")],
                           cwd=w, env=dict(env, PYTHONUNBUFFERED=unbuffered), stdout=write,
                           stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert p.returncode == 128 + signal.SIGPIPE, p.stderr
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr


def test_predict_with_stdout_closed_says_so_in_one_line(champion):
    """`python -m stages.predict data/samples/ >&-`: Python sets sys.stdout to None, so every
    answer was lost silently, and the final flush ended in an AttributeError traceback."""
    w, env = champion
    p = subprocess.run([sys.executable, "-m", "stages.predict", str(ROOT / "data/samples")],
                       cwd=w, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       text=True, timeout=120, preexec_fn=lambda: os.close(1))
    assert p.returncode == 1 and p.stderr == (
        "error: stdout is closed (>&-): predict has nowhere to write its answers; redirect it, "
        "e.g. > answers.tsv\n"), p.stderr


def test_16_bit_palette_and_cmyk_images_are_answered_as_predict_does(server, champion, tmp_path):
    w, env = champion
    gray = np.asarray(Image.open(ROOT / "data/samples/3.png").convert("L"))
    files = {
        "16bit.png": png(Image.fromarray(gray.astype(np.uint16) * 257)),
        "palette.png": png(Image.fromarray(gray).convert("P")),
        "cmyk.jpg": png(Image.fromarray(gray).convert("CMYK"), format="JPEG", quality=95),
    }
    assert Image.open(io.BytesIO(files["16bit.png"])).mode.startswith("I")
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    status, body = post(server["base"], {"inputs": [b64(d) for d in files.values()]})
    assert status == 200, body
    assert_same(body["predictions"], predict_json(w, env, [tmp_path / n for n in files]))


class Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))  # would create the marker file when unpickled


def test_a_hostile_registered_model_never_runs_its_code(logged_in, tmp_path):
    """Anyone who can register a version on the team's server can put code in it: in its
    models-from-code file, or as a pickle. Serving and loading through reprotrain.serving.app takes only
    its model.onnx and model.json; loading the registered model with MLflow alone runs the
    code."""
    import mlflow
    from omegaconf import OmegaConf

    from reprotrain.serving.registry import load_champion

    marker = tmp_path / "pwned"
    genuine = Path(mlflow.artifacts.download_artifacts(f"models:/{NAME}/1",
                                                       dst_path=str(tmp_path / "v1")))
    client = mlflow.MlflowClient()

    code = genuine / "served_model.py"  # the registered model's copy of the code
    code.write_text(code.read_text() + f"open({str(marker)!r}, 'w').close()\n")
    pickled = tmp_path / "pickled"
    shutil.copytree(genuine, pickled)
    (pickled / "served_model.py").unlink()
    (pickled / "python_model.pkl").write_bytes(pickle.dumps(Exploit(marker)))
    conf = OmegaConf.load(pickled / "MLmodel")
    del conf.flavors.python_function.model_code_path
    conf.flavors.python_function.loader_module = "mlflow.pyfunc.model"
    conf.flavors.python_function.python_model = "python_model.pkl"
    OmegaConf.save(conf, pickled / "MLmodel")

    images = [p.read_bytes() for p in SAMPLES[:3]]
    good = load_champion().predict(images)
    experiment = client.get_experiment_by_name("reprotrain").experiment_id
    for hostile in (genuine, pickled):
        with mlflow.start_run(experiment_id=experiment) as r:
            mlflow.log_artifacts(str(hostile), "model")
        version = mlflow.register_model(f"runs:/{r.info.run_id}/model", NAME).version
        client.set_registered_model_alias(NAME, "champion", version)
        try:
            assert load_champion().predict(images) == good
            assert not marker.exists(), f"{hostile.name}: reprotrain.serving.app ran the model's code"
            # The fault is real: MLflow's own loader runs it.
            try:
                mlflow.pyfunc.load_model(f"models:/{NAME}/{version}")
            except Exception:  # noqa: BLE001, S110 - whether it then fails does not matter
                pass
            assert marker.exists(), f"{hostile.name}: the hostile model is not hostile"
            marker.unlink()
        finally:
            client.set_registered_model_alias(NAME, "champion", "1")


@pytest.fixture
def in_workspace(logged_in):
    """`python -m reprotrain.serving.app`'s main in this process, as if run in the workspace."""
    from reprotrain.serving.app import main

    return main


def test_the_served_folder_loads_anywhere_without_torch(in_workspace, tmp_path):
    in_workspace(["--save", str(tmp_path / "model")])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    check = ("import sys, json, base64, mlflow.pyfunc; m = mlflow.pyfunc.load_model('../model'); "
             f"out = m.predict([open({str(SAMPLES[0])!r}, 'rb').read()]); "
             "print(json.dumps([out[0]['label'], 'torch' in sys.modules, "
             "sys.modules['stages.inference'].__file__, 'stages.predict' in sys.modules]))")
    label, torch_loaded, source, command_loaded = json.loads(run(
        [sys.executable, "-c", check], elsewhere, env=env_with()).stdout)
    assert label in [str(i) for i in range(10)] and not torch_loaded and not command_loaded
    assert source.startswith(str(tmp_path / "model/code/stages"))


def test_dockerfile_names_the_locked_versions_and_the_pyfunc_server(in_workspace, tmp_path):
    out = tmp_path / "docker"
    in_workspace(["--dockerfile", str(out)])
    dockerfile = (out / "Dockerfile").read_text()
    locked = dict(re.findall(r"^([a-z0-9_.-]+)==([^\s;\\]+)", (ROOT / "requirements.lock").read_text(),
                             re.M))
    assert f"pip install mlflow=={locked['mlflow']}" in dockerfile
    assert "C._serve('local')" in dockerfile and "COPY model_dir/model /opt/ml/model" in dockerfile
    requirements = (out / "model_dir/model/requirements.txt").read_text().split()
    assert requirements == [f"{name}=={locked[name]}" for name in
                            ("mlflow", "onnxruntime", "pillow", "numpy", "omegaconf")]
    code = out / "model_dir/model/code/stages"
    assert sorted(p.relative_to(code).as_posix() for p in code.rglob("*.py")) == sorted(PACKAGE)


def test_the_log_is_private(server):
    """Root writing its log through a symlink another user planted at /tmp/NAME-PORT.log would
    overwrite what it points at: the log is in a new 0700 folder."""
    assert server["victim"].read_text() == "untouched\n" and server["planted"].is_symlink()
    log = log_of(server["out"][0])
    assert log.is_file() and log.parent.stat().st_mode & 0o777 == 0o700


def test_ctrl_c_stops_the_server_and_it_restarts_on_its_port_at_once(server, champion):
    proc, port = server["proc"], server["port"]
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:  # the server closes it:
        s.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 999999999\r\n\r\n")  # its side waits in TIME_WAIT
        assert answer_of(s).startswith(b"HTTP/1.1 413 ")
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends: the foreground group
    proc.wait(timeout=30)
    assert "stopping the model server" in proc.stderr.read()
    assert not log_of(server["out"][0]).parent.exists()  # a clean stop leaves no log folder
    time.sleep(0.5)
    with pytest.raises(OSError):
        post(server["base"], {"inputs": [b64(SAMPLE)]})
    assert not [cmd for cmd in command_lines().values() if f"--port\0{port}\0".encode() in cmd]
    # A restart after a crash: the same port, at once, not "taken" for TIME_WAIT's minute.
    with serving(*champion, port) as again:
        status, body = post(again["base"], {"inputs": [b64(SAMPLE)]})
        assert status == 200 and len(body["predictions"]) == 1, body


def test_sigterm_to_make_serve_is_a_clean_stop_that_leaves_no_log(champion):
    """`kill` of make (which passes SIGTERM on to its command), as a service manager stops it:
    the server stops, make reports no error (it printed `make: *** [Makefile:113: serve] Error
    143`), and the log's private folder is gone from $TMPDIR."""
    with serving(*champion) as s:
        proc, log = s["proc"], log_of(s["out"][0])
        assert log.is_file()
        os.kill(proc.pid, signal.SIGTERM)  # make alone
        err = proc.communicate(timeout=30)[1]
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, err)
    assert err.strip() == "stopping the model server", err
    assert not log.parent.exists()
    assert not [cmd for cmd in command_lines().values() if f"--port\0{s['port']}\0".encode() in cmd]


def test_a_port_another_server_listens_on_is_one_line(champion):
    w, env = champion
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        p = run(make_serve(port), w, env=env, check=False, timeout=120)
    assert p.returncode != 0 and "curl " not in p.stdout
    assert f"error: port {port} on 127.0.0.1 is taken; `make serve PORT={port + 1}`" in p.stderr


def command_lines() -> dict[int, bytes]:
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            out[int(pid)] = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # ended meanwhile
            pass
    return out


def test_no_champion_is_one_line_naming_the_fix(in_workspace):
    from stages.lib.errors import UserError

    with pytest.raises(UserError, match="no champion of registered model 'nope' in .*make repro"):
        in_workspace(["--name", "nope"])
