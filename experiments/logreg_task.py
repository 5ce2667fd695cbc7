"""The a5a logistic-regression task (docs/algorithms.md section 6): data, worker shards, oracle, f*.

Model: x in R^124 = 123 weights plus a bias (a constant-1 feature appended to every example),
one parameter block with the Euclidean LMO. Objective of worker tau on its shard D_tau:

    f^tau(x) = mean_{(a, b) in D_tau} log(1 + exp(-b <a, x>)) + (lam / 2) ||x||^2,  lam = 1e-4,

with the bias regularised too (so f is strongly convex and f* unique). The global objective f
is the mean of the workers' objectives; with equal shards it is the full-data objective.
Gradients are closed form: autograd would cost more than the whole step.
"""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_svmlight_file
from torch import Tensor

from gluon.worker import Oracle

from .atomic import atomic_write_text

N_FEATURES = 123


def load_libsvm(path: str | Path, n_features: int = N_FEATURES) -> tuple[Tensor, Tensor]:
    """(A, b): A dense float32 with a trailing column of ones (bias), b in {-1, +1}."""
    X, y = load_svmlight_file(str(path), n_features=n_features)
    A = np.hstack([X.toarray(), np.ones((X.shape[0], 1))]).astype(np.float32)
    b = np.where(y > 0, 1.0, -1.0).astype(np.float32)
    return torch.from_numpy(A), torch.from_numpy(b)


def split(n: int, n_workers: int, seed: int, labels: Tensor | None = None,
          heterogeneity: str = "iid") -> list[Tensor]:
    """Index shards of equal size (the remainder is dropped so f = mean of the f^tau).

    ``iid``: a random permutation cut in n_workers pieces. ``label_skew``: examples sorted by
    label (ties broken at random) before cutting, so workers see different class balances.
    """
    if n_workers < 1 or n_workers > n:
        raise ValueError(f"n_workers must be in [1, {n}], got {n_workers}")
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=gen)
    if heterogeneity == "label_skew":
        if labels is None:
            raise ValueError("label_skew needs labels")
        perm = perm[torch.argsort(labels[perm], stable=True)]
    elif heterogeneity != "iid":
        raise ValueError(f"unknown heterogeneity {heterogeneity!r}; use 'iid' or 'label_skew'")
    size = n // n_workers
    return [perm[i * size:(i + 1) * size] for i in range(n_workers)]


class LogRegOracle(Oracle):
    """Worker oracle for regularised logistic regression on a shard (A, b)."""

    def __init__(self, A: Tensor, b: Tensor, batch_size: int, l2: float):
        self.A, self.b = A.contiguous(), b.contiguous()
        self.batch_size, self.l2 = batch_size, l2

    def sample(self, gen, batches=1):
        return torch.randint(len(self.b), (self.batch_size * batches,), generator=gen)

    def full(self):
        return None  # marker: the whole shard

    def _rows(self, idx):
        if idx is None:
            return self.A, self.b
        return self.A.index_select(0, idx), self.b.index_select(0, idx)

    def grad(self, params, idx):
        (x,) = params
        A, b = self._rows(idx)
        # d/dz log(1+exp(-b z)) = -b * sigmoid(-b z)
        r = -b * torch.sigmoid(-b * (A @ x))
        return [A.T @ r / len(b) + self.l2 * x]

    def grad_diff(self, params, prev, idx):
        # Both gradients share A and b: one matmul for the two points, and the difference
        # taken before the second matmul (A^T r - A^T r' = A^T (r - r')).
        A, b = self._rows(idx)
        x, xp = params[0], prev[0]
        s = torch.sigmoid((A @ torch.stack([x, xp], 1)) * -b[:, None])
        r = b * (s[:, 1] - s[:, 0])
        return [A.T @ r / len(b) + self.l2 * (x - xp)]

    def loss(self, params, idx=None):
        (x,) = params
        A, b = self._rows(idx)
        return float(torch.nn.functional.softplus(-b * (A @ x)).mean() + 0.5 * self.l2 * x.dot(x))


def objective(A: Tensor, b: Tensor, l2: float):
    """f(x) in float64 for evaluation and for f*: numpy callables (value, gradient)."""
    A64, b64 = A.double().numpy(), b.double().numpy()

    def f(x):
        z = -b64 * (A64 @ x)
        return float(np.logaddexp(0.0, z).mean() + 0.5 * l2 * x @ x)

    def grad(x):
        z = -b64 * (A64 @ x)
        s = 0.5 * (1.0 + np.tanh(0.5 * z))  # sigmoid, overflow-free
        return A64.T @ (-b64 * s) / len(b64) + l2 * x

    return f, grad


def solve_f_star(A: Tensor, b: Tensor, l2: float, tol: float = 1e-10, max_iter: int = 200_000):
    """f* by full-batch gradient descent with Nesterov momentum on the float64 objective.

    f is L-smooth with L <= ||A||_2^2 / (4 N) + l2 and l2-strongly convex; we stop when
    ||grad f|| <= tol, which bounds f - f* <= ||grad||^2 / (2 l2).
    """
    f, grad = objective(A, b, l2)
    A64 = A.double().numpy()
    L = np.linalg.norm(A64, 2) ** 2 / (4 * len(A64)) + l2
    mu = l2
    kappa = L / mu
    mom = (math.sqrt(kappa) - 1) / (math.sqrt(kappa) + 1)
    x = np.zeros(A64.shape[1])
    y = x.copy()
    for it in range(max_iter):
        gy = grad(y)
        x_new = y - gy / L
        y = x_new + mom * (x_new - x)
        x = x_new
        if it % 100 == 0 and np.linalg.norm(grad(x)) <= tol:
            break
    gnorm = float(np.linalg.norm(grad(x)))
    return {"f_star": f(x), "grad_norm": gnorm, "iterations": it + 1,
            "gap_bound": gnorm**2 / (2 * l2), "solver": "Nesterov accelerated gradient descent"}, x


def cached_f_star(A, b, l2, cache: Path, key: dict) -> dict:
    """f* computed once per (dataset, l2, split) and cached as JSON beside the results.

    The jobs of a sweep or SLURM array may all compute it at once on a fresh checkout: the file
    is written atomically (a private temporary file, then a rename; experiments.atomic), so a
    reader never sees half of it. A cache that cannot be parsed (left truncated by an older
    version) is a miss: f* is recomputed and the file rewritten.
    """
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    name = "fstar-" + "-".join(f"{k}={v}" for k, v in sorted(key.items())) + ".json"
    path = cache / name
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        pass
    except (ValueError, UnicodeDecodeError) as err:
        warnings.warn(f"ignoring unreadable f* cache {path} ({err}); recomputing it",
                      RuntimeWarning, stacklevel=2)
    info, _ = solve_f_star(A, b, l2)
    info.update(key)
    atomic_write_text(path, json.dumps(info, indent=2))
    return info
