"""One copy of each weight on disk: every stage's initializers moved into one shared file, `weights.data`, each
distinct tensor stored once (by the sha256 of its bytes), and every stage graph pointing into it.

The stages of an export repeat weights: the target's embedding is the lm_head of every drafter block and the
embedding of the Domino scorer stages and the frontier, a DFlash drafter trained with a Domino head shares its
body, and the scorer stages share the GRU. Stored per stage, SmolLM2's fp32 export holds 1.27 GB of which 0.64 GB are
distinct. ONNX external data names a file, an offset and a length per tensor, so several graphs can read one file.

Each stage is folded in as soon as it is final, and its own data file is cut back from its end as its tensors are
copied, so the disk holds the shared file and at most one stage's data beside it: SmolLM2's fp32 export peaks at
0.78 GB for the 0.65 GB it leaves, where writing every stage before sharing peaked at 1.91 GB.
"""

import hashlib
from pathlib import Path

import onnx

WEIGHTS = "weights.data"
# an export's peak on disk over the bytes of its models' distinct parameters, with margin: measured 1.26x for
# SmolLM2's fp32 export (0.76 GB; its stages also store buffers and the frontier's tables), 1.44x for its gguf one
# and 1.40x for its int4 one (the target, written last, its fp32 stage beside its blocks or integers and beside the
# drafter stages' shared weights)
PEAK = 1.6
ALIGN = 4096  # bytes: a page, as the ONNX external-data convention asks, so a runtime can map a tensor from the file


def external(init: onnx.TensorProto) -> dict | None:
    info = {e.key: e.value for e in init.external_data}
    return info if init.data_location == onnx.TensorProto.EXTERNAL and info else None


def disk_need(*models) -> int:
    """Bytes an export of `models` (torch modules, as loaded in the export's dtype) needs free on disk at its peak."""
    distinct = {id(p): p.numel() * p.element_size() for m in models for p in m.parameters()}
    return int(PEAK * sum(distinct.values()))


def point_at(init: onnx.TensorProto, location: str, offset: int, length: int):
    del init.external_data[:]
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = init.external_data.add()
        entry.key, entry.value = k, v


class SharedWeights:
    """`root`/WEIGHTS while an export writes it (a context: the file is closed on leaving): `fold(stage_file)` moves
    a finished stage's external initializers into it (each distinct tensor once) and removes the stage's own data
    files; `totals()` gives {"tensors", "distinct", "bytes", "stored"}, which the manifest records."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.out = open(self.root / WEIGHTS, "wb")
        self.offsets: dict[str, tuple[int, int]] = {}  # sha256 -> (offset, length) in WEIGHTS
        self.tensors = self.stored = self.total = 0

    def _append(self, data: bytes) -> tuple[int, int]:
        key = hashlib.sha256(data).hexdigest()
        if key not in self.offsets:
            self.out.write(b"\0" * (-self.out.tell() % ALIGN))
            self.offsets[key] = (self.out.tell(), len(data))
            self.out.write(data)
            self.stored += len(data)
        return self.offsets[key]

    def fold(self, stage_file: str):
        path = self.root / stage_file
        model = onnx.load(str(path), load_external_data=False)
        by_file: dict[str, list] = {}
        for init in model.graph.initializer:
            if (info := external(init)) is not None:
                by_file.setdefault(info["location"], []).append((int(info.get("offset", 0)), int(info["length"]), init))
        for location, items in by_file.items():
            if location == WEIGHTS:
                raise ValueError(f"{stage_file}: already reads {WEIGHTS}")
            # from the file's end down, cutting it back behind each copied tensor: the stage's data shrinks as the
            # shared file grows (a cut never reaches below a tensor still to be copied)
            items.sort(key=lambda t: t[0], reverse=True)
            ends, high = [0] * len(items), 0  # ends[i]: the furthest end of the tensors after the i-th
            for i in range(len(items) - 1, -1, -1):
                ends[i], high = high, max(high, items[i][0] + items[i][1])
            with open(self.root / location, "r+b") as src:
                for (offset, length, init), end in zip(items, ends):
                    src.seek(offset)
                    point_at(init, WEIGHTS, *self._append(src.read(length)))
                    self.tensors += 1
                    self.total += length
                    src.truncate(max(offset, end))
        self.out.flush()
        onnx.save_model(model, str(path))
        for location in by_file:
            (self.root / location).unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.out.close()

    def totals(self, log=None) -> dict:
        self.out.flush()
        if log:
            log(
                f"weights: {self.tensors} tensors, {self.total / 1e6:.1f} MB in the stages, "
                f"{self.stored / 1e6:.1f} MB stored once"
            )
        return {"tensors": self.tensors, "distinct": len(self.offsets), "bytes": self.total, "stored": self.stored}
