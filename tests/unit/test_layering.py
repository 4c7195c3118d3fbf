"""Dependencies flow one way: core <- data <- {compress, export, backends} <- server <- cli; the 2:4 CPU
kernels (holoserve.kernels) sit on core, below the OpenVINO backend.

Checked on the source (every import statement, module level or inside a function), so a cycle or a
server that reaches into training code fails here rather than in a slim image.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"holoserve": ROOT / "holoserve", "holoserve.compress": ROOT / "compress",
           "holoserve.export": ROOT / "export"}

# package -> the holoserve packages it may import (besides itself and the top-level holoserve/__init__)
ALLOWED = {
    "holoserve.core": set(),
    "holoserve.kernels": {"holoserve.core"},
    "holoserve.cli_options": set(),
    "holoserve.data": {"holoserve.core"},
    "holoserve.compress": {"holoserve.core", "holoserve.data", "holoserve.cli_options", "holoserve.backends"},
    "holoserve.export": {"holoserve.core", "holoserve.data", "holoserve.cli_options", "holoserve.compress",
                         "holoserve.backends"},
    # data: the checkpoint's dev texts, which `auto` and `holoserve tune` time the CPU backends on
    "holoserve.backends": {"holoserve.core", "holoserve.data", "holoserve.kernels"},
    "holoserve.server": {"holoserve.core", "holoserve.backends"},
}


def _modules():
    for pkg, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("").parts
            name = ".".join((pkg, *rel)).removesuffix(".__init__")
            yield name, path


def _package(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else name


def _imports(name: str, path: Path):
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                yield ".".join(base + ([node.module] if node.module else []))
            elif node.module:
                yield node.module


@pytest.mark.parametrize("name,path", sorted(_modules()), ids=lambda v: v if isinstance(v, str) else "")
def test_imports_respect_the_layers(name, path):
    pkg = _package(name)
    if pkg not in ALLOWED:
        return  # the CLI entry points and holoserve/__init__ sit on top
    bad = []
    for target in _imports(name, path):
        if not target.startswith("holoserve.") or target == "holoserve":
            continue
        other = _package(target)
        if other != pkg and other not in ALLOWED[pkg]:
            bad.append(target)
    assert not bad, f"{name} imports {sorted(set(bad))}; {pkg} may import only {sorted(ALLOWED[pkg])}"
