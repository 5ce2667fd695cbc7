"""The character-level language model task (docs/lm.md): a nanoGPT-shaped GPT on Tiny
Shakespeare, worker oracles, evaluation, ``build``.

Worker tau minimises the mean next-character cross-entropy of the GPT (:mod:`.gpt`) on
minibatches of ``batch_size`` windows of ``task.block_size + 1`` characters drawn uniformly, with
replacement, from its range of the training text (:mod:`.shakespeare`: ``task.split=iid`` the
whole training text for every worker, ``plays`` the tau-th contiguous part). Gradients come from
:class:`gluon.worker.ModuleOracle` (``torch.func.functional_call`` on one shared module; the
tied embedding and head are one parameter). With ``task.dropout > 0`` every minibatch carries a
seed drawn from the worker's generator and its dropout masks are drawn from it, so a gradient at
X^k and at X^{k-1} on the same minibatch (Delta) uses the same masks, and the run's other
randomness is untouched.

What a logged row holds:

* ``loss``: the training objective on ``task.eval_train`` fixed windows, drawn equally from the
  workers' ranges (so with ``plays`` it is the mean of the workers' objectives), no dropout;
* ``val_loss``: the loss on ``task.eval_val`` fixed windows of the validation text;
* ``val_loss_full`` (the last row only, so in the summary's ``final``): the whole validation
  text in consecutive windows of ``block_size`` targets, each character but the first predicted
  once, from the context before it within its window.

LMOs (docs/lm.md, after Scion's nanoGPT recipe, checked in ``tests/test_lm.py``): spectral
on every hidden matrix, sign (1/d_in) on the tied embedding and head at ``task.embed_scale``
times the radius, RMS on the position embedding, LayerNorm gains and biases (:func:`lmo_rules`).
"""
from __future__ import annotations

import re
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor
from torch.func import functional_call

from gluon import simulate_module
from gluon.engine import gradients_per_worker
from gluon.lmo import LMOS
from gluon.worker import ModuleOracle

from experiments.shared.files import REPO
from . import Built, settings, sha256
from .gpt import GPT, GPTShape, n_params
from .shakespeare import (CHARS, SPLITS, Text, kl_table, load_text, locate, shard_ranges,
                          text_file, train_size, window_starts, windows)


def pick_device(name: str | None) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@contextmanager
def _seeded(seed: int | None, device: torch.device):
    """Inside the block, torch's generators start from ``seed`` (the minibatch's dropout
    masks); outside, their state is as it was. No-op for None (no dropout)."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


class TextOracle(ModuleOracle):
    """Worker oracle: windows of the range [lo, hi) of the text, next-character cross-entropy.

    A batch is (inputs, targets, dropout seed or None). Batches of more than ``max_chunk``
    windows (a large batch of B minibatches) are evaluated in chunks; their gradient is the
    windows' mean, as one pass would give it up to float rounding (each chunk has its own
    dropout seed)."""

    def __init__(self, model, tokens: Tensor, lo: int, hi: int, block_size: int,
                 batch_size: int, *, dropout: float = 0.0, amp: bool = False,
                 max_chunk: int = 1024):
        super().__init__(model, None, tokens, None, batch_size)
        self.lo, self.hi, self.block = lo, hi, block_size
        self.dropout, self.amp, self.max_chunk = dropout > 0, amp, max(1, max_chunk)

    def sample(self, gen, batches=1):
        starts = window_starts(self.lo, self.hi, self.block, self.batch_size * batches, gen)
        seed = int(torch.randint(2 ** 62, (1,), generator=gen)) if self.dropout else None
        return (*windows(self.inputs, starts, self.block), seed)

    def full(self):
        """The worker's whole range in consecutive windows (VR-MARINA's full gradient)."""
        starts = self.lo + self.block * torch.arange((self.hi - self.lo - 1) // self.block)
        return (*windows(self.inputs, starts, self.block), 0 if self.dropout else None)

    def shard_minibatches(self) -> float:
        return ((self.hi - self.lo - 1) // self.block) / self.batch_size

    def _loss(self, params, batch):
        x, y, seed = batch
        with _seeded(seed, x.device), torch.autocast(x.device.type, dtype=torch.bfloat16,
                                                     enabled=self.amp):
            logits = functional_call(self.model, dict(zip(self.names, params)), (x,))
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def grad(self, params, batch):
        self.model.train()
        x, y, seed = batch
        if len(x) <= self.max_chunk:
            return super().grad(params, batch)
        total = None
        for i, (xs, ys) in enumerate(zip(x.split(self.max_chunk), y.split(self.max_chunk))):
            g = super().grad(params, (xs, ys, None if seed is None else seed + i))
            w = len(ys) / len(y)
            total = [w * a for a in g] if total is None else [t + w * a for t, a in zip(total, g)]
        return total

    def grad_diff(self, params, prev, batch):
        """Delta in fp32, never under bf16 autocast (the two gradients are close: bf16's
        rounding would be much of their difference; docs/cnn.md, "The GPU path")."""
        amp, self.amp = self.amp, False
        try:
            return super().grad_diff(params, prev, batch)
        finally:
            self.amp = amp


class Evaluator:
    """The evaluation closure handed to :func:`gluon.train` (see the module docstring)."""

    def __init__(self, model, train: tuple, val: tuple, full: tuple, *, chunk: int, amp: bool,
                 steps: int, max_comm: float | None = None, max_grads: float | None = None):
        self.model, self.train, self.val, self.full = model, train, val, full
        self.chunk, self.amp = max(1, chunk), amp
        self.steps, self.max_comm, self.max_grads = steps, max_comm, max_grads

    @torch.no_grad()
    def loss(self, x: Tensor, y: Tensor) -> float:
        """Mean cross-entropy over every target of the windows, in eval mode (no dropout)."""
        self.model.eval()
        try:
            total = 0.0
            for xs, ys in zip(x.split(self.chunk), y.split(self.chunk)):
                with torch.autocast(xs.device.type, dtype=torch.bfloat16, enabled=self.amp):
                    logits = self.model(xs)
                total += float(F.cross_entropy(logits.float().flatten(0, 1), ys.flatten(),
                                               reduction="sum"))
            return total / y.numel()
        finally:
            self.model.train()

    def __call__(self, method) -> dict:
        row = {"loss": self.loss(*self.train), "val_loss": self.loss(*self.val)}
        if (method.k >= self.steps
                or (self.max_comm is not None and method.comm.ledger.cost >= self.max_comm)
                or (self.max_grads is not None and gradients_per_worker(method) >= self.max_grads)):
            row["val_loss_full"] = self.loss(*self.full)
        return row


# ---------------------------------------------------------------- the model and its LMOs

HIDDEN = r"\.(c_q|c_k|c_v|c_proj|c_fc)\.weight$"


def lmo_rules(embed_scale: float = 60.0, first=()) -> list[tuple[str, str, float]]:
    """The LMO of every parameter of :class:`~.gpt.GPT`, as ``gluon.lmo.assign_lmos`` rules
    (first match wins): the rules ``first`` (the config's ``task.lmo_rules``), then Scion's
    nanoGPT recipe (docs/lm.md):

    * the tied token embedding and head: sign, scaled by 1/d_in (Scion's ``Sign``), at
      ``embed_scale`` times the radius (``task.embed_scale``; Scion's nanoGPT with weight
      sharing: 60);
    * the position embedding: RMS-normalised, at the radius (Scion's DeiT example gives its
      learned position embedding ``BiasRMS`` at the hidden layers' scale);
    * the hidden matrices (q, k, v and output projections, both MLP matrices): spectral, scaled
      by sqrt(d_out / d_in) (Scion's ``Spectral``), at the radius;
    * LayerNorm gains and biases, Linear biases: RMS-normalised (Scion's ``BiasRMS``, which its
      ``Auto`` norm gives every vector), at the radius."""
    return [*((str(p), str(n), float(sc)) for p, n, sc in first),
            (r"^transformer\.wte\.weight$", "sign", float(embed_scale)),
            (r"^transformer\.wpe\.weight$", "rms", 1.0),
            (HIDDEN, "spectral", 1.0),
            (r"(^|\.)ln_(1|2|f)\.(weight|bias)$|\.bias$", "rms", 1.0)]


def make_model(t: DictConfig, vocab: int) -> GPT:
    return GPT(GPTShape(vocab=vocab, block_size=t.block_size, n_layer=t.n_layer,
                        n_head=t.n_head, n_embd=t.n_embd, dropout=float(t.dropout),
                        bias=bool(t.bias)))


# ---------------------------------------------------------------- the task, for the run lifecycle

def _cache_dir(cfg) -> Path:
    return Path(REPO, cfg.results_dir, "cache")


def data_identity(cfg: DictConfig) -> str | None:
    """The SHA-256 of the text a run of ``cfg`` reads (part of the run's identity), or None
    while it is not on disk."""
    hit, _ = locate(cfg.data_dir)
    return None if hit is None else sha256(hit, _cache_dir(cfg))


def check_data(cfg: DictConfig) -> None:
    """Before hydra makes a folder: the text is on disk and is Tiny Shakespeare (its SHA-256,
    and SHA256SUMS beside it), or is downloaded now (``task.download``); else two lines naming
    every place looked. Writes nothing, except a download."""
    text_file(cfg.data_dir, _cache_dir(cfg), cfg.task.download, remember=False)


def check(cfg: DictConfig) -> None:
    """The lm task's own checks (before any data is loaded; the text's length is known with
    its hash)."""
    t = cfg.task
    if t.split not in SPLITS:
        raise ValueError(f"task.split={t.split}: choose one of {', '.join(SPLITS)}")
    for key in ("n_layer", "n_head", "n_embd", "block_size", "eval_train", "eval_val",
                "max_chunk"):
        if t[key] < 1:
            raise ValueError(f"task.{key}={t[key]}: must be >= 1")
    if t.n_embd % t.n_head:
        raise ValueError(f"task.n_embd={t.n_embd}: must be a multiple of task.n_head={t.n_head}")
    if not 0 <= t.dropout < 1:
        raise ValueError(f"task.dropout={t.dropout}: must be in [0, 1)")
    if not t.embed_scale > 0:
        raise ValueError(f"task.embed_scale={t.embed_scale}: must be > 0 (radius scale)")
    for rule in t.lmo_rules or []:
        ok = (len(rule) == 3 and isinstance(rule[0], str) and rule[1] in LMOS
              and isinstance(rule[2], (int, float)))
        if not ok or not _compiles(rule[0]):
            raise ValueError(f"task.lmo_rules: {list(rule)} is not [regex, lmo, scale] with lmo "
                             f"one of {', '.join(sorted(LMOS))}")
    n_train = train_size(CHARS)
    shortest = min(hi - lo for lo, hi in shard_ranges(n_train, cfg.n_workers, t.split))
    if shortest <= t.block_size + 1 or CHARS - n_train <= t.block_size + 1:
        raise ValueError(f"n_workers={cfg.n_workers}: with task.split={t.split} a worker's part "
                         f"of the training text has {shortest} characters, too few for windows "
                         f"of task.block_size={t.block_size} + 1")
    if cfg.device is not None and not re.fullmatch(r"auto|cpu|cuda(:(0|[1-9][0-9]*))?",
                                                   str(cfg.device)):
        raise ValueError(f"device={cfg.device}: must be auto, cpu, cuda or cuda:<index>")


def _compiles(pattern: str) -> bool:
    try:
        re.compile(pattern)
        return True
    except re.error:
        return False


def build(cfg: DictConfig, compressor, world=None, text: Text | None = None) -> Built:
    """The simulated method over the workers this process hosts, the evaluation closure and what
    the summary records. ``text`` replaces the data (tests pass a small one)."""
    t = cfg.task
    device = pick_device(cfg.device)
    text = text if text is not None else load_text(cfg.data_dir, _cache_dir(cfg), t.download)
    tokens, T, n_train = text.tokens.to(device), t.block_size, text.n_train
    ranges = shard_ranges(n_train, cfg.n_workers, t.split)

    torch.manual_seed(cfg.seed)                 # the model's initialisation
    model = make_model(t, len(text.vocab)).to(device)
    amp = bool(t.amp) and device.type == "cuda"
    comm = world.comm(cfg.n_workers, cfg.seed) if world is not None else None
    ranks = comm.local_workers if comm is not None else range(cfg.n_workers)
    oracles = {r: TextOracle(model, tokens, *ranges[r], T, cfg.batch_size, dropout=t.dropout,
                             amp=amp, max_chunk=t.max_chunk) for r in ranks}
    method = simulate_module(cfg.method.name, model, oracles, compressor=compressor, comm=comm,
                             lmo_rules=lmo_rules(t.embed_scale, t.lmo_rules or []),
                             ns_steps=t.ns_steps, seed=cfg.seed, **settings(cfg.method))

    # fixed evaluation windows (the same for every run seed and method): equally many from each
    # worker's range, from the validation text, and the whole validation text
    per = max(1, t.eval_train // cfg.n_workers)
    gen = torch.Generator().manual_seed(t.split_seed + 1)
    train_starts = torch.cat([window_starts(lo, hi, T, per, gen) for lo, hi in ranges])
    val_starts = window_starts(n_train, len(tokens), T, t.eval_val,
                               torch.Generator().manual_seed(t.split_seed + 2))
    full_starts = n_train + T * torch.arange((len(tokens) - n_train - 1) // T)
    evaluate = Evaluator(model, windows(tokens, train_starts, T), windows(tokens, val_starts, T),
                         windows(tokens, full_starts, T), chunk=t.max_chunk, amp=amp,
                         steps=cfg.steps, max_comm=cfg.get("max_comm"),
                         max_grads=cfg.get("max_grads"))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    extra = {"n_params": n_params(model), **text.info(), "device": str(device), "amp": amp,
             "model": {k: t[k] for k in ("n_layer", "n_head", "n_embd", "block_size",
                                         "dropout", "bias")},
             "tokens_per_minibatch": cfg.batch_size * T,
             "eval": {"train_windows": len(train_starts), "val_windows": len(val_starts),
                      "val_full_targets": len(full_starts) * T, "block_size": T},
             "shards": kl_table(text, cfg.n_workers, t.split),
             "lmo": {n: f"{b.lmo!r} x{b.scale:g}"
                     for n, b in zip(names, getattr(method.update, "blocks", []))}}
    return Built(method, evaluate, extra)
