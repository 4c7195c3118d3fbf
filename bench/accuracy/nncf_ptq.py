"""The peer row of the accuracy benchmark: NNCF INT8 post-training quantization of the same dense teacher.

What a CPU user would do instead of compressing: export the fine-tuned dense model to ONNX, run
`nncf.quantize` (transformer preset) on a few hundred training rows, and serve the INT8 OpenVINO model.
Its weights stay dense. Scored on the same dev rows, with the same metric, as the HoloServe rows.
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

CALIBRATION_ROWS = 256


def nncf_ptq(teacher_dir: Path, task_name: str | None, data, *, max_seq_length: int, seed: int = 0,
             rows: int = CALIBRATION_ROWS) -> dict:
    """NNCF INT8 PTQ of the HF model in `teacher_dir`, calibrated on the first `rows` training rows
    (the holoserve.data options `data`), scored on the dev rows through OpenVINO. Returns
    {"metrics", "calibration_rows", "seconds"}."""
    import nncf
    import openvino as ov
    import torch
    from transformers import AutoModelForSequenceClassification

    from bench.cpu_latency.common import nncf_int8
    from holoserve.compress.data import encode, eval_batches
    from holoserve.compress.evaluate import predict_with, score
    from holoserve.core.tokenizer import load_tokenizer
    from holoserve.data.sources import load_for_training
    from holoserve.export.onnx_export import torch_export_fp32

    t0 = time.perf_counter()
    td = load_for_training(task_name, data, seed=seed)
    tok = load_tokenizer(teacher_dir, max_seq_length)
    calib = encode(tok, td.train[:rows], td.task.is_regression)
    dev = encode(tok, td.dev, td.task.is_regression)

    def feed(batch) -> dict[str, np.ndarray]:
        return {k: v.numpy() for k, v in batch.items() if k != "labels"}

    model = AutoModelForSequenceClassification.from_pretrained(
        str(teacher_dir), local_files_only=True, attn_implementation="eager").eval()
    with tempfile.TemporaryDirectory(prefix="holoserve-nncf-") as tmp:
        onnx_path = Path(tmp) / "dense.onnx"
        with torch.no_grad():
            torch_export_fp32(model, onnx_path)
        samples = [feed(b) for _, b in eval_batches(calib, 1)]
        # the same NNCF recipe as the CPU-latency benchmark's OpenVINO INT8 engine
        ir = nncf_int8(ov, nncf, onnx_path, samples, Path(tmp) / "dense.nncf-int8.xml")
        compiled = ov.Core().compile_model(str(ir), "CPU")
        out = compiled.outputs[0]
        logits = predict_with(lambda b: compiled(feed(b))[out], dev)
    return {"metrics": score(td.task, logits, dev.labels), "calibration_rows": len(calib.labels),
            "seconds": round(time.perf_counter() - t0, 1), "openvino": ov.__version__, "nncf": nncf.__version__}


def cached_nncf_ptq(out: Path, teacher_dir: Path, task_name: str | None, data, **kw) -> dict | None:
    """nncf_ptq, kept in `out` (JSON) so a re-run of the benchmark reuses it; None when NNCF/OpenVINO are missing."""
    from holoserve.core.files import atomic_write_json

    if out.is_file():
        return json.loads(out.read_text())
    try:
        import nncf  # noqa: F401
        import openvino  # noqa: F401
    except ImportError as e:
        print(f"no NNCF row: {e} (pip install 'holoserve[bench]')", flush=True)
        return None
    print(f"[nncf] INT8 PTQ of {teacher_dir} ...", flush=True)
    res = nncf_ptq(teacher_dir, task_name, data, **kw)
    atomic_write_json(out, res)
    return res
