"""Compressors (docs/algorithms.md section 3), one class each, acting on one parameter block.

A compressor turns a dense block into a :class:`Packet` (what a worker would put on the
wire) and back. Two costs are reported for every packet:

* ``cost``: the paper's normalised uplink cost, where one dense block of the *whole model*
  would cost 1.0; a compressor reports it for its block as a fraction of ``numel`` and the
  caller divides by the model dimension d.
* ``wire_bytes``: the bytes a real implementation sends, i.e. the bytes of the tensors in
  ``Packet.wire`` (RandK sends values only: its indices are regenerated from a seed that
  sender and receiver share; TopK must send its indices).

Randomness is stateless: a compressor gets an integer ``seed`` per message, derived by
:func:`message_seed` from (run seed, worker, step, block). A receiver that knows those four
numbers regenerates RandK's indices without any of them being sent.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

_MASK64 = (1 << 63) - 1


def message_seed(run_seed: int, worker: int, step: int, block: int) -> int:
    """A 63-bit seed for one message, a pure function of its coordinates (splitmix64 mixing)."""
    z = (run_seed * 0x9E3779B97F4A7C15 + worker * 0xBF58476D1CE4E5B9
         + step * 0x94D049BB133111EB + block * 0x2545F4914F6CDD1D) & ((1 << 64) - 1)
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & ((1 << 64) - 1)
    z ^= z >> 31
    return z & _MASK64


def _generator(seed: int, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


@dataclass
class Packet:
    """One compressed block: ``wire`` is what crosses the network, ``seed`` is shared, not sent."""
    wire: dict[str, Tensor]
    shape: torch.Size
    seed: int = 0
    meta: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.wire.values())


class Compressor:
    """Base class. Subclasses set ``unbiased`` and implement the four methods below."""

    name = "base"
    unbiased = True

    def check(self) -> None:
        """Validate hyperparameters; raises ValueError with a clear message."""

    # The constants of Definitions 1.1 / 1.2 for a block of ``numel`` coordinates.
    def omega(self, numel: int) -> float:  # unbiased: E||Q(x)||^2 <= (omega+1)||x||^2
        raise NotImplementedError(f"{self.name} is a contraction; it has delta, not omega")

    def delta(self, numel: int) -> float:  # contraction: E||x-C(x)||^2 <= (1-delta)||x||^2
        raise NotImplementedError(f"{self.name} is unbiased; it has omega, not delta")

    def compress(self, x: Tensor, seed: int) -> Packet:
        raise NotImplementedError

    def decompress(self, p: Packet) -> Tensor:
        raise NotImplementedError

    def cost(self, numel: int) -> float:
        """Normalised cost of one packet as a multiple of ``numel`` dense fp32 coordinates."""
        raise NotImplementedError

    def wire_bytes(self, numel: int) -> int:
        raise NotImplementedError

    def __call__(self, x: Tensor, seed: int = 0) -> Tensor:
        """Compress and decompress: the value the receiver reconstructs."""
        return self.decompress(self.compress(x, seed))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class Identity(Compressor):
    """Q(x) = x: omega = 0, cost 1 (a dense fp32 block)."""
    name = "identity"
    unbiased = True

    def omega(self, numel):
        return 0.0

    def delta(self, numel):  # identity is also the delta = 1 contraction
        return 1.0

    def compress(self, x, seed):
        return Packet({"values": x.reshape(-1)}, x.shape)

    def decompress(self, p):
        return p.wire["values"].reshape(p.shape)

    def cost(self, numel):
        return 1.0

    def wire_bytes(self, numel):
        return 4 * numel


class Zero(Compressor):
    """C(x) = 0: the delta = 0 contraction; nothing is sent (Local Gluon)."""
    name = "zero"
    unbiased = False

    def delta(self, numel):
        return 0.0

    def compress(self, x, seed):
        return Packet({}, x.shape, meta={"dtype": x.dtype, "device": x.device})

    def decompress(self, p):
        return torch.zeros(p.shape, dtype=p.meta["dtype"], device=p.meta["device"])

    def cost(self, numel):
        return 0.0

    def wire_bytes(self, numel):
        return 0


class _Sparse(Compressor):
    """Shared by RandK and TopK: keep k = max(1, round(density * numel)) coordinates."""

    def __init__(self, density: float):
        self.density = float(density)
        self.check()

    def check(self):
        if not (0.0 < self.density <= 1.0):
            raise ValueError(f"{self.name}: density must lie in (0, 1], got {self.density}")

    def k(self, numel: int) -> int:
        return min(numel, max(1, round(self.density * numel)))

    def cost(self, numel):
        # The paper's convention: k/d for both RandK and TopK (TopK's indices are not counted).
        return self.k(numel) / numel

    def decompress(self, p):
        values = p.wire["values"]
        flat = torch.zeros(math.prod(p.shape), dtype=values.dtype, device=values.device)
        if _numpy_view_ok(values):
            flat.numpy()[self._indices(p).numpy()] = values.numpy()
        else:
            flat[self._indices(p)] = values
        return flat.reshape(p.shape)


def random_subset(numel: int, k: int, seed: int, device) -> Tensor:
    """k distinct indices drawn uniformly from range(numel), reproducible from ``seed``.

    For small blocks a randperm is cheapest. For k << numel, a full randperm is wasteful (O(numel) per message); drawing a few more
    than k with replacement and keeping the first k distinct ones is O(k log k) and exact in
    distribution (the first k distinct values of an iid uniform stream form a uniform
    k-subset). We fall back to randperm when too few distinct values come out.
    """
    gen = _generator(seed, device)
    if k * 8 > numel or numel <= 65536:
        return torch.randperm(numel, generator=gen, device=device)[:k]
    draw = torch.randint(numel, (k + k // 4 + 8,), generator=gen, device=device)
    uniq, inverse = torch.unique(draw, sorted=True, return_inverse=True)
    if uniq.numel() < k:
        return torch.randperm(numel, generator=gen, device=device)[:k]
    # keep the first k distinct values in order of first appearance
    first = torch.full((uniq.numel(),), draw.numel(), device=device, dtype=torch.long)
    first.scatter_reduce_(0, inverse, torch.arange(draw.numel(), device=device), "amin")
    return uniq[first.argsort()[:k]]


class RandK(_Sparse):
    """Unbiased random sparsification: keep k uniform coordinates scaled by d/k.

    omega = d/k - 1. Only the k values travel; the indices come from the message seed.
    """
    name = "randk"
    unbiased = True

    def omega(self, numel):
        return numel / self.k(numel) - 1.0

    def _indices(self, p):
        if "indices" in p.meta:  # the sender kept them; a receiver regenerates them
            return p.meta["indices"]
        return random_subset(math.prod(p.shape), p.meta["k"], p.seed, p.wire["values"].device)

    def compress(self, x, seed):
        numel = x.numel()
        k = self.k(numel)
        idx = random_subset(numel, k, seed, x.device)
        vals = x.reshape(-1)[idx] * (numel / k)
        return Packet({"values": vals}, x.shape, seed=seed, meta={"k": k, "indices": idx})

    def wire_bytes(self, numel):
        return 4 * self.k(numel)


def largest_magnitudes(a: np.ndarray, k: int) -> np.ndarray:
    """Indices, ascending, of the k largest |a_j| of a 1-D array: NaN counts as the largest
    magnitude, and of equal magnitudes at the k-th place the lowest indices are kept.

    The rule makes the kept set a function of the values alone: torch.topk leaves ties to its
    algorithm (on CPU, a heap). For k = 1 it keeps the first largest, as this rule does. A
    threshold read off every 16th magnitude keeps about 2k candidates; numpy's introselect
    finds the k-th largest magnitude among them; when fewer than k pass the threshold (a sample
    that misjudged the tail) the whole block is the candidate set, so the result is exact
    either way. On the CNN's 36,864-coordinate blocks this is several times faster than
    torch.topk (``make bench-cnn`` measures compression's share of EF21-Muon's step).
    """
    n = a.size
    mag = np.abs(a)
    if k == 1:   # argmax: the first NaN, else the first of the largest
        return np.array([np.argmax(mag)])
    cand = None
    if n >= _PREFILTER_MIN and k <= n // 8:
        sample = mag[::_PREFILTER_STRIDE]
        rank = min(sample.size, 2 * k // _PREFILTER_STRIDE + 4)
        threshold = np.partition(sample, sample.size - rank)[sample.size - rank]
        cand = np.flatnonzero(~(mag < threshold))   # ~(<) keeps NaN
        if cand.size < k:
            cand = None
    m = mag if cand is None else mag[cand]
    kth = np.partition(m, m.size - k)[m.size - k]   # numpy sorts NaN last, as the largest
    if np.isnan(kth):
        keep = np.flatnonzero(np.isnan(m))[:k]
    else:
        above = ~(m <= kth)                          # greater than the k-th, or NaN
        tied = np.flatnonzero(m == kth)
        above[tied[:k - int(above.sum())]] = True
        keep = np.flatnonzero(above)
    return keep if cand is None else cand[keep]


_PREFILTER_MIN = 4096     # coordinates; below this one introselect over the block is cheapest
_PREFILTER_STRIDE = 16    # every 16th magnitude estimates the threshold


def _numpy_view_ok(t: Tensor) -> bool:
    """Whether a sparse compressor may work on ``t`` through a numpy view (CPU, float32/64,
    no autograd): numpy's per-call cost is a fraction of torch's, and a step encodes many
    small blocks (``make bench-cnn``). Other tensors (CUDA, bf16) take the torch path."""
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64) \
        and not t.requires_grad


class TopK(_Sparse):
    """Greedy contraction: keep the k largest |x_j| unscaled; delta = k/d. Sends values + int32
    indices (ascending). Ties at the k-th place keep the lowest indices (``largest_magnitudes``)."""
    name = "topk"
    unbiased = False

    def delta(self, numel):
        return self.k(numel) / numel

    def _indices(self, p):
        return p.wire["indices"]   # int32 indexes numpy arrays and tensors as it is

    def compress(self, x, seed):
        flat = x.detach().reshape(-1)
        k = self.k(flat.numel())
        if _numpy_view_ok(flat):
            a = flat.numpy()
            idx = largest_magnitudes(a, k)
            return Packet({"values": torch.from_numpy(a[idx]),
                           "indices": torch.from_numpy(idx.astype(np.int32))}, x.shape)
        # the same rule on other devices and dtypes: a stable sort keeps the lowest indices
        idx = torch.sort(flat.abs(), descending=True, stable=True).indices[:k].sort().values
        return Packet({"values": flat[idx], "indices": idx.to(torch.int32)}, x.shape)

    def wire_bytes(self, numel):
        return 8 * self.k(numel)


class Natural(Compressor):
    """Natural compression (Horvath et al. 2022): round |x_j| stochastically to a power of two.

    Unbiased with omega = 1/8. On the wire: one int8 exponent per coordinate (-128 encodes 0)
    plus the signs packed 8 per byte: 9 bits a coordinate, normalised cost 9/32.
    """
    name = "natural"
    unbiased = True

    def omega(self, numel):
        return 1.0 / 8.0

    def compress(self, x, seed):
        flat = x.reshape(-1).float()
        a = flat.abs()
        nz = a > 0
        # 2^e <= a < 2^(e+1); round up with probability (a - 2^e) / 2^e.
        e = torch.floor(torch.log2(torch.where(nz, a, torch.ones_like(a))))
        low = torch.exp2(e)
        p_up = (a - low) / low
        u = torch.rand(flat.shape, generator=_generator(seed, x.device), device=x.device)
        e = e + (u < p_up).to(e.dtype)
        code = torch.where(nz, e.clamp(-127, 127), torch.full_like(e, -128)).to(torch.int8)
        signs = _pack_bits(flat < 0)
        return Packet({"exponent": code, "signs": signs}, x.shape, meta={"dtype": x.dtype})

    def decompress(self, p):
        code = p.wire["exponent"]
        n = code.numel()
        neg = _unpack_bits(p.wire["signs"], n)
        mag = torch.where(code == -128, torch.zeros((), device=code.device),
                          torch.exp2(code.float()))
        return torch.where(neg, -mag, mag).to(p.meta["dtype"]).reshape(p.shape)

    def cost(self, numel):
        return 9.0 / 32.0

    def wire_bytes(self, numel):
        return numel + (numel + 7) // 8


class QSGD(Compressor):
    """Random dithering / QSGD (Alistarh et al. 2017) with ``levels`` = s levels per sign.

    Q(x) = ||x||_2 sign(x) xi(x, s) / s, xi stochastic rounding of s|x_j|/||x||_2.
    Unbiased with omega = min(d/s^2, sqrt(d)/s). On the wire: the fp32 norm plus one int8
    signed level per coordinate (s <= 127). Normalised cost counts the information bits,
    32 + d (1 + ceil(log2(s + 1))), over 32 d.
    """
    name = "qsgd"
    unbiased = True

    def __init__(self, levels: int = 1):
        self.levels = int(levels)
        self.check()

    def check(self):
        if not (1 <= self.levels <= 127):
            raise ValueError(f"qsgd: levels must be an integer in [1, 127], got {self.levels}")

    def omega(self, numel):
        s = self.levels
        return min(numel / s**2, math.sqrt(numel) / s)

    def compress(self, x, seed):
        flat = x.reshape(-1).float()
        norm = flat.norm()
        s = self.levels
        scaled = flat.abs() / norm.clamp_min(torch.finfo(flat.dtype).tiny) * s
        low = torch.floor(scaled)
        u = torch.rand(flat.shape, generator=_generator(seed, x.device), device=x.device)
        level = low + (u < scaled - low).to(low.dtype)
        code = (torch.sign(flat) * level).to(torch.int8)
        return Packet({"norm": norm.reshape(1), "levels": code}, x.shape, meta={"dtype": x.dtype})

    def decompress(self, p):
        out = p.wire["norm"] * p.wire["levels"].float() / self.levels
        return out.to(p.meta["dtype"]).reshape(p.shape)

    def cost(self, numel):
        bits = 32 + numel * (1 + math.ceil(math.log2(self.levels + 1)))
        return bits / (32.0 * numel)

    def wire_bytes(self, numel):
        return 4 + numel


def _pack_bits(b: Tensor) -> Tensor:
    n = b.numel()
    pad = (-n) % 8
    bits = torch.cat([b.to(torch.uint8), b.new_zeros(pad, dtype=torch.uint8)]).reshape(-1, 8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=b.device)
    return (bits * weights).sum(1, dtype=torch.uint8)


def _unpack_bits(packed: Tensor, n: int) -> Tensor:
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) & weights) > 0).reshape(-1)[:n]


COMPRESSORS = {c.name: c for c in (Identity, Zero, RandK, TopK, Natural, QSGD)}


def make_compressor(name: str, **kwargs) -> Compressor:
    """Build a compressor by name; unknown names and bad hyperparameters raise ValueError."""
    if name not in COMPRESSORS:
        raise ValueError(f"unknown compressor {name!r}; choose one of {sorted(COMPRESSORS)}")
    cls = COMPRESSORS[name]
    params = {} if cls.__init__ is object.__init__ else \
        {k: p for k, p in inspect.signature(cls.__init__).parameters.items() if k != "self"}
    unknown = set(kwargs) - set(params)
    if unknown:
        raise ValueError(f"compressor {name!r} takes {sorted(params) or 'no options'}, "
                         f"got {sorted(unknown)}")
    missing = [k for k, p in params.items() if p.default is p.empty and k not in kwargs]
    if missing:
        raise ValueError(f"compressor {name!r} needs {missing} (e.g. {name}.density in (0, 1])")
    return cls(**kwargs)
