"""The layer-by-layer calibration pass of the projections (SparseGPT's sequential pass), run once per layer.

The projections measure each encoder layer's Linear inputs after the layers before it were projected. Run as a
whole-model forward per layer, that costs an L-layer model L(L+1)/2 layer passes per batch, plus the
embeddings L times. LayerInputs keeps each batch's input to the current layer instead, so each layer runs
twice per batch (measured before its projection, advanced after it), for the same numbers: the layer is the
same module called with the same arguments the encoder passes it. It checks that on the first batch, and
falls back to whole-model forwards where it does not hold or the inputs would not fit in memory.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from .data import to_device
from .layers import encoder_layer_stack
from .quant import input_hessians, summing_inputs, xtx

log = logging.getLogger("holoserve.compress")

CACHE_BYTES = 4 << 30  # at most this much of kept layer inputs (all batches); beyond it, whole-model forwards


class _Stop(Exception):
    """Raised by the capture hook once the first layer's inputs are seen: the rest of the model need not run."""


Call = tuple[tuple, dict]  # a layer's positional and keyword arguments


def _hidden(call: Call) -> torch.Tensor:
    args, kwargs = call
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(call: Call, hidden: torch.Tensor) -> Call:
    args, kwargs = call
    return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})


def _output(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and (
            a is b or bool(torch.equal(a, b)))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a is b or a == b


class LayerInputs:
    """Each calibration batch's input to one encoder layer at a time, for the X^T X of that layer's Linears.

    `groups` are lists of batches (e.g. the fit batches and the held-out ones); hessians(index, names) returns,
    per group, the X^T X of the named Linears (all in encoder layer `index`) on the non-padding tokens, as
    compress.quant.input_hessians would on the whole model as it is now. Indices must not decrease: reaching a
    later layer runs the layers in between, with the weights they have then.
    """

    def __init__(self, model: nn.Module, groups: Sequence[Sequence[Mapping[str, torch.Tensor]]],
                 sequential: bool = True):
        self.model, self.groups = model, [list(g) for g in groups]
        self.stack_name, self.stack = encoder_layer_stack(model)
        self.index = 0
        self.calls: list[list[Call]] | None = None
        self.masks: list[list[torch.Tensor | None]] = []
        self.reason = "the Linears are not taken one encoder layer at a time, in order"
        if sequential:
            self.reason = ""
            with torch.no_grad(), _eval(model):
                self._capture()
        if self.calls is None:
            log.debug("[project] whole-model forwards per layer: %s", self.reason)

    @property
    def sequential(self) -> bool:
        """True when layers run one at a time on kept inputs; False: whole-model forwards (see .reason)."""
        return self.calls is not None

    def _capture(self) -> None:
        first = next((b for g in self.groups for b in g), None)
        if first is None:
            self.reason = "no batches"
            return
        per_batch = self._verify(first)
        if per_batch is None:
            return
        count = sum(len(g) for g in self.groups)
        if per_batch * count > CACHE_BYTES:
            self.reason = f"{count} batches of {per_batch / 2**20:.0f} MiB of layer inputs exceed the cache"
            return
        device = next(self.model.parameters()).device
        self.calls, self.masks = [], []
        for g in self.groups:
            calls, masks = [], []
            for b in g:
                calls.append(self._first_call(to_device(b, device)))
                am = b.get("attention_mask")
                masks.append(am.to(device).bool() if am is not None else None)
            self.calls.append(calls)
            self.masks.append(masks)

    def _first_call(self, batch: Mapping[str, torch.Tensor]) -> Call:
        seen: list[Call] = []

        def hook(_m, args, kwargs):
            seen.append((tuple(args), dict(kwargs)))
            raise _Stop

        h = self.stack[0].register_forward_pre_hook(hook, with_kwargs=True)
        try:
            self.model(**batch)
        except _Stop:
            pass
        finally:
            h.remove()
        if not seen:
            raise RuntimeError(f"{self.stack_name}[0] was not called by the model's forward")
        return seen[0]

    def _verify(self, batch: Mapping[str, torch.Tensor]) -> int | None:
        """One whole-model forward on `batch` recording every layer's arguments: each layer must get the same
        arguments as the first, but for the hidden states, which must be exactly the previous layer's output when
        it is called on its own. Returns the bytes one batch's layer input takes, or None (self.reason says why)."""
        device = next(self.model.parameters()).device
        seen: list[Call] = []
        handles = [layer.register_forward_pre_hook(lambda _m, a, k: seen.append((tuple(a), dict(k))), with_kwargs=True)
                   for layer in self.stack]
        try:
            self.model(**to_device(batch, device))
        finally:
            for h in handles:
                h.remove()
        if len(seen) != len(self.stack):
            self.reason = f"the forward called {len(seen)} layer modules, not each of the {len(self.stack)} once"
            return None
        try:
            for i in range(1, len(seen)):
                expect = _output(self.stack[i - 1](*seen[i - 1][0], **seen[i - 1][1]))
                if not (_same(_hidden(seen[i]), expect) and _same(_with_hidden(seen[i], expect),
                                                                   _with_hidden(seen[0], expect))):
                    self.reason = f"layer {i} is called with other arguments than layer 0, or on other hidden states"
                    return None
        except (KeyError, IndexError, TypeError) as e:
            self.reason = f"a layer cannot be called on its own ({e})"
            return None
        hidden = _hidden(seen[0])
        return hidden.numel() * hidden.element_size()

    @torch.no_grad()
    def hessians(self, index: int, names: Sequence[str]) -> list[dict[str, torch.Tensor]]:
        """Per group, X^T X [in, in] (float64, CPU) of the named Linears of encoder layer `index`."""
        if self.calls is None:
            return [input_hessians(self.model, names, g) for g in self.groups]
        if index < self.index:
            raise ValueError(f"LayerInputs: layer {index} comes after layer {self.index} was reached")
        with _eval(self.model):
            while self.index < index:
                layer = self.stack[self.index]
                self.calls = [[_with_hidden(c, _output(layer(*c[0], **c[1]))) for c in calls] for calls in self.calls]
                self.index += 1
            return [self._sums(names, calls, masks) for calls, masks in zip(self.calls, self.masks)]

    def _sums(self, names: Sequence[str], calls: list[Call], masks: list[torch.Tensor | None]
              ) -> dict[str, torch.Tensor]:
        layer = self.stack[self.index]
        with summing_inputs(self.model, names, xtx, f"layer {self.index}'s input Hessians") as (sums, keep):
            for (args, kwargs), mask in zip(calls, masks):
                keep[0] = mask
                layer(*args, **kwargs)
        return sums


class _eval:
    """The model in eval mode for the block; its training flag restored after."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self):
        self.was = self.model.training
        self.model.eval()

    def __exit__(self, *exc):
        self.model.train(self.was)


def layer_blocks(model: nn.Module, layers: Sequence[str]) -> tuple[list[tuple[int | None, list[str]]], bool]:
    """The named Linears grouped by encoder layer, in the order first named: [(layer index or None, names)], and
    whether the indices are all known and increasing (what LayerInputs needs to run the layers one at a time)."""
    stack_name, _ = encoder_layer_stack(model)
    blocks: dict[str, list[str]] = {}
    for name in layers:
        rest = name[len(stack_name) + 1:] if name.startswith(f"{stack_name}.") else name
        blocks.setdefault(rest.split(".")[0], []).append(name)
    out = [(int(k) if k.isdigit() and names[0].startswith(f"{stack_name}.") else None, names)
           for k, names in blocks.items()]
    idx = [i for i, _ in out]
    return out, None not in idx and all(a < b for a, b in zip(idx, idx[1:]))
