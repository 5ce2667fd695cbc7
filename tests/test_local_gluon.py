"""Local Gluon (Alg. 2 with C = 0) evaluates only what its iterates use.

With C = 0 every message between two syncs is zero, so Alg. 2's Delta and error memory change
nothing (Section 4.1: "we actually do not need to calculate y and e"). ``local_gluon`` skips
them. These tests pin that it does so without changing a single iterate, that its gradient
count is exactly its syncs' large batches, and that Local Gluon EC-MVR (Alg. 4 with C = 0),
whose Delta feeds the MVR term and the flush, still evaluates it.

The reference is the implementation this replaced: the registry's ``local_gluon`` record with
class Alg2 (Alg. 2 run with the zero compressor, Delta and all).
"""
from __future__ import annotations

from functools import partial

import pytest
import torch

from experiments.run.config import validate
from experiments.tasks import cnn as cnn_task
from experiments.tasks import logreg as logreg_task
from gluon import methods as gluon_methods
from gluon.comm import InProcessComm
from gluon.compressors import Identity, Zero
from gluon.methods import Alg1, Alg2, Alg4, LocalGluon, make_method
from gluon.worker import Worker
from tests.conftest import compose_config
from tests.test_cnn import synthetic
from tests.test_methods import make_problem

STEPS = 200


def _alg2_reference(monkeypatch):
    """Build ``local_gluon`` as it was: the registry's record with Alg. 2's class."""
    spec = gluon_methods.METHODS["local_gluon"]
    monkeypatch.setitem(gluon_methods.METHODS, "local_gluon", spec._replace(cls=Alg2))


def _run(method, steps=STEPS):
    """Step ``method``; returns the iterates after every step and u^k of every step."""
    iterates, coins = [], []
    for _ in range(steps):
        coins.append(method.u)
        method.step()
        iterates.append([p.detach().clone() for p in method.params])
    return iterates, coins


def _assert_same_run(new, ref):
    (xs, us), (ys, vs) = _run(new.method), _run(ref.method)
    assert us == vs and 3 <= sum(us) < STEPS
    for k, (x, y) in enumerate(zip(xs, ys)):
        assert all(torch.equal(a, b) for a, b in zip(x, y)), f"iterates differ at step {k}"
    return us


def _assert_counts(new, ref, coins):
    """Local Gluon evaluates B minibatches on each sync (step 0's u^0 = 1 among them) and
    nothing else; Alg. 2 with C = 0 paid 2 more per worker on every other step."""
    B, syncs = new.method.B, sum(coins)
    for w, v in zip(new.method.workers, ref.method.workers):
        assert w.grads == B * syncs
        assert v.grads == B * syncs + 2 * (STEPS - syncs)
        assert "e" not in w.state                     # no error memory is kept
    assert new.method.comm.ledger.cost == ref.method.comm.ledger.cost == syncs
    assert new.method.comm.ledger.messages == syncs * len(new.method.workers)


def test_a5a_iterates_equal_alg2_with_zero_compressor_and_only_syncs_cost(monkeypatch,
                                                                             results_with_cache):
    cfg = compose_config("logreg", "method=local_gluon", "method.q=0.1", "method.B=4",
                         "method.lr=0.01", "method.beta=0.9", f"results_dir={results_with_cache}")
    new = logreg_task.build(cfg, validate(cfg))
    _alg2_reference(monkeypatch)
    ref = logreg_task.build(cfg, validate(cfg))
    assert type(new.method) is LocalGluon and type(ref.method) is Alg2
    coins = _assert_same_run(new, ref)
    _assert_counts(new, ref, coins)


def test_cnn_iterates_equal_alg2_with_zero_compressor_and_only_syncs_cost(monkeypatch):
    """A tiny CNN (widths 8/16/16, 2 workers, augmentation on: the data stream must match)."""
    cfg = compose_config("cnn", "method=local_gluon", "method.q=0.1", "method.B=2",
                         "method.lr=0.05", "method.beta=0.5", "task.widths=[8,16,16]",
                         "n_workers=2", "batch_size=4", "task.eval_train=16",
                         "task.eval_test=16", "task.whiten_images=64", "device=cpu")
    build = partial(cnn_task.build, data=synthetic(n_train=64))
    new = build(cfg, validate(cfg))
    _alg2_reference(monkeypatch)
    ref = build(cfg, validate(cfg))
    coins = _assert_same_run(new, ref)
    _assert_counts(new, ref, coins)


def test_local_gluon_ecmvr_still_evaluates_delta_on_every_step():
    """Alg. 4 with C = 0: the MVR term beta * y^k and the flush use Delta, so it costs 2 per
    worker on every step, and its syncs B more."""
    oracles, params = make_problem()
    workers = [Worker(r, o, seed=0) for r, o in enumerate(oracles)]
    m = make_method("local_gluon_ecmvr", params, workers, InProcessComm(len(workers), seed=0),
                    compressor=Zero(), lr=0.05, q=0.25, B=3)
    assert type(m) is Alg4
    calls = [w.oracle.grad_calls for w in workers]
    _, coins = _run(m, 40)
    for w, before in zip(workers, calls):
        assert w.grads == 3 * sum(coins) + 2 * 40
        assert w.oracle.grad_calls - before == sum(coins) + 2 * 40   # grad_diff: two grads
    assert m.comm.ledger.cost == 2 * sum(coins)                      # flush and sync are dense


@pytest.mark.parametrize("B", [1, 4])
def test_large_batch_gluon_is_alg1_with_q_1_and_identity(B):
    """``large_batch_gluon``: every step a dense gradient on B minibatches per worker."""
    runs = []
    for name, hp in (("large_batch_gluon", {}), ("alg1", {"q": 1.0})):
        oracles, params = make_problem()
        workers = [Worker(r, o, seed=3) for r, o in enumerate(oracles)]
        m = make_method(name, params, workers, InProcessComm(len(workers), seed=3),
                        compressor=Identity(), lr=0.05, beta=0.8, B=B, **hp)
        assert type(m) is Alg1
        runs.append((m, _run(m, 30)))
    (a, (xs, us)), (b, (ys, vs)) = runs
    assert us == vs == [True] * 30
    for x, y in zip(xs, ys):
        assert all(torch.equal(p, r) for p, r in zip(x, y))
    assert [w.grads for w in a.workers] == [30 * B] * len(a.workers)
    assert a.comm.ledger.cost == 30


def test_large_batch_gluon_fixes_q_and_the_compressor():
    oracles, params = make_problem()
    workers = [Worker(r, o, seed=0) for r, o in enumerate(oracles)]
    with pytest.raises(ValueError, match="fixes q = 1.0"):
        make_method("large_batch_gluon", params, workers, InProcessComm(len(workers)),
                    compressor=Identity(), lr=0.1, q=0.5)
    with pytest.raises(ValueError, match="identity"):
        make_method("large_batch_gluon", params, workers, InProcessComm(len(workers)),
                    compressor=Zero(), lr=0.1)
