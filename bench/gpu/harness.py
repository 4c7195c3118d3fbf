"""The measurement harness of bench/gpu/run.py: the run's state and report, timing, guarded calls, CUDA graphs."""
from __future__ import annotations

import json
import os
import statistics
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable


class Stopped(BaseException):
    """Raised by the SIGTERM handler; not an Exception, so the per-measurement guards let it through."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Run:
    """Shared state: mode, clock, output, and the report being built."""

    def __init__(self, args):
        self.args = args
        self.smoke = args.cpu_smoke
        self.t0 = time.perf_counter()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.report: dict[str, Any] = {
            "kind": "holoserve-gpu-bench",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "mode": "cpu-smoke" if self.smoke else "gpu",
            "args": {k: v for k, v in vars(args).items() if not k.endswith("_list")},
            "method": {
                "timer": "perf_counter (cpu-smoke)" if self.smoke else "CUDA events around each call",
                "warmup": args.warmup, "iters": args.iters, "statistic": "median",
                "inputs": "fresh random inputs every call; token ids in [1000, vocab); GEMM operands random, non-zero",
                "ops_convention": "2*M*N*K dense-equivalent operations for dense and 2:4 kernels alike",
            },
            "sections": {},
        }
        self.device = "cpu" if self.smoke else "cuda"

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over_budget(self) -> bool:
        return self.elapsed() > self.args.budget_s

    def save(self) -> None:
        self.report["elapsed_s"] = round(self.elapsed(), 1)
        tmp = self.out / ".results.json.tmp"
        tmp.write_text(json.dumps(self.report, indent=2, default=str) + "\n")
        os.replace(tmp, self.out / "results.json")


# --------------------------------------------------------------------------- timing


def measure(run: Run, fn: Callable[[int], Any], *, warmup: int | None = None, iters: int | None = None,
            per_call: int = 1, host_timer: bool = False) -> dict[str, Any]:
    """Median time of fn(i) (i = call index, for picking fresh inputs); per_call divides the result."""
    warmup = run.args.warmup if warmup is None else warmup
    iters = run.args.iters if iters is None else iters
    for i in range(warmup):
        fn(i)
    times: list[float] = []
    if run.smoke or host_timer:
        if not run.smoke:
            import torch

            torch.cuda.synchronize()
        for i in range(iters):
            t = time.perf_counter()
            fn(warmup + i)
            if not run.smoke:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
    else:
        import torch

        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        torch.cuda.synchronize()
        for i, (s, e) in enumerate(events):
            s.record()
            fn(warmup + i)
            e.record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in events]
    times = [t / per_call for t in times]
    q = sorted(times)
    return {"median_ms": statistics.median(times), "p10_ms": q[len(q) // 10],
            "p90_ms": q[min(len(q) - 1, (9 * len(q)) // 10)],
            "n": len(times)}


def only_failure(sec: dict[str, Any]) -> bool:
    """A section result that holds nothing but its failure (as guarded() returns it, timed or not)."""
    return "error" in sec and set(sec) <= {"error", "trace", "seconds"}


def guarded(label: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - every measurement is optional; record why it failed
        log(f"  {label}: FAILED {type(e).__name__}: {str(e)[:300]}")
        return {"error": f"{type(e).__name__}: {str(e)[:500]}", "trace": traceback.format_exc(limit=3)[-1500:]}


def graph_of(fn: Callable[[], Any]):
    """Capture fn() (a fixed sequence of GPU work) in a CUDA graph after warm-up; returns replay."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out
