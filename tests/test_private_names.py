"""Other libraries' private names this project still uses, each pinned here so that an upgrade
that moves one fails in seconds, naming it, instead of deep in a stage. Each use says why it is
private (no public equivalent) beside it; each test names the version it was checked on, and
fails on another one until someone checks the name there and moves the pin."""

from __future__ import annotations

import ast
import importlib.util
import io
import re
import sys
import tokenize

from tests.conftest import ROOT


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


def test_torchs_foreach_lerp_moves_each_tensor_toward_its_pair_in_place():
    # stages/optim.py EMA.update: torch._foreach_lerp_ averages every weight in one call.
    import torch

    assert torch.__version__.split("+")[0] == "2.14.1", \
        "checked on torch 2.14.1: recheck torch._foreach_lerp_ in optim.EMA.update"
    gen = torch.Generator().manual_seed(0)
    avg = [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen, dtype=torch.float64)]
    model = [torch.randn(a.shape, generator=gen, dtype=a.dtype) for a in avg]
    expected = [a.clone().lerp_(m, 0.25) for a, m in zip(avg, model, strict=True)]
    same = list(avg)
    torch._foreach_lerp_(avg, model, 0.25)
    assert all(a is b for a, b in zip(avg, same, strict=True))  # in place: EMA's own tensors
    assert all(torch.equal(a, e) for a, e in zip(avg, expected, strict=True))


def test_torchs_foreach_copy_copies_each_tensor_in_place():
    # stages/optim.py EMA.update: torch._foreach_copy_ copies the first update and the counters.
    import torch

    assert torch.__version__.split("+")[0] == "2.14.1", \
        "checked on torch 2.14.1: recheck torch._foreach_copy_ in optim.EMA.update"
    avg = [torch.zeros(3), torch.zeros((), dtype=torch.long)]
    model = [torch.arange(3.0), torch.tensor(7)]
    storage = [a.data_ptr() for a in avg]
    torch._foreach_copy_(avg, model)
    assert [a.data_ptr() for a in avg] == storage
    assert all(torch.equal(a, m) for a, m in zip(avg, model, strict=True))


def test_mlflows_package_map_the_warm_process_fills_ahead_exists():
    # reprotrain/warm.py PREWARM: mlflow.utils.requirements_utils._init_packages_to_modules_map,
    # called once in the warm process so that export's `log_model` finds the map made. Moved,
    # the warm process skips it and export pays its 0.5-2 s again, silently.
    import mlflow

    from reprotrain.warm import PREWARM

    assert mlflow.__version__ == "3.17.2", \
        "checked on MLflow 3.17.2: recheck _init_packages_to_modules_map in warm.PREWARM"
    assert PREWARM == (("mlflow.utils.requirements_utils", "_init_packages_to_modules_map"),)
    utils = importlib.import_module("mlflow.utils.requirements_utils")
    utils._init_packages_to_modules_map()
    # What it fills is the cache later calls reuse: the installed packages' modules.
    assert "torch" in utils._MODULES_TO_PACKAGES["torch"] and "torch" in utils._PACKAGES_TO_MODULES


def test_mlflows_latest_schema_revision_is_a_revision_id():
    # reprotrain/team/server.py schema_current and reprotrain/tracking/sync.py _schema_head:
    # mlflow.store.db.utils._get_latest_schema_revision, this MLflow's schema head.
    import mlflow
    from mlflow.store.db.utils import _get_latest_schema_revision

    assert mlflow.__version__ == "3.17.2", \
        "checked on MLflow 3.17.2: recheck _get_latest_schema_revision in server.py and sync.py"
    assert re.fullmatch(r"[0-9a-f]{12}", _get_latest_schema_revision())


def test_mlflows_schema_version_reads_a_stores_revision(mlflow_uri):
    # reprotrain/team/server.py schema_current: mlflow.store.db.utils._get_schema_version(engine),
    # equal to the head on a store this MLflow made, so `make server` skips `mlflow db upgrade`.
    import mlflow
    from mlflow.store.db.utils import _get_latest_schema_revision, _get_schema_version
    from sqlalchemy import create_engine

    assert mlflow.__version__ == "3.17.2", \
        "checked on MLflow 3.17.2: recheck _get_schema_version in server.schema_current"
    engine = create_engine(mlflow_uri)
    try:
        assert _get_schema_version(engine) == _get_latest_schema_revision()
    finally:
        engine.dispose()


# ------------------------------------------------------------ no unmarked private name


def private(name: str) -> bool:
    return bool(re.fullmatch(r"_[A-Za-z0-9]\w*", name)) and not name.endswith("__")


def library(dotted: str) -> bool:
    """Whether a dotted name is another library's: not this repo's, not the standard library's
    (whose underscore names are documented ones: os._exit, sys._xoptions, namedtuple's
    _replace), and installed (a string that only looks dotted names none)."""
    root = dotted.partition(".")[0]
    return bool(re.fullmatch(r"[A-Za-z]\w*(\.\w+)*", dotted)) and \
        root not in {"stages", "reprotrain", "tests"} and root not in sys.stdlib_module_names and \
        importlib.util.find_spec(root) is not None


def private_uses(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    """(node, dotted name) of each use of another library's private name: an import of one, an
    attribute of a name imported from a library (or of sys.modules["lib"]), a getattr family
    call with a private name as a literal, and a private name written as a string beside the
    library module it belongs to (("mlflow.x", "_f"), "torch._dynamo")."""
    bound = {}  # names the file's imports bind, anywhere in it: the module each stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {a.asname or a.name.partition(".")[0]: a.name if a.asname else
                      a.name.partition(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            bound |= {a.asname or a.name: f"{node.module}.{a.name}" for a in node.names}

    def dotted(node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return bound.get(node.id)
        if isinstance(node, ast.Attribute):
            return (base := dotted(node.value)) and f"{base}.{node.attr}"
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.modules" and \
                isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            return node.slice.value
        return None

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node, a.name) for a in node.names
                      if library(a.name) and any(map(private, a.name.split(".")))]
        elif isinstance(node, ast.ImportFrom) and not node.level and library(node.module or ""):
            found += [(node, f"{node.module}.{a.name}") for a in node.names
                      if any(map(private, f"{node.module}.{a.name}".split(".")))]
        elif isinstance(node, ast.Attribute) and private(node.attr):
            if (name := dotted(node)) and library(name):
                found.append((node, name))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr", "setattr", "delattr") and \
                len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and \
                isinstance(node.args[1].value, str) and private(node.args[1].value):
            owner = dotted(node.args[0])
            if owner is None or library(owner):  # an unknown object's too: mark it, or rename
                found.append((node, f"{owner or ast.unparse(node.args[0])}.{node.args[1].value}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                "." in node.value and library(node.value) and \
                any(map(private, node.value.split("."))):
            found.append((node, node.value))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Call)):
            items = node.args if isinstance(node, ast.Call) else node.elts
            texts = [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]
            modules = [t for t in texts if "." in t and library(t)]
            found += [(node, f"{modules[0]}.{t}") for t in texts if modules and private(t)]
    return found


def marked(source: str, tree: ast.AST, node: ast.AST) -> bool:
    """Whether a comment says "private" on the lines from the use's statement to the use, or in
    the comment lines right above that statement."""
    comments = {t.start[0]: t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type == tokenize.COMMENT}
    statement = min((s for s in ast.walk(tree) if isinstance(s, ast.stmt)
                     and s.lineno <= node.lineno <= s.end_lineno),
                    key=lambda s: s.end_lineno - s.lineno)
    lines, above = list(range(statement.lineno, node.end_lineno + 1)), statement.lineno - 1
    code = source.splitlines()
    while above > 0 and code[above - 1].lstrip().startswith("#"):
        lines.append(above)
        above -= 1
    return any(re.search(r"\bprivate\b", comments.get(n, ""), re.IGNORECASE) for n in lines)


def test_every_private_name_of_another_library_is_marked_and_pinned():
    """A private name of another library (torch's, MLflow's, DVC's, Optuna's...) used in the
    shipped code needs a comment beside it saying why it is private, and a test above that
    names it: a new one cannot slip in unmarked. A false alarm: mark it (or use the public
    name), never a list of exceptions here."""
    pins = (ROOT / "tests" / "test_private_names.py").read_text()
    unmarked, unpinned = [], []
    for folder in (ROOT / name for name in ("stages", "reprotrain")):
        for path in sorted(folder.rglob("*.py")) if folder.is_dir() else []:
            source = path.read_text()
            tree = ast.parse(source, str(path))
            for node, name in private_uses(tree):
                where = f"{path.relative_to(ROOT)}:{node.lineno} {name}"
                if not marked(source, tree, node):
                    unmarked.append(where)
                if next(p for p in reversed(name.split(".")) if private(p)) not in pins:
                    unpinned.append(where)
    assert not unmarked, f"say why each is private in a comment beside it: {unmarked}"
    assert not unpinned, f"pin each in tests/test_private_names.py: {unpinned}"
