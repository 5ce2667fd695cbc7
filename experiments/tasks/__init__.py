"""The experiments' tasks. Each module holds one task whole (data, oracle, evaluation) and
offers the run lifecycle (:mod:`experiments.run.lifecycle`) two functions:

* ``check(cfg)``: the task's own checks of a config, before any data is loaded;
* ``build(cfg, compressor, world) -> Built``: the method over the workers this process hosts.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

from gluon.methods import Method


class Built(NamedTuple):
    """What a task's ``build`` hands the run lifecycle."""
    method: Method                            # stepped by gluon.train
    evaluate: Callable[[Method], dict]        # the values of a logged row (loss, gap, test_acc)
    summary: dict                             # recorded in summary.json (f*, parameter counts)
    state: Any = None                         # task state the method does not own (state_dict /
                                              # load_state_dict), checkpointed with the method
