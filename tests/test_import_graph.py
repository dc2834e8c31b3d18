"""The package imports one way: files -> ops -> layers -> model -> (interop | train) -> bench -> cli.

Every module under hybridlm/ is parsed with `ast` (nothing is imported): every `import` / `from ... import` at any
depth (inside functions too: a lazy import is still a dependency) and every `importlib.import_module("...")` with a
literal name. A module may import its own layer and the layers below it, never a layer above, never the other
layer of the same rank (interop and train do not know each other), and neither the layers nor the modules form a
circle.
"""

from __future__ import annotations

import ast
import functools
import os
from dataclasses import dataclass

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hybridlm")

# layer -> rank; a higher rank may import a lower one. `files` is the shared bottom (atomic writes, no hybridlm
# imports); `top` is the command line and the package root that re-exports the main classes.
RANKS = {"files": 0, "ops": 1, "layers": 2, "model": 3, "interop": 4, "train": 4, "bench": 5, "top": 6}
TOP_MODULES = {"hybridlm", "hybridlm.cli", "hybridlm.demo", "hybridlm.__main__"}


def layer_of(module: str) -> str | None:
    """The layer of a hybridlm module name; None for a name outside the package."""
    parts = module.split(".")
    if parts[0] != "hybridlm":
        return None
    if module in TOP_MODULES:
        return "top"
    if parts[1] in RANKS and parts[1] != "top":
        return parts[1]
    raise AssertionError(f"{module}: no layer for it; add it to RANKS or TOP_MODULES in {__file__}")


@dataclass(frozen=True)
class Edge:
    module: str  # the importing module
    line: int
    target: str  # the imported module (a submodule when `from pkg import sub` names one)
    text: str  # the import as written


def module_names(root: str = ROOT) -> dict[str, str]:
    """module name -> path of every .py file under root (a package's __init__.py is the package itself)."""
    out = {}
    base = os.path.dirname(root)
    for folder, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                parts = os.path.relpath(path, base)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of `from <level dots><name> import ...` written in `module`."""
    if level == 0:
        return name or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports_of(module: str, source: str, known: set[str], is_package: bool = False) -> list[Edge]:
    """Every import in `source` (the text of `module`), at any depth."""
    lines = source.splitlines()
    edges = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            src = _resolve(module, is_package, node.level, node.module)
            # `from pkg import sub` imports the module pkg.sub; `from pkg import name` imports pkg
            targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in known else src for a in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            targets = [node.args[0].value]
        for t in dict.fromkeys(targets):
            if t.split(".")[0] == "hybridlm":
                edges.append(Edge(module, node.lineno, t, lines[node.lineno - 1].strip()))
    return edges


def violations(edges: list[Edge] | tuple[Edge, ...]) -> list[str]:
    """One line per import of a higher layer or of the other layer of the same rank."""
    out = []
    for e in edges:
        src, dst = layer_of(e.module), layer_of(e.target)
        if src == dst:
            continue
        if RANKS[dst] > RANKS[src]:
            out.append(f"{e.module}:{e.line} ({src}) imports {e.target} ({dst}), a higher layer: {e.text}")
        elif RANKS[dst] == RANKS[src]:
            out.append(f"{e.module}:{e.line} ({src}) imports {e.target} ({dst}), a sideways layer: {e.text}")
    return out


def module_cycles(edges: list[Edge] | tuple[Edge, ...]) -> list[str]:
    """Circles between single modules (a imports b ... imports a, lazily or not), each with one import per step."""
    first: dict[tuple[str, str], Edge] = {}
    for e in edges:
        if e.module != e.target:
            first.setdefault((e.module, e.target), e)
    graph: dict[str, list[str]] = {}
    for a, b in first:
        graph.setdefault(a, []).append(b)
    found, state = [], {}  # state: 1 on the current path, 2 done

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                cyc = path[path.index(nxt):] + [nxt]
                found.append(" -> ".join(cyc) + ": " + "; ".join(
                    f"{first[(x, y)].module}:{first[(x, y)].line} {first[(x, y)].text}" for x, y in zip(cyc, cyc[1:])))
            elif nxt not in state:
                walk(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            walk(start, [start])
    return found


def layer_cycles(edges: list[Edge] | tuple[Edge, ...]) -> list[str]:
    """Circles in the graph of layers (layer A imports B ... imports A), each with one import per step."""
    first: dict[tuple[str, str], Edge] = {}
    for e in edges:
        a, b = layer_of(e.module), layer_of(e.target)
        if a != b:
            first.setdefault((a, b), e)
    graph: dict[str, list[str]] = {}
    for a, b in first:
        graph.setdefault(a, []).append(b)
    found, seen = [], set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in graph.get(node, []):
            if nxt in path:
                cyc = path[path.index(nxt):] + [nxt]
                key = frozenset(cyc)
                if key not in seen:
                    seen.add(key)
                    steps = [first[(x, y)] for x, y in zip(cyc, cyc[1:])]
                    found.append(" -> ".join(cyc) + ": " + "; ".join(f"{s.module}:{s.line} {s.text}" for s in steps))
            else:
                walk(nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, [start])
    return found


@functools.cache
def package_edges(root: str = ROOT) -> tuple[Edge, ...]:
    """Every import of every module under root (parsed once per session)."""
    names = module_names(root)
    known = set(names)
    edges = []
    for module, path in sorted(names.items()):
        with open(path, encoding="utf-8") as f:
            edges += imports_of(module, f.read(), known, is_package=path.endswith("__init__.py"))
    return tuple(edges)


def test_every_module_has_a_layer():
    for module in module_names():
        layer_of(module)


def test_no_import_goes_up_or_sideways():
    bad = violations(package_edges())
    assert not bad, "imports against the layering (ops -> layers -> model -> interop | train -> bench -> cli):\n" + (
        "\n".join(bad))


def test_no_circle_between_layers():
    cycles = layer_cycles(package_edges())
    assert not cycles, "circles between layers:\n" + "\n".join(cycles)


def test_no_circle_between_modules():
    cycles = module_cycles(package_edges())
    assert not cycles, "circles between modules (lazy imports included):\n" + "\n".join(cycles)


def test_the_checker_sees_lazy_relative_and_dynamic_imports():
    """Hand-written sources with one known bad import each, in the forms the package uses."""
    known = {"hybridlm.model", "hybridlm.model.hybrid", "hybridlm.model.config", "hybridlm.interop",
             "hybridlm.interop.compare", "hybridlm.train", "hybridlm.train.optim", "hybridlm.files"}
    lazy = "import torch\n\ndef f():\n    from hybridlm.interop.compare import compare_layers\n"
    relative = "from ..train import optim\nfrom . import config\nfrom ..files import atomic_write\n"
    dynamic = "import importlib\nm = importlib.import_module('hybridlm.train.optim')\n"
    cases = {
        "lazy": ("hybridlm.model.hybrid", lazy, False),
        "relative": ("hybridlm.interop.compare", relative, False),
        "dynamic": ("hybridlm.model", dynamic, True),
    }
    found = {name: violations(imports_of(mod, src, known, pkg)) for name, (mod, src, pkg) in cases.items()}
    assert found["lazy"] == ["hybridlm.model.hybrid:4 (model) imports hybridlm.interop.compare (interop), a higher "
                             "layer: from hybridlm.interop.compare import compare_layers"]
    assert found["relative"] == ["hybridlm.interop.compare:1 (interop) imports hybridlm.train.optim (train), a "
                                 "sideways layer: from ..train import optim"]
    assert found["dynamic"] == ["hybridlm.model:2 (model) imports hybridlm.train.optim (train), a higher layer: "
                                "m = importlib.import_module('hybridlm.train.optim')"]
    edges = imports_of("hybridlm.model.hybrid", lazy, known) + imports_of("hybridlm.interop.compare",
                                                                          "from hybridlm.model import hybrid\n", known)
    assert layer_cycles(edges) == [
        "interop -> model -> interop: hybridlm.interop.compare:1 from hybridlm.model import hybrid; "
        "hybridlm.model.hybrid:4 from hybridlm.interop.compare import compare_layers"]
    assert module_cycles(edges) == [
        "hybridlm.interop.compare -> hybridlm.model.hybrid -> hybridlm.interop.compare: "
        "hybridlm.interop.compare:1 from hybridlm.model import hybrid; "
        "hybridlm.model.hybrid:4 from hybridlm.interop.compare import compare_layers"]
