"""Which modules are compressed: every nn.Linear inside the repeated layers of a BERT-family encoder.

The layers are found from the model's structure, not from a name pattern: the base model's stack of
repeated layers (an nn.ModuleList of `num_hidden_layers` modules of one class — `encoder.layer` in
BERT, RoBERTa, XLM-R, ELECTRA and MPNet, `transformer.layer` in DistilBERT), and inside each layer
its Linears (Q, K, V, attention output, FFN in, FFN out). Embeddings (and ELECTRA's embedding
projection), LayerNorm, the pooler and the classifier head stay dense.

A family the rest of the pipeline (training, ONNX export, serving) is not built and tested for is
refused up front, and so is any model whose encoder reuses one layer's weights across layers
(ALBERT): 2:4 masks and INT8 scales are per weight, so a shared weight would have to satisfy every
layer at once and the layer count in the checkpoint would not be the layer count that runs.
"""
from __future__ import annotations

import torch
from torch import nn

from holoserve import HoloServeError

# config.model_type -> family name, for the encoder families compress -> export -> eval -> serve supports
SUPPORTED_FAMILIES = {
    "bert": "BERT",
    "roberta": "RoBERTa",
    "xlm-roberta": "XLM-RoBERTa",
    "electra": "ELECTRA",
    "distilbert": "DistilBERT",
    "mpnet": "MPNet",
}
# families refused with a reason of their own
SHARED_WEIGHT_FAMILIES = {"albert": "ALBERT"}


def supported_families() -> str:
    return ", ".join(f"{name} ({mt})" for mt, name in SUPPORTED_FAMILIES.items())


def _family(model: nn.Module) -> str:
    cfg = getattr(model, "config", None)
    return str(getattr(cfg, "model_type", "") or type(model).__name__)


def _refuse(model: nn.Module, why: str) -> HoloServeError:
    return HoloServeError(
        f"cannot compress {type(model).__name__} (model type {_family(model)!r}): {why}. "
        f"Supported encoder families: {supported_families()}"
    )


def _num_layers(model: nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    for key in ("num_hidden_layers", "n_layers", "num_layers"):
        n = getattr(cfg, key, None)
        if isinstance(n, int) and n > 0:
            return n
    return None


def _linears(mod: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in mod.named_modules() if isinstance(m, nn.Linear)]


def _stacks(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """Every ModuleList of same-class modules that hold Linears: the candidates for the layer stack."""
    out = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        kinds = {type(m) for m in mod}
        if len(kinds) == 1 and all(_linears(m) for m in mod):
            out.append((name, mod))
    return out


def _shared_parameters(layers: nn.ModuleList) -> bool:
    seen: dict[int, int] = {}
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            if seen.setdefault(id(p), i) != i:
                return True
    return False


def encoder_layer_stack(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(name, ModuleList) of the encoder's repeated layers; HoloServeError when the model cannot be compressed."""
    mt = str(getattr(getattr(model, "config", None), "model_type", "") or "")
    if mt in SHARED_WEIGHT_FAMILIES:
        raise _refuse(model, f"{SHARED_WEIGHT_FAMILIES[mt]} shares one layer's weights across all encoder layers, "
                             "and a 2:4 mask and INT8 scales cannot be fitted to a weight that every layer reuses")
    if mt and mt not in SUPPORTED_FAMILIES:
        raise _refuse(model, f"the encoder family {mt!r} is not supported")
    base = model
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        base = getattr(model, prefix)
    base_name = next((n for n, m in model.named_modules() if m is base), "")
    stacks = [(n, s) for n, s in _stacks(model) if n == base_name or n.startswith(f"{base_name}.") or not base_name]
    stacks = [(n, s) for n, s in stacks if "embedding" not in n.lower()]
    if not stacks:
        raise _refuse(model, "no stack of repeated encoder layers holding nn.Linear modules was found")
    n_layers = _num_layers(model)
    exact = [(n, s) for n, s in stacks if n_layers is None or len(s) == n_layers]
    if not exact:
        raise _refuse(model, f"its {n_layers} encoder layers run fewer distinct layer modules "
                             f"({', '.join(f'{n}: {len(s)}' for n, s in stacks)}), so weights are shared across layers")
    name, stack = max(exact, key=lambda ns: (len(ns[1]) * len(_linears(ns[1][0])), -ns[0].count(".")))
    if _shared_parameters(stack):
        raise _refuse(model, f"layers of {name} share parameter tensors, so weights are shared across layers")
    shapes = [[(n, tuple(m.weight.shape)) for n, m in _linears(layer)] for layer in stack]
    if any(s != shapes[0] for s in shapes[1:]):
        raise _refuse(model, f"the layers of {name} do not all have the same Linears")
    return name, stack


def encoder_linear_names(model: nn.Module) -> list[str]:
    """Names of the Q, K, V, attention-output, FFN-in and FFN-out Linears of every encoder layer, in module order.

    Embeddings, LayerNorm, the pooler and the classifier head are not included: they stay dense.
    Raises HoloServeError (naming the family and the supported ones) for a model that cannot be compressed.
    """
    name, _ = encoder_layer_stack(model)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith(f"{name}.")]
    if not names:
        raise _refuse(model, "no encoder Linear layers were found")
    return names


def activation_key(config) -> str:
    """The config field that names the FFN activation (DistilBERT: `activation`, the rest: `hidden_act`)."""
    return "activation" if getattr(config, "model_type", "") == "distilbert" else "hidden_act"


# the attribute that holds the FFN activation: BertIntermediate and its kin (RoBERTa, XLM-R, ELECTRA, MPNet)
# `intermediate_act_fn`, DistilBERT's FFN `activation`
_FFN_ACTIVATION_ATTRS = ("intermediate_act_fn", "activation")


def ffn_activation_slots(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, attribute) of every encoder layer's FFN activation, one per layer, in layer order."""
    _, stack = encoder_layer_stack(model)
    slots = []
    for layer in stack:
        found = [(m, a) for m in layer.modules() for a in _FFN_ACTIVATION_ATTRS
                 if isinstance(getattr(m, a, None), nn.Module)]
        if len(found) != 1:
            raise _refuse(model, f"found {len(found)} FFN activations in one encoder layer, expected 1")
        slots.append(found[0])
    return slots


class BlendedActivation(nn.Module):
    """(1 - alpha) * start(x) + alpha * end(x): an FFN activation on its way from the teacher's to the student's.

    alpha is a 0-d tensor set from outside, step by step (compress.methods: the activation ramp), so a compiled
    forward does not recompile as it moves; at 0 and 1 the result is exactly the one activation."""

    def __init__(self, start: nn.Module, end: nn.Module, device=None):
        super().__init__()
        self.start, self.end = start, end
        self.register_buffer("alpha", torch.zeros((), device=device), persistent=False)

    def set_alpha(self, alpha: float) -> None:
        self.alpha.fill_(min(1.0, max(0.0, alpha)))

    def forward(self, x):
        return torch.lerp(self.start(x), self.end(x), self.alpha.to(x.dtype))


def blend_ffn_activations(model: nn.Module, end: str) -> list[BlendedActivation]:
    """Put a BlendedActivation from each FFN's current activation to `end` (a Hugging Face name, e.g. "relu")
    in its place, alpha 0; the model computes what it did until alpha moves."""
    from transformers.activations import ACT2FN

    device = next(model.parameters()).device
    blends = []
    for mod, attr in ffn_activation_slots(model):
        cur = getattr(mod, attr)
        blend = cur if isinstance(cur, BlendedActivation) else BlendedActivation(cur, ACT2FN[end], device)
        setattr(mod, attr, blend)
        blends.append(blend)
    return blends


def set_ffn_activation(model: nn.Module, name: str) -> None:
    """Every encoder FFN computes `name` (a Hugging Face activation name), and the config says so, so the
    saved folder reloads as the same model."""
    from transformers.activations import ACT2FN

    for mod, attr in ffn_activation_slots(model):
        setattr(mod, attr, ACT2FN[name])
    setattr(model.config, activation_key(model.config), name)


def get_linear(model: nn.Module, name: str) -> nn.Linear:
    mod = model.get_submodule(name)
    if not isinstance(mod, nn.Linear):
        raise ValueError(f"{name} is not an nn.Linear")
    return mod
