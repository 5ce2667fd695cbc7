"""The a5a logistic-regression task (docs/algorithms.md section 6): data, worker shards, oracle, f*.

Model: x in R^124 = 123 weights plus a bias (a constant-1 feature appended to every example),
one parameter block with the Euclidean LMO. Objective of worker tau on its shard D_tau:

    f^tau(x) = mean_{(a, b) in D_tau} log(1 + exp(-b <a, x>)) + (lam / 2) ||x||^2,  lam = 1e-4,

with the bias regularised too (so f is strongly convex and f* unique). The global objective f
is the mean of the workers' objectives; with equal shards it is the full-data objective.
Gradients are closed form: autograd would cost more than the whole step.

The data file is known by its SHA-256 (checked against ``SHA256SUMS`` beside it, when there is
one) and its row count; f* is cached under that identity, so a changed file is never paired
with another file's f*.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from gluon import simulate
from gluon.worker import Oracle

from experiments.shared.files import REPO, atomic_write_text
from experiments.shared.errors import ConfigError
from . import (LIBSVM_URL, Built, DataCorruptError, check_heterogeneity, libsvm_file,
               locate_libsvm, settings, sha256, split, verify)

N_FEATURES = 123
log = logging.getLogger("experiments.run")


FLOAT32_MAX = float(np.finfo(np.float32).max)
LABELS = (-1.0, 0.0, 1.0)      # a binary LIBSVM file's labels: -1/+1, or 0/1 (0 is read as -1)


def load_libsvm(path: str | Path, n_features: int = N_FEATURES) -> tuple[Tensor, Tensor]:
    """(A, b): A dense float32 with a trailing column of ones (bias), b in {-1, +1} (a file
    labelled 0/1 has 0 read as -1). A file that is not LIBSVM text, a value that is not finite
    or not representable in float32 (``3:1e300``, ``5:nan``) and a label that is not binary
    (``7``) are a DataCorruptError naming the file's first bad line."""
    from sklearn.datasets import load_svmlight_file   # here: a command refused before its data
    try:                                              # never imports scikit-learn
        X, y = load_svmlight_file(str(path), n_features=n_features)
    except (ValueError, UnicodeDecodeError) as err:
        raise DataCorruptError(_bad_line(path, n_features, err)) from None
    problem = _bad_values(X, y)
    if problem is not None:
        raise DataCorruptError(_row_message(path, *problem))
    A = np.hstack([X.toarray(), np.ones((X.shape[0], 1))]).astype(np.float32)
    b = np.where(y > 0, 1.0, -1.0).astype(np.float32)
    return torch.from_numpy(A), torch.from_numpy(b)


def _bad_values(X, y) -> tuple[int, str] | None:
    """(example, what is wrong) of the first example (0-based) whose label or a value cannot be
    used, or None. A value must be finite and at most float32's largest in magnitude (A is
    float32: 1e300 would be inf); a label one of :data:`LABELS`."""
    found = []
    bad = ~np.isfinite(X.data) | (np.abs(X.data) > FLOAT32_MAX)
    if bad.any():
        at = int(np.argmax(bad))
        value = float(X.data[at])
        kind = "not a finite number" if not math.isfinite(value) else "beyond float32's range"
        found.append((int(np.searchsorted(X.indptr, at, side="right")) - 1,
                      f"feature {int(X.indices[at]) + 1} is {value:g}, {kind}"))
    odd = ~np.isin(y, LABELS)
    if odd.any():
        row = int(np.argmax(odd))
        found.append((row, f"label {float(y[row]):g} is not a binary label (-1/+1, or 0/1)"))
    return min(found) if found else None


def _row_message(path, example: int, what: str) -> str:
    """Two lines: the file line of ``example`` (0-based; blank and comment lines hold no
    example) with what is wrong with it, and the fix."""
    line, seen = 0, -1
    with open(path, "rb") as fh:
        for line, raw in enumerate(fh, 1):
            seen += bool(raw.split(b"#", 1)[0].strip())
            if seen == example:
                break
    fix = f"the file is damaged: get it again ({LIBSVM_URL.format(name=Path(path).name)})"
    return f"{path} line {line}: {what}\n  {fix}"


def _bad_line(path, n_features: int, err: Exception) -> str:
    """Where a LIBSVM file stops being LIBSVM text ("label index:value ..."), in two lines."""
    fix = f"the file is damaged: get it again ({LIBSVM_URL.format(name=Path(path).name)})"
    with open(path, "rb") as fh:
        for i, raw in enumerate(fh, 1):
            line = raw.split(b"#", 1)[0].strip()
            if not line:
                continue
            try:
                fields = line.decode().split()
                float(fields[0])
                for f in fields[1:]:
                    index, value = f.split(":")
                    if not 1 <= int(index) <= n_features:
                        raise ValueError(f"feature index {index} outside 1..{n_features}")
                    float(value)
            except (ValueError, UnicodeDecodeError, IndexError) as bad:
                shown = raw.decode(errors="replace").strip()
                return (f"{path} line {i} is not a LIBSVM row ({shown[:40]!r}: {bad})\n  {fix}")
    return f"{path} cannot be read as LIBSVM text ({err})\n  {fix}"


@functools.lru_cache(maxsize=2)
def _parsed(path: str, size: int, mtime_ns: int) -> tuple[Tensor, Tensor]:
    return load_libsvm(path)


def load_dataset(name: str, data_dir=None, cache_dir=None, download: bool = True,
                 remember: bool = True):
    """(A, b, identity) of LIBSVM dataset ``name``: located (downloaded if allowed), checked
    against ``SHA256SUMS`` beside it, parsed once per process and file version. ``identity``:
    ``{"file", "sha256", "rows"}``. ``remember``: keep the file's hash in ``cache_dir``."""
    path = libsvm_file(name, data_dir, download=download)
    digest = verify(path, cache_dir, remember=remember,
                    fix=f"get it again ({LIBSVM_URL.format(name=name)}) or fix SHA256SUMS")
    st = path.stat()
    A, b = _parsed(str(path.resolve()), st.st_size, st.st_mtime_ns)
    return A, b, {"file": str(path), "sha256": digest, "rows": len(b)}


class LogRegOracle(Oracle):
    """Worker oracle for regularised logistic regression on a shard (A, b)."""

    def __init__(self, A: Tensor, b: Tensor, batch_size: int, l2: float):
        self.A, self.b = A.contiguous(), b.contiguous()
        self.batch_size, self.l2 = batch_size, l2

    def sample(self, gen, batches=1):
        return torch.randint(len(self.b), (self.batch_size * batches,), generator=gen)

    def full(self):
        return None  # marker: the whole shard

    def shard_minibatches(self) -> float:
        return len(self.b) / self.batch_size

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
    """f* computed once per ``key`` (the data's content hash and row count, l2, the split) and
    cached as JSON beside the results.

    The jobs of a sweep or SLURM array may all compute it at once on a fresh checkout: the file
    is written atomically (a private temporary file, then a rename; experiments.shared.runs), so a
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


# ---------------------------------------------------------------- the task, for the run lifecycle

def check(cfg) -> None:
    """The a5a task's own checks (the dataset file is looked for when the data is loaded)."""
    check_heterogeneity(cfg)
    if not 0 <= cfg.task.l2 < math.inf:
        raise ValueError(f"task.l2={cfg.task.l2}: must be a finite number >= 0")


def _cache_dir(cfg) -> Path:
    return Path(REPO, cfg.results_dir, "cache")


def data_identity(cfg) -> str | None:
    """The identity of the data a run of ``cfg`` reads, part of the run's identity
    (:func:`experiments.shared.runs.run_id`): the SHA-256 of the LIBSVM file (hashed once per file
    version), or None while it is not on disk."""
    hit, _ = locate_libsvm(cfg.task.dataset, cfg.data_dir)
    return None if hit is None else sha256(hit, _cache_dir(cfg))


def check_data(cfg) -> None:
    """The data a run of ``cfg`` needs, before hydra makes a folder: the file exists (or can
    be downloaded), matches SHA256SUMS, parses, and has a row for every worker. Writes
    nothing, except a download."""
    _, b, data = load_dataset(cfg.task.dataset, cfg.data_dir, _cache_dir(cfg), remember=False)
    if cfg.n_workers > data["rows"]:
        raise ConfigError(f"n_workers={cfg.n_workers}: {cfg.task.dataset} has {data['rows']} "
                          f"examples, so at most {data['rows']} workers (one example each)")


def shard_note(rows: int, n_workers: int, batch_size: int) -> str | None:
    """One line when the split is not what a reader would assume: a shard smaller than a
    minibatch, or more than 1% of the rows left over by equal shards; else None."""
    size, left = rows // n_workers, rows % n_workers
    notes = []
    if size < batch_size:
        notes.append(f"each worker's shard has {size} examples, fewer than batch_size="
                     f"{batch_size}: a minibatch draws {batch_size} of them with replacement")
    if left and (size < batch_size or left > 0.01 * rows):
        notes.append(f"the {left} rows ({left / rows:.0%}) left over by {n_workers} equal shards "
                     "are not used")
    return f"n_workers={n_workers}, batch_size={batch_size}: " + "; ".join(notes) if notes else None


def build(cfg, compressor, world=None) -> Built:
    """The method over the workers this process hosts (all of them in a simulation), the
    evaluation (f(x) - f* on the full training set) and what the summary records."""
    A, b, data = load_dataset(cfg.task.dataset, cfg.data_dir, _cache_dir(cfg))
    note = shard_note(len(b), cfg.n_workers, cfg.batch_size)
    if note:
        log.warning("[data] %s", note)
    shards = split(len(b), cfg.n_workers, cfg.task.split_seed, b, cfg.task.heterogeneity)
    used = torch.cat(shards)
    data["used"] = len(used)
    f, _ = objective(A[used], b[used], cfg.task.l2)
    fstar = cached_f_star(A[used], b[used], cfg.task.l2, _cache_dir(cfg),
                          {"dataset": cfg.task.dataset, "sha256": data["sha256"][:16],
                           "rows": data["rows"], "n_workers": cfg.n_workers,
                           "split_seed": cfg.task.split_seed, "heterogeneity": cfg.task.heterogeneity,
                           "l2": cfg.task.l2})
    comm = world.comm(cfg.n_workers, cfg.seed) if world is not None else None
    ranks = comm.local_workers if comm is not None else range(cfg.n_workers)
    oracles = {r: LogRegOracle(A[shards[r]], b[shards[r]], cfg.batch_size, cfg.task.l2)
               for r in ranks}
    x = torch.zeros(A.shape[1])
    method = simulate(cfg.method.name, [x], oracles, compressor=compressor, seed=cfg.seed,
                      comm=comm, **settings(cfg.method))

    def evaluate(m):
        loss = f(m.params[0].double().numpy())
        return {"loss": loss, "gap": loss - fstar["f_star"]}

    return Built(method, evaluate, {"f_star": fstar["f_star"], "f_star_info": fstar,
                                    "data_file": data})
