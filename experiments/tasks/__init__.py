"""The experiments' tasks. Each module holds one task whole (data, oracle, evaluation) and
offers the run (:mod:`experiments.run.lifecycle`) four functions, each given the run's config
resolved once (:attr:`ResolvedConfig.cfg`):

* ``check(cfg)``: the task's own checks of a config, before any data is loaded;
* ``check_data(cfg)``: the data is on disk, intact and readable (before hydra makes a folder);
* ``data_identity(cfg)``: the data's identity, part of a run's (:mod:`experiments.shared.runs`);
* ``build(cfg, compressor, world) -> Built``: the method over the workers this process hosts.

:data:`TASKS` registers them by ``task.name``, the name every config, record and figure uses.
What every task shares is here too: :class:`ResolvedConfig` (a run's config resolved once, as
tasks and records read it), :func:`settings` (a method's or compressor's settings),
:func:`split` (worker shards) and the data: where it is found (:func:`candidate_dirs`,
:func:`libsvm_file`) and its identity by content (:func:`sha256`, checked against
``SHA256SUMS`` by :func:`verify`).
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import urllib.request
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import Tensor

from gluon.methods import Method

from experiments.shared.files import REPO, atomic_write, atomic_write_text
from experiments.shared.errors import ConfigError, EnvironmentProblem


class Built(NamedTuple):
    """What a task's ``build`` hands the run lifecycle."""
    method: Method                            # stepped by gluon.train
    evaluate: Callable[[Method], dict]        # the values of a logged row (loss, gap, test_acc)
    summary: dict                             # recorded in summary.json (f*, parameter counts)
    state: Any = None                         # task state the method does not own (state_dict /
                                              # load_state_dict), checkpointed with the method


# task.name -> the module that holds the task: its name (imported on first use: the CNN's
# imports torchvision) or the module itself. A task of your own is one more entry, made by its
# module (docs/architecture.md, "How to add a task").
TASKS = {"logreg": "experiments.tasks.logreg", "cnn": "experiments.tasks.cnn",
         "lm": "experiments.tasks.lm"}


def task_module(name: str):
    """The module of the task registered as ``name``."""
    try:
        module = TASKS[name]
    except KeyError:
        raise ValueError(f"task.name={name}: no such task; the tasks are "
                         f"{', '.join(sorted(TASKS))}") from None
    return importlib.import_module(module) if isinstance(module, str) else module


# ---------------------------------------------------------------- what every task shares

def resolved(cfg: DictConfig) -> DictConfig:
    """``cfg`` resolved, with enums as their strings and without hydra's node: a config as
    tasks and records read it (a config already resolved comes back equal). The run resolves
    its config once, into a :class:`ResolvedConfig`."""
    keys = [k for k in cfg.keys() if k != "hydra"]
    return OmegaConf.create(OmegaConf.to_container(OmegaConf.masked_copy(cfg, keys), resolve=True,
                                                   enum_to_str=True))


@dataclass(frozen=True)
class ResolvedConfig:
    """A run's config resolved once, where the run starts (the command line's check, the sweeper
    for each job, a sweep's job, ``execute`` given a composed config): what the run, its task
    and its records read from then on. :meth:`of` makes it."""
    composed: DictConfig        # as composed: the schema's types, hydra's node when composed with it
    cfg: DictConfig             # the values (read-only; enums as strings, no hydra node): what a
                                # task's check, check_data, data_identity and build receive
    config: dict                # the same values as plain data: what summary.json records and a
                                # run's identity is made of (experiments.shared.runs.identity)
    task: Any = None            # the task's module (TASKS), when known
    validated: bool = False     # every check passed (experiments.run.config.checked)

    @classmethod
    def of(cls, cfg: DictConfig | ResolvedConfig, task=None) -> ResolvedConfig:
        """``cfg`` resolved (``cfg`` itself when it is resolved already). ConfigError when a
        value cannot be resolved (an interpolation to no key, say)."""
        if isinstance(cfg, cls):
            return cfg if task is None or cfg.task is task else replace(cfg, task=task)
        try:
            values = resolved(cfg)
        except OmegaConfBaseException as err:
            raise ConfigError(str(err).strip().splitlines()[0]) from None
        OmegaConf.set_readonly(values, True)
        return cls(cfg, values, OmegaConf.to_container(values), task)

    @cached_property
    def data(self) -> str | None:
        """The data's identity (the task's ``data_identity``), part of the run's; None when the
        config alone makes the data (or no task is known)."""
        identity = getattr(self.task, "data_identity", None)
        return identity(self.cfg) if identity is not None else None


def settings(node: DictConfig) -> dict:
    """The settings a method's or compressor's config node gives: its keys less ``name`` and
    less those left unset (null), for ``gluon.simulate`` and ``gluon.make_compressor``."""
    return {k: v for k, v in OmegaConf.to_container(node, resolve=True, enum_to_str=True).items()
            if k != "name" and v is not None}


HETEROGENEITY = ("iid", "label_skew")     # how the workers' shards are cut (split); the schema's
                                          # enum (experiments.run.config) is made from it


def check_heterogeneity(cfg) -> None:
    """ValueError unless ``cfg.task.heterogeneity`` is one :func:`split` knows (a task's
    ``check``; the project's schema refuses others when composing, a task of your own may not
    use it)."""
    if str(cfg.task.heterogeneity) not in HETEROGENEITY:
        raise ValueError(f"task.heterogeneity={cfg.task.heterogeneity}: choose one of "
                         f"{', '.join(HETEROGENEITY)}")


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
        raise ValueError(f"unknown heterogeneity {heterogeneity!r}; use one of {HETEROGENEITY}")
    size = n // n_workers
    return [perm[i * size:(i + 1) * size] for i in range(n_workers)]


# ---------------------------------------------------------------- the data, known by content
#
# Finding (and where possible downloading) the datasets, and knowing them by content. File paths
# live here, not in gluon/.
#
# Search order for a data directory: an explicit ``data_dir`` (config key), the environment
# variable ``GLUON_DATA_DIR``, ``./data`` in the checkout, and a shared ``data`` folder beside
# the checkout (``../shared/data``). Files keep their upstream layout below it:
# ``libsvm/a5a`` and ``cifar10-jpeg/{train,test}.tar.gz`` (or ``cifar10-jpeg/{train,test}/``).
# The last two are fall-backs, searched only when neither ``data_dir`` nor ``GLUON_DATA_DIR`` is
# set: a folder the user named is the only place looked (and where a download goes), so data
# missing there is never taken silently from another copy. A ``data_dir`` or ``GLUON_DATA_DIR``
# that names no folder, or a ``GLUON_DATA_DIR`` set to nothing, is an error (nor is a folder
# created anywhere).
#
# A data file is known by its SHA-256 (:func:`sha256`), computed once and remembered under the
# results folder's cache by (path, size, modification time), so a later start costs a ``stat``.
# Where a ``SHA256SUMS`` file sits beside a data file and lists it, the file must match it
# (:func:`verify`). Caches built from data (f*, the decoded CIFAR-10) are keyed by these hashes.

LIBSVM_URL = "https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/binary/{name}"
SUMS = "SHA256SUMS"
_CHUNK = 1 << 20


class DataError(EnvironmentProblem):
    """The data cannot be used: missing, unreadable, or not the expected bytes."""


class DataNotFoundError(DataError, FileNotFoundError):
    pass


class DataCorruptError(DataError, ValueError):
    pass


def candidate_dirs(data_dir: str | os.PathLike | None = None) -> list[Path]:
    """The data directories to search, in order: ``data_dir`` and ``GLUON_DATA_DIR`` when
    either is set (each must be an existing folder), else ``./data`` and ``../shared/data``
    (DataNotFoundError for a named folder that is not one, or GLUON_DATA_DIR set to nothing)."""
    dirs = []
    env = os.environ.get("GLUON_DATA_DIR")
    if env is not None and not env.strip():
        raise DataNotFoundError("GLUON_DATA_DIR is set to nothing\n  set it to the data folder, "
                                "or unset it to search ./data and ../shared/data")
    for given, name in ((data_dir, "data_dir"), (env, "GLUON_DATA_DIR")):
        if not given:
            continue
        d = Path(given).expanduser()
        if not d.is_dir():
            hint = ("unset it to search ./data and ../shared/data" if name == "GLUON_DATA_DIR"
                    else "leave data_dir unset to search GLUON_DATA_DIR, ./data and ../shared/data")
            raise DataNotFoundError(f"{name}={given}: no such folder\n  fix the path, or {hint}")
        dirs.append(d)
    if not dirs:                              # the fall-backs: nothing was named
        dirs = [REPO / "data", REPO.parent / "shared" / "data"]
    seen, out = set(), []
    for d in dirs:
        r = d.resolve()
        if r not in seen:
            seen.add(r)
            out.append(d)
    return out


def find(relpath: str, data_dir=None) -> Path | None:
    for d in candidate_dirs(data_dir):
        if (d / relpath).exists():
            return d / relpath
    return None


def locate_libsvm(name: str = "a5a", data_dir=None) -> tuple[Path | None, list[Path]]:
    """(the file of LIBSVM dataset ``name`` or None, every place looked). Never downloads."""
    rel = f"libsvm/{name}"
    looked = [d / rel for d in candidate_dirs(data_dir)]
    return next((p for p in looked if p.is_file()), None), looked


def libsvm_file(name: str = "a5a", data_dir=None, download: bool = True) -> Path:
    """Path of LIBSVM binary dataset ``name``; downloads it into the first candidate directory
    when it is nowhere and the internet is reachable (nothing is written unless the download
    succeeds); otherwise DataNotFoundError in two lines: where it looked, how to get it."""
    hit, looked = locate_libsvm(name, data_dir)
    if hit is not None:
        return hit
    url = LIBSVM_URL.format(name=name)
    if download:
        target = candidate_dirs(data_dir)[0] / f"libsvm/{name}"
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:  # noqa: S310 (fixed https URL)
                data = resp.read()
            atomic_write(target, lambda fh: fh.write(data))
            return target
        except OSError as err:
            reason = f"download from {url} failed ({err})"
    else:
        reason = "download disabled"
    raise DataNotFoundError(
        f"LIBSVM dataset {name!r} not found (looked in {', '.join(map(str, looked))}; {reason})"
        f"\n  get it from {url} and put it at <dir>/libsvm/{name}, then pass data_dir=<dir> "
        "or set GLUON_DATA_DIR=<dir>")


# ---------------------------------------------------------------- content

def sha256(path: str | Path, cache_dir: str | Path | None = None, remember: bool = True) -> str:
    """SHA-256 of a file's bytes. With ``cache_dir`` it is remembered there by (path, size,
    modification time) and read back while those are unchanged: hashed once per file.
    ``remember=False`` reads a remembered hash but writes none (checks before a run starts
    create nothing)."""
    path = Path(path)
    st = path.stat()
    ident = {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    memo = None
    if cache_dir is not None:
        key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]
        memo = Path(cache_dir) / "sha256" / f"{key}.json"
        try:
            known = json.loads(memo.read_text())
            if {k: known.get(k) for k in ident} == ident:
                return known["sha256"]
        except (OSError, ValueError, KeyError, AttributeError):
            pass
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            h.update(chunk)
    digest = h.hexdigest()
    if memo is not None and remember:
        try:
            atomic_write_text(memo, json.dumps({**ident, "sha256": digest}))
        except OSError:            # only a speed-up: a read-only cache costs a re-hash
            pass
    return digest


def expected_sha256(path: str | Path) -> str | None:
    """The hash ``SHA256SUMS`` beside ``path`` lists for it, or None (no such file or entry)."""
    path = Path(path)
    try:
        lines = (path.parent / SUMS).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    for line in lines:
        parts = line.strip().split(None, 1)
        if len(parts) == 2 and parts[1].lstrip("*") == path.name:
            return parts[0].lower()
    return None


def verify(path: str | Path, cache_dir: str | Path | None = None, fix: str = "",
           remember: bool = True) -> str:
    """The file's SHA-256 (:func:`sha256`), checked against ``SHA256SUMS`` beside it when that
    lists the file; DataCorruptError (two lines: the file, the fix) when it differs."""
    path = Path(path)
    digest = sha256(path, cache_dir, remember)
    want = expected_sha256(path)
    if want is not None and want != digest:
        raise DataCorruptError(
            f"{path}: its SHA-256 {digest[:12]}... differs from {want[:12]}... in "
            f"{path.parent / SUMS}: the file is damaged or another version\n  "
            + (fix or "replace it with the listed file"))
    return digest
