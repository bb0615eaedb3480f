"""The target's weights in the fewest bytes that still give back its fp32 checkpoint bit for bit: the GGUF file's
own quantized blocks (Q4_1, Q8_0, F32) under the checkpoint's tensor names, with the checkpoint's safetensors
header. `decode` rebuilds model.safetensors with the same arithmetic the `gguf` package dequantizes with, and
refuses a result whose sha256 is not the checkpoint's."""

import json
import shutil
import struct
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from dtrt.artifacts.files import sha256

SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
WEIGHTS = "weights.safetensors"
FINGERPRINT = "fingerprint.json"
BLOCK = 32


class CodecError(Exception):
    pass


def _dequantize(kind: str, raw: np.ndarray) -> np.ndarray:
    """fp32 [rows, cols] from the raw blocks [rows, bytes] (gguf.quants' operations, in the same order)."""
    rows = raw.shape[0]
    if kind == "F32":
        return raw.view(np.float32).reshape(rows, -1)
    if kind == "Q8_0":  # 34 bytes a block: d (fp16), 32 int8
        blocks = raw.reshape(-1, 34)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        x = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
        return (x * d).reshape(rows, -1)
    if kind == "Q4_1":  # 20 bytes a block: d, m (fp16), 16 bytes of nibbles (low: 0..15, high: 16..31)
        blocks = raw.reshape(-1, 20)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        qs = blocks[:, 4:].reshape(-1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
        qs = (qs & np.uint8(0x0F)).reshape(-1, BLOCK).astype(np.float32)
        return ((d * qs) + m).reshape(rows, -1)
    raise CodecError(f"GGUF tensor type {kind} is not one this codec stores")


def _header(path: Path) -> bytes:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return struct.pack("<Q", n) + f.read(n)


def encode(checkpoint: Path, gguf_file: Path, out: Path) -> dict:
    """`out`/: the compact weights, the checkpoint's small files and its fingerprint; checked by decoding here."""
    from gguf import GGUFReader

    from dtrt.zoo.gguf import hf_name, read_fields

    checkpoint, out = Path(checkpoint), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(str(gguf_file))
    fields = read_fields(reader)
    heads = {
        "q_proj": fields["llama.attention.head_count"],
        "k_proj": fields.get("llama.attention.head_count_kv", fields["llama.attention.head_count"]),
    }
    tensors, kinds = {}, {}
    for t in reader.tensors:
        name = hf_name(t.name)
        raw = np.asarray(t.data)
        tensors[name] = raw.view(np.uint8).reshape(raw.shape[0], -1) if raw.ndim > 1 else raw.view(np.uint8)[None]
        proj = name.split(".")[-2]
        kinds[name] = json.dumps([t.tensor_type.name, heads.get(proj, 0)])
    tensors["__header__"] = np.frombuffer(_header(checkpoint / "model.safetensors"), dtype=np.uint8)
    save_file(tensors, str(out / WEIGHTS), metadata=kinds)
    for name in SMALL_FILES:
        shutil.copy2(checkpoint / name, out / name)
    record = {"model.safetensors": sha256(checkpoint / "model.safetensors")}
    (out / FINGERPRINT).write_text(json.dumps(record, indent=1) + "\n")
    probe = out / ".decoded"
    try:
        decode(out, probe)
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return record


def decode(stage: Path, out: Path) -> Path:
    """The checkpoint directory `out` (model.safetensors rebuilt, the small files copied) from `encode`'s folder."""
    from safetensors import safe_open

    from dtrt.zoo.gguf import unpermute_rows

    stage, out = Path(stage), Path(out)
    want = json.loads((stage / FINGERPRINT).read_text())["model.safetensors"]
    with safe_open(str(stage / WEIGHTS), "np") as f:
        kinds = f.metadata()
    tensors = load_file(str(stage / WEIGHTS))
    header = tensors.pop("__header__").tobytes()
    layout = json.loads(header[8:])
    buf = bytearray(len(header) + max(v["data_offsets"][1] for k, v in layout.items() if k != "__metadata__"))
    buf[: len(header)] = header
    for name, raw in tensors.items():
        kind, heads = json.loads(kinds[name])
        w = _dequantize(kind, raw)
        if heads:
            w = unpermute_rows(w, heads)
        spec = layout[name]
        w = np.ascontiguousarray(w.reshape(spec["shape"]), dtype=np.float32)
        a, b = spec["data_offsets"]
        buf[len(header) + a : len(header) + b] = w.tobytes()
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.safetensors.tmp"
    tmp.write_bytes(bytes(buf))
    if (got := sha256(tmp)) != want:
        tmp.unlink()
        raise CodecError(f"{stage / WEIGHTS}: rebuilds a checkpoint of sha256 {got[:12]}..., not {want[:12]}...")
    tmp.replace(out / "model.safetensors")
    for name in SMALL_FILES:
        shutil.copy2(stage / name, out / name)
    return out
