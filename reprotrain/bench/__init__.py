"""Measurements, each side by side in one run: the loop (`make bench`), the pipeline
(`make bench-pipeline`), serving (`make bench-serve`), sweeps, several nodes, the import graph,
DVC's storage (a folder remote against S3) and datasets at scale (`make bench-data`: shards
against ImageFolder and tensors)."""

from __future__ import annotations

import os


def cpu_label() -> str:
    """The CPU a figure came from: results differ between CPUs with and without bf16."""
    from stages.runtime import cpu_has_bf16, cpu_name  # torch: only once a bench has run

    bf16 = "bf16 (AMX/AVX512-BF16)" if cpu_has_bf16() else "no bf16: fp32"
    return f"{cpu_name()}, {os.cpu_count()} cores, {bf16}"

