"""The served model's library: how it is logged (export) and how the champion is taken from the
registry to be served (`make serve`, reprotrain/serving/app.py) or loaded (`load_champion`).

What runs is this checkout's code, never code from the registry. Loading a logged pyfunc model
runs the Python file stored with it (models-from-code) or unpickles it (older models), and a
team's registry takes versions from anyone who can log one. So only the two data files are taken
from the champion, model.json (checked by stages.inference.read_spec) and model.onnx (a graph of
standard operators, run by onnxruntime); the model folder served is saved afresh around them
from stages/served_model.py of this checkout, with the modules it imports.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from pathlib import Path

from stages.config import load_params
from stages.inference import FILES, model_kwargs, package_copy, quiet_type_hints
from stages.lib.errors import UserError


def champion_files(name: str, dest: Path, alias: str = "champion") -> tuple[int, Path, str]:
    """The version number `alias` points at, its model.onnx and model.json downloaded to
    `dest`, and the run that made it (its id and name)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from reprotrain import tracking

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
    return int(found.version), dest / "artifacts", run_named(found.run_id)


def example_image(name: str, number: int, dest: Path) -> Path | None:
    """The first image of the version's input example (two of its own test images, which
    export logs with it) as a PNG file in `dest`; None when the version has none."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        got = mlflow.artifacts.download_artifacts(
            artifact_uri=f"models:/{name}/{number}/input_example.json", dst_path=str(dest))
        (first, *_) = json.loads(Path(got).read_text())
        png = dest / "example.png"
        png.write_bytes(base64.b64decode(first, validate=True))
        return png
    except (MlflowException, OSError, ValueError, TypeError):
        return None


def run_named(run_id: str) -> str:
    """`run <id> (<name>)`, what the MLflow UI's runs table shows; the id alone where the run
    cannot be read (deleted, or a login that may read the registry only)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        return f"run {run_id} ({mlflow.MlflowClient().get_run(run_id).info.run_name})"
    except MlflowException:
        return f"run {run_id}"


def lookup_failed(e: Exception, name: str, alias: str, uri: str) -> str:
    """Why the champion could not be looked up, in one line with its fix: a login refused or a
    server that does not answer is no reason to retrain (`make repro`)."""
    from reprotrain import tracking
    from reprotrain.redact import masked_uri
    from reprotrain.tracking.stores import is_server, reachable

    where = masked_uri(uri)  # credentials a URI may carry never reach a message
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


def champion_model(name: str, dest: Path, alias: str = "champion") -> tuple[int, Path]:
    """The version `alias` points at and a folder to serve it from (the module's docstring)."""
    number, files, _ = champion_files(name, dest / "registry", alias)
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
