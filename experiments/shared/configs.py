"""What a reader of results needs from configs/, read as plain YAML (no hydra, no composition):
the folder an experiment's sweep writes, and the CNN's widths.

The sweep folder is ``results/sweeps/<group>`` (configs/hydra/default.yaml: ``hydra.sweep.dir``),
``group`` being the experiment config's own or, failing that, the last one its ``/experiment/``
defaults set (a config's own keys override its defaults, as hydra's ``_self_`` last does).
tests/test_architecture.py checks that this equals the folder hydra composes, for every
experiment config.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from .files import REPO

CONFIGS = REPO / "configs"
SWEEPS = Path("results/sweeps")       # relative to the checkout, as hydra writes it
NO_GROUP = "adhoc"                    # configs/hydra/default.yaml's gluon_sweep_name for no group


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def _experiment_file(name: str) -> Path:
    path = CONFIGS / "experiment" / f"{name}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no experiment config {path.relative_to(REPO)}")
    return path


def _group(name: str) -> str | None:
    """The ``group`` experiment ``name`` sets, through its ``/experiment/`` defaults."""
    cfg = _load(_experiment_file(name))
    group = None
    for entry in cfg.get("defaults") or []:
        if isinstance(entry, str) and entry != "_self_":
            parent = entry[len("/experiment/"):] if entry.startswith("/experiment/") else \
                str(Path(name).parent / entry)          # a name relative to this config's folder
            group = _group(parent) or group
    return cfg.get("group", group)


def sweep_dir(primary: str, experiment: str) -> Path:
    """The folder ``python -m experiments.<primary> -m experiment=<experiment>`` writes its
    runs into: where a figure finds them. ``primary`` is the entry point (``logreg``, ``cnn``);
    every primary config shares the one hydra default, so the folder depends on the experiment."""
    if not (CONFIGS / f"{primary}.yaml").is_file():
        raise FileNotFoundError(f"no primary config configs/{primary}.yaml")
    return SWEEPS / (_group(experiment) or NO_GROUP)


def cnn_widths(profile: str) -> list[int]:
    """The CNN's channel widths where the configs set them: ``paper`` (configs/task/cnn.yaml,
    airbench94's) or ``cpu`` (configs/profile/cpu.yaml)."""
    if profile == "paper":
        return list(_load(CONFIGS / "task" / "cnn.yaml")["widths"])
    if profile == "cpu":
        return list(_load(CONFIGS / "profile" / "cpu.yaml")["task"]["widths"])
    raise ValueError(f"profile {profile!r}: paper or cpu")
