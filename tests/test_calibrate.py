"""The cost-aware methods' cost curve: measured at fixed contexts on a reset backend, and kept per machine for a
backend that names what decides its costs."""

import json

import pytest
import torch
from helpers import PROMPTS, pipe_for, spec

from dtrt.runtime import calibrate
from dtrt.runtime.calibrate import calibration_contexts, cost_curve, measure_cost_curve, widths_for
from dtrt.runtime.sampling import SamplingConfig
from dtrt.tree import CostCurve

pytestmark = pytest.mark.usefixtures("one_thread")


def test_widths_and_contexts():
    assert widths_for(16) == [1, 2, 4, 8, 16, 17] and widths_for(2) == [1, 2, 3]
    assert calibration_contexts(None, 17) == [128, 1024, 2048]
    assert calibration_contexts(4096, 17) == [128, 1024, 2048]
    assert calibration_contexts(256, 17) == [128, 239]
    assert calibration_contexts(100, 17) == [83]
    with pytest.raises(ValueError):
        calibration_contexts(10, 17)


def test_measured_on_a_reset_backend_at_fixed_contexts(tiny):
    pipe = pipe_for(tiny, spec("cadominotree", budget=8))
    ids = pipe.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    before = pipe.generate(ids, 12, SamplingConfig()).tokens
    curve = measure_cost_curve(pipe.backend, 8)
    assert curve.contexts == [128, 1024, 2048] and curve.draft_cost > 0
    for ctx in (128, 2048):
        costs = [curve.verify_cost(n, ctx) for n in (0, 4, 8)]
        assert costs == sorted(costs) and costs[0] > 0
    assert pipe.generate(ids, 12, SamplingConfig()).tokens == before  # measuring leaves no trace


class FakeBackend:
    """What cost_curve reads of a backend; measuring is counted, not timed."""

    def __init__(self, key):
        self.key, self.device, self.max_context = key, torch.device("cpu"), 512

    def cost_key(self):
        return self.key


@pytest.fixture
def measured(monkeypatch):
    calls = []

    def measure(backend, max_nodes):
        calls.append((backend.key, max_nodes))
        return CostCurve.fit({128: [(0, 1e-3), (max_nodes, 2e-3 * len(calls))]}, draft_cost=5e-4)

    monkeypatch.setattr(calibrate, "measure_cost_curve", measure)
    return calls


def test_stored_per_backend_key_and_budget(measured, cost_store):
    a = {"runner": "onnxruntime", "threads": 1, "export": "abc"}
    first = cost_curve(FakeBackend(a), 16)
    assert cost_curve(FakeBackend(dict(a)), 16) == first and len(measured) == 1  # read back, not measured
    assert len(list(cost_store.glob("*.json"))) == 1
    cost_curve(FakeBackend({**a, "threads": 2}), 16)
    cost_curve(FakeBackend(a), 8)
    assert len(measured) == 3 and len(list(cost_store.glob("*.json"))) == 3
    cost_curve(FakeBackend(None), 16)  # no key: measured, not stored
    cost_curve(FakeBackend(None), 16)
    assert len(measured) == 5 and len(list(cost_store.glob("*.json"))) == 3
    assert not list(cost_store.glob("*.tmp"))


def test_a_damaged_store_is_measured_again(measured, cost_store):
    key = {"runner": "onnxruntime", "export": "abc"}
    cost_curve(FakeBackend(key), 4)
    (path,) = cost_store.glob("*.json")
    stored = json.loads(path.read_text())
    for damaged in ("{", json.dumps({**stored, "curve": {"contexts": []}}), json.dumps([1])):
        path.write_text(damaged)
        again = cost_curve(FakeBackend(key), 4)
        assert CostCurve.from_json(json.loads(path.read_text())["curve"]) == again  # rewritten whole
    assert len(measured) == 4


def test_an_unwritable_store_still_gives_a_curve(measured, cost_store):
    cost_store.parent.mkdir(parents=True, exist_ok=True)
    cost_store.write_text("a file where the store's directory should be")
    assert cost_curve(FakeBackend({"export": "abc"}), 4).draft_cost == 5e-4
    assert cost_curve(FakeBackend({"export": "abc"}), 4).draft_cost == 5e-4
    assert len(measured) == 2
