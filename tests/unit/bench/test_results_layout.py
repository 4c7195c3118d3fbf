"""bench/ runs as a package from the repository root; a run's tables live in the docs/results pages, the
tree keeps under bench/results only the files a page embeds, and every relative link in the docs resolves."""
from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest

from bench import RESULTS, dated_results

ROOT = Path(__file__).resolve().parents[3]
# What bench/results may hold in the tree: its README (a pointer to docs/results) and the plots a page
# embeds. Everything else a run writes stays out of the tree (git history keeps the earlier runs).
KEPT = {"bench/results/README.md", "bench/results/2026-11-21-accuracy/accuracy.png",
        "bench/results/2026-11-28-admm-decisive/paired.png"}
MAX_BYTES = 1_000_000  # tracked bytes under bench/results and docs/results together
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _tracked(*paths: str) -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", *paths], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [f for f in out.split("\0") if f]


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "bench").rglob("README.md"))]


def _outside_code(text: str) -> str:
    """The text without fenced blocks and inline code spans (a link in a code sample is not a link)."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _links(doc: Path) -> list[str]:
    return [t for t in LINK.findall(_outside_code(doc.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def _slug(heading: str) -> str:
    """The anchor a Markdown heading gets (GitHub's rule: lower case, punctuation dropped, spaces to hyphens)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> Iterator[str]:
    seen: dict[str, int] = {}
    for line in re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            s = _slug(m.group(1))
            seen[s] = seen.get(s, -1) + 1
            yield s if seen[s] == 0 else f"{s}-{seen[s]}"


def test_dated_results_is_todays_folder_under_bench_results():
    today = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    assert dated_results("cpu_latency_2threads") == RESULTS / f"{today}-cpu-latency-2threads"
    assert RESULTS == ROOT / "bench" / "results"


def test_bench_results_holds_only_the_kept_files():
    extra = sorted(set(_tracked("bench/results")) - KEPT)
    assert not extra, f"raw run files in the tree (move their tables into a docs/results page): {extra}"
    missing = sorted(f for f in KEPT if not (ROOT / f).is_file())
    assert not missing, missing


def test_every_kept_plot_is_embedded_by_a_page():
    embedded = {(doc.parent / t.partition("#")[0]).resolve()
                for doc in _docs() for t in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", doc.read_text())}
    unused = sorted(f for f in KEPT if not f.endswith(".md") and (ROOT / f).resolve() not in embedded)
    assert not unused, f"kept under bench/results but embedded by no page: {unused}"


def test_results_stay_under_the_size_budget():
    files = _tracked("bench/results", "docs/results")
    total = sum((ROOT / f).stat().st_size for f in files if (ROOT / f).is_file())
    assert total < MAX_BYTES, f"bench/results + docs/results: {total} bytes tracked, budget {MAX_BYTES}"


def test_relative_links_resolve():
    """Every relative link in README.md, docs/ and bench/**/README.md names an existing file or folder, and
    one into a docs/results page names a heading of it."""
    broken = []
    for doc in _docs():
        for target in _links(doc):
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc.resolve()
            if not dest.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
            elif anchor and dest.parent == (ROOT / "docs" / "results").resolve() and dest.suffix == ".md" \
                    and anchor not in set(_anchors(dest)):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_prose_names_no_removed_result_file():
    """Outside commands and code, a bench/results path the docs name is there (a removed run's tables are in
    its docs/results page)."""
    gone = set()
    for doc in _docs():
        for ref in re.findall(r"bench/results/[A-Za-z0-9_./-]+", _outside_code(doc.read_text())):
            if not (ROOT / ref.rstrip(".")).exists():
                gone.add(f"{doc.relative_to(ROOT)}: {ref}")
    assert not gone, sorted(gone)


def test_bench_scripts_leave_sys_path_alone():
    edits = [str(p.relative_to(ROOT)) for p in (ROOT / "bench").rglob("*.py") if "sys.path" in p.read_text()]
    assert not edits, edits
