"""One copy of each weight on disk: every stage's initializers moved into one shared file, `weights.data`, each
distinct tensor stored once (by the sha256 of its bytes), and every stage graph pointing into it.

The stages of an export repeat weights: the target's embedding is the lm_head of every drafter block and the
embedding of the Domino scorer stages and the frontier, a DFlash drafter trained with a Domino head shares its
body, and the scorer stages share the GRU. Stored per stage, SmolLM2's export holds 1.24 GB of which 0.61 GB are
distinct. ONNX external data names a file, an offset and a length per tensor, so several graphs can read one file.
"""

import hashlib
from pathlib import Path

import onnx

WEIGHTS = "weights.data"
ALIGN = 4096  # bytes: a page, as the ONNX external-data convention asks, so a runtime can map a tensor from the file


def external(init: onnx.TensorProto) -> dict | None:
    info = {e.key: e.value for e in init.external_data}
    return info if init.data_location == onnx.TensorProto.EXTERNAL and info else None


def share_weights(root: Path, stage_files: list[str], log=None) -> dict:
    """Rewrite the stage graphs `stage_files` under `root` to read their external initializers from one shared
    file (WEIGHTS); their own data files are removed. Returns {"tensors", "distinct", "bytes", "stored"}."""
    root = Path(root)
    offsets: dict[str, tuple[int, int]] = {}  # sha256 -> (offset, length) in WEIGHTS
    tensors = stored = total = 0
    models = {}
    with open(root / WEIGHTS, "wb") as out:
        for name in stage_files:
            model = onnx.load(str(root / name), load_external_data=False)
            for init in model.graph.initializer:
                info = external(init)
                if info is None:
                    continue
                with open(root / info["location"], "rb") as f:
                    f.seek(int(info.get("offset", 0)))
                    data = f.read(int(info["length"]))
                key = hashlib.sha256(data).hexdigest()
                if key not in offsets:
                    pad = -out.tell() % ALIGN
                    out.write(b"\0" * pad)
                    offsets[key] = (out.tell(), len(data))
                    out.write(data)
                    stored += len(data)
                offset, length = offsets[key]
                del init.external_data[:]
                for k, v in (("location", WEIGHTS), ("offset", str(offset)), ("length", str(length))):
                    entry = init.external_data.add()
                    entry.key, entry.value = k, v
                tensors += 1
                total += len(data)
            models[name] = model
    for name, model in models.items():
        before = onnx.load(str(root / name), load_external_data=False).graph.initializer
        old = {info["location"] for info in map(external, before) if info is not None}
        onnx.save_model(model, str(root / name))
        for loc in old - {WEIGHTS}:
            (root / loc).unlink(missing_ok=True)
    if log:
        log(f"weights: {tensors} tensors, {total / 1e6:.1f} MB in the stages, {stored / 1e6:.1f} MB stored once")
    return {"tensors": tensors, "distinct": len(offsets), "bytes": total, "stored": stored}
