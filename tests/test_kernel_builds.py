"""Every Triton kernel launch the torch backend makes on a CUDA GPU compiles for the GPUs the project is measured on
(sm_90: H100, H200), without a GPU. Triton's CPU interpreter (the other kernel tests) runs a kernel's arithmetic but
none of a GPU compile's checks: a `tl.dot` shape the tensor cores refuse, a layout the compiler cannot lower, shared
memory past what a block may take. So the launches are recorded, not run: the models at the released shapes (Qwen3-4B
and Qwen3-8B in bf16; SmolLM2-135M in fp32, as the embedded pair runs; a Qwen3-Next Gated-DeltaNet layer) run on the
meta device with DTRT_KERNELS=triton, each plugin's kernel replaced by a recorder that keeps each launch's arguments,
typed and specialized as Triton's JIT types and specializes them. A process without the interpreter then compiles
each distinct launch for sm_90 (DTRT_KERNEL_ARCHS=8.0,8.9,12.0 names others). The static verify at every width, the
drafting graph (the fixed-shape block, the frontier's scores and ledger), the eager verify and the hybrid's recurrent
ops all launch. torch.compile's own generated kernels are not among them (generating them needs a GPU)."""

import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.slow,  # not `kernels`: it runs no kernel, and the GPU check need not spend its time on it
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (the gpu extra)"),
]

ROOT = Path(__file__).resolve().parent.parent
# the compute capabilities compiled for: sm_90 (H100, H200) unless DTRT_KERNEL_ARCHS names others, e.g. 8.0,8.9,12.0
ARCHS = tuple(os.environ.get("DTRT_KERNEL_ARCHS", "9.0").split(","))
# bytes of shared memory a block may take (with the launcher's opt-in), by compute capability
SHARED_MAX = {"8.0": 163 * 1024, "8.6": 99 * 1024, "8.7": 163 * 1024, "8.9": 99 * 1024, "9.0": 227 * 1024,
              "10.0": 227 * 1024, "12.0": 99 * 1024}  # fmt: skip
PLUGINS = ("static_tree_attention", "tree_attention", "ledger_select", "topm_corrected_score", "tree_causal_conv1d",
           "tree_gated_delta_net")  # fmt: skip
# SmolLM2-135M-Instruct's config.json (the embedded default's target)
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def specialized(value) -> tuple[str, object]:
    """(Triton's type, what the JIT specializes on) of one launch argument: an int of 1 is a constant, an int that
    is a multiple of 16 or a pointer aligned to 16 bytes gets "D" (divisibility 16)."""
    if isinstance(value, torch.Tensor):
        from dtrt.plugins.ptx import TRITON_TYPES

        kind = "u1" if value.dtype == torch.bool else TRITON_TYPES[value.dtype]  # the JIT's type for bool
        return "*" + kind, "D" if value.data_ptr() % 16 == 0 else ""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"a launch argument of type {type(value).__name__}")
    if isinstance(value, float):
        return "fp32", ""
    if value == 1:
        return "constexpr", 1
    return ("i32" if -(2**31) <= value < 2**31 else "i64"), "D" if value % 16 == 0 else ""


class Recorder:
    """Stands for a plugin's kernel: `kernel[grid](*args, **kwargs)` appends the launch to `log` and runs nothing."""

    def __init__(self, plugin: str, name: str, kernel, log: list):
        self.plugin, self.name, self.log = plugin, name, log
        self.params = list(inspect.signature(kernel.fn).parameters.values())

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            entry = {"plugin": self.plugin, "kernel": self.name, "num_warps": kwargs.pop("num_warps", 4),
                     "num_stages": kwargs.pop("num_stages", 3), "args": []}  # fmt: skip
            values = [*args, *(kwargs[p.name] for p in self.params[len(args) :])]
            for p, value in zip(self.params, values, strict=True):
                if "constexpr" in str(p.annotation):
                    entry["args"].append([p.name, "constexpr", value])
                else:
                    entry["args"].append([p.name, *specialized(value)])
            self.log.append(entry)

        return launch


@pytest.fixture
def launches(monkeypatch):
    """The distinct launches recorded while the test runs (DTRT_KERNELS=triton; the dtrt custom ops' real
    implementations on meta tensors, where their fake ones would launch nothing)."""
    from dtrt.models import layers, static_kv

    monkeypatch.setenv("DTRT_KERNELS", "triton")
    log = []
    for plugin in PLUGINS:
        module = importlib.import_module(f"dtrt.plugins.{plugin}")
        name = f"{plugin}_kernel"
        monkeypatch.setattr(module, name, Recorder(plugin, name, getattr(module, name), log))
    for op in (layers.committed_attention, static_kv.static_attend):
        monkeypatch.setattr(op, "_abstract_fn", op._init_fn)
    yield log


@pytest.fixture
def gpu_shapes(monkeypatch):
    """benchmarks/gpu_shapes.py: the Qwen3 configs as released, and how it parses and makes the pair."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_shapes

    return gpu_shapes


def pair_on_meta(gpu_shapes, target: dict, drafter: dict, dtype: torch.dtype):
    from dtrt.models.domino import DominoHead
    from dtrt.models.drafter import Drafter
    from dtrt.models.target import Target

    tcfg, dcfg, (gru, emb) = gpu_shapes.parse(target=target, drafter=drafter)
    with gpu_shapes.made_as(device=torch.device("meta"), dtype=dtype):
        return Target(tcfg).eval(), Drafter(dcfg, DominoHead(dcfg.hidden_size, gru, emb, dcfg.vocab_size)).eval()


def run_the_gpu_paths(target, drafter, context: int, past: int = 1000):
    """What `dtrt run --device cuda` launches: the --static-shapes round at every width (verify, accept walk,
    commit, the drafter's context), --cuda-graph's drafting (the fixed-shape block, the frontier), and the eager
    verify (the tree attention kernel)."""
    from dtrt.runtime.backends.torch import TorchBackend
    from dtrt.runtime.draft_graph import DraftGraph
    from dtrt.runtime.methods import make_method
    from dtrt.runtime.spec import RunSpec
    from dtrt.runtime.static_round import WIDTHS, ContextAppend, device_round, padded
    from dtrt.tree import Tree

    meta = torch.device("meta")
    run = RunSpec(method="dominotree", budget=16, builder="frontier", static_shapes=True, compile=False)
    static = TorchBackend(target, drafter, meta, max_context=context)
    static.prepare(run)
    static.reset(past + 2 * WIDTHS[-1])
    static.cache.past = past
    static.cache.length.fill_(past)
    context_append = ContextAppend(static.drafter, static.draft_cache)
    with torch.no_grad():
        for n in WIDTHS:
            tokens, parents = padded(Tree.chain([0] * (n - 1), root=0), n)
            device_round(static.target, static.cache, static.taps, tokens.to(meta), parents.to(meta), context_append,
                         None)  # fmt: skip
        method = make_method(run)
        method.prepare(static, static.drafter.cfg.k_draft)
        DraftGraph(static, method)(42, past)
        eager = TorchBackend(target, drafter, meta)
        eager.reset(past + WIDTHS[-1])
        for n in (1, 17):
            eager.time_verify(n, past)


def run_a_gated_deltanet_layer(gpu_shapes):
    """A Qwen3-Next Gated-DeltaNet layer (its released dims: HybridConfig's defaults) verifying a tree of 17 nodes."""
    from dtrt.models.config import HybridConfig
    from dtrt.models.hybrid import GatedDeltaNet, HybridCache

    cfg = HybridConfig(arch="qwen3_next", vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_layers=4,
                       num_heads=16, num_kv_heads=2, head_dim=256, rms_norm_eps=1e-6, rope_theta=1e7,
                       tie_word_embeddings=False,
                       layer_types=("linear_attention",) * 3 + ("full_attention",))  # fmt: skip
    with gpu_shapes.made_as(device=torch.device("meta"), dtype=torch.bfloat16):
        layer = GatedDeltaNet(cfg, 0)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 4, 5, 6, 6, 7, 8, 9, 10, 11, 12], device="meta")
    cache = HybridCache(cfg, 64, torch.bfloat16, "meta")  # as the hybrid target makes its own
    with torch.no_grad():
        layer(torch.empty(17, cfg.hidden_size, dtype=torch.bfloat16, device="meta"), parents, cache)


def twin(launch: dict) -> str:
    """What a launch compiles as: everything it passes but static_tree_attention's SPLITS, a count its programs
    divide their share of the past by (the widths' launches differ in it alone where their row blocks agree)."""
    args = [a for a in launch["args"] if not (launch["plugin"] == PLUGINS[0] and a[0] == "SPLITS")]
    return json.dumps(launch | {"args": args}, sort_keys=True)


def compiled(launches: list, arch: str, tmp_path: Path) -> list[dict]:
    """Each launch compiled for sm<arch> in a process without Triton's interpreter: its name and shared memory,
    or the compile's error."""
    todo = tmp_path / "launches.json"
    todo.write_text(json.dumps(launches))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DTRT_KERNELS")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # a fresh cache: every launch really compiles
    cmd = [sys.executable, __file__, str(todo), arch]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_every_launch_of_the_gpu_path_compiles(launches, gpu_shapes, tmp_path):
    assert set(ARCHS) <= SHARED_MAX.keys(), f"DTRT_KERNEL_ARCHS: use some of {','.join(SHARED_MAX)}"
    for model in ("qwen3-4b", "qwen3-8b"):
        target, drafter = gpu_shapes.configs(tiny=False, model=model)
        pair = pair_on_meta(gpu_shapes, target, drafter, torch.bfloat16)
        run_the_gpu_paths(*pair, target["max_position_embeddings"])
    shipped = json.loads((ROOT / "dtrt/assets/smollm2-135m/domino/config.json").read_text())
    run_the_gpu_paths(*pair_on_meta(gpu_shapes, SMOLLM2, shipped, torch.float32), SMOLLM2["max_position_embeddings"])
    run_a_gated_deltanet_layer(gpu_shapes)

    assert {e["plugin"] for e in launches} == set(PLUGINS)
    distinct = list({twin(e): e for e in launches}.values())
    widths = {dict((a[0], a[2]) for a in e["args"])["BLOCK_R"] for e in distinct if e["plugin"] == PLUGINS[0]}
    assert widths == {16, 32, 64}  # the static verify's row blocks: every width of the bf16 and fp32 targets
    for arch in ARCHS:
        results = compiled(distinct, arch, tmp_path)
        failures = [f"{e['plugin']} {r['error']}" for e, r in zip(distinct, results, strict=True) if "error" in r]
        assert failures == []
        for e, r in zip(distinct, results, strict=True):
            assert r["shared"] <= SHARED_MAX[arch], (arch, e, r)
            assert e["num_warps"] * 32 <= 1024


def compile_all(path: str, arch: str) -> list[dict]:
    """The launches in `path` compiled for sm<arch> (run as a script, in a process without the interpreter)."""
    from triton.backends.compiler import BaseBackend

    from dtrt.plugins.ptx import compile_kernel

    out = []
    for e in json.loads(Path(path).read_text()):
        fn = getattr(importlib.import_module(f"dtrt.plugins.{e['plugin']}"), e["kernel"])
        signature = {name: typ for name, typ, _ in e["args"]}
        constexprs = {name: value for name, typ, value in e["args"] if typ == "constexpr"}
        attrs = {(i,): BaseBackend.parse_attr(spec) for i, (_, typ, spec) in enumerate(e["args"]) if typ != "constexpr"}
        try:
            meta = compile_kernel(fn, signature, constexprs, e["num_warps"], e["num_stages"], arch, attrs).metadata
        except Exception as error:  # noqa: BLE001 - every launch's outcome is reported
            out.append({"error": f"{type(error).__name__}: {str(error)[:2000]}"})
            continue
        out.append({"name": meta.name, "shared": meta.shared})
    return out


if __name__ == "__main__":
    print(json.dumps(compile_all(sys.argv[1], sys.argv[2])))
