"""The served model's library: how it is logged (export) and how the champion is taken from the
registry to be served (`make serve`, stages/serving/app.py) or loaded (`load_champion`).

What runs is this checkout's code, never code from the registry. Loading a logged pyfunc model
runs the Python file stored with it (models-from-code) or unpickles it (older models), and a
team's registry takes versions from anyone who can log one. So only the two data files are taken
from the champion, model.json (checked by stages.inference.read_spec) and model.onnx (a graph of
standard operators, run by onnxruntime); the model folder served is saved afresh around them
from stages/serving/served_model.py of this checkout, with the modules it imports.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import stat
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from urllib.parse import urlencode

from stages.config import load_params
from stages.lib.errors import UserError

# Downloads of two small files need no progress bars in the output.
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

SERVED_MODEL = Path(__file__).with_name("served_model.py")
FILES = ("model.onnx", "model.json")
# What the served model imports, at the versions of this environment (requirements.lock): the
# model's requirements.txt, which a container built from it installs.
REQUIREMENTS = ("mlflow", "onnxruntime", "pillow", "numpy", "omegaconf")
# The modules of stages/ it imports, transitively, and the two that config reads as text (the
# registries of models and sources): tests/test_serving.py checks the list against the import graph
# and loads a saved model away from the checkout.
PACKAGE = ("__init__.py", "config.py", "inference.py", "models.py", "sources.py", "lib/__init__.py",
           "lib/errors.py", "lib/images.py", "lib/paths.py", "lib/strict_yaml.py",
           "serving/__init__.py", "serving/classifier.py")
STAGES = SERVED_MODEL.parents[1]
# The champions looked up before, by registry, name and alias: a restart of `make serve` takes
# the files from here while the registry provably still points at them (`cached`), without
# MLflow's import (1.3 s of a 2-core machine's) and its lookup.
CACHE = Path(sys.prefix) / "var" / "reprotrain-serve"
# A sqlite store written this recently is not cached: a write in the same tick of the file
# system's clock (a few ms) would leave its mtime as it was.
QUIET_S = 2.0
# MLflow's settings that send the lookup to another registry (its own URI, a workspace) or change
# how its client calls: with any of them set, every start looks the champion up through MLflow.
CLIENT_OPTIONS = ("MLFLOW_REGISTRY_URI", "MLFLOW_ENABLE_WORKSPACES", "MLFLOW_WORKSPACE",
                  "MLFLOW_WORKSPACE_STORE_URI", "MLFLOW_TRACKING_INSECURE_TLS",
                  "MLFLOW_TRACKING_SERVER_CERT_PATH", "MLFLOW_TRACKING_CLIENT_CERT_PATH",
                  "MLFLOW_TRACKING_AUTH", "MLFLOW_TRACKING_AWS_SIGV4")


def png_base64(images) -> list[str]:
    """uint8 (N, C, H, W) images as base64 PNG files: the model's input example."""
    from PIL import Image

    out = []
    for img in images:
        buf = io.BytesIO()
        arr = img.transpose(1, 2, 0)
        Image.fromarray(arr[:, :, 0] if arr.shape[2] == 1 else arr).save(buf, format="PNG")
        out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return out


def model_kwargs(folder: Path, example: list[str] | None = None,
                 package: Path | None = None) -> dict:
    """Arguments of mlflow.pyfunc.log_model/save_model for the served model over `folder`'s
    model.onnx and model.json; with `package` (a copy of what it imports from stages/) inside."""
    return {"python_model": str(SERVED_MODEL),
            "artifacts": {name: str(folder / name) for name in FILES},
            "input_example": example,
            "pip_requirements": [f"{p}=={version(p)}" for p in REQUIREMENTS],
            "code_paths": [str(package)] if package else None}


def package_copy(dest: Path) -> Path:
    """The modules of stages/ that the served model imports, as a package in `dest`."""
    package = dest / "stages"
    package.mkdir(parents=True)
    for name in PACKAGE:
        (package / name).parent.mkdir(exist_ok=True)
        shutil.copy2(STAGES / name, package / name)
    # Not the checkout's: its hand-off to a warm process has no place in a served model.
    (package / "__init__.py").write_text('"""reprotrain\'s inference, as the served model runs it."""\n')
    return package


def champion_files(name: str, dest: Path, alias: str = "champion") -> tuple[int, Path]:
    """The version number `alias` points at, and its model.onnx and model.json downloaded to
    `dest`."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from stages import tracking

    uri = tracking.tracking_uri(load_params().mlflow)
    mlflow.set_tracking_uri(uri)
    try:
        found = mlflow.MlflowClient().get_model_version_by_alias(name, alias)
    except MlflowException as e:
        raise UserError(lookup_failed(e, name, alias, uri)) from None
    # The files of one version, by number: the alias can move between the two downloads.
    for file in FILES:
        try:
            mlflow.artifacts.download_artifacts(
                artifact_uri=f"models:/{name}/{found.version}/artifacts/{file}", dst_path=str(dest))
        except (MlflowException, OSError) as e:
            raise UserError(f"{name} version {found.version} ({alias}) has no artifacts/{file} "
                            f"({tracking.reason(e)}): it is not a model this export logged (an "
                            "mlflow.pytorch model from before?); serve another version with "
                            "--alias candidate, or move the alias") from None
    return int(found.version), dest / "artifacts"


def served_files(name: str, dest: Path, alias: str = "champion") -> tuple[int, Path]:
    """champion_files, from the cache when the registry provably still points where it did when
    they were last downloaded; else looked up, downloaded and cached."""
    from stages import tracking

    uri = tracking.tracking_uri(load_params().mlflow)
    entry = cache_entry(uri, name, alias) if cache_usable() else None
    if entry and (number := cached(entry, uri, name, alias, dest)) is not None:
        return number, dest
    seen = witness(uri, name, alias)  # before the lookup: a write during it changes it
    number, files = champion_files(name, dest / "registry", alias)
    if entry and seen and seen.get("version", str(number)) == str(number):
        keep(entry, {"uri": uri, "name": name, "alias": alias, "version": number,
                     "witness": seen, "sha256": {f: sha256(files / f) for f in FILES}}, files)
    return number, files


def cache_entry(uri: str, name: str, alias: str) -> Path:
    return CACHE / hashlib.sha256(f"{uri}\0{name}\0{alias}".encode()).hexdigest()[:24]


def cache_usable() -> bool:
    """No MLflow setting that sends the lookup elsewhere (a registry of its own, a workspace) or
    changes how it is made; and the cache folder, if there, a real folder of this user's that
    nobody else can write to."""
    if any(os.environ.get(k) for k in CLIENT_OPTIONS):
        return False
    try:
        st = CACHE.lstat()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def cached(entry: Path, uri: str, name: str, alias: str, dest: Path) -> int | None:
    """The cached version, its files copied to `dest`, when the registry's witness is as it was
    when they were downloaded; else None (any doubt, any error: a miss)."""
    try:
        found = json.loads((entry / "lookup.json").read_text())
        if (found["uri"], found["name"], found["alias"]) != (uri, name, alias) or \
                found["witness"] != witness(uri, name, alias):
            return None
        dest.mkdir(parents=True, exist_ok=True)
        for file, digest in found["sha256"].items():  # a copy made while the entry was replaced
            shutil.copyfile(entry / file, dest / file)
            if sha256(dest / file) != digest:
                return None
        os.utime(entry)  # served from: kept
        return int(found["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def witness(uri: str, name: str, alias: str) -> dict | None:
    """What proves the alias has not moved since: a sqlite store's files as stat sees them (any
    write changes them), or the version a tracking server names for it; None where nothing
    cheap proves it (another store, a sqlite file written within QUIET_S, a server that does not
    answer this call)."""
    from stages.tracking.stores import is_server

    if is_server(uri):
        return server_version(uri, name, alias)
    if not uri.startswith("sqlite:///") or uri.startswith("sqlite:///file:"):
        return None
    db = Path(uri.removeprefix("sqlite:///").split("?", 1)[0])
    files = []
    for path in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-journal")):
        try:
            st = path.stat()
        except FileNotFoundError:
            files.append(None)
            continue
        except OSError:
            return None
        if time.time() - st.st_mtime < QUIET_S:
            return None
        files.append([st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns])
    return {"stat": files} if files[0] is not None else None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # urllib would send the login on to anywhere
        return None


def server_version(uri: str, name: str, alias: str) -> dict | None:
    """The version `alias` points at on the tracking server, as the REST call MLflow's client
    makes for it answers, with the user's login, without MLflow's import: its number and what
    tells it from a number reused (a new database behind the same address, the registered model
    made again). None for a refusal, a redirect or any failure."""
    user, password = (os.environ.get(f"MLFLOW_TRACKING_{k}") for k in ("USERNAME", "PASSWORD"))
    headers = {}
    if user and password:  # as MLflow's client: basic auth first, then a token
        login = base64.b64encode(f"{user}:{password}".encode()).decode()
        headers["Authorization"] = f"Basic {login}"
    elif token := os.environ.get("MLFLOW_TRACKING_TOKEN"):
        headers["Authorization"] = f"Bearer {token}"
    query = urlencode({"name": name, "alias": alias})
    url = f"{uri.rstrip('/')}/api/2.0/mlflow/registered-models/alias?{query}"
    try:
        with urllib.request.build_opener(_NoRedirect).open(
                urllib.request.Request(url, headers=headers), timeout=5) as r:
            found = json.load(r)["model_version"]
        return {k: str(found.get(k)) for k in ("version", "creation_timestamp", "source",
                                                "run_id", "model_id")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def keep(entry: Path, lookup: dict, files: Path) -> None:
    """The entry written whole beside the old one, then swapped in: a reader sees the old, the
    new or none (a miss). Best effort: a cache that cannot be written is no cache."""
    new = old = None
    try:
        CACHE.mkdir(parents=True, mode=0o700, exist_ok=True)
        if not cache_usable():
            return
        for stale in CACHE.iterdir():  # a registry not served from for a week (a test's server)
            if time.time() - stale.lstat().st_mtime > 7 * 86400:
                shutil.rmtree(stale, ignore_errors=True)
        new = Path(tempfile.mkdtemp(dir=CACHE, prefix=".new-"))
        for file in FILES:
            shutil.copyfile(files / file, new / file)
        (new / "lookup.json").write_text(json.dumps(lookup) + "\n")
        old = Path(tempfile.mkdtemp(dir=CACHE, prefix=".old-"))
        with contextlib.suppress(FileNotFoundError):
            entry.rename(old / "entry")
        new.rename(entry)  # another start's entry there since: this one is dropped
    except OSError:
        pass
    finally:
        for folder in (new, old):
            if folder is not None and folder.exists():
                shutil.rmtree(folder, ignore_errors=True)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def lookup_failed(e: Exception, name: str, alias: str, uri: str) -> str:
    """Why the champion could not be looked up, in one line with its fix: a login refused or a
    server that does not answer is no reason to retrain (`make repro`)."""
    from stages import tracking
    from stages.tracking.stores import is_server, plain_uri, reachable

    where = plain_uri(uri)  # credentials a URI may carry never reach a message
    what = f"the {alias} of registered model {name!r}"
    if is_server(uri) and not reachable(uri):
        return (f"the tracking server at {where} does not answer, so {what} cannot be looked "
                "up; start it (`make server`, docs/server.md) or set "
                "MLFLOW_TRACKING_URI to one that runs")
    if refused := tracking.refusal(e):
        if getattr(e, "error_code", None) == "PERMISSION_DENIED":
            refused = (f"user {os.environ.get('MLFLOW_TRACKING_USERNAME')!r} may not read it: ask "
                       "the server's admin for READ on the registered model")
        return f"cannot look up {what} at {where}: {refused}"
    return (f"no {alias} of registered model {name!r} in {where} ({tracking.reason(e)}); run "
            "`make repro` (export registers each model as export.register_as in params.yaml) "
            "or pass --name")


def save_served(folder: Path, dest: Path) -> Path:
    """The served model saved to `dest` from this checkout's code over `folder`'s files, with
    the modules it imports inside: it loads from any folder, and in a container."""
    import mlflow

    with tempfile.TemporaryDirectory() as tmp, quiet_type_hints():
        mlflow.pyfunc.save_model(str(dest), **model_kwargs(folder, package=package_copy(Path(tmp))))
    return dest


@contextmanager
def quiet_type_hints() -> Iterator[None]:
    """MLflow logs that it cannot check the elements of a `str | bytes` list: served_model.py
    checks each image itself."""
    logger = logging.getLogger("mlflow.types.type_hints")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def champion_model(name: str, dest: Path, alias: str = "champion") -> tuple[int, Path]:
    """The version `alias` points at and a folder to serve it from (the module's docstring)."""
    number, files = champion_files(name, dest / "registry", alias)
    return number, save_served(files, dest / "model")


def load_champion(name: str | None = None):
    """The champion as a pyfunc model in this process: `load_champion().predict([bytes...])`."""
    import mlflow

    dest = Path(tempfile.mkdtemp(prefix="reprotrain-champion-"))
    try:
        _, folder = champion_model(name or registered_name(), dest)
        return mlflow.pyfunc.load_model(str(folder))  # onnxruntime holds the graph in memory
    finally:
        shutil.rmtree(dest, ignore_errors=True)


def registered_name() -> str:
    name = load_params().export.register_as
    if not name:
        raise UserError("params.yaml: export.register_as is empty, so export registers no model "
                        "to serve; set it (e.g. `digits`), run `make repro`, or pass --name")
    return name
