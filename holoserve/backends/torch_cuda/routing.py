"""Per-bucket routing between the 2:4 INT8 GEMMs and dense INT8 GEMMs of the same weights.

A 2:4 GEMM can lose to a dense one at small token counts (few rows: the sparse kernel's tiles are
under-used and its fixed costs dominate). With `route="auto"` the backend builds both from the same
INT8 codes ("cslt": cuSPARSELt, "int_mm": torch._int_mm), times both on the device per token count
at load, and serves every (batch, seq) bucket on the faster one. Both are exact integer GEMMs of
the same codes, so only the epilogue can differ. With `precision="fp32"` both hand the INT32 result to
the same torch ops (numerics.dequantize): bit-identical logits. With FP16, cuSPARSELt scales (and adds
the bias) inside its epilogue and rounds once to FP16, while the dense path computes the same FP32
product and sum with separate torch ops before that rounding (and a "bias after" epilogue adds the bias
in FP16): an output can differ by one FP16 unit in the last place where the value sits on a rounding
boundary, which a later quantizer can turn into one code step. tests/gpu/test_torch_cuda_routing.py
measures both cases.

The key is the token count (batch x padded length): the variants share everything outside the
encoder Linears (embeddings, LayerNorm, attention, the activation quantizers), and a Linear's GEMM has
batch x length rows whatever the split, so buckets with the same token count route alike and are timed
once. Token counts above `max_tokens` are not timed and stay on the 2:4 GEMMs, whose lead grows with the
row count; this bounds the load time, and so does a budget in seconds.

`build_variants` builds both from one read of the checkpoint, the float tensors (embeddings, LayerNorm,
pooler, classifier) held once. The decision (`choose_kernel`, `route_table`) is pure; `measure_routes`
times a GraphRunner's variants with CUDA events (or any timer the caller passes).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping

from holoserve import HoloServeError
from holoserve.core.artifact import Artifact
from holoserve.core.choices import TORCH_CUDA_ROUTES

from .encoder import CheckpointQuant, Encoder, Fusion, LinearOptions, build_encoder, checkpoint_tensors
from .layers import QuantLinear

ROUTES = TORCH_CUDA_ROUTES  # ("auto", "sparse", "dense-int8")
SPARSE, DENSE = "cslt", "int_mm"  # the kernels behind "sparse" and "dense-int8" (layers.KERNELS)
# the dense GEMM must be faster than the 2:4 one by more than this share of the 2:4 time to take a
# bucket: timing noise between two near-equal kernels must not flip routes from one load to the next
ROUTE_MARGIN = 0.05
# token counts (batch x padded length) up to this are timed; above it the 2:4 GEMMs serve untimed
ROUTE_MAX_TOKENS = 4096


@dataclass(frozen=True)
class RouteTiming:
    """How each token count is timed: warm-up calls, then `rounds` alternating blocks of `iters` calls of
    each variant (alternating, so a clock or thermal drift hits both alike); the median call counts.
    Timing stops after `budget_s` seconds, and the token counts not reached stay on the 2:4 GEMMs."""

    warmup: int = 3
    iters: int = 10
    rounds: int = 2
    budget_s: float = 60.0


def check_route(route: str, kernel: str, max_tokens: Any = ROUTE_MAX_TOKENS) -> None:
    """Refuse route settings that cannot work, saying what to write instead."""
    if route not in ROUTES:
        raise HoloServeError(f"route must be one of {ROUTES}, not {route!r} (auto: time both GEMMs per bucket at "
                             "load and serve each on the faster)")
    if route != "auto" and kernel != SPARSE:
        raise HoloServeError(f"route={route!r} chooses between kernel='cslt' and 'int_mm', but kernel={kernel!r} "
                             f"was given: leave kernel at 'cslt' to use route, or drop route to run {kernel!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise HoloServeError(f"route_max_tokens must be a whole number >= 0 (0: time nothing, every bucket on the "
                             f"2:4 GEMMs), not {max_tokens!r}")


def bucket_name(b: int, n: int) -> str:
    return f"{b}x{n}"


def timing_plan(batch_buckets: Iterable[int], seq_buckets: Iterable[int],
                max_tokens: int) -> dict[int, tuple[int, int]]:
    """The bucket each token count up to `max_tokens` is timed at (its smallest batch), smallest count first."""
    plan: dict[int, tuple[int, int]] = {}
    for b in sorted(batch_buckets):
        for n in sorted(seq_buckets):
            t = b * n
            if t <= max_tokens and t not in plan:
                plan[t] = (b, n)
    return dict(sorted(plan.items()))


def choose_kernel(ms: Mapping[str, float | None], margin: float = ROUTE_MARGIN) -> str:
    """SPARSE unless the dense time is below the 2:4 one by more than `margin` of it. A missing or
    unusable time (None, NaN, infinite, not above 0) keeps the 2:4 GEMMs, as does a tie."""
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), not {margin}")

    def ok(v):
        return v is not None and math.isfinite(v) and v > 0

    sparse, dense = ms.get(SPARSE), ms.get(DENSE)
    if ok(sparse) and ok(dense) and dense < sparse * (1 - margin):
        return DENSE
    return SPARSE


def route_table(batch_buckets: Iterable[int], seq_buckets: Iterable[int],
                timings: Mapping[int, Mapping[str, float | None]], margin: float = ROUTE_MARGIN) -> dict[str, str]:
    """The kernel of every (batch, seq) bucket, by name "BxN": the decision for its token count, or SPARSE
    where that count was not timed."""
    decided = {t: choose_kernel(ms, margin) for t, ms in timings.items()}
    return {bucket_name(b, n): decided.get(b * n, SPARSE) for b in sorted(batch_buckets) for n in sorted(seq_buckets)}


def share_float_params(dst: Encoder, src: Encoder) -> None:
    """Make `dst` use `src`'s embedding tables, LayerNorm, pooler and classifier tensors instead of its own
    copies (which are freed): two builds of one checkpoint that differ only in their Linears' kernels."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError("share_float_params needs two encoders of the same shape and dtype")
    for name in ("word_emb", "pos_emb", "type_emb"):
        setattr(dst, name, getattr(src, name))
    dst.emb_ln, dst.lns, dst.pooler, dst.classifier = src.emb_ln, src.lns, src.pooler, src.classifier


def build_variants(art: Artifact, *, linear: LinearOptions, fusion: Fusion = Fusion(),
                   dense: bool = True) -> tuple[Encoder, Encoder | None]:
    """The checkpoint's encoder with `linear`, and, where `dense` and some quantized layer of it does not
    already run dense INT8, the same weights with every quantized layer on DENSE (sharing the float tensors);
    else None. The checkpoint is read once."""
    config, state = checkpoint_tensors(art)
    quant = CheckpointQuant(weight_scales=art.all_weight_scales(), act_amax=art.activation_amax(),
                            sparse_layers=art.sparse_layers if art.nm == (2, 4) else ())
    model = build_encoder(config, state, quant, linear=linear, fusion=fusion)
    if not dense or all(m.kernel == DENSE for m in model.modules() if isinstance(m, QuantLinear)):
        return model, None
    other = build_encoder(config, state, quant, linear=replace(linear, kernel=DENSE), fusion=fusion)
    share_float_params(other, model)
    return model, other


def cuda_event_timer(device) -> Callable[[Callable[[], Any], int], list[float]]:
    """A timer for `measure_routes`: `iters` calls of `fn`, each between two CUDA events; ms per call."""
    from ._torch import torch

    def timer(fn, iters):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in events]

    return timer


def measure_routes(runner, plan: Mapping[int, tuple[int, int]], variants: Mapping[str, str],
                   timer: Callable[[Callable[[], Any], int], list[float]],
                   timing: RouteTiming = RouteTiming()) -> dict[int, dict[str, float | None]]:
    """Median ms per call of each variant at each planned token count. `variants` maps a kernel name to
    the runner's variant name ("" for its own model); the runner's `trial` gives each bucket's call. A
    variant that fails at a count gets None there (and so does not take it); counts past the budget are left out."""
    out: dict[int, dict[str, float | None]] = {}
    t0 = time.perf_counter()
    for tokens, (b, n) in plan.items():
        if time.perf_counter() - t0 > timing.budget_s:
            break
        calls: dict[str, Callable[[], Any] | None] = {}
        samples: dict[str, list[float]] = {k: [] for k in variants}
        for kernel, name in variants.items():
            try:
                calls[kernel] = runner.trial(b, n, name)
                for _ in range(timing.warmup):
                    calls[kernel]()
            except Exception:  # noqa: BLE001 - a variant that cannot run this bucket does not take it
                calls[kernel] = None
        for _ in range(timing.rounds):
            for kernel, fn in calls.items():
                if fn is not None:
                    samples[kernel] += timer(fn, timing.iters)
        out[tokens] = {k: (round(statistics.median(v), 4) if v else None) for k, v in samples.items()}
    return out


def apply_routes(runner, routes: Mapping[str, str], variants: Mapping[str, str]) -> list[str]:
    """Route the runner's buckets as `routes` says (kernel per "BxN"), keep the winners' trial graphs, and
    free the variants no bucket uses; returns the freed variants' names."""
    for b in runner.batch_buckets:
        for n in runner.seq_buckets:
            runner.adopt(b, n, variants[routes[bucket_name(b, n)]])
    return runner.drop_unrouted()
