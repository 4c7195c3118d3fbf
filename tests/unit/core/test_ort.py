"""The one ONNX Runtime session builder computes integer GEMMs exactly on the CPU it runs on: without VNNI,
ONNX Runtime's u8 x s8 kernel saturates unless the session asks for its exact path."""
from __future__ import annotations


def test_int8_gemms_are_exact_on_this_cpu():
    from holoserve.export.checks import int8_gemm_saturates

    int8_gemm_saturates.cache_clear() if hasattr(int8_gemm_saturates, "cache_clear") else None
    assert not int8_gemm_saturates()
