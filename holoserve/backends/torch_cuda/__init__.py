"""`torch-cuda`: 2:4 sparse INT8 inference on NVIDIA GPUs through PyTorch's cuSPARSELt ops.

For GPUs without TensorRT. Every sparse encoder Linear of a checkpoint runs as one 2:4
semi-structured INT8 GEMM (`torch._cslt_compress` / `torch._cslt_sparse_mm`, the ops behind
`torch.sparse.SparseSemiStructuredTensorCUSPARSELT`):

    codes_x = clamp(round_half_even(x / s_x), ACT_QMIN, ACT_QMAX)    s_x = amax["<layer>.input"] / ACT_SCALE_DIV
    y       = (codes_x @ codes_w^T) * (s_w[n] * s_x) + bias           int32 accumulation on the tensor cores

with the constants and weight codes of holoserve.core.numerics. The per-output-channel factor `s_w[n] * s_x` is
cuSPARSELt's alpha vector, so the dequantization (and, where the library takes it, the bias)
happens in the GEMM epilogue and the result comes out in FP16. Everything else (embeddings,
LayerNorm, attention, GELU, pooler, classifier) runs in FP16. The activation quantizers are small
Triton kernels fused with what precedes them (residual add + LayerNorm, GELU; or any FFN activation
by a table of each FP16 value's code, `activation_table`); each fused kernel is compared with the plain
torch ops on the device at load time and used only if it agrees. One CUDA
graph is captured per (batch, sequence) bucket, so a request costs a few launches. The same code
runs an exact CPU reference of the quantized math (`kernel="reference"`), which the tests compare
with the checkpoint's fake-quant model on machines without a GPU.

Modules, each importable on its own:
  numerics  the quantized math as torch ops: activation codes, weight codes, the exact INT8 Linear
  kernels   the fused Triton quantizers of the serving path
  layers    QuantLinear (cslt / int_mm / reference / fakequant / dense), DenseLinear, the epilogues
  encoder   the graph-capturable BERT encoder, built from a state dict or a checkpoint folder
  probe     device checks and the load-time epilogue / quantizer probes
  graphs    per-bucket CUDA graph capture and replay
  routing   per-bucket choice between the 2:4 and the dense INT8 GEMMs of the same weights (`route`)
  backend   `load(artifact)`: the adapter the backend registry imports (holoserve.backends.base)
"""
from __future__ import annotations

from .backend import (
    DEFAULT_BATCH_BUCKETS,
    DEFAULT_SEQ_BUCKETS,
    NAME,
    PRECISIONS,
    TorchCudaBackend,
    TorchCudaOptions,
    load,
)
from .encoder import (
    SUPPORTED_ACTS,
    BertShape,
    CheckpointQuant,
    Encoder,
    Fusion,
    LinearOptions,
    build_encoder,
    checkpoint_tensors,
    encoder_from_artifact,
    make_linear,
)
from .graphs import GraphRunner
from .kernels import (
    QUANT_BLOCK,
    activation_code_table,
    add_layer_norm_quant,
    quantize_activation_triton,
    quantize_by_table,
)
from .layers import (
    CSLT_DENSE_MULTIPLE,
    CSLT_SPARSE_MULTIPLE,
    EPILOGUES,
    KERNELS,
    DenseLinear,
    Epilogue,
    QuantLinear,
    Tuning,
    pad_rows,
)
from .numerics import dequantize, int8_linear_codes, int8_linear_reference, quantize_activation, weight_codes
from .probe import choose_epilogue, choose_quantizer, cuda_report, require_cuda
from .routing import (
    ROUTES,
    RouteTiming,
    build_variants,
    check_route,
    choose_kernel,
    measure_routes,
    route_table,
    share_float_params,
    timing_plan,
)

__all__ = [
    "CSLT_DENSE_MULTIPLE", "CSLT_SPARSE_MULTIPLE", "DEFAULT_BATCH_BUCKETS", "DEFAULT_SEQ_BUCKETS", "EPILOGUES",
    "KERNELS", "NAME", "PRECISIONS", "QUANT_BLOCK", "ROUTES", "SUPPORTED_ACTS",
    "BertShape", "CheckpointQuant", "DenseLinear", "Encoder", "Epilogue", "Fusion", "GraphRunner", "LinearOptions",
    "QuantLinear", "RouteTiming", "TorchCudaBackend", "TorchCudaOptions", "Tuning",
    "add_layer_norm_quant", "build_encoder", "build_variants", "check_route", "checkpoint_tensors", "choose_epilogue",
    "choose_kernel", "choose_quantizer", "measure_routes", "route_table", "share_float_params", "timing_plan",
    "cuda_report", "dequantize", "encoder_from_artifact", "int8_linear_codes", "int8_linear_reference", "load",
    "make_linear", "pad_rows", "quantize_activation", "quantize_activation_triton", "quantize_by_table", "require_cuda",
    "weight_codes", "activation_code_table",
]
