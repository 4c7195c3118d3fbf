"""torch-cuda's routing on a CUDA GPU: route="auto" times the 2:4 and the dense INT8 GEMMs of the same weights
per token count at load, serves each bucket on the faster and reports the table; forced routes serve every
bucket on one kind. The decision logic itself is tested on the CPU (tests/unit/backends/test_torch_cuda_routing.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from holoserve.backends import load_backend  # noqa: E402
from holoserve.backends import torch_cuda as tc  # noqa: E402
from holoserve.core.artifact import load_artifact  # noqa: E402
from tests.helpers.tiny import calibrated_tiny_checkpoint, random_batches  # noqa: E402

pytestmark = pytest.mark.gpu
BATCHES, SEQS = [1, 2, 4, 8], [16, 32, 64]


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    tc.require_cuda()
    torch.manual_seed(0)
    _, _, _, a = calibrated_tiny_checkpoint(tmp_path_factory.mktemp("route"), hidden=64, intermediate=128,
                                            max_seq_length=64)
    return load_artifact(a.path)


def _feeds(art, seed):
    vocab = int(json.loads((art.path / "config.json").read_text())["vocab_size"])
    return [[b[k].numpy() for k in ("input_ids", "attention_mask", "token_type_ids")]
            for b in random_batches(vocab, n=3, b=5, s=20, seed=seed)]


def _load(art, **options):
    return load_backend("torch-cuda", art, max_batch=8, **options)


def test_gpu_auto_route_times_both_and_reports_every_bucket(art):
    backend = _load(art, route="auto")
    info = backend.info()
    print("routes:", info["routes"], "\nroute_ms:", info["route_ms"], "\n",
          info["route_note"], info["route_seconds"], "s")
    assert info["route"] == "auto" and info["kernel"] == "cslt"
    assert set(info["routes"]) == {f"{b}x{n}" for b in BATCHES for n in SEQS}
    assert set(info["routes"].values()) <= {"cslt", "int_mm"}
    assert info["route_ms"], info  # the tiny model's token counts are all under route_max_tokens
    for bucket, ms in info["route_ms"].items():
        assert ms["cslt"] > 0 and ms["int_mm"] > 0, (bucket, ms)
        assert info["routes"][bucket] == tc.choose_kernel(ms), (bucket, ms)
    by_tokens = {}
    for bucket, kernel in info["routes"].items():  # one decision per token count
        b, n = map(int, bucket.split("x"))
        assert by_tokens.setdefault(b * n, kernel) == kernel, info["routes"]
    # the timed buckets' graphs were kept for serving; the dense INT8 weights only if a bucket takes them
    assert set(info["route_ms"]) <= set(info["captured_buckets"])
    assert ("int_mm" in backend.runner.variants) == ("int_mm" in info["routes"].values())
    assert info["weight_mib_at_load"]["int_mm"] > info["weight_mib_at_load"]["cslt"] > 0
    sparse = _load(art, route="sparse")
    for feed in _feeds(art, seed=21):
        a, b = backend.infer(*feed), sparse.infer(*feed)
        assert a.shape == b.shape == (5, 2) and np.isfinite(a).all()
        assert np.abs(a - b).max() < 2e-2 * max(1.0, np.abs(b).max())


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_gpu_forced_routes_serve_one_kind_and_agree(art, precision):
    """The same INT8 codes through either GEMM: exact integer products, so only the epilogue's rounding can
    differ. FP32 (INT32 out, the same dequantization ops on both): bit-identical logits. FP16 (cuSPARSELt's
    fused alpha/bias epilogue vs dequantization after torch._int_mm): within FP16 rounding, and the same
    argmax wherever the top two logits are further apart than the two variants differ."""
    sparse = _load(art, route="sparse", precision=precision)
    dense = _load(art, route="dense-int8", precision=precision)
    si, di = sparse.info(), dense.info()
    assert si["route"] == "sparse" and set(si["routes"].values()) == {"cslt"} and si["gemm_kernels"] == {"cslt": 8}
    assert di["route"] == "dense-int8" and set(di["routes"].values()) == {"int_mm"}, di
    assert di["gemm_kernels"] == {"int_mm": 8} and di["epilogue"] is None and "route_ms" not in di
    worst = 0.0
    for feed in _feeds(art, seed=22 if precision == "fp16" else 23):
        a, b = sparse.infer(*feed), dense.infer(*feed)
        if precision == "fp32":
            assert np.array_equal(a, b), np.abs(a - b).max()
        diff = np.abs(a - b).max()
        worst = max(worst, float(diff))
        assert diff < 2e-2 * max(1.0, np.abs(a).max()), diff
        top2 = np.sort(a, axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 2 * diff
        assert (a.argmax(-1) == b.argmax(-1))[clear].all()
    print(f"precision={precision}: largest |logit difference| between the 2:4 and dense INT8 GEMMs: {worst:.3g}")
