"""Other libraries' private names this project still uses, each pinned here so that an upgrade
that moves one fails in seconds, naming it, instead of deep in a stage. Each use says why it is
private (no public equivalent) beside it."""

from __future__ import annotations


def test_the_interpreters_own_shutdown_steps_exist():
    # stages/lib/cli.py exit_now: what a normal exit calls, before skipping the teardown.
    import atexit
    import threading

    assert callable(threading._shutdown) and callable(atexit._run_exitfuncs)


def test_torch_exports_dtype_table_reads_what_export_writes():
    # stages/predict.py pt2_weights: the .pt2 archive's dtype names, read without torch.export.load.
    import torch
    from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE

    assert torch.float32 in _SERIALIZE_TO_TORCH_DTYPE.values()
    assert all(isinstance(d, torch.dtype) for d in _SERIALIZE_TO_TORCH_DTYPE.values())
