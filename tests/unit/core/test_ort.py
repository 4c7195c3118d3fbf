"""The one ONNX Runtime session builder computes integer GEMMs exactly on the CPU it runs on: without VNNI,
ONNX Runtime's u8 x s8 kernel saturates unless the session asks for its exact u8 x u8 path, which is much
slower where VNNI or AMX computes the default exactly, so it is asked for only where a probe finds it needed."""
from __future__ import annotations

import platform

import numpy as np
import pytest

from holoserve.core import int8_probe, ort
from holoserve.core.machine import cpu_flags
from tests.helpers.serving import tiny_checkpoint

VNNI = {"avx512_vnni", "avx_vnni", "amx_int8"}


def asks_exact(sess) -> bool:
    try:
        return sess.get_session_options().get_session_config_entry(ort.EXACT_U8U8) == "1"
    except RuntimeError:  # ONNX Runtime raises for a key never set
        return False


def test_int8_gemms_are_exact_on_this_cpu():
    from holoserve.export.checks import int8_gemm_saturates

    int8_gemm_saturates.cache_clear()
    assert not int8_gemm_saturates()


def test_the_probe_finds_the_default_kernel_wrong_exactly_where_the_cpu_lacks_vnni(monkeypatch):
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the saturating kernels are x86-64's; this is {platform.machine()}")
    monkeypatch.delenv(int8_probe.ENV, raising=False)
    ort._measured_u8s8_saturates.cache_clear()
    try:
        assert ort.u8s8_saturates() == (not VNNI & cpu_flags())
    finally:
        ort._measured_u8s8_saturates.cache_clear()


@pytest.mark.parametrize("stated", ["exact", "saturates"])
def test_sessions_ask_for_the_exact_path_only_where_it_is_needed(monkeypatch, stated):
    """Stated either way (HOLOSERVE_INT8_PROBE), so that both paths run on every CPU: the exact u8 x u8 path is
    asked for only where the default saturates, and gives the default's logits wherever that is exact."""
    ckpt = tiny_checkpoint("sst2")
    path = ckpt / "model.onnx"
    monkeypatch.setenv(int8_probe.ENV, stated)
    sess = ort.session(path, threads=1)
    assert asks_exact(sess) is (stated == "saturates")
    assert asks_exact(ort.session(path, threads=1, exact_u8u8=True))
    assert not asks_exact(ort.session(path, threads=1, exact_u8u8=False))
    rng = np.random.default_rng(0)
    feed = {"input_ids": rng.integers(5, 100, (4, 12)).astype(np.int64),
            "attention_mask": np.ones((4, 12), np.int64), "token_type_ids": np.zeros((4, 12), np.int64)}
    names = {i.name for i in sess.get_inputs()}
    feed = {k: v for k, v in feed.items() if k in names}
    exact = ort.session(path, threads=1, exact_u8u8=True).run(None, feed)[0]
    if VNNI & cpu_flags():
        np.testing.assert_array_equal(sess.run(None, feed)[0], exact)


def test_the_probes_need_no_writable_temporary_folder(monkeypatch):
    """A server's container may have a read-only root and no /tmp: both runtimes' probes read their model from
    memory."""
    import tempfile

    from holoserve.backends import openvino as ov_backend

    monkeypatch.delenv(int8_probe.ENV, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", "/nonexistent/holoserve-test")
    ort._measured_u8s8_saturates.cache_clear()
    ov_backend._measured_saturates.cache_clear()
    try:
        assert ort.u8s8_saturates() == (not VNNI & cpu_flags())
        assert ov_backend._measured_saturates() == (not VNNI & cpu_flags())
    finally:
        ort._measured_u8s8_saturates.cache_clear()
        ov_backend._measured_saturates.cache_clear()
