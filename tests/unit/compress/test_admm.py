"""ADMM on a tiny model: W is driven onto Z ∈ 2:4 ∩ INT8, rho rises, duals accumulate, state resumes."""
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from holoserve.compress.config import AdmmConfig, PhaseConfig, Preset
from holoserve.compress.data import encode
from holoserve.core.tokenizer import load_tokenizer
from holoserve.compress.layers import encoder_linear_names
from holoserve.compress.project import project
from holoserve.compress.admm import Admm
from holoserve.compress.trainer import TrainOptions, train_phase
from holoserve.data.glue import read_split
from holoserve.core.numerics import grid_codes, is_nm_sparse

from tests.helpers.checkpoints import write_glue
from tests.helpers.tiny import make_tiny_bert

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("admm")
    model_dir = make_tiny_bert(root / "tiny", hidden=32, intermediate=64)
    glue = write_glue(root / "glue")
    tok = load_tokenizer(model_dir, 32)
    data = encode(tok, read_split("sst2", "train", glue))
    return model_dir, data


def _model(model_dir: Path):
    return AutoModelForSequenceClassification.from_pretrained(str(model_dir), local_files_only=True)


def test_admm_drives_w_onto_the_constraint_set(setup):
    model_dir, data = setup
    torch.manual_seed(0)
    model = _model(model_dir)
    layers = encoder_linear_names(model)
    preset = Preset(name="t", batch_size=16)
    cfg = AdmmConfig(interval=5, rho_start=1e-3, rho_end=0.3)
    admm = Admm(model, layers, cfg, total_steps=80)
    r0 = admm.residual()
    rho0 = admm.rho
    train_phase("admm", model, PhaseConfig(steps=80, lr=1e-3), data, preset, 0, None,
                TrainOptions(admm=admm, progress=False))
    r1 = admm.residual()
    assert r0 > 0.2  # a dense random weight is far from 2:4
    assert r1 < r0 / 5
    assert admm.k == 16 and admm.rho > rho0 * 100
    for name, z in admm.Z.items():  # Z always lies in S ∩ Q
        zz = z.numpy()
        assert is_nm_sparse(zz)
        assert grid_codes(zz, project(z).scales.numpy()) is not None
    # the duals are non-zero: they carry the accumulated constraint violation
    assert sum(float(u.abs().sum()) for u in admm.U.values()) > 0


def test_without_penalty_w_stays_far(setup):
    """Control: the same training without the ADMM penalty leaves W dense (the test above can fail)."""
    model_dir, data = setup
    torch.manual_seed(0)
    model = _model(model_dir)
    layers = encoder_linear_names(model)
    admm = Admm(model, layers, AdmmConfig(interval=5, rho_start=1e-9, rho_end=1e-9), total_steps=40)
    train_phase("admm", model, PhaseConfig(steps=40, lr=1e-3), data, Preset(name="t", batch_size=16), 0, None,
                TrainOptions(admm=admm, progress=False))
    assert admm.residual() > 0.2


def test_rho_rescales_the_scaled_dual():
    lin = torch.nn.Linear(8, 4)
    model = torch.nn.Module()
    model.add_module("encoder", torch.nn.Module())
    admm = Admm.__new__(Admm)
    Admm.__init__(admm, torch.nn.ModuleDict({"l": lin}), ["l"], AdmmConfig(interval=1, rho_start=0.01, rho_end=1.0),
                  total_steps=3)
    assert admm.num_updates == 3
    rhos = [admm.rho]
    admm.update()
    u1 = admm.U["l"].clone()
    rhos.append(admm.rho)
    assert rhos == pytest.approx([0.01, 0.1])
    with torch.no_grad():
        w = admm.weights["l"]
        expected = (u1 + w - project(w + u1).z) * (0.1 / 1.0)
    admm.update()
    assert admm.rho == pytest.approx(1.0)
    assert torch.allclose(admm.U["l"], expected, atol=1e-7)


def test_phase_resumes_exactly_from_mid_phase_state(setup, tmp_path):
    """Stop after a mid-phase save, resume in a fresh process state: same weights as an uninterrupted run."""
    model_dir, data = setup
    preset = Preset(name="t", batch_size=16, save_every=10)
    cfg = PhaseConfig(steps=20, lr=1e-3)

    def run(state):
        torch.manual_seed(1)
        model = _model(model_dir)
        admm = Admm(model, encoder_linear_names(model), AdmmConfig(interval=5), total_steps=20)
        train_phase("admm", model, cfg, data, preset, 3, state, TrainOptions(admm=admm, progress=False))
        return model, admm

    full, admm_full = run(tmp_path / "a")  # leaves its step-10 save behind
    assert (tmp_path / "a" / "admm-progress.json").is_file()
    torch.manual_seed(123)  # the resumed run must restore the RNG itself
    resumed, admm_res = run(tmp_path / "a")
    for (k, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), k
    assert admm_full.k == admm_res.k
    for k in admm_full.U:
        assert torch.equal(admm_full.U[k], admm_res.U[k])


def test_penalty_in_the_loss_also_drives_w_onto_the_constraint_set(setup):
    """penalty="loss" (ADMM-DS's way): AdamW minimises task + rho/2||W - Z + U||^2 together; the
    decoupled step is off, and each Z-update records how much of the 2:4 mask moved."""
    model_dir, data = setup
    torch.manual_seed(0)
    model = _model(model_dir)
    layers = encoder_linear_names(model)
    admm = Admm(model, layers, AdmmConfig(interval=10, rho_start=10.0, rho_end=10.0, penalty="loss"), total_steps=80)
    assert admm.penalty_loss() is not None and float(admm.penalty_loss().detach()) > 0
    before = {k: w.detach().clone() for k, w in admm.weights.items()}
    admm.penalty_step()  # a no-op in this mode
    assert all(torch.equal(before[k], w) for k, w in admm.weights.items())
    r0 = admm.residual()
    train_phase("admm", model, PhaseConfig(steps=80, lr=1e-3), data, Preset(name="t", batch_size=16), 0, None,
                TrainOptions(admm=admm, progress=False))
    assert admm.residual() < r0 / 2  # Adam moves each weight by ~lr per step; the control stays above 0.2
    assert len(admm.mask_moves) == 8 and all(0 <= m <= 0.5 for m in admm.mask_moves)
    assert sum(m > 0 for m in admm.mask_moves) >= 4  # the mask keeps moving while W is trained
    assert admm.state_meta()["mask_moves"] == admm.mask_moves


def test_bad_admm_settings_are_refused():
    from holoserve import HoloServeError

    lin = torch.nn.ModuleDict({"l": torch.nn.Linear(8, 4)})
    for cfg, word in ((AdmmConfig(penalty="adam"), "penalty"), (AdmmConfig(rho_end=0.0), "rho"),
                      (AdmmConfig(interval=0), "interval")):
        with pytest.raises(HoloServeError, match=word):
            Admm(lin, ["l"], cfg, total_steps=10)


def test_guided_admm_z_minimises_the_weighted_penalty_and_moves_the_forward_mask():
    """Stage 2 (GuidedAdmm): the penalty weighs input j by d_j = importance_j^2 / mean, so the Z-step's 2:4 choice by
    |w| x importance keeps, in each group, the 2 entries whose removal costs most in that penalty; the forward
    then computes W on Z's mask (rounded), gradients reach the pruned entries, and a Z-step moves the mask."""
    from torch import nn

    from holoserve.compress.admm import GuidedAdmm
    from holoserve.compress.project import nm_mask

    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 8, bias=False)

    net = Net()
    imp = torch.rand(16) + 0.1
    start = nm_mask(net.lin.weight.detach(), importance=imp)
    start_copy = start.clone()
    guide = GuidedAdmm(net, ["lin"], {"lin": start}, AdmmConfig(guide_rho=0.5, interval=1), total_steps=10,
                       importance={"lin": imp})
    torch.testing.assert_close(guide.d["lin"].flatten(), imp ** 2 / (imp ** 2).mean())
    w = guide.weights["lin"]
    with torch.no_grad():
        w.copy_(torch.randn(8, 16))  # the latent weights move (as training would move them)
    x = torch.randn(4, 16, requires_grad=True)
    net.lin(x).sum().backward()
    assert (w.grad[~start] != 0).any()  # straight through the mask: the pruned entries get a gradient
    guide.update()
    z = guide.Z["lin"]
    kept = nm_mask(w.detach(), importance=imp)  # Z = Π(W + U), and U was zero before this Z-step
    assert torch.equal(guide.params["lin"].mask, kept) and not (z[~kept] != 0).any()
    # the kept pair of each group is the one whose loss costs most in sum_j d_j (w_ij - z_ij)^2
    cost = (guide.d["lin"] * w.detach() ** 2).reshape(8, 4, 4)
    best = torch.zeros_like(cost, dtype=torch.bool).scatter_(-1, cost.topk(2, dim=-1).indices, True)
    assert torch.equal(kept, best.reshape(8, 16))
    assert guide.k == 1 and guide.mask_moves[0] > 0
    assert torch.equal(start, start_copy) and not torch.equal(guide.masks()["lin"], start)  # the caller's mask stays
    with torch.no_grad():
        out = net.lin(torch.eye(16))  # row j: the forward weight's column j
    torch.testing.assert_close(out.T, project(w.detach(), mask=kept).z)


def test_layerwise_admm_on_the_default_masks_keeps_them_and_writes_grid_points(setup):
    """projection=admm_fixed_mask on a tiny BERT (compress.admm.layerwise_projection with fixed_mask): every
    Linear keeps exactly the mask the default chose (|w| x ||x_j||^0.5 on the teacher), its weights end exactly
    on 2:4 ∩ INT8, and its output error on the fit rows is at most the default OBS projection's."""
    from holoserve.compress.admm import ProjectionOptions, layerwise_projection
    from holoserve.compress.data import collate
    from holoserve.compress.project import AdmmSolverOptions
    from holoserve.compress.quant import input_channel_norms
    from holoserve.compress.sparsify import hard_masks

    model_dir, data = setup
    batches = [collate(data, list(range(i, i + 16))) for i in range(0, 64, 16)]
    for b in batches:
        b.pop("labels")
    projected = {}
    for method, fixed, damp in (("obs", False, 0.01), ("admm", True, 0.1)):
        model = _model(model_dir).eval()
        layers = encoder_linear_names(model)
        importance = {k: v.sqrt() for k, v in input_channel_norms(model, layers, batches).items()}
        default = hard_masks(model, layers, importance=importance)
        masks, diag = layerwise_projection(model, layers, batches, batches,
                                           ProjectionOptions(method=method, fixed_mask=fixed,
                                                             solver=AdmmSolverOptions(damp=damp)),
                                           masks=default, importance=importance)
        projected[method] = diag
        for name in layers:
            assert torch.equal(masks[name], default[name])
            w = model.get_submodule(name).weight.detach()
            if method == "admm":
                p = project(w, mask=default[name])
                assert is_nm_sparse(w.numpy()) and not (w[~default[name]] != 0).any()
                assert grid_codes(w.numpy(), p.scales.numpy()) is not None
                assert diag[name]["mask_moved_vs_start"] == 0 and diag[name]["iters"] >= 1
    worse = [k for k in projected["obs"]
             if projected["admm"][k]["fit_vs_nearest"] > projected["obs"][k]["fit_vs_nearest"]]
    assert not worse, worse
