"""`holoserve bench CHECKPOINT`: latency and throughput of a checkpoint's backends on this machine.

Every backend named (or every registered one) is loaded the way the server loads it and timed on
fresh random token ids (never all zeros, never repeated between iterations) for each batch size
and sequence length: warm-up calls first, then the median, p90 and sequences/s of timed calls.
A backend that cannot run here is reported with its reason instead of failing the run. Results
are printed as a table and saved as JSON + Markdown (+ a PNG plot when matplotlib is present).

Light at import time (argparse only), so the slim server image can offer this command too.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from holoserve.core.choices import OPENVINO_KERNELS


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="checkpoint folder (manifest.json + model files)")
    p.add_argument("--backend", default="all",
                   help="backend name, comma-separated names, 'all' (every registered backend; default) or "
                        "'auto' (the one `holoserve serve --backend auto` would pick)")
    p.add_argument("--batch", type=_ints, default=[1, 8, 32], help="batch sizes, comma-separated (default 1,8,32)")
    p.add_argument("--seq", type=_ints, default=None,
                   help="sequence lengths, comma-separated (default 128, or the checkpoint's max_seq_length "
                        "if shorter)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per configuration (default 5)")
    p.add_argument("--iters", type=int, default=30, help="timed calls per configuration (default 30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="folder for the JSON/Markdown/PNG results (default bench/results/YYYY-MM-DD-holoserve-bench, "
                        "one dated folder per run)")
    p.add_argument("--name", default=None, help="file name stem for the results (default holoserve-bench-<checkpoint>)")
    p.add_argument("--no-save", action="store_true", help="print only; write no files")
    p.add_argument("--openvino-kernels", choices=OPENVINO_KERNELS, default=None,
                   help="openvino backend: HoloServe's 2:4 INT8 kernels, as `holoserve serve --openvino-kernels` "
                        "takes it (default: the server's default)")
    p.add_argument("--openvino-static", action="store_true",
                   help="openvino backend: also compile a static-shape model for every batch x seq timed, as "
                        "`holoserve serve --openvino-shapes` would, so each cell runs on one")


# --------------------------------------------------------------------------- helpers


def machine_description() -> dict[str, Any]:
    """The machine named by its hardware: CPU cores/architecture and any NVIDIA GPU."""
    import os
    import platform
    import shutil
    import subprocess

    cores = os.cpu_count() or 0
    desc = {"cpu": f"{cores}-core {platform.machine()} CPU", "gpu": None, "python": platform.python_version()}
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
            if line:
                name, _, driver = line.partition(",")
                desc["gpu"], desc["driver"] = name.strip(), driver.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    desc["name"] = desc["gpu"] + " + " + desc["cpu"] if desc["gpu"] else desc["cpu"]
    return desc


def random_inputs(rng, batch: int, seq: int, vocab: int, pair: bool):
    """Fresh token ids: [CLS] w... [SEP] with ids drawn away from the special tokens (never zeros)."""
    import numpy as np

    lo = min(1000, max(5, vocab // 2))
    ids = rng.integers(lo, vocab, size=(batch, seq), dtype=np.int64)
    ids[:, 0] = 101 if vocab > 102 else 2
    ids[:, -1] = 102 if vocab > 102 else 3
    mask = np.ones_like(ids)
    tt = np.zeros_like(ids)
    if pair:
        tt[:, seq // 2:] = 1
    return ids, mask, tt


@dataclass(frozen=True)
class Workload:
    """The inputs one timing feeds a backend: `batch` sequences of `seq` random ids below `vocab`."""

    batch: int
    seq: int
    vocab: int
    pair: bool  # second segment's token type ids set, as for a sentence-pair task


def time_backend(backend, work: Workload, *, warmup: int, iters: int, rng, clock=None) -> dict[str, Any]:
    """Median/p90 wall-clock latency of backend.infer (host arrays in, host logits out)."""
    import time

    import numpy as np

    clock = clock or time.perf_counter
    batch, seq, vocab, pair = work.batch, work.seq, work.vocab, work.pair
    for _ in range(warmup):
        backend.infer(*random_inputs(rng, batch, seq, vocab, pair))
    times = []
    for _ in range(iters):
        inputs = random_inputs(rng, batch, seq, vocab, pair)
        t0 = clock()
        out = backend.infer(*inputs)
        times.append(clock() - t0)
        if out.shape[0] != batch:
            raise RuntimeError(f"backend returned {out.shape[0]} rows for a batch of {batch}")
    arr = np.asarray(times)
    med = float(np.median(arr))
    return {
        "batch": batch, "seq": seq, "iters": iters,
        "latency_ms_median": round(med * 1e3, 4),
        "latency_ms_p90": round(float(np.percentile(arr, 90)) * 1e3, 4),
        "seq_per_s": round(batch / med, 2) if med > 0 else None,
    }


def markdown_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    head = "| " + " | ".join(title for _, title in columns) + " |"
    sep = "| " + " | ".join("---" for _ in columns) + " |"
    body = []
    for r in rows:
        cells = []
        for key, _ in columns:
            v = r.get(key)
            cells.append("—" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v)))
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, sep, *body])


def _resolve_backends(spec: str) -> list[str]:
    from .backends import available_backends

    if spec in ("all", ""):
        return available_backends()
    names = [s.strip() for s in spec.split(",") if s.strip()]
    from . import HoloServeError

    unknown = [n for n in names if n != "auto" and n not in available_backends()]
    if unknown:
        raise HoloServeError(f"unknown backend(s) {', '.join(unknown)}: choose from "
                             f"{', '.join(available_backends())}, 'auto' or 'all'")
    return names


def _load(name: str, art, **options: Any):
    from .backends import load_backend

    if name == "auto":
        from .backends.auto import select_backend

        backend, decision = select_backend(art, **options)
        return backend, {"auto": decision}
    return load_backend(name, art, **options), {}


def run(args: argparse.Namespace) -> int:
    import json
    import time
    from datetime import datetime, timezone
    from pathlib import Path

    import numpy as np

    from . import HoloServeError
    from holoserve.core.artifact import load_artifact
    from holoserve.core.files import atomic_write_json, atomic_write_text
    from .backends import BackendUnavailable

    if args.iters < 1 or args.warmup < 0:
        raise HoloServeError("--iters must be >= 1 and --warmup >= 0")
    names = _resolve_backends(args.backend)
    art = load_artifact(args.checkpoint)
    seqs = args.seq or [min(128, art.max_seq_length)]
    cfg = json.loads((art.path / "config.json").read_text(encoding="utf-8"))
    vocab = int(cfg.get("vocab_size", 30522))
    too_long = [s for s in seqs if s > art.max_seq_length]
    if too_long:
        raise HoloServeError(f"--seq {too_long} exceeds the checkpoint's max_seq_length {art.max_seq_length}")
    rng = np.random.default_rng(args.seed)
    machine = machine_description()
    options = {"openvino_shapes": [(b, s) for b in args.batch for s in seqs]} if args.openvino_static else {}
    if args.openvino_kernels:
        options["openvino_kernels"] = args.openvino_kernels
    results: list[dict[str, Any]] = []
    backends: dict[str, Any] = {}
    for name in names:
        t0 = time.perf_counter()
        try:
            backend, extra = _load(name, art, **options)
        except (BackendUnavailable, ImportError) as e:
            backends[name] = {"status": "unavailable", "reason": str(e)}
            print(f"{name}: unavailable: {e}")
            continue
        except HoloServeError as e:
            backends[name] = {"status": "error", "reason": str(e)}
            print(f"{name}: cannot load this checkpoint: {e}")
            continue
        label = getattr(backend, "name", name)
        backends[name] = {"status": "ok", "backend": label, "load_s": round(time.perf_counter() - t0, 3), **extra}
        for seq in seqs:
            for batch in args.batch:
                try:
                    r = time_backend(backend, Workload(batch=batch, seq=seq, vocab=vocab, pair=art.is_pair),
                                     warmup=args.warmup, iters=args.iters, rng=rng)
                except Exception as e:  # noqa: BLE001 - one failing configuration must not end the run
                    r = {"batch": batch, "seq": seq, "error": f"{type(e).__name__}: {e}"}
                r = {"backend": label, **r}
                results.append(r)
                print(f"{label:>14} batch {batch:>4} seq {seq:>4}: "
                      + (f"{r['latency_ms_median']:.3f} ms median, {r['seq_per_s']:.1f} seq/s"
                         if "error" not in r else r["error"]))
        try:  # after the timing, so that a backend can report what ran where (openvino: static vs dynamic runs)
            backends[name]["info"] = backend.info()
        except Exception as e:  # noqa: BLE001 - info is descriptive only
            backends[name]["info"] = {"info_error": str(e)}
    # speed as ratios measured in this run: against the slowest backend at the same (batch, seq)
    for r in results:
        peers = [p["seq_per_s"] for p in results if p.get("seq_per_s") and p["batch"] == r["batch"]
                 and p["seq"] == r["seq"]]
        if r.get("seq_per_s") and peers:
            r["speedup_vs_slowest"] = round(r["seq_per_s"] / min(peers), 3)
    report = {
        "kind": "holoserve-bench",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "checkpoint": {"path": str(art.path), "task": art.task_name, "base_model": art.base_model,
                       "max_seq_length": art.max_seq_length,
                       "sparsity": art.manifest.sparsity.pattern if art.manifest.sparsity else None,
                       "precision": "int8" if art.quantized else "fp32"},
        "method": {"timer": "time.perf_counter around backend.infer (host arrays in, logits out)",
                   "warmup": args.warmup, "iters": args.iters, "statistic": "median",
                   "inputs": "fresh random token ids per call, drawn away from special tokens; full attention mask",
                   "openvino_static_shapes": bool(args.openvino_static)},
        "backends": backends,
        "results": results,
    }
    md = render_markdown(report)
    print()
    print(md)
    if not args.no_save:
        out = (Path(args.out) if args.out
               else Path("bench/results") / f"{datetime.now(timezone.utc):%Y-%m-%d}-holoserve-bench")
        stem = args.name or f"holoserve-bench-{art.path.name}"
        atomic_write_json(out / f"{stem}.json", report)
        atomic_write_text(out / f"{stem}.md", md + "\n")
        png = write_plot(results, out / f"{stem}.png", title=f"{art.path.name} on {machine['name']}")
        print(f"saved {out / stem}.json, .md" + (", .png" if png else ""))
    return 0 if any(b["status"] == "ok" for b in backends.values()) else 1


def render_markdown(report: dict[str, Any]) -> str:
    lines = [f"# holoserve bench: {report['checkpoint']['path']}", "",
             f"{report['date']} · {report['machine']['name']} · task {report['checkpoint']['task']}", ""]
    ok = [r for r in report["results"] if "error" not in r]
    if ok:
        lines.append(markdown_table(ok, [("backend", "backend"), ("batch", "batch"), ("seq", "seq"),
                                         ("latency_ms_median", "median ms"), ("latency_ms_p90", "p90 ms"),
                                         ("seq_per_s", "seq/s"), ("speedup_vs_slowest", "× slowest")]))
    bad = [r for r in report["results"] if "error" in r]
    skipped = {k: v["reason"] for k, v in report["backends"].items() if v["status"] != "ok"}
    if bad or skipped:
        lines += ["", "Not measured:"]
        lines += [f"- {k}: {v}" for k, v in skipped.items()]
        lines += [f"- {r['backend']} batch {r['batch']} seq {r['seq']}: {r['error']}" for r in bad]
    return "\n".join(lines)


def write_plot(results: list[dict[str, Any]], path, *, title: str) -> bool:
    """Throughput per backend over batch size; returns False when matplotlib is absent or no data."""
    ok = [r for r in results if r.get("seq_per_s")]
    if not ok:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for (backend, seq) in sorted({(r["backend"], r["seq"]) for r in ok}):
        pts = sorted((r["batch"], r["seq_per_s"]) for r in ok if r["backend"] == backend and r["seq"] == seq)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{backend} (seq {seq})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("sequences / s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    from holoserve.core.files import atomic_savefig

    try:
        atomic_savefig(fig, path, dpi=120)
    finally:
        plt.close(fig)
    return True
