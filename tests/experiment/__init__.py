"""The experiment's tests: stages/ on real data, DVC and an embedded MLflow store; no service."""
