"""Code rules checked on the source alone (ast, nothing imported): no import cycle among the installed
modules, and no function with more than MAX_PARAMS parameters outside bench/ and tests/."""
from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the installed packages and the folders they come from (pyproject.toml, [tool.setuptools.package-dir])
PACKAGES = {"holoserve": ROOT / "holoserve", "holoserve.compress": ROOT / "compress",
            "holoserve.export": ROOT / "export"}
MAX_PARAMS = 8  # self and cls not counted; keyword-only counted; *args and **kwargs not counted


def _sources() -> dict[str, Path]:
    """module name -> file, for every module of the installed packages."""
    mods = {}
    for pkg, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("").parts
            mods[".".join((pkg, *rel)).removesuffix(".__init__")] = path
    return mods


def _imported(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The modules of `mods` that `name` imports anywhere in its file (a function-local import counts:
    a lazy cycle is still a cycle). `from pkg import x` names pkg.x where that is a module, else pkg."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in mods)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in mods:
                    found.add(f"{base}.{alias.name}")
                elif base in mods:
                    found.add(base)
    return found - {name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def _cycle_path(comp: list[str], graph: dict[str, set[str]]) -> str:
    """One import loop through a component, as 'a -> b -> a', for the failure message."""
    members = set(comp)
    start = comp[0]
    # breadth-first from start's imports back to start, inside the component
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier and start not in prev:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child not in prev:
                    prev[child] = node
                    nxt.append(child)
        frontier = nxt
    path = [start]
    node = prev[start]
    while node != start:
        path.append(node)
        node = prev[node]
    path.append(start)
    return " -> ".join(reversed(path))


def test_no_import_cycles():
    mods = _sources()
    graph = {name: _imported(name, path, mods) for name, path in mods.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles (function-local imports included):\n" + "\n".join(
        f"  {_cycle_path(c, graph)}" + (f"   (component: {', '.join(c)})" if len(c) > 2 else "") for c in cycles)


def _param_count(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    positional = a.posonlyargs + a.args
    count = len(positional) + len(a.kwonlyargs)
    if positional and positional[0].arg in ("self", "cls"):
        count -= 1
    return count


def _is_triton_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for deco in fn.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        if ast.unparse(target) in ("triton.jit", "jit"):
            return True
    return False


def _checked_files():
    """Every .py file of the repository but bench/, tests/ and what is not source (hidden folders, runs/, builds)."""
    skip = {"bench", "tests", "runs", "build", "dist", "node_modules", "__pycache__"}
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in skip and not d.startswith(".") and not d.endswith(".egg-info"))
        for f in sorted(files):
            if f.endswith(".py"):
                yield Path(folder, f)


def test_no_function_takes_more_than_eight_parameters():
    too_many = []
    for path in _checked_files():
        rel = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_kernel(node):
                n = _param_count(node)
                if n > MAX_PARAMS:
                    too_many.append(f"  {rel}:{node.lineno} {node.name} {n}")
    assert not too_many, (f"functions with more than {MAX_PARAMS} parameters (group them into a small frozen "
                          "dataclass):\n" + "\n".join(too_many))
