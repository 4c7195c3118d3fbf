"""Compiled dense peers of the encoder section (bench/gpu/encoder.py), and the engine kinds the report uses.

- transformers' BERT (SDPA attention) through torch.compile, in FP16 on the GPU;
- the same model with its encoder Linears in dense INT8 (per-output-channel weight scales, the
  checkpoint's calibrated per-tensor activation scale as ours uses, torch._int_mm), through torch.compile.

`compiled()` wraps a model builder; the call it builds carries `compile_mode`, which tells the
benchmark loop to time the first call of each batch size (the compilation) apart from the timed calls.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable

# transformers' torch.compile guide: "max-autotune offers the fastest speed, but compilation takes
# longer"; on a GPU it tunes the GEMMs for the shapes seen and runs the graph through CUDA graphs
COMPILE_MODES = ("max-autotune", "reduce-overhead", "max-autotune-no-cudagraphs", "default")
DEFAULT_COMPILE_MODE = "max-autotune"
# calls after the first (compiling) one before timing starts: CUDA-graph trees run a warm-up call,
# then record, then replay, so the run's own warm-up starts on a replaying graph
COMPILE_SETTLE_CALLS = 3


def engine_kind(name: str) -> str:
    """'ours' (this project's 2:4 INT8 engine, any configuration), 'peer-2:4' (another 2:4 engine:
    torchao) or 'dense' (FP16/FP32 or dense INT8: the peers the speed-up is judged against)."""
    if name.startswith("torchao"):
        return "peer-2:4"
    if "(ours" in name or "backend" in name:
        return "ours"
    return "dense"


def int8_linear(linear, act_amax: float):
    """A dense INT8 module in place of `linear` (torch.nn.Linear), with the activation range act_amax."""
    return _int8_linear_class()(linear, act_amax)


@functools.cache
def _int8_linear_class():  # defined on first use: torch is imported lazily, as everywhere in bench/gpu
    import torch

    from holoserve.core.numerics import ACT_QMAX, ACT_QMIN, ACT_SCALE_DIV, WEIGHT_QMAX

    class _Int8Linear(torch.nn.Module):
        """y = (codes_x @ codes_w^T) * (s_x * s_w) + b, codes_x = clamp(round(x / s_x)); s_w per output channel."""

        def __init__(self, linear, act_amax: float):
            super().__init__()
            w = linear.weight.detach().float()
            s_w = (w.abs().amax(dim=1) / WEIGHT_QMAX).clamp(min=1e-12)
            self.s_x = float(act_amax) / ACT_SCALE_DIV
            # [N, K] row-major, passed transposed: _int_mm's B column-major, the faster layout (see the peak section)
            self.register_buffer("codes", torch.clamp(torch.round(w / s_w[:, None]), -WEIGHT_QMAX, WEIGHT_QMAX)
                                 .to(torch.int8))
            self.register_buffer("scale", s_w * self.s_x)
            self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

        def forward(self, x):
            x2 = x.reshape(-1, x.shape[-1])
            q = torch.clamp(torch.round(x2 / self.s_x), ACT_QMIN, ACT_QMAX).to(torch.int8)
            y = (torch._int_mm(q, self.codes.t()) * self.scale).to(x.dtype)  # int32 * fp32 scale: the dequantization
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*x.shape[:-1], y.shape[-1])

    return _Int8Linear


def int8_dense(model, layers, act_amax: dict[str, float]):
    """`model` with each named Linear replaced by a dense INT8 one (in place; returns the model)."""
    from holoserve.core.artifact import act_key

    for name in layers:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, int8_linear(getattr(owner, child), act_amax[act_key(name)]))
    return model


def _configure_compiler() -> None:
    import torch

    cfg = torch._dynamo.config
    # one graph per batch size (dynamic=False); past the limit (8 per code object by default) dynamo
    # falls back to eager without an error, which would time the eager model under a compiled name
    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, key):
            setattr(cfg, key, max(getattr(cfg, key), 64))


def compiled(make_model: Callable[[], Any], mode: str, skipped: str | None = None) -> Callable[[], Callable]:
    """Builder of `make_model()` through torch.compile; the call takes the tokenizer's dict, returns logits.
    With `skipped` (the reason), the builder carries it and the benchmark records the peer as skipped."""
    def build():
        import torch

        _configure_compiler()
        model = make_model()
        # dynamic=False: one graph per batch size, as a serving bucket holds it; CUDA graphs are per
        # shape anyway, and max-autotune tunes each GEMM for its concrete shape
        cm = torch.compile(model, mode=mode, dynamic=False)

        def call(inp):
            torch.compiler.cudagraph_mark_step_begin()  # a new step: the last call's outputs may be overwritten
            return cm(**inp).logits
        call.compile_mode = mode
        return call
    build.skipped = skipped
    return build


def dynamo_counts() -> dict[str, int]:
    """Graphs compiled, graph breaks met, and graphs Inductor left out of CUDA graphs (its reason is in
    the log) so far in this process (torch._dynamo's counters)."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "cudagraph_skips": int(counters["inductor"].get("cudagraph_skips", 0))}


def first_calls(fn: Callable[[int], Any], sync: Callable[[], None]) -> dict[str, Any]:
    """Compile: time fn(0) (tracing, compiling, autotuning and the first run), then settle CUDA-graph trees.
    Returns compile_s, and the dynamo_counts() of the way (0 graph breaks: one whole graph; CUDA-graph
    skips: the compiled mode's CUDA graphs were not used)."""
    before = dynamo_counts()
    sync()
    t = time.perf_counter()
    fn(0)
    sync()
    compile_s = time.perf_counter() - t
    for i in range(COMPILE_SETTLE_CALLS):
        fn(1 + i)
    after = dynamo_counts()
    return {"compile_s": round(compile_s, 2), **{k: after[k] - before[k] for k in after}}


def reset() -> None:
    """Drop every compiled graph (and its CUDA-graph pool) before the next peer."""
    import torch

    torch._dynamo.reset()
