"""The champion model over HTTP (`make serve`, app.py) and how it is taken from the registry
(registry.py). What it answers, and the model MLflow serves, are the experiment's:
stages/inference.py (Classifier) and stages/served_model.py."""
