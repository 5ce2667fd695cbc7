"""Worker shards: which examples each of the n workers holds (shared by every task)."""
from __future__ import annotations

import torch
from torch import Tensor

HETEROGENEITY = ("iid", "label_skew")


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
