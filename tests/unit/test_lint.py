"""The tree passes the linter's checks (pyproject.toml [tool.ruff] says which). .ci/setup installs the
pinned ruff, so CI runs this; elsewhere `pip install ruff` first."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: `pip install ruff` (.ci/setup installs the pinned one)")
    r = subprocess.run([ruff, "check", "--output-format", "concise", str(REPO)], capture_output=True, text=True,
                       cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
