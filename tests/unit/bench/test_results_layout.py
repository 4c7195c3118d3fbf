"""bench/ runs as a package from the repository root; bench/results keeps one dated folder per run,
each indexed in its README.md, and the paths the docs cite exist."""
from __future__ import annotations

import re
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest

from bench import RESULTS, dated_results

ROOT = Path(__file__).resolve().parents[3]
DATED = re.compile(r"\d{4}-\d{2}-\d{2}-[a-z0-9][a-z0-9.-]*")


def test_dated_results_is_todays_folder_under_bench_results():
    today = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    assert dated_results("cpu_latency_2threads") == RESULTS / f"{today}-cpu-latency-2threads"
    assert RESULTS == ROOT / "bench" / "results"


def _committed_entries() -> list[str]:
    """The top-level names under bench/results that git tracks (a run in progress may write beside them)."""
    try:
        out = subprocess.run(["git", "ls-files", "--", "bench/results"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return sorted({f.split("/")[2] for f in out} - {"README.md"})


def test_results_hold_only_dated_folders_each_in_the_index():
    index = (RESULTS / "README.md").read_text()
    entries = _committed_entries()
    assert entries and all(DATED.fullmatch(name) and (RESULTS / name).is_dir() for name in entries), entries
    missing = [name for name in entries if f"]({name}/)" not in index]
    assert not missing, f"not in bench/results/README.md: {missing}"


def test_cited_result_paths_exist():
    docs = [ROOT / "README.md", ROOT / "bench" / "gpu" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    gone = set()
    for doc in docs:
        for ref in re.findall(r"bench/results/[A-Za-z0-9_./*<>{}-]+", doc.read_text()):
            ref = ref.rstrip(".")
            if not re.search(r"[*<>{}]|YYYY|NAME", ref) and not (ROOT / ref).exists():
                gone.add(f"{doc.relative_to(ROOT)}: {ref}")
    assert not gone, sorted(gone)


def test_bench_scripts_leave_sys_path_alone():
    edits = [str(p.relative_to(ROOT)) for p in (ROOT / "bench").rglob("*.py") if "sys.path" in p.read_text()]
    assert not edits, edits
