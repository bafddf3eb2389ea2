"""Other libraries' private names this project still uses, each pinned here so that an upgrade
that moves one fails in seconds, naming it, instead of deep in a stage. Each use says why it is
private (no public equivalent) beside it; each test names the version it was checked on, and
fails on another one until someone checks the name there and moves the pin."""

from __future__ import annotations

import importlib.util


def test_the_model_files_dtype_codes_are_the_libraries_own():
    # stages/predict.py FILE_DTYPES: the .pt2 schema's and safetensors' dtype codes, written out
    # there; here checked against the libraries' private tables.
    import torch
    from safetensors.torch import _TYPES
    from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE

    from stages.predict import FILE_DTYPES, file_dtype

    for name, (pt2, safetensors) in FILE_DTYPES.items():
        assert _SERIALIZE_TO_TORCH_DTYPE[pt2] == getattr(torch, name) == _TYPES[safetensors]
        assert file_dtype("pt2", pt2) == file_dtype("safetensors", safetensors) == getattr(torch, name)
    assert file_dtype("pt2", 99) == 99


def test_the_heavy_modules_looked_up_by_name_exist():
    # stages/lib/cli.py HEAVY_IMPORTS, looked up in sys.modules only: one that moved would read
    # as never imported and the no-heavy-import test pass blind.
    from stages.lib.cli import HEAVY_IMPORTS

    for name in HEAVY_IMPORTS:
        assert importlib.util.find_spec(name) is not None, f"{name} is gone: update HEAVY_IMPORTS"


def test_the_modules_the_warm_process_preloads_exist():
    # reprotrain/warm.py PRELOAD: one that moved would end every warm start in an ImportError.
    from reprotrain.warm import PRELOAD

    for name in PRELOAD:
        assert importlib.util.find_spec(name) is not None, f"{name} is gone: update PRELOAD"
