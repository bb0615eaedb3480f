"""ONNX Runtime on a GPU: the execution providers of a CUDA device (and the one-line errors without them), the IO
binding plan, IO binding run on the CPU giving token for token what plain `run` gives, a stage failing inside ONNX
Runtime as a BackendFault naming it, and (`gpu`-marked) every method on the CUDA provider giving the torch AR
tokens."""

import importlib.metadata

import numpy as np
import onnxruntime as ort
import pytest
import torch
from helpers import generate_all, pipe_for, spec

from dtrt.errors import BackendFault, DtrtError
from dtrt.runtime.backends import onnxruntime as ort_backend
from dtrt.runtime.backends.onnxruntime import GPU_INSTALL, OrtBackend, binding_plan, providers_for
from dtrt.tree import CostCurve

# providers


def test_cpu_providers():
    assert providers_for(torch.device("cpu"), ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    assert providers_for(torch.device("cpu"), ["CUDAExecutionProvider", "CPUExecutionProvider"], 1234) == [
        "CPUExecutionProvider"
    ]


def test_cuda_providers_on_the_device_and_stream():
    available = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    cuda = torch.device("cuda:1")
    assert providers_for(cuda, available, 1234) == [
        ("CUDAExecutionProvider", {"device_id": "1", "has_user_compute_stream": "1", "user_compute_stream": "1234"}),
        "CPUExecutionProvider",
    ]
    assert providers_for(cuda, available) == [("CUDAExecutionProvider", {"device_id": "1"}), "CPUExecutionProvider"]
    assert providers_for(torch.device("cuda"), available)[0] == ("CUDAExecutionProvider", {"device_id": "0"})


def test_missing_cuda_provider_names_the_install(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with pytest.raises(DtrtError) as e:
        providers_for(torch.device("cuda:1"), ["CPUExecutionProvider"], 1234)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--device cuda:1: ")
    assert GPU_INSTALL in msg and "pip uninstall -y onnxruntime && pip install onnxruntime-gpu" in msg
    assert f"onnxruntime {ort.__version__} has no CUDA provider" in msg and "CPUExecutionProvider" in msg


def test_gpu_package_without_its_provider_names_the_libraries(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.99.0")
    with pytest.raises(DtrtError) as e:
        providers_for(torch.device("cuda"), ["CPUExecutionProvider"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--device cuda: ")
    assert "onnxruntime-gpu 1.99.0 is installed" in msg and "CUDA and cuDNN libraries" in msg
    assert GPU_INSTALL not in msg


# the binding plan


def test_binding_plan():
    feeds = {
        "logits": torch.randn(2, 3),
        "half": torch.randn(4, dtype=torch.float16),
        "ids": torch.arange(5),
        "mask": torch.ones(2, 2, dtype=torch.bool).tril(),
        "bf16": torch.zeros(3, dtype=torch.bfloat16),
        "scalar": torch.tensor(7),
    }
    plan = binding_plan(feeds)
    assert [p[0] for p in plan] == list(feeds)
    assert all(p[1:3] == ("cpu", 0) for p in plan)
    assert [p[3] for p in plan] == [np.float32, np.float16, np.int64, np.bool_, 16, np.int64]
    assert [p[4] for p in plan] == [(2, 3), (4,), (5,), (2, 2), (3,), ()]
    assert [p[5] for p in plan] == [t.data_ptr() for t in feeds.values()]


def test_binding_plan_gives_zero_size_inputs_an_address():
    """torch reports address 0 for any empty tensor, also a zero-length view into a buffer (the past before the
    prefill): such an input is bound at a valid address."""
    past = torch.zeros(2, 2, 64, 24)[:, :, :0]
    empty = torch.empty(0, dtype=torch.long)
    assert past.data_ptr() == 0 and empty.data_ptr() == 0
    plan = binding_plan({"past_k": past, "ids": empty})
    assert [p[4] for p in plan] == [(2, 2, 0, 24), (0,)]
    assert all(p[5] != 0 for p in plan)


def test_binding_plan_refuses_what_it_cannot_bind():
    with pytest.raises(ValueError, match="input past_k: IO binding needs a contiguous tensor"):
        binding_plan({"ids": torch.arange(3), "past_k": torch.ones(3, 4).t()})
    with pytest.raises(ValueError, match="input x: IO binding takes no torch.complex64"):
        binding_plan({"x": torch.ones(2, dtype=torch.complex64)})


# IO binding on the CPU: the same tokens as plain run

BINDING_VARIANTS = [spec("ar"), spec("ddtree"), spec("dominotree"), spec("dominotree", builder="frontier")]


def binding_pipeline(exp, run, monkeypatch):
    """The pipeline open_pipeline makes for `run` on ONNX Runtime, its backend running every stage through IO
    binding; plain InferenceSession.run is made to fail."""

    class Bound(ort_backend.OrtBackend):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw, binding=True)

    monkeypatch.setattr(ort_backend, "OrtBackend", Bound)
    pipe = pipe_for(None, run, backend="onnxruntime", export=exp.path, threads=1)
    assert pipe.backend.runner.binding and pipe.backend.name == "onnxruntime"

    def plain_run(*args, **kw):
        raise AssertionError("plain InferenceSession.run under IO binding")

    monkeypatch.setattr(ort.InferenceSession, "run", plain_run)
    return pipe


def test_backend_binds_by_default_on_cuda_only(tiny_export):
    assert not OrtBackend(tiny_export, None, threads=1).runner.binding
    assert OrtBackend(tiny_export, None, threads=1, binding=True).runner.binding


@pytest.mark.parametrize("run", BINDING_VARIANTS, ids=lambda r: f"{r.method}-{r.builder}")
def test_io_binding_gives_the_tokens_of_plain_run(tiny_export, torch_tokens, run, monkeypatch):
    plain = generate_all(pipe_for(None, run, backend="onnxruntime", export=tiny_export.path, threads=1))
    calls = []
    real = ort.InferenceSession.run_with_iobinding
    monkeypatch.setattr(
        ort.InferenceSession, "run_with_iobinding", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw)
    )
    bound = generate_all(binding_pipeline(tiny_export, run, monkeypatch))
    assert calls
    assert [g.tokens for g in bound] == [g.tokens for g in plain] == torch_tokens
    assert [[r.accepted for r in g.rounds] for g in bound] == [[r.accepted for r in g.rounds] for g in plain]
    rounds = [r for g in bound for r in g.rounds]
    if run.method != "ar":
        assert sum(r.accepted for r in rounds) / len(rounds) > 2


def test_io_binding_stage_outputs_equal_plain_run(tiny_export):
    """The prefill (a zero-length past) and a step after it: the same outputs, dtypes and shapes either way, and
    the bound outputs stay valid after the stage runs again."""
    plain = OrtBackend(tiny_export, "domino", threads=1)
    bound = OrtBackend(tiny_export, "domino", threads=1, binding=True)
    n = 7
    ids, mask = torch.tensor([5, 9, 3, 12, 40, 2, 8]), torch.ones(n, n, dtype=torch.bool).tril()
    outs = {}
    for name, b in (("plain", plain), ("bound", bound)):
        b.reset(32)
        first = b.runner("target", ids=ids, positions=torch.arange(n), mask=mask, **b.cache.feeds())
        kept = {k: v.clone() for k, v in first.items()}
        b.target_forward(ids, torch.arange(n), mask)
        b.commit(torch.arange(n))
        second = b.runner("target", ids=ids[:2], positions=n + torch.arange(2), mask=mask[:2, :2], **b.cache.feeds())
        assert all(torch.equal(first[k], kept[k]) for k in first)  # not overwritten by the later calls
        outs[name] = (first, second)
    for a, b in zip(outs["plain"], outs["bound"]):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].device.type == "cpu", k
            assert torch.equal(a[k], b[k]), k


# a stage failing inside ONNX Runtime


def ort_failure(*args, **kw):
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail

    raise Fail("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running MatMul node\nmore")


@pytest.mark.parametrize("binding", [False, True], ids=["run", "iobinding"])
def test_stage_failure_is_a_backend_fault_naming_the_stage(tiny_export, binding, monkeypatch):
    backend = OrtBackend(tiny_export, "dflash", threads=1, binding=binding)
    backend.reset(32)
    block = backend.runner.sessions["dflash.block"]
    monkeypatch.setattr(block, "run_with_iobinding" if binding else "run", ort_failure)
    ids, mask = torch.tensor([5, 9, 3]), torch.ones(3, 3, dtype=torch.bool).tril()
    _, hidden = backend.target_forward(ids, torch.arange(3), mask)  # the other stages still run
    backend.commit(torch.arange(3))
    backend.draft_context(hidden, torch.arange(3))
    with pytest.raises(BackendFault) as e:
        backend.draft_block(9, 3, rows=2)
    msg = str(e.value)
    assert msg.startswith("stage dflash.block: onnxruntime failed to run it (Fail: ") and "\n" not in msg
    assert "MatMul" in msg and isinstance(e.value.__cause__, Exception)


def test_stage_failure_ends_a_generation_as_a_backend_fault(tiny_export, monkeypatch):
    pipe = pipe_for(None, spec("ddtree"), backend="onnxruntime", export=tiny_export.path, threads=1)
    monkeypatch.setattr(pipe.backend.runner.sessions["target"], "run", ort_failure)
    with pytest.raises(BackendFault, match=r"^stage target: onnxruntime failed to run it \(Fail: "):
        generate_all(pipe, max_new=8)


def test_bad_bound_input_is_a_backend_fault(tiny_export):
    """ONNX Runtime's own refusal of a bound input (a mask of the wrong rank) is a BackendFault too."""
    backend = OrtBackend(tiny_export, None, threads=1, binding=True)
    backend.reset(32)
    with pytest.raises(BackendFault, match=r"^stage target: onnxruntime failed to run it \(") as e:
        backend.target_forward(torch.tensor([5, 9]), torch.arange(2), torch.ones(2, dtype=torch.bool))
    assert "\n" not in str(e.value)


# on a GPU: the CUDA provider through IO binding

GPU_VARIANTS = [
    spec("ar"),
    spec("dflash"),
    spec("domino"),
    spec("ddtree"),
    spec("caddtree", budget=32),
    spec("dominotree"),
    spec("dominotree", builder="frontier"),
    spec("dominotree", arm="marg"),
    spec("cadominotree", budget=32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("run", GPU_VARIANTS, ids=lambda r: f"{r.method}-{r.builder}-{r.arm}")
def test_cuda_provider_gives_the_torch_ar_tokens(tiny_export, torch_tokens, run):
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip(f"onnxruntime {ort.__version__} has no CUDA provider ({GPU_INSTALL})")
    pipe = pipe_for(None, run, backend="onnxruntime", export=tiny_export.path, device="cuda")
    runner = pipe.backend.runner
    assert runner.binding and runner.device.type == "cuda"
    assert runner.providers[0][0] == "CUDAExecutionProvider"
    assert all(s.get_providers()[0] == "CUDAExecutionProvider" for s in runner.sessions.values())
    if run.method in ("caddtree", "cadominotree"):  # drafts that pay, whatever the measured curve says
        pipe.method.curve = CostCurve.fit({0: [(0, 1.0), (32, 2.0)]}, draft_cost=0.5)
    gens = generate_all(pipe)
    assert [g.tokens for g in gens] == torch_tokens
    rounds = [r for g in gens for r in g.rounds]
    if run.method != "ar":
        assert sum(r.accepted for r in rounds) / len(rounds) > 2
    pipe.backend.reset(32)
    logits, hidden = pipe.backend.target_forward(torch.tensor([5, 9]), torch.arange(2), torch.ones(2, 2).tril().bool())
    assert logits.device.type == "cuda" and hidden.device.type == "cuda"
    assert pipe.backend.cache.k.device.type == "cuda"
