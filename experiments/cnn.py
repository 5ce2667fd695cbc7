"""CIFAR-10 with the airbench94 CNN and n workers: one run per invocation, a sweep with ``-m``.

    python -m experiments.cnn method=alg1 compressor=randk compressor.density=0.01 \
        method.q=0.1 method.B=4 method.beta=0.9 method.lr=0.05 steps=2000 seed=0
    python -m experiments.cnn profile=cpu method=gluon seed=1        # the small CPU profile
    torchrun --nproc-per-node 4 -m experiments.cnn comm=torchdist profile=cpu steps=50

Writes metrics.jsonl, summary.json and cnn.log into hydra's run folder (``hydra.run.dir=PATH``);
the task itself (data, model, oracles, evaluation) lives in :mod:`experiments.tasks.cnn`.
"""
from __future__ import annotations

from .run.command_line import entry_point
from .tasks import cnn as task

main = entry_point(task, "cnn", objective="loss")   # hydra's job returns the final loss

if __name__ == "__main__":
    main()
