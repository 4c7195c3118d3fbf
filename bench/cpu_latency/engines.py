"""The engines bench/cpu_latency/run.py times: their keys in table order and labels, how the rows relate (the
static-shape rows and the dynamic rows whose models they compile, the OpenVINO and 2:4-kernel rows), and how each
engine is run at a thread count."""
from __future__ import annotations

from bench.cpu_latency.common import int8_gemms, openvino_runner, ort_runner, ort_session
from holoserve.backends.openvino import inference_precision as openvino_inference_precision

ENGINES = ("pytorch_fp32", "ort_fp32", "ort_dynamic_int8", "openvino_fp32", "openvino_nncf_int8",
           "openvino_nncf_int8_static", "ours_qdq_int8", "ours_openvino", "ours_openvino_sparse",
           "ours_openvino_static", "ours_openvino_f32", "ours_openvino_static_f32", "ours_openvino_kernels",
           "ours_openvino_static_kernels", "also_openvino", "also_openvino_static")
LABELS = {
    "pytorch_fp32": "PyTorch fp32 (eager)",
    "ort_fp32": "ORT fp32",
    "ort_dynamic_int8": "ORT dynamic INT8",
    "openvino_fp32": "OpenVINO fp32",
    "openvino_nncf_int8": "OpenVINO INT8 (NNCF PTQ)",
    "ours_qdq_int8": "ours: 2:4 + static INT8 (ORT)",
    "ours_openvino": "ours on OpenVINO",
    # the same model with OpenVINO's sparse-weight decompression on: beside the row above (the backend's
    # default, off) it shows what the 2:4 zeros buy where the CPU has AMX; where it has none, both run dense
    "ours_openvino_sparse": "ours on OpenVINO, sparse-weight decompression on",
    "ours_openvino_dense": "ours on OpenVINO, sparse-weight decompression off",  # the label older reports use
    # compiled for each cell's one shape: OpenVINO fuses more with every dimension static. Ours through the
    # backend's --openvino-shapes; the NNCF baseline gets the same treatment, so the pair compares alike
    "openvino_nncf_int8_static": "OpenVINO INT8 (NNCF PTQ), static shape",
    "ours_openvino_static": "ours on OpenVINO, static shape",
    # --openvino-precision f32: the float ops in float32, `holoserve eval`'s numerics (OpenVINO's CPU default
    # is bf16 where the CPU has bf16 units, which moves some predictions), at the speed this costs
    "ours_openvino_f32": "ours on OpenVINO, f32 float ops",
    "ours_openvino_static_f32": "ours on OpenVINO, static shape, f32 float ops",
    # --openvino-kernels on: the 2:4 INT8 Linears on HoloServe's own kernels (holoserve.kernels), which skip
    # the zeros; every other op stays OpenVINO's
    "ours_openvino_kernels": "ours on OpenVINO + 2:4 kernels",
    "ours_openvino_static_kernels": "ours on OpenVINO + 2:4 kernels, static shape",
    # --also: a second checkpoint's OpenVINO export, through the same backend as ours
    "also_openvino": "second checkpoint (--also) on OpenVINO",
    "also_openvino_static": "second checkpoint (--also) on OpenVINO, static shape",
}
# static-shape rows and the dynamic row whose model they compile per cell
STATIC_OF = {"openvino_nncf_int8_static": "openvino_nncf_int8", "ours_openvino_static": "ours_openvino",
             "ours_openvino_static_f32": "ours_openvino_f32", "ours_openvino_static_kernels": "ours_openvino_kernels",
             "also_openvino_static": "also_openvino"}
# our model.ov.onnx compiled by OpenVINO once for all shapes (the static rows compile it per cell)
OURS_OPENVINO = ("ours_openvino", "ours_openvino_sparse", "ours_openvino_f32", "ours_openvino_kernels")
KERNEL_ROWS = ("ours_openvino_kernels", "ours_openvino_static_kernels")  # --openvino-kernels on
OPENVINO_ENGINES = ("openvino_fp32", "openvino_nncf_int8", *OURS_OPENVINO, "also_openvino")
PRECISION_OF = {"ours_openvino_f32": "f32", "ours_openvino_static_f32": "f32"}  # others: OpenVINO's default
INT8_REFERENCE = "openvino_nncf_int8"  # the second ratio in the table: speed-up over OpenVINO INT8 (NNCF)


def skip_static_rows(skipped: dict) -> None:
    """A static-shape row is skipped, for the same reason, when the row whose model it compiles is."""
    for k, base in STATIC_OF.items():
        if base in skipped:
            skipped.setdefault(k, skipped[base])


class EngineSet:
    """The engines that run, their models, and how each is run at a thread count (feed dict -> logits)."""

    def __init__(self, names: list[str], cps, base):
        """cps: the checkpoints and their exports; base: the dense baselines' files (both from run.py)."""
        self.names, self.cps, self.nncf_ir = names, cps, base.nncf_ir
        self.onnx_of = {"ort_fp32": base.fp32_onnx, "ort_dynamic_int8": base.dyn_onnx, "ours_qdq_int8": cps.ours}
        self.openvino_of = {"openvino_fp32": (base.plain_fp32_onnx, False), "openvino_nncf_int8": (base.nncf_ir, False),
                            **{k: (cps.ours_ov, k == "ours_openvino_sparse") for k in OURS_OPENVINO},
                            "also_openvino": (cps.also_ov, False)}  # (model, sparse decompression)

    def compile_ov(self, key: str, threads: int):
        from holoserve.backends.openvino import compile_model

        path, sparse = self.openvino_of[key]
        compiled, note = compile_model(path, threads=threads, sparse=sparse, precision=PRECISION_OF.get(key, "auto"),
                                       kernels="on" if key in KERNEL_ROWS else "off")
        return compiled, note

    def static_runner(self, key: str, threads: int, batch: int, seq: int):
        """feed -> logits for a static-shape row, compiled for this one cell."""
        from holoserve.backends.openvino import OpenVinoBackend, compile_model

        if key != "openvino_nncf_int8_static":  # ours: the product path, the backend with --openvino-shapes
            art = self.cps.art_also if key == "also_openvino_static" else self.cps.art
            backend = OpenVinoBackend(art, threads=threads, shapes=[(batch, seq)],
                                      precision=PRECISION_OF.get(key, "auto"),
                                      kernels="on" if key in KERNEL_ROWS else "off")
            def run(feed):
                return backend.infer(feed["input_ids"], feed["attention_mask"], feed["token_type_ids"])

            return run, backend
        return openvino_runner(compile_model(self.nncf_ir, threads=threads, sparse=False, shape=(batch, seq))[0]), None

    def runners(self, threads: int) -> dict:
        out = {}
        for k in self.names:
            if k in self.onnx_of:
                out[k] = ort_runner(ort_session(self.onnx_of[k], threads))
            elif k in self.openvino_of:
                out[k] = openvino_runner(self.compile_ov(k, threads)[0])
        return out

    def openvino_info(self, ov, nncf) -> dict:
        """OpenVINO's version and, per OpenVINO engine, the precisions its compiled graph runs in."""
        if ov is None or not any(k in self.names for k in OPENVINO_ENGINES):
            return {}
        info = {"version": ov.__version__, "nncf": getattr(nncf, "__version__", None),
                "config": "PERFORMANCE_HINT LATENCY, INFERENCE_NUM_THREADS = threads"}
        for k in OPENVINO_ENGINES:
            if k in self.names:
                compiled, note = self.compile_ov(k, 1)
                info[k] = {"gemm_precisions": int8_gemms(compiled), "sparse_weights_decompression": note,
                           "inference_precision": openvino_inference_precision(compiled)}
        return info
