"""What every test module shares: composing an entry point's hydra config without running it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from threadpoolctl import threadpool_limits

from experiments.run.config import compose as compose_config  # noqa: F401 (the helper)

# `make test` runs two test processes on two cores: each computes on one thread, as every run
# does (threads=1), so that neither torch nor numpy's BLAS spins on the core the other holds.
torch.set_num_threads(1)
threadpool_limits(1, user_api="blas")

from experiments.shared.files import REPO
CONFIGS = REPO / "configs"


def entry_point_of(experiment: str) -> str:
    """The entry point an experiment config belongs to: a task's own folder names it (lm/...),
    else the CNN's configs say cnn (or are Figure 8), else logistic regression."""
    top = experiment.split("/")[0]
    if (CONFIGS / f"{top}.yaml").is_file():
        return top
    return "cnn" if "cnn" in experiment or experiment == "fig8" else "logreg"


def stopping_train(train, step: int):
    """``train`` that raises KeyboardInterrupt right after ``step`` (an in-process kill)."""
    def stopping(method, steps, **kw):
        inner = kw["on_step"]

        def on_step(m):
            inner(m)
            if m.k == step:
                raise KeyboardInterrupt
        return train(method, steps, **{**kw, "on_step": on_step})
    return stopping


@pytest.fixture
def compose_cfg():
    return compose_config


@pytest.fixture(scope="module")
def results_with_cache(tmp_path_factory):
    """A results_dir whose f* cache is filled before any run starts (copied from the repo's
    cache, else computed once), so that concurrent runs do not each solve for f*."""
    import shutil

    from experiments.tasks import logreg
    from gluon import make_compressor
    out = tmp_path_factory.mktemp("results")
    (out / "cache").mkdir()
    for f in (REPO / "results" / "cache").glob("fstar-*.json"):
        shutil.copy(f, out / "cache" / f.name)
    logreg.build(compose_config("logreg", f"results_dir={out}"), make_compressor("identity"))
    return out


# Every logged row carries compute_s, the measured compute time (docs/cost.md): the one column in
# which two runs of the same config differ. Runs are compared byte for byte on everything else.
_TIMING = re.compile(r', "compute_s": [-+0-9.eEinfa]+')


def metrics_bytes(run_dir) -> bytes:
    """metrics.jsonl as written, less every row's measured ``compute_s`` (each row has one)."""
    text = (Path(run_dir) / "metrics.jsonl").read_text()
    assert text.count('"compute_s": ') == text.count("\n")
    return _TIMING.sub("", text).encode()


def untimed(x):
    """A row, a summary's ``final`` or a list of rows without ``compute_s``."""
    if isinstance(x, list):
        return [untimed(r) for r in x]
    return {k: v for k, v in x.items() if k != "compute_s"}
