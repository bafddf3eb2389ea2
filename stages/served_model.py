"""The served model as MLflow serves it (`mlflow models serve`, the container `make serve
--dockerfile` builds), logged as code (MLflow models-from-code) over the artifacts model.onnx
and model.json: the classifier of stages/inference.py, its refusals as MLflow's 400s.

MLflow runs this file to load the model. `make serve` (reprotrain/serving/app.py) never loads it:
it serves the classifier itself, and takes only model.onnx and model.json from the registry.
"""

from __future__ import annotations

from pathlib import Path

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

from stages.inference import BadInput, Classifier


class Refused(MlflowException):
    """A 400 with the classifier's one line. MLflow's scoring server prepends the whole request
    to a model's error message ("Failed to predict data '<every image>'"): this message ignores
    that assignment."""

    def __init__(self, line: str):
        self._line = line
        super().__init__(line, error_code=INVALID_PARAMETER_VALUE)

    @property
    def message(self) -> str:
        return self._line

    @message.setter
    def message(self, _: str) -> None:
        pass


class ImageClassifier(mlflow.pyfunc.PythonModel):
    def load_context(self, context: mlflow.pyfunc.PythonModelContext) -> None:
        self.classify = Classifier(Path(context.artifacts["model.json"]),
                                   Path(context.artifacts["model.onnx"]))

    def predict(self, model_input: list[str | bytes]) -> list[dict[str, str | float | dict[str, float]]]:
        """One record per image: `label`, its `probability`, and `probabilities` by class name."""
        try:
            return self.classify(model_input)
        except BadInput as e:
            raise Refused(str(e)) from None


mlflow.models.set_model(ImageClassifier())
