import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))  # scripts/ hold importable helpers (evaluate, ...)


@pytest.fixture
def rng():
    """A seeded generator, so each test's random data is reproducible on its own."""
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def repo_root() -> Path:
    return REPO
