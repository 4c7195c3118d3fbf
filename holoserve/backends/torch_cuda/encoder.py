"""The encoder: BertForSequenceClassification's inference forward, built from a checkpoint.

A small BERT written here rather than the transformers module: its forward has no data-dependent
branches (which CUDA graph capture forbids) and Q/K/V share one GEMM when their activation ranges
agree (they quantize the same tensor). Every encoder Linear is a layers.QuantLinear (INT8 scales
and an activation range) or a layers.DenseLinear; embeddings, LayerNorm, attention, GELU, pooler
and classifier run in the float dtype. With the Triton quantizer, residual add + LayerNorm and GELU
are fused with the next GEMM's quantizer (kernels.py) where the device probe allowed it.

Numerics follow compress/quant.py (activations) and compress/project.py (weights): the saved
weights are exactly int8 codes x per-channel scale, so the codes are recovered without loss.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping

import numpy as np

from holoserve import HoloServeError
from holoserve.core.artifact import Artifact, act_key
from holoserve.core.numerics import ACT_SCALE_DIV

from ._torch import F, Module, torch, torch_or_raise
from .kernels import activation_code_table, add_layer_norm_quant, quantize_activation_triton, quantize_by_table
from .layers import DenseLinear, QuantLinear, Tuning
from .numerics import weight_codes

SUPPORTED_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


@dataclass
class BertShape:
    hidden: int
    heads: int
    layers: int
    intermediate: int
    act: str
    eps: float
    vocab: int
    max_positions: int
    type_vocab: int
    num_labels: int

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "BertShape":
        if cfg.get("model_type", "bert") != "bert":
            raise HoloServeError(
                f"backend 'torch-cuda' runs BERT models only; this checkpoint is {cfg.get('model_type')!r}: "
                "use --backend onnxruntime"
            )
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise HoloServeError("backend 'torch-cuda' supports absolute position embeddings only")
        act = cfg.get("hidden_act", "gelu")
        if act not in SUPPORTED_ACTS:
            raise HoloServeError(f"backend 'torch-cuda' does not implement hidden_act={act!r}")
        labels = cfg.get("id2label") or {}
        return cls(
            hidden=int(cfg["hidden_size"]), heads=int(cfg["num_attention_heads"]),
            layers=int(cfg["num_hidden_layers"]), intermediate=int(cfg["intermediate_size"]), act=act,
            eps=float(cfg.get("layer_norm_eps", 1e-12)), vocab=int(cfg["vocab_size"]),
            max_positions=int(cfg.get("max_position_embeddings", 512)), type_vocab=int(cfg.get("type_vocab_size", 2)),
            num_labels=int(cfg.get("num_labels", len(labels) or 2)),
        )


# activations that cuSPARSELt's GELU epilogue stands in for (exact or tanh GELU; the difference is measured by
# tests/gpu/test_cslt_epilogue.py)
GEMM_GELU_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh")


def _act(name: str):
    if name == "relu":
        return F.relu
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    return F.gelu


class Encoder(Module):  # type: ignore[misc]
    """BertForSequenceClassification's inference forward with pluggable Linear kernels."""

    def __init__(self, shape: BertShape, state: Mapping[str, "torch.Tensor"], linears: Mapping[str, Any], *,
                 dtype, device, prefix: str = "bert."):
        super().__init__()
        self.shape = shape
        self.dtype = dtype
        self.act = _act(shape.act)
        self.gelu_quant = False  # fused GELU + quantize before the FFN's second GEMM (Triton quantizer only)
        self.code_tables = False  # ... done as a lookup of each FP16 value's code instead (use_code_tables)
        self.ln_quant = False  # residual add + LayerNorm + next quantizer fused (Triton; see _forward_fused)
        p = prefix

        def t(name):
            return state[name].to(device=device, dtype=dtype)

        self.register_buffer("word_emb", t(f"{p}embeddings.word_embeddings.weight"))
        self.register_buffer("pos_emb", t(f"{p}embeddings.position_embeddings.weight"))
        self.register_buffer("type_emb", t(f"{p}embeddings.token_type_embeddings.weight"))
        self.emb_ln = (t(f"{p}embeddings.LayerNorm.weight"), t(f"{p}embeddings.LayerNorm.bias"))
        self.layers = torch.nn.ModuleList()
        self.lns: list[tuple] = []
        for i in range(shape.layers):
            lp = f"{p}encoder.layer.{i}."
            block = torch.nn.ModuleDict({
                "qkv": linears[f"{lp}attention.self.qkv"], "out": linears[f"{lp}attention.output.dense"],
                "ffn_in": linears[f"{lp}intermediate.dense"], "ffn_out": linears[f"{lp}output.dense"],
            })
            self.layers.append(block)
            self.lns.append(((t(f"{lp}attention.output.LayerNorm.weight"), t(f"{lp}attention.output.LayerNorm.bias")),
                             (t(f"{lp}output.LayerNorm.weight"), t(f"{lp}output.LayerNorm.bias"))))
        self.pooler = ((t(f"{p}pooler.dense.weight"), t(f"{p}pooler.dense.bias"))
                       if f"{p}pooler.dense.weight" in state else None)
        self.classifier = (t("classifier.weight"), t("classifier.bias"))

    def use_code_tables(self, on: bool = True) -> None:
        """Quantize the FFN activation (GELU or any other) for the second GEMM by a table of the code of
        every FP16 value, built here once per layer with the torch reference (kernels.activation_code_table:
        64 KiB each), instead of the fused erf kernel. The codes are the reference's exactly; whether the
        gather is faster than the erf is the GPU's to tell (bench/gpu/run.py times both). FP16 and the
        Triton quantizer only; `on=False` goes back to the fused kernel."""
        if on and (self.dtype != torch.float16 or not all(
                isinstance(b["ffn_out"], QuantLinear) and b["ffn_out"].quantizer == "triton" for b in self.layers)):
            raise ValueError("code tables need an FP16 encoder whose FFN output Linears use the Triton quantizer")
        for block in self.layers:
            lin = block["ffn_out"]
            if on and getattr(lin, "code_table", None) is None:
                lin.register_buffer("code_table", activation_code_table(self.act, lin.act_scale))
        if on and not self.code_tables:
            self._gelu_quant_without_tables = self.gelu_quant
            self.gelu_quant = True  # the activation is fused into the quantizer, whatever it is
        elif not on and self.code_tables:
            self.gelu_quant = self._gelu_quant_without_tables
        self.code_tables = bool(on)

    def _ffn_codes(self, ffn_out, inter, rows: int):
        """The FFN's second GEMM's input codes from its first GEMM's FP16 output, activation fused."""
        if self.code_tables:
            return quantize_by_table(inter, ffn_out.code_table, rows=rows)
        return quantize_activation_triton(inter, ffn_out.act_scale, rows=rows, gelu=True)

    def _fusable(self) -> bool:
        def tq(mod):
            return isinstance(mod, QuantLinear) and mod.quantizer == "triton"

        return all(len(blk["qkv"].parts) == 1 and tq(blk["qkv"].parts[0]) and tq(blk["out"]) and tq(blk["ffn_in"])
                   and tq(blk["ffn_out"]) for blk in self.layers)

    def forward(self, input_ids, attention_mask, token_type_ids):
        if self.ln_quant:
            return self._forward_fused(input_ids, attention_mask, token_type_ids)
        s = self.shape
        b, n = input_ids.shape
        pos = torch.arange(n, device=input_ids.device)
        h = self.word_emb[input_ids] + self.pos_emb[pos].unsqueeze(0) + self.type_emb[token_type_ids]
        h = F.layer_norm(h, (s.hidden,), *self.emb_ln, s.eps)
        # additive mask: 0 where attended, the dtype's most negative value where padded
        mask = (1.0 - attention_mask[:, None, None, :].to(self.dtype)) * torch.finfo(self.dtype).min
        d = s.hidden // s.heads
        for block, (ln1, ln2) in zip(self.layers, self.lns):
            qkv = block["qkv"](h)
            q, k, v = qkv.view(b, n, 3, s.heads, d).permute(2, 0, 3, 1, 4).unbind(0)
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            ctx = ctx.transpose(1, 2).reshape(b, n, s.hidden)
            h = F.layer_norm(block["out"](ctx) + h, (s.hidden,), *ln1, s.eps)
            ffn_in, ffn_out = block["ffn_in"], block["ffn_out"]
            if getattr(ffn_in, "emits_codes", False):  # GELU and the quantizer in the first GEMM's epilogue
                xq = ffn_in.codes_from_codes(ffn_in.input_codes(h.reshape(b * n, -1)))
                out = ffn_out.from_codes(xq, b * n).reshape(b, n, -1)
            elif self.gelu_quant and isinstance(ffn_out, QuantLinear) and ffn_out.quantizer == "triton":
                y = block["ffn_in"](h).reshape(b * n, -1)
                xq = self._ffn_codes(ffn_out, y, ffn_out.padded_rows(b * n))
                out = ffn_out.from_codes(xq, b * n).reshape(b, n, -1)
            else:
                out = ffn_out(self.act(block["ffn_in"](h)))
            h = F.layer_norm(out + h, (s.hidden,), *ln2, s.eps)
        cls = h[:, 0]
        if self.pooler is not None:
            cls = torch.tanh(F.linear(cls, *self.pooler))
        return F.linear(cls, *self.classifier).float()

    def _forward_fused(self, input_ids, attention_mask, token_type_ids):
        """The same forward with every LayerNorm fused with the residual add and the next GEMM's
        quantizer, and GELU fused with the FFN's second quantizer (Triton kernels)."""
        s = self.shape
        b, n = input_ids.shape
        t = b * n
        pos = torch.arange(n, device=input_ids.device)
        emb = self.word_emb[input_ids] + self.pos_emb[pos].unsqueeze(0) + self.type_emb[token_type_ids]
        first = self.layers[0]["qkv"].parts[0]
        h, hq = add_layer_norm_quant(emb, None, *self.emb_ln, s.eps, scale=first.act_scale, rows=first.padded_rows(t))
        mask = (1.0 - attention_mask[:, None, None, :].to(self.dtype)) * torch.finfo(self.dtype).min
        d = s.hidden // s.heads
        for i, (block, (ln1, ln2)) in enumerate(zip(self.layers, self.lns)):
            qkv = block["qkv"].parts[0].from_codes(hq, t)
            q, k, v = qkv.view(b, n, 3, s.heads, d).permute(2, 0, 3, 1, 4).unbind(0)
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            y = block["out"](ctx.transpose(1, 2).reshape(t, s.hidden))
            ffn_in, ffn_out = block["ffn_in"], block["ffn_out"]
            h, hq = add_layer_norm_quant(y, h, *ln1, s.eps, scale=ffn_in.act_scale, rows=ffn_in.padded_rows(t))
            if getattr(ffn_in, "emits_codes", False):  # GELU and the quantizer in the first GEMM's epilogue
                xq = ffn_in.codes_from_codes(hq)
            elif self.gelu_quant:
                inter = ffn_in.from_codes(hq, t)
                xq = self._ffn_codes(ffn_out, inter, ffn_out.padded_rows(t))
            else:
                inter = ffn_in.from_codes(hq, t)
                xq = quantize_activation_triton(self.act(inter), ffn_out.act_scale, rows=ffn_out.padded_rows(t))
            y = ffn_out.from_codes(xq, t)
            nxt = self.layers[i + 1]["qkv"].parts[0] if i + 1 < len(self.layers) else None
            h, hq = add_layer_norm_quant(y, h, *ln2, s.eps, scale=nxt.act_scale if nxt is not None else None,
                                         rows=nxt.padded_rows(t) if nxt is not None else None)
        cls = h.view(b, n, s.hidden)[:, 0]
        if self.pooler is not None:
            cls = torch.tanh(F.linear(cls, *self.pooler))
        return F.linear(cls, *self.classifier).float()


class _FusedQKV(Module):  # type: ignore[misc]
    """Three Linears of one input run as one GEMM when they share an activation scale, else three."""

    def __init__(self, parts):
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)

    def forward(self, x):
        if len(self.parts) == 1:
            return self.parts[0](x)
        return torch.cat([p(x) for p in self.parts], dim=-1)


@dataclass(frozen=True)
class LinearOptions:
    """What every Linear of an encoder is built with."""

    kernel: str = "cslt"  # every quantized layer's kernel (layers.KERNELS); "dense": float Linears throughout
    dtype: Any = None  # the float dtype; None: torch.float16
    device: Any = "cpu"
    tuning: Tuning = Tuning()


@dataclass(frozen=True)
class CheckpointQuant:
    """A checkpoint's quantization: INT8 weight scales and activation ranges by layer, and its 2:4 layers."""

    weight_scales: Mapping[str, Any] | None = None
    act_amax: Mapping[str, float] | None = None
    sparse_layers: Iterable[str] = ()


@dataclass(frozen=True)
class Fusion:
    """Which operations the encoder fuses; each fusion needs the Triton quantizer except `qkv`."""

    qkv: bool = True  # Q, K and V as one GEMM where their activation ranges agree
    gelu_quant: bool = False  # exact GELU + the FFN output's quantizer in one kernel
    ln_quant: bool = False  # residual add + LayerNorm + the next quantizer in one kernel
    # kernel "cslt_fused": the FFN's first GEMM applies GELU and the second GEMM's quantizer in its epilogue
    gemm_codes: bool = True


def make_linear(weight, bias, *, scales=None, act_amax: float | None = None, sparse: bool = False,
                linear: LinearOptions = LinearOptions()):
    """One Linear of the encoder. Quantized layers (scales and an activation range) use `linear.kernel`;
    with kernel="cslt" a quantized layer that is not 2:4 falls back to dense INT8 (`int_mm`)."""
    dtype = linear.dtype or torch.float16
    device = linear.device
    if scales is not None:
        scales = torch.as_tensor(np.asarray(scales, dtype=np.float32))
        codes = weight_codes(weight, scales)
        if linear.kernel != "dense" and act_amax is not None:
            k = "int_mm" if (linear.kernel in ("cslt", "cslt_fused") and not sparse) else linear.kernel
            tuning = linear.tuning if k in ("cslt", "cslt_fused", "int_mm", "reference") \
                else replace(linear.tuning, quantizer="torch")
            return QuantLinear(codes.to(device), scales.to(device), float(act_amax) / ACT_SCALE_DIV, bias,
                               kernel=k, dtype=dtype, tuning=tuning)
        weight = codes.float() * scales.reshape(-1, 1)  # the exact dequantized weight
    return DenseLinear(weight.float().to(device), bias, dtype=dtype)


def build_encoder(config: Mapping[str, Any], state: Mapping[str, "torch.Tensor"], quant: CheckpointQuant, *,
                  linear: LinearOptions = LinearOptions(), fusion: Fusion = Fusion()) -> "Encoder":
    """An Encoder for a BERT state dict (transformers names) and the checkpoint's quantization.

    `linear.kernel` is used for every quantized layer (see QuantLinear); layers without INT8 scales and an
    activation range, and every layer with kernel="dense", run as float Linears.
    """
    torch_or_raise()
    linear = replace(linear, dtype=linear.dtype or torch.float16)
    shape = BertShape.from_config(config)
    prefix = "bert." if any(k.startswith("bert.") for k in state) else ""
    weight_scales = dict(quant.weight_scales or {})
    act_amax = dict(quant.act_amax or {})
    sparse = set(quant.sparse_layers)

    def single(name: str):
        return make_linear(state[f"{name}.weight"], state.get(f"{name}.bias"), scales=weight_scales.get(name),
                           act_amax=act_amax.get(act_key(name)), sparse=name in sparse, linear=linear)

    linears: dict[str, Any] = {}
    for i in range(shape.layers):
        lp = f"{prefix}encoder.layer.{i}."
        names = [f"{lp}attention.self.{x}" for x in ("query", "key", "value")]
        amaxes = {act_amax.get(act_key(n)) for n in names}
        quantized = {n in weight_scales for n in names}
        sp = {n in sparse for n in names}
        if fusion.qkv and len(amaxes) == 1 and len(quantized) == 1 and len(sp) == 1:
            # Q, K and V read the same tensor: with one activation scale they are one GEMM.
            w = torch.cat([state[f"{n}.weight"] for n in names])
            b = torch.cat([state[f"{n}.bias"] for n in names])
            scales = np.concatenate([np.asarray(weight_scales[n], dtype=np.float32) for n in names]) \
                if quantized == {True} else None
            qkv = _FusedQKV([make_linear(w, b, scales=scales, act_amax=amaxes.pop(), sparse=sp == {True},
                                         linear=linear)])
        else:
            qkv = _FusedQKV([single(n) for n in names])
        linears[f"{lp}attention.self.qkv"] = qkv
        for n in ("attention.output.dense", "intermediate.dense", "output.dense"):
            linears[lp + n] = single(lp + n)
    enc = Encoder(shape, state, linears, dtype=linear.dtype, device=linear.device, prefix=prefix).eval()
    triton = linear.tuning.quantizer == "triton"
    enc.gelu_quant = bool(fusion.gelu_quant and triton and shape.act == "gelu")
    enc.ln_quant = bool(fusion.ln_quant and triton and enc._fusable())
    if linear.kernel == "cslt_fused" and fusion.gemm_codes and shape.act in GEMM_GELU_ACTS:
        for blk in enc.layers:
            fi, fo = blk["ffn_in"], blk["ffn_out"]
            if all(isinstance(x, QuantLinear) and x.kernel == "cslt_fused" for x in (fi, fo)):
                fi.emit_codes(fo.act_scale, gelu=True)
    return enc


def checkpoint_tensors(art: Artifact) -> tuple[dict[str, Any], dict[str, "torch.Tensor"]]:
    """config.json and model.safetensors of a checkpoint, as (config dict, CPU tensors)."""
    from safetensors.torch import load_file

    config = json.loads((art.path / "config.json").read_text(encoding="utf-8"))
    return config, load_file(str(art.path / "model.safetensors"), device="cpu")


def encoder_from_artifact(art: Artifact, *, linear: LinearOptions = LinearOptions(),
                          fusion: Fusion = Fusion()) -> "Encoder":
    """The Encoder of a checkpoint folder: its weights, INT8 weight scales and activation ranges
    (its sparse layers count as 2:4 only when the checkpoint's pattern is 2:4)."""
    config, state = checkpoint_tensors(art)
    quant = CheckpointQuant(weight_scales=art.all_weight_scales(), act_amax=art.activation_amax(),
                            sparse_layers=art.sparse_layers if art.nm == (2, 4) else ())
    return build_encoder(config, state, quant, linear=linear, fusion=fusion)
