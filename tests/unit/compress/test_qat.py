"""The frozen 2:4 mask survives QAT (fake-quant weights + activations), and QAT sees the saved numerics."""
import pytest
import torch
from torch.nn.utils import parametrize
from transformers import AutoModelForSequenceClassification

from holoserve.compress.config import PhaseConfig, Preset
from holoserve.compress.data import encode, train_batches
from holoserve.core.tokenizer import load_tokenizer
from holoserve.compress.layers import encoder_linear_names, get_linear
from holoserve.compress.project import project
from holoserve.compress.quant import calibrate_amax, input_quantizers
from holoserve.compress.sparsify import MaskedWeight, attach_masks, finalize, hard_masks, nm_share
from holoserve.compress.trainer import TrainOptions, train_phase
from holoserve.data.glue import read_split
from holoserve.core.numerics import grid_codes, is_nm_sparse

from tests.helpers.checkpoints import write_glue
from tests.helpers.tiny import make_tiny_bert

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("qat")
    model_dir = make_tiny_bert(root / "tiny", hidden=32, intermediate=64)
    data = encode(load_tokenizer(model_dir, 32), read_split("sst2", "train", write_glue(root / "glue")))
    return model_dir, data


def _projected(model_dir):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), local_files_only=True)
    layers = encoder_linear_names(model)
    masks = hard_masks(model, layers)
    finalize(model, masks, quant=True)
    return model, layers, masks


def test_masked_weight_matches_the_saved_projection():
    torch.manual_seed(0)
    w = torch.randn(16, 32)
    mask = torch.rand(16, 32) > 0.5
    assert torch.equal(MaskedWeight(mask, quant=True)(w), project(w, mask=mask).z)
    assert torch.equal(MaskedWeight(mask, quant=False)(w), w * mask)


def test_mask_survives_qat(setup):
    model_dir, data = setup
    model, layers, masks = _projected(model_dir)
    before = {n: get_linear(model, n).weight.detach().clone() for n in layers}
    batches = [{k: v for k, v in b.items() if k != "labels"} for _, b in zip(range(2), train_batches(data, 16, 0))]
    amax = calibrate_amax(model, layers, batches)
    attach_masks(model, masks, quant=True)
    preset = Preset(name="t", batch_size=16)
    # a large learning rate: gradients and AdamW moments push hard on every entry
    train_phase("qat", model, PhaseConfig(steps=25, lr=5e-3, weight_decay=0.1), data, preset, 0, None,
                TrainOptions(masks=masks, context=lambda: input_quantizers(model, amax, layers), progress=False))
    for n in layers:  # the trained (original) weights keep exact zeros where the mask is off
        orig = get_linear(model, n).parametrizations.weight.original
        assert (orig[~masks[n]] == 0).all(), n
    scales = finalize(model, masks, quant=True)
    changed = 0
    for n in layers:
        lin = get_linear(model, n)
        assert not parametrize.is_parametrized(lin, "weight")
        w = lin.weight.detach()
        assert is_nm_sparse(w.numpy()), n
        assert (w[~masks[n]] == 0).all()
        assert grid_codes(w.numpy(), scales[n].numpy()) is not None, n
        changed += int(not torch.equal(w, before[n]))
    assert changed == len(layers)  # QAT really trained every layer
    assert nm_share(model, layers) == 1.0


def test_plain_training_breaks_the_mask(setup):
    """Control: without the frozen mask the same training refills pruned weights (so the test above can fail)."""
    model_dir, data = setup
    model, layers, _ = _projected(model_dir)
    train_phase("plain", model, PhaseConfig(steps=5, lr=5e-3), data, Preset(name="t", batch_size=16), 0, None,
                TrainOptions(progress=False))
    assert nm_share(model, layers) < 0.5


def test_preset_overrides():
    from holoserve.compress.config import PRESETS, apply_overrides
    from holoserve import HoloServeError

    p = apply_overrides(PRESETS["quick"], ["qat.lr=3e-4", "admm_cfg.rho_end=0.1", "calib_percentile=none",
                                           "freeze_word_embeddings=false", "admm.steps=7"])
    assert (p.qat.lr, p.admm_cfg.rho_end, p.calib_percentile, p.freeze_word_embeddings, p.admm.steps) == \
        (3e-4, 0.1, None, False, 7)
    assert PRESETS["quick"].qat.lr != 3e-4  # presets themselves are frozen
    for bad in ("qat.nope=1", "nope.lr=1", "qat.lr", "qat.steps=abc",
                # strict: no silent coercion of a misspelt boolean or a fractional step count
                "quantize_embeddings=ture", "qat.steps=1.7", "qat.lr=nan", "qat=3"):
        with pytest.raises(HoloServeError, match="--set"):
            apply_overrides(PRESETS["quick"], [bad])


def test_exact_input_quantizers_equal_the_integer_gemm():
    """exact=True: int8 input x int8 weight summed without float32 rounding, like an int32 accumulator."""
    from holoserve.compress.quant import ACT_QMAX, ACT_QMIN, act_scale, fake_quant_weight

    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(4096, 8)
    # power-of-two scales: q * scale is exact in float32, so the integer GEMM is the exact answer
    scales = 2.0 ** -torch.randint(7, 11, (8,), generator=g).float()
    with torch.no_grad():
        lin.weight.copy_(fake_quant_weight(torch.rand(8, 4096, generator=g), scales))
    model = torch.nn.Sequential(lin)
    x = torch.rand(16, 4096, generator=g) * 4  # same-sign terms: int32-sized sums, past float32's 24 bits
    amax = {"0.input": 127 / 32}
    s = act_scale(127 / 32)
    xq = torch.clamp(torch.round(x / s), ACT_QMIN, ACT_QMAX).to(torch.int64)
    wq = torch.round(lin.weight.detach().double() / scales.double()[:, None]).to(torch.int64)
    want = ((xq @ wq.T).double() * s.double() * scales.double() + lin.bias.detach().double()).float()
    with torch.no_grad():
        with input_quantizers(model, amax, ["0"], exact=True):
            exact = model(x)
        with input_quantizers(model, amax, ["0"]):
            fp32 = model(x)
        plain = model(x)
    assert torch.equal(exact, want)
    assert not torch.equal(fp32, want)  # float32 accumulation rounds; the export's int32 sums do not
    assert "forward" not in vars(lin) and not lin._forward_pre_hooks  # restored
    assert torch.equal(plain, lin(x))


def test_tensorrt_quantizers_quantize_qkv_softmax_and_both_add_inputs(setup):
    """TensorRT QAT: LayerNorm sees fq(dense output) + fq(skip input); Q/K/V leave their Linears quantized;
    the attention probabilities are on their INT8 grid; padding stays masked."""
    from holoserve.compress.quant import (act_scale, calibrate_tensorrt_amax, fake_quant_act, output_key, residual_key,
                                          softmax_key, tensorrt_quantizers, tensorrt_sites)

    model_dir, data = setup
    model, layers, _ = _projected(model_dir)
    model.eval()
    sites = tensorrt_sites(model, layers)
    n_layers = model.config.num_hidden_layers
    assert len(sites.outputs) == 5 * n_layers and len(sites.blocks) == 2 * n_layers
    assert len(sites.attention) == n_layers and all(a.endswith(".attention.self") for a in sites.attention)
    assert all(b.endswith((".attention.output", ".output")) for b in sites.blocks)
    batch = next(train_batches(data, 4, seed=0))
    batch.pop("labels")
    batch["attention_mask"][0, 5:] = 0  # a padded row: the quantized attention must still mask it
    amax, sqnr = calibrate_tensorrt_amax(model, layers, [batch])
    # a random tiny model has no outlier channels: every residual input keeps > 20 dB and its range
    assert sorted(sqnr) == sorted(sites.residual_keys()) and min(sqnr.values()) > 20
    assert sorted(amax) == sorted([output_key(n) for n in sites.outputs] + [residual_key(b) for b in sites.blocks]
                                  + [softmax_key(a) for a in sites.attention])
    assert 0 < amax[softmax_key(sites.attention[0])] <= 1.0

    block = sites.blocks[0]
    dense, query = f"{block}.dense", next(n for n in sites.outputs if n.endswith(".query"))
    attn = sites.attention[0]
    amax = {k: v / 4 for k, v in amax.items()}  # a coarse grid, so quantization visibly changes values
    seen = {}

    def keep(key, i=0):
        def hook(_m, args, out=None):
            seen.setdefault(key, out if out is not None else args[i])  # returns None: observe only
        return hook

    hooks = [model.get_submodule(dense).register_forward_hook(keep("dense")),
             model.get_submodule(query).register_forward_hook(keep("query")),
             model.get_submodule(block).register_forward_pre_hook(keep("skip", 1)),
             model.get_submodule(f"{block}.LayerNorm").register_forward_pre_hook(keep("sum"))]
    with torch.no_grad(), tensorrt_quantizers(model, amax, layers):
        out = model(**batch, output_attentions=True)
        q_out = model.get_submodule(query)(seen["query"].new_ones(2, seen["query"].shape[-1]) * 3)
    for h in hooks:
        h.remove()
    want = (fake_quant_act(seen["dense"], act_scale(amax[output_key(dense)]))
            + fake_quant_act(seen["skip"], act_scale(amax[residual_key(block)])))
    assert torch.allclose(seen["sum"], want, atol=1e-6)
    assert not torch.allclose(seen["sum"], seen["dense"] + seen["skip"])
    s_q = act_scale(amax[output_key(query)])
    assert torch.allclose(q_out / s_q, torch.round(q_out / s_q), atol=1e-4)  # on the INT8 grid
    probs = out.attentions[0]  # layer 0's softmax output, as P·V reads it
    s_p = act_scale(amax[softmax_key(attn)])
    assert torch.allclose(probs / s_p, torch.round(probs / s_p), atol=1e-4)
    assert torch.all(probs[0, :, :, 5:] == 0)  # padded keys get no attention
    with torch.no_grad():
        plain = model(**batch).logits
    assert model.config._attn_implementation != "holoserve_tensorrt_qat"  # restored
    assert not torch.allclose(plain, out.logits)  # hooks removed: the float model again
    with pytest.raises(KeyError, match="calibrate first"):
        with tensorrt_quantizers(model, {}, layers):
            pass


def test_tensorrt_calibration_leaves_low_sqnr_residual_inputs_float(setup, monkeypatch):
    """A residual-Add input under the SQNR floor gets no range, and QAT then leaves that input alone."""
    import holoserve.compress.quant as quant

    model_dir, data = setup
    model, layers, _ = _projected(model_dir)
    model.eval()
    batch = next(train_batches(data, 4, seed=0))
    batch.pop("labels")
    _, sqnr = quant.calibrate_tensorrt_amax(model, layers, [batch])
    floor = sorted(sqnr.values())[2] + 1e-3  # between the measured values: the three lowest go float
    monkeypatch.setattr(quant, "RESIDUAL_MIN_SQNR_DB", floor)
    amax, again = quant.calibrate_tensorrt_amax(model, layers, [batch])
    low = {k for k, v in sqnr.items() if v < floor}
    assert again == sqnr and len(low) == 3 and not low & set(amax) and set(sqnr) - low <= set(amax)
    dense_side = next(k for k in sqnr if k.endswith(".dense.output"))
    layer, block = dense_side[: -len(".output")], dense_side[: -len(".dense.output")]
    query = next(n for n in layers if n.endswith(".query"))
    amax.pop(dense_side, None)
    amax[f"{block}.residual"] = 1.0
    with quant.tensorrt_quantizers(model, amax, layers):
        assert len(model.get_submodule(query)._forward_hooks) == 1  # quantized
        assert not model.get_submodule(layer)._forward_hooks  # no range: its output stays float
        assert len(model.get_submodule(block)._forward_pre_hooks) == 1  # the skip side has one: quantized


def test_tensorrt_calibration_refuses_models_it_cannot_quantize(setup):
    """No BERT-style attention among the layers (DistilBERT's q_lin, MPNet's attn.q): a clear error, not a
    QAT that silently trains without the placement's quantizers."""
    from holoserve import HoloServeError
    from holoserve.compress.quant import calibrate_tensorrt_amax

    model_dir, data = setup
    model, layers, _ = _projected(model_dir)
    batch = next(train_batches(data, 4, seed=0))
    batch.pop("labels")
    ffn = [n for n in layers if n.endswith(("intermediate.dense", "output.dense"))]
    with pytest.raises(HoloServeError, match="no BERT-style self-attention.*leave it off"):
        calibrate_tensorrt_amax(model, ffn, [batch])


def test_presets_size_each_phase_in_epochs_of_the_training_set():
    """A preset's budget is epochs, capped: quick on MRPC-sized data runs whole epochs, on SST-2-sized
    data the caps bind; an exact --set PHASE.steps wins over epochs; bad budgets get a clear error."""
    from holoserve import HoloServeError
    from holoserve.compress.config import apply_overrides, get_preset

    quick, full = get_preset("quick"), get_preset("full")
    mrpc = quick.sized(3668)  # 115 batches of 32 per epoch
    assert (mrpc.dense.steps, mrpc.admm.steps, mrpc.qat.steps) == (345, 230, 200)
    sst2 = quick.sized(67349)
    assert (sst2.dense.steps, sst2.admm.steps, sst2.qat.steps) == (500, 300, 200)
    assert (full.sized(3668).dense.steps, full.sized(67349).dense.steps) == (345, 6000)
    assert sst2.with_max_steps(7).admm.steps == 7
    exact = apply_overrides(quick, ["admm.steps=0", "qat.epochs=0.5", "qat.max_steps=none"]).sized(3668)
    assert (exact.admm.steps, exact.qat.steps) == (0, 58)
    with pytest.raises(HoloServeError, match="epochs"):
        apply_overrides(quick, ["qat.epochs=-1"]).sized(100)
    with pytest.raises(HoloServeError, match="steps"):
        apply_overrides(quick, ["qat.steps=-3"]).sized(100)


def test_input_channel_norms_skip_padding(setup):
    """||x_j|| per input channel of each Linear over the non-padding tokens, as a direct computation gives."""
    from holoserve.compress.quant import input_channel_norms

    model_dir, data = setup
    model, layers, _ = _projected(model_dir)
    batches = [{k: torch.nn.functional.pad(v, (0, 5)) for k, v in b.items() if k != "labels"}  # 5 padding columns
               for _, b in zip(range(2), train_batches(data, 16, 0))]
    assert all((b["attention_mask"] == 0).any() for b in batches)
    norms = input_channel_norms(model, layers, batches)
    name = layers[0]
    seen = []
    h = get_linear(model, name).register_forward_pre_hook(lambda _m, a: seen.append(a[0].detach()))
    with torch.no_grad():
        model.eval()
        for b in batches:
            model(**b)
    h.remove()
    rows = torch.cat([x[b["attention_mask"].bool()] for x, b in zip(seen, batches)])
    assert set(norms) == set(layers) and norms[name].shape == (rows.shape[1],)
    torch.testing.assert_close(norms[name], rows.pow(2).sum(0).sqrt())
    with_pad = torch.cat([x.reshape(-1, x.shape[-1]) for x in seen]).pow(2).sum(0).sqrt()
    assert not torch.allclose(norms[name], with_pad)


def _dense(model_dir):
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), local_files_only=True)
    return model.eval(), encoder_linear_names(model)


def _calib(data, n=4):
    return [{k: v for k, v in b.items() if k != "labels"} for _, b in zip(range(n), train_batches(data, 16, 0))]


def test_input_hessians_are_xtx_over_the_non_padding_tokens(setup):
    from holoserve.compress.quant import input_channel_norms, input_hessians

    model_dir, data = setup
    model, layers = _dense(model_dir)
    batches = _calib(data, 2)
    hess = input_hessians(model, layers[:2], batches)
    norms = input_channel_norms(model, layers[:2], batches)
    for name in layers[:2]:
        assert hess[name].shape == (32, 32) and hess[name].dtype == torch.float64
        torch.testing.assert_close(hess[name].diagonal().sqrt().float(), norms[name])  # diag(X^T X) = ||x_j||^2
        assert torch.allclose(hess[name], hess[name].T)


def test_obs_masks_keep_the_pruned_model_closer_to_the_dense_one(setup):
    """The sequential OBS projection: exactly 2:4 in every encoder Linear, and with the same masks as the
    nearest projection the pruned model's outputs on the calibration rows (and on other rows) stay closer
    to the dense model's; SparseGPT's saliency masks too."""
    from holoserve.compress.sparsify import obs_masks

    model_dir, data = setup
    dense, layers = _dense(model_dir)
    calib, other = _calib(data), [b for _, b in zip(range(6), train_batches(data, 16, 5))][4:]
    other = [{k: v for k, v in b.items() if k != "labels"} for b in other]

    def gap(model, batches):
        with torch.no_grad():
            return sum(float(((model(**b, output_hidden_states=True).hidden_states[-1]
                               - dense(**b, output_hidden_states=True).hidden_states[-1]) ** 2).sum())
                       for b in batches)

    near, _ = _dense(model_dir)
    masks = hard_masks(near, layers)
    finalize(near, masks, quant=False)
    obs, _ = _dense(model_dir)
    obs_m, ratios = obs_masks(obs, layers, calib, masks=masks)
    assert all(torch.equal(obs_m[n], masks[n]) for n in layers)  # the given masks are kept
    assert nm_share(obs, layers) == 1.0 and all(torch.equal(get_linear(obs, n).weight != 0, obs_m[n]) for n in layers)
    assert set(ratios) == set(layers) and all(0 < r < 1 for r in ratios.values())  # each layer's own error falls
    assert gap(obs, calib) < 0.5 * gap(near, calib)
    assert gap(obs, other) < gap(near, other)
    sal, _ = _dense(model_dir)
    obs_masks(sal, layers, calib)
    assert nm_share(sal, layers) == 1.0 and gap(sal, calib) < gap(near, calib)


def test_perturbed_copies_keep_special_tokens_and_segments_and_carry_no_label():
    import numpy as np

    from holoserve.compress.data import UNLABELED, Encoded, with_perturbed_copies

    rng = np.random.default_rng(0)
    rows = []
    for _ in range(40):  # [CLS] a [SEP] b [SEP], segment ids 0 then 1
        a, b = rng.integers(1000, 2000, rng.integers(1, 6)), rng.integers(1000, 2000, rng.integers(1, 6))
        rows.append((np.r_[101, a, 102, b, 102], np.r_[[0] * (len(a) + 2), [1] * (len(b) + 1)]))
    data = Encoded([r[0] for r in rows], [r[1] for r in rows], np.arange(40) % 2, np.array([len(r[0]) for r in rows]))
    aug = with_perturbed_copies(data, 2, 0.5, seed=3, special_ids=[0, 101, 102])
    assert len(aug) == 120 and (aug.labels[:40] == data.labels).all() and (aug.labels[40:] == UNLABELED).all()
    assert all((x == y).all() for x, y in zip(aug.input_ids[:40], data.input_ids))  # the real rows untouched
    changed = 0
    for k in range(40, 120):
        x, t, src = aug.input_ids[k], aug.token_type_ids[k], data.input_ids[(k - 40) % 40]
        assert len(x) == len(t) == aug.lengths[k] <= len(src)
        assert x[0] == 101 and list(x[t == 0]).count(102) == 1 and list(x[t == 1]).count(102) == 1
        assert ((x[t == 0] != 102).sum() >= 2) and ((x[t == 1] != 102).sum() >= 1)  # no segment emptied
        assert set(x[(x != 101) & (x != 102)]) <= set(np.concatenate(data.input_ids)) - {101, 102}
        changed += len(x) != len(src) or (x != src).any()
    assert changed > 60  # at rate 0.5 nearly every copy differs from its row
    again = with_perturbed_copies(data, 2, 0.5, seed=3, special_ids=[0, 101, 102])
    assert all((x == y).all() for x, y in zip(again.input_ids, aug.input_ids))
    reg = Encoded(data.input_ids, data.token_type_ids, np.linspace(0, 5, 40, dtype=np.float32), data.lengths)
    assert np.isnan(with_perturbed_copies(reg, 1, 0.2, seed=0, special_ids=[101, 102]).labels[40:]).all()
    assert with_perturbed_copies(data, 0, 0.5, seed=0, special_ids=[]) is data


def test_task_loss_reads_only_the_labelled_rows():
    import torch

    from holoserve.compress.data import UNLABELED
    from holoserve.compress.distill import task_loss

    logits = torch.randn(6, 3, requires_grad=True)
    labels = torch.tensor([0, 2, UNLABELED, 1, UNLABELED, 0])
    keep = labels != UNLABELED
    assert torch.allclose(task_loss(logits, labels, False),
                          torch.nn.functional.cross_entropy(logits[keep], labels[keep]))
    none = task_loss(logits, torch.full((6,), UNLABELED), False)
    none.backward()
    assert none.item() == 0.0 and logits.grad is not None and not logits.grad.any()
    scores = torch.tensor([1.0, float("nan"), 3.0, float("nan"), 0.5, 2.0])
    out = torch.randn(6, 1)
    ok = ~torch.isnan(scores)
    assert torch.allclose(task_loss(out, scores, True), torch.nn.functional.mse_loss(out[ok, 0], scores[ok]))


def test_step_profile_says_where_a_qat_step_goes(setup, tmp_path, monkeypatch):
    """HOLOSERVE_TRAIN_PROFILE_STEPS: the named steps after the warm-up are profiled and summarized per part
    of the step; without it nothing is written."""
    import json

    from holoserve.compress import trainer

    model_dir, data = setup
    model, layers, masks = _projected(model_dir)
    batches = [{k: v for k, v in b.items() if k != "labels"} for _, b in zip(range(2), train_batches(data, 16, 0))]
    amax = calibrate_amax(model, layers, batches)
    attach_masks(model, masks, quant=True)
    teacher = AutoModelForSequenceClassification.from_pretrained(str(model_dir), local_files_only=True)
    run = dict(preset=Preset(name="t", batch_size=16), seed=0, state_dir=None,
               options=TrainOptions(masks=masks, teacher=teacher, distill=trainer.DistillConfig(),
                                    context=lambda: input_quantizers(model, amax, layers), progress=False))
    monkeypatch.chdir(tmp_path)
    trainer.train_phase("qat", model, PhaseConfig(steps=8, lr=1e-4), data, **run)
    assert not list(tmp_path.glob("*.json"))  # off by default
    monkeypatch.setenv(trainer.PROFILE_STEPS_ENV, "3")
    monkeypatch.setenv(trainer.PROFILE_DIR_ENV, str(tmp_path / "prof"))
    trainer.train_phase("qat", model, PhaseConfig(steps=trainer.PROFILE_SKIP + 4, lr=1e-4), data, **run)
    r = json.loads((tmp_path / "prof" / "qat-profile.json").read_text())
    assert r["phase"] == "qat" and r["steps"] == 3 and r["device"] == "cpu" and r["wall_ms_per_step"] > 0
    parts = r["host_ms_per_step_by_part"]
    assert set(parts) == {"data", "teacher", "student_forward", "backward", "optimizer", "loss_to_host"}
    assert sum(parts.values()) <= r["wall_ms_per_step"] * 1.05 and parts["backward"] > 0
    assert r["aten_ops_per_step"] > 100  # a QAT step of even a two-layer model is hundreds of operator calls
    # a phase shorter than the warm-up profiles nothing
    (tmp_path / "prof" / "qat-profile.json").unlink()
    trainer.train_phase("qat", model, PhaseConfig(steps=trainer.PROFILE_SKIP, lr=1e-4), data, **run)
    assert not (tmp_path / "prof" / "qat-profile.json").exists()


def test_compiled_qat_trains_as_eager(setup):
    """preset.compile: the QAT student (masked fake-quant weights, input quantizer hooks) and the teacher run
    through torch.compile with dynamic shapes, and train to the same weights as eager (no dropout here, so the
    two runs draw the same numbers); the mask holds."""
    from holoserve.compress import trainer

    model_dir, data = setup
    runs = []
    for compile_ in (False, True):
        model, layers, masks = _projected(model_dir)
        for mod in model.modules():  # dropout off: compiled and eager dropout draw different numbers
            if isinstance(mod, torch.nn.Dropout):
                mod.p = 0.0
        batches = [{k: v for k, v in b.items() if k != "labels"} for _, b in zip(range(2), train_batches(data, 16, 0))]
        amax = calibrate_amax(model, layers, batches)
        attach_masks(model, masks, quant=True)
        teacher = AutoModelForSequenceClassification.from_pretrained(str(model_dir), local_files_only=True)
        res = trainer.train_phase("qat", model, PhaseConfig(steps=4, lr=1e-3), data,
                                  Preset(name="t", batch_size=16, compile=compile_), 0, None,
                                  TrainOptions(masks=masks, teacher=teacher, distill=trainer.DistillConfig(),
                                               context=lambda m=model, a=amax: input_quantizers(m, a, layers),
                                               progress=False))
        assert res.loss is not None and res.loss == res.loss  # finite, not NaN
        runs.append({n: get_linear(model, n).parametrizations.weight.original.detach().clone() for n in layers})
        for n in layers:
            assert (runs[-1][n][~masks[n]] == 0).all(), n
    for n in runs[0]:
        torch.testing.assert_close(runs[1][n], runs[0][n], rtol=1e-4, atol=1e-5)


def test_compile_without_a_compiler_says_what_to_install(monkeypatch):
    import shutil

    from holoserve import HoloServeError
    from holoserve.compress import trainer

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(HoloServeError, match="needs a C\\+\\+ compiler"):
        trainer._can_compile(torch.device("cpu"))
