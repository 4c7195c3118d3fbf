"""compress.sequential: the projections' layer-by-layer pass gives exactly what whole-model forwards give."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from holoserve.compress import sequential
from holoserve.compress.admm import ProjectionOptions, layerwise_projection
from holoserve.compress.layers import encoder_linear_names
from holoserve.compress.project import AdmmSolverOptions
from holoserve.compress.quant import input_hessians
from holoserve.compress.sequential import LayerInputs, layer_blocks
from holoserve.compress.sparsify import hard_masks, obs_masks
from tests.helpers.tiny import make_tiny_bert, random_batches


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_bert(tmp_path_factory.mktemp("seq") / "tiny", hidden=32, intermediate=64, layers=3)


def _model(model_dir):
    return AutoModelForSequenceClassification.from_pretrained(str(model_dir), local_files_only=True).eval()


def _batches(model, n, seed):
    return random_batches(model.config.vocab_size, n=n, b=4, s=12, seed=seed)


def test_layer_by_layer_hessians_equal_whole_model_ones_as_weights_change(model_dir):
    """Each layer's X^T X, on two groups of batches, is bitwise what input_hessians gives on the whole model, also
    after the layers before it changed their weights (as a projection changes them)."""
    model, ref = _model(model_dir), _model(model_dir)
    groups = [_batches(model, 3, 0), _batches(model, 2, 1)]
    blocks, in_order = layer_blocks(model, encoder_linear_names(model))
    assert in_order and [i for i, _ in blocks] == [0, 1, 2]
    inputs = LayerInputs(model, groups)
    assert inputs.sequential, inputs.reason
    g = torch.Generator().manual_seed(0)
    for index, names in blocks:
        got = inputs.hessians(index, names)
        want = [input_hessians(ref, names, batches) for batches in groups]
        for got_g, want_g in zip(got, want):
            assert got_g.keys() == set(names)
            for name in names:
                assert torch.equal(got_g[name], want_g[name]), (index, name)
        with torch.no_grad():  # change this layer's weights in both models, as the projection would
            for name in names:
                noise = 0.05 * torch.randn(model.get_submodule(name).weight.shape, generator=g)
                model.get_submodule(name).weight.add_(noise)
                ref.get_submodule(name).weight.add_(noise)
    with pytest.raises(ValueError, match="comes after"):
        inputs.hessians(0, blocks[0][1])


def _project(model, method, batches, heldout):
    layers = encoder_linear_names(model)
    options = ProjectionOptions(method=method, fixed_mask=True, solver=AdmmSolverOptions(damp=0.1, max_iters=6))
    masks = hard_masks(model, layers)
    return layerwise_projection(model, layers, batches, heldout, options, masks=masks)


@pytest.mark.parametrize("method", ["obs", "admm"])
def test_projection_is_the_same_with_whole_model_forwards(model_dir, monkeypatch, method):
    """layerwise_projection (OBS and ADMM on the given masks) and obs_masks write the same weights, masks and
    diagnostics whether the layers run one at a time or the whole model runs per layer (the cache too small)."""
    batches = _batches(_model(model_dir), 3, 2)
    heldout = _batches(_model(model_dir), 2, 3)
    fast, slow = _model(model_dir), _model(model_dir)
    masks_f, diag_f = _project(fast, method, batches, heldout)
    monkeypatch.setattr(sequential, "CACHE_BYTES", 0)
    masks_s, diag_s = _project(slow, method, batches, heldout)
    assert masks_f.keys() == masks_s.keys() and all(torch.equal(masks_f[k], masks_s[k]) for k in masks_f)
    for (k, a), b in zip(fast.state_dict().items(), slow.state_dict().values()):
        assert torch.equal(a, b), k
    strip = lambda d: {k: {f: v for f, v in x.items() if f != "seconds"} for k, x in d.items()}  # noqa: E731
    assert strip(diag_f) == strip(diag_s)
    if method == "obs":
        fast2, slow2 = _model(model_dir), _model(model_dir)
        layers = encoder_linear_names(fast2)
        monkeypatch.setattr(sequential, "CACHE_BYTES", 4 << 30)
        mf, rf = obs_masks(fast2, layers, batches)
        monkeypatch.setattr(sequential, "CACHE_BYTES", 0)
        ms, rs = obs_masks(slow2, layers, batches)
        assert rf == rs and all(torch.equal(mf[k], ms[k]) for k in mf)


def test_falls_back_when_the_cache_is_too_small_or_the_layers_are_out_of_order(model_dir, monkeypatch):
    model = _model(model_dir)
    batches = _batches(model, 2, 4)
    monkeypatch.setattr(sequential, "CACHE_BYTES", 0)
    small = LayerInputs(model, [batches])
    assert not small.sequential and "exceed the cache" in small.reason
    names = encoder_linear_names(model)
    blocks, in_order = layer_blocks(model, [n for n in names if ".1." in n] + [n for n in names if ".0." in n])
    assert not in_order and [i for i, _ in blocks] == [1, 0]
    unordered = LayerInputs(model, [batches], sequential=in_order)
    assert not unordered.sequential
    (h,) = unordered.hessians(1, blocks[0][1])  # whole-model forwards: any order works
    assert all(torch.equal(h[n], input_hessians(model, [n], batches)[n]) for n in blocks[0][1])


def test_falls_back_when_a_layer_gets_other_arguments(model_dir):
    """A model whose layers are not each called with the first layer's arguments (here: layer 1 gets a different
    attention mask) is measured by whole-model forwards, not by replaying the first layer's arguments."""
    model = _model(model_dir)
    layer1 = model.bert.encoder.layer[1]

    def other_mask(_m, args, kwargs):
        if len(args) > 1 and isinstance(args[1], torch.Tensor):
            return (args[0], args[1] * 0.5, *args[2:]), kwargs
        key = "attention_mask"
        if isinstance(kwargs.get(key), torch.Tensor):
            return args, {**kwargs, key: kwargs[key] * 0.5}
        return args, {**kwargs, "marker": True}

    h = layer1.register_forward_pre_hook(other_mask, with_kwargs=True)
    try:
        inputs = LayerInputs(model, [_batches(model, 2, 5)])
    finally:
        h.remove()
    assert not inputs.sequential and "other arguments" in inputs.reason
