"""A run's config: its typed schema, its checks, and what decides a run's identity.

* **Schema.** :class:`LogRegConfig` and :class:`CnnConfig` (hydra structured configs, registered
  in hydra's ConfigStore as ``logreg_schema`` / ``cnn_schema`` and named first in the defaults
  of ``configs/logreg.yaml`` / ``configs/cnn.yaml``) type every key, so ``steps=abc`` or
  ``task.heterogeneity=dirichlet`` is refused while the config is composed.
* **Resolved once, validated once.** :func:`checked` resolves a composed config into the
  typed :class:`~experiments.tasks.ResolvedConfig` the run reads from then on, and
  :func:`validate` runs every check that can fail (the schema, the method and its compressor,
  the task's own checks, the process world) before any data is loaded; a failure is a
  :class:`ConfigError` naming the key, the value and what is allowed.
* **Folders.** A run's folder is named by its identity (:mod:`experiments.shared.runs`: the
  resolved config less the operational keys, and the data), through the ``gluon_run_folder``
  resolver of ``configs/hydra/default.yaml``: any spelling of a config lands in one folder.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from gluon import make_compressor, resolve_method
from .world import KINDS, export_torch_env_from_slurm

from ..tasks import HETEROGENEITY, ResolvedConfig, settings
from experiments.shared.runs import folder_name
from experiments.shared.errors import ConfigError


# ---------------------------------------------------------------- the schema

# The enums are strings (StrEnum): a composed config reads as its resolved values do.
Heterogeneity = StrEnum("Heterogeneity", {h: h for h in HETEROGENEITY})  # experiments.tasks.split


class CommKind(StrEnum):
    sim = "sim"                  # all workers simulated in this process
    torchdist = "torchdist"      # one worker per process (torchrun / srun), torch.distributed


class DenseCollective(StrEnum):
    all_reduce = "all_reduce"    # torchdist: sum in the collective's order (last-bit differences)
    all_gather = "all_gather"    # torchdist: gather, then average as the simulation: bit-identical


@dataclass
class MethodConf:
    name: str = MISSING
    lr: Optional[float] = None          # radius eta of the LMO step (parameter units per step)
    beta: Optional[float] = None        # momentum decay
    q: Optional[float] = None           # probability of a full synchronisation per step
    B: Optional[int] = None             # minibatches in a full synchronisation's large batch
    scale_by_B: Optional[bool] = None   # the paper's 1/B trick (Sec. 6.1)
    full: Optional[bool] = None         # VR-MARINA: full gradients at a synchronisation


@dataclass
class CompressorConf:
    name: str = MISSING
    density: Optional[float] = None     # randk / topk: fraction of coordinates sent
    levels: Optional[int] = None        # qsgd: quantisation levels


@dataclass
class WandbConf:
    enabled: bool = False
    project: str = "gluon-fl"
    entity: Optional[str] = None
    mode: str = "offline"               # offline | online | disabled
    group: Optional[str] = None
    tags: List[str] = field(default_factory=list)


@dataclass
class RunConf:
    """Keys shared by every entry point."""
    method: MethodConf = field(default_factory=MethodConf)
    compressor: CompressorConf = field(default_factory=CompressorConf)
    wandb: WandbConf = field(default_factory=WandbConf)
    seed: int = 0
    steps: int = MISSING
    max_comm: Optional[float] = None    # uplink budget per worker (dense gradients); null: none
    max_grads: Optional[float] = None   # compute budget: gradient evaluations per worker (minibatches)
    n_workers: int = MISSING          # configs/workers.yaml (the paper's n)
    batch_size: int = MISSING
    log_every: int = MISSING
    log_comm: Optional[float] = None    # a row at each multiple of this uplink (units per worker)
    log_grads: Optional[float] = None   # a row at each multiple of this compute (gradients per worker)
    data_dir: Optional[str] = None
    results_dir: str = "results"
    overwrite: bool = False
    threads: int = 1                    # CPU threads of torch and of numpy's BLAS (f*)
    group: Optional[str] = None
    checkpoint_every: int = MISSING     # steps between checkpoints (each entry point's yaml)
    keep_checkpoint: bool = False       # a finished run keeps its final state (extend_from reads it)
    extend_from: Optional[str] = None   # a folder of finished runs (a sweep's): start from the one
                                        # that is this run on a smaller budget (resume.extension)
    comm: CommKind = CommKind.sim       # sim | torchdist (one worker per process)
    dense_collective: DenseCollective = DenseCollective.all_reduce
    progress_s: float = 10.0            # seconds of wall time between progress lines (0: none)


@dataclass
class TaskConf:
    """The keys every task has: its registered name (experiments.tasks.TASKS) and how its
    data is shared among the workers (experiments.tasks.split)."""
    name: str = MISSING
    heterogeneity: Heterogeneity = MISSING
    split_seed: int = MISSING


@dataclass
class LogRegTask(TaskConf):
    """The logreg task's keys (its dataset: a5a or a9a), typed; their values live in
    configs/task/logreg.yaml alone."""
    dataset: str = MISSING
    l2: float = MISSING


@dataclass
class LogRegConfig(RunConf):
    task: LogRegTask = field(default_factory=LogRegTask)


@dataclass
class CifarTask(TaskConf):
    """The cnn task's keys (airbench94 on CIFAR-10), typed; their values live in
    configs/task/cnn.yaml alone."""
    source: str = MISSING
    download: bool = MISSING
    widths: List[int] = MISSING
    whiten_images: int = MISSING
    whiten_eps: float = MISSING
    whiten_bias_trainable: bool = MISSING
    bn_weight_trainable: bool = MISSING
    label_smoothing: float = MISSING
    flip: bool = MISSING
    translate: int = MISSING
    lmo_default: str = MISSING
    ns_steps: int = MISSING
    head_scale: float = MISSING
    lmo_rules: List[Any] = MISSING
    eval_train: int = MISSING
    eval_test: Optional[int] = MISSING
    channels_last: bool = MISSING
    amp: bool = MISSING
    amp_cpu: bool = MISSING
    max_chunk: int = MISSING


@dataclass
class CnnConfig(RunConf):
    task: CifarTask = field(default_factory=CifarTask)
    eval_every: int = MISSING          # configs/cnn.yaml
    device: str = MISSING              # configs/cnn.yaml


@dataclass
class LmTask:
    """The lm task's keys (a character-level GPT on Tiny Shakespeare), typed; their values live
    in configs/task/lm.yaml and the profiles configs/profile/lm/. Its workers' data is
    ``split`` (iid | plays), not experiments.tasks.split."""
    name: str = MISSING
    split: str = MISSING
    split_seed: int = MISSING
    download: bool = MISSING
    n_layer: int = MISSING
    n_head: int = MISSING
    n_embd: int = MISSING
    block_size: int = MISSING
    bias: bool = MISSING
    dropout: float = MISSING
    embed_scale: float = MISSING
    ns_steps: int = MISSING
    lmo_rules: List[Any] = MISSING
    eval_train: int = MISSING
    eval_val: int = MISSING
    max_chunk: int = MISSING
    amp: bool = MISSING


@dataclass
class LmConfig(RunConf):
    task: LmTask = field(default_factory=LmTask)
    device: str = MISSING              # configs/lm.yaml


SCHEMAS = {"logreg": LogRegConfig, "cnn": CnnConfig, "lm": LmConfig}     # by task.name


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="logreg_schema", node=LogRegConfig)
    cs.store(name="cnn_schema", node=CnnConfig)
    cs.store(name="lm_schema", node=LmConfig)


register()


def compose(primary: str = "logreg", *overrides: str, hydra: bool = False,
            config_dir: str | Path | None = None) -> DictConfig:
    """The config ``python -m experiments.<primary> <overrides>`` would run, composed without
    running anything (with the ``hydra`` node, its folders included, when ``hydra`` is set).
    The one way the project composes a config outside hydra's own entry point: the command
    line's checks, the sbatch preview, the benchmarks and the tests. ``config_dir``: the folder
    of the primary config when it is not the project's ``configs/`` (an entry point of your
    own; the project's groups stay on the search path, ``hydra_plugins.gluon_sweeper``)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    from experiments.shared.files import REPO
    folder = Path(config_dir) if config_dir is not None else REPO / "configs"
    with initialize_config_dir(config_dir=str(folder.resolve()), version_base="1.3",
                               job_name=primary):
        return hydra_compose(primary, overrides=list(overrides), return_hydra_config=hydra)


# ---------------------------------------------------------------- run folder names

def run_folder(*, _root_) -> str:
    """The ``gluon_run_folder`` resolver: the folder name (:func:`experiments.shared.runs.
    folder_name`) of the run the whole config (``_root_``) describes, its data included."""
    from ..tasks import task_module
    run = ResolvedConfig.of(_root_, task_module(str(_root_.task.name)))
    return folder_name(run.config, run.data)


def method_default(key: str, *, _parent_) -> Any:
    """The ``gluon_default`` resolver: the default of ``key`` in the METHODS registry's record
    of the method the node names (``configs/method/*.yaml``: ``scale_by_B:
    ${gluon_default:scale_by_B}``), so that a per-method default has one home, the registry."""
    from gluon.methods import method_spec
    return method_spec(str(_parent_.name)).defaults.get(key)


def lmo_default(key: str) -> Any:
    """The ``gluon_lmo_default`` resolver: the library's default of an LMO setting
    (:data:`gluon.lmo.LMO_DEFAULTS`: ``ns_steps``, ``head_scale``), so that it has one home."""
    from gluon.lmo import LMO_DEFAULTS
    return LMO_DEFAULTS[key]


def visible_gpus() -> int:
    """The ``gluon_visible_gpus`` resolver: the GPUs this process sees. submitit's local executor
    sets each job's CUDA_VISIBLE_DEVICES to its first ``gpus_per_node`` GPUs (none: no GPU at
    all), so launcher=local gives its jobs the GPUs of the machine it runs on, every job sharing
    them. It gives them GPUs 0..n-1 of the machine whatever CUDA_VISIBLE_DEVICES says here, so
    a selection of other GPUs is not honoured: said once, not refused (launcher=basic honours it)."""
    import torch
    n = torch.cuda.device_count()
    chosen = os.environ.get("CUDA_VISIBLE_DEVICES")
    if n and chosen is not None and chosen.replace(" ", "") != ",".join(map(str, range(n))):
        warnings.warn(f"launcher=local: its jobs get GPUs {','.join(map(str, range(n)))} of the "
                      f"machine, not CUDA_VISIBLE_DEVICES={chosen} (submitit sets it per job); "
                      "launcher=basic honours it", stacklevel=2)
    return n


def tasks_per_node(comm, n_workers) -> int:
    """SLURM tasks of a run: one per worker with ``comm=torchdist``, else one."""
    return int(n_workers) if str(getattr(comm, "value", comm)) == "torchdist" else 1


if not OmegaConf.has_resolver("gluon_run_folder"):
    OmegaConf.register_new_resolver("gluon_run_folder", run_folder)
    OmegaConf.register_new_resolver("gluon_tasks_per_node", tasks_per_node)
    OmegaConf.register_new_resolver("gluon_default", method_default)
    OmegaConf.register_new_resolver("gluon_lmo_default", lmo_default)
    OmegaConf.register_new_resolver("gluon_visible_gpus", visible_gpus)
    # a sweep's folder: results/sweeps/<group>, or results/sweeps/adhoc without a group
    OmegaConf.register_new_resolver("gluon_sweep_name", lambda group: group or "adhoc")


# ---------------------------------------------------------------- building and checking


def build_compressor(cfg: DictConfig):
    return make_compressor(cfg.name, **settings(cfg))


def _check(ok: bool, key: str, value, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value}: {allowed}")


def _known_keys(cfg: DictConfig, prefix: str = "") -> None:
    """ConfigError for a key the typed schema does not have: hydra adds any ``+key=value``
    (its own error for ``stpes=500`` suggests ``+stpes=500``), which would then be ignored."""
    import difflib
    from dataclasses import fields, is_dataclass
    schema = OmegaConf.get_type(cfg)
    if not is_dataclass(schema):
        return
    known = {f.name for f in fields(schema)}
    for key in cfg.keys():
        if key == "hydra" and not prefix:
            continue
        name = f"{prefix}{key}"
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            raise ConfigError(f"+{name}: no such key" + (f" (did you mean {prefix}{close[0]}?)"
                                                          if close else "")
                              + "; --help lists the keys")
        node = cfg._get_node(key)
        if isinstance(node, DictConfig):
            _known_keys(node, f"{name}.")


def checked(cfg: DictConfig | ResolvedConfig, task=None,
            check_world: bool = True) -> ResolvedConfig:
    """``cfg`` resolved once and validated once (:func:`validate`): the config a run reads from
    then on. One checked already comes back as it is."""
    run = ResolvedConfig.of(cfg, task)
    if run.validated:
        return run
    validate(run, check_world=check_world)
    return replace(run, validated=True)


def validate(cfg: DictConfig | ResolvedConfig, task=None, check_world: bool = True):
    """Every check that can fail, before any data is loaded or compute spent: the run's keys,
    the method with its compressor, the task's own ``check(cfg)`` and, for ``comm=torchdist``,
    the processes started (``check_world``; a launcher that will start them, SLURM with one
    task per worker, checks them in the job). ``cfg``: composed, or resolved already. Returns
    the compressor. Raises :class:`ConfigError`."""
    _known_keys(cfg.composed if isinstance(cfg, ResolvedConfig) else cfg)
    run = ResolvedConfig.of(cfg, task)
    task, cfg = run.task, run.cfg
    _check(cfg.n_workers >= 1, "n_workers", cfg.n_workers, "must be >= 1")
    _check(cfg.batch_size >= 1, "batch_size", cfg.batch_size, "must be >= 1")
    _check(cfg.steps >= 0, "steps", cfg.steps, "must be >= 0")
    _check((cfg.log_every or 0) >= 0, "log_every", cfg.log_every, "must be >= 0")
    _check((cfg.get("log_comm") or 0) >= 0, "log_comm", cfg.get("log_comm"), "must be >= 0")
    _check((cfg.get("log_grads") or 0) >= 0, "log_grads", cfg.get("log_grads"), "must be >= 0")
    _check(bool(cfg.log_every or cfg.get("log_comm") or cfg.get("log_grads")), "log_every",
           cfg.log_every, "set log_every (steps), log_comm (uplink units) or log_grads "
           "(gradient evaluations) > 0: nothing would be logged")
    _check(cfg.get("max_comm") is None or cfg.max_comm > 0, "max_comm", cfg.get("max_comm"),
           "must be > 0 (uplink units per worker) or null")
    _check(cfg.get("max_grads") is None or cfg.max_grads > 0, "max_grads", cfg.get("max_grads"),
           "must be > 0 (gradient evaluations per worker, in minibatches) or null")
    _check(cfg.threads >= 1, "threads", cfg.threads, "must be >= 1")
    try:
        compressor = build_compressor(cfg.compressor)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"compressor={cfg.compressor.name}: {err}") from None
    try:
        resolve_method(cfg.method.name, compressor, settings(cfg.method))
    except ValueError as err:
        raise ConfigError(f"method={cfg.method.name}: {err}") from None
    if task is not None:
        try:
            task.check(cfg)
        except ConfigError:
            raise
        except ValueError as err:
            raise ConfigError(str(err)) from None
    problem = check_env(str(cfg.get("comm", "sim")), cfg.n_workers) if check_world else None
    if problem:
        raise ConfigError(problem)
    return compressor


def check_env(kind: str, n_workers: int, environ=os.environ) -> str | None:
    """Why ``comm=kind`` cannot run with ``n_workers`` workers here (None when it can); checked
    before any process group or data."""
    if kind not in KINDS:
        return f"comm={kind}: choose one of {', '.join(KINDS)}"
    if kind == "sim":
        return None
    if not export_torch_env_from_slurm(environ):
        return ("comm=torchdist needs one process per worker: start it with "
                "`torchrun --nproc-per-node N -m experiments.<task> comm=torchdist ...` or srun")
    size = int(environ["WORLD_SIZE"])
    if size != n_workers:
        return f"n_workers={n_workers} but {size} processes were started (one per worker)"
    return None
