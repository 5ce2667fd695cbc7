"""Linear minimisation oracles, one per norm (docs/algorithms.md section 2).

``lmo(M)`` returns D = argmin_{||D|| <= 1} <M, D> for the block's norm, so the Gluon step is
X <- X + radius * D. ``dual_norm(M)`` is ||M||_*, with <M, lmo(M)> = -||M||_* for the exact
LMOs; tests check both.

The norms follow Scion (Pethick et al. 2025; LIONS-EPFL/scion, ``scion.py`` and
``examples/airbench``): a spectral LMO scaled by sqrt(d_out/d_in) for hidden matrices and by
sqrt(c_out/c_in)/(kh*kw) for conv kernels (Scion's ``SpectralConv``), a sign LMO scaled by 1/d_in
for the head (Scion's ``Sign(normalized=True)``), an RMS-normalised LMO for biases (``BiasRMS``).
The scales are part of the norm's definition; ``scale=False`` gives the plain unit ball.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

_EPS = 1e-12


class LMO:
    name = "base"

    def __call__(self, m: Tensor) -> Tensor:
        raise NotImplementedError

    def dual_norm(self, m: Tensor) -> float:
        """||m||_* for this LMO's norm: equals -<m, lmo(m)> when the LMO is exact."""
        return float(-(m * self(m)).sum())

    def __repr__(self):
        return f"{type(self).__name__}()"


class Euclidean(LMO):
    """l2 ball: D = -M/||M||_2 (normalised SGD with momentum)."""
    name = "euclidean"

    def __call__(self, m):
        return -m / m.norm().clamp_min(_EPS)


class Sign(LMO):
    """l_inf ball: D = -sign(M); Scion's "Sign" form divides by d_in (the row length)."""
    name = "sign"

    def __init__(self, scale: bool = True):
        self.scale = scale

    def __call__(self, m):
        d = -torch.sign(m)
        if self.scale and m.ndim >= 2:
            d = d / (m.numel() // m.shape[0])
        return d


class RMS(LMO):
    """RMS-normalised ball for biases / norm parameters: D = -M / rms(M)."""
    name = "rms"

    def __call__(self, m):
        rms = m.pow(2).mean().sqrt().clamp_min(_EPS)
        return -m / rms


# Muon's quintic Newton-Schulz coefficients: they push all singular values into about
# [0.68, 1.13] in 5 steps instead of converging to exactly 1 (faster, good enough).
NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5   # Muon's number of steps: the default wherever a spectral LMO is built


def newton_schulz(m: Tensor, steps: int = NS_STEPS, eps: float = 1e-7) -> Tensor:
    """Approximate the polar factor U V^T of a 2-D matrix m = U S V^T.

    Muon's iteration X <- a X + (b A + c A^2) X with A = X X^T. Every iterate is Q X_0 for a
    matrix Q acting on the short side, and A = Q G Q^T with G = X_0 X_0^T, so we iterate on the
    small Gram matrix instead: two products with the wide X_0 in all (G and the final Q X_0)
    instead of two per step. Same iteration in exact arithmetic; for a 256 x 2304 conv kernel it
    is several times cheaper.
    """
    a, b, c = NS_COEFFS
    x = m / (m.norm() + eps)  # Frobenius scaling puts every singular value in [0, 1]
    transpose = x.shape[0] > x.shape[1]
    if transpose:  # iterate on the short side: X X^T is then the small Gram matrix
        x = x.T
    gram = x @ x.T
    q = None
    s = gram                  # A_k = Q_k G Q_k^T
    for _ in range(steps):
        p = torch.addmm(b * s, s, s, alpha=c)          # b A + c A^2
        p.diagonal().add_(a)                           # + a I
        q = p if q is None else p @ q
        s = q @ gram @ q.T
    out = q @ x
    return out.T if transpose else out


def spectral_scale(shape) -> float:
    """Scion's factor for a spectral step: sqrt(d_out/d_in) for a matrix (d_out x d_in),
    sqrt(c_out/c_in)/(kh*kw) for a conv kernel (c_out, c_in, kh, kw)."""
    if len(shape) > 2:
        taps = math.prod(shape[2:])
        return math.sqrt(shape[0] / shape[1]) / taps
    return math.sqrt(shape[0] / math.prod(shape[1:]))


class Spectral(LMO):
    """Spectral-norm ball: D = -U V^T (exact SVD, or ``ns_steps`` Newton-Schulz steps).

    Conv kernels are flattened to out x (in*kh*kw). With ``scale`` the step is multiplied as in
    Scion: by sqrt(d_out/d_in) for a matrix (the RMS->RMS operator norm is the one bounded) and
    by sqrt(c_out/c_in)/(kh*kw) for a conv kernel (Scion's ``SpectralConv``: each of the kh*kw
    taps is an RMS->RMS map and their outputs add up).
    """
    name = "spectral"

    def __init__(self, ns_steps: int = NS_STEPS, scale: bool = True):
        self.ns_steps = ns_steps
        self.scale = scale

    def __call__(self, m):
        mat = m.reshape(m.shape[0], -1)
        if self.ns_steps > 0:
            polar = newton_schulz(mat.float(), self.ns_steps).to(m.dtype)
        else:
            u, _, vh = torch.linalg.svd(mat, full_matrices=False)
            polar = u @ vh
        d = -polar
        if self.scale:
            d = d * spectral_scale(m.shape)
        return d.reshape(m.shape)

    def __repr__(self):
        return f"Spectral(ns_steps={self.ns_steps}, scale={self.scale})"


LMOS = {"euclidean": Euclidean, "sign": Sign, "rms": RMS, "spectral": Spectral}


def make_lmo(name: str, **kwargs) -> LMO:
    if name not in LMOS:
        raise ValueError(f"unknown LMO {name!r}; choose one of {sorted(LMOS)}")
    return LMOS[name](**kwargs)


@dataclass
class Block:
    """One parameter block: its LMO and its radius scale t_i (step = t_i * lr * lmo(M))."""
    name: str
    lmo: LMO
    scale: float = 1.0


# Scion's airbench configuration (LIONS-EPFL/scion, examples/airbench): one radius for the convs
# and the BatchNorm biases, 16 times that radius for the Sign head.
SCION_HEAD_SCALE = 16.0

# The rule that gives each parameter its LMO when no rule of the caller's names it
# (:func:`assign_lmos`): Scion's.
LMO_DEFAULT = "scion"

# The LMO settings a task's config may leave to the library (configs/task/cnn.yaml refers to
# them with ${gluon_lmo_default:<key>}), so that each has one home, here.
LMO_DEFAULTS = {"lmo_default": LMO_DEFAULT, "ns_steps": NS_STEPS, "head_scale": SCION_HEAD_SCALE}


def assign_lmos(named_shapes: Sequence[tuple[str, torch.Size]],
                rules: Sequence[tuple[str, str, float]] | None = None,
                default: str = LMO_DEFAULT, ns_steps: int = NS_STEPS,
                head_scale: float = SCION_HEAD_SCALE) -> list[Block]:
    """Give every parameter a block (LMO + radius scale).

    ``rules`` are (regex on the parameter name, LMO name, radius scale), first match wins,
    and override the default rule. Default rules:

    * ``"scion"``: matrices and conv kernels -> spectral, the last matrix (the head) -> sign
      with radius scale ``head_scale`` (16, Scion's airbench), vectors (biases, norm weights)
      -> rms. The CNN experiment's choice.
    * ``"euclidean"``: every block l2 (the logistic-regression experiment).
    """
    if default not in ("scion", "euclidean"):
        raise ValueError(f"unknown default LMO rule {default!r}; use 'scion' or 'euclidean'")
    rules = [(re.compile(p), n, float(s)) for p, n, s in (rules or [])]
    matrices = [i for i, (_, shape) in enumerate(named_shapes) if len(shape) >= 2]
    head = matrices[-1] if matrices else None
    blocks = []
    for i, (name, shape) in enumerate(named_shapes):
        for pattern, lmo_name, scale in rules:
            if pattern.search(name):
                kw = {"ns_steps": ns_steps} if lmo_name == "spectral" else {}
                blocks.append(Block(name, make_lmo(lmo_name, **kw), scale))
                break
        else:
            if default == "euclidean":
                lmo = Euclidean()
            elif len(shape) < 2:
                lmo = RMS()
            elif i == head:
                blocks.append(Block(name, Sign(), float(head_scale)))
                continue
            else:
                lmo = Spectral(ns_steps=ns_steps)
            blocks.append(Block(name, lmo))
    return blocks
