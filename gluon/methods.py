"""The paper's algorithms (docs/algorithms.md section 4) and its baselines (section 5), each written once.

Every method sees only: the global parameters X (a list of blocks, updated in place), the
workers this process hosts, a :class:`~gluon.comm.Comm` backend, an update rule and a
compressor. The same code therefore runs in the in-process simulation (all n workers local)
and on torch.distributed (one local worker per process).

Notation follows docs/algorithms.md: u^k is the shared coin (u^0 = 1), g^k the gradient estimator, M^k the
momentum, Delta^{tau,k} = grad f_xi(X^k) - grad f_xi(X^{k-1}) on one minibatch xi, e^{tau,k}
the error-feedback memory. ``self.u`` holds u^k during step k; u^{k+1} is drawn at its end.
"""
from __future__ import annotations

import time
from types import MappingProxyType
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch
from torch import Tensor

from .comm import DENSE, Comm, Message, encode
from .compressors import Compressor, Identity
from .lmo import Block, Euclidean
from .worker import Worker

BETA = 0.9   # the momentum decay's default, of every method and every gluon.optim optimiser


# ---------------------------------------------------------------- update rules (X <- X + ...)

class LMOUpdate:
    """Gluon's step: X_i <- X_i + t_i * lr * lmo_i(M_i), one LMO and radius scale per block."""

    def __init__(self, blocks: Sequence[Block]):
        self.blocks = list(blocks)

    def __call__(self, params, direction, lr):
        if len(self.blocks) != len(params):
            raise ValueError(f"{len(self.blocks)} LMO blocks for {len(params)} parameter blocks")
        for p, m, b in zip(params, direction, self.blocks):
            p.add_(b.lmo(m), alpha=lr * b.scale)


class GradientUpdate:
    """Plain gradient step X <- X - lr * M (VR-MARINA)."""

    def __call__(self, params, direction, lr):
        for p, m in zip(params, direction):
            p.add_(m, alpha=-lr)


def _axpby(a: float, xs, b: float, ys):
    return [a * x + b * y for x, y in zip(xs, ys)]


# ---------------------------------------------------------------- the common skeleton

class Method:
    """Shared state and helpers. Subclasses implement :meth:`_direction` for step k."""

    name = "method"
    needs = "any"  # which compressors the theory allows: "unbiased", "contraction" or "any"
    # Whether the 1/B trick (``scale_by_B``) is consistent with the method at all. The default
    # of the switch is per method name, in its registry record's ``defaults`` (on for alg1 and
    # alg2 only).
    allows_scale_by_B = True

    def __init__(self, params: Sequence[Tensor], workers: Sequence[Worker], comm: Comm,
                 update, compressor: Compressor, *, lr: float, beta: float = BETA,
                 q: float = 1.0, B: int = 1, scale_by_B: bool = False, seed: int = 0):
        check_hparams(lr=lr, beta=beta, q=q, B=B)
        _check_kind(self, compressor)
        _check_scale_by_B(self.name, type(self), scale_by_B)
        self.params = list(params)
        self.workers = list(workers)
        if [w.rank for w in self.workers] != list(comm.local_workers):
            raise ValueError("workers must be the comm backend's local workers, in rank order")
        self.comm, self.update, self.compressor = comm, update, compressor
        self.lr, self.beta, self.q, self.B = float(lr), float(beta), float(q), int(B)
        self.scale_by_B = bool(scale_by_B)
        self.seed = seed
        self.dim = sum(p.numel() for p in self.params)
        self.k = 0
        self.u = True                      # u^0 = 1
        self.prev = [p.detach().clone() for p in self.params]  # X^{-1} := X^0
        self.g: list[Tensor] | None = None
        self.M: list[Tensor] | None = None
        # measured compute per worker (s), cumulative: see step(); not part of the algorithm
        self.compute_s = 0.0
        self._cuda = any(p.is_cuda for p in self.params)

    # --- one iteration
    @torch.no_grad()
    def step(self) -> None:
        """One iteration. Adds its compute time to ``compute_s`` (docs/cost.md): the process's
        CPU seconds inside the step (gradients, compression, decoding and averaging, the LMO
        step; waiting in a collective costs no CPU), divided by the number of workers this
        process hosts; on CUDA the wall time between two synchronisations instead."""
        t0 = self._clock()
        direction = self._direction()
        current = [p.detach().clone() for p in self.params]
        self.update(self.params, direction, self.lr)
        self.prev = current
        self.k += 1
        self.compute_s += (self._clock() - t0) / len(self.workers)

    def _clock(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.process_time()

    def _direction(self) -> list[Tensor]:
        raise NotImplementedError

    # --- helpers shared by the algorithms
    def send(self, compressor: Compressor, worker: Worker, blocks) -> Message:
        return encode(compressor, blocks, run_seed=self.seed, worker=worker.rank, step=self.k,
                      dim=self.dim)

    def large_batch_grad(self, w: Worker) -> list[Tensor]:
        """g^{tau,k}: the mean gradient over B minibatches drawn at X^k."""
        w.grads += self.B
        return w.oracle.grad(self.params, w.sample(self.B))

    def minibatch_grad(self, w: Worker) -> list[Tensor]:
        """A stochastic gradient at X^k on one fresh minibatch."""
        w.grads += 1
        return w.oracle.grad(self.params, w.sample(1))

    def delta(self, w: Worker) -> list[Tensor]:
        """Delta^{tau,k} on one fresh minibatch; scaled by 1/B when u^k = 0 and the switch is on.

        The paper's empirical trick (Section 6.1) scales y by 1/B for Alg. 1 and 2; scaling the
        compressor's input instead is the same for any positively homogeneous compressor
        (C(a x) = a C(x), a > 0: identity, RandK, TopK, zero, qsgd). For Alg. 2 too: e restarts
        at 0 on every sync and every step in between is scaled by the same 1/B, so e is 1/B
        times the unscaled memory and C(Delta/B + e) = C(Delta + e_unscaled)/B (a test checks
        it). Default per method name (``METHODS[name].defaults``): on for alg1 and alg2 only.
        """
        w.grads += 2
        d = w.oracle.grad_diff(self.params, self.prev, w.sample(1))
        if self.scale_by_B and not self.u and self.B > 1:
            d = [x / self.B for x in d]
        return d

    def send_with_error_feedback(self, w: Worker) -> Message:
        """y = C(Delta + e) is sent; the worker keeps e <- e + Delta - y (Alg. 2 and 4)."""
        x = _add_error(self.delta(w), w.state.get("e"))
        m = self.send(self.compressor, w, x)
        w.state["e"] = [a - b for a, b in zip(x, m.values)]
        return m

    def full_sync(self) -> list[Tensor]:
        """g^{k+1} on a sync step (u^k = 1): the average of the workers' large-batch
        gradients, sent uncompressed."""
        return self.comm.average([self.send(DENSE, w, self.large_batch_grad(w))
                                  for w in self.workers])

    def plus_g(self, y) -> list[Tensor]:
        """g^{k+1} = g^k + y^k on a step without sync (u^k = 0)."""
        return [a + b for a, b in zip(self.g, y)]

    def advance(self, g, y=None) -> list[Tensor]:
        """The end of every iteration of Alg. 1-4: keep g^k, draw the shared coin u^{k+1}, and
        return the direction M^k (from g^k, and y^k for the MVR variants)."""
        self.g = g
        self.u = self.comm.coin(self.q)   # u^{k+1}
        self.M = self.momentum(g, y)
        return self.M

    def momentum(self, g, y=None) -> list[Tensor]:
        """M^k = beta M^{k-1} + (1-beta) g^k (+ beta y^k for MVR); M^0 = g^0."""
        if self.M is None:
            return [x.clone() for x in g]
        m = _axpby(self.beta, self.M, 1 - self.beta, g)
        if y is not None:
            m = [a + self.beta * b for a, b in zip(m, y)]
        return m

    # --- checkpointing: everything a bit-identical resume needs
    def state_dict(self) -> dict:
        clone = lambda xs: None if xs is None else [x.clone() for x in xs]
        return {"k": self.k, "u": self.u, "params": clone(self.params), "prev": clone(self.prev),
                "g": clone(self.g), "M": clone(self.M), "extra": self._extra_state(),
                "workers": [w.state_dict() for w in self.workers],
                "comm": self.comm.state_dict(), "compute_s": self.compute_s}

    def load_state_dict(self, s: dict) -> None:
        self.k, self.u = s["k"], s["u"]
        with torch.no_grad():
            for p, v in zip(self.params, s["params"]):
                p.copy_(v)
        self.prev, self.g, self.M = s["prev"], s["g"], s["M"]
        self._load_extra_state(s["extra"])
        for w, ws in zip(self.workers, s["workers"]):
            w.load_state_dict(ws)
        self.comm.load_state_dict(s["comm"])
        self.compute_s = s["compute_s"]     # a measurement, not the algorithm's state

    def _extra_state(self):
        return {}

    def _load_extra_state(self, s):
        pass


# ---------------------------------------------------------------- Algorithms 1-4

class Alg1(Method):
    """Compressed Gluon with an unbiased compressor Q (Algorithm 1)."""
    name = "alg1"
    needs = "unbiased"

    def _direction(self):
        if self.u:
            return self.advance(self.full_sync())
        y = self.comm.average([self.send(self.compressor, w, self.delta(w)) for w in self.workers])
        return self.advance(self.plus_g(y))


class Alg2(Method):
    """Compressed Gluon with error feedback and a contraction C (Algorithm 2)."""
    name = "alg2"
    needs = "contraction"

    def _direction(self):
        if self.u:
            for w in self.workers:
                w.state["e"] = None      # e^{tau,k+1} = 0
            return self.advance(self.full_sync())
        y = self.comm.average([self.send_with_error_feedback(w) for w in self.workers])
        return self.advance(self.plus_g(y))


class LocalGluon(Alg2):
    """Local Gluon (Section 4.1): Alg. 2 with C = 0, without the work that C = 0 throws away.

    With C = 0 every message between two syncs is zero, so g^{k+1} = g^k and the error memory
    is never read before the next sync resets it: "we actually do not need to calculate y and
    e". A step without a sync therefore evaluates no Delta, keeps no e and sends no message;
    only the syncs cost gradients (B per worker) and uplink. Each worker still draws the
    minibatch that Alg. 2's Delta would use, and discards it, so the data stream and hence the
    iterates are exactly those of Alg. 2 with the zero compressor (a test checks it).
    """
    name = "local_gluon"

    def _direction(self):
        if self.u:
            return self.advance(self.full_sync())
        for w in self.workers:
            w.sample(1)                  # the minibatch of Alg. 2's Delta: drawn, not evaluated
        return self.advance(self.g)      # g^{k+1} = g^k + C(Delta + e) = g^k


class Alg3(Method):
    """Compressed Gluon with momentum variance reduction, unbiased Q (Algorithm 3)."""
    name = "alg3"
    needs = "unbiased"

    def _direction(self):
        y = self.comm.average([self.send(self.compressor, w, self.delta(w)) for w in self.workers])
        g = self.full_sync() if self.u else self.plus_g(y)
        return self.advance(g, y)


class Alg4(Method):
    """Compressed Gluon with error feedback and MVR, contraction C (Algorithm 4).

    No 1/B trick: e would collect 1/B-scaled Deltas on u = 0 steps while the flush (u = 1)
    sends e + Delta with Delta unscaled, so the sum of the y's would no longer be the sum of
    the Deltas between two flushes. ``scale_by_B=True`` is refused.
    """
    name = "alg4"
    needs = "contraction"
    allows_scale_by_B = False

    def _direction(self):
        msgs = []
        for w in self.workers:
            if self.u:   # flush: send e + Delta uncompressed and forget the error
                msgs.append(self.send(DENSE, w, _add_error(self.delta(w), w.state.get("e"))))
                w.state["e"] = None
            else:
                msgs.append(self.send_with_error_feedback(w))
        y = self.comm.average(msgs)
        g = self.full_sync() if self.u else self.plus_g(y)
        return self.advance(g, y)


def _add_error(delta, e):
    return [d.clone() for d in delta] if e is None else [d + x for d, x in zip(delta, e)]


# ---------------------------------------------------------------- baselines

class VRMarina(Alg1):
    """VR-MARINA with momentum (Gorbunov et al. 2022): with probability q every worker sends
    its full local gradient (whole shard), otherwise Q(Delta) on a minibatch; then a plain
    gradient step X <- X - lr * M. ``full=False`` uses B minibatches instead of the shard."""
    name = "vr_marina"

    def __init__(self, *args, full: bool = True, **kw):
        super().__init__(*args, **kw)
        self.full = bool(full)

    def large_batch_grad(self, w):
        if self.full:
            w.grads += w.oracle.shard_minibatches()
            return w.oracle.grad(self.params, w.oracle.full())
        return super().large_batch_grad(w)


class EF21Muon(Method):
    """EF21-Muon (Gruntkowska et al. 2025), uplink-only form, beta = momentum *decay*:

        M_tau <- beta M_tau + (1-beta) grad f_xi(X)      (local momentum, one minibatch)
        R_tau  = C(M_tau - G_tau);  G_tau <- G_tau + R_tau    (sent: R_tau)
        G = mean_tau G_tau (kept by the server as G <- G + mean R);  LMO step with G.

    Step 0 mirrors u^0 = 1 of the other methods: M_tau^0 is the first stochastic gradient and is
    sent uncompressed, so G^0 = M^0 (cost 1). q and B do not apply.
    """
    name = "ef21_muon"
    needs = "contraction"

    def _direction(self):
        msgs = []
        # every worker's gradient first, then their vector work back to back: the same
        # arithmetic, but the small ops then run on warm caches (``make bench-cnn``)
        grads = [self.minibatch_grad(w) for w in self.workers]
        for w, grad in zip(self.workers, grads):
            mom = w.state.get("M")
            mom = grad if mom is None else _axpby(self.beta, mom, 1 - self.beta, grad)
            w.state["M"] = mom
            if self.k == 0:
                m = self.send(DENSE, w, mom)
                w.state["G"] = [x.clone() for x in m.values]
            else:
                m = self.send(self.compressor, w, [a - b for a, b in zip(mom, w.state["G"])])
                w.state["G"] = [a + b for a, b in zip(w.state["G"], m.values)]
            msgs.append(m)
        r = self.comm.average(msgs)
        self.g = r if self.g is None else self.plus_g(r)
        self.M = self.g
        return self.g


# ---------------------------------------------------------------- checks

def _check_kind(method, c: Compressor):
    if isinstance(c, Identity) or method.needs == "any":
        return
    if method.needs == "unbiased" and not c.unbiased:
        raise ValueError(f"{method.name} needs an unbiased compressor (identity, randk, natural, "
                         f"qsgd); got {c.name!r}")
    if method.needs == "contraction" and c.unbiased:
        raise ValueError(f"{method.name} needs a contraction compressor (identity, topk, zero); "
                         f"got {c.name!r}")


def _check_scale_by_B(name: str, cls, scale_by_B) -> None:
    if scale_by_B and not cls.allows_scale_by_B:
        raise ValueError(f"method {name!r} (Alg. 4) cannot use scale_by_B = true: its error "
                         f"memory would hold 1/B-scaled Deltas while the flush (u = 1) sends "
                         f"e + Delta unscaled. The paper uses the 1/B trick for Alg. 1 and 2 only")


def check_hparams(*, lr=None, beta=None, q=None, B=None):
    """Reject bad hyperparameters before any compute."""
    if lr is not None and not 0 < lr < float("inf"):
        raise ValueError(f"lr must be > 0 and finite, got {lr}")
    if beta is not None and not (0.0 <= beta < 1.0):
        raise ValueError(f"beta must lie in [0, 1), got {beta}")
    if q is not None and not (0.0 <= q <= 1.0):
        raise ValueError(f"q must lie in [0, 1], got {q}")
    if B is not None and (int(B) != B or B < 1):
        raise ValueError(f"B must be a positive integer, got {B}")


# ---------------------------------------------------------------- the registry: one record per method

class MethodSpec(NamedTuple):
    """What a method name means: its class and what it fixes, reads and defaults.

    ``compressor``: the compressor the method always uses (None: any its class accepts, see
    ``Method.needs``). ``update``: "lmo" (Gluon's LMO step) or "gradient" (X <- X - lr M).
    ``fixed``: hyperparameters the method fixes; setting them to something else is an error.
    ``settings``: the hyperparameters the user may set. ``defaults``: per-name defaults of
    settings left unset (the class's own defaults apply otherwise). ``rule``: the method's own
    rule, applied to the hyperparameters after the defaults (returns them, or raises).
    """
    cls: type[Method]
    compressor: str | None
    update: str
    fixed: Mapping[str, Any]
    settings: frozenset[str]
    defaults: Mapping[str, Any]
    rule: Callable[[dict], dict] | None
    doc: str


UPDATES = ("lmo", "gradient")


def _spec(cls, compressor, update, fixed, settings, defaults, rule, doc) -> MethodSpec:
    """A record with read-only ``fixed``/``defaults``, frozen ``settings`` and a known update."""
    if update not in UPDATES:
        raise ValueError(f"update must be one of {UPDATES}, got {update!r}")
    return MethodSpec(cls, compressor, update, MappingProxyType(dict(fixed)),
                      frozenset(settings), MappingProxyType(dict(defaults)), rule, doc)


def _vr_gluon_rule(hp: dict) -> dict:
    """Section 2.2's variance-reduced Gluon: uncompressed with q * B = 1, so B = 1/q and q must
    be 1/B for an integer B; a B given as well must be that one."""
    q = hp.get("q", 1.0)
    check_hparams(q=q)
    B = max(1, round(1.0 / q)) if q > 0 else None
    if B is None or abs(q * B - 1.0) > 1e-9:
        raise ValueError(f"vr_gluon needs q = 1/B for an integer B; got q = {q}")
    if hp.get("B", B) != B:
        raise ValueError(f"vr_gluon sets B = 1/q = {B}; got B = {hp['B']}")
    return {**hp, "B": B}


_SYNC = {"q", "B", "beta", "lr", "scale_by_B"}     # the settings of the methods with syncs
_MOMENTUM = {"beta", "lr"}
# scale_by_B, the paper's 1/B trick (Section 6.1: "we empirically improve Algorithms 1 and 2 by
# scaling y by 1/B when u^k = 0"): on for alg1 and alg2 only. Every other name that takes it
# (alg3, vr_gluon, local_gluon, vr_marina) defaults to off, where turning it on is an extension
# beyond the paper; alg4 and local_gluon_ecmvr refuse it (see Alg4).
_TRICK, _NO_TRICK = {"scale_by_B": True}, {"scale_by_B": False}

METHODS: dict[str, MethodSpec] = {
    # name                     class       compressor  update      fixed               settings             defaults   rule            doc
    "alg1":              _spec(Alg1,       None,       "lmo",      {},                 _SYNC,               _TRICK,    None,           "Alg. 1, unbiased Q"),
    "alg2":              _spec(Alg2,       None,       "lmo",      {},                 _SYNC,               _TRICK,    None,           "Alg. 2, EF, contraction C"),
    "alg3":              _spec(Alg3,       None,       "lmo",      {},                 _SYNC,               _NO_TRICK, None,           "Alg. 3, MVR, unbiased Q"),
    "alg4":              _spec(Alg4,       None,       "lmo",      {},                 _SYNC,               _NO_TRICK, None,           "Alg. 4, EF + MVR, contraction C"),
    "gluon":             _spec(Alg1,       "identity", "lmo",      {"q": 1.0, "B": 1}, _MOMENTUM,           {},        None,           "Gluon: Alg. 1, q = B = 1"),
    "large_batch_gluon": _spec(Alg1,       "identity", "lmo",      {"q": 1.0},         _MOMENTUM | {"B"},   {},        None,           "Gluon on B minibatches: Alg. 1, q = 1"),
    "vr_marina":         _spec(VRMarina,   None,       "gradient", {},                 _SYNC | {"full"},    _NO_TRICK, None,           "VR-MARINA with momentum"),
    "ef21_muon":         _spec(EF21Muon,   None,       "lmo",      {},                 _MOMENTUM,           {},        None,           "EF21-Muon, uplink only"),
    "local_gluon":       _spec(LocalGluon, "zero",     "lmo",      {},                 _SYNC,               _NO_TRICK, None,           "Local Gluon: Alg. 2, C = 0"),
    "local_gluon_ecmvr": _spec(Alg4,       "zero",     "lmo",      {},                 _SYNC,               _NO_TRICK, None,           "Local Gluon EC-MVR: Alg. 4, C = 0"),
    "vr_gluon":          _spec(Alg1,       "identity", "lmo",      {},                 _SYNC,               _NO_TRICK, _vr_gluon_rule, "VR Gluon (Sec. 2.2): B = 1/q"),
}


def method_spec(name: str) -> MethodSpec:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {sorted(METHODS)}")
    return METHODS[name]


def resolve_method(name: str, compressor: Compressor, hparams: dict):
    """Check a method's name, compressor and hyperparameters without building anything.

    Returns (class, hyperparameters, update kind), all read from the method's record in
    ``METHODS``. Settings that a method fixes (gluon: q = 1, B = 1, identity compressor) are
    applied here; setting them to something else is an error, not silently ignored. Per-name
    defaults (scale_by_B on for alg1 and alg2 only) fill settings left unset, then the method's
    own rule applies (vr_gluon: B = 1/q). Experiments call this before loading any data.
    """
    spec = method_spec(name)
    hparams = {k: v for k, v in hparams.items() if v is not None}
    unknown = set(hparams) - spec.settings - set(spec.fixed)
    if unknown:
        raise ValueError(f"method {name!r} takes {sorted(spec.settings)}; "
                         f"got unexpected {sorted(unknown)}")
    for key, value in spec.fixed.items():
        if key in hparams and hparams[key] != value:
            raise ValueError(f"method {name!r} fixes {key} = {value}; got {hparams[key]}")
        hparams[key] = value
    if spec.compressor is not None and compressor.name != spec.compressor:
        raise ValueError(f"method {name!r} always uses the {spec.compressor!r} compressor; "
                         f"got {compressor.name!r}")
    for key, value in spec.defaults.items():
        hparams.setdefault(key, value)
    _check_scale_by_B(name, spec.cls, hparams.get("scale_by_B", False))
    if spec.rule is not None:
        hparams = spec.rule(hparams)
    check_hparams(**{k: hparams.get(k) for k in ("lr", "beta", "q", "B")})
    if "lr" not in hparams:
        raise ValueError(f"method {name!r} needs a learning rate lr")
    _check_kind(spec.cls, compressor)
    return spec.cls, hparams, spec.update


def make_method(name: str, params, workers, comm, *, compressor: Compressor, blocks=None,
                update=None, seed: int = 0, **hparams) -> Method:
    """Build method ``name`` over ``params`` (checked by :func:`resolve_method` first).

    ``blocks`` (from :func:`gluon.lmo.assign_lmos`) give the LMO step; without them every block
    is Euclidean. ``update`` replaces the update rule altogether.
    """
    cls, hparams, kind = resolve_method(name, compressor, hparams)
    params = list(params)
    if update is None:
        if kind == "gradient":
            update = GradientUpdate()
        else:
            update = LMOUpdate(blocks if blocks is not None else
                               [Block(str(i), Euclidean()) for i in range(len(params))])
    return cls(params, workers, comm, update, compressor, seed=seed, **hparams)
