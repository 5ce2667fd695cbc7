"""Compressed Gluon as a ``torch.optim`` optimiser: your own training loop, one process or torchrun.

The algorithms are not written again here. Each optimiser class builds the method of
:mod:`gluon.methods` it names (through :func:`gluon.methods.make_method`) over the model's own
parameters, with one worker: this process. The worker's oracle is the user's closure, and its
minibatches come from the user's data iterator. The method then runs exactly as in
:func:`gluon.simulate_module`: the same step, coin, compressors, error memory and momentum, and
the same ledger. In one process the backend is :class:`~gluon.comm.InProcessComm` with n = 1.
When torch.distributed is initialised (torchrun), it is
:class:`~gluon.distributed.TorchDistComm`: each process is one worker, and packets cross the wire
compressed. The class and the user's code are the same in both cases.

The closure contract::

    loss = opt.step(loss_on, batches)

* ``loss_on(batch)`` returns the loss of the model on ``batch`` as a scalar tensor, before any
  backward: the forward pass and nothing else (no ``zero_grad``, no ``backward``).
* ``batches`` is an iterator of minibatches (make an endless one from a DataLoader with
  :func:`forever`). A step draws what the algorithm needs. An ordinary step draws one batch and
  calls ``loss_on`` on it at X^k and at X^{k-1} (Delta). A synchronisation (u^k = 1) draws B
  batches and calls ``loss_on`` once per batch at X^k; the large-batch gradient is their mean,
  each minibatch weighted 1/B. Alg. 3 and 4 draw the Delta batch too. EF21-Muon draws one batch
  at X^k.
* The optimiser differentiates the returned loss itself (``torch.autograd.grad``), so ``.grad``
  is never touched. The parameters hold X^{k-1} only while ``loss_on`` runs there, and always
  hold X^k between steps.

``param_groups`` carry ``lr`` (the LMO radius eta of the group's blocks) and ``beta`` (the
momentum decay, one value for all groups), so torch's LR schedulers work. A group may also set
``lmo`` (an LMO name from :data:`gluon.lmo.LMOS`) and ``lmo_scale`` (its radius scale t_i) to
override :func:`gluon.lmo.assign_lmos` for its parameters. ``state_dict`` holds everything a
bit-identical resume needs: the method's state (g, M, X^{k-1}, u, k), the worker's error
memory and generator, the shared coin's stream, and the ledger. It does not hold the parameters,
which belong to ``model.state_dict()``. Under torchrun each rank saves its own. It records what
the optimiser was built with (parameter shapes, compressor, q, B, the 1/B switch, beta, lr per
group as given, seed, LMOs): ``load_state_dict`` refuses a state of an optimiser built otherwise,
naming the first difference, before anything changes.

A step whose direction M^k is not finite (a NaN or inf loss, or gradient) raises
:class:`FloatingPointError` before the parameters change; every rank raises at the same step
(the direction is the averaged one). The method's state has moved past X^k by then, so a run
goes on from a ``state_dict`` saved before that step. A non-finite loss whose gradient stays
finite is returned as it is.
"""
from __future__ import annotations

import hashlib
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
# Imported now, before any process group exists: its functions take ``group=group.WORLD`` as a
# default argument, evaluated at import. torch.optim.Optimizer imports it (through torch._dynamo)
# on first use, so imported after init_process_group those defaults would hold the world group
# for good: destroy_process_group could not free it, its gloo threads would outlive it, and one of
# them releasing the last collective's tensors while the interpreter exits aborts the process
# now and then ("terminate called without an active exception"; torch 2.14, gloo, busy cores).
import torch.distributed.nn.functional  # noqa: F401
from torch import Tensor, nn

from .comm import Comm, InProcessComm
from .compressors import Compressor, Identity
from .lmo import LMO_DEFAULT, LMOS, NS_STEPS, SCION_HEAD_SCALE, Block, assign_lmos
from .methods import BETA, LMOUpdate, Method, check_hparams, make_method
from .worker import Oracle, Worker


def forever(iterable: Iterable) -> Iterator:
    """An endless iterator over ``iterable``'s epochs. Each epoch calls ``iter(iterable)`` again,
    so a DataLoader reshuffles (and a ``DistributedSampler``'s epoch should be set by the caller
    if it matters). Unlike ``itertools.cycle``, nothing is cached."""
    while True:
        empty = True
        for batch in iterable:
            empty = False
            yield batch
        if empty:
            raise ValueError("forever(): the iterable yields no batches")


@dataclass
class StepRecord:
    """What the last step did, for logging (``opt.last``)."""
    k: int                 # the step just taken: X^k -> X^{k+1}
    sync: bool             # u^k = 1: the workers sent a large batch
    batches: int           # minibatches drawn from the data iterator
    closure_calls: int     # forward + backward passes
    loss: Tensor | None    # mean closure loss at X^k over this step's calls there (detached)
    uplink: float          # this worker's uplink in this step, in dense gradients of the model
    bytes: int             # this worker's wire bytes in this step


# ---------------------------------------------------------------- the worker's oracle: the closure

class ClosureOracle(Oracle):
    """The oracle of this process's worker: the user's closure on the user's minibatches.

    ``grad(point, batches)`` evaluates the closure at ``point``, which is X^k (the parameters
    themselves) or any other list of tensors of their shapes (X^{k-1}). For the latter it swaps
    the parameters' storage in for the call and swaps it back. Every minibatch comes from the
    user's iterator, so the worker's own generator is not used for data.
    """

    def __init__(self, params: Sequence[nn.Parameter]):
        self.params = list(params)
        self.closure: Callable | None = None
        self.batches: Iterator | None = None
        self.drawn = self.calls = 0
        self.losses: list[Tensor] = []    # the closure's losses at X^k in this step

    # --- bound for the duration of one step
    def bind(self, closure: Callable, batches: Iterator) -> None:
        self.closure, self.batches = closure, batches
        self.drawn = self.calls = 0
        self.losses = []

    def unbind(self) -> None:
        self.closure = self.batches = None

    # --- the Oracle interface
    def sample(self, gen, batches: int = 1) -> list:
        return [self._next() for _ in range(batches)]

    def full(self):
        raise ValueError("a closure oracle has no whole shard; methods that need one "
                         "(vr_marina with full=True) are not available as optimisers")

    def grad(self, params, batch) -> list[Tensor]:
        """The gradient at ``params`` on one minibatch, or the mean over a list of B of them
        (each weighted 1/B, summed in draw order)."""
        w = 1.0 / len(batch)
        total = None
        for b in batch:
            g = self._grad_at(params, b)
            if len(batch) == 1:
                return g
            total = ([w * a for a in g] if total is None
                     else [t + w * a for t, a in zip(total, g)])
        return total

    def grad_diff(self, params, prev, batch) -> list[Tensor]:
        """Delta on one batch: the closure at X^k, then at X^{k-1} with torch's RNG rewound, so
        whatever randomness it draws (dropout masks, augmentation) is the same at both points
        and is consumed once, as if the closure had run once."""
        rng = _rng_state(self.params[0].device)
        now = self.grad(params, batch)
        after = _rng_state(self.params[0].device)
        _set_rng_state(rng)
        before = self.grad(prev, batch)
        _set_rng_state(after)
        return [a - b for a, b in zip(now, before)]

    # --- helpers
    def _next(self):
        try:
            batch = next(self.batches)
        except StopIteration:
            raise ValueError(f"the data iterator ran out after {self.drawn} batches in this step; "
                             f"pass an endless one, e.g. gluon.optim.forever(loader)") from None
        self.drawn += 1
        return batch

    def _grad_at(self, point, batch) -> list[Tensor]:
        at_current = _is_current(self.params, point)
        with _parameters_at(self.params, point), torch.enable_grad():
            loss = _checked_loss(self.closure(batch))
            try:
                grads = torch.autograd.grad(loss, self.params, allow_unused=True)
            except RuntimeError as e:
                if "second time" in str(e):
                    raise RuntimeError("the closure called backward() itself; it must only "
                                       "return the loss (the optimiser differentiates it)") from e
                raise
        self.calls += 1
        if at_current:
            self.losses.append(loss.detach())
        return [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads)]


def _is_current(params, point) -> bool:
    return len(point) == len(params) and all(a is b for a, b in zip(point, params))


@contextmanager
def _parameters_at(params: Sequence[nn.Parameter], point: Sequence[Tensor]):
    """The parameters hold ``point`` inside the block (storage swapped, not copied)."""
    if _is_current(params, point):
        yield
        return
    saved = [p.data for p in params]
    try:
        for p, x in zip(params, point):
            p.data = x
        yield
    finally:
        for p, s in zip(params, saved):
            p.data = s


def _rng_state(device: torch.device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda, device


def _set_rng_state(state) -> None:
    cpu, cuda, device = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def _checked_loss(loss) -> Tensor:
    if loss is None:
        raise ValueError("the closure returned None: it must return the loss on its batch as a "
                         "tensor, e.g. `return F.cross_entropy(model(x), y)` (no backward: the "
                         "optimiser differentiates it)")
    if not isinstance(loss, Tensor):
        raise TypeError(f"the closure must return the loss as a tensor, got "
                        f"{type(loss).__name__} (a .item() or float cannot be differentiated)")
    if loss.numel() != 1:
        raise ValueError(f"the closure must return a scalar loss, got shape {tuple(loss.shape)}")
    if not loss.requires_grad:
        raise ValueError("the closure's loss does not depend on the parameters with autograd on "
                         "(computed under torch.no_grad(), or detached?)")
    return loss.reshape(())


# ---------------------------------------------------------------- the update: radius per group

class GroupLMOUpdate:
    """:class:`gluon.methods.LMOUpdate` run on each param group with that group's current lr:
    X_i <- X_i + t_i * (lr_group * lr) * lmo_i(M_i). The method's own lr is held at 1, so the
    step of a block is exactly the engine's with lr = the group's lr."""

    def __init__(self, blocks: Sequence[Block], slices: Sequence[slice]):
        self.parts = [(sl, LMOUpdate(blocks[sl])) for sl in slices]
        self.group_lrs = [1.0] * len(slices)     # set by the optimiser before every step

    def __call__(self, params, direction, lr):
        if not bool(torch.stack([torch.isfinite(d).all() for d in direction]).all()):
            raise NonFiniteStep("the update direction is not finite")
        for (sl, update), group_lr in zip(self.parts, self.group_lrs):
            update(params[sl], direction[sl], lr * group_lr)


class NonFiniteStep(FloatingPointError):
    """A step whose direction M^k is not finite (a NaN or inf loss, or gradient): refused
    before the parameters change (see :meth:`GluonOptimizer.step`)."""


# ---------------------------------------------------------------- the optimiser

class GluonOptimizer(torch.optim.Optimizer):
    """Base class: one process's worker of the method named ``method`` (see the module docstring).

    Args (common to every subclass):
        params: ``model.named_parameters()`` (names let LMO rules match), parameters, a list of
            param-group dicts (keys ``params``, ``lr``, ``beta``, ``lmo``, ``lmo_scale``), or a
            module (its named parameters). Parameters with ``requires_grad=False`` stay in
            their group but are never updated.
        lr: the LMO radius eta (per group). beta: the momentum decay in [0, 1), equal across groups.
        seed: the run seed: the shared coin and RandK's indices come from it; equal on all ranks.
        lmo_rules, lmo_default, ns_steps, head_scale: as :func:`gluon.lmo.assign_lmos` (Scion's
            rule by default: spectral for matrices and conv kernels, sign with radius scale 16
            for the last matrix, RMS for vectors). A group's ``lmo``/``lmo_scale`` win over both.
        comm: a backend hosting one worker; default: TorchDistComm when torch.distributed is
            initialised, else InProcessComm(1).
        dense_collective: ``"all_reduce"`` or ``"all_gather"`` (dense rounds bit-identical to
            the in-process simulation of n workers) under torch.distributed.
    """

    method = "alg1"   # the registry name in gluon.methods.METHODS

    def __init__(self, params, *, lr: float, beta: float = BETA,
                 compressor: Compressor | None = None, seed: int = 0,
                 lmo_rules: Sequence[tuple[str, str, float]] | None = None,
                 lmo_default: str = LMO_DEFAULT, ns_steps: int = NS_STEPS,
                 head_scale: float = SCION_HEAD_SCALE, comm: Comm | None = None,
                 dense_collective: str = "all_reduce", **settings):
        if isinstance(params, nn.Module):
            params = params.named_parameters()
        _check_settings(settings)
        self._building = True
        super().__init__(params, {"lr": lr, "beta": beta, "lmo": None, "lmo_scale": None})
        self._building = False
        self._check_groups(building=True)
        named, slices = self._trainable()
        self._params = [p for _, p in named]
        _check_devices(named)
        self.blocks = self._assign_lmos(named, lmo_rules, lmo_default, ns_steps, head_scale)
        compressor = compressor if compressor is not None else Identity()
        self.comm = comm if comm is not None else _default_comm(seed, dense_collective,
                                                                self._params[0].device)
        if len(self.comm.local_workers) != 1:
            raise ValueError(f"an optimiser is one worker; the comm backend hosts "
                             f"{len(self.comm.local_workers)}")
        self.seed = int(seed)
        self._sync_ranks(compressor, settings)
        self._oracle = ClosureOracle(self._params)
        self._update = GroupLMOUpdate(self.blocks, slices)
        self._set_group_values()
        worker = Worker(self.comm.local_workers[0], self._oracle, self.seed)
        self.algorithm: Method = make_method(
            self.method, self._params, [worker], self.comm, compressor=compressor,
            update=self._update, seed=self.seed, lr=1.0,
            beta=self.param_groups[0]["beta"], **settings)
        self.last: StepRecord | None = None
        self._settings = self._built_with(named, compressor)

    # ------------------------------------------------------------------ one step
    def step(self, closure: Callable[[Any], Tensor], batches: Iterator) -> Tensor | None:
        """One iteration of the method (every worker takes it together under torchrun).

        Returns the mean loss at X^k over this step's closure calls there (detached)."""
        if not callable(closure):
            raise TypeError("step(closure, batches): closure(batch) must return the loss on batch")
        if batches is None or iter(batches) is not batches:
            raise TypeError("step(closure, batches): batches must be an iterator over minibatches "
                            "(make one once, before the loop: batches = gluon.optim.forever(loader))")
        self._check_groups()
        self._set_group_values()
        m, led = self.algorithm, self.comm.ledger
        k, sync, cost, nbytes = m.k, self.sync, led.cost, led.bytes
        self._oracle.bind(closure, batches)
        try:
            m.step()
        except NonFiniteStep:
            losses = self._oracle.losses
            loss = float(torch.stack(losses).mean()) if losses else float("nan")
            raise NonFiniteStep(
                f"step {k}: the update direction is not finite (the closure's loss at X^k: "
                f"{loss:g}); the parameters are left at X^k, but the optimiser's state has "
                "moved on: load a state_dict saved before this step to go on (a smaller lr, "
                "or the batch checked)") from None
        finally:
            self._oracle.unbind()
        o = self._oracle
        loss = torch.stack(o.losses).mean() if o.losses else None
        self.last = StepRecord(k, sync, o.drawn, o.calls, loss, led.cost - cost,
                               int(led.bytes - nbytes))
        return loss

    # ------------------------------------------------------------------ what users read
    @property
    def k(self) -> int:
        """Steps taken so far."""
        return self.algorithm.k

    @property
    def sync(self) -> bool:
        """Whether the next step is a synchronisation (u^k = 1, drawn at the end of the last)."""
        return bool(self.algorithm.u)

    @property
    def ledger(self):
        """This worker's cumulative uplink (``cost`` in dense gradients, ``bytes``)."""
        return self.comm.ledger

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        out = super().state_dict()
        state = self.algorithm.state_dict()
        del state["params"]              # the model's state_dict holds them
        out["gluon"] = {"method": self.method, "n_workers": self.comm.n_workers,
                        "rank": self.comm.local_workers[0], "algorithm": state,
                        "settings": dict(self._settings)}
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state saved by an optimiser built as this one: the same method and worker,
        parameter shapes, compressor and settings (q, B, the 1/B switch, beta, lr per group,
        seed, each parameter's LMO); a ValueError naming the first that differs otherwise,
        before anything changes. The param groups' current values (a schedule's lr) are the
        state's, as in torch."""
        g = state_dict.get("gluon")
        if g is None:
            raise ValueError("not a gluon optimiser's state_dict (no 'gluon' entry)")
        if g["method"] != self.method:
            raise ValueError(f"state of method {g['method']!r} loaded into {self.method!r}")
        if (g["n_workers"], g["rank"]) != (self.comm.n_workers, self.comm.local_workers[0]):
            raise ValueError(f"state of worker {g['rank']} of {g['n_workers']} loaded into "
                             f"worker {self.comm.local_workers[0]} of {self.comm.n_workers}")
        problem = self._mismatch(g)
        if problem:
            raise ValueError(f"a state_dict of an optimiser built otherwise: {problem}; build "
                             "this one as that one was (the model, compressor and settings)")
        super().load_state_dict(state_dict)
        device = self._params[0].device
        state = _to_device(g["algorithm"], device)
        state["params"] = [p.detach() for p in self._params]   # unchanged: the model's own
        self.algorithm.load_state_dict(state)
        self._check_groups()

    def _built_with(self, named, compressor: Compressor) -> dict:
        """What this optimiser was built with, saved in its state_dict and compared on load:
        the trainable parameters' names and shapes, the compressor, the method's settings, the
        seed, each group's lr and beta as given (not as a schedule moves them) and each
        parameter's LMO."""
        m = self.algorithm
        return {"names": [n for n, _ in named], "shapes": [tuple(p.shape) for _, p in named],
                "compressor": repr(compressor), "q": m.q, "B": m.B, "scale_by_B": m.scale_by_B,
                "beta": self.param_groups[0]["beta"], "lr": [g["lr"] for g in self.param_groups],
                "seed": self.seed, "lmo": [_block_text(b) for b in self.blocks]}

    def _mismatch(self, g: dict) -> str | None:
        """The first difference between the optimiser that saved ``g`` and this one, or None.
        A state saved before the settings were recorded is checked by its tensors' shapes."""
        mine, theirs = self._settings, g.get("settings")
        names = mine["names"]
        if theirs is None:
            prev = g["algorithm"].get("prev") or []
            theirs = {"shapes": [tuple(t.shape) for t in prev]}
        shapes = theirs["shapes"]
        if len(shapes) != len(mine["shapes"]):
            return (f"{len(shapes)} trainable parameters in the state, {len(mine['shapes'])} "
                    "here")
        for name, a, b in zip(names, shapes, mine["shapes"]):
            if tuple(a) != b:
                return f"parameter {name}: shape {tuple(a)} in the state, {b} here"
        for key in ("compressor", "q", "B", "scale_by_B", "beta", "lr", "seed"):
            if key in theirs and theirs[key] != mine[key]:
                return f"{key}: {theirs[key]} in the state, {mine[key]} here"
        for name, a, b in zip(names, theirs.get("lmo", mine["lmo"]), mine["lmo"]):
            if a != b:
                return f"lmo of {name}: {a} in the state, {b} here"
        return None

    def add_param_group(self, param_group: dict) -> None:
        if not self._building:
            raise NotImplementedError("a gluon optimiser's parameters are fixed at construction "
                                      "(the method's vectors span all of them)")
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ construction helpers
    def _check_groups(self, building: bool = False) -> None:
        """lr > 0 at construction; afterwards a schedule may bring it to 0 (no step), never
        below."""
        for g in self.param_groups:
            check_hparams(lr=g["lr"] if building else None, beta=g["beta"])
            if not g["lr"] >= 0:
                raise ValueError(f"lr must be >= 0 (a schedule may reach 0), got {g['lr']}")
            if g["lmo"] is not None and g["lmo"] not in LMOS:
                raise ValueError(f"unknown LMO {g['lmo']!r} in a param group; choose one of "
                                 f"{sorted(LMOS)}")
            if g["lmo_scale"] is not None and g["lmo"] is None:
                raise ValueError("a param group's lmo_scale needs its lmo as well")
        betas = {g["beta"] for g in self.param_groups}
        if len(betas) > 1:
            raise ValueError(f"beta must be the same in every param group (the momentum is one "
                             f"recursion over all blocks); got {sorted(betas)}")

    def _set_group_values(self) -> None:
        self._update.group_lrs = [float(g["lr"]) for g in self.param_groups]
        if hasattr(self, "algorithm"):
            self.algorithm.beta = float(self.param_groups[0]["beta"])

    def _trainable(self):
        """(name, parameter) of every trainable parameter in group order, and each group's
        slice of that list. Unnamed parameters are called ``<group>.<index>``."""
        named, slices = [], []
        for gi, g in enumerate(self.param_groups):
            names = g.get("param_names") or [f"{gi}.{i}" for i in range(len(g["params"]))]
            start = len(named)
            named += [(n, p) for n, p in zip(names, g["params"]) if p.requires_grad]
            slices.append(slice(start, len(named)))
        if not named:
            raise ValueError("no parameter requires grad: nothing to optimise")
        return named, slices

    def _assign_lmos(self, named, lmo_rules, lmo_default, ns_steps, head_scale) -> list[Block]:
        """:func:`gluon.lmo.assign_lmos` over all trainable parameters in order, with each
        group's ``lmo`` as an exact-name rule ahead of ``lmo_rules``."""
        if lmo_rules and not any("param_names" in g for g in self.param_groups):
            raise ValueError("lmo_rules match parameter names: pass model.named_parameters()")
        rules = []
        for gi, g in enumerate(self.param_groups):
            if g["lmo"] is None:
                continue
            names = g.get("param_names") or [f"{gi}.{i}" for i in range(len(g["params"]))]
            scale = 1.0 if g["lmo_scale"] is None else float(g["lmo_scale"])
            rules += [(f"^{re.escape(n)}$", g["lmo"], scale) for n, p in zip(names, g["params"])
                      if p.requires_grad]
        rules += [tuple(r) for r in (lmo_rules or [])]
        return assign_lmos([(n, p.shape) for n, p in named], rules, lmo_default, ns_steps,
                           head_scale)

    def _sync_ranks(self, compressor: Compressor, settings: dict) -> None:
        """Under torch.distributed: every rank starts from rank 0's parameters (as DDP does) and
        must agree on the method, its settings, the seed and the shapes; else a ValueError on
        every rank."""
        if self.comm.n_workers == 1 or not (dist.is_available() and dist.is_initialized()):
            return
        group = getattr(self.comm, "group", None)
        src = 0 if group is None else dist.get_global_rank(group, 0)
        with torch.no_grad():
            for p in self._params:
                dist.broadcast(p.data, src=src, group=group)
        text = repr((self.method, self.seed, sorted(settings.items()), repr(compressor.__dict__),
                     compressor.name, [tuple(p.shape) for p in self._params]))
        digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")
        device = getattr(self.comm, "device", self._params[0].device)
        t = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        if int(t[0]) != -int(t[1]):
            raise ValueError("the ranks disagree on the method, its settings, the compressor, the "
                             "seed or the parameter shapes: build the optimiser identically on "
                             "every rank")


def _block_text(b: Block) -> str:
    """A block's LMO with its settings and radius scale: ``Sign(scale=True) x 16``."""
    args = ", ".join(f"{k}={v}" for k, v in vars(b.lmo).items())
    return f"{type(b.lmo).__name__}({args}) x {b.scale:g}"


def _check_settings(settings: dict) -> None:
    """What the issue asks of an optimiser beyond gluon.methods' own checks: q in (0, 1]."""
    q, B = settings.get("q"), settings.get("B")
    if q is not None and not (0.0 < q <= 1.0):
        raise ValueError(f"q must lie in (0, 1], got {q}")
    if B is not None and (isinstance(B, bool) or int(B) != B or B < 1):
        raise ValueError(f"B must be a positive integer, got {B}")


def _check_devices(named) -> None:
    devices = {p.device for _, p in named}
    if len(devices) > 1:
        where = {str(d): next(n for n, p in named if p.device == d) for d in devices}
        raise ValueError(f"all parameters must be on one device; got {where} "
                         f"(move the model with model.to(device) before building the optimiser)")


def _default_comm(seed: int, dense: str, device) -> Comm:
    if dist.is_available() and dist.is_initialized():
        from .distributed import TorchDistComm
        return TorchDistComm(seed, dense=dense)
    return InProcessComm(1, seed=seed)


def _to_device(obj, device):
    """A copy of a loaded state with its floating-point tensors on ``device`` (generator states,
    which are uint8 CPU tensors, stay where they are)."""
    if isinstance(obj, Tensor):
        return obj.to(device, copy=True) if obj.is_floating_point() else obj.clone()
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_device(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_device(v, device) for v in obj)
    return obj


# ---------------------------------------------------------------- one class per method

class Gluon(GluonOptimizer):
    """Gluon (non-Euclidean SGD with momentum): Alg. 1 with q = 1, B = 1 and no compression.
    Every step draws one batch, averages the dense gradients and takes the LMO step."""
    method = "gluon"

    def __init__(self, params, *, lr: float, beta: float = BETA, **options):
        super().__init__(params, lr=lr, beta=beta, **options)


class _Compressed(GluonOptimizer):
    """The signature Alg. 1-3 share: a compressor, the coin's probability q, B minibatches per
    sync, and the paper's 1/B trick (``scale_by_B``; None: the method's default, on for Alg. 1
    and 2, off for Alg. 3: ``gluon.methods.METHODS``)."""

    def __init__(self, params, *, lr: float, compressor: Compressor, q: float, B: int,
                 beta: float = BETA, scale_by_B: bool | None = None, **options):
        super().__init__(params, lr=lr, beta=beta, compressor=compressor, q=q, B=B,
                         scale_by_B=scale_by_B, **options)


class CompressedGluon(_Compressed):
    """Alg. 1: Compressed Gluon with an unbiased compressor (identity, RandK, natural, QSGD)."""
    method = "alg1"


class CompressedGluonEF(_Compressed):
    """Alg. 2: Compressed Gluon with error feedback and a contraction (identity, TopK, zero)."""
    method = "alg2"


class CompressedGluonMVR(_Compressed):
    """Alg. 3: Compressed Gluon with momentum variance reduction, unbiased compressor."""
    method = "alg3"


class CompressedGluonEFMVR(GluonOptimizer):
    """Alg. 4: Compressed Gluon with error feedback and MVR, contraction compressor (no 1/B
    trick: the method refuses it)."""
    method = "alg4"

    def __init__(self, params, *, lr: float, compressor: Compressor, q: float, B: int,
                 beta: float = BETA, **options):
        super().__init__(params, lr=lr, beta=beta, compressor=compressor, q=q, B=B, **options)


class EF21Muon(GluonOptimizer):
    """EF21-Muon, uplink-only form: local momentum on one batch a step, R = C(M - G) sent,
    contraction compressor (identity, TopK, zero)."""
    method = "ef21_muon"

    def __init__(self, params, *, lr: float, compressor: Compressor, beta: float = BETA,
                 **options):
        super().__init__(params, lr=lr, beta=beta, compressor=compressor, **options)

    @property
    def sync(self) -> bool:
        """EF21-Muon has no coin: only step 0 sends M^0 uncompressed."""
        return self.algorithm.k == 0


OPTIMIZERS = {cls.method: cls for cls in (Gluon, CompressedGluon, CompressedGluonEF,
                                          CompressedGluonMVR, CompressedGluonEFMVR, EF21Muon)}
