"""Property tests of gluon.methods and gluon.engine on small synthetic least-squares problems.

Identities checked step by step (docs/algorithms.md sections 4 and 5): the error-feedback recursion of
Alg. 2, Alg. 4's flush (the y's between two flushes add up to the Deltas), EF21-Muon's server
estimate = mean of the workers' G (= their momenta with the identity compressor), Alg. 1
(q = 1, B = 1, identity) = Gluon = hand-written normalised SGD with momentum, Alg. 1 with
radius gamma ||M|| = VR-MARINA, Alg. 2 / Alg. 4 with the identity compressor = Alg. 1 / Alg. 3,
the MVR estimator of Alg. 3 / Alg. 4 tracking the exact gradient on a deterministic oracle, and
the 1/B trick (per-method defaults; scaling Delta before compression = scaling y after it for
Alg. 2). Then uplink cost accounting, determinism, input validation, checkpoint/resume,
divergence handling, and the method registry (one typed record per name).
"""
from __future__ import annotations

import dataclasses
import inspect
import io
import itertools
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from gluon.comm import InProcessComm, encode
from gluon.compressors import Identity, Natural, QSGD, RandK, TopK, Zero, make_compressor
from gluon.engine import gradients_per_worker, simulate, train
from gluon.lmo import Block, Euclidean
from gluon.methods import (METHODS, Alg1, Alg2, Alg3, Alg4, EF21Muon, GradientUpdate, LMOUpdate,
                           LocalGluon, Method, MethodSpec, VRMarina, method_spec, resolve_method)
from gluon.worker import Oracle, Worker

torch.set_num_threads(1)

SHAPES = ((3, 4), (8,))          # two blocks, d = 20
N_WORKERS = 3


# ---------------------------------------------------------------- the synthetic problem

class LeastSquaresOracle(Oracle):
    """f^tau(X) = 1/(2|batch|) ||A_batch x - b_batch||^2, x = concatenation of the blocks.

    ``deterministic``: every "minibatch" is the whole shard (grad_diff is then exact).
    Counts and records every call, so tests can see what the method asked for.
    """

    def __init__(self, A, b, shapes, batch_size, deterministic=False):
        self.A, self.b, self.shapes = A, b, shapes
        self.batch_size, self.deterministic = batch_size, deterministic
        self.sample_calls: list[int] = []
        self.grad_calls = 0

    def sample(self, gen, batches=1):
        self.sample_calls.append(batches)
        if self.deterministic:
            return None
        return torch.randint(len(self.b), (self.batch_size * batches,), generator=gen)

    def full(self):
        return None

    def shard_minibatches(self):
        return len(self.b) / self.batch_size

    def _rows(self, idx):
        return (self.A, self.b) if idx is None else (self.A[idx], self.b[idx])

    def grad(self, params, idx):
        self.grad_calls += 1
        A, b = self._rows(idx)
        x = torch.cat([p.reshape(-1) for p in params])
        g = A.T @ (A @ x - b) / len(b)
        out, i = [], 0
        for s in self.shapes:
            n = math.prod(s)
            out.append(g[i:i + n].reshape(s))
            i += n
        return out

    def loss(self, params, idx=None):
        A, b = self._rows(idx)
        x = torch.cat([p.reshape(-1) for p in params])
        return float(0.5 * (A @ x - b).pow(2).mean())


def make_problem(n=N_WORKERS, shapes=SHAPES, rows=40, batch_size=4, seed=0,
                 dtype=torch.float64, deterministic=False):
    """n heterogeneous shards (different A and b per worker) and a random X^0."""
    g = torch.Generator().manual_seed(1000 + seed)
    d = sum(math.prod(s) for s in shapes)
    oracles = []
    for _ in range(n):
        A = torch.randn(rows, d, generator=g, dtype=dtype) / math.sqrt(d)
        b = torch.randn(rows, generator=g, dtype=dtype)
        oracles.append(LeastSquaresOracle(A, b, shapes, batch_size, deterministic))
    params = [torch.randn(s, generator=g, dtype=dtype) for s in shapes]
    return oracles, params


def build(method, compressor, *, seed=0, problem=None, **hp):
    oracles, params = problem if problem is not None else make_problem()
    hp.setdefault("lr", 0.05)
    return simulate(method, [p.clone() for p in params], oracles, compressor=compressor,
                    seed=seed, **hp)


def build_class(cls, compressor, *, problem, seed=0, **hp):
    """A method class built by hand on ``problem``, exactly as simulate() wires its own (same
    worker data streams and coin for the same seed, Euclidean LMO per block)."""
    oracles, params = problem
    comm = InProcessComm(len(oracles), seed=seed)
    workers = [Worker(r, o, seed) for r, o in enumerate(oracles)]
    update = LMOUpdate([Block(str(i), Euclidean()) for i in range(len(params))])
    return cls([p.clone() for p in params], workers, comm, update, compressor, seed=seed, **hp)


def snapshot(m):
    return [p.detach().clone() for p in m.params]


def full_grad(oracles, params):
    grads = [o.grad(params, None) for o in oracles]
    return [torch.stack(g).mean(0) for g in zip(*grads)]


def record_coins(m):
    """Wrap the shared coin: returns the list of drawn u^{k+1}."""
    coins, real = [], m.comm.coin

    def coin(q):
        u = real(q)
        coins.append(u)
        return u

    m.comm.coin = coin
    return coins


def record_messages(m):
    """Wrap comm.average: returns a list with, per call, the list of messages."""
    calls, real = [], m.comm.average

    def average(msgs):
        calls.append(list(msgs))
        return real(msgs)

    m.comm.average = average
    return calls


def record_deltas(m):
    """Wrap Method.delta: per call (worker rank, the Delta the algorithm used)."""
    seen, real = [], m.delta

    def delta(w):
        d = real(w)
        seen.append((w.rank, [x.clone() for x in d]))
        return d

    m.delta = delta
    return seen


def assert_same(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def assert_close(a, b, rtol=1e-9, atol=1e-12):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


# ---------------------------------------------------------------- error feedback (Alg. 2)

def test_alg2_error_feedback_recursion_every_step():
    c = TopK(0.25)
    m = build("alg2", c, q=0.3, B=2, beta=0.9)
    deltas, calls = record_deltas(m), record_messages(m)
    n_compressed = n_sync = 0
    for _ in range(30):
        u = m.u
        e_before = [w.state.get("e") for w in m.workers]
        g_before = m.g
        deltas.clear(), calls.clear()
        m.step()
        if u:   # full sync: errors reset, one dense message per worker
            n_sync += 1
            assert all(w.state["e"] is None for w in m.workers)
            assert deltas == [] and len(calls) == 1
            assert all(isinstance(msg.compressor, Identity) for msg in calls[0])
            continue
        n_compressed += 1
        assert len(calls) == 1 and len(deltas) == N_WORKERS
        ys = []
        for (rank, delta), msg, w, e in zip(deltas, calls[0], m.workers, e_before):
            assert rank == w.rank == msg.worker
            e = e if e is not None else [torch.zeros_like(x) for x in delta]
            y = msg.values
            ys.append(y)
            for ei, di, yi, new, numel in zip(e, delta, y, w.state["e"],
                                              (x.numel() for x in delta)):
                # e^{k+1} = e^k + Delta^k - y^k
                torch.testing.assert_close(new, ei + di - yi, rtol=1e-12, atol=1e-14)
                # y = C(e + Delta) is the TopK of e + Delta ...
                torch.testing.assert_close(yi, c(ei + di), rtol=0, atol=0)
                # ... hence the contraction of Definition 1.2 on the new error
                assert new.pow(2).sum() <= (1 - c.delta(numel)) * (ei + di).pow(2).sum() + 1e-15
        # server: g^k = g^{k-1} + mean_tau y^tau
        for gb, ga, *yb in zip(g_before, m.g, *ys):
            torch.testing.assert_close(ga, gb + torch.stack(yb).mean(0), rtol=1e-12, atol=1e-14)
    assert n_sync >= 3 and n_compressed >= 10     # both branches exercised


def test_alg2_error_feedback_telescopes():
    # q = 0: one full sync at step 0, then only compressed steps. Per worker,
    # sum_k y^k = sum_k Delta^k - e^{K+1}: nothing sent is lost, it waits in the error.
    m = build("alg2", TopK(0.1), q=0.0, B=1, beta=0.5)
    m.step()
    deltas, calls = record_deltas(m), record_messages(m)
    for _ in range(25):
        m.step()
    assert len(calls) == 25
    for w in m.workers:
        sum_d = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
        sum_y = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
        for rank, d in deltas:
            if rank == w.rank:
                sum_d = [a + b for a, b in zip(sum_d, d)]
        for msgs in calls:
            sum_y = [a + b for a, b in zip(sum_y, msgs[w.rank].values)]
        e = w.state["e"]
        assert any(x.abs().max() > 1e-6 for x in e)        # the error is not trivially zero
        assert_close(sum_y, [a - b for a, b in zip(sum_d, e)], rtol=1e-10, atol=1e-12)


def _zeros():
    return [torch.zeros(s, dtype=torch.float64) for s in SHAPES]


def _add(xs, ys):
    return [a + b for a, b in zip(xs, ys)]


# ---------------------------------------------------------------- EF with a flush (Alg. 4)

@pytest.mark.parametrize("name,comp", [("alg4", TopK(0.25)), ("local_gluon_ecmvr", Zero())])
def test_alg4_flush_sends_the_error_once_and_forgets_it(name, comp):
    # On a flush (u^k = 1) worker tau sends y = e + Delta uncompressed and sets e <- 0. So per
    # worker, over the steps after one flush up to and including the next, the y's sent add up
    # to the Deltas of those steps: nothing is lost, nothing is counted twice.
    m = build(name, comp, q=0.3, B=2, beta=0.9)
    deltas, calls = record_deltas(m), record_messages(m)
    sum_d = [_zeros() for _ in m.workers]
    sum_y = [_zeros() for _ in m.workers]
    flushes, error_seen = 0, False
    for _ in range(40):
        u = m.u
        deltas.clear(), calls.clear()
        m.step()
        assert len(deltas) == N_WORKERS and len(calls) == (2 if u else 1)
        for (rank, d), msg in zip(deltas, calls[0]):   # calls[0]: the y's, [1]: the large batch
            assert rank == msg.worker
            assert isinstance(msg.compressor, Identity) == u   # the flush is sent uncompressed
            sum_d[rank], sum_y[rank] = _add(sum_d[rank], d), _add(sum_y[rank], msg.values)
        if u:
            flushes += 1
            for w in m.workers:
                e = w.state.get("e")
                assert e is None or all(not x.any() for x in e)      # e = 0 right after a flush
                assert_close(sum_y[w.rank], sum_d[w.rank], rtol=1e-10, atol=1e-12)
            sum_d = [_zeros() for _ in m.workers]
            sum_y = [_zeros() for _ in m.workers]
        else:
            error_seen |= any(x.abs().max() > 1e-6 for w in m.workers for x in w.state["e"])
    assert flushes >= 4 and error_seen     # several stretches, and e had something to flush


# ---------------------------------------------------------------- the 1/B trick (Section 6.1)

PAPER_SCALE_BY_B = {"alg1": True, "alg2": True}      # every other name: off by default
COMPRESSOR_FOR = {"alg1": RandK(0.25), "alg2": TopK(0.25), "alg3": RandK(0.25),
                  "alg4": TopK(0.25), "gluon": Identity(), "vr_marina": RandK(0.25),
                  "ef21_muon": TopK(0.25), "local_gluon": Zero(), "local_gluon_ecmvr": Zero(),
                  "vr_gluon": Identity(), "large_batch_gluon": Identity()}
REFUSE_SCALE_BY_B = {"alg4", "local_gluon_ecmvr"}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_scale_by_B_defaults_follow_the_paper(name):
    # "we empirically improve Algorithms 1 and 2 by scaling y by 1/B when u^k = 0": on by
    # default for alg1 and alg2 only, whether built by name or resolved from a config.
    comp, expected = COMPRESSOR_FOR[name], PAPER_SCALE_BY_B.get(name, False)
    assert build(name, comp).scale_by_B is expected
    _, hp, _ = resolve_method(name, comp, {"lr": 0.1})
    assert hp.get("scale_by_B", False) is expected
    assert METHODS[name].defaults.get("scale_by_B", False) is expected
    takes_it = "scale_by_B" in METHODS[name].settings
    if takes_it and name not in REFUSE_SCALE_BY_B:     # the switch stays: it can be turned on
        assert build(name, comp, scale_by_B=True).scale_by_B is True
        assert build(name, comp, scale_by_B=False).scale_by_B is False


def test_class_default_of_scale_by_B_is_off():
    # the registry, not the class, turns the trick on (alg1, alg2): a class built by hand
    # does not silently differ from the paper's other algorithms
    problem = make_problem()
    assert build_class(Alg1, RandK(0.25), problem=problem, lr=0.1, q=0.5, B=2).scale_by_B is False
    assert build_class(Method, Identity(), problem=problem, lr=0.1).scale_by_B is False
    with pytest.raises(ValueError, match="scale_by_B"):
        build_class(Alg4, TopK(0.25), problem=problem, lr=0.1, q=0.5, B=2, scale_by_B=True)
    assert all(o.grad_calls == 0 for o in problem[0])


METHOD_CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs" / "method").glob("*.yaml"))


@pytest.mark.parametrize("path", METHOD_CONFIGS, ids=[p.stem for p in METHOD_CONFIGS])
def test_method_configs_state_the_registry_default_of_scale_by_B(path):
    cfg = OmegaConf.load(path).method
    assert cfg.name in METHODS
    if "scale_by_B" in cfg:
        assert cfg.scale_by_B is METHODS[cfg.name].defaults["scale_by_B"]


class Alg2ScaleAfterCompression(Alg2):
    """Alg. 2 with the 1/B trick as the paper words it: on u = 0 steps y = C(Delta + e) / B is
    sent and the memory e <- e + Delta - C(Delta + e) keeps unscaled quantities."""

    def delta(self, w):
        return w.oracle.grad_diff(self.params, self.prev, w.sample(1))     # never scaled

    def send_with_error_feedback(self, w):      # called on u^k = 0 steps only
        d, e = self.delta(w), w.state.get("e")
        x = d if e is None else _add(d, e)
        m = self.send(self.compressor, w, x)
        w.state["e"] = [a - b for a, b in zip(x, m.values)]
        if self.scale_by_B:
            m = dataclasses.replace(m, values=[v / self.B for v in m.values])
        return m


@pytest.mark.parametrize("B", [3, 4])
@pytest.mark.parametrize("name,comp", [("alg2", TopK(0.25)), ("alg2", Identity()),
                                       ("alg2", Zero())], ids=["topk", "identity", "zero"])
def test_alg2_scaling_before_compression_equals_scaling_after_for_homogeneous_compressors(
        name, comp, B):
    # The code sends C(Delta/B + e) with a scaled memory; the paper scales y = C(Delta + e).
    # For C(a x) = a C(x) (a > 0) they agree: e restarts at 0 on every sync and every step in
    # between is scaled by the same 1/B, so by induction e_scaled = e_unscaled / B.
    problem = make_problem()
    hp = dict(q=0.25, B=B, beta=0.9, lr=0.05, scale_by_B=True)
    a = build(name, comp, problem=problem, seed=8, **hp)
    b = build_class(Alg2ScaleAfterCompression, comp, problem=problem, seed=8, **hp)
    off = build(name, comp, problem=problem, seed=8, **{**hp, "scale_by_B": False})
    coins = record_coins(a)
    trick_matters = error_seen = False
    for _ in range(40):
        a.step(), b.step(), off.step()
        assert_close(a.params, b.params, rtol=1e-12, atol=1e-14)
        assert_close(a.g, b.g, rtol=1e-12, atol=1e-14)
        for wa, wb in zip(a.workers, b.workers):
            ea, eb = wa.state.get("e"), wb.state.get("e")
            assert (ea is None) == (eb is None)
            if ea is not None:
                assert_close(ea, [x / B for x in eb], rtol=1e-12, atol=1e-14)
                error_seen |= any(x.abs().max() > 1e-6 for x in ea)
        trick_matters |= not all(torch.equal(x, y) for x, y in zip(a.params, off.params))
    assert True in coins and False in coins
    # with C = 0 nothing is sent between syncs: the trick is a no-op
    assert trick_matters == (not isinstance(comp, Zero))
    assert error_seen == (not isinstance(comp, Identity))


# ---------------------------------------------------------------- EF21-Muon's worker estimates

@pytest.mark.parametrize("comp", [TopK(0.25), Zero(), Identity()], ids=["topk", "zero", "identity"])
def test_ef21_muon_server_estimate_is_the_mean_of_the_workers_G(comp):
    # R = C(M - G) is sent and G <- G + R on the worker, g <- g + mean R on the server: at every
    # step g = mean_tau G_tau, whatever C loses.
    m = build("ef21_muon", comp, beta=0.9)
    lossy = False
    for _ in range(25):
        m.step()
        Gs = [w.state["G"] for w in m.workers]
        assert_close(m.g, [torch.stack(x).mean(0) for x in zip(*Gs)], rtol=1e-10, atol=1e-12)
        lossy |= any((a - b).abs().max() > 1e-8 for w in m.workers
                     for a, b in zip(w.state["G"], w.state["M"]))
    assert lossy == (not isinstance(comp, Identity))


def test_ef21_muon_with_identity_is_the_lmo_step_with_the_mean_local_momentum():
    # C = identity: R = M - G, so G <- G + R = M at every step and the method is the LMO step
    # with the mean of the workers' local momenta.
    beta, lr = 0.9, 0.05
    m = build("ef21_muon", Identity(), beta=beta, lr=lr)
    for _ in range(25):
        x = snapshot(m)
        m.step()
        for w in m.workers:
            assert_close(w.state["G"], w.state["M"], rtol=1e-12, atol=1e-14)
        mean_M = [torch.stack(ms).mean(0) for ms in zip(*(w.state["M"] for w in m.workers))]
        expected = [xi - lr * mi / mi.norm() for xi, mi in zip(x, mean_M)]   # Euclidean LMO
        assert_close(m.params, expected, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- Gluon = Alg. 1 special case

def test_alg1_q1_B1_identity_equals_gluon_step_by_step():
    problem = make_problem()
    a = build("alg1", Identity(), problem=problem, q=1.0, B=1, beta=0.8, seed=3)
    b = build("gluon", Identity(), problem=problem, beta=0.8, seed=3)
    for _ in range(25):
        a.step(), b.step()
        assert_same(a.params, b.params)


@pytest.mark.parametrize("seed", [0, 5])
def test_gluon_equals_handwritten_normalised_sgd_with_momentum(seed):
    oracles, params0 = make_problem(seed=seed)
    beta, lr = 0.9, 0.03
    m = build("gluon", Identity(), problem=(oracles, params0), beta=beta, lr=lr, seed=seed)
    # the reference replicates each worker's data stream (Worker: seed * 1_000_003 + rank)
    gens = [torch.Generator().manual_seed(seed * 1_000_003 + r) for r in range(N_WORKERS)]
    X = [p.clone() for p in params0]
    M = None
    for _ in range(30):
        grads = [o.grad(X, o.sample(gens[r], 1)) for r, o in enumerate(oracles)]
        g = [sum(gs) / N_WORKERS for gs in zip(*grads)]
        M = g if M is None else [beta * a + (1 - beta) * b for a, b in zip(M, g)]
        X = [x - lr * mi / mi.norm() for x, mi in zip(X, M)]     # one Euclidean LMO per block
        m.step()
        assert_close(m.params, X, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(X[0], params0[0])


# ---------------------------------------------------------------- VR-MARINA identity (docs/algorithms.md section 5)

def _radius_gamma_norm_update(params, direction, lr):
    """Alg. 1's LMO step with radius eta = gamma * ||M^k||_2 (Euclidean LMO, t = 1)."""
    for p, mi in zip(params, direction):
        p.add_(Euclidean()(mi), alpha=lr * float(mi.norm()))


@pytest.mark.parametrize("compressor,q,B", [(RandK(0.3), 0.4, 2), (Natural(), 0.2, 1),
                                            (Identity(), 0.5, 3)])
def test_alg1_with_radius_gamma_norm_M_is_vr_marina(compressor, q, B):
    problem = make_problem(shapes=((20,),))       # p = 1 block
    gamma = 0.2
    a = build("alg1", compressor, problem=problem, q=q, B=B, beta=0.0, lr=gamma,
              scale_by_B=False, update=_radius_gamma_norm_update, seed=2)
    b = build("vr_marina", compressor, problem=problem, q=q, B=B, beta=0.0, lr=gamma,
              full=False, scale_by_B=False, seed=2)
    assert isinstance(a, Alg1) and isinstance(b, VRMarina)
    moved = False
    for _ in range(40):
        before = snapshot(b)
        a.step(), b.step()
        assert_close(a.params, b.params, rtol=1e-9, atol=1e-12)
        moved |= not torch.equal(before[0], b.params[0])
    assert moved
    assert a.comm.ledger.cost == pytest.approx(b.comm.ledger.cost)


def test_vr_marina_full_uses_the_whole_shard():
    problem = make_problem()
    m = build("vr_marina", RandK(0.5), problem=problem, q=1.0, beta=0.0, lr=0.1, full=True)
    x0 = snapshot(m)
    m.step()
    expected = [x - 0.1 * g for x, g in zip(x0, full_grad(problem[0], x0))]
    assert_close(m.params, expected)


# ---------------------------------------------------------------- identities between algorithms

def test_alg2_with_identity_equals_alg1_and_keeps_zero_error():
    problem = make_problem()
    a = build("alg1", Identity(), problem=problem, q=0.3, B=2, beta=0.9, seed=4)
    b = build("alg2", Identity(), problem=problem, q=0.3, B=2, beta=0.9, seed=4)
    coins = record_coins(b)
    for _ in range(30):
        a.step(), b.step()
        assert_same(a.params, b.params)
        for w in b.workers:
            assert w.state.get("e") is None or all(not x.any() for x in w.state["e"])
    assert False in coins and True in coins
    assert a.comm.ledger.cost == b.comm.ledger.cost


def test_alg4_with_identity_equals_alg3():
    problem = make_problem()
    a = build("alg3", Identity(), problem=problem, q=0.3, B=2, beta=0.9, seed=6)
    b = build("alg4", Identity(), problem=problem, q=0.3, B=2, beta=0.9, seed=6)
    for _ in range(30):
        a.step(), b.step()
        assert_same(a.params, b.params)
    assert a.comm.ledger.cost == b.comm.ledger.cost


@pytest.mark.parametrize("method", ["alg3", "alg4"])
@pytest.mark.parametrize("q", [1.0, 0.3])
def test_mvr_tracks_the_exact_gradient_on_a_deterministic_oracle(method, q):
    # With exact Deltas, M^k - grad f(X^k) = beta (M^{k-1} - grad f(X^{k-1})) and M^0 = g^0 =
    # grad f(X^0), so M^k = grad f(X^k) for every beta: the MVR correction removes the lag.
    oracles, params = make_problem(deterministic=True)
    m = build(method, Identity(), problem=(oracles, params), q=q, B=1, beta=0.9, lr=0.05)
    for _ in range(25):
        x = snapshot(m)
        m.step()
        exact = full_grad(oracles, x)
        assert_close(m.M, exact, rtol=1e-8, atol=1e-10)
        assert_close(m.g, exact, rtol=1e-8, atol=1e-10)


def test_plain_momentum_of_alg1_lags_the_gradient_on_a_deterministic_oracle():
    # Counterpart of the test above: without the MVR term M^k != grad f(X^k) once X moves,
    # while g^k (identity compressor, telescoping Deltas) still equals it.
    oracles, params = make_problem(deterministic=True)
    m = build("alg1", Identity(), problem=(oracles, params), q=0.3, beta=0.9, lr=0.05)
    worst = 0.0
    for _ in range(15):
        x = snapshot(m)
        m.step()
        exact = full_grad(oracles, x)
        assert_close(m.g, exact, rtol=1e-8, atol=1e-10)
        worst = max(worst, max(float((a - b).norm()) for a, b in zip(m.M, exact)))
    assert worst > 1e-3


def test_alg3_with_beta_0_equals_alg1_on_a_deterministic_oracle():
    # beta = 0 removes the MVR term; with exact Deltas both estimators follow the same g.
    oracles, params = make_problem(deterministic=True)
    a = build("alg1", RandK(0.25), problem=(oracles, params), q=0.3, beta=0.0, seed=1)
    b = build("alg3", RandK(0.25), problem=(oracles, params), q=0.3, beta=0.0, seed=1)
    for _ in range(25):
        a.step(), b.step()
        assert_same(a.params, b.params)


# ---------------------------------------------------------------- uplink cost accounting

def _cost_steps(m, steps):
    """Per-step (u^k, cost increment, bytes increment) of the mean ledger."""
    rows = []
    for _ in range(steps):
        u, c0, b0 = m.u, m.comm.ledger.cost, m.comm.ledger.bytes
        m.step()
        rows.append((u, m.comm.ledger.cost - c0, m.comm.ledger.bytes - b0))
    return rows


def test_alg1_randk_cost_is_syncs_plus_k_over_d_per_compressed_step():
    c = RandK(0.25)                    # blocks of 12 and 8: k = 3 + 2, k/d = 5/20
    d, k = 20, 5
    # fp32 parameters: the wire format the byte counts assume
    m = build("alg1", c, problem=make_problem(dtype=torch.float32), q=0.3, B=2)
    coins, calls = record_coins(m), record_messages(m)
    steps = 40
    for _ in range(steps):
        m.step()
    us = [True] + coins[:-1]          # u^0 = 1, then the coins drawn for steps 1..K-1
    syncs = sum(us)
    compressed = steps - syncs
    assert 3 <= syncs <= steps - 10
    assert m.comm.ledger.cost == pytest.approx(syncs * 1.0 + compressed * k / d, rel=1e-12)
    assert m.comm.ledger.bytes == pytest.approx(syncs * 4 * d + compressed * 4 * k)
    # the bytes counted are the bytes of the packets that were built (fp32: 4 per value)
    sent = sum(p.nbytes for msgs in calls for msg in msgs for p in msg.packets) / N_WORKERS
    assert m.comm.ledger.bytes == pytest.approx(sent)
    assert all(len(p.wire["values"]) in (3, 2) for msgs in calls for msg in msgs
               for p in msg.packets if msg.compressor is c)


def test_costs_per_step_for_each_algorithm():
    kd = 5 / 20
    for name, comp, sync_cost, other_cost in [
            ("alg1", RandK(0.25), 1.0, kd),
            ("alg2", TopK(0.25), 1.0, kd),
            ("alg3", RandK(0.25), 1.0 + kd, kd),   # y is sent every step
            ("alg4", TopK(0.25), 2.0, kd)]:        # flush: dense y and the large batch
        rows = _cost_steps(build(name, comp, q=0.3, B=2), 30)
        assert {u for u, *_ in rows} == {True, False}
        for u, cost, _ in rows:
            assert cost == pytest.approx(sync_cost if u else other_cost, rel=1e-12), name


def test_a_dense_message_costs_exactly_one_unit_so_a_budget_of_K_units_is_K_dense_rounds():
    """Blocks of 1, 4 and 1 coordinates: 1/6 + 4/6 + 1/6 sums to 0.9999999999999999 in floats,
    which made a budget of K units take a (K+1)-th step (the paper's CNN, 1.97M parameters in
    its blocks, ran 501 Gluon steps under a budget of 500)."""
    assert 1 / 6 + 4 / 6 + 1 / 6 != 1.0
    problem = make_problem(shapes=[(1,), (2, 2), (1,)])
    msg = encode(Identity(), [torch.ones(1), torch.ones(2, 2), torch.ones(1)], run_seed=0,
                 worker=0, step=0, dim=6)
    assert msg.cost == 1.0
    m = build("gluon", Identity(), problem=problem)
    assert train(m, 1000, log_every=10, evaluate=lambda m: {}, max_comm=50) == "ok"
    assert m.k == 50 and m.comm.ledger.cost == 50.0
    sparse = encode(RandK(0.5), [torch.ones(1), torch.ones(2, 2), torch.ones(1)], run_seed=0,
                    worker=0, step=0, dim=6)
    assert sparse.cost == 4 / 6                    # k = 1 + 2 + 1 of d = 6, one rounding


def test_topk_bytes_include_the_indices():
    rows = _cost_steps(build("alg2", TopK(0.25), q=0.3), 30)
    for u, _, nbytes in rows:
        assert nbytes == (4 * 20 if u else 8 * 5)


def test_local_gluon_sends_nothing_between_syncs():
    m = build("local_gluon", Zero(), q=0.25, B=2)
    rows = _cost_steps(m, 40)
    syncs = sum(u for u, *_ in rows)
    assert 3 <= syncs <= 30
    for u, cost, nbytes in rows:
        assert (cost, nbytes) == ((1.0, 80) if u else (0.0, 0))
    assert m.comm.ledger.cost == pytest.approx(syncs)
    # ... and still moves between syncs (local steps with the stale g)
    x = snapshot(m)
    while m.u:
        m.step()
        x = snapshot(m)
    m.step()
    assert not torch.equal(x[0], m.params[0])


def test_local_gluon_ecmvr_only_pays_on_syncs():
    rows = _cost_steps(build("local_gluon_ecmvr", Zero(), q=0.25), 30)
    for u, cost, _ in rows:
        assert cost == (2.0 if u else 0.0)


def test_ef21_muon_costs_one_then_k_over_d():
    rows = _cost_steps(build("ef21_muon", TopK(0.25), beta=0.9), 15)
    assert rows[0][1] == pytest.approx(1.0)
    for _, cost, nbytes in rows[1:]:
        assert cost == pytest.approx(5 / 20)
        assert nbytes == 8 * 5


@pytest.mark.parametrize("q,B", [(0.25, 4), (1.0, 1), (0.5, 2)])
def test_vr_gluon_has_B_equal_one_over_q(q, B):
    oracles, params = make_problem()
    m = build("vr_gluon", Identity(), problem=(oracles, params), q=q)
    assert m.B == B and m.q == q
    coins = record_coins(m)
    for _ in range(12):
        m.step()
    # full syncs draw B minibatches, compressed steps one
    us = [True] + coins[:-1]
    assert oracles[0].sample_calls == [B if u else 1 for u in us]


SWITCH_CASES = [(name, comp, scale) for name, comp in [("alg1", RandK(0.5)), ("alg2", TopK(0.5)),
                                                      ("alg3", RandK(0.5)), ("alg4", TopK(0.5))]
                for scale in (True, False) if not (scale and name in REFUSE_SCALE_BY_B)]


@pytest.mark.parametrize("name,comp,scale", SWITCH_CASES,
                         ids=[f"{n}-{'on' if s else 'off'}" for n, _, s in SWITCH_CASES])
def test_scale_by_B_switch_scales_delta_only_on_compressed_steps(name, comp, scale):
    B = 4
    oracles, params = make_problem()
    raw = []
    for o in oracles:     # record the oracle's Delta on the minibatch, before any scaling
        def grad_diff(p, prev, batch, o=o, real=o.grad_diff):
            d = real(p, prev, batch)
            raw.append([x.clone() for x in d])
            return d
        o.grad_diff = grad_diff
    m = build(name, comp, problem=(oracles, params), q=0.5, B=B, scale_by_B=scale, seed=9)
    used = record_deltas(m)
    seen_u = set()
    for _ in range(16):
        u = m.u
        raw.clear(), used.clear()
        m.step()
        assert len(raw) == len(used) == (0 if u and name in ("alg1", "alg2") else N_WORKERS)
        factor = 1.0 / B if (scale and not u) else 1.0
        for r, (_, d) in zip(raw, used):
            assert_close(d, [x * factor for x in r], rtol=1e-12)
        seen_u.add(u)
    assert seen_u == {True, False}


# ---------------------------------------------------------------- determinism

@pytest.mark.parametrize("name,comp", [("alg1", RandK(0.3)), ("alg2", TopK(0.3)),
                                       ("alg3", QSGD(2)), ("alg4", TopK(0.3)),
                                       ("ef21_muon", TopK(0.3)), ("vr_marina", Natural())])
def test_same_seed_same_iterates_different_seed_different_iterates(name, comp):
    def run(seed):
        hp = {} if name == "ef21_muon" else {"q": 0.4}
        m = build(name, comp, seed=seed, **hp)
        for _ in range(15):
            m.step()
        return snapshot(m), m.comm.ledger.cost
    (a, ca), (b, cb), (c, _) = run(1), run(1), run(2)
    assert_same(a, b)
    assert ca == cb
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


# ---------------------------------------------------------------- the registry: one record per name

SYNC = {"q", "B", "beta", "lr", "scale_by_B"}
# name -> (class, compressor it always uses, update rule, hyperparameters it fixes, settings),
# written out here independently of gluon.methods
REGISTRY = {
    "alg1": (Alg1, None, "lmo", {}, SYNC),
    "alg2": (Alg2, None, "lmo", {}, SYNC),
    "alg3": (Alg3, None, "lmo", {}, SYNC),
    "alg4": (Alg4, None, "lmo", {}, SYNC),
    "gluon": (Alg1, "identity", "lmo", {"q": 1.0, "B": 1}, {"beta", "lr"}),
    "vr_marina": (VRMarina, None, "gradient", {}, SYNC | {"full"}),
    "ef21_muon": (EF21Muon, None, "lmo", {}, {"beta", "lr"}),
    "large_batch_gluon": (Alg1, "identity", "lmo", {"q": 1.0}, {"B", "beta", "lr"}),
    "local_gluon": (LocalGluon, "zero", "lmo", {}, SYNC),
    "local_gluon_ecmvr": (Alg4, "zero", "lmo", {}, SYNC),
    "vr_gluon": (Alg1, "identity", "lmo", {}, SYNC),
}


def expected_defaults(name):
    return {"scale_by_B": PAPER_SCALE_BY_B.get(name, False)} if "scale_by_B" in REGISTRY[name][4] else {}


def test_registry_names_are_the_documented_ones():
    assert set(METHODS) == set(REGISTRY) == set(COMPRESSOR_FOR)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_method_is_a_typed_record_with_its_fixed_compressor_and_update_rule(name):
    cls, compressor, update, fixed, settings = REGISTRY[name]
    spec = METHODS[name]
    assert isinstance(spec, MethodSpec) and method_spec(name) is spec
    assert (spec.cls, spec.compressor, spec.update) == (cls, compressor, update)
    assert dict(spec.fixed) == fixed and spec.settings == frozenset(settings)
    assert dict(spec.defaults) == expected_defaults(name)
    assert spec.rule is None or name == "vr_gluon"
    assert spec.doc and "\n" not in spec.doc
    # fixed are hyperparameters only (the compressor and update rule have their own fields),
    # never also settable; defaults are for settings only
    assert not set(spec.fixed) & ({"compressor", "update"} | spec.settings)
    assert set(spec.defaults) <= spec.settings
    # immutable: the record, its mappings and its settings
    with pytest.raises(AttributeError):
        spec.update = "gradient"
    with pytest.raises(TypeError):
        spec.fixed["q"] = 0.5
    with pytest.raises(TypeError):
        spec.defaults["scale_by_B"] = True
    assert isinstance(spec.settings, frozenset)
    # the record's compressor and update rule are what a method built by name gets
    comp = COMPRESSOR_FOR[name]
    if compressor is not None:
        assert comp.name == compressor
        with pytest.raises(ValueError, match=f"always uses the {compressor!r} compressor"):
            resolve_method(name, TopK(0.25) if compressor != "topk" else RandK(0.25), {"lr": 0.1})
    m = build(name, comp)
    assert type(m) is cls
    assert type(m.update) is (GradientUpdate if update == "gradient" else LMOUpdate)
    assert resolve_method(name, comp, {"lr": 0.1})[2] == update


@pytest.mark.parametrize("q,B", [(0.25, 4), (0.5, 2), (1.0, 1), (0.1, 10), (1 / 3, 3)])
def test_vr_gluon_rule_sets_B_to_one_over_q_and_lives_with_its_entry(q, B):
    rule = METHODS["vr_gluon"].rule
    assert rule.__module__ == "gluon.methods" and "vr_gluon" in rule.__name__
    assert rule({"q": q, "lr": 0.1}) == {"q": q, "lr": 0.1, "B": B}
    assert rule({"q": q, "B": B}) == {"q": q, "B": B}
    with pytest.raises(ValueError, match=f"vr_gluon sets B = 1/q = {B}; got B = {B + 1}"):
        rule({"q": q, "B": B + 1})
    assert resolve_method("vr_gluon", Identity(), {"q": q, "lr": 0.1})[1]["B"] == B
    # the rule is vr_gluon's own: the same q without it leaves B to the class (alg1) or the user
    assert "B" not in resolve_method("alg1", Identity(), {"q": q, "lr": 0.1})[1]
    assert [n for n, s in METHODS.items() if s.rule is not None] == ["vr_gluon"]


@pytest.mark.parametrize("q", [0.3, 0.0, 0.7, 0.26])
def test_vr_gluon_rule_refuses_q_that_is_not_one_over_an_integer(q):
    with pytest.raises(ValueError, match=f"vr_gluon needs q = 1/B for an integer B; got q = {q}"):
        METHODS["vr_gluon"].rule({"q": q})
    with pytest.raises(ValueError, match="1/B"):
        resolve_method("vr_gluon", Identity(), {"q": q, "lr": 0.1})


def test_resolve_method_reads_records_and_special_cases_no_name():
    src = inspect.getsource(resolve_method)
    assert not [name for name in METHODS if f'"{name}"' in src or f"'{name}'" in src]


GRID_VALUES = {"q": [None, 0.25, 0.3, 1.0], "B": [None, 1, 4], "beta": [None, 0.0, 0.9],
               "scale_by_B": [None, False, True], "full": [None, False]}
GRID = [dict(zip(GRID_VALUES, v)) for v in itertools.product(*GRID_VALUES.values())]


def expected_resolution(name, hp):
    """What resolve_method must return for ``hp`` (lr = 0.1 added), from REGISTRY alone:
    the class, the given settings plus the fixed ones, the defaults of settings left unset, and
    vr_gluon's B = 1/q; or a ValueError matching the returned pattern."""
    cls, _, update, fixed, settings = REGISTRY[name]
    given = {k: v for k, v in hp.items() if v is not None}
    errors = []
    if set(given) - settings - set(fixed):
        errors.append("got unexpected")
    errors += [f"fixes {k} = " for k, v in fixed.items() if k in given and given[k] != v]
    out = {**given, "lr": 0.1, **fixed}
    for k, v in expected_defaults(name).items():
        out.setdefault(k, v)
    if out.get("scale_by_B") and name in REFUSE_SCALE_BY_B:
        errors.append("cannot use scale_by_B")
    if name == "vr_gluon":
        B = {0.25: 4, 1.0: 1}.get(out.get("q", 1.0))
        if B is None:
            errors.append("q = 1/B for an integer B")
        elif out.get("B", B) != B:
            errors.append("sets B = 1/q")
        out["B"] = B
    return (cls, out, update), "|".join(errors)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_resolve_method_applies_fixed_settings_defaults_and_rules_over_a_grid(name):
    comp, n_ok = COMPRESSOR_FOR[name], 0
    for hp in GRID:
        given = {**hp, "lr": 0.1}
        before = dict(given)
        expected, errors = expected_resolution(name, hp)
        if errors:
            with pytest.raises(ValueError, match=errors):
                resolve_method(name, comp, given)
        else:
            assert resolve_method(name, comp, given) == expected, hp
            n_ok += 1
        assert given == before      # the caller's dict is left alone
    assert n_ok >= 3
    assert METHODS[name] == method_spec(name)
    assert dict(METHODS[name].fixed) == REGISTRY[name][3]     # resolving does not touch the record


def test_method_spec_of_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown method 'adam'; choose one of \['alg1', 'alg2'"):
        method_spec("adam")


# ---------------------------------------------------------------- bad input

BAD = [("adam", Identity(), {}, "unknown method"),
       ("alg1", RandK(0.1), {"q": -0.1}, "q must"),
       ("alg1", RandK(0.1), {"q": 1.5}, "q must"),
       ("alg2", TopK(0.1), {"q": float("nan")}, "q must"),
       ("alg1", RandK(0.1), {"beta": 1.0}, "beta"),
       ("alg3", RandK(0.1), {"beta": -0.1}, "beta"),
       ("alg1", RandK(0.1), {"lr": 0.0}, "lr"),
       ("alg4", TopK(0.1), {"lr": -1.0}, "lr"),
       ("alg1", RandK(0.1), {"B": 0}, "B must"),
       ("alg2", TopK(0.1), {"B": 1.5}, "B must"),
       ("alg1", TopK(0.1), {}, "unbiased"),
       ("alg3", Zero(), {}, "unbiased"),
       ("vr_marina", TopK(0.1), {}, "unbiased"),
       ("alg2", RandK(0.1), {}, "contraction"),
       ("alg4", Natural(), {}, "contraction"),
       ("ef21_muon", RandK(0.1), {}, "contraction"),
       ("gluon", Identity(), {"q": 0.5}, "q"),
       ("gluon", Identity(), {"B": 2}, "B"),
       ("gluon", RandK(0.1), {}, "identity"),
       ("vr_gluon", Identity(), {"q": 0.3}, "1/B"),
       ("vr_gluon", Identity(), {"q": 0.0}, "1/B"),
       ("vr_gluon", Identity(), {"q": 0.25, "B": 2}, "B"),
       ("ef21_muon", TopK(0.1), {"q": 0.5}, "unexpected"),
       ("local_gluon", TopK(0.1), {}, "zero"),
       ("alg4", TopK(0.1), {"scale_by_B": True}, "scale_by_B"),
       ("local_gluon_ecmvr", Zero(), {"scale_by_B": True}, "scale_by_B")]


@pytest.mark.parametrize("name,comp,hp,match", BAD, ids=[f"{b[0]}-{b[1].name}-{b[2]}" for b in BAD])
def test_bad_input_rejected_before_any_compute(name, comp, hp, match):
    oracles, params = make_problem()
    x0 = [p.clone() for p in params]
    with pytest.raises(ValueError, match=match):
        simulate(name, params, oracles, compressor=comp, lr=hp.pop("lr", 0.1), **hp)
    assert all(o.grad_calls == 0 and o.sample_calls == [] for o in oracles)
    assert_same(params, x0)


# ---------------------------------------------------------------- checkpoint / resume

CKPT_CASES = [("alg2", TopK(0.25), {"q": 0.3, "B": 2}), ("alg4", TopK(0.25), {"q": 0.3, "B": 2}),
              ("ef21_muon", TopK(0.25), {}), ("alg1", RandK(0.25), {"q": 0.3})]


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("via_disk", [False, True], ids=["in_memory", "torch_save"])
@pytest.mark.parametrize("name,comp,hp", CKPT_CASES, ids=[c[0] for c in CKPT_CASES])
def test_resume_from_checkpoint_is_bit_identical(name, comp, hp, via_disk):
    problem = make_problem()
    a = build(name, comp, problem=problem, seed=7, beta=0.9, **hp)
    for _ in range(20):
        a.step()
    sd = a.state_dict()
    if via_disk:
        sd = _roundtrip(sd)
    for _ in range(20):     # the original keeps running after the checkpoint was taken
        a.step()
    b = build(name, comp, problem=problem, seed=7, beta=0.9, **hp)
    b.load_state_dict(sd)
    assert b.k == 20
    for _ in range(20):
        b.step()
    assert_same(a.params, b.params)
    assert_same(a.M, b.M)
    assert a.comm.ledger.cost == b.comm.ledger.cost
    assert a.comm.ledger.bytes == b.comm.ledger.bytes


def test_checkpoint_can_be_loaded_twice():
    problem = make_problem()
    # q = 0: no sync after step 0, so the error memories are part of the state that matters
    a = build("alg2", TopK(0.25), problem=problem, q=0.0, seed=7)
    for _ in range(10):
        a.step()
    sd = a.state_dict()
    runs = []
    for _ in range(2):
        b = build("alg2", TopK(0.25), problem=problem, q=0.0, seed=7)
        b.load_state_dict(sd)
        for _ in range(15):
            b.step()
        runs.append(snapshot(b))
    assert_same(*runs)


# ---------------------------------------------------------------- engine.train

class InfOracle(LeastSquaresOracle):
    def grad(self, params, idx):
        return [torch.full_like(p, math.inf) for p in params]


def _evaluate(problem):
    oracles = problem[0]
    return lambda m: {"loss": sum(o.loss(m.params) for o in oracles) / len(oracles)}


def test_train_returns_ok_on_a_healthy_run_and_logs():
    problem = make_problem()
    m = build("alg1", RandK(0.25), problem=problem, q=0.3, lr=0.02)
    rows = []
    status = train(m, 23, log_every=10, evaluate=_evaluate(problem), on_log=rows.append)
    assert status == "ok"
    assert [r["step"] for r in rows] == [0, 10, 20, 23]
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert [r["comm"] for r in rows] == sorted(r["comm"] for r in rows)


@pytest.mark.parametrize("name,comp", [("alg1", RandK(0.25)), ("gluon", Identity()),
                                       ("ef21_muon", TopK(0.1))])
def test_train_logs_once_at_every_multiple_of_log_comm(name, comp):
    """Rows aligned on uplink: a row at step 0, at the last step, and at exactly the steps whose
    uplink crosses a multiple of log_comm (every crossing, none twice)."""
    problem = make_problem()
    hp = {"q": 0.3} if name == "alg1" else {}
    m = build(name, comp, problem=problem, lr=0.02, **hp)
    costs, rows = [], []
    status = train(m, 60, log_every=0, log_comm=0.5, evaluate=_evaluate(problem),
                   on_log=rows.append, on_step=lambda mm: costs.append((mm.k, mm.comm.ledger.cost)))
    assert status == "ok"
    prev, expected = 0.0, [0]
    for k, c in costs:
        if math.floor(c / 0.5) > math.floor(prev / 0.5) or k == 60:
            expected.append(k)
        prev = c
    assert [r["step"] for r in rows] == expected
    marks = [math.floor(r["comm"] / 0.5) for r in rows[1:-1]]
    assert marks == sorted(set(marks))                          # never two rows for one mark
    with pytest.raises(ValueError, match="log_every"):
        train(m, 70, log_every=0, log_comm=None, evaluate=_evaluate(problem))


@pytest.mark.parametrize("name,comp", [("alg1", RandK(0.25)), ("local_gluon", Zero()),
                                       ("large_batch_gluon", Identity())])
def test_train_logs_once_at_every_multiple_of_log_grads_and_stops_at_max_grads(name, comp):
    """Rows aligned on compute: a row at step 0, at the last step, and at exactly the steps whose
    gradient count per worker crosses a multiple of log_grads; the run stops at the first step
    at or past max_grads."""
    problem = make_problem()
    hp = {"large_batch_gluon": {"B": 3}}.get(name, {"q": 0.3, "B": 4})
    m = build(name, comp, problem=problem, lr=0.02, **hp)
    counts, rows = [], []
    status = train(m, 10_000, log_every=0, log_grads=5, max_grads=120,
                   evaluate=_evaluate(problem), on_log=rows.append,
                   on_step=lambda mm: counts.append((mm.k, gradients_per_worker(mm))))
    assert status == "ok"
    prev, expected = 0.0, [0]
    for k, g in counts:
        if math.floor(g / 5) > math.floor(prev / 5) or g >= 120:
            expected.append(k)
        prev = g
    assert [r["step"] for r in rows] == expected
    assert rows[-1]["grads"] >= 120 and counts[-2][1] < 120
    marks = [math.floor(r["grads"] / 5) for r in rows[1:-1]]
    assert marks == sorted(set(marks))
    with pytest.raises(ValueError, match="log_grads must be > 0"):
        train(m, 70, log_every=0, log_grads=-1.0, evaluate=_evaluate(problem))


@pytest.mark.parametrize("log_every", [1, 7])
def test_train_reports_divergence_of_vr_marina_with_huge_lr(log_every):
    problem = make_problem(dtype=torch.float32)
    m = build("vr_marina", RandK(0.5), problem=problem, q=0.5, lr=1e8, full=False)
    rows = []
    # nothing evaluated: the non-finite parameters alone must stop the run
    status = train(m, 200, log_every=log_every, evaluate=lambda m: {}, on_log=rows.append)
    assert status == "diverged"
    assert rows[-1]["step"] == m.k
    assert m.k < 200
    assert not all(torch.isfinite(p).all() for p in m.params)


def test_train_reports_divergence_when_the_oracle_returns_inf():
    oracles, params = make_problem()
    oracles = [InfOracle(o.A, o.b, o.shapes, o.batch_size) for o in oracles]
    m = build("gluon", Identity(), problem=(oracles, params))
    assert train(m, 10, log_every=1, evaluate=lambda m: {}) == "diverged"
    assert m.k == 1


def test_train_reports_divergence_of_a_non_finite_logged_value():
    m = build("alg1", RandK(0.25), q=0.5)
    assert train(m, 10, log_every=2, evaluate=lambda m: {"loss": float("nan")}) == "diverged"


# ---------------------------------------------------------------- gradient evaluations counted

class MinibatchCounter:
    """Wraps an oracle: adds up the minibatches every gradient it is asked for is taken over
    (a gradient difference counts its two gradients; the whole shard counts rows/batch_size)."""

    def __init__(self, oracle):
        self.oracle, self.minibatches = oracle, 0.0

    def _count(self, idx):
        rows = len(self.oracle.b) if idx is None else len(idx)
        self.minibatches += rows / self.oracle.batch_size

    def grad(self, params, idx):
        self._count(idx)
        return self.oracle.grad(params, idx)

    def grad_diff(self, params, prev, idx):
        self._count(idx)
        self._count(idx)
        return self.oracle.grad_diff(params, prev, idx)

    def __getattr__(self, name):
        return getattr(self.oracle, name)


@pytest.mark.parametrize("name,compressor,hp", [
    ("gluon", "identity", {}),
    ("alg1", "randk", {"q": 0.3, "B": 5}),
    ("alg2", "topk", {"q": 0.3, "B": 3}),
    ("alg3", "randk", {"q": 0.3, "B": 4}),
    ("alg4", "topk", {"q": 0.3, "B": 4}),
    ("ef21_muon", "topk", {}),
    ("vr_marina", "randk", {"q": 0.3, "full": True}),
    ("vr_marina", "randk", {"q": 0.3, "B": 6, "full": False}),
])
def test_gradient_evaluations_per_worker_are_the_minibatches_the_oracle_is_asked_for(name, compressor, hp):
    """Every worker's ``grads`` (logged as a row's ``grads``) equals the minibatches its oracle
    really computed gradients over: B on a sync, 2 for a gradient difference, 1 for
    EF21-Muon's minibatch gradient, rows / batch size for a full local gradient."""
    oracles, params = make_problem(batch_size=4)
    counters = [MinibatchCounter(o) for o in oracles]
    comp = make_compressor(compressor, **({"density": 0.25} if compressor in ("randk", "topk") else {}))
    m = build(name, comp, problem=(counters, params), **hp)
    for _ in range(40):
        m.step()
    for w, c in zip(m.workers, counters):
        assert w.grads == c.minibatches > 0
    assert gradients_per_worker(m) == counters[0].minibatches


def test_a_compute_budget_stops_a_run_at_the_first_step_that_reaches_it():
    """train(max_grads=G) stops at the first step at which each worker has made G gradient
    evaluations: EF21-Muon makes one a step, so it stops at step G; the last row logs it."""
    oracles, params = make_problem(batch_size=4)
    m = build("ef21_muon", make_compressor("topk", density=0.25), problem=(oracles, params))
    rows = []
    status = train(m, 1000, log_every=5, evaluate=lambda m: {}, on_log=rows.append, max_grads=17)
    assert status == "ok" and m.k == 17
    assert rows[-1]["step"] == 17 and rows[-1]["grads"] == 17.0
    assert [r["grads"] for r in rows] == [r["step"] for r in rows]


def test_ef21_muon_with_the_identity_compressor_equals_gluon_step_for_step():
    """Uncompressed, EF21-Muon's server estimate G = mean_tau G_tau is the mean of the local
    momenta M_tau <- beta M_tau + (1 - beta) g_tau, which is Gluon's M <- beta M + (1 - beta)
    mean g: the same iterates (float64; only the summation order differs). Pins which of
    beta and 1 - beta weights the old momentum."""
    problem = make_problem(dtype=torch.float64)
    ef21 = build("ef21_muon", Identity(), problem=problem, beta=0.7, lr=0.03)
    gluon = build("gluon", Identity(), problem=problem, beta=0.7, lr=0.03)
    for _ in range(25):
        ef21.step()
        gluon.step()
        for a, b in zip(ef21.params, gluon.params):
            assert torch.allclose(a, b, rtol=0, atol=1e-12)
    assert not torch.allclose(ef21.params[0], problem[1][0])        # the iterates moved
