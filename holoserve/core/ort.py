"""The one ONNX Runtime session builder: every stage that runs an ONNX file opens it here.

Inter-op threads are always 1 (the graphs are one chain of ops; a second pool only competes for
cores) and execution is sequential; what callers choose is the intra-op thread count, the
providers and whether ORT optimizes the graph.

Integer GEMMs are exact on every x86 CPU: without VNNI, ONNX Runtime's u8 x s8 kernel adds pairs of products
in 16 bits (VPMADDUBSW), which saturates for the full-range int8 weights a checkpoint holds, so predictions
would differ from the checkpoint's; `session.x64quantprecision` makes it take its exact u8 x u8 path there
(a slower kernel, on those CPUs only; VNNI CPUs are unaffected).
"""
from __future__ import annotations

import os
from typing import Sequence

CPU = ("CPUExecutionProvider",)


def session(
    path: str | os.PathLike,
    *,
    threads: int = 0,
    providers: Sequence[str] = CPU,
    optimize: bool = True,
    optimized_path: str | os.PathLike | None = None,
    spinning: bool = True,
    quiet: bool = False,
):
    """An `onnxruntime.InferenceSession` on `path`.

    threads:        intra-op threads; 0 lets ONNX Runtime use every core.
    optimize:       ORT_ENABLE_ALL graph optimizations, or none at all (calibration reads
                    intermediate tensors that the optimizer would fuse away).
    optimized_path: also write the optimized graph there (what verification inspects).
    spinning:       False parks idle pool threads instead of spin-waiting after each run; engines
                    interleaved in one process on a small CPU otherwise starve each other.
    quiet:          log errors only.
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
    if not spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.x64quantprecision", "1")
    if quiet:
        so.log_severity_level = 3
    return ort.InferenceSession(str(path), sess_options=so, providers=list(providers))
