"""cslt_epilogue without a GPU: its cuSPARSELt constants against cusparseLt.h (the committed copy of the pinned
header's values, the header itself where installed, nvmath-python's enums), the descriptors and attributes it
builds for each Linear kind (through tests.helpers.cslt.CsltSim, which checks every call and computes the GEMM
from the descriptors), and the fused epilogue's arithmetic against the unfused torch path."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from holoserve.backends.torch_cuda import cslt_epilogue as ce  # noqa: E402
from holoserve.backends.torch_cuda.layers import QuantLinear  # noqa: E402
from tests.helpers import cslt  # noqa: E402

E = cslt.HEADER_FACTS["enums"]


def _module_values() -> dict[tuple[str, str], int]:
    """(header enum type, enumerator) -> the value cslt_epilogue passes."""
    v = {("cusparseOrder_t", "CUSPARSE_ORDER_COL"): ce.ORDER_COL,
         ("cusparseOrder_t", "CUSPARSE_ORDER_ROW"): ce.ORDER_ROW,
         ("cusparseOperation_t", "CUSPARSE_OPERATION_NON_TRANSPOSE"): ce.OP_NON_TRANSPOSE,
         ("cusparseOperation_t", "CUSPARSE_OPERATION_TRANSPOSE"): ce.OP_TRANSPOSE,
         ("cusparseComputeType", "CUSPARSE_COMPUTE_32I"): ce.COMPUTE_32I,
         ("cusparseLtSparsity_t", "CUSPARSELT_SPARSITY_50_PERCENT"): ce.SPARSITY_50_PERCENT,
         ("cusparseLtMatmulAlg_t", "CUSPARSELT_MATMUL_ALG_DEFAULT"): ce.MATMUL_ALG_DEFAULT}
    v.update({("cusparseLtMatmulDescAttribute_t", f"CUSPARSELT_MATMUL_{a.name}"): int(a) for a in ce.MatmulAttr})
    v.update({("cusparseLtMatmulAlgAttribute_t", f"CUSPARSELT_MATMUL_ALG_{a.name}"): int(a) for a in ce.AlgAttr})
    return v


def test_constants_match_the_committed_header_values():
    for (enum, name), value in _module_values().items():
        assert E[enum][name] == value, (enum, name)
    assert set(cslt.HEADER_FACTS["structs"].values()) == {ce.HANDLE_BYTES}
    assert cslt.HEADER_FACTS["version"] == "0.10.0"


def test_committed_header_values_match_an_installed_header():
    header = cslt.find_header()
    if header is None or not header.is_file():
        pytest.skip("no cusparseLt.h here (set HOLOSERVE_CUSPARSELT_HEADER, or install nvidia-cusparselt-cu13)")
    facts = cslt.header_facts(header)
    for (enum, name), value in _module_values().items():
        assert facts["enums"][enum][name] == value, (header, enum, name)
    assert facts["structs"] == cslt.HEADER_FACTS["structs"]
    # the functions the module calls are declared
    for fn in ("cusparseLtStructuredDescriptorInit", "cusparseLtDenseDescriptorInit", "cusparseLtMatmulDescriptorInit",
               "cusparseLtMatmulDescSetAttribute", "cusparseLtMatmulAlgSelectionInit", "cusparseLtMatmulPlanInit",
               "cusparseLtMatmulGetWorkspace", "cusparseLtMatmul", "cusparseLtMatmulSearch",
               "cusparseLtSpMMACompressedSize2", "cusparseLtSpMMACompress2", "cusparseLtMatmulAlgGetAttribute"):
        assert fn in facts["functions"], fn
    if facts["sha256"] == cslt.HEADER_FACTS["sha256"]:
        assert facts["enums"] == cslt.HEADER_FACTS["enums"]


def test_constants_and_attribute_types_match_nvmath():
    lt = pytest.importorskip("nvmath.bindings.cusparseLt")
    for a in ce.MatmulAttr:
        assert int(lt.MatmulDescAttribute[a.name]) == int(a)
        assert np.dtype(lt.get_matmul_desc_attribute_dtype(int(a))) == np.dtype(ce.ATTR_DTYPES[a]), a
    for a in ce.AlgAttr:
        assert int(lt.MatmulAlgAttribute[a.name]) == int(a)
        assert np.dtype(lt.get_matmul_alg_attribute_dtype(int(a))) == np.dtype(ce.ALG_ATTR_DTYPES[a]), a
    for name, dt in cslt.MATMUL_ATTR_DTYPES.items():  # the stand-in's table too
        attr = lt.MatmulDescAttribute[name.removeprefix("CUSPARSELT_MATMUL_")]
        assert np.dtype(lt.get_matmul_desc_attribute_dtype(int(attr))) == np.dtype(dt), name
    assert int(lt.ComputeType.COMPUTE_32I) == ce.COMPUTE_32I
    assert int(lt.Sparsity.SPARSITY_50_PERCENT) == ce.SPARSITY_50_PERCENT
    assert int(lt.MatmulAlg.DEFAULT) == ce.MATMUL_ALG_DEFAULT
    rt = pytest.importorskip("cuda.bindings.runtime")
    dt = rt.cudaDataType
    assert (int(dt.CUDA_R_32F), int(dt.CUDA_R_16F), int(dt.CUDA_R_8I), int(dt.CUDA_R_32I), int(dt.CUDA_R_16BF)) == (
        ce.CUDA_R_32F, ce.CUDA_R_16F, ce.CUDA_R_8I, ce.CUDA_R_32I, ce.CUDA_R_16BF)
    sp = pytest.importorskip("nvmath.bindings.cusparse")
    assert (int(sp.Order.COL), int(sp.Order.ROW)) == (ce.ORDER_COL, ce.ORDER_ROW)
    assert (int(sp.Operation.NON_TRANSPOSE), int(sp.Operation.TRANSPOSE)) == (ce.OP_NON_TRANSPOSE, ce.OP_TRANSPOSE)


# -- descriptors per Linear kind -------------------------------------------------------------------------------

def _weights(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    keep = torch.rand(n, k // 4, 4, generator=g).argsort(-1) < 2  # two of every four along K
    w = (w.reshape(n, -1, 4) * keep).reshape(n, k)
    alpha = (torch.rand(n, generator=g) * 1e-3 + 1e-4).float()
    bias = (torch.randn(n, generator=g) * 0.5).half().float()  # representable in FP16: see the exactness test
    return w, alpha, bias


def _codes(t, k, seed=1):
    return torch.randint(-128, 128, (t, k), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


NEXT_SCALE = 0.0213


@pytest.mark.parametrize("kind", ce.LINEAR_KINDS)
def test_descriptors_and_attributes_for_each_linear_kind(kind):
    n, k, t = 64, 96, 32
    spec = ce.spec_for(kind, next_scale=NEXT_SCALE if kind == "ffn_in" else None)
    sim = cslt.CsltSim()
    w, alpha, bias = _weights(n, k)
    g = ce.FusedGemm(w, alpha, bias, spec, api=sim)
    out = g(_codes(t, k))
    names = [c[0] for c in sim.calls]
    # handle, the sparse operand compressed at load, then per row count: B and D, matmul, attributes, plan
    assert names == ["init", "structured_descriptor_init", "sp_mma_compressed_size2", "sp_mma_compress2",
                     "dense_descriptor_init", "dense_descriptor_init", "matmul_descriptor_init"] + \
        ["matmul_desc_set_attribute"] * (4 if kind == "ffn_in" else 2) + \
        ["matmul_alg_selection_init", "matmul_plan_init", "matmul_get_workspace", "matmul"]
    calls = dict((c[0], c[1]) for c in sim.calls if c[0] != "dense_descriptor_init")
    assert calls["structured_descriptor_init"] == (n, k, k, 16, 3, 2, 0)  # [N, K] int8 row-major, 2:4
    dense = [c[1] for c in sim.calls if c[0] == "dense_descriptor_init"]
    out_type = 3 if kind == "ffn_in" else 2
    assert dense == [(t, k, k, 16, 3, 2), (n, t, n, 16, out_type, 1)]  # B [T, K] row-major; D [N, T] col-major
    assert calls["matmul_descriptor_init"][:2] == (0, 1) and calls["matmul_descriptor_init"][-1] == 0  # N, T, 32I
    attrs = [c[1] for c in sim.calls if c[0] == "matmul_desc_set_attribute"]
    bias_ptr = g.bias.data_ptr()
    if kind == "ffn_in":
        assert g.bias.dtype == torch.float32  # fp32 bias with an INT8 output
        post = float(np.float32(1) / np.float32(NEXT_SCALE))
        assert attrs == [("CUSPARSELT_MATMUL_ALPHA_VECTOR_SCALING", 1), ("CUSPARSELT_MATMUL_BIAS_POINTER", bias_ptr),
                         ("CUSPARSELT_MATMUL_ACTIVATION_GELU", 1),
                         ("CUSPARSELT_MATMUL_ACTIVATION_GELU_SCALING", pytest.approx(post, rel=1e-7))]
        assert out.dtype == torch.int8
    else:
        assert g.bias.dtype == torch.float16
        assert attrs == [("CUSPARSELT_MATMUL_ALPHA_VECTOR_SCALING", 1), ("CUSPARSELT_MATMUL_BIAS_POINTER", bias_ptr)]
        assert out.dtype == torch.float16
    assert out.shape == (t, n)


@pytest.mark.parametrize("kind", ce.LINEAR_KINDS)
def test_fused_gemm_layout_gives_the_modelled_epilogue(kind):
    """The stand-in reads every operand through its descriptor and writes D through its own: the output in
    [T, N] equals the CPU model of the epilogue on the exact accumulators, for every Linear kind."""
    n, k, t = 48, 64, 16
    spec = ce.spec_for(kind, next_scale=NEXT_SCALE if kind == "ffn_in" else None)
    w, alpha, bias = _weights(n, k, seed=3)
    xq = _codes(t, k, seed=4)
    out = ce.FusedGemm(w, alpha, bias, spec, api=cslt.CsltSim())(xq)
    acc = (xq.double() @ w.double().t()).to(torch.int32)
    assert torch.equal(out, ce.epilogue_reference(acc, spec, alpha, bias))


def test_alg_search_reads_the_pick_and_rebuilds_the_plan():
    sim = cslt.CsltSim()
    w, alpha, bias = _weights(32, 32)
    g = ce.FusedGemm(w, alpha, bias, ce.spec_for("qkv"), api=sim, alg_search=True)
    g(_codes(16, 32))
    names = [c[0] for c in sim.calls]
    i = names.index("matmul_search")
    assert names[i + 1:] == ["matmul_alg_get_attribute", "matmul_plan_destroy", "matmul_plan_init",
                             "matmul_get_workspace", "matmul"]
    assert g.plans[16].alg == cslt.SEARCHED_ALG
    g(_codes(16, 32, seed=9))  # the plan is reused
    assert [c[0] for c in sim.calls].count("matmul_plan_init") == 2


def test_the_stand_in_fails_on_wrong_values(monkeypatch):
    """The seam can fail: a wrong enum, a wrong attribute type, an attribute after the plan, swapped ops."""
    w, alpha, bias = _weights(32, 32)
    xq = _codes(16, 32)
    spec = ce.spec_for("ffn_in", next_scale=NEXT_SCALE)
    with monkeypatch.context() as m:
        m.setattr(ce, "ORDER_COL", 0)
        with pytest.raises(cslt.SimError, match="cusparseOrder_t"):
            ce.FusedGemm(w, alpha, bias, spec, api=cslt.CsltSim())(xq)
    with monkeypatch.context() as m:
        m.setitem(ce.ATTR_DTYPES, ce.MatmulAttr.ACTIVATION_GELU_SCALING, np.float64)
        with pytest.raises(cslt.SimError, match="GELU_SCALING takes float32"):
            ce.FusedGemm(w, alpha, bias, spec, api=cslt.CsltSim())(xq)
    with monkeypatch.context() as m:
        m.setattr(ce, "OP_TRANSPOSE", ce.OP_NON_TRANSPOSE)
        with pytest.raises(cslt.SimError, match="shapes"):
            ce.FusedGemm(w, alpha, bias, spec, api=cslt.CsltSim())(xq)
    sim = cslt.CsltSim()
    g = ce.FusedGemm(w, alpha, bias, spec, api=sim)
    g(xq)
    buf = np.array([1], dtype=np.int32)
    with pytest.raises(cslt.SimError, match="after the plan"):
        sim.matmul_desc_set_attribute(g.handle, g.plans[16].matmul, int(ce.MatmulAttr.ACTIVATION_GELU),
                                      buf.ctypes.data, buf.nbytes)
    with pytest.raises(cslt.SimError, match="not 2:4"):
        ce.FusedGemm(torch.ones(32, 32, dtype=torch.int8), alpha, bias, spec, api=cslt.CsltSim())


# -- the arithmetic against the unfused torch path ---------------------------------------------------------------

@pytest.mark.parametrize("kind", ["qkv", "attn_out", "ffn_out"])
def test_fp16_epilogue_equals_the_unfused_path_when_the_bias_is_fp16(kind):
    """FP16 outputs: alpha x acc + bias in float32, one rounding to FP16, the same as the unfused path exactly
    while the bias is representable in FP16 (the backend's `cslt` kernel hands cuSPARSELt an FP16 bias too)."""
    w, alpha, bias = _weights(256, 512, seed=5)
    acc = (_codes(128, 512, seed=6).double() @ w.double().t()).to(torch.int32)
    spec = ce.spec_for(kind)
    assert torch.equal(ce.epilogue_reference(acc, spec, alpha, bias), ce.unfused_reference(acc, spec, alpha, bias))


@pytest.mark.parametrize("gelu_kind", ce.GELU_KINDS)
def test_int8_gelu_epilogue_rounding_difference(gelu_kind):
    """INT8 codes of GELU written by the first FFN GEMM vs the unfused path (FP16 GEMM output, exact GELU, division
    by the scale). The arithmetic models differ (no FP16 rounding before GELU, maybe tanh GELU, multiplication by
    1 / s): codes differ by at most one step, on a small share of elements. This bounds the model on the CPU;
    the GPU test measures the library."""
    n, k, t = 512, 384, 256
    w, alpha, bias = _weights(n, k, seed=7)
    alpha = alpha * 2.0
    acc = (_codes(t, k, seed=8).double() @ w.double().t()).to(torch.int32)
    spec = ce.spec_for("ffn_in", next_scale=NEXT_SCALE)
    fused = ce.epilogue_reference(acc, spec, alpha, bias, gelu_kind=gelu_kind).int()
    ref = ce.unfused_reference(acc, spec, alpha, bias).int()
    diff = (fused - ref).abs()
    share = (diff > 0).float().mean().item()
    assert diff.max().item() <= 1
    assert share < (0.01 if gelu_kind == "erf" else 0.05), share
    assert ref.abs().max().item() > 60  # the codes span most of the range, not a degenerate test


def test_quantlinear_cslt_fused_matches_the_reference_kernel():
    """QuantLinear(kernel='cslt_fused') through the stand-in equals the exact reference kernel in FP16 (bias exact
    in FP16); after emit_codes, its codes equal the fused epilogue's model."""
    n, k, t = 64, 128, 20
    w, _, bias = _weights(n, k, seed=11)
    scales = torch.rand(n, generator=torch.Generator().manual_seed(2)) * 0.01 + 0.001
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(3))
    with ce.use_api(cslt.CsltSim()):
        fused = QuantLinear(w, scales, 0.02, bias, kernel="cslt_fused", dtype=torch.float16)
        ref = QuantLinear(w, scales, 0.02, bias, kernel="reference", dtype=torch.float16)
        assert fused.padded_rows(t) == 32
        assert torch.equal(fused(x), ref(x))
        fused.emit_codes(NEXT_SCALE)
        xq = fused.input_codes(x)
        codes = fused.codes_from_codes(xq)
    acc = (xq.double() @ w.double().t()).to(torch.int32)
    spec = ce.spec_for("ffn_in", next_scale=NEXT_SCALE)
    assert torch.equal(codes, ce.epilogue_reference(acc, spec, fused.alpha, fused.bias32))
    with pytest.raises(RuntimeError, match="codes_from_codes"):
        fused.from_codes(xq, t)


def test_spec_validation():
    with pytest.raises(ValueError, match="next_scale"):
        ce.EpilogueSpec(out="int8")
    with pytest.raises(ValueError, match="positive"):
        ce.EpilogueSpec(out="int8", next_scale=0.0)
    with pytest.raises(ValueError, match="Linear kind"):
        ce.spec_for("pooler")
    assert ce.spec_for("ffn_in") == ce.EpilogueSpec(out="fp16")  # no next scale: FP16 out, no GELU
