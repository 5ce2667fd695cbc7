"""Running a method: build an in-process simulation, step it, log, detect divergence."""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from .comm import Comm, InProcessComm
from .compressors import Compressor
from .lmo import LMO_DEFAULT, NS_STEPS, SCION_HEAD_SCALE, assign_lmos
from .methods import Method, make_method
from .worker import Oracle, Worker


def simulate(method: str, params: Sequence[Tensor], oracles: Sequence[Oracle], *,
             compressor: Compressor, blocks=None, seed: int = 0, comm: Comm | None = None,
             **hparams) -> Method:
    """n = len(oracles) workers in this process, worker tau owning ``oracles[tau]``.

    ``comm`` replaces the in-process simulation by another backend (e.g.
    :class:`gluon.distributed.TorchDistComm`): only the workers it hosts (``comm.local_workers``)
    are built, so ``oracles`` needs to hold only theirs (a mapping rank -> oracle will do; with
    the simulation, a mapping must hold every rank 0..n-1)."""
    comm = comm if comm is not None else InProcessComm(len(oracles), seed=seed)
    workers = [Worker(r, oracles[r], seed) for r in comm.local_workers]
    return make_method(method, list(params), workers, comm, compressor=compressor,
                       blocks=blocks, seed=seed, **hparams)


def simulate_module(method: str, model: nn.Module, oracles: Sequence[Oracle], *,
                    compressor: Compressor, lmo_rules=None, lmo_default: str = LMO_DEFAULT,
                    ns_steps: int = NS_STEPS, head_scale: float = SCION_HEAD_SCALE, seed: int = 0,
                    comm: Comm | None = None, **hparams) -> Method:
    """As :func:`simulate` for a ``torch.nn.Module``: LMOs assigned by name and shape
    (:func:`gluon.lmo.assign_lmos`; the head's radius is ``head_scale`` times lr)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    blocks = assign_lmos([(n, p.shape) for n, p in named], lmo_rules, lmo_default, ns_steps,
                         head_scale)
    return simulate(method, [p.data for _, p in named], oracles, compressor=compressor,
                    blocks=blocks, seed=seed, comm=comm, **hparams)


def is_finite(params: Sequence[Tensor]) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in params)


def gradients_per_worker(method: Method) -> float:
    """Stochastic gradient evaluations per worker so far, in minibatches (every worker makes
    the same number; a process of a multi-process run sees its own workers)."""
    return sum(w.grads for w in method.workers) / len(method.workers)


def train(method: Method, steps: int, *, log_every: int | None,
          evaluate: Callable[[Method], dict],
          on_log: Callable[[dict], None] = lambda row: None,
          on_step: Callable[[Method], None] = lambda m: None,
          max_comm: float | None = None, log_comm: float | None = None,
          max_grads: float | None = None, log_grads: float | None = None) -> str:
    """Run ``method`` until it has done ``steps`` steps (resuming from ``method.k``), or until
    its cumulative uplink cost per worker reaches ``max_comm`` (a communication budget), or
    until each worker has made ``max_grads`` gradient evaluations (a compute budget).

    Logs a row {step, comm, bytes, grads, up_bytes, down_bytes, star_down_bytes, rounds, hops,
    compute_s, **evaluate(method)} (the costs: docs/cost.md) at step 0, at the end, every
    ``log_every`` steps (0 or None: never by step count) and, with ``log_comm``, at the first
    step whose uplink crosses each multiple of ``log_comm`` (rows aligned on communication, so
    every method is looked at equally often per unit of uplink, however much its steps cost) and,
    with ``log_grads``, likewise at each multiple of ``log_grads`` gradient evaluations per worker
    (rows aligned on compute).
    Returns "ok", or "diverged" at the first logged row whose parameters or values are not
    finite (checked at logging steps only, so the check costs nothing in between; the run is
    then recorded, not crashed).
    """
    if not log_every and not log_comm and not log_grads:
        raise ValueError("train needs log_every > 0, log_comm > 0 or log_grads > 0")
    for name, value in (("log_comm", log_comm), ("log_grads", log_grads)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    def log() -> bool:
        led = method.comm.ledger
        row = {"step": method.k, "comm": led.cost, "bytes": led.bytes,
               "grads": gradients_per_worker(method), **led.totals(),
               "compute_s": method.compute_s}
        finite = is_finite(method.params)
        if finite:
            row.update(evaluate(method))
            finite = all(math.isfinite(v) for v in row.values() if isinstance(v, float))
        on_log(row)
        return finite

    if method.k == 0 and not log():
        return "diverged"
    def done():
        return (method.k >= steps
                or (max_comm is not None and method.comm.ledger.cost >= max_comm)
                or (max_grads is not None and gradients_per_worker(method) >= max_grads))

    def crossed(every: float | None, before: float, now: float) -> bool:
        # stateless, so a resumed run logs the same rows
        return bool(every) and math.floor(now / every) > math.floor(before / every)

    while not done():
        comm, grads = method.comm.ledger.cost, gradients_per_worker(method)
        method.step()
        if ((log_every and method.k % log_every == 0) or done()
                or crossed(log_comm, comm, method.comm.ledger.cost)
                or crossed(log_grads, grads, gradients_per_worker(method))):
            if not log():
                return "diverged"
        on_step(method)
    return "ok"
