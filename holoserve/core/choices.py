"""Fixed sets of values that CLI flags, the server's settings and the backends share.

Import-light on purpose (no numpy, pydantic or runtime libraries): `holoserve serve --help`, the server
config and `holoserve export`'s argument parser read these without loading a backend.
"""
from __future__ import annotations

# OpenVINO's INFERENCE_PRECISION_HINT for the float ops of model.ov.onnx: "auto" keeps the CPU plugin's
# default (bf16 where the CPU has bf16 units), "f32" the checkpoint's numerics.
OPENVINO_PRECISIONS = ("auto", "f32", "bf16", "f16")
OPENVINO_KERNELS = ("auto", "on", "off", "reference")  # HoloServe's 2:4 INT8 kernels (holoserve.kernels)
# auto: on where the CPU has AVX-512 VNNI + VBMI and no AMX, and the library builds (or is built); reference:
# their portable scalar build (any x86-64 CPU, the same numbers, many times slower), for checks, not speed
OPENVINO_KERNELS_DEFAULT = "auto"
# `holoserve compress --method`: the recipes compress/methods.py registers, named here so that the CLI lists them
# without importing torch. The default is one-shot OBS + QAT, no ADMM: no ADMM recipe measured better after
# training (docs/results/2026-11-28-admm-decisive.md).
COMPRESS_METHODS = ("oneshot", "admm", "admm_guided", "magnitude", "ptq")
DEFAULT_METHOD = "oneshot"
# What `holoserve eval` scores through: `torch`, the PyTorch fake-quant model (the checkpoint's own numerics), or
# an export through the server's own CPU backend of that name. "pytorch" is read as "torch", its earlier name.
EVAL_BACKENDS = ("torch", "onnxruntime", "openvino")
EVAL_BACKEND_ALIASES = {"pytorch": "torch"}
# The `torch` backend's float dtype: fp32 is the checkpoint's own numerics (the parity reference); fp16 is how
# a GPU serves a dense model (CUDA only).
TORCH_PRECISIONS = ("fp32", "fp16")
# Which INT8 GEMMs the `torch-cuda` backend serves each batch bucket on: auto = the faster of the 2:4 and the
# dense INT8 GEMMs of the same weights, timed at load; sparse / dense-int8 = that kind for every bucket.
TORCH_CUDA_ROUTES = ("auto", "sparse", "dense-int8")
