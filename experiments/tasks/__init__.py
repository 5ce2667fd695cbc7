"""The experiments' tasks. Each module holds one task whole (data, oracle, evaluation) and
offers the run lifecycle (:mod:`experiments.run.lifecycle`) two functions:

* ``check(cfg)``: the task's own checks of a config, before any data is loaded;
* ``check_data(cfg)``: the data is on disk, intact and readable (before hydra makes a folder);
* ``data_identity(cfg)``: the data's identity, part of a run's (:mod:`experiments.run.runs`);
* ``build(cfg, compressor, world) -> Built``: the method over the workers this process hosts.

:data:`TASKS` registers them by ``task.name``, the name every config, record and figure uses.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, NamedTuple

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
