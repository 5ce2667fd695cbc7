"""Benchmarks and measurements: step times, the optimiser's overhead, the GPU acceptance check,
the shaped network. Each writes its report under results/bench or results/cost."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cnn_widths(profile: str) -> list[int]:
    """The CNN's channel widths where the configs set them: ``paper`` (configs/task/cnn.yaml)
    or ``cpu`` (configs/profile/cpu.yaml)."""
    from omegaconf import OmegaConf
    path = {"paper": "task/cnn.yaml", "cpu": "profile/cpu.yaml"}[profile]
    cfg = OmegaConf.load(REPO / "configs" / path)
    return list(cfg.widths if profile == "paper" else cfg.task.widths)
