"""The package's import graph has no cycle.

Every `.py` file of the installed `dsv41` package is a node, named as Python imports it: the packages
and their directories come from pyproject.toml (`dsv41.kernels` is the `kernels/` directory), and a
package's `__init__.py` is the node of the package itself (`dsv41`, `dsv41.nn`). An edge is every
intra-package import in the file, at module level or inside a function (a lazy import hides a cycle
from the interpreter, not from the design): `import dsv41.x`, `from dsv41.x import y`, and relative
imports resolved against the importing module. In `from P import name`, `name` is the submodule
`P.name` when that file exists, else a name defined by `P` itself (an edge to `P`). Importing a
submodule also runs its parents' `__init__`, but no edge is drawn for that: a parent that imports its
own submodules is not a cycle. Imports by string (`importlib.import_module`) are not seen.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_modules(root: Path) -> dict[str, Path]:
    """{module name: file} of every `.py` file of the packages that pyproject.toml installs."""
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = tool.get("package-dir", {})
    modules = {}
    for package in tool["packages"]:
        parent, _, leaf = package.rpartition(".")
        folder = root / dirs[package] if package in dirs else root / package.replace(".", "/")
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            modules[name] = path
    return modules


def imports_of(module: str, source: str, modules: set[str], is_package: bool = False) -> set[str]:
    """The modules of `modules` that `source` (the text of `module`) imports, anywhere in the file."""
    found = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {name for name in found if name in modules and name != module}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = package_modules(root)
    names = set(modules)
    return {name: imports_of(name, path.read_text(), names, path.name == "__init__.py")
            for name, path in modules.items()}


def shortest_path(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """The shortest path [start, ..., goal] along `graph`'s edges, None when there is none."""
    previous, frontier = {start: None}, [start]
    while frontier:
        following = []
        for node in frontier:
            if node == goal:
                path = [node]
                while previous[path[-1]] is not None:
                    path.append(previous[path[-1]])
                return path[::-1]
            for nxt in sorted(graph.get(node, ())):
                if nxt not in previous:
                    previous[nxt] = node
                    following.append(nxt)
        frontier = following
    return None


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of `graph` as paths [a, b, ..., a], each once, starting at its first name.

    For every edge a -> b with a path back from b to a, the shortest such cycle: every import that
    takes part in a cycle shows in one."""
    cycles, seen = [], set()
    for a in sorted(graph):
        for b in sorted(graph[a]):
            back = shortest_path(graph, b, a)
            if back is None:
                continue
            ring = [a, *back[:-1]]
            first = ring.index(min(ring))
            ring = ring[first:] + ring[:first]
            if tuple(ring) not in seen:
                seen.add(tuple(ring))
                cycles.append([*ring, ring[0]])
    return cycles


def test_the_package_imports_have_no_cycle():
    graph = import_graph()
    assert {"dsv41", "dsv41.nn.attention", "dsv41.kernels.dispatch"} <= set(graph)
    assert "dsv41.kernels.dispatch" in graph["dsv41.nn.attention"]
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_a_cycle_is_found_and_printed(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackages = ["pkg", "pkg.kern"]\n[tool.setuptools.package-dir]\n"pkg.kern" = "kern"\n')
    files = {
        "pkg/__init__.py": "from pkg.a import f\n",
        "pkg/a.py": "from pkg import b\n\ndef f():\n    from pkg.kern import k  # lazy, still an edge\n",
        "pkg/b.py": "import os\nfrom pkg import a\n",
        "pkg/c.py": "from . import b\nfrom pkg import f\n",
        "kern/__init__.py": "",
        "kern/k.py": "from ..a import f\nimport pkg.c\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b", "pkg.kern.k"}, "pkg.b": {"pkg.a"},
                     "pkg.c": {"pkg.b", "pkg"}, "pkg.kern": set(), "pkg.kern.k": {"pkg.a", "pkg.c"}}
    assert [" -> ".join(c) for c in find_cycles(graph)] == [
        "pkg -> pkg.a -> pkg.kern.k -> pkg.c -> pkg", "pkg.a -> pkg.b -> pkg.a", "pkg.a -> pkg.kern.k -> pkg.a",
        "pkg.a -> pkg.kern.k -> pkg.c -> pkg.b -> pkg.a"]
    assert find_cycles({"x": {"y"}, "y": {"z"}, "z": set()}) == []
