"""The CIFAR-10 airbench CNN task (docs/algorithms.md section 6): worker oracles, evaluation, ``build``.

Worker tau holds a shard of the training set (``experiments.tasks.split``: iid by default,
``label_skew`` optional) and minimises the mean cross-entropy of airbench94 on augmented
minibatches of ``batch_size`` images. Gradients come from :class:`gluon.worker.ModuleOracle`
(``torch.func.functional_call`` on one shared module), so the same module evaluates gradients at
X^k and X^{k-1}.

BatchNorm (details in docs/cnn.md): training forwards normalise with ghost-batch statistics
(groups of ``batch_size`` images) and never update running statistics; evaluation first
recomputes them at the current parameters on a fixed set of training images ("precise BN").

What a logged row holds:

* ``loss``: the training objective on a fixed subset of ``task.eval_train`` training images
  (from the workers' shards, not augmented), BN in training mode with ghost batches of
  ``batch_size``: the f(X) the methods minimise, minus the augmentation. Every ``log_every`` steps.
* ``test_acc``, ``test_loss``: eval mode after recalibration on the ``eval_train`` images, on a
  fixed subset of ``task.eval_test`` test images (all of them when ``eval_test`` is null).
  Every ``eval_every`` steps (a multiple of ``log_every``) and at the last step.
"""
from __future__ import annotations

import logging
import re
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor

from gluon import simulate_module
from gluon.engine import gradients_per_worker
from gluon.worker import ModuleOracle

from .airbench import Airbench94, count_params, init_whitening, recalibrate_bn
from .cifar10 import Cifar, augment, check_data, load_cifar10, normalize  # noqa: F401
from .cifar10 import data_identity as _source_identity
from experiments.shared.files import REPO
from . import Built, check_heterogeneity, settings, split


def pick_device(name: str | None) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _precision_knobs():
    """(object, attribute, value for IEEE fp32, label) of CUDA's TF32 switches."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):          # torch >= 2.9
        return [(conv, "fp32_precision", "ieee", "cudnn.conv.fp32_precision"),
                (torch.backends.cuda.matmul, "fp32_precision", "ieee",
                 "cuda.matmul.fp32_precision")]
    return [(torch.backends.cudnn, "allow_tf32", False, "cudnn.allow_tf32"),
            (torch.backends.cuda.matmul, "allow_tf32", False, "cuda.matmul.allow_tf32")]


def precision_settings() -> dict:
    """How CUDA runs fp32 convolutions and matmuls now ("tf32": TF32 tensor cores)."""
    return {label: str(getattr(obj, name)) for obj, name, _, label in _precision_knobs()}


@contextmanager
def ieee_fp32():
    """IEEE fp32 convolutions and matmuls on CUDA (no TF32) inside the block."""
    knobs = _precision_knobs()
    old = [getattr(o, n) for o, n, _, _ in knobs]
    try:
        for o, n, v, _ in knobs:
            setattr(o, n, v)
        yield
    finally:
        for (o, n, _, _), v in zip(knobs, old):
            setattr(o, n, v)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX), which the CPU fast path
    (``task.amp_cpu``) needs to be fast: elsewhere (AVX2 only) bf16 is emulated."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


class CifarOracle(ModuleOracle):
    """Worker oracle: uint8 shard in, normalised and augmented minibatches out.

    Batches larger than ``max_chunk`` images (VR-MARINA's whole shard) are evaluated in chunks
    of a multiple of ``batch_size``; with ghost-batch BN the chunked gradient equals the
    unchunked one exactly (both are the mean over ghost batches).
    """

    def __init__(self, model, images: Tensor, labels: Tensor, batch_size: int, *,
                 flip: bool = True, translate: int = 2, label_smoothing: float = 0.0,
                 channels_last: bool = False, amp: bool = False, max_chunk: int = 1024):
        loss_fn = lambda out, y: F.cross_entropy(out.float(), y, label_smoothing=label_smoothing)
        super().__init__(model, loss_fn, images, labels, batch_size)
        self.flip, self.translate = flip, translate
        self.channels_last, self.amp = channels_last, amp
        self.max_chunk = max(batch_size, max_chunk // batch_size * batch_size)

    def _prepare(self, x: Tensor) -> Tensor:
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def sample(self, gen, batches=1):
        idx = torch.randint(len(self.inputs), (self.batch_size * batches,), generator=gen)
        x = augment(normalize(self.inputs[idx.to(self.inputs.device)]), gen, self.flip, self.translate)
        return self._prepare(x), self.targets[idx.to(self.targets.device)]

    def full(self):
        """The whole shard, normalised, not augmented (cut to a multiple of batch_size)."""
        n = len(self.inputs) // self.batch_size * self.batch_size
        return self._prepare(normalize(self.inputs[:n])), self.targets[:n]

    def shard_minibatches(self) -> float:
        return float(len(self.inputs) // self.batch_size)   # as full() cuts it

    def _loss(self, params, batch):
        with torch.autocast(batch[0].device.type, dtype=torch.bfloat16, enabled=self.amp):
            return super()._loss(params, batch)

    def grad_diff(self, params, prev, batch):
        """Delta = grad f_xi(X) - grad f_xi(X_prev) in fp32, never under bf16 autocast: the two
        gradients are close, so bf16 rounding would dominate their difference (`make gpu-check`:
        at the paper's width a bf16 Delta is off by about its own norm), and g sums about 1/q of
        them between syncs. On CUDA the convolutions run in
        IEEE fp32 here too (cuDNN's TF32 off for these two gradients only)."""
        amp, self.amp = self.amp, False
        try:
            if batch[0].device.type != "cuda":
                return super().grad_diff(params, prev, batch)
            with ieee_fp32():
                return super().grad_diff(params, prev, batch)
        finally:
            self.amp = amp

    def grad(self, params, batch):
        self.model.train()
        x, y = batch
        if len(x) <= self.max_chunk:
            return super().grad(params, batch)
        total = None
        for xs, ys in zip(x.split(self.max_chunk), y.split(self.max_chunk)):
            g = super().grad(params, (xs, ys))
            w = len(ys) / len(y)
            total = [w * a for a in g] if total is None else [t + w * a for t, a in zip(total, g)]
        return total


class Evaluator:
    """The evaluation closure handed to :func:`gluon.train` (see the module docstring)."""

    def __init__(self, model, train_x: Tensor, train_y: Tensor, test_x: Tensor, test_y: Tensor,
                 *, batch_size: int, eval_every: int, steps: int, max_comm: float | None = None,
                 max_grads: float | None = None,
                 label_smoothing: float = 0.0, channels_last: bool = False, amp: bool = False,
                 chunk: int = 512):
        self.model = model
        self.train = (train_x, train_y)
        self.test = (test_x, test_y)
        self.batch_size, self.eval_every, self.steps = batch_size, eval_every, steps
        self.max_comm, self.max_grads = max_comm, max_grads
        self.label_smoothing = label_smoothing
        self.channels_last, self.amp = channels_last, amp
        self.chunk = max(batch_size, chunk // batch_size * batch_size)

    def _batches(self, x: Tensor, y: Tensor):
        for xs, ys in zip(x.split(self.chunk), y.split(self.chunk)):
            xs = normalize(xs)
            if self.channels_last:
                xs = xs.contiguous(memory_format=torch.channels_last)
            yield xs, ys

    def _forward(self, x):
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.amp):
            return self.model(x).float()

    @torch.no_grad()
    def _scores(self, x, y) -> tuple[float, float]:
        loss = correct = 0.0
        for xs, ys in self._batches(x, y):
            out = self._forward(xs)
            loss += float(F.cross_entropy(out, ys, reduction="sum", label_smoothing=self.label_smoothing))
            correct += float((out.argmax(1) == ys).sum())
        return loss / len(y), correct / len(y)

    @torch.no_grad()
    def train_loss(self) -> float:
        """The objective in training mode: ghost-batch BN over consecutive groups of batch_size."""
        self.model.train()
        x, y = self.train
        n = len(y) // self.batch_size * self.batch_size
        return self._scores(x[:n], y[:n])[0]

    @torch.no_grad()
    def test_scores(self) -> dict:
        recalibrate_bn(self.model, (xs for xs, _ in self._batches(*self.train)))  # -> eval mode
        try:
            test_loss, test_acc = self._scores(*self.test)
        finally:
            self.model.train()
        return {"test_loss": test_loss, "test_acc": test_acc}

    def __call__(self, method) -> dict:
        row = {"loss": self.train_loss()}
        last = (method.k >= self.steps
                or (self.max_comm is not None and method.comm.ledger.cost >= self.max_comm)
                or (self.max_grads is not None and gradients_per_worker(method) >= self.max_grads))
        if (self.eval_every and method.k % self.eval_every == 0) or last:
            row.update(self.test_scores())
        return row


def _subset(n: int, size: int | None, seed: int) -> Tensor:
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return perm if size is None or size >= n else perm[:size]


def make_model(t: DictConfig, batch_size: int) -> Airbench94:
    return Airbench94(widths=tuple(t.widths), ghost_batch=batch_size,
                      bn_weight_trainable=t.bn_weight_trainable,
                      whiten_bias_trainable=t.whiten_bias_trainable)


def load_data(cfg: DictConfig) -> Cifar:
    return load_cifar10(cfg.data_dir, Path(REPO, cfg.results_dir, "cache"), cfg.task.source,
                        download=cfg.task.download)


def data_identity(cfg: DictConfig) -> str | None:
    """The identity of the CIFAR-10 source a run of ``cfg`` decodes (part of the run's
    identity), or None while none is on disk."""
    return _source_identity(cfg.data_dir, Path(REPO, cfg.results_dir, "cache"), cfg.task.source)


def check(cfg: DictConfig) -> None:
    """The CNN task's own checks (before any data is loaded)."""
    check_heterogeneity(cfg)
    if cfg.eval_every < 0 or (cfg.eval_every and (not cfg.log_every or cfg.eval_every % cfg.log_every)):
        raise ValueError(f"eval_every ({cfg.eval_every}) must be 0 (only at the end) or a multiple "
                         f"of log_every ({cfg.log_every}): test metrics are computed on logged rows")
    widths = list(cfg.task.get("widths") or [])
    if len(widths) != 3 or any(int(w) != w or w < 1 for w in widths):
        raise ValueError(f"task.widths must be three positive channel counts, got {widths}")
    device = cfg.device
    if device is not None and not re.fullmatch(r"auto|cpu|cuda(:(0|[1-9][0-9]*))?", str(device)):
        raise ValueError(f"device={device}: must be auto, cpu, cuda or cuda:<index>")


def build(cfg: DictConfig, compressor, world=None, data: Cifar | None = None) -> Built:
    """The simulated method, the evaluation closure and what the summary records for CIFAR-10.
    ``data`` replaces the dataset (tests pass a tiny synthetic one)."""
    t = cfg.task
    device = pick_device(cfg.device)
    data = data if data is not None else load_data(cfg)
    train_x, train_y = data.train_x.to(device), data.train_y.to(device)
    test_x, test_y = data.test_x.to(device), data.test_y.to(device)
    shards = split(len(train_y), cfg.n_workers, t.split_seed, train_y.cpu(), t.heterogeneity)
    used = torch.cat(shards)

    torch.manual_seed(cfg.seed)             # the model's initialisation
    model = make_model(t, cfg.batch_size)
    whiten_idx = used[:t.whiten_images]    # airbench: the first 5,000 training images
    init_whitening(model.whiten, normalize(train_x[whiten_idx.to(device)]).cpu(), eps=t.whiten_eps)
    model = model.to(device)
    channels_last = bool(t.channels_last)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    amp = bool(t.amp) and (device.type == "cuda" or bool(t.get("amp_cpu")))
    if amp and device.type == "cpu" and not cpu_has_native_bf16():
        logging.getLogger("experiments.run").warning(
            "[task] task.amp_cpu=true on a CPU without native bf16 (%s; no AVX512-BF16 or AMX): "
            "bf16 is emulated there and the fast path runs several times slower than fp32 "
            "(docs/cnn.md)", torch.backends.cpu.get_cpu_capability())

    comm = world.comm(cfg.n_workers, cfg.seed) if world is not None else None
    ranks = comm.local_workers if comm is not None else range(cfg.n_workers)
    oracles = {r: CifarOracle(model, train_x[shards[r].to(device)], train_y[shards[r].to(device)],
                              cfg.batch_size, flip=t.flip, translate=t.translate,
                              label_smoothing=t.label_smoothing, channels_last=channels_last,
                              amp=amp, max_chunk=t.max_chunk)
               for r in ranks}
    rules = [tuple(r) for r in (t.lmo_rules or [])]
    method = simulate_module(cfg.method.name, model, oracles, compressor=compressor, comm=comm,
                             lmo_rules=rules, lmo_default=t.lmo_default, ns_steps=t.ns_steps,
                             head_scale=t.head_scale,
                             seed=cfg.seed, **settings(cfg.method))

    ev_train = used[_subset(len(used), t.eval_train, t.split_seed + 1)]
    ev_test = _subset(len(test_y), t.eval_test, t.split_seed + 2)
    evaluate = Evaluator(model, train_x[ev_train.to(device)], train_y[ev_train.to(device)],
                         test_x[ev_test.to(device)], test_y[ev_test.to(device)],
                         batch_size=cfg.batch_size, eval_every=cfg.eval_every, steps=cfg.steps,
                         max_comm=cfg.get("max_comm"), max_grads=cfg.get("max_grads"),
                         label_smoothing=t.label_smoothing, channels_last=channels_last, amp=amp)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    extra = {"params": count_params(model), "n_params": count_params(model)["total"],
             **data.info(), "device": str(device), "amp": amp,
             "eval": {"train_images": len(ev_train), "test_images": len(ev_test),
                      "every": cfg.eval_every},
             "lmo": {n: f"{b.lmo!r} x{b.scale:g}"
                     for n, b in zip(names, getattr(method.update, "blocks", []))},
             "bn": "train: ghost-batch statistics, running stats untouched; "
                   "eval: precise-BN recalibration on the eval_train images"}
    return Built(method, evaluate, extra)
