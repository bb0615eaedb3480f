import pytest
import torch

from dtrt.models.registry import tiny_pair


@pytest.fixture(scope="session")
def tiny():
    """The tiny pair (target + DFlash + Domino drafters), created once and cached like `dtrt run --model tiny`."""
    return tiny_pair()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
