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
