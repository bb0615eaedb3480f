"""The cost-aware methods' cost model, measured on the running backend: verify latency against tree width at fixed
context lengths, and the drafter's block latency over a short committed past (the block computing the rows the
cost-aware methods ask for: those a tree of their budget can reach).

The contexts do not depend on any prompt (CONTEXTS, cut at the backend's limit; beyond the last the curve grows
as between its last two), so one measurement serves every generation. A backend that names what decides its costs
(Backend.cost_key: an export's manifest, the runtime, the thread count, the device) keeps its curve per machine
under `$DTRT_CACHE/cost/`: the first process on a machine measures (a few seconds), the others read it. A curve
that cannot be read is measured again; one that cannot be written only means the next process measures too.
"""

import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from dtrt.artifacts.files import cache_dir, write_cache_file
from dtrt.tree.caddtree import CostCurve

CONTEXTS = (128, 1024, 2048)  # positions of committed past the verify reads, where the backend's limit allows
# bump when what is measured changes: older stored curves are then measured again (2: the drafter's block over the
# rows a tree of max_nodes nodes reaches, not every row)
STORE_VERSION = 2


def _median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def widths_for(max_nodes: int) -> list[int]:
    """Verify widths (nodes + the root) measured for trees of up to `max_nodes` nodes: powers of two and the cap."""
    return sorted({1 << i for i in range(max_nodes.bit_length() + 1) if 1 << i <= max_nodes + 1} | {max_nodes + 1})


def calibration_contexts(max_context: int | None, width: int) -> list[int]:
    """CONTEXTS that leave room for a `width`-token verify within `max_context` (None: no limit), and the largest
    past that does when it is shorter than the last."""
    top = CONTEXTS[-1] if max_context is None else min(CONTEXTS[-1], max_context - width)
    if top < 1:
        raise ValueError(f"a context of {max_context} positions leaves no past for a {width}-token verify")
    return sorted({c for c in CONTEXTS if c < top} | {top})


def measure_cost_curve(backend, max_nodes: int, repeats: int = 3) -> CostCurve:
    """Measures on `backend`, which it resets: call it between generations."""
    widths = widths_for(max_nodes)
    contexts = calibration_contexts(backend.max_context, widths[-1])
    backend.reset(contexts[-1] + widths[-1])
    # a committed past for the drafter's block to read, as a generation's rounds have one
    n = contexts[0]
    _, hidden = backend.target_forward(
        torch.zeros(n, dtype=torch.long), torch.arange(n), torch.ones(n, n).tril().bool()
    )
    backend.commit(torch.arange(n))
    samples = {}
    for ctx in contexts:
        backend.time_verify(widths[-1], ctx)  # warm-up at this context
        samples[ctx] = [
            (w - 1, _median_time(lambda w=w, ctx=ctx: backend.time_verify(w, ctx), repeats)) for w in widths
        ]
    draft_cost = 0.0
    if backend.drafter is not None:
        backend.draft_context(hidden, torch.arange(n))
        rows = min(max_nodes, backend.drafter.cfg.k_draft)  # the rows a tree of max_nodes nodes asks the block for
        backend.time_draft(rows=rows)  # warm-up
        draft_cost = _median_time(lambda: backend.time_draft(rows=rows), repeats)
    return CostCurve.fit(samples, draft_cost)


def machine_identity(device: torch.device) -> dict:
    """What a stored curve is kept per: the processor, its count of logical CPUs, and the GPU where one runs it."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    ident = {"cpu": cpu, "cpus": os.cpu_count(), "torch": torch.__version__}
    if device.type == "cuda":
        ident["gpu"] = torch.cuda.get_device_name(device)
    return ident


def store_root() -> Path:
    return cache_dir() / "cost"


def store_path(ident: dict) -> Path:
    return store_root() / f"{hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]}.json"


def cost_curve(backend, max_nodes: int) -> CostCurve:
    """The backend's curve for trees of up to `max_nodes` nodes: stored on this machine, else measured (and stored
    where the backend has a cost_key). Resets the backend when it measures."""
    key = backend.cost_key()
    if key is None:
        return measure_cost_curve(backend, max_nodes)
    widths = widths_for(max_nodes)
    ident = {
        "version": STORE_VERSION,
        "backend": key,
        "machine": machine_identity(backend.device),
        "widths": widths,
        "contexts": calibration_contexts(backend.max_context, widths[-1]),
    }
    path = store_path(ident)
    try:
        stored = json.loads(path.read_text())
        if stored.get("identity") == json.loads(json.dumps(ident)):
            return CostCurve.from_json(stored["curve"])
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        pass
    curve = measure_cost_curve(backend, max_nodes)
    write_cache_file(path, json.dumps({"identity": ident, "curve": curve.to_json()}, indent=1))
    return curve
