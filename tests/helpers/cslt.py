"""cusparseLt.h facts and a CPU stand-in for the cuSPARSELt library, for testing cslt_epilogue without a GPU.

`parse_header` reads enum values and opaque-struct sizes from cusparseLt.h (and the enums its cuSPARSE stub
declares). `HEADER_FACTS` is the committed result of that parse for the pinned library version, with the
header's checksum; tests compare it with the header wherever one is installed.

`CsltSim` has the function names and signatures of `nvmath.bindings.cusparseLt`. It validates every call
against the header's enums, the documented attribute types and a valid call order (descriptors, then the
matmul descriptor, its attributes, algorithm selection, plan, workspace, matmul), and it computes the GEMM
on the CPU from the raw pointers it is given, reading each operand through its descriptor (rows, columns,
leading dimension, order, op), so a wrong layout gives wrong numbers. Its epilogue is the documented one:
alpha (scalar or per row of D) x accumulator + bias per row of D, then the activation, then conversion.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

FACTS_PATH = Path(__file__).resolve().parents[1] / "fixtures" / "cusparselt" / "cusparselt-0.10.0-header-facts.json"
HEADER_FACTS = json.loads(FACTS_PATH.read_text(encoding="utf-8"))


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def parse_header(text: str) -> dict:
    """{"enums": {type: {name: value}}, "structs": {type: bytes}, "functions": [names]} of a C header."""
    text = _strip_comments(text)
    enums: dict[str, dict[str, int]] = {}
    for body, name in re.findall(r"typedef\s+enum\s*\{(.*?)\}\s*(\w+)\s*;", text, flags=re.S):
        values, nxt = {}, 0
        for item in (i.strip() for i in body.split(",")):
            if not item:
                continue
            key, _, val = (p.strip() for p in item.partition("="))
            nxt = int(val, 0) if val else nxt
            values[key] = nxt
            nxt += 1
        enums[name] = values
    structs = {name: int(size) for size, name in
               re.findall(r"typedef\s+struct\s*\{\s*alignas\(16\)\s*uint8_t\s+data\[(\d+)\];\s*\}\s*(\w+)\s*;", text)}
    functions = sorted(set(re.findall(r"\b(cusparseLt\w+)\s*\(", text)))
    return {"enums": enums, "structs": structs, "functions": functions}


def find_header() -> Path | None:
    """cusparseLt.h: $HOLOSERVE_CUSPARSELT_HEADER, else the nvidia-cusparselt wheel's include/ in site-packages."""
    env = os.environ.get("HOLOSERVE_CUSPARSELT_HEADER")
    if env:
        return Path(env)
    import site
    import sys

    for base in [*site.getsitepackages(), site.getusersitepackages(), *sys.path]:
        for cand in sorted(Path(base).glob("nvidia/*/include/cusparseLt.h")) + sorted(
                Path(base).glob("nvidia/cusparselt/include/cusparseLt.h")):
            if cand.is_file():
                return cand
    return None


def header_facts(header: Path) -> dict:
    """parse_header of cusparseLt.h merged with its cuSPARSE stub (which declares the order/operation enums)."""
    facts = parse_header(header.read_text(encoding="utf-8"))
    stub = header.with_name("cusparseLt_cusparse_stub.h")
    if stub.is_file():
        facts["enums"].update(parse_header(stub.read_text(encoding="utf-8"))["enums"])
    facts["sha256"] = hashlib.sha256(header.read_bytes()).hexdigest()
    ver = dict(re.findall(r"#define\s+CUSPARSELT_VER_(MAJOR|MINOR|PATCH)\s+(\d+)", header.read_text(encoding="utf-8")))
    facts["version"] = f"{ver.get('MAJOR')}.{ver.get('MINOR')}.{ver.get('PATCH')}"
    return facts


# -- the library stand-in -------------------------------------------------------------------------------------

E = HEADER_FACTS["enums"]
MATMUL_ATTRS = E["cusparseLtMatmulDescAttribute_t"]
ALG_ATTRS = E["cusparseLtMatmulAlgAttribute_t"]
# the C type of each attribute's value (cuSPARSELt's documentation; nvmath's get_*_attribute_dtype agree)
MATMUL_ATTR_DTYPES = {
    "CUSPARSELT_MATMUL_ACTIVATION_RELU": np.int32, "CUSPARSELT_MATMUL_ACTIVATION_RELU_UPPERBOUND": np.float32,
    "CUSPARSELT_MATMUL_ACTIVATION_RELU_THRESHOLD": np.float32, "CUSPARSELT_MATMUL_ACTIVATION_GELU": np.int32,
    "CUSPARSELT_MATMUL_ACTIVATION_GELU_SCALING": np.float32, "CUSPARSELT_MATMUL_ALPHA_VECTOR_SCALING": np.int32,
    "CUSPARSELT_MATMUL_BETA_VECTOR_SCALING": np.int32, "CUSPARSELT_MATMUL_BIAS_STRIDE": np.int64,
    "CUSPARSELT_MATMUL_BIAS_POINTER": np.int64, "CUSPARSELT_MATMUL_SPARSE_MAT_POINTER": np.int64,
}
ALG_ATTR_DTYPES = {"CUSPARSELT_MATMUL_ALG_CONFIG_ID": np.int32, "CUSPARSELT_MATMUL_ALG_CONFIG_MAX_ID": np.int32,
                   "CUSPARSELT_MATMUL_SEARCH_ITERATIONS": np.int32, "CUSPARSELT_MATMUL_SPLIT_K": np.int32}
# cudaDataType (library_types.h, not in the cuSPARSELt wheel; tests check them against cuda-bindings)
DATA_TYPES = {0: np.float32, 2: np.float16, 3: np.int8, 10: np.int32, 14: "bf16"}
ORDERS = set(E["cusparseOrder_t"].values())
OPS = set(E["cusparseOperation_t"].values())
SEARCHED_ALG = 3  # what the stand-in's search "finds"


class SimError(AssertionError):
    pass


def _check(cond, msg):
    if not cond:
        raise SimError(msg)


def _np_dtype(dt):
    return np.uint16 if dt == "bf16" else dt


def _read(ptr: int, count: int, dtype) -> np.ndarray:
    dt = np.dtype(_np_dtype(dtype))
    return np.frombuffer((ctypes.c_byte * (count * dt.itemsize)).from_address(ptr), dtype=dt).copy()


def _write(ptr: int, arr: np.ndarray) -> None:
    ctypes.memmove(ptr, np.ascontiguousarray(arr).ctypes.data, arr.nbytes)


class CsltSim:
    """nvmath.bindings.cusparseLt's functions, checked and computed on the CPU (see the module docstring).

    gelu_kind ("erf"/"tanh") and scale_gelu_input say how the stand-in models the library's GELU and
    GELU_SCALING; `calls` records (function name, arguments) in order."""

    def __init__(self, gelu_kind: str = "erf", scale_gelu_input: bool = False, stream: int = 0):
        self.gelu_kind, self.scale_gelu_input, self.stream = gelu_kind, scale_gelu_input, stream
        self.calls: list[tuple[str, tuple]] = []
        self.objs: dict[int, dict] = {}
        self._next = 1000

    def _new(self, **obj) -> int:
        self._next += 16
        self.objs[self._next] = obj
        return self._next

    def _get(self, key, kind):
        _check(key in self.objs and self.objs[key]["kind"] == kind, f"{key} is not a live {kind}")
        return self.objs[key]

    def init(self):
        self.calls.append(("init", ()))
        return self._new(kind="handle")

    def _mat(self, h, rows, cols, ld, alignment, value_type, order, structured):
        self._get(h, "handle")
        _check(value_type in DATA_TYPES, f"unknown cudaDataType {value_type}")
        _check(order in ORDERS, f"unknown cusparseOrder_t {order}")
        _check(alignment % 16 == 0 and rows > 0 and cols > 0, "bad alignment or shape")
        _check(ld >= (cols if order == E["cusparseOrder_t"]["CUSPARSE_ORDER_ROW"] else rows),
               f"leading dimension {ld} too small for {rows}x{cols} order {order}")
        return self._new(kind="mat", rows=rows, cols=cols, ld=ld, type=value_type, order=order, structured=structured)

    def structured_descriptor_init(self, h, rows, cols, ld, alignment, value_type, order, sparsity):
        self.calls.append(("structured_descriptor_init", (rows, cols, ld, alignment, value_type, order, sparsity)))
        _check(sparsity in E["cusparseLtSparsity_t"].values(), f"unknown sparsity {sparsity}")
        return self._mat(h, rows, cols, ld, alignment, value_type, order, True)

    def dense_descriptor_init(self, h, rows, cols, ld, alignment, value_type, order):
        self.calls.append(("dense_descriptor_init", (rows, cols, ld, alignment, value_type, order)))
        return self._mat(h, rows, cols, ld, alignment, value_type, order, False)

    def _matrix(self, desc, ptr) -> np.ndarray:
        """The logical rows x cols matrix a descriptor describes at ptr."""
        row = desc["order"] == E["cusparseOrder_t"]["CUSPARSE_ORDER_ROW"]
        outer, inner = (desc["rows"], desc["cols"]) if row else (desc["cols"], desc["rows"])
        flat = _read(ptr, (outer - 1) * desc["ld"] + inner, DATA_TYPES[desc["type"]])
        m = np.stack([flat[i * desc["ld"]: i * desc["ld"] + inner] for i in range(outer)])
        return m if row else m.T

    def sp_mma_compressed_size2(self, h, desc):
        self.calls.append(("sp_mma_compressed_size2", (desc,)))
        d = self._get(desc, "mat")
        _check(d["structured"], "compressed size of a dense descriptor")
        return d["rows"] * d["cols"], 64  # the stand-in's "compressed" form is the dense matrix, row-major

    def sp_mma_compress2(self, h, desc, is_sparse_a, op, d_dense, d_compressed, d_buffer, stream):
        self.calls.append(("sp_mma_compress2", (desc, is_sparse_a, op, stream)))
        d = self._get(desc, "mat")
        _check(d["structured"] and is_sparse_a == 1 and op in OPS, "compress2: structured A, a valid op")
        _check(stream == self.stream, f"compress2 on stream {stream}, expected {self.stream}")
        m = self._matrix(d, d_dense)
        _check(((m.reshape(m.shape[0], -1, 4) != 0).sum(-1) <= 2).all(), "compress2: the matrix is not 2:4")
        d["compressed_at"] = d_compressed
        _write(d_compressed, np.ascontiguousarray(m))

    def matmul_descriptor_init(self, h, op_a, op_b, a, b, c, d, compute_type):
        self.calls.append(("matmul_descriptor_init", (op_a, op_b, a, b, c, d, compute_type)))
        da, db, dc, dd = (self._get(x, "mat") for x in (a, b, c, d))
        _check(op_a in OPS and op_b in OPS, f"unknown operation {op_a}, {op_b}")
        _check(compute_type in E["cusparseComputeType"].values(), f"unknown compute type {compute_type}")
        _check(da["structured"] and not db["structured"], "A must be the structured operand")
        _check(compute_type != E["cusparseComputeType"]["CUSPARSE_COMPUTE_32I"] or (da["type"] == db["type"] == 3),
               "COMPUTE_32I takes int8 A and B")
        ma, ka = (da["rows"], da["cols"]) if op_a == 0 else (da["cols"], da["rows"])
        kb, nb = (db["rows"], db["cols"]) if op_b == 0 else (db["cols"], db["rows"])
        _check(ka == kb and (dc["rows"], dc["cols"]) == (ma, nb) == (dd["rows"], dd["cols"]),
               f"shapes: op(A) {ma}x{ka}, op(B) {kb}x{nb}, C {dc['rows']}x{dc['cols']}, D {dd['rows']}x{dd['cols']}")
        return self._new(kind="matmul", op_a=op_a, op_b=op_b, a=a, b=b, c=c, d=d, attrs={}, planned=False)

    def matmul_desc_set_attribute(self, h, mm, attr, data, size):
        m = self._get(mm, "matmul")
        names = {v: k for k, v in MATMUL_ATTRS.items()}
        _check(attr in names, f"unknown cusparseLtMatmulDescAttribute_t {attr}")
        _check(not m["planned"], f"{names[attr]} set after the plan was made: the plan would not see it")
        dt = MATMUL_ATTR_DTYPES.get(names[attr])
        _check(dt is not None, f"the stand-in does not model {names[attr]}")
        _check(size == np.dtype(dt).itemsize, f"{names[attr]} takes {np.dtype(dt).name}, got {size} bytes")
        value = _read(data, 1, dt)[0].item()
        m["attrs"][names[attr]] = value
        self.calls.append(("matmul_desc_set_attribute", (names[attr], value)))

    def matmul_alg_selection_init(self, h, mm, alg):
        self.calls.append(("matmul_alg_selection_init", (mm, alg)))
        self._get(mm, "matmul")
        _check(alg in E["cusparseLtMatmulAlg_t"].values(), f"unknown algorithm {alg}")
        return self._new(kind="alg", matmul=mm, attrs={"CUSPARSELT_MATMUL_ALG_CONFIG_ID": 0})

    def _alg_attr(self, alg_sel, attr, size):
        a = self._get(alg_sel, "alg")
        names = {v: k for k, v in ALG_ATTRS.items()}
        _check(attr in names and names[attr] in ALG_ATTR_DTYPES, f"unknown or unmodelled alg attribute {attr}")
        _check(size == np.dtype(ALG_ATTR_DTYPES[names[attr]]).itemsize, f"{names[attr]}: {size} bytes")
        return a, names[attr]

    def matmul_alg_set_attribute(self, h, alg_sel, attr, data, size):
        a, name = self._alg_attr(alg_sel, attr, size)
        a["attrs"][name] = _read(data, 1, ALG_ATTR_DTYPES[name])[0].item()
        self.calls.append(("matmul_alg_set_attribute", (name, a["attrs"][name])))

    def matmul_alg_get_attribute(self, h, alg_sel, attr, data, size):
        a, name = self._alg_attr(alg_sel, attr, size)
        self.calls.append(("matmul_alg_get_attribute", (name,)))
        _write(data, np.array([a["attrs"].get(name, 0)], dtype=ALG_ATTR_DTYPES[name]))

    def matmul_plan_init(self, h, mm, alg_sel):
        self.calls.append(("matmul_plan_init", (mm, alg_sel)))
        m = self._get(mm, "matmul")
        _check(self._get(alg_sel, "alg")["matmul"] == mm, "the algorithm selection belongs to another matmul")
        m["planned"] = True
        return self._new(kind="plan", matmul=mm, attrs=dict(m["attrs"]), alg=alg_sel)

    def matmul_plan_destroy(self, plan):
        self.calls.append(("matmul_plan_destroy", (plan,)))
        self._get(plan, "plan")
        del self.objs[plan]

    def matmul_get_workspace(self, h, plan):
        self.calls.append(("matmul_get_workspace", (plan,)))
        self._get(plan, "plan")
        return 256

    def matmul_search(self, *args):
        self.matmul(*args, _name="matmul_search")
        alg = self._get(self._get(args[1], "plan")["alg"], "alg")
        alg["attrs"]["CUSPARSELT_MATMUL_ALG_CONFIG_ID"] = SEARCHED_ALG

    def matmul(self, h, plan, alpha, d_a, d_b, beta, d_c, d_d, workspace, streams, num_streams, _name="matmul"):
        p = self._get(plan, "plan")
        m = self._get(p["matmul"], "matmul")
        self.calls.append((_name, (plan,)))
        _check(num_streams == 1 and int(_read(streams, 1, np.int64)[0]) == self.stream, "stream array")
        da, db, dd = (self.objs[m[k]] for k in ("a", "b", "d"))
        _check(da.get("compressed_at") == d_a, "A is not the buffer compress2 wrote")
        a = _read(d_a, da["rows"] * da["cols"], np.int8).reshape(da["rows"], da["cols"]).astype(np.int64)
        a = a if m["op_a"] == 0 else a.T
        b = self._matrix(db, d_b).astype(np.int64)
        b = b if m["op_b"] == 0 else b.T
        acc = torch.from_numpy(a @ b)  # [rows of D, cols of D], exact
        attrs = p["attrs"]
        rows = dd["rows"]
        al = _read(alpha, rows if attrs.get("CUSPARSELT_MATMUL_ALPHA_VECTOR_SCALING") else 1, np.float32)
        _check(float(_read(beta, 1, np.float32)[0]) == 0.0, "the stand-in models beta = 0 only")
        v = acc.float() * torch.from_numpy(al).reshape(-1, 1)
        if attrs.get("CUSPARSELT_MATMUL_BIAS_POINTER"):
            btype = 0 if dd["type"] in (3, 10) else dd["type"]  # fp32 bias for int outputs, else D's type
            bias = _read(attrs["CUSPARSELT_MATMUL_BIAS_POINTER"], rows, DATA_TYPES[btype])
            bias_t = torch.from_numpy(bias.astype(np.int32) << 16).view(torch.float32) if btype == 14 \
                else torch.from_numpy(bias).float()
            v = v + bias_t.reshape(-1, 1)
        if attrs.get("CUSPARSELT_MATMUL_ACTIVATION_GELU") or "CUSPARSELT_MATMUL_ACTIVATION_GELU_SCALING" in attrs:
            s = attrs.get("CUSPARSELT_MATMUL_ACTIVATION_GELU_SCALING", 1.0)
            approx = "tanh" if self.gelu_kind == "tanh" else "none"
            v = F.gelu(v * s, approximate=approx) if self.scale_gelu_input else F.gelu(v, approximate=approx) * s
        out = {3: lambda t: torch.clamp(torch.round(t), -128, 127).to(torch.int8), 2: lambda t: t.half(),
               14: lambda t: t.bfloat16().view(torch.int16), 10: lambda t: t.round().to(torch.int32)}[dd["type"]](v)
        out = out.numpy()
        row = dd["order"] == E["cusparseOrder_t"]["CUSPARSE_ORDER_ROW"]
        mem = out if row else out.T  # outer x inner
        itemsize = mem.dtype.itemsize
        for i in range(mem.shape[0]):
            _write(d_d + i * dd["ld"] * itemsize, np.ascontiguousarray(mem[i]))
