"""HoloServe's benchmarks: run each one as a module from the repository root, e.g.
`python -m bench.cpu_latency.run CHECKPOINT` (not installed with the package).

A run writes into its own dated folder, bench/results/YYYY-MM-DD-<what>/, unless told where
(bench/results/README.md indexes the folders)."""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def dated_results(what: str) -> Path:
    """bench/results/YYYY-MM-DD-<what> (today, UTC; underscores in `what` written as hyphens)."""
    return RESULTS / f"{datetime.now(timezone.utc):%Y-%m-%d}-{what.replace('_', '-')}"
