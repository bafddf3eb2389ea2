"""The import graph of the experiment (stages/) and the platform (reprotrain/): which module
imports which, in layers, drawn as a picture.

    python -m reprotrain.bench.imports [--rev REV] [--out imports.png]

dvc.yaml's deps come from it (tests/experiment/test_dvc_yaml.py), and docs/code-map.md shows its pictures.
Imports inside functions count: they run as surely as the ones at the top. A package's
`__init__` counts only where it is imported by name (importing stages.lib.files runs
stages/lib/__init__.py, a docstring, which decides nothing). It sees imports only:
stages/config.py also reads stages/models.py and stages/sources.py as text (the names of their
registries, without importing torch), which no edge here shows.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("stages", "reprotrain")  # the experiment, the platform
# Where the platform's modules were before they left stages/ (at fde514b and earlier), so that
# counts of an old revision compare with today's.
PLATFORM_BEFORE = ("stages.tracking", "stages.sweep", "stages.serving", "stages.team",
                   "stages.bench", "stages.lib.warm", "stages.lib.processes", "stages.lib.redact",
                   "stages.lib.ports", "stages.lib.pip_progress")


def ours(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def platform(module: str) -> bool:
    return module.startswith("reprotrain") or any(
        module == p or module.startswith(p + ".") for p in PLATFORM_BEFORE)


def sources(rev: str | None = None) -> dict[str, str]:
    """Each module of both packages (dotted name) -> its source: of the checkout, or of git
    revision `rev`."""
    if rev is None:
        files = {p.relative_to(ROOT).as_posix(): p.read_text() for package in PACKAGES
                 for p in (ROOT / package).rglob("*.py")}
    else:
        listed = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, *PACKAGES], cwd=ROOT,
                                check=True, capture_output=True, text=True).stdout.split()
        files = {f: subprocess.run(["git", "show", f"{rev}:{f}"], cwd=ROOT, check=True,
                                   capture_output=True, text=True).stdout
                 for f in listed if f.endswith(".py")}
    return {module_name(f): text for f, text in files.items()}


def module_name(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_file(name: str) -> str:
    """stages.lib.files -> stages/lib/files.py; a package of the checkout -> its __init__.py."""
    path = name.replace(".", "/")
    return f"{path}/__init__.py" if (ROOT / path).is_dir() else f"{path}.py"


def graph(texts: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the modules of both packages it imports."""
    edges: dict[str, set[str]] = {}
    for name, text in texts.items():
        out: set[str] = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                    ours(node.module):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    out.add(sub if sub in texts else node.module)
            elif isinstance(node, ast.Import):
                out |= {a.name for a in node.names if ours(a.name)}
        edges[name] = {m for m in out if m in texts and m != name and m not in PACKAGES}
    return edges


def closure(edges: dict[str, set[str]], start: str, stop: Callable[[str], bool]) -> set[str]:
    """`start` and what it imports, transitively, not going into modules where `stop` holds."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name not in seen and not (stop(name) and name != start):
            seen.add(name)
            todo += edges.get(name, ())
    return seen


def layers(edges: dict[str, set[str]]) -> dict[str, int]:
    """0 for a module that imports none of stages/, else one more than its highest import's
    (modules on a cycle share the layer of the cycle)."""
    import networkx as nx

    g = nx.DiGraph([(a, b) for a, bs in edges.items() for b in bs])
    g.add_nodes_from(edges)
    dag = nx.condensation(g)
    level: dict[int, int] = {}
    for c in reversed(list(nx.topological_sort(dag))):
        level[c] = 1 + max((level[d] for d in dag.successors(c)), default=-1)
    return {m: level[dag.graph["mapping"][m]] for m in edges}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    import networkx as nx

    g = nx.DiGraph([(a, b) for a, bs in edges.items() for b in bs])
    return [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]


def packages_of(edges: dict[str, set[str]]) -> set[str]:
    return {m for m in edges if any(n.startswith(m + ".") for n in edges)}


def crossing(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The arrows from the experiment to the platform: its hooks (docs/code-map.md)."""
    return sorted((a, b) for a, bs in edges.items() for b in bs
                  if not platform(a) and platform(b))


def summary(edges: dict[str, set[str]]) -> dict[str, int]:
    top = [m for m in edges if m.startswith("stages.") and m.count(".") == 1
           and m not in packages_of(edges)]
    return {"modules": len(edges), "experiment": sum(not platform(m) for m in edges),
            "platform": sum(platform(m) for m in edges),
            "top_level_modules": len(top), "layers": max(layers(edges).values()) + 1,
            "imports": sum(map(len, edges.values())),
            "experiment_to_platform": len(crossing(edges)), "cycles": len(cycles(edges))}


# What a fork edits (docs/code-map.md): its share of stages/ is the layout's measure.
FORK_EDITS = ("stages/models.py", "stages/sources.py", "stages/batches.py", "stages/loop.py",
              "stages/optim.py")


def lines(rev: str | None = None) -> dict[str, int]:
    """Physical lines (`wc -l`) by part: the experiment, what a fork edits, the platform's
    packages, the tests; of the checkout or of git revision `rev` (either layout)."""
    listed = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev or "HEAD"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout.split()
    if rev is None:  # the working tree: what git tracks or would, as it is now
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                                cwd=ROOT, check=True, capture_output=True, text=True).stdout.split()
    count = {f: (Path(ROOT / f).read_text() if rev is None else subprocess.run(
        ["git", "show", f"{rev}:{f}"], cwd=ROOT, check=True, capture_output=True,
        text=True).stdout).count("\n") for f in listed
        if f.endswith(".py") and (rev is not None or (ROOT / f).is_file())}
    def of_platform(f: str) -> bool:
        return platform(module_name(f))

    def package(name: str):  # the platform's packages, wherever they are
        return lambda f: f.startswith((f"stages/{name}/", f"reprotrain/{name}/"))

    parts = {"top of stages/ (`stages/*.py`)": lambda f: f.count("/") == 1 and
             f.startswith("stages/"),
             "of which the five a fork edits": lambda f: f in FORK_EDITS,
             "stages/lib/": lambda f: f.startswith("stages/lib/"),
             **{f"{name}/": package(name) for name in
                ("bench", "tracking", "sweep", "team", "serving")},
             "top of reprotrain/ (`reprotrain/*.py`)": lambda f: f.count("/") == 1 and
             f.startswith("reprotrain/"),
             "all of stages/": lambda f: f.startswith("stages/"),
             "the experiment (stages/ less the platform)": lambda f: f.startswith("stages/")
             and not of_platform(f),
             "the platform (reprotrain/, or its modules in stages/)": lambda f:
             not f.startswith("tests/") and of_platform(f),
             "tests": lambda f: f.startswith("tests/")}
    return {name: sum(n for f, n in count.items() if test(f)) for name, test in parts.items()}


def draw(edges: dict[str, set[str]], out: Path, title: str) -> None:
    """Boxes in rows by layer (imports point down), coloured by package."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def package(m: str) -> str | None:
        name = m.removeprefix("stages.").removeprefix("reprotrain.")
        if platform(m):  # a colour per package of the platform, one for its single modules
            first = name.split(".")[0]
            return first if first != "lib" and ("." in name or m in packages_of(edges)) else "*"
        return "lib" if name.startswith("lib") else None  # white: the experiment

    imported = set().union(*edges.values())
    shown = {m: bs for m, bs in edges.items()  # not a package that is only a docstring
             if bs or m in imported or m not in packages_of(edges) and m not in PACKAGES}
    level = layers(shown)
    columns: dict[int, list[str]] = {}
    for m in sorted(shown, key=lambda m: (package(m) or "", m)):
        columns.setdefault(level[m], []).append(m)
    width = max(map(len, columns.values()))
    # Rows are layers, the bottom one first: every arrow points down.
    pos = {m: ((i + 0.5) * width / len(ms), 1.4 * y) for y, ms in columns.items()
           for i, m in enumerate(ms)}
    colours = dict(zip(sorted({package(m) for m in shown} - {None}), plt.cm.Set2.colors, strict=False))
    fig, ax = plt.subplots(figsize=(1.7 * width + 1, 0.95 * len(columns) + 1.5))
    hooks = set(crossing(shown))
    for a, bs in shown.items():
        for b in bs:  # the experiment's hooks into the platform in red
            ax.annotate("", xy=pos[b], xytext=pos[a], arrowprops={
                "arrowstyle": "->", "color": "#d62728" if (a, b) in hooks else "#888",
                "lw": 1.2 if (a, b) in hooks else 0.5, "alpha": 0.9 if (a, b) in hooks else 0.5,
                "shrinkA": 14, "shrinkB": 14})
    for m, (x, y) in pos.items():
        ax.text(x, y, m.removeprefix("stages.").removeprefix("reprotrain."), ha="center",
                va="center", fontsize=8,
                bbox={"boxstyle": "round", "fc": colours.get(package(m), "white"), "ec": "#333"})
    s = summary(edges)
    ax.set_title(f"{title}: {s['modules']} modules ({s['experiment']} of the experiment, stages/, "
                 f"{s['top_level_modules']} at its top; {s['platform']} of the platform), "
                 f"{s['layers']} layers, {s['imports']} imports, "
                 f"{s['experiment_to_platform']} from the experiment to the platform (red), "
                 f"{s['cycles']} cycles\nrows are layers: a module imports only modules below "
                 "it; white = the experiment (its lib/ in a colour), a colour per package of the platform",
                 fontsize=10)
    ax.set_xlim(-0.3, width + 0.3)
    ax.set_ylim(-0.8, 1.4 * max(columns) + 0.8)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m reprotrain.bench.imports",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--rev", help="a git revision instead of the checkout")
    ap.add_argument("--out", type=Path, help="draw the graph into this PNG")
    ap.add_argument("--lines", action="store_true", help="lines by part instead of the graph")
    a = ap.parse_args()
    if a.lines:
        for name, n in lines(a.rev).items():
            print(f"{n:7,}  {name}")
        return
    edges = graph(sources(a.rev))
    print(" ".join(f"{k}={v}" for k, v in summary(edges).items()))
    print("top of stages/:", " ".join(sorted(m.removeprefix("stages.") for m in edges
                                              if m.startswith("stages.") and m.count(".") == 1)))
    print("experiment -> platform:", " ".join(f"{a}->{b}" for a, b in crossing(edges)))
    if a.out:
        draw(edges, a.out, a.rev or "this checkout")


if __name__ == "__main__":
    main()
