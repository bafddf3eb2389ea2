"""The champion model over HTTP (`make serve`, app.py): what it answers (classifier.py), how it is
logged and taken from the registry (registry.py), and the model MLflow serves (served_model.py)."""
