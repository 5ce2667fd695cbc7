"""What every test module shares: composing an entry point's hydra config without running it."""
from __future__ import annotations

from pathlib import Path

import pytest

from experiments.run.config import compose as compose_config  # noqa: F401 (the helper)

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


@pytest.fixture
def compose_cfg():
    return compose_config
