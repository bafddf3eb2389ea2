"""The champion model over HTTP (`make serve`, app.py): what it answers (classifier.py), how it is
logged and taken from the registry (registry.py), and the model MLflow serves (served_model.py)."""


def __getattr__(name: str):  # an old `from stages.serving import x`: say where x lives now
    from stages import moved_attribute

    return moved_attribute(__name__, name)
