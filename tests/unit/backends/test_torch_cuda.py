"""The torch-cuda backend: exact quantized math on CPU, and the real 2:4 INT8 path where CUDA is."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from holoserve.compress.checkpoint import load_model  # noqa: E402
from holoserve.compress.project import project  # noqa: E402
from holoserve.compress.quant import fake_quant_act, input_quantizers  # noqa: E402
from holoserve.core.artifact import load_artifact  # noqa: E402
from holoserve.backends import BackendUnavailable, load_backend  # noqa: E402
from holoserve.backends import torch_cuda as tc  # noqa: E402
from tests.helpers.tiny import calibrated_tiny_checkpoint, random_batches as _batches  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A tiny BERT projected onto 2:4 ∩ INT8, calibrated, saved as a real checkpoint."""
    torch.manual_seed(0)
    model, _, _, art = calibrated_tiny_checkpoint(tmp_path_factory.mktemp("tc"), hidden=32, intermediate=64,
                                                  max_seq_length=32)
    vocab = model.config.vocab_size
    return art, vocab


def test_quantize_activation_matches_fake_quant():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 300.0, -300.0, 0.49, 126.6]) * 0.1
    s = torch.tensor(0.1)
    codes = tc.quantize_activation(x, s)
    assert codes.dtype == torch.int8
    # half to even, saturation to [-128, 127]
    assert codes.tolist() == [0, 2, 2, 0, -2, 127, -128, 0, 127]
    assert torch.equal(codes.float() * s, fake_quant_act(x, s))


_TRITON_CHECK = r"""
import torch
from holoserve.backends import torch_cuda as tc
g = torch.Generator().manual_seed(0)
s = torch.tensor(0.05)
ties = (torch.arange(-300, 300, dtype=torch.float32) + 0.5) * s
x = torch.cat([ties, torch.randn(5000, generator=g) * 3, torch.tensor([0.0, -0.0, 1e4, -1e4])])
x = x[: (x.numel() // 40) * 40].reshape(-1, 40).half()
want = tc.quantize_activation(x, s)
got = tc.quantize_activation_triton(x, s, rows=x.shape[0] + 7)
assert got.dtype == torch.int8 and got.shape == (x.shape[0] + 7, 40)
assert torch.equal(got[: x.shape[0]], want), int((got[: x.shape[0]] != want).sum())
assert not got[x.shape[0]:].any()
q, probe = tc.choose_quantizer("cpu")
assert q == "triton" and probe["gelu_fused"] and probe["ln_fused"] and probe["table_fused"], probe
# GELU + quantize in one kernel vs GELU then quantize
gx = torch.randn(64, 48, generator=g).half() * 2
want_g = tc.quantize_activation(torch.nn.functional.gelu(gx.float()), s)
got_g = tc.quantize_activation_triton(gx, s, gelu=True)
assert int((got_g.int() - want_g.int()).abs().max()) <= 1 and int((got_g != want_g).sum()) <= 3

# a whole encoder: Triton quantizers + fused GELU vs the torch-op quantizers, same exact INT8 GEMMs
from transformers import BertConfig, BertForSequenceClassification
from holoserve.compress.layers import encoder_linear_names
from holoserve.compress.project import project
from holoserve.compress.sparsify import project_layers
from holoserve.compress.quant import calibrate_amax
torch.manual_seed(0)
cfg = BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                 max_position_embeddings=64, num_labels=2)
model = BertForSequenceClassification(cfg).eval()
layers = encoder_linear_names(model)
scales = project_layers(model, layers)
ids = torch.randint(5, 300, (3, 16), generator=g)
batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
amax = calibrate_amax(model, layers, [batch])
state = model.state_dict()
from dataclasses import replace
quant = tc.CheckpointQuant(weight_scales=scales, act_amax=amax, sparse_layers=layers)
lin = tc.LinearOptions(kernel="reference", dtype=torch.float32)
with_triton = lambda lin: replace(lin, tuning=tc.Tuning(quantizer="triton"))  # noqa: E731
plain = tc.build_encoder(cfg.to_dict(), state, quant, linear=lin)
fused = tc.build_encoder(cfg.to_dict(), state, quant, linear=with_triton(lin), fusion=tc.Fusion(gelu_quant=True))
assert fused.gelu_quant and not plain.gelu_quant and not fused.ln_quant
with torch.no_grad():
    a, b = plain(**batch), fused(**batch)
assert torch.allclose(a, b, atol=2e-2), (a - b).abs().max()
# FP16 throughout, as on the GPU: LayerNorm + residual + quantize fused as well
lin16 = replace(lin, dtype=torch.float16)
plain16 = tc.build_encoder(cfg.to_dict(), state, quant, linear=lin16)
fused16 = tc.build_encoder(cfg.to_dict(), state, quant, linear=with_triton(lin16),
                           fusion=tc.Fusion(gelu_quant=True, ln_quant=True))
assert fused16.ln_quant and fused16.gelu_quant
with torch.no_grad():
    c, d = plain16(**batch), fused16(**batch)
assert torch.allclose(c, d, atol=3e-2), (c - d).abs().max()
assert torch.allclose(a, d, atol=5e-2), (a - d).abs().max()
# the FFN activation by a table of every FP16 value's code: the torch reference's codes exactly
tab = tc.activation_code_table(torch.nn.functional.gelu, s)
every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
fin = every[torch.isfinite(every)]
fin = fin[: (fin.numel() // 64) * 64].reshape(-1, 64)
got_t = tc.quantize_by_table(fin, tab, rows=fin.shape[0] + 3)
assert torch.equal(got_t[: fin.shape[0]], tc.quantize_activation(torch.nn.functional.gelu(fin.float()), s))
assert not got_t[fin.shape[0]:].any()
special = torch.tensor([[float("nan"), float("inf"), -float("inf"), -0.0]]).half()
assert torch.equal(tc.quantize_by_table(special, tab),  # torch's GELU, a NaN activation as code 0
                   tc.quantize_activation(torch.nn.functional.gelu(special.float()).nan_to_num(nan=0.0), s))
assert tc.quantize_by_table(special, relu_tab := tc.activation_code_table(torch.nn.functional.relu, s)
                            ).tolist() == [[0, 127, 0, 0]]
assert torch.equal(tc.quantize_by_table(fin, relu_tab), tc.quantize_activation(fin.float().clamp_min(0), s))
tables16 = tc.build_encoder(cfg.to_dict(), state, quant, linear=with_triton(lin16),
                            fusion=tc.Fusion(gelu_quant=True, ln_quant=True))
tables16.use_code_tables()
assert tables16.code_tables and tables16.layers[0]["ffn_out"].code_table.shape == (65536,)
with torch.no_grad():
    e = tables16(**batch)
assert torch.allclose(d, e, atol=3e-2), (d - e).abs().max()
tables16.use_code_tables(False)
assert tables16.gelu_quant and not tables16.code_tables
try:
    tc.build_encoder(cfg.to_dict(), state, quant, linear=lin).use_code_tables()
    raise AssertionError("an FP32 encoder took code tables")
except ValueError as err:
    assert "FP16" in str(err)
h, hq = tc.add_layer_norm_quant(gx, gx, torch.ones(48).half(), torch.zeros(48).half(), 1e-12, scale=s, rows=70)
ref_h = torch.nn.functional.layer_norm(gx + gx, (48,), torch.ones(48).half(), torch.zeros(48).half(), 1e-12)
assert (h.float() - ref_h.float()).abs().max() < 1e-2 and hq.shape == (70, 48) and not hq[64:].any()
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed here")
def test_triton_quantizer_equals_reference_in_interpreter():
    """The fused quantizer kernel, run by Triton's CPU interpreter, gives the exact reference codes."""
    _run_interpreted(_TRITON_CHECK)


_TRITON_FMA_CHECK = r"""
import numpy as np
import torch
import triton.runtime.interpreter as interp
from holoserve.backends.torch_cuda import kernels as K
from holoserve.backends import torch_cuda as tc

K.fma_div = lambda: True  # the GPU's arithmetic: division through a fused multiply-add


def exact_fma(self, x, y, z):  # a real FMA (one rounding); the interpreter's own rounds a*b, then the sum
    d = x.data.astype(np.longdouble) * y.data.astype(np.longdouble) + z.data.astype(np.longdouble)
    return interp.TensorHandle(d.astype(z.data.dtype), z.dtype.scalar)


def broken_fma(self, x, y, z):
    return interp.TensorHandle(np.zeros_like(z.data), z.dtype.scalar)


g = torch.Generator().manual_seed(1)
every_half = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
every_half = every_half[torch.isfinite(every_half)]
every_half = every_half[: (every_half.numel() // 64) * 64].reshape(-1, 64)
all_ones = float(np.nextafter(np.float32(0.0625), np.float32(0)))  # significand all ones: the exception
for scale in (0.05, 0.0123, 3.0 / 127, all_ones):
    s = torch.tensor(scale)
    ties = ((torch.arange(-300, 300, dtype=torch.float32) + 0.5) * s).half()
    x = torch.cat([ties[: (ties.numel() // 64) * 64].reshape(-1, 64), every_half,
                   (torch.randn(64, 64, generator=g) * 3).half()])
    want = tc.quantize_activation(x, s)
    interp.InterpreterBuilder.create_fma = broken_fma
    broken = tc.quantize_activation_triton(x, s)
    # the FMA path really runs, except for the all-ones scale, which divides
    assert torch.equal(broken, want) == (scale == all_ones), scale
    interp.InterpreterBuilder.create_fma = exact_fma
    got = tc.quantize_activation_triton(x, s)
    assert torch.equal(got, want), (scale, int((got != want).sum()))
    gx = (torch.randn(64, 48, generator=g) * 2).half()
    got_g = tc.quantize_activation_triton(gx, s, gelu=True)
    want_g = tc.quantize_activation(torch.nn.functional.gelu(gx.float()), s)
    assert int((got_g.int() - want_g.int()).abs().max()) <= 1 and int((got_g != want_g).sum()) <= 3
    h, hq = tc.add_layer_norm_quant(gx, gx, torch.ones(48).half(), torch.zeros(48).half(), 1e-12, scale=s)
    assert torch.equal(hq, tc.quantize_activation(h.float(), s))
print("ok")
"""


def _run_interpreted(script: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[3]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed here")
def test_triton_fma_division_gives_the_reference_codes_in_interpreter():
    """The kernels' division by the scale through one FMA correction step (as compiled for the GPU), run by the
    interpreter with an exact FMA: the reference codes for every FP16 value, at ties and at a scale whose
    significand is all ones (which takes the plain division)."""
    _run_interpreted(_TRITON_FMA_CHECK)


def test_weight_codes_recover_grid_exactly():
    w = torch.randn(64, 32)
    p = project(w)
    codes = tc.weight_codes(p.z, p.scales)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) <= 127
    assert torch.equal(codes.float() * p.scales.reshape(-1, 1), p.z)
    # 2:4 survives: every group of 4 codes holds at least two zeros
    assert int((codes.reshape(64, 8, 4) != 0).sum(-1).max()) <= 2


def test_int8_linear_reference_is_integer_exact():
    g = torch.Generator().manual_seed(0)
    p = project(torch.randn(48, 64, generator=g))
    codes = tc.weight_codes(p.z, p.scales)
    x = torch.randn(5, 7, 64, generator=g)
    act = torch.tensor(3.0 / 127)
    bias = torch.randn(48, generator=g)
    y = tc.int8_linear_reference(x, codes, p.scales, act, bias)
    assert y.shape == (5, 7, 48)
    # integer accumulation checked against int64 arithmetic
    xq = tc.quantize_activation(x.reshape(-1, 64), act).long()
    acc = xq @ codes.long().t()
    want = acc.float() * (p.scales * act) + bias
    assert torch.allclose(y.reshape(-1, 48), want, rtol=1e-6, atol=1e-6)
    # and it equals the fake-quant formulation up to float32 rounding
    fq = torch.nn.functional.linear(fake_quant_act(x, act), p.z, bias)
    assert torch.allclose(y, fq, rtol=1e-4, atol=1e-4)


def test_dense_encoder_matches_transformers(tiny_checkpoint):
    """The graph-capturable encoder is BERT: float path equals the transformers model."""
    art, vocab = tiny_checkpoint
    ref, _ = load_model(art.path)
    enc = tc.encoder_from_artifact(art, linear=tc.LinearOptions(kernel="dense", dtype=torch.float32))
    for batch in _batches(vocab, n=2, seed=5):
        with torch.no_grad():
            want = ref(**batch).logits
            got = enc(**batch)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("kernel", ["reference", "fakequant"])
def test_quantized_encoder_matches_checkpoint_fake_quant(tiny_checkpoint, kernel):
    """Int8 codes + integer accumulation + dequant == the checkpoint's fake-quant model."""
    art, vocab = tiny_checkpoint
    ref, _ = load_model(art.path)
    layers = art.sparse_layers
    enc = tc.encoder_from_artifact(art, linear=tc.LinearOptions(kernel=kernel, dtype=torch.float32))
    n_q = sum(isinstance(m, tc.QuantLinear) for m in enc.modules())
    assert n_q == 2 * 4  # fused QKV + attention out + FFN in + FFN out, per layer
    agree = total = 0
    for batch in _batches(vocab, n=4, seed=7):
        with torch.no_grad(), input_quantizers(ref, art.activation_amax(), layers):
            want = ref(**batch).logits
        with torch.no_grad():
            got = enc(**batch)
        assert torch.allclose(got, want, atol=2e-3, rtol=1e-3), (got - want).abs().max()
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += got.shape[0]
    assert agree == total


def test_qkv_not_fused_when_ranges_differ(tiny_checkpoint):
    art, _ = tiny_checkpoint
    config, state = tc.checkpoint_tensors(art)
    amax = dict(art.activation_amax())
    key = next(k for k in amax if k.endswith("attention.self.key.input"))
    amax[key] *= 2
    q = art.all_weight_scales()
    enc = tc.build_encoder(config, state, tc.CheckpointQuant(weight_scales=q, act_amax=amax,
                                                             sparse_layers=art.sparse_layers),
                           linear=tc.LinearOptions(kernel="reference", dtype=torch.float32))
    assert len(enc.layers[0]["qkv"].parts) == 3 or len(enc.layers[1]["qkv"].parts) == 3
    ids = torch.randint(5, 50, (2, 8))
    out = enc(ids, torch.ones_like(ids), torch.zeros_like(ids))
    assert out.shape == (2, 2) and torch.isfinite(out).all()


def test_unsupported_model_type_is_a_clear_error():
    from holoserve import HoloServeError

    with pytest.raises(HoloServeError, match="BERT models only"):
        tc.BertShape.from_config({"model_type": "roberta"})


def test_cuda_report_never_raises():
    rep = tc.cuda_report()
    assert "cuda" in rep and "torch" in rep


@pytest.mark.skipif(HAS_CUDA, reason="checks the message given when CUDA is absent")
def test_backend_says_clearly_that_cuda_is_absent(tiny_checkpoint):
    art, _ = tiny_checkpoint
    with pytest.raises(BackendUnavailable, match="needs an NVIDIA GPU"):
        load_backend("torch-cuda", load_artifact(art.path))


def test_dense_int8_layer_passes_int_mm_a_column_major_weight(monkeypatch):
    """torch._int_mm's fast cuBLASLt INT8 kernels take B column-major: with a row-major [K, N] weight the
    same product ran 6x slower on an H100 (133 vs 840 TOPS at 8192^3). The layer keeps [N, K] and hands
    over its transposed view; the result is the exact integer product either way."""
    from holoserve.backends.torch_cuda.layers import QuantLinear

    g = torch.Generator().manual_seed(0)
    p = project(torch.randn(48, 64, generator=g))
    codes = tc.weight_codes(p.z, p.scales)
    act, bias = torch.tensor(3.0 / 127), torch.randn(48, generator=g)
    seen = []

    def int_mm(a, b):
        seen.append((tuple(b.shape), b.stride()))
        return (a.long() @ b.long()).to(torch.int32)

    monkeypatch.setattr(torch, "_int_mm", int_mm)
    layer = QuantLinear(codes, p.scales, act, bias, kernel="int_mm", dtype=torch.float32)
    x = torch.randn(3, 5, 64, generator=g)
    y = layer(x)
    assert seen == [((64, 48), (1, 64))]  # [K, N] with unit stride down K: column-major
    assert torch.allclose(y, tc.int8_linear_reference(x, codes, p.scales, act, bias), rtol=1e-6, atol=1e-6)


def test_algorithm_search_covers_the_token_counts_it_is_given(monkeypatch):
    """alg_search=N: cuSPARSELt's own search picks the algorithm up to N token rows (once per count, never
    inside a graph capture); above N, and with False, algorithm 0; True searches every count."""
    from holoserve.backends.torch_cuda.layers import QuantLinear

    p = project(torch.randn(16, 32))
    codes = tc.weight_codes(p.z, p.scales)
    searched = []

    def search(packed, x_t, **kw):
        searched.append(x_t.shape[1])
        return 3

    monkeypatch.setattr(torch, "_cslt_sparse_mm_search", search, raising=False)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])

    def layer(alg_search):
        lin = QuantLinear(codes, p.scales, torch.tensor(0.01), None, kernel="reference", dtype=torch.float32,
                          tuning=tc.Tuning(alg_search=alg_search))
        lin.packed = codes  # stands in for the compressed weight: the search only passes it on
        return lin

    rows = lambda m: torch.zeros(m, 32, dtype=torch.int8)  # noqa: E731
    lin = layer(2048)
    capturing[0] = True
    assert lin._alg(rows(128)) == 0 and searched == []  # no search inside a capture, and nothing remembered
    capturing[0] = False
    assert [lin._alg(rows(m)) for m in (128, 2048, 4096, 128)] == [3, 3, 0, 3]
    assert searched == [128, 2048]  # once per token count, none above the limit
    assert layer(False)._alg(rows(16)) == 0 and layer(0)._alg(rows(16)) == 0
    searched.clear()
    assert layer(True)._alg(rows(16384)) == 3 and searched == [16384]
    from holoserve.backends.torch_cuda.backend import ALG_SEARCH_MAX_TOKENS, TorchCudaOptions
    import inspect

    assert inspect.signature(TorchCudaOptions).parameters["alg_search"].default == ALG_SEARCH_MAX_TOKENS == 2048


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed here")
def test_layer_norm_kernel_layout_per_width():
    from holoserve.backends.torch_cuda import kernels

    assert kernels._triton_quant_kernel() is not None
    assert kernels.ln_blocks(768) == {"BLOCK": 256, "CHUNKS": 3, "num_warps": 1}  # BERT-base: no idle lane
    assert kernels.ln_blocks(384) == {"BLOCK": 128, "CHUNKS": 3, "num_warps": 1}  # MiniLM
    assert kernels.ln_blocks(48) == {"BLOCK": 16, "CHUNKS": 3, "num_warps": 1}
    assert kernels.ln_blocks(64) == {"BLOCK": 64, "CHUNKS": 1, "num_warps": 1}
    assert kernels.ln_blocks(312) == {"BLOCK": 512, "CHUNKS": 1, "num_warps": 1}  # TinyBERT: masked lanes
    assert kernels.ln_blocks(24) == {"BLOCK": 32, "CHUNKS": 1, "num_warps": 1}
    assert kernels.ln_blocks(4096) == {"BLOCK": 4096, "CHUNKS": 1, "num_warps": 4}
    assert kernels.ln_blocks(3072) == {"BLOCK": 1024, "CHUNKS": 3, "num_warps": 2}  # warps: a power of two
