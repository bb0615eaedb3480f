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


@pytest.fixture(scope="session")
def tiny_export(tiny, tmp_path_factory):
    """The tiny pair exported once per test session with `dtrt export` defaults (budget 16, fp32)."""
    from dtrt.exporter.export import export_pair

    return export_pair(tiny, tmp_path_factory.mktemp("export") / "tiny", model="tiny", max_context=512)
