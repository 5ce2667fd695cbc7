"""Property tests of gluon.compressors: Definitions 1.1 / 1.2 of the paper, RandK's shared-seed
indices, the wire format and the normalised cost (docs/algorithms.md section 3).

Statistical tests draw N messages with fixed seeds and compare sample means with the expected
value within a few standard errors estimated from the same samples, so a wrong scale or a
biased rounding rule fails while sampling noise does not.
"""
from __future__ import annotations

import math

import pytest
import torch

from gluon.compressors import (COMPRESSORS, QSGD, Identity, Natural, Packet, RandK, TopK, Zero,
                               make_compressor, message_seed, random_subset)

torch.set_num_threads(1)

N_SAMPLES = 3000   # messages per statistical test
Z = 5.0            # tolerance in standard errors


def _unbiased():
    return [Identity(), RandK(0.1), RandK(0.5), Natural(), QSGD(1), QSGD(4)]


def _contractions():
    return [Identity(), Zero(), TopK(0.1), TopK(0.5)]


def _all():
    return [Identity(), Zero(), RandK(0.1), TopK(0.1), Natural(), QSGD(1), QSGD(4)]


def _x(shape=(4, 5), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # spread magnitudes over several binades so natural compression has work to do
    return (torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g))).to(dtype)


def _samples(c, x, n=N_SAMPLES):
    return torch.stack([c(x, seed=message_seed(7, 0, s, 0)) for s in range(n)])


# ---------------------------------------------------------------- Definition 1.1

@pytest.mark.parametrize("c", _unbiased(), ids=repr)
def test_unbiased_compressors_have_mean_x(c):
    x = _x(dtype=torch.float64)
    q = _samples(c, x)
    assert q.shape == (N_SAMPLES, *x.shape)
    mean = q.mean(0)
    se = q.std(0) / math.sqrt(N_SAMPLES)
    # a coordinate with zero sample variance must be reproduced exactly
    assert torch.all((mean - x).abs() <= Z * se + 1e-6 * x.abs()), (mean - x, se)


@pytest.mark.parametrize("c", _unbiased(), ids=repr)
def test_unbiased_second_moment_bounded_by_omega(c):
    x = _x(dtype=torch.float64)
    q = _samples(c, x)
    sq = q.flatten(1).pow(2).sum(1)
    bound = (c.omega(x.numel()) + 1) * x.pow(2).sum()
    se = sq.std() / math.sqrt(N_SAMPLES)
    assert sq.mean() <= bound * (1 + 1e-6) + Z * se, (float(sq.mean()), float(bound))


def test_randk_second_moment_is_exactly_omega_plus_one():
    # For RandK the bound of Definition 1.1 is tight: E||Q(x)||^2 = (d/k) ||x||^2.
    c, x = RandK(0.2), _x(dtype=torch.float64)
    sq = _samples(c, x).flatten(1).pow(2).sum(1)
    expected = (c.omega(x.numel()) + 1) * x.pow(2).sum()
    se = sq.std() / math.sqrt(N_SAMPLES)
    assert abs(sq.mean() - expected) <= Z * se


def test_unbiased_compressors_are_not_contractions_and_vice_versa():
    for c in (RandK(0.1), Natural(), QSGD(2)):
        assert c.unbiased
        with pytest.raises(NotImplementedError):
            c.delta(10)
    for c in (TopK(0.1), Zero()):
        assert not c.unbiased
        with pytest.raises(NotImplementedError):
            c.omega(10)


def test_omega_constants():
    assert Identity().omega(50) == 0.0
    assert RandK(0.1).omega(100) == pytest.approx(100 / 10 - 1)
    assert Natural().omega(100) == pytest.approx(1 / 8)
    assert QSGD(1).omega(100) == pytest.approx(min(100, 10))
    assert QSGD(20).omega(100) == pytest.approx(min(100 / 400, 10 / 20))


# ---------------------------------------------------------------- Definition 1.2

@pytest.mark.parametrize("c", _contractions(), ids=repr)
def test_contraction_property(c):
    d = 20
    for seed in range(200):
        x = _x((d,), seed)
        if seed % 4 == 0:   # equal magnitudes: the worst case of TopK, equality must still hold
            x = torch.sign(x)
        err = (x - c(x, seed)).pow(2).sum()
        assert err <= (1 - c.delta(d)) * x.pow(2).sum() * (1 + 1e-6) + 1e-12


def test_topk_keeps_the_largest_magnitudes_unscaled():
    c = TopK(0.25)
    x = _x((4, 5), 3)
    y = c(x)
    kept = y != 0
    assert int(kept.sum()) == c.k(x.numel()) == 5
    assert torch.equal(y[kept], x[kept])
    assert x[kept].abs().min() >= x[~kept].abs().max()


def _topk_reference(x, k):
    """TopK's rule by brute force: magnitudes in descending order (NaN first), equal ones by
    ascending index (a stable sort), the first k, ascending."""
    order = torch.sort(x.reshape(-1).double().abs(), descending=True, stable=True).indices
    return sorted(order[:k].tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("layout", ["normal", "ascending", "heavy_tail", "sampled_tail", "ties"])
@pytest.mark.parametrize("shape,density", [((64, 64, 3, 3), 0.01), ((64, 64, 3, 3), 0.1),
                                           ((9216,), 0.01), ((3456,), 0.01), ((123,), 0.1),
                                           ((64,), 0.01), ((16,), 0.5), ((40,), 1.0)])
def test_topk_keeps_the_k_largest_magnitudes_and_the_lowest_indices_of_ties(dtype, layout,
                                                                            shape, density):
    """On CPU TopK selects with numpy (a sampled threshold, then introselect, with a fallback
    to the whole block); on bf16 with a stable sort. Both must keep exactly the rule's set, for
    layouts that make the sampled threshold right (normal), too low (heavy_tail), too high
    (sampled_tail: every 16th coordinate, the only ones the threshold sees, is large, so fewer
    than k pass it), and for many equal magnitudes at the k-th place (ties: values in
    {-2, -1, 0, 1, 2}, as binary features give on a5a)."""
    n = math.prod(shape)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    if layout == "ascending":
        x = torch.linspace(-1, 1, n, dtype=torch.float64) ** 3 + 1e-3 * x
    if layout == "heavy_tail":
        x = x * torch.exp(3 * torch.randn(n, generator=g, dtype=torch.float64))
    if layout == "sampled_tail":
        x[::16] = 100 + torch.randperm(len(x[::16]), generator=g).double()
    if layout == "ties":
        x = torch.randint(-2, 3, (n,), generator=g).double()
    x = x.to(dtype).reshape(shape)
    c = TopK(density)
    p = c.compress(x, seed=0)
    idx = p.wire["indices"]
    assert idx.dtype == torch.int32 and p.wire["values"].dtype == dtype
    assert idx.tolist() == _topk_reference(x, c.k(n))
    assert torch.equal(p.wire["values"], x.reshape(-1)[idx.long()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_counts_nan_as_the_largest_magnitude(dtype):
    x = torch.randn(36864, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[[7, 1000, 20001]] = float("nan")          # none on the sampled stride
    c = TopK(0.01)
    idx = c.compress(x, seed=0).wire["indices"].tolist()
    assert {7, 1000, 20001} <= set(idx)
    assert idx == _topk_reference(x, c.k(x.numel()))
    x[::2] = float("nan")                        # more NaNs than k: the lowest-index ones
    nan_at = torch.isnan(x.float()).nonzero().flatten().tolist()
    assert c.compress(x, seed=0).wire["indices"].tolist() == nan_at[:c.k(x.numel())]


def test_zero_returns_zeros_of_the_same_shape_and_dtype():
    x = _x((3, 2), dtype=torch.float64)
    y = Zero()(x, seed=5)
    assert y.shape == x.shape and y.dtype == x.dtype and not y.any()


# ---------------------------------------------------------------- output structure

def test_natural_rounds_to_bracketing_powers_of_two():
    x = _x((200,), 1)
    x[::17] = 0.0
    x[5] = 0.25   # an exact power of two is sent exactly
    for s in range(20):
        y = Natural()(x, seed=s)
        nz = x != 0
        assert torch.all(y[~nz] == 0)
        assert torch.all(torch.sign(y[nz]) == torch.sign(x[nz]))
        e = torch.log2(y[nz].abs())
        assert torch.equal(e, torch.round(e))          # |y| is a power of two
        lo = torch.exp2(torch.floor(torch.log2(x[nz].abs())))
        assert torch.all((y[nz].abs() == lo) | (y[nz].abs() == 2 * lo))
        assert y[5] == 0.25


def test_qsgd_levels_are_bracketing_multiples_of_norm_over_s():
    s = 3
    x = _x((30,), 2)
    norm = x.norm()
    for seed in range(20):
        y = QSGD(s)(x, seed=seed)
        lvl = y.abs() * s / norm
        assert torch.allclose(lvl, torch.round(lvl), atol=1e-4)
        exact = x.abs() * s / norm
        assert torch.all(torch.round(lvl) >= torch.floor(exact) - 1e-4)
        assert torch.all(torch.round(lvl) <= torch.ceil(exact) + 1e-4)
        assert torch.all((torch.sign(y) == torch.sign(x)) | (y == 0))


@pytest.mark.parametrize("c", _all(), ids=repr)
def test_shape_dtype_preserved_and_same_seed_same_output(c):
    x = _x((3, 4, 2))
    a, b = c(x, seed=11), c(x, seed=11)
    assert a.shape == x.shape and a.dtype == x.dtype
    assert torch.equal(a, b)


# ---------------------------------------------------------------- RandK and its indices

def test_randk_keeps_exactly_k_distinct_coordinates_scaled_by_d_over_k():
    d, c = 50, RandK(0.2)
    k = c.k(d)
    assert k == 10
    x = _x((d,), 4) + 10.0 * torch.sign(_x((d,), 5))   # no zero coordinate
    for seed in range(50):
        p = c.compress(x, seed)
        y = c.decompress(p)
        kept = y != 0
        assert int(kept.sum()) == k
        assert torch.allclose(y[kept], x[kept] * (d / k))
        idx = random_subset(d, k, seed, x.device)
        assert torch.equal(torch.sort(idx).values, torch.nonzero(kept).flatten())


def test_randk_decompresses_from_values_and_seed_alone():
    d, x = 40, _x((5, 8), 6)
    sender = RandK(0.25)
    p = sender.compress(x, seed=123456789)
    assert set(p.wire) == {"values"}                     # no indices on the wire
    # A receiver that knows only the values, the shape, k and the shared seed:
    received = Packet({"values": p.wire["values"].clone()}, x.shape, seed=123456789,
                      meta={"k": RandK(0.25).k(d)})
    assert torch.equal(RandK(0.25).decompress(received), sender.decompress(p))
    # ... and a wrong seed puts the values elsewhere
    wrong = Packet(received.wire, x.shape, seed=987654321, meta=received.meta)
    assert not torch.equal(RandK(0.25).decompress(wrong), sender.decompress(p))


def test_message_seeds_differ_across_coordinates():
    seeds = {message_seed(r, w, s, b) for r in range(3) for w in range(4) for s in range(20)
             for b in range(3)}
    assert len(seeds) == 3 * 4 * 20 * 3
    assert all(0 <= s < 2**63 for s in seeds)


def _check_subsets(numel, k, n_draws):
    counts = torch.zeros(numel)
    for seed in range(n_draws):
        idx = random_subset(numel, k, seed, "cpu")
        assert idx.shape == (k,)
        assert idx.dtype == torch.long
        assert int(idx.min()) >= 0 and int(idx.max()) < numel
        assert torch.unique(idx).numel() == k                    # distinct
        assert torch.equal(idx, random_subset(numel, k, seed, "cpu"))   # reproducible
        counts += torch.bincount(idx, minlength=numel)
    return counts


def test_random_subset_small_path_is_uniform():
    numel, k, n = 60, 6, 3000
    counts = _check_subsets(numel, k, n)
    p = k / numel
    mean, sd = n * p, math.sqrt(n * p * (1 - p))
    assert (counts - mean).abs().max() <= Z * sd
    # chi-square with numel - 1 dof (the per-index counts are negatively correlated, which
    # only shrinks the statistic): mean 59, sd ~ 11
    chi2 = float(((counts - mean) ** 2 / mean).sum())
    assert chi2 <= (numel - 1) + Z * math.sqrt(2 * (numel - 1))


def test_random_subset_large_path_is_distinct_and_uniform(monkeypatch):
    numel, k, n = 70_000, 1000, 300       # numel > 65536 and 8k <= numel: randint/unique path
    real_randperm = torch.randperm

    def no_randperm(*a, **kw):
        raise AssertionError("the large-block path must not call randperm here")

    monkeypatch.setattr(torch, "randperm", no_randperm)
    counts = _check_subsets(numel, k, n)
    monkeypatch.setattr(torch, "randperm", real_randperm)
    # rough uniformity: 20 equal bins
    bins = counts.reshape(20, -1).sum(1)
    p = 1 / 20
    total = n * k
    mean, sd = total * p, math.sqrt(total * p * (1 - p))
    assert (bins - mean).abs().max() <= Z * sd
    # and no index is favoured: the max count of one index stays near its binomial mean
    p1 = k / numel
    assert counts.max() <= n * p1 + 7 * math.sqrt(n * p1) + 3


def test_random_subset_large_path_first_distinct_values_are_not_sorted():
    # The first k distinct values of the stream, in order of appearance: an unsorted sample.
    idx = random_subset(100_000, 500, 3, "cpu")
    assert not torch.equal(idx, torch.sort(idx).values)


# ---------------------------------------------------------------- wire bytes and cost

@pytest.mark.parametrize("c", _all(), ids=repr)
@pytest.mark.parametrize("numel", [1, 7, 20, 64, 123])
def test_packet_bytes_equal_wire_bytes(c, numel):
    x = _x((numel,), numel)
    p = c.compress(x, seed=1)
    assert p.nbytes == c.wire_bytes(numel)
    assert p.nbytes == sum(t.numel() * t.element_size() for t in p.wire.values())


def test_wire_contents():
    x = _x((100,), 8)
    assert set(RandK(0.1).compress(x, 1).wire) == {"values"}
    tp = TopK(0.1).compress(x, 1)
    assert set(tp.wire) == {"values", "indices"}
    assert tp.wire["indices"].dtype == torch.int32 and tp.wire["indices"].numel() == 10
    assert Zero().compress(x, 1).wire == {}
    assert RandK(0.1).wire_bytes(100) == 4 * 10
    assert TopK(0.1).wire_bytes(100) == 8 * 10
    assert Identity().wire_bytes(100) == 400


@pytest.mark.parametrize("d", [10, 100, 1000])
def test_normalised_costs(d):
    assert Identity().cost(d) == 1.0
    assert Zero().cost(d) == 0.0
    for density in (0.01, 0.1, 0.5, 1.0):
        k = max(1, round(density * d))
        assert RandK(density).cost(d) == pytest.approx(k / d)
        assert TopK(density).cost(d) == pytest.approx(k / d)
    assert Natural().cost(d) == pytest.approx(9 / 32)
    for s in (1, 3, 127):   # docstring: (32 + d (1 + ceil(log2(s + 1)))) / (32 d)
        assert QSGD(s).cost(d) == pytest.approx((32 + d * (1 + math.ceil(math.log2(s + 1))))
                                                / (32 * d))


@pytest.mark.parametrize("c", _all(), ids=repr)
def test_normalised_cost_never_exceeds_actual_bytes(c):
    # cost is in units of dense fp32 coordinates: cost * 4 * numel <= bytes actually sent,
    # with equality where the paper's convention and the wire agree.
    for numel in (8, 64, 100):
        assert c.cost(numel) * 4 * numel <= c.wire_bytes(numel) + 1e-9
    if isinstance(c, (Identity, Zero, RandK, Natural)):
        assert c.cost(64) * 4 * 64 == pytest.approx(c.wire_bytes(64))


def test_sparse_k_is_at_least_one_and_at_most_numel():
    assert RandK(0.01).k(10) == 1
    assert TopK(1.0).k(10) == 10
    x = _x((10,), 9)
    assert torch.equal(RandK(1.0)(x, 3), x)      # density 1: every coordinate, scale 1
    assert torch.equal(TopK(1.0)(x), x)


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("name", ["randk", "topk"])
@pytest.mark.parametrize("density", [0, 1.5, -1, float("nan")])
def test_bad_density_rejected(name, density):
    with pytest.raises(ValueError, match=r"density.*\(0, 1\]"):
        make_compressor(name, density=density)
    with pytest.raises(ValueError, match=r"density.*\(0, 1\]"):
        COMPRESSORS[name](density)


def test_unknown_compressor_name_lists_valid_names():
    with pytest.raises(ValueError) as err:
        make_compressor("randomk", density=0.1)
    for name in ("identity", "zero", "randk", "topk", "natural", "qsgd"):
        assert name in str(err.value)


@pytest.mark.parametrize("name,kwargs", [("randk", {"density": 0.1, "levels": 2}),
                                         ("identity", {"density": 0.1}),
                                         ("qsgd", {"density": 0.1}),
                                         ("natural", {"seed": 1})])
def test_unknown_option_rejected(name, kwargs):
    with pytest.raises(ValueError, match="got"):
        make_compressor(name, **kwargs)


@pytest.mark.parametrize("levels", [0, 128, -3])
def test_bad_qsgd_levels_rejected(levels):
    with pytest.raises(ValueError, match="levels"):
        make_compressor("qsgd", levels=levels)


def test_make_compressor_builds_each_compressor():
    assert isinstance(make_compressor("identity"), Identity)
    assert isinstance(make_compressor("zero"), Zero)
    assert make_compressor("randk", density=0.3).density == 0.3
    assert make_compressor("topk", density=0.3).density == 0.3
    assert isinstance(make_compressor("natural"), Natural)
    assert make_compressor("qsgd", levels=5).levels == 5
