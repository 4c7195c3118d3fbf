"""bench/cpu_kernels/avx2_probe: the AVX2 2:4 GEMM compiles, runs and is exact, as ONNX Runtime's exact path
is, on small shapes (rows not a multiple of its 32-row block; a group with a single non-zero)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from holoserve.core.machine import cpu_flags

pytestmark = pytest.mark.skipif(not ({"avx2", "fma"} <= cpu_flags() and shutil.which("g++")),
                                reason="needs an x86-64 CPU with AVX2 and g++")


def test_the_probe_is_exact_and_reports(tmp_path, monkeypatch):
    from bench.cpu_kernels import avx2_probe

    monkeypatch.setattr(avx2_probe, "SHAPES", (("small", 37, 64, 6), ("one row", 1, 128, 4)))
    assert avx2_probe.main(["--seconds", "0.01", "--rounds", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "cpu_avx2_24_probe.json").read_text())["rows"]
    assert [r["M"] for r in rows] == [37, 1]
    for r in rows:
        assert r["ours_exact_share"] == 1.0 and r["ort_exact_exact_share"] == 1.0, r
    assert "ours vs ORT exact" in (tmp_path / "cpu_avx2_24_probe.md").read_text()


def test_single_non_zero_groups_and_refusal(tmp_path):
    from bench.cpu_kernels import avx2_probe

    dll = avx2_probe.build(tmp_path)
    rng = np.random.default_rng(3)
    w = avx2_probe.weights_24(64, 4, rng)
    w[4:8, 1] = [0, 0, 0, -127]  # a group with one weight, in the last position
    x = rng.integers(0, 256, (5, 64)).astype(np.uint8)
    _, y = avx2_probe.ours(dll, x, w, 0.0)
    np.testing.assert_array_equal(y, (x.astype(np.int64) - 128) @ w.astype(np.int64))
    w[0:4, 0] = [1, 2, 3, 0]  # three non-zeros: not 2:4
    with pytest.raises(ValueError, match="not 2:4"):
        avx2_probe.ours(dll, x, w, 0.0)
