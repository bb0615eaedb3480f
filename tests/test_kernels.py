"""The torch backend's kernel path: which implementation an op call runs (dtrt.ops.kernels), the Triton kernels
inside the decode loop giving exactly the AR tokens with drafts accepted (on the CPU in Triton's interpreter,
on a CUDA GPU with `--device cuda`), and the --device defaults (its errors: test_bad_input.py)."""

import importlib.util
import os

import pytest
import torch
from helpers import run_cli

import dtrt.ops.kernels as kernels
from dtrt.errors import DtrtError
from dtrt.models.registry import tiny_hybrid_pair
from dtrt.runtime.methods import METHODS, DraftConfig
from dtrt.runtime.pipeline import build_pipeline, check_device, default_builder, source_defaults
from dtrt.runtime.sampling import SamplingConfig

HAVE_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()
interpreted = pytest.mark.skipif(
    not HAVE_TRITON or CUDA or os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the kernels in Triton's CPU interpreter: needs Triton, no CUDA GPU",
)
PROMPT = list(range(5, 25))
TREE_OPS = {"tree_attention", "topm_corrected_score", "ledger_select"}
HYBRID_OPS = TREE_OPS | {"tree_gated_delta_net", "tree_causal_conv1d"}


@pytest.fixture(scope="module")
def hybrid():
    return tiny_hybrid_pair()


@pytest.fixture
def launched(monkeypatch):
    """The ops whose kernels ran (dtrt.ops.kernels hands out launchers through _launcher)."""
    ops, real = set(), kernels._launcher

    def spy(op):
        ops.add(op)
        return real(op)

    monkeypatch.setattr(kernels, "_launcher", spy)
    return ops


def test_dispatch_rules(monkeypatch):
    x, w = torch.ones(2), torch.ones(2, requires_grad=True)
    assert kernels.mode() == "auto" and kernels.kernel("tree_attention", x) is None  # CPU tensors: the reference
    monkeypatch.setenv("DTRT_KERNELS", "ref")
    assert kernels.kernel("tree_attention", x) is None
    monkeypatch.setenv("DTRT_KERNELS", "kernel")
    with pytest.raises(DtrtError, match=r"DTRT_KERNELS='kernel': use one of auto, ref, triton"):
        kernels.kernel("tree_attention", x)
    monkeypatch.setenv("DTRT_KERNELS", "triton")
    assert kernels.kernel("tree_attention", x, w * 2) is None  # a gradient to carry: the kernels have no backward
    with torch.no_grad():
        monkeypatch.setattr(kernels, "_triton_why", lambda: 'Triton is not installed (pip install "dtrt[gpu]")')
        with pytest.raises(DtrtError, match=r"^DTRT_KERNELS=triton: Triton is not installed"):
            kernels.kernel("tree_attention", x, w * 2)


def _tokens(pair, monkeypatch, mode: str, method: str, builder: str = "heap", n: int = 16):
    monkeypatch.setenv("DTRT_KERNELS", mode)
    pipe = build_pipeline(pair, DraftConfig(method, budget=4, builder=builder))
    g = pipe.generate(PROMPT, n, SamplingConfig())
    return g.tokens, g.tau


@interpreted
@pytest.mark.kernels
@pytest.mark.parametrize("name", ["tiny", "tiny-hybrid"])
def test_kernels_in_the_decode_loop_give_the_ar_tokens(name, tiny, hybrid, launched, monkeypatch):
    pair = tiny if name == "tiny" else hybrid
    want, _ = _tokens(pair, monkeypatch, "ref", "ar")
    assert not launched
    for method, builder in (("ar", "heap"), ("dominotree", "frontier")):
        got, tau = _tokens(pair, monkeypatch, "triton", method, builder)
        assert got == want, (method, builder)
        assert method == "ar" or tau > 1.5, "drafts must be accepted"
    assert launched == (HYBRID_OPS if name == "tiny-hybrid" else TREE_OPS)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny", "tiny-hybrid"])
def test_cuda_device_gives_the_cpu_ar_tokens(name, tiny, hybrid, launched, monkeypatch):
    pair = tiny if name == "tiny" else hybrid
    want = build_pipeline(pair, DraftConfig("ar")).generate(PROMPT, 32, SamplingConfig()).tokens
    for method in METHODS:
        draft = DraftConfig(method, budget=8, builder=default_builder(method, "cuda"))
        pipe = build_pipeline(pair, draft, device="cuda")
        g = pipe.generate(PROMPT, 32, SamplingConfig())
        assert g.tokens == want, method
        assert method in ("ar", "caddtree", "cadominotree") or g.tau > 1.5, method
        assert (
            pipe.generate(PROMPT, 8, SamplingConfig(temperature=1.0, seed=3)).tokens
            == pipe.generate(PROMPT, 8, SamplingConfig(temperature=1.0, seed=3)).tokens
        ), "seeded sampling repeats"
    assert launched == (HYBRID_OPS if name == "tiny-hybrid" else TREE_OPS)


def test_device_flag():
    assert check_device(None, "onnxruntime") == torch.device("cpu") == check_device("cpu", "torch")
    with pytest.raises(
        DtrtError,
        match=r"^--device cuda: only the torch backend takes a device \(--backend "
        r"tensorrt runs its engines on the GPU by itself\)$",
    ):
        check_device("cuda", "tensorrt")
    assert source_defaults(None, None, None, None, None, "cuda") == ("smollm2-135m", "torch")
    assert source_defaults(None, None, None, None, None, "cpu")[1] == "onnxruntime"
    assert default_builder("dominotree", "cuda:1") == default_builder("dominotree", None, cuda_graph=True) == "frontier"
    assert default_builder("dominotree", None) == default_builder("cadominotree", "cuda") == "heap"


def test_cpu_device_flag_runs(tiny, monkeypatch, capsys):
    code, out, _ = run_cli(
        monkeypatch, capsys, "run", "--model", "tiny", "--device", "cpu", "--max-new-tokens", "8", "--json", "hello"
    )
    assert code == 0 and '"tokens"' in out
