"""Property tests of gluon.lmo (docs/algorithms.md section 2).

For every exact LMO: D = lmo(M) lies in the unit ball of its norm, <M, D> = -||M||_* (the dual
norm), and no random feasible point does better. Newton-Schulz: an approximate polar factor
with the same singular vectors. assign_lmos: the Scion default rule, the Euclidean rule, regex
overrides.
"""
from __future__ import annotations

import math

import pytest
import torch

from gluon.lmo import (RMS, Euclidean, Sign, Spectral, assign_lmos, make_lmo, newton_schulz)

torch.set_num_threads(1)


def _m(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _spec(x):
    return torch.linalg.matrix_norm(x.reshape(x.shape[0], -1), ord=2)


def _nuc(x):
    return torch.linalg.matrix_norm(x.reshape(x.shape[0], -1), ord="nuc")


def _rms(x):
    return x.pow(2).mean().sqrt()


# (lmo, primal norm, dual norm, projection of an arbitrary point onto the unit sphere)
EXACT = {
    "euclidean": (Euclidean(), lambda x: x.norm(), lambda x: x.norm(), lambda z: z / z.norm()),
    "sign": (Sign(scale=False), lambda x: x.abs().max(), lambda x: x.abs().sum(),
             lambda z: z / z.abs().max()),
    "rms": (RMS(), _rms, lambda x: math.sqrt(x.numel()) * x.norm(), lambda z: z / _rms(z)),
    "spectral_svd": (Spectral(ns_steps=0, scale=False), _spec, _nuc, lambda z: z / _spec(z)),
}
SHAPES = [(7,), (4, 6), (6, 4), (3, 2, 2, 2)]


def _cases():
    for name in EXACT:
        for shape in SHAPES:
            if name == "spectral_svd" and len(shape) < 2:
                continue
            yield name, shape


@pytest.mark.parametrize("name,shape", list(_cases()))
def test_exact_lmo_is_feasible_and_attains_the_dual_norm(name, shape):
    lmo, norm, dual, _ = EXACT[name]
    for seed in range(5):
        m = _m(shape, seed)
        d = lmo(m)
        assert d.shape == m.shape and d.dtype == m.dtype
        assert norm(d) <= 1 + 1e-9
        assert float((m * d).sum()) == pytest.approx(-float(dual(m)), rel=1e-9)
        assert lmo.dual_norm(m) == pytest.approx(float(dual(m)), rel=1e-9)


@pytest.mark.parametrize("name,shape", list(_cases()))
def test_no_random_feasible_point_beats_the_lmo(name, shape):
    lmo, norm, _, project = EXACT[name]
    m = _m(shape, 1)
    best = float((m * lmo(m)).sum())
    g = torch.Generator().manual_seed(2)
    for _ in range(300):
        z = project(torch.randn(shape, generator=g, dtype=torch.float64))
        assert norm(z) <= 1 + 1e-9
        assert float((m * z).sum()) >= best - 1e-9
    # a point near the optimum is feasible after projection and still no better
    z = project(lmo(m) + 0.01 * torch.randn(shape, generator=g, dtype=torch.float64))
    assert float((m * z).sum()) >= best - 1e-9


def test_lmo_is_positively_homogeneous_of_degree_zero():
    m = _m((5, 3), 3)
    for lmo, *_ in EXACT.values():
        assert torch.allclose(lmo(7.5 * m), lmo(m), atol=1e-12)


def test_sign_scale_divides_by_row_length():
    m = _m((4, 6), 4)
    assert torch.equal(Sign(scale=True)(m), -torch.sign(m) / 6)
    conv = _m((4, 3, 2, 2), 4)
    assert torch.equal(Sign(scale=True)(conv), -torch.sign(conv) / 12)
    v = _m((5,), 4)   # vectors are not scaled
    assert torch.equal(Sign(scale=True)(v), -torch.sign(v))


# Scion (LIONS-EPFL/scion): Spectral scales a d_out x d_in matrix by sqrt(d_out/d_in);
# SpectralConv scales a (c_out, c_in, k, k) kernel by sqrt(c_out/c_in)/k^2.
@pytest.mark.parametrize("shape,factor", [((4, 9), math.sqrt(4 / 9)), ((9, 4), math.sqrt(9 / 4)),
                                          ((8, 3, 3, 3), math.sqrt(8 / 3) / 9),
                                          ((6, 4, 2, 2), math.sqrt(6 / 4) / 4)])
def test_spectral_scale_follows_scion(shape, factor):
    m = _m(shape, 5)
    plain = Spectral(ns_steps=0, scale=False)(m)
    scaled = Spectral(ns_steps=0, scale=True)(m)
    assert torch.allclose(scaled, plain * factor, atol=1e-12)
    ns_plain = Spectral(ns_steps=5, scale=False)(m)
    ns_scaled = Spectral(ns_steps=5, scale=True)(m)
    assert torch.allclose(ns_scaled, ns_plain * factor, atol=1e-6)


# ---------------------------------------------------------------- Newton-Schulz

def _well_conditioned(rows, cols, seed, lo=0.5, hi=2.0):
    g = torch.Generator().manual_seed(seed)
    r = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, r, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, r, generator=g, dtype=torch.float64))
    s = lo + (hi - lo) * torch.rand(r, generator=g, dtype=torch.float64)
    return (u * s) @ v.T, u, v


@pytest.mark.parametrize("rows,cols", [(8, 16), (16, 8), (12, 12)])
def test_newton_schulz_approximates_the_polar_factor(rows, cols):
    for seed in range(3):
        m, u, v = _well_conditioned(rows, cols, seed)
        x = newton_schulz(m, steps=5)
        assert x.shape == m.shape
        sv = torch.linalg.svdvals(x)
        assert sv.min() >= 0.6 and sv.max() <= 1.2, sv
        polar = u @ v.T
        rel = (x - polar).norm() / polar.norm()
        # every singular value within 0.4 of 1 and the singular vectors kept => rel <= 0.4
        assert rel <= 0.4
        # an odd matrix polynomial keeps the singular vectors: U^T X V is diagonal
        core = u.T @ x @ v
        off = core - torch.diag(torch.diagonal(core))
        assert off.norm() <= 1e-6 * core.norm()
        assert torch.all(torch.diagonal(core) > 0)


def test_newton_schulz_improves_with_steps_towards_unit_singular_values():
    m, u, v = _well_conditioned(10, 20, 7, lo=0.2, hi=3.0)
    spread = [float((torch.linalg.svdvals(newton_schulz(m, steps=s)) - 1).abs().max())
              for s in (1, 2, 3, 5)]
    assert spread[-1] < spread[0]
    assert spread[-1] <= 0.35


def test_spectral_ns_lmo_is_a_descent_direction_close_to_the_exact_one():
    m = _m((12, 20), 8)
    exact = Spectral(ns_steps=0, scale=False)(m)
    approx = Spectral(ns_steps=5, scale=False)(m)
    assert float((m * approx).sum()) < 0
    # cosine between the NS step and the exact one
    cos = float((exact * approx).sum() / (exact.norm() * approx.norm()))
    assert cos >= 0.9


@pytest.mark.parametrize("ns_steps", [0, 5])
def test_conv_kernel_is_flattened_to_out_by_rest_and_reshaped_back(ns_steps):
    k = _m((6, 3, 3, 3), 9)
    lmo = Spectral(ns_steps=ns_steps, scale=False)
    d = lmo(k)
    assert d.shape == k.shape
    flat = lmo(k.reshape(6, 27))
    assert torch.allclose(d.reshape(6, 27), flat, atol=1e-12)
    if ns_steps == 0:
        assert float(_spec(d)) == pytest.approx(1.0, rel=1e-9)
        assert float(-(k * d).sum()) == pytest.approx(float(_nuc(k)), rel=1e-9)


def test_spectral_keeps_dtype():
    m = _m((4, 5), 10)
    assert Spectral(ns_steps=5)(m).dtype == torch.float64
    assert Spectral(ns_steps=5)(m.float()).dtype == torch.float32


# ---------------------------------------------------------------- assign_lmos

NAMED = [("conv1.weight", torch.Size([8, 3, 3, 3])), ("conv1.bias", torch.Size([8])),
         ("bn1.weight", torch.Size([8])), ("fc.weight", torch.Size([16, 72])),
         ("fc.bias", torch.Size([16])), ("head.weight", torch.Size([10, 16])),
         ("head.bias", torch.Size([10]))]


def test_assign_lmos_scion_default():
    blocks = assign_lmos(NAMED, ns_steps=3)
    kinds = {b.name: type(b.lmo) for b in blocks}
    assert [b.name for b in blocks] == [n for n, _ in NAMED]
    assert kinds["conv1.weight"] is Spectral and kinds["fc.weight"] is Spectral
    assert kinds["head.weight"] is Sign
    for n in ("conv1.bias", "bn1.weight", "fc.bias", "head.bias"):
        assert kinds[n] is RMS
    assert all(b.lmo.ns_steps == 3 for b in blocks if isinstance(b.lmo, Spectral))
    # Scion's airbench radii: the head's is 16 times the others'
    assert all(b.scale == (16.0 if b.name == "head.weight" else 1.0) for b in blocks)
    assert all(b.scale == 1.0 for b in assign_lmos(NAMED, head_scale=1.0))


def test_assign_lmos_euclidean_default():
    blocks = assign_lmos(NAMED, default="euclidean")
    assert all(isinstance(b.lmo, Euclidean) for b in blocks)


def test_assign_lmos_rules_override_first_match_wins():
    rules = [(r"^head\.", "euclidean", 0.5), (r"bias$", "sign", 2.0), (r"bias$", "rms", 3.0)]
    blocks = {b.name: b for b in assign_lmos(NAMED, rules, ns_steps=4)}
    assert isinstance(blocks["head.weight"].lmo, Euclidean) and blocks["head.weight"].scale == 0.5
    assert isinstance(blocks["head.bias"].lmo, Euclidean) and blocks["head.bias"].scale == 0.5
    assert isinstance(blocks["fc.bias"].lmo, Sign) and blocks["fc.bias"].scale == 2.0
    # unmatched parameters keep the default rule
    assert isinstance(blocks["fc.weight"].lmo, Spectral) and blocks["fc.weight"].scale == 1.0
    assert isinstance(blocks["bn1.weight"].lmo, RMS)
    # a spectral rule gets the requested ns_steps
    spec = assign_lmos(NAMED, [(r"head\.weight", "spectral", 1.0)], ns_steps=4)
    assert isinstance(spec[5].lmo, Spectral) and spec[5].lmo.ns_steps == 4


def test_assign_lmos_bad_names_raise():
    with pytest.raises(ValueError, match="unknown LMO"):
        assign_lmos(NAMED, [(r"head", "frobenius", 1.0)])
    with pytest.raises(ValueError, match="unknown default"):
        assign_lmos(NAMED, default="muon")
    with pytest.raises(ValueError, match="euclidean"):   # lists the valid names
        make_lmo("l2")
