import os
from contextlib import contextmanager

import pytest
import torch

# Without a CUDA GPU the Triton kernels run in Triton's CPU interpreter. It is chosen when a kernel is defined,
# so before any test imports dtrt.plugins.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dtrt.zoo.registry import tiny_hybrid_pair, tiny_pair  # noqa: E402

# Under pytest-xdist (`-n`), each worker process gets its share of the cores for torch's intra-op threads: workers
# with every core each would crowd each other out.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))
    # ONNX Runtime sessions opened without a thread count would take every core too: the same share as torch's
    from dtrt.runtime.backends import onnxruntime as _ort_backend

    _make_session = _ort_backend.make_session

    def _session_on_the_workers_share(path, threads=None, *args, **kwargs):
        return _make_session(path, threads or max(1, (os.cpu_count() or 1) // _WORKERS), *args, **kwargs)

    _ort_backend.make_session = _session_on_the_workers_share


def pytest_configure(config):
    """With workers (`-n`), the cached tiny pairs are made once here, before the workers start, rather than by
    every worker at once."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        tiny_pair()
        tiny_hybrid_pair()


@pytest.fixture(scope="session")
def tiny():
    """The tiny pair (target + DFlash + Domino drafters), created once and cached like `dtrt run --model tiny`."""
    return tiny_pair()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _threads_kept():
    """torch's intra-op threads as they were before the test: a pipeline opened with --threads sets them for the
    process, and a worker's later tests on more threads than its share of the cores crawl on a busy machine."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _rounds_without_a_chain_draft():
    """DominoTree with lookup verifies the root alone where drafting has not been paying by the clock
    (ChainOrDraft.root_alone). On the tests' tiny pairs a verify costs next to nothing, so that would depend on the
    machine's timing; rounds with no chain draft here, as the tests of drafting expect. The rule's own tests
    (test_lookup_tree.py) turn it on. Set outside monkeypatch, which a test may undo halfway."""
    from dtrt.tree.lookup_source import ChainOrDraft

    ChainOrDraft.root_alone = False
    yield
    ChainOrDraft.root_alone = True


@pytest.fixture(autouse=True)
def cost_store(tmp_path, monkeypatch):
    """Where this test's cost-aware methods keep their measured cost curves: its own, so none is read from
    another test or an earlier run."""
    from dtrt.runtime import calibrate

    monkeypatch.setattr(calibrate, "store_root", lambda: tmp_path / "cost")
    return tmp_path / "cost"


@contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to `n` inside the block, restored after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests (`pytestmark = pytest.mark.usefixtures("one_thread")`): the tiny model
    runs fastest on one, and several threads crawl on a busy machine."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def torch_tokens(tiny):
    """The torch backend's AR tokens for helpers.PROMPTS on the tiny pair: what every method must give."""
    from helpers import generate_all, pipe_for, spec

    with torch_threads(1):
        return [g.tokens for g in generate_all(pipe_for(tiny, spec("ar")))]


@pytest.fixture(scope="module")
def pipe(tiny):
    """DominoTree on the tiny pair (torch backend)."""
    from helpers import pipe_for, spec

    return pipe_for(tiny, spec("dominotree"))


@pytest.fixture(scope="module")
def server(tiny):
    """`dtrt serve` of a pipeline like `pipe` in this process (needs aiohttp): its own, since its worker fills the
    prefix cache between requests while a test may be generating on `pipe`."""
    pytest.importorskip("aiohttp")
    from helpers import pipe_for, spec

    from dtrt.serve import BackgroundServer, ServeConfig

    with BackgroundServer(pipe_for(tiny, spec("dominotree")), ServeConfig("tiny")) as s:
        yield s


@pytest.fixture(scope="session")
def tiny_export(tiny, tmp_path_factory):
    """The tiny pair exported once per test session with `dtrt export` defaults (budget 16, fp32). With workers
    (`-n`), the first worker that needs it exports it into the session's shared folder while the others wait, then
    load it: one export per session rather than one per worker (the tests copy it before changing anything)."""
    from filelock import FileLock

    from dtrt.artifacts.export import load_export
    from dtrt.exporter.export_config import ExportConfig
    from dtrt.exporter.write import export_pair

    if not _WORKERS:
        return export_pair(
            tiny, tmp_path_factory.mktemp("export") / "tiny", ExportConfig(max_context=512), model="tiny"
        )
    path = tmp_path_factory.getbasetemp().parent / "tiny-export"  # the workers' basetemps share this parent
    with FileLock(f"{path}.lock"):
        if path.is_dir():
            return load_export(path)
        return export_pair(tiny, path, ExportConfig(max_context=512), model="tiny")


@pytest.fixture(scope="session")
def tiny_export_int8(tiny_export, tmp_path_factory):
    from helpers import drafter_quant_export

    return drafter_quant_export(tiny_export, tmp_path_factory, "int8")


@pytest.fixture(scope="session")
def tiny_export_int4(tiny_export, tmp_path_factory):
    from helpers import drafter_quant_export

    return drafter_quant_export(tiny_export, tmp_path_factory, "int4")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need a CUDA GPU, `trt` ones TensorRT as well; elsewhere they skip with the reason."""
    from dtrt.artifacts.gpu import cuda_status, tensorrt_status

    gpu_why = None if torch.cuda.is_available() else cuda_status()[1]
    trt_why = gpu_why
    if any("trt" in item.keywords for item in items) and trt_why is None:
        trt_why = tensorrt_status()[1] or None
    for item in items:
        why = trt_why if "trt" in item.keywords else gpu_why if "gpu" in item.keywords else None
        if why:
            item.add_marker(pytest.mark.skip(reason=why))
