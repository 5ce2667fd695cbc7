"""A worker: its local stochastic gradient oracle, its own RNG stream and its own state.

An :class:`Oracle` is what a task provides: gradients of the worker's local objective f^tau
on minibatches of its shard. :class:`ModuleOracle` covers any ``torch.nn.Module`` through
autograd; tasks with closed-form gradients (logistic regression) subclass :class:`Oracle`.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call


class Oracle:
    """Stochastic first-order oracle of one worker's local objective."""

    def sample(self, gen: torch.Generator, batches: int = 1) -> Any:
        """Draw ``batches`` independent minibatches (as one concatenated batch)."""
        raise NotImplementedError

    def full(self) -> Any:
        """The worker's whole shard as one batch (VR-MARINA's full local gradient)."""
        raise NotImplementedError

    def grad(self, params: Sequence[Tensor], batch: Any) -> list[Tensor]:
        raise NotImplementedError

    def grad_diff(self, params, prev, batch) -> list[Tensor]:
        """grad f_xi(X) - grad f_xi(X_prev) on the same sample xi."""
        return [a - b for a, b in zip(self.grad(params, batch), self.grad(prev, batch))]

    def loss(self, params: Sequence[Tensor], batch: Any) -> float:
        raise NotImplementedError

    def shard_minibatches(self) -> float:
        """The whole shard (:meth:`full`) in minibatches of the task's batch size (counting
        gradient evaluations: a full local gradient costs this many). Needed by methods that
        take full local gradients (VR-MARINA with ``full``)."""
        raise NotImplementedError(f"{type(self).__name__} needs shard_minibatches() (the shard "
                                  "size over the batch size) to count a full local gradient")


class ModuleOracle(Oracle):
    """Autograd oracle for any module: loss_fn(model(inputs), targets) averaged over the batch.

    ``params`` handed to :meth:`grad` replace the module's trainable parameters by name
    (``torch.func.functional_call``), so the same module evaluates gradients at X and X_prev.
    Buffers (BatchNorm running statistics) are the module's own: a model whose forward pass
    updates them in training mode updates them on every gradient evaluation.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable, inputs: Tensor, targets: Tensor,
                 batch_size: int, transform: Callable | None = None):
        self.model = model
        self.loss_fn = loss_fn
        self.inputs, self.targets = inputs, targets
        self.batch_size = batch_size
        self.transform = transform
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]

    def sample(self, gen, batches=1):
        idx = torch.randint(len(self.inputs), (self.batch_size * batches,), generator=gen)
        x = self.inputs[idx]
        if self.transform is not None:
            x = self.transform(x, gen)
        return x, self.targets[idx]

    def full(self):
        return self.inputs, self.targets

    def shard_minibatches(self) -> float:
        return len(self.targets) / self.batch_size

    def _loss(self, params, batch):
        x, y = batch
        out = functional_call(self.model, dict(zip(self.names, params)), (x,))
        return self.loss_fn(out, y)

    def grad(self, params, batch):
        leaves = [p.detach().requires_grad_(True) for p in params]
        with torch.enable_grad():
            loss = self._loss(leaves, batch)
            return list(torch.autograd.grad(loss, leaves))

    def loss(self, params, batch):
        with torch.no_grad():
            return float(self._loss(params, batch))


class Worker:
    """Worker tau: an oracle on its shard, a data RNG seeded from (run seed, rank), the
    method's per-worker state (error memory, local momentum, ...) in ``state``, and ``grads``:
    the stochastic gradient evaluations it has made, in minibatches of the task's batch size (a
    gradient on B minibatches counts B, a difference of gradients at two points counts 2)."""

    def __init__(self, rank: int, oracle: Oracle, seed: int):
        self.rank = rank
        self.oracle = oracle
        self.gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)
        self.state: dict[str, Any] = {}
        self.grads = 0.0

    def sample(self, batches: int = 1):
        return self.oracle.sample(self.gen, batches)

    # Both directions copy ``state``: the live dict would let a checkpoint change as the run goes
    # on (methods reassign its entries, e.g. the error memory "e", every step) and two methods
    # loaded from one checkpoint share their workers' state. Method.state_dict clones the rest.
    def state_dict(self):
        return {"gen": self.gen.get_state(), "state": copy.deepcopy(self.state),
                "grads": self.grads}

    def load_state_dict(self, s):
        self.gen.set_state(s["gen"])
        self.state = copy.deepcopy(s["state"])
        self.grads = s["grads"]
