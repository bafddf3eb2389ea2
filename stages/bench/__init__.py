"""Measurements, each side by side in one run: the loop (`make bench`), the pipeline
(`make bench-pipeline`), serving (`make bench-serve`), sweeps, several nodes, the import graph,
and DVC's storage (a folder remote against S3)."""
