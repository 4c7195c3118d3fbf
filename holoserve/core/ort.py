"""The one ONNX Runtime session builder: every stage that runs an ONNX file opens it here.

Inter-op threads are always 1 (the graphs are one chain of ops; a second pool only competes for
cores) and execution is sequential; what callers choose is the intra-op thread count, the
providers and whether ORT optimizes the graph.

Integer GEMMs are exact on every x86 CPU: without VNNI, ONNX Runtime's u8 x s8 kernel adds pairs of products
in 16 bits (VPMADDUBSW), which saturates for the full-range int8 weights a checkpoint holds, so predictions
would differ from the checkpoint's; `session.x64quantprecision` makes it take its exact u8 x u8 path there.
That path is only for such CPUs: where VNNI or AMX runs the u8 x s8 GEMM exactly, it is several times slower
(docs/results/2026-11-29-ort-exact-path.md), so sessions ask for it only where a probe finds the default wrong.
"""
from __future__ import annotations

import functools
import os
from typing import Sequence

CPU = ("CPUExecutionProvider",)
EXACT_U8U8 = "session.x64quantprecision"


def u8s8_saturates() -> bool:
    """Whether ONNX Runtime's default u8 x s8 GEMM comes out wrong on this CPU (x86-64 without VNNI), so that
    sessions need its exact u8 x u8 path: measured once per process on holoserve.core.int8_probe's model.
    HOLOSERVE_INT8_PROBE=exact or saturates states the answer instead (as for OpenVINO, whose GEMMs saturate
    on the same CPUs)."""
    from holoserve.core import int8_probe

    stated = int8_probe.stated()
    return stated if stated is not None else _measured_u8s8_saturates()


@functools.lru_cache(maxsize=1)
def _measured_u8s8_saturates() -> bool:
    from holoserve.core import int8_probe

    # from memory: a server's container may have no writable temporary folder
    y = session(int8_probe.probe_onnx(), threads=1, quiet=True, exact_u8u8=False).run(None, int8_probe.FEED)[0]
    return not int8_probe.exact(y)


SPIN = ("run", "always", "never")  # session(spin=...)


def session(
    path: str | os.PathLike | bytes,
    *,
    threads: int = 0,
    providers: Sequence[str] = CPU,
    optimize: bool = True,
    optimized_path: str | os.PathLike | None = None,
    spin: str = "run",
    quiet: bool = False,
    exact_u8u8: bool | None = None,
):
    """An `onnxruntime.InferenceSession` on `path`.

    threads:        intra-op threads; 0 lets ONNX Runtime use every core.
    optimize:       ORT_ENABLE_ALL graph optimizations, or none at all (calibration reads
                    intermediate tensors that the optimizer would fuse away).
    optimized_path: also write the optimized graph there (what verification inspects).
    spin:           how the pool threads wait for work (SPIN): "run" spin-waits inside a run and stops when it
                    returns, so the serving thread and any other runtime in the process get the cores between
                    runs; "always" keeps spinning after a run (ONNX Runtime's default); "never" sleeps, inside
                    a run too (slower: docs/results/2026-11-29-ort-spin.md).
    quiet:          log errors only.
    exact_u8u8:     ask for ONNX Runtime's exact u8 x u8 GEMMs (session.x64quantprecision); None: where its
                    default saturates on this CPU (u8s8_saturates).
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    if threads > 0:
        so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    if optimized_path:
        so.optimized_model_filepath = str(optimized_path)
    if spin not in SPIN:
        raise ValueError(f"spin={spin!r}: choose one of {', '.join(SPIN)}")
    if spin == "never":
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    elif spin == "run":
        so.add_session_config_entry("session.force_spinning_stop", "1")
    if exact_u8u8 if exact_u8u8 is not None else u8s8_saturates():
        so.add_session_config_entry(EXACT_U8U8, "1")
    if quiet:
        so.log_severity_level = 3
    model = path if isinstance(path, bytes) else str(path)  # bytes: a serialized model
    return ort.InferenceSession(model, sess_options=so, providers=list(providers))
