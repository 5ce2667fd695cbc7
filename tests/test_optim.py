"""gluon.optim: the optimisers driven by a plain loop equal the engine, iterate by iterate.

The engine is :func:`gluon.simulate_module` with one worker whose oracle owns the data; the
optimiser gets the same minibatches from the user's iterator (the same generator, drawn in the
same order) and the user's closure. A synchronisation's large batch is B closure calls averaged
with weight 1/B each. The engine's oracle here computes its large batch the same way, minibatch
by minibatch (:class:`MinibatchOracle`, like the CNN task's chunked oracle). Otherwise the two
large-batch gradients differ in the last bits only (``test_large_batch_is_mean_of_minibatches``).
"""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gluon
from gluon import InProcessComm, ModuleOracle, RandK, TopK, assign_lmos, optim

torch.set_num_threads(1)
SEED, STEPS, LR, BETA, Q, B, BATCH = 3, 14, 0.05, 0.9, 0.3, 3, 8

# optimiser class, its method name, its settings (q and B where it takes them)
CASES = {
    "gluon": (optim.Gluon, {}),
    "alg1": (optim.CompressedGluon, {"compressor": RandK(density=0.2), "q": Q, "B": B}),
    "alg2": (optim.CompressedGluonEF, {"compressor": TopK(density=0.2), "q": Q, "B": B}),
    "alg3": (optim.CompressedGluonMVR, {"compressor": RandK(density=0.2), "q": Q, "B": B}),
    "alg4": (optim.CompressedGluonEFMVR, {"compressor": TopK(density=0.2), "q": Q, "B": B}),
    "ef21_muon": (optim.EF21Muon, {"compressor": TopK(density=0.2)}),
}


# ---------------------------------------------------------------- shared with test_optim_dist

class MinibatchOracle(ModuleOracle):
    """ModuleOracle whose large batch (B minibatches drawn as one) is the mean of the B
    minibatch gradients, weight 1/B each, summed in order: what the optimiser computes."""

    def grad(self, params, batch):
        x, y = batch
        if len(x) <= self.batch_size:
            return super().grad(params, batch)
        w, total = 1.0 / (len(x) // self.batch_size), None
        for xs, ys in zip(x.split(self.batch_size), y.split(self.batch_size)):
            g = super().grad(params, (xs, ys))
            total = [w * a for a in g] if total is None else [t + w * a for t, a in zip(total, g)]
        return total


class ShardBatches:
    """The user's data order: minibatches of a shard, drawn by a generator seeded as the engine
    seeds worker ``rank`` (so both see the same batches). Its state can be checkpointed."""

    def __init__(self, X, y, batch_size: int, seed: int, rank: int = 0):
        self.X, self.y, self.batch_size = X, y, batch_size
        self.gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)

    def __iter__(self):
        return self

    def __next__(self):
        idx = torch.randint(len(self.X), (self.batch_size,), generator=self.gen)
        return self.X[idx], self.y[idx]


def make_data(seed: int = 0, n: int = 256):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 10, generator=g)
    return X, (X[:, 0] * X[:, 1] > 0).long() + (X[:, 2] > 1).long()


def make_model(seed: int = 0) -> nn.Module:
    """Spectral hidden matrices, RMS biases, a Sign head (Scion's rule), and a frozen tensor."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(10, 16), nn.GELU(), nn.Linear(16, 12), nn.GELU(),
                          nn.Linear(12, 3))
    model.register_parameter("frozen", nn.Parameter(torch.ones(3), requires_grad=False))
    return model


def closure_of(model):
    def loss_on(batch):
        x, y = batch
        return F.cross_entropy(model(x), y)
    return loss_on


def engine(name: str, model, X, y, *, rank: int = 0, comm=None, oracles=None, **settings):
    """The library's engine for method ``name`` on ``model`` (worker ``rank``'s shard X, y)."""
    settings = dict(settings)
    settings.setdefault("compressor", gluon.Identity())
    if oracles is None:
        oracles = {rank: MinibatchOracle(model, F.cross_entropy, X, y, batch_size=BATCH)}
    return gluon.simulate_module(name, model, oracles, lr=LR, beta=BETA, seed=SEED, comm=comm,
                                 **settings)


def params_of(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def equal(xs, ys) -> bool:
    return len(xs) == len(ys) and all(torch.equal(a, b) for a, b in zip(xs, ys))


# ---------------------------------------------------------------- exactness, n = 1

@pytest.mark.parametrize("name", list(CASES))
def test_matches_engine_step_by_step(name):
    cls, settings = CASES[name]
    X, y = make_data()
    ma, mb = make_model(), make_model()
    eng = engine(name, ma, X, y, **settings)
    opt = cls(mb.named_parameters(), lr=LR, beta=BETA, seed=SEED, **settings)
    assert isinstance(opt.comm, InProcessComm) and opt.comm.n_workers == 1
    batches, loss_on = ShardBatches(X, y, BATCH, SEED), closure_of(mb)
    syncs = []
    for k in range(STEPS):
        sync = eng.u
        assert opt.sync == (bool(sync) if name != "ef21_muon" else k == 0)
        eng.step()
        loss = opt.step(loss_on, batches)
        assert equal(params_of(ma), params_of(mb)), f"step {k}"
        assert equal(eng.prev, opt.algorithm.prev) and equal(eng.M, opt.algorithm.M)
        syncs.append(opt.last.sync)
        assert opt.last.k == k and torch.isfinite(loss)
    assert not equal(params_of(mb), params_of(make_model()))      # it moved
    assert eng.comm.ledger.state_dict() == opt.ledger.state_dict()
    if "q" in settings:                                           # both coin outcomes happened
        assert any(syncs[1:]) and not all(syncs)
        calls = {True: B + (name in ("alg3", "alg4")), False: 1}
        assert opt.last.batches == calls[opt.last.sync]


def test_step_record_counts_batches_calls_and_bytes():
    X, y = make_data()
    model = make_model()
    opt = optim.CompressedGluon(model.named_parameters(), lr=LR, compressor=RandK(density=0.2),
                                q=Q, B=B, seed=SEED)
    batches, loss_on = ShardBatches(X, y, BATCH, SEED), closure_of(model)
    seen = set()
    for _ in range(STEPS):
        sync, bytes0 = opt.sync, opt.ledger.bytes
        opt.step(loss_on, batches)
        r = opt.last
        assert r.sync == sync
        assert (r.batches, r.closure_calls) == ((B, B) if sync else (1, 2))
        assert r.bytes == opt.ledger.bytes - bytes0
        sizes = [p.numel() for p in model.parameters() if p.requires_grad]
        assert r.bytes == 4 * (sum(sizes) if sync else sum(RandK(density=0.2).k(n) for n in sizes))
        seen.add(sync)
    assert seen == {True, False}


def test_large_batch_is_mean_of_minibatches():
    """B closure calls averaged = the gradient on the B concatenated minibatches, to rounding."""
    X, y = make_data()
    model = make_model()
    params = [p for p in model.parameters() if p.requires_grad]
    oracle = optim.ClosureOracle(params)
    data = ShardBatches(X, y, BATCH, SEED)
    oracle.bind(closure_of(model), data)
    batches = oracle.sample(None, 4)
    mean = oracle.grad(params, batches)
    whole = ModuleOracle(model, F.cross_entropy, X, y, BATCH).grad(
        params, (torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])))
    for a, b in zip(mean, whole):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    assert oracle.drawn == 4 and oracle.calls == 4


def test_delta_is_evaluated_at_the_previous_iterate_on_the_same_batch():
    """A Delta step calls the closure twice on one batch, first at X^k and then at X^{k-1};
    between steps the parameters hold the current iterate."""
    X, y = make_data()
    model = make_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = optim.CompressedGluon(model.named_parameters(), lr=LR, compressor=RandK(density=0.2),
                                q=1e-9, B=2, seed=SEED)
    batches = ShardBatches(X, y, BATCH, SEED)
    opt.step(closure_of(model), batches)                 # step 0: the sync (u^0 = 1)
    assert not opt.sync
    seen = []

    def recording(batch):
        seen.append((batch, [p.detach().clone() for p in trainable]))
        return closure_of(model)(batch)
    x_prev = [p.clone() for p in opt.algorithm.prev]
    x_now = [p.detach().clone() for p in trainable]
    opt.step(recording, batches)
    (b0, at0), (b1, at1) = seen
    assert b0 is b1 and equal(at0, x_now)
    assert equal(at1, x_prev) and not equal(at0, at1)
    assert equal([p.detach() for p in trainable], opt.algorithm.params)
    assert equal(opt.algorithm.prev, at0)                # X^k is now the previous iterate


def test_delta_sees_the_same_randomness_at_both_points():
    """Dropout (or augmentation) inside the closure draws the same numbers at X^k and X^{k-1},
    and torch's generator advances as if the closure had run once."""
    X, y = make_data()
    model = make_model()
    opt = optim.CompressedGluon(model.named_parameters(), lr=LR, compressor=RandK(density=0.2),
                                q=1e-9, B=2, seed=SEED)
    batches = ShardBatches(X, y, BATCH, SEED)
    opt.step(closure_of(model), batches)                 # the sync
    draws = []

    def noisy(batch):
        mask = torch.rand(batch[0].shape) > 0.1          # a dropout mask on the inputs
        draws.append(mask)
        return closure_of(model)((batch[0] * mask, batch[1]))
    torch.manual_seed(11)
    opt.step(noisy, batches)
    next_draw = torch.rand(3)
    torch.manual_seed(11)
    once = torch.rand(X[:BATCH].shape) > 0.1             # the closure run once
    assert len(draws) == 2 and torch.equal(draws[0], draws[1]) and torch.equal(draws[0], once)
    assert torch.equal(next_draw, torch.rand(3))


# ---------------------------------------------------------------- param groups, LMOs, schedulers

def test_default_lmos_are_scions_rule_and_frozen_parameters_stay():
    model = make_model()
    opt = optim.Gluon(model.named_parameters(), lr=LR)
    named = [(n, p.shape) for n, p in model.named_parameters() if p.requires_grad]
    ref = assign_lmos(named)
    assert [(b.name, type(b.lmo), b.scale) for b in opt.blocks] == \
        [(b.name, type(b.lmo), b.scale) for b in ref]
    assert [type(b.lmo).__name__ for b in opt.blocks] == \
        ["Spectral", "RMS", "Spectral", "RMS", "Sign", "RMS"]
    assert opt.blocks[4].scale == 16.0
    unnamed = optim.Gluon(model.parameters(), lr=LR)              # by shape and order alone
    assert [(type(b.lmo), b.scale) for b in unnamed.blocks] == \
        [(type(b.lmo), b.scale) for b in ref]
    X, y = make_data()
    batches = ShardBatches(X, y, BATCH, SEED)
    for _ in range(3):
        opt.step(closure_of(model), batches)
    assert torch.equal(model.frozen, torch.ones(3))


def test_group_lr_and_lmo_override_give_the_lmo_step_exactly():
    """Two groups: hidden layers at lr a (Scion's rule), the head at lr b with a Euclidean LMO of
    radius scale 2. Gluon's first step is X + lr_g * t_i * lmo_i(g^0) for every block, bit for bit."""
    model = make_model()
    head = dict(model[4].named_parameters(prefix="4"))
    body = [(n, p) for n, p in model.named_parameters() if n not in head]
    a, b = 0.05, 0.2
    opt = optim.Gluon([{"params": body}, {"params": list(head.items()), "lr": b,
                                          "lmo": "euclidean", "lmo_scale": 2.0}], lr=a)
    kinds = {blk.name: (type(blk.lmo).__name__, blk.scale) for blk in opt.blocks}
    assert kinds["4.weight"] == ("Euclidean", 2.0) and kinds["4.bias"] == ("Euclidean", 2.0)
    assert kinds["0.weight"] == ("Spectral", 1.0) and kinds["2.weight"] == ("Spectral", 1.0)
    X, y = make_data()
    batch = next(ShardBatches(X, y, BATCH, SEED))
    trainable = [p for p in model.parameters() if p.requires_grad]
    order = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    before = [p.detach().clone() for p in order]
    grads = torch.autograd.grad(closure_of(model)(batch), order)
    opt.step(closure_of(model), iter([batch]))
    lrs = [a] * (len(order) - 2) + [b, b]
    for p, x0, g, blk, lr in zip(order, before, grads, opt.blocks, lrs):
        assert torch.equal(p, x0.add(blk.lmo(g), alpha=lr * blk.scale)), blk.name
    assert {id(p) for p in order} == {id(p) for p in trainable}
    unnamed = optim.Gluon([{"params": [p for _, p in body]},        # without names: the same
                           {"params": list(head.values()), "lmo": "euclidean", "lmo_scale": 2.0}],
                          lr=a)
    assert [(type(x.lmo), x.scale) for x in unnamed.blocks] == \
        [(type(x.lmo), x.scale) for x in opt.blocks]


def test_scheduler_and_beta_follow_the_param_groups():
    """LambdaLR on the optimiser and a beta changed mid-run = the engine given the same lr and
    beta at every step, bit for bit."""
    X, y = make_data()
    ma, mb = make_model(), make_model()
    settings = CASES["alg2"][1]
    eng = engine("alg2", ma, X, y, **settings)
    opt = optim.CompressedGluonEF(mb.named_parameters(), lr=LR, beta=BETA, seed=SEED, **settings)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1.0 + 0.3 * k))
    batches, loss_on = ShardBatches(X, y, BATCH, SEED), closure_of(mb)
    lrs = []
    for k in range(STEPS):
        if k == 6:
            opt.param_groups[0]["beta"] = 0.5
        eng.lr, eng.beta = opt.param_groups[0]["lr"], opt.param_groups[0]["beta"]
        lrs.append(eng.lr)
        eng.step()
        opt.step(loss_on, batches)
        sched.step()
        assert equal(params_of(ma), params_of(mb)), f"step {k}"
    assert len(set(lrs)) == STEPS and lrs[0] == LR and opt.algorithm.beta == 0.5


def test_a_schedule_may_reach_lr_0_but_not_below():
    """CosineAnnealingLR ends at lr = 0: that step leaves the parameters where they are."""
    X, y = make_data()
    model = make_model()
    opt = optim.Gluon(model.named_parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=2)
    batches = ShardBatches(X, y, BATCH, SEED)
    for _ in range(2):
        opt.step(closure_of(model), batches)
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.0
    before = params_of(model)
    opt.step(closure_of(model), batches)
    assert equal(params_of(model), before) and opt.k == 3
    opt.param_groups[0]["lr"] = -0.1
    with pytest.raises(ValueError, match="lr must be >= 0"):
        opt.step(closure_of(model), batches)


# ---------------------------------------------------------------- resume

def _run(name: str, steps: int, *, stop: int | None = None):
    """Train ``steps`` steps with a scheduler; with ``stop``, checkpoint after ``stop`` steps
    (model, optimiser, scheduler, data order), rebuild everything from a different
    initialisation, load, and finish. Returns the parameters after every step and the state."""
    cls, settings = CASES[name]
    X, y = make_data()

    def build(init_seed):
        model = make_model(init_seed)
        opt = cls(model.named_parameters(), lr=LR, beta=BETA, seed=SEED, **settings)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        return model, opt, sched, ShardBatches(X, y, BATCH, SEED)

    model, opt, sched, data = build(0)
    traj = []
    for k in range(steps):
        if k == stop:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "data": data.gen.get_state()}, buf)
            buf.seek(0)
            ck = torch.load(buf, weights_only=False)
            model, opt, sched, data = build(1)
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            sched.load_state_dict(ck["sched"])
            data.gen.set_state(ck["data"])
            assert _same_state(opt.state_dict(), ck["opt"])           # exact round trip
        opt.step(closure_of(model), data)
        sched.step()
        traj.append(params_of(model))
    return traj, opt


ALGORITHM_STATE = ("k", "u", "prev", "g", "M", "extra", "workers", "comm")


def _algorithm_state(opt) -> dict:
    """What the iterates depend on: the method's vectors, the workers' memory and generators,
    the coin's stream and the ledger (not measurements such as timings)."""
    s = opt.state_dict()
    return {"groups": s["param_groups"],
            **{k: s["gluon"]["algorithm"][k] for k in ALGORITHM_STATE}}


def _same_state(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("name", ["alg1", "alg2", "alg4", "ef21_muon"])
def test_resume_from_state_dict_is_bit_identical(name):
    full, opt_full = _run(name, STEPS)
    resumed, opt_res = _run(name, STEPS, stop=5)
    for k, (a, b) in enumerate(zip(full, resumed)):
        assert equal(a, b), f"step {k}"
    assert _same_state(_algorithm_state(opt_full), _algorithm_state(opt_res))
    s = opt_full.state_dict()["gluon"]["algorithm"]
    assert "params" not in s and s["prev"] is not None and s["M"] is not None
    if name in ("alg2", "alg4", "ef21_muon"):     # the worker's memory travels in the state
        assert any(v is not None for v in s["workers"][0]["state"].values())


def test_load_state_dict_refuses_another_method_or_world():
    model = make_model()
    a = optim.Gluon(model.named_parameters(), lr=LR)
    b = optim.CompressedGluon(model.named_parameters(), lr=LR, compressor=RandK(density=0.2),
                              q=Q, B=B)
    with pytest.raises(ValueError, match="method 'gluon' loaded into 'alg1'"):
        b.load_state_dict(a.state_dict())
    s = a.state_dict()
    s["gluon"]["n_workers"] = 2
    with pytest.raises(ValueError, match="of 2 loaded into"):
        a.load_state_dict(s)


def _other(field):
    """A state_dict saved by an optimiser that differs from the reference one (Alg. 1, RandK
    20%, q = Q, B = B, lr = LR, beta = BETA, seed = SEED, Scion's LMOs) in ``field``, after a
    few steps."""
    X, y = make_data()
    model = make_model()
    kw = dict(lr=LR, beta=BETA, seed=SEED, compressor=RandK(density=0.2), q=Q, B=B)
    kw.update({"compressor": {"compressor": RandK(density=0.05)}, "q": {"q": 0.7},
               "B": {"B": 2}, "beta": {"beta": 0.5}, "lr": {"lr": 0.2}, "seed": {"seed": 9},
               "scale_by_B": {"scale_by_B": False}, "lmo": {"lmo_rules": [(r"^4\.weight$", "spectral", 1.0)]},
               "shapes": {}}[field])
    if field == "shapes":
        model = nn.Sequential(nn.Linear(10, 32), nn.GELU(), nn.Linear(32, 12), nn.GELU(),
                              nn.Linear(12, 3))
    opt = optim.CompressedGluon(model.named_parameters(), **kw)
    batches = ShardBatches(X, y, BATCH, SEED)
    for _ in range(3):
        opt.step(closure_of(model), batches)
    return opt.state_dict()


@pytest.mark.parametrize("field, match", [
    ("shapes", r"parameter 0\.weight: shape \(32, 10\) in the state, \(16, 10\) here"),
    ("compressor", r"compressor: RandK\(density=0\.05\) in the state, RandK\(density=0\.2\) here"),
    ("q", r"q: 0\.7 in the state, 0\.3 here"),
    ("B", r"B: 2 in the state, 3 here"),
    ("beta", r"beta: 0\.5 in the state, 0\.9 here"),
    ("lr", r"lr: \[0\.2\] in the state, \[0\.05\] here"),
    ("seed", r"seed: 9 in the state, 3 here"),
    ("scale_by_B", r"scale_by_B: False in the state, True here"),
    ("lmo", r"lmo of 4\.weight: Spectral\(.*\) x 1 in the state, Sign\(.*\) x 16 here"),
])
def test_load_state_dict_refuses_other_shapes_compressor_and_settings(field, match):
    """A state saved by an optimiser built otherwise (another model, compressor, q, B, beta,
    lr, seed, 1/B switch or LMO) is refused, naming the field, and changes nothing: before,
    beta came from the state and q, B from the constructor, and another model's state failed
    at the next step deep in the method."""
    model = make_model()
    opt = optim.CompressedGluon(model.named_parameters(), lr=LR, beta=BETA, seed=SEED,
                                compressor=RandK(density=0.2), q=Q, B=B)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(_other(field))
    assert _same_state(opt.state_dict(), before)
    opt.load_state_dict(before)                                 # its own state loads


def test_a_scheduled_lr_in_the_state_is_not_a_mismatch():
    """What a state carries in its param groups (a schedule's current lr) is the state's; the
    settings compared are those the optimiser was built with."""
    X, y = make_data()
    model = make_model()
    build = lambda: optim.Gluon(model.named_parameters(), lr=LR, beta=BETA, seed=SEED)  # noqa: E731
    opt = build()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    batches = ShardBatches(X, y, BATCH, SEED)
    for _ in range(3):
        opt.step(closure_of(model), batches)
        sched.step()
    again = build()
    again.load_state_dict(opt.state_dict())
    assert again.param_groups[0]["lr"] == LR / 8


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_loss_is_refused_before_the_parameters_change(bad):
    """A loss that is NaN or inf makes the step's direction non-finite: the step raises
    FloatingPointError naming the step and leaves the parameters at X^k (before, they all
    became NaN without a word)."""
    X, y = make_data()
    model = make_model()
    opt = optim.CompressedGluon(model.named_parameters(), lr=LR, beta=BETA, seed=SEED,
                                compressor=RandK(density=0.2), q=Q, B=B)
    batches = ShardBatches(X, y, BATCH, SEED)
    for _ in range(3):
        opt.step(closure_of(model), batches)
    good = closure_of(model)
    before = params_of(model)

    def poisoned(batch):
        return good(batch) * bad
    with pytest.raises(FloatingPointError, match="step 3: the update direction is not finite"):
        opt.step(poisoned, batches)
    assert equal(params_of(model), before) and opt.k == 3


# ---------------------------------------------------------------- misuse: refused before any step

def _bad(kind):
    model = make_model()
    named = list(model.named_parameters())
    r, t = RandK(density=0.2), TopK(density=0.2)
    return {
        "q = 0": lambda: optim.CompressedGluon(named, lr=LR, compressor=r, q=0.0, B=B),
        "q > 1": lambda: optim.CompressedGluon(named, lr=LR, compressor=r, q=1.5, B=B),
        "B = 0": lambda: optim.CompressedGluonEF(named, lr=LR, compressor=t, q=Q, B=0),
        "B not integer": lambda: optim.CompressedGluonMVR(named, lr=LR, compressor=r, q=Q, B=2.5),
        "lr = 0": lambda: optim.Gluon(named, lr=0.0),
        "beta = 1": lambda: optim.Gluon(named, lr=LR, beta=1.0),
        "alg1 with topk": lambda: optim.CompressedGluon(named, lr=LR, compressor=t, q=Q, B=B),
        "alg3 with topk": lambda: optim.CompressedGluonMVR(named, lr=LR, compressor=t, q=Q, B=B),
        "alg2 with randk": lambda: optim.CompressedGluonEF(named, lr=LR, compressor=r, q=Q, B=B),
        "alg4 with randk": lambda: optim.CompressedGluonEFMVR(named, lr=LR, compressor=r, q=Q, B=B),
        "ef21 with randk": lambda: optim.EF21Muon(named, lr=LR, compressor=r),
        "gluon with randk": lambda: optim.Gluon(named, lr=LR, compressor=r),
        "alg4 with 1/B": lambda: optim.CompressedGluonEFMVR(named, lr=LR, compressor=t, q=Q, B=B,
                                                            scale_by_B=True),
        "two devices": lambda: optim.Gluon(named + [("extra", nn.Parameter(
            torch.zeros(2, device="meta")))], lr=LR),
        "betas differ": lambda: optim.Gluon([{"params": named[:2]},
                                             {"params": named[2:], "beta": 0.5}], lr=LR),
        "unknown lmo": lambda: optim.Gluon([{"params": named, "lmo": "nuclear"}], lr=LR),
        "rules without names": lambda: optim.Gluon([p for _, p in named], lr=LR,
                                                   lmo_rules=[("0", "sign", 1.0)]),
    }[kind]


@pytest.mark.parametrize("kind, error, match", [
    ("q = 0", ValueError, r"q must lie in \(0, 1\]"),
    ("q > 1", ValueError, r"q must lie in \(0, 1\]"),
    ("B = 0", ValueError, "B must be a positive integer"),
    ("B not integer", ValueError, "B must be a positive integer"),
    ("lr = 0", ValueError, "lr must be > 0"),
    ("beta = 1", ValueError, r"beta must lie in \[0, 1\)"),
    ("alg1 with topk", ValueError, "needs an unbiased compressor"),
    ("alg3 with topk", ValueError, "needs an unbiased compressor"),
    ("alg2 with randk", ValueError, "needs a contraction compressor"),
    ("alg4 with randk", ValueError, "needs a contraction compressor"),
    ("ef21 with randk", ValueError, "needs a contraction compressor"),
    ("gluon with randk", ValueError, "always uses the 'identity' compressor"),
    ("alg4 with 1/B", ValueError, "cannot use scale_by_B"),
    ("two devices", ValueError, "one device"),
    ("betas differ", ValueError, "beta must be the same in every param group"),
    ("unknown lmo", ValueError, "unknown LMO 'nuclear'"),
    ("rules without names", ValueError, "named_parameters"),
])
def test_bad_construction_is_refused(kind, error, match):
    with pytest.raises(error, match=match):
        _bad(kind)()


def _nothing(batch):
    pass


@pytest.mark.parametrize("closure, batches, error, match", [
    (_nothing, None, ValueError, "returned None"),
    (lambda m: (lambda b: F.cross_entropy(m(b[0]), b[1]).item()), None, TypeError, "float"),
    (lambda m: (lambda b: F.cross_entropy(m(b[0]), b[1], reduction="none")), None, ValueError,
     "scalar loss"),
    (lambda m: (lambda b: F.cross_entropy(m(b[0]), b[1]).detach()), None, ValueError,
     "does not depend on the parameters"),
    (lambda m: (lambda b: _backward(F.cross_entropy(m(b[0]), b[1]))), None, RuntimeError,
     "called backward"),
    (closure_of, "list", TypeError, "must be an iterator"),
    (closure_of, "short", ValueError, "ran out after 1 batches"),
])
def test_misuse_is_refused_before_the_parameters_change(closure, batches, error, match):
    X, y = make_data()
    model = make_model()
    opt = optim.CompressedGluon(model.named_parameters(), lr=LR, compressor=RandK(density=0.2),
                                q=Q, B=2, seed=SEED)
    fn = closure if closure is _nothing else closure(model)
    data = {None: ShardBatches(X, y, BATCH, SEED), "list": [next(ShardBatches(X, y, BATCH, 0))],
            "short": iter([next(ShardBatches(X, y, BATCH, 0))])}[batches]
    before = params_of(model)
    with pytest.raises(error, match=match):
        opt.step(fn, data)
    assert equal(params_of(model), before) and opt.k == 0 and opt.ledger.cost == 0.0


def _backward(loss):
    loss.backward()
    return loss


def test_param_groups_are_fixed_after_construction():
    model = make_model()
    opt = optim.Gluon(list(model.named_parameters())[:2], lr=LR)
    with pytest.raises(NotImplementedError, match="fixed at construction"):
        opt.add_param_group({"params": [model[2].weight]})


def test_forever_reshuffles_and_refuses_an_empty_loader():
    loader = torch.utils.data.DataLoader(torch.arange(6), batch_size=3, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    it = optim.forever(loader)
    epochs = [torch.cat([next(it), next(it)]) for _ in range(3)]
    assert all(sorted(e.tolist()) == list(range(6)) for e in epochs)
    assert len({tuple(e.tolist()) for e in epochs}) > 1
    with pytest.raises(ValueError, match="no batches"):
        next(optim.forever([]))
