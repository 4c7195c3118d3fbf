"""The torch-cuda backend's real 2:4 INT8 path (cuSPARSELt, Triton, CUDA graphs) on a CUDA GPU."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from holoserve.backends import load_backend  # noqa: E402
from holoserve.backends import torch_cuda as tc  # noqa: E402
from holoserve.compress.project import project  # noqa: E402
from holoserve.compress.quant import input_quantizers  # noqa: E402
from holoserve.core.artifact import load_artifact  # noqa: E402
from tests.helpers.tiny import calibrated_tiny_checkpoint, random_batches as _batches  # noqa: E402

pytestmark = pytest.mark.gpu


def test_gpu_triton_quantizer_matches_torch_ops():
    q, probe = tc.choose_quantizer("cuda")
    assert q in ("triton", "torch")
    if importlib.util.find_spec("triton") is not None:
        assert q == "triton", probe


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("scale", [0.05, 0.0123, 3.0 / 127, float(np.nextafter(np.float32(0.0625), np.float32(0)))])
def test_gpu_triton_codes_for_every_fp16_value(scale):
    """The compiled kernels (division through an FMA step, plain division for an all-ones significand) give
    the torch ops' codes for every finite FP16 input, exactly, also from FP32 inputs, after LayerNorm and
    through a GELU code table."""
    tc.require_cuda()
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    x = x[torch.isfinite(x)]
    x = x[: (x.numel() // 64) * 64].reshape(-1, 64).cuda()
    s = torch.tensor(scale, device="cuda")
    assert torch.equal(tc.quantize_activation_triton(x, s), tc.quantize_activation(x, s))
    # the FFN activation by table: the torch reference's codes of GELU for every FP16 value, exactly
    table = tc.activation_code_table(torch.nn.functional.gelu, s)
    assert torch.equal(tc.quantize_by_table(x, table), tc.quantize_activation(torch.nn.functional.gelu(x.float()), s))
    x32 = torch.randn(4096, 256, device="cuda") * 4
    assert torch.equal(tc.quantize_activation_triton(x32, s), tc.quantize_activation(x32, s))
    h, hq = tc.add_layer_norm_quant(x[:512], None, torch.ones(64, device="cuda").half(),
                                    torch.zeros(64, device="cuda").half(), 1e-12, scale=s)
    assert torch.equal(hq, tc.quantize_activation(h.float(), s))
    # BERT-base's width: three chunks of 256 lanes, one warp per row; with a residual, against torch's ops
    a, r = (torch.randn(300, 768, device="cuda") * 3).half(), (torch.randn(300, 768, device="cuda")).half()
    w, b = (torch.rand(768, device="cuda") + 0.5).half(), (torch.randn(768, device="cuda") * 0.1).half()
    h, hq = tc.add_layer_norm_quant(a, r, w, b, 1e-12, scale=s, rows=304)
    ref = torch.nn.functional.layer_norm(a + r, (768,), w, b, 1e-12)
    assert (h.float() - ref.float()).abs().max() < 1e-2 and hq.shape == (304, 768) and not hq[300:].any()
    assert torch.equal(hq[:300], tc.quantize_activation(h.float(), s))


def test_gpu_epilogue_probe_finds_a_working_mode():
    tc.require_cuda()
    e, tried = tc.choose_epilogue("cuda")
    assert tried[-1]["ok"] and e.name == tried[-1]["epilogue"]
    e32, tried32 = tc.choose_epilogue("cuda", torch.float32)  # precision=fp32: INT32 out, dequant after
    assert not e32.alpha and tried32[-1]["ok"]


@pytest.mark.parametrize("m", [16, 48, 200])
def test_gpu_cslt_linear_matches_reference(m):
    tc.require_cuda()
    g = torch.Generator().manual_seed(m)
    p = project(torch.randn(96, 128, generator=g))
    codes = tc.weight_codes(p.z, p.scales)
    bias = torch.randn(96, generator=g)
    act = torch.tensor(4.0 / 127)
    x = torch.randn(m, 128, generator=g)
    want = tc.int8_linear_reference(x.half().float(), codes, p.scales, act, bias)
    e, _ = tc.choose_epilogue("cuda")
    quantizers = ["torch"] + (["triton"] if tc.choose_quantizer("cuda")[0] == "triton" else [])
    for kernel in ("cslt", "int_mm"):
        for quantizer in quantizers:
            lin = tc.QuantLinear(codes.cuda(), p.scales.cuda(), act, bias, kernel=kernel, dtype=torch.float16,
                                 tuning=tc.Tuning(epilogue=e, quantizer=quantizer))
            got = lin(x.cuda().half()).float().cpu()
            assert got.shape == (m, 96)
            assert torch.allclose(got, want, atol=2e-2 * float(want.abs().max()), rtol=1e-2), (kernel, quantizer)
    searched = tc.QuantLinear(codes.cuda(), p.scales.cuda(), act, bias, kernel="cslt", dtype=torch.float16,
                              tuning=tc.Tuning(epilogue=e, alg_search=True))
    got = searched(x.cuda().half()).float().cpu()
    assert list(searched.algs) == [m + (-m) % 16]
    assert torch.allclose(got, want, atol=2e-2 * float(want.abs().max()), rtol=1e-2)


def test_gpu_backend_matches_fake_quant_and_graphs(tmp_path):
    """Real load path on a 64-wide tiny model (cuSPARSELt INT8 needs multiples of 32)."""
    tc.require_cuda()
    model, layers, amax, art = calibrated_tiny_checkpoint(tmp_path, hidden=64, intermediate=128, max_seq_length=64)
    vocab = model.config.vocab_size
    # route="sparse": every bucket on the 2:4 GEMMs, captured on its first request (route="auto" captures the
    # timed buckets at load: test_torch_cuda_routing.py)
    backend = load_backend("torch-cuda", load_artifact(art.path), route="sparse")
    info = backend.info()
    assert info["gemm_kernels"].get("cslt", 0) == 2 * 4, info
    if importlib.util.find_spec("triton") is not None:  # the fused kernels pass their probes on the device
        assert info["quantizer"] == "triton" and info["gelu_quant_fused"] and info["ln_quant_fused"], info
    for batch in _batches(vocab, n=3, b=5, s=20, seed=3):
        with torch.no_grad(), input_quantizers(model, amax, layers):
            want = model(**batch).logits.numpy()
        got = backend.infer(*(batch[k].numpy() for k in ("input_ids", "attention_mask", "token_type_ids")))
        assert got.shape == want.shape and got.dtype == np.float32
        assert np.abs(got - want).max() < 5e-2 * max(1.0, np.abs(want).max())
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.8
    assert backend.info()["captured_buckets"] == ["8x32"]
    accurate = load_backend("torch-cuda", load_artifact(art.path), precision="fp32")
    assert accurate.info()["precision"] == "fp32"
    batch = _batches(vocab, n=1, b=5, s=20, seed=4)[0]
    with torch.no_grad(), input_quantizers(model, amax, layers):
        want = model(**batch).logits.numpy()
    got = accurate.infer(*(batch[k].numpy() for k in ("input_ids", "attention_mask", "token_type_ids")))
    assert np.abs(got - want).max() < 1e-2 * max(1.0, np.abs(want).max())
    # the FFN activation by code table (the default only where no fused kernel exists; this model's GELU has one)
    assert info["activation_table"] == "off"
    tabled = load_backend("torch-cuda", load_artifact(art.path), activation_table="on")
    assert tabled.info()["activation_table"] == "on" and tabled.info()["quantizer_probe"]["table_fused"]
    for batch in _batches(vocab, n=2, b=5, s=20, seed=5):
        feed = [batch[k].numpy() for k in ("input_ids", "attention_mask", "token_type_ids")]
        a, b = backend.infer(*feed), tabled.infer(*feed)
        assert np.abs(a - b).max() < 2e-2 * max(1.0, np.abs(a).max())


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_gpu_relu_checkpoint_takes_the_code_table_by_default(tmp_path):
    """activation_table="auto": a ReLU FFN, which no fused kernel covers, is quantized by code table, and the
    logits are the fake-quant model's as closely as the GELU model's are."""
    tc.require_cuda()
    model, layers, amax, art = calibrated_tiny_checkpoint(tmp_path, hidden=64, intermediate=128, max_seq_length=64,
                                                          hidden_act="relu")
    backend = load_backend("torch-cuda", load_artifact(art.path))
    info = backend.info()
    assert info["activation_table"] == "on" and info["gelu_quant_fused"], info
    assert load_backend("torch-cuda", load_artifact(art.path),
                        activation_table="off").info()["activation_table"] == "off"
    for batch in _batches(model.config.vocab_size, n=2, b=5, s=20, seed=6):
        with torch.no_grad(), input_quantizers(model, amax, layers):
            want = model(**batch).logits.numpy()
        got = backend.infer(*(batch[k].numpy() for k in ("input_ids", "attention_mask", "token_type_ids")))
        assert np.abs(got - want).max() < 5e-2 * max(1.0, np.abs(want).max())

