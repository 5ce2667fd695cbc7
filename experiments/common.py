"""Turning a hydra config into gluon objects; shared by every experiment entry point."""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from gluon import make_compressor, resolve_method


def build_compressor(cfg: DictConfig):
    opts = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k != "name"}
    return make_compressor(cfg.name, **opts)


def method_hparams(cfg: DictConfig) -> dict:
    return {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k != "name"}


def validate(cfg: DictConfig):
    """Every check that can fail, before any data is loaded or compute spent."""
    if cfg.n_workers < 1:
        raise ValueError(f"n_workers must be >= 1, got {cfg.n_workers}")
    if cfg.batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {cfg.batch_size}")
    if cfg.steps < 0:
        raise ValueError(f"steps must be >= 0, got {cfg.steps}")
    if (cfg.log_every or 0) < 0 or (cfg.get("log_comm") or 0) < 0:
        raise ValueError("log_every and log_comm must be >= 0")
    if not cfg.log_every and not cfg.get("log_comm"):
        raise ValueError("set log_every (steps) or log_comm (uplink units) > 0: nothing would be logged")
    compressor = build_compressor(cfg.compressor)
    resolve_method(cfg.method.name, compressor, method_hparams(cfg.method))
    return compressor
