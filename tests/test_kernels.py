"""The torch backend's kernel path: which implementation an op call runs (dtrt.ops.kernels), the Triton kernels
inside the decode loop giving exactly the AR tokens with drafts accepted (on the CPU in Triton's interpreter,
on a CUDA GPU with `--device cuda`), and the --device defaults (its errors: test_bad_input.py)."""

import importlib.util
import os

import pytest
import torch
from helpers import pipe_for, run_cli, spec

import dtrt.ops.kernels as kernels
from dtrt.errors import DtrtError
from dtrt.launch import resolve_spec
from dtrt.launch.start import default_backend, default_builder
from dtrt.runtime.sampling import SamplingConfig
from dtrt.runtime.spec import METHODS
from dtrt.zoo.registry import tiny_hybrid_pair
from dtrt.zoo.tiny import encode

HAVE_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()
interpreted = pytest.mark.skipif(
    not HAVE_TRITON or CUDA or os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the kernels in Triton's CPU interpreter: needs Triton, no CUDA GPU",
)
# text like the tiny pairs' training data, so drafts get accepted however the seeded training came out on this CPU
PROMPT = encode("Some old man reads ")
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
    pipe = pipe_for(pair, spec(method, budget=4, builder=builder))
    g = pipe.generate(PROMPT, n, SamplingConfig())
    return g.tokens, g.tau


@pytest.mark.slow
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
    want = pipe_for(pair, spec("ar")).generate(PROMPT, 32, SamplingConfig()).tokens
    for method in METHODS:
        draft = spec(method, budget=8, builder=default_builder(method, "cuda"))
        pipe = pipe_for(pair, draft, device="cuda")
        g = pipe.generate(PROMPT, 32, SamplingConfig())
        assert g.tokens == want, method
        assert method in ("ar", "lookup", "caddtree", "cadominotree") or g.tau > 1.5, method
        assert (
            pipe.generate(PROMPT, 8, SamplingConfig(temperature=1.0, seed=3)).tokens
            == pipe.generate(PROMPT, 8, SamplingConfig(temperature=1.0, seed=3)).tokens
        ), "seeded sampling repeats"
    assert launched == (HYBRID_OPS if name == "tiny-hybrid" else TREE_OPS)


def test_device_flag():
    assert resolve_spec(backend="onnxruntime").device == "cpu" == resolve_spec(device="cpu", model="tiny").device
    with pytest.raises(
        DtrtError,
        match=r"^--device cuda: only the torch and onnxruntime backends take a device \(--backend "
        r"tensorrt runs its engines on the GPU by itself\)$",
    ):
        spec(device="cuda", backend="tensorrt")
    assert default_backend(False, None, "cuda") == "torch" and resolve_spec().model == "smollm2-135m"
    assert default_backend(False, None, "cpu") == "onnxruntime"
    assert (
        default_builder("dominotree", "cuda:1") == default_builder("dominotree", "cpu", cuda_graph=True) == "frontier"
    )
    assert default_builder("dominotree", "cpu") == default_builder("cadominotree", "cuda") == "heap"


def test_cpu_device_flag_runs(tiny, monkeypatch, capsys):
    code, out, _ = run_cli(
        monkeypatch, capsys, "run", "--model", "tiny", "--device", "cpu", "--max-new-tokens", "8", "--json", "hello"
    )
    assert code == 0 and '"tokens"' in out
