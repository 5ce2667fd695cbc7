"""The experiments' tasks. Each module holds one task whole (data, oracle, evaluation) and
offers the run lifecycle (:mod:`experiments.run.lifecycle`) two functions:

* ``check(cfg)``: the task's own checks of a config, before any data is loaded;
* ``check_data(cfg)``: the data is on disk, intact and readable (before hydra makes a folder);
* ``data_identity(cfg)``: the data's identity, part of a run's (:mod:`experiments.run.runs`);
* ``build(cfg, compressor, world) -> Built``: the method over the workers this process hosts.

:data:`TASKS` registers them by ``task.name``, the name every config, record and figure uses.
What every task shares is here too: :func:`resolved` (a config as tasks read it),
:func:`settings` (a method's or compressor's settings) and :func:`split` (worker shards).
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, NamedTuple

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from gluon.methods import Method


class Built(NamedTuple):
    """What a task's ``build`` hands the run lifecycle."""
    method: Method                            # stepped by gluon.train
    evaluate: Callable[[Method], dict]        # the values of a logged row (loss, gap, test_acc)
    summary: dict                             # recorded in summary.json (f*, parameter counts)
    state: Any = None                         # task state the method does not own (state_dict /
                                              # load_state_dict), checkpointed with the method


TASKS = {"a5a": "logreg", "cifar10": "cnn"}   # task.name -> module of experiments.tasks


def task_module(name: str):
    """The module of the task registered as ``name`` (imported on first use: the CNN's
    imports torchvision)."""
    try:
        return importlib.import_module(f"{__name__}.{TASKS[name]}")
    except KeyError:
        raise ValueError(f"task.name={name}: no such task; the tasks are "
                         f"{', '.join(sorted(TASKS))}") from None


# ---------------------------------------------------------------- what every task shares

def resolved(cfg: DictConfig) -> DictConfig:
    """``cfg`` resolved, with enums as their strings and without hydra's node: a config as
    tasks and records read it (a config already resolved comes back equal)."""
    keys = [k for k in cfg.keys() if k != "hydra"]
    return OmegaConf.create(OmegaConf.to_container(OmegaConf.masked_copy(cfg, keys), resolve=True,
                                                   enum_to_str=True))


def settings(node: DictConfig) -> dict:
    """The settings a method's or compressor's config node gives: its keys less ``name`` and
    less those left unset (null), for ``gluon.simulate`` and ``gluon.make_compressor``."""
    return {k: v for k, v in OmegaConf.to_container(node, resolve=True, enum_to_str=True).items()
            if k != "name" and v is not None}


HETEROGENEITY = ("iid", "label_skew")


def split(n: int, n_workers: int, seed: int, labels: Tensor | None = None,
          heterogeneity: str = "iid") -> list[Tensor]:
    """Worker shards: index shards of equal size (the remainder is dropped so f = mean of the f^tau).

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
