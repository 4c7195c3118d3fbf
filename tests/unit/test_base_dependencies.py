"""The base install (pyproject.toml's `dependencies`) is what `pip install holoserve` and the CPU image give
the server, so every third-party module the CPU serve path imports, at module level or inside a function,
must come with it: listed there, or required by something listed (per the installed packages' metadata).
A module found only in an extra would import in the development environment and fail in a server.

Checked on the source (every import statement), like tests/unit/test_layering.py.
"""
from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "holoserve"
# What `holoserve serve` runs on a CPU: the server, the CPU backends and the choice between them, the 2:4
# kernels and their graph rewrite, and the core they stand on. core/progress.py is left out: it draws
# progress bars for compress and export, whose extras bring tqdm.
SERVE_PATH = sorted({PKG / "serve_cli.py", PKG / "cli.py", *PKG.glob("server/*.py"), *PKG.glob("kernels/*.py"),
                     *(PKG / "backends" / f"{m}.py" for m in ("__init__", "base", "auto", "onnxruntime", "openvino")),
                     *(p for p in PKG.glob("core/*.py") if p.name != "progress.py")})


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", requirement).lower()  # PEP 503 normalisation


@functools.lru_cache(maxsize=1)
def base_dependencies() -> frozenset[str]:
    """The distributions the base install brings on this machine: pyproject's `dependencies` whose markers
    hold here, and everything they require in turn (with the extras asked for), as installed."""
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    todo: list[tuple[Requirement, frozenset[str]]] = [(Requirement(r), frozenset()) for r in listed]
    found: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req, extras = todo.pop()  # `extras`: those the requirer was asked for, which its markers may name
        key = (_name(req.name), frozenset(req.extras))
        if key in found or (req.marker is not None
                            and not any(req.marker.evaluate({"extra": e}) for e in ("", *extras))):
            continue
        found.add(key)
        try:
            todo.extend((Requirement(r), key[1]) for r in md.requires(req.name) or [])
        except md.PackageNotFoundError:
            pass  # not installed here: its own requirements are unknown, the name itself still counts
    return frozenset(name for name, _ in found)


def third_party_imports(path: Path) -> set[str]:
    """The top-level names of the non-standard-library modules `path` imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("holoserve", "__future__")}


def test_the_serve_path_is_what_it_says():
    assert all(p.is_file() for p in SERVE_PATH)
    imported = set().union(*(third_party_imports(p) for p in SERVE_PATH))
    # the serving libraries themselves are among them: a list that lost its files would check nothing
    assert {"openvino", "onnx", "onnxruntime", "fastapi", "uvicorn"} <= imported, imported


@pytest.mark.parametrize("path", SERVE_PATH, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_serve_path_imports_only_base_dependencies(path):
    base, providers = base_dependencies(), md.packages_distributions()
    missing = {}
    for module in sorted(third_party_imports(path)):
        dists = {_name(d) for d in providers.get(module, [])}
        if not dists:
            missing[module] = "not installed here, so its distribution is unknown"
        elif not dists & base:
            missing[module] = f"from {', '.join(sorted(dists))}, which the base install does not bring"
    assert not missing, (f"{path.relative_to(ROOT)} imports modules that `pip install holoserve` and the CPU image "
                         f"lack: {missing}; add their distributions to [project] dependencies in pyproject.toml")
