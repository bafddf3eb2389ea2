"""YAML read strictly, for files DVC hashes as text (params.yaml, a sweep file): plain
containers, no interpolation, a bounded size. It knows no params schema: stages/config.py checks
params.yaml's keys and values, reprotrain/sweep/spec.py a sweep file's.

OmegaConf reads the YAML (PyYAML would read `1e-3` as a string); a syntax error or a duplicate
key names the line, and a file or an alias bomb too large for any params file is refused before
it is expanded.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from stages.lib.errors import UserError

# A params.yaml holds about a hundred values in under 2 KB: these bounds are far above any real
# one and stop a file that would make every stage read gigabytes ("billion laughs" aliases).
MAX_YAML_BYTES = 64 * 1024
MAX_YAML_NODES = 10_000


class YamlError(UserError, ValueError):
    """A file that is no strict YAML; the message names the file (and the line or key)."""


def read_yaml(path: Path) -> Any:
    """The YAML as plain containers, uninterpolated; a syntax error or a duplicate key names
    the line."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import GrammarParseError, OmegaConfBaseException

    with open(path, "rb") as f:
        text = f.read(MAX_YAML_BYTES + 1)  # at most this: the path may be a huge file or a pipe
    if len(text) > MAX_YAML_BYTES:
        raise YamlError(f"{path}: larger than {MAX_YAML_BYTES // 1024} KiB, far more than any "
                        f"params file; restore it (`git diff {path}` shows your edits)")
    try:
        # Aliases share one node when composed, so the expanded size is counted before
        # OmegaConf copies every one of them.
        if _expanded_nodes(yaml.compose(text, Loader=yaml.SafeLoader), {}) > MAX_YAML_NODES:
            raise YamlError(f"{path}: expands to over {MAX_YAML_NODES} values through YAML "
                            "aliases (*name); write the values out instead of nesting aliases")
        return OmegaConf.to_container(OmegaConf.load(io.BytesIO(text)), resolve=False) or {}
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        if isinstance(e, GrammarParseError):  # a broken `${`: refused naming its key, as any `${`
            refuse_interpolation(yaml.safe_load(text), path)
        where = getattr(e, "problem_mark", None)
        line = f"line {where.line + 1}: " if where else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise YamlError(f"{path}: {line}{what}; fix the YAML (`git diff {path}` shows your "
                        "edits)") from None
    except RecursionError:
        raise YamlError(f"{path}: nested too deeply (or an alias inside itself); fix the YAML "
                        f"(`git diff {path}` shows your edits)") from None


def _expanded_nodes(node: Any, seen: dict[int, int]) -> int:
    """How many nodes the document has once every alias is copied out, counting each shared
    node once (`seen`: its count, -1 while inside it: an alias of itself recurses)."""
    import yaml

    if seen.get(id(node)) == -1:
        raise RecursionError
    if id(node) not in seen:
        seen[id(node)] = -1
        children = node.value if isinstance(node, yaml.SequenceNode) else \
            [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else []
        seen[id(node)] = 1 + sum(_expanded_nodes(c, seen) for c in children)
    return seen[id(node)]


def refuse_interpolation(value: Any, path: Path, key: str = "") -> None:
    """DVC hashes params.yaml's text, so a `${...}` (an environment variable, another key, a
    resolver) or OmegaConf's missing-value `???` (which becomes the default) would let the
    stages use a value DVC never recorded."""
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        name = f"{key}[{k}]" if isinstance(value, list) else f"{key}.{k}" if key else str(k)
        refuse_interpolation(v, path, name)
    if value == "???":
        raise YamlError(f"{path}: {key}='???' means a missing value to OmegaConf, which would "
                        "use the default that DVC never recorded; write the value itself")
    if isinstance(value, str) and "${" in value:
        raise YamlError(f"{path}: {key}={value!r}: interpolation (${{...}}) is not allowed, since "
                        "DVC would record the text, not the value the stages use; write the "
                        "value itself")
