"""The project's import graph has no circles: every import of mcore_rl, at module
level or inside a function (a lazy import that closes a circle is still one), read with ast. An
import under `if TYPE_CHECKING:` never runs and is left out."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("mcore_rl",)
MAX_TOP_LEVEL_MODULES = 8


def modules() -> dict[str, str]:
    """{dotted module name: path} of every .py file of the packages."""
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    found[dotted.removesuffix(".__init__")] = path
    return found


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or
                                         isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, path: str, known: dict[str, str]) -> set[str]:
    """The project modules `module` imports (the deepest known module each import names)."""
    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found: set[str | None] = set()
    todo = [ast.parse(open(path).read(), path)]
    while todo:
        node = todo.pop()
        if _type_checking(node):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(resolve(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.update(resolve(f"{base}.{a.name}") if f"{base}.{a.name}" in known else resolve(base)
                         for a in node.names)
        todo.extend(ast.iter_child_nodes(node))
    return {m for m in found if m and m != module}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports_of(m, p, known) for m, p in known.items()}


def test_the_walk_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    known = modules()
    assert "mcore_rl.config.checks" in imports_of("mcore_rl.config.sections", known["mcore_rl.config.sections"], known)


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_no_module_getattr():
    """No module forwards attribute lookups to another (a facade hides who imports whom)."""
    facades = [m for m, p in modules().items()
               if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in ast.parse(open(p).read()).body)]
    assert facades == []


def test_a_few_modules_at_the_top():
    """mcore_rl's top level is its entry and its wings: at most 8 modules directly in mcore_rl/."""
    top = sorted(n for n in os.listdir(os.path.join(ROOT, "mcore_rl")) if n.endswith(".py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_one_import_package():
    """The converters are mcore_rl's own (mcore_rl.convert): no second top-level package beside it."""
    packages = sorted(n for n in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, n, "__init__.py")))
    assert packages == ["mcore_rl", "tests"]
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert 'include = ["mcore_rl*"]' in f.read()  # what a wheel installs
