"""A character-level GPT on Tiny Shakespeare with n workers: one run per invocation, a sweep with ``-m``.

    python -m experiments.lm profile=lm/cpu method=alg1 compressor=randk compressor.density=0.01 \
        method.q=0.1 method.B=16 max_comm=300 seed=0
    python -m experiments.lm profile=lm/cpu task.split=plays method=gluon   # by-play worker split
    torchrun --nproc-per-node 4 -m experiments.lm comm=torchdist profile=lm/cpu steps=50

Writes metrics.jsonl, summary.json and lm.log into hydra's run folder (``hydra.run.dir=PATH``);
the task itself (data, model, oracles, evaluation) lives in :mod:`experiments.tasks.lm`
(docs/lm.md).
"""
from __future__ import annotations

from .run.command_line import entry_point
from .tasks import lm as task

main = entry_point(task, "lm", objective="val_loss")   # hydra's job returns the final val_loss

if __name__ == "__main__":
    main()
