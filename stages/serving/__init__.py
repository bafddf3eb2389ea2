"""The champion model over HTTP (`make serve`, app.py), how the served model is logged and taken
from the registry (registry.py), and the model MLflow serves (served_model.py)."""
