"""A GGUF file's tensors as the file holds them: each quantized tensor's raw blocks expanded into a BlockWeight
(dtrt.models.blocks) whose dequantization is the `gguf` package's, bit for bit; F32, F16 and BF16 tensors stay
float. The codes are unpacked with integer operations; the scales and mins are the products the `gguf` package
forms (an fp16 scale times a 6- or 8-bit one, exact in fp32), so nothing is rounded on the way.

Byte layouts (gguf-py's quants.py, llama.cpp's ggml-common.h), one block a row of `raw`:
    Q4_0  18 B / 32:  d fp16, 16 B of nibbles (low: 0..15, high: 16..31);  w = d (q - 8)
    Q4_1  20 B / 32:  d, m fp16, 16 B of nibbles;                          w = d q + m
    Q5_0  22 B / 32:  d fp16, 4 B of fifth bits (bit j: code j's), 16 B of nibbles;  w = d (q - 16)
    Q5_1  24 B / 32:  d, m fp16, 4 B of fifth bits, 16 B of nibbles;      w = d q + m
    Q8_0  34 B / 32:  d fp16, 32 int8;                                     w = d q
    Q2_K  84 B / 256: 16 B of 4-bit scales and mins, 64 B of 2-bit codes, d, dmin fp16;  w = d sc q - dmin m,
                      blocks of 16
    Q3_K 110 B / 256: 32 B of third bits, 64 B of low 2 bits, 12 B of 6-bit scales, d fp16;  w = d (sc - 32) (q - 4),
                      blocks of 16
    Q4_K 144 B / 256: d, dmin fp16, 12 B of 6-bit scales and mins, 128 B of nibbles;  w = d sc q - dmin m
    Q5_K 176 B / 256: as Q4_K, plus 32 B holding each code's fifth bit
    Q6_K 210 B / 256: 128 B low nibbles, 64 B high 2 bits, 16 int8 scales, d fp16; w = d sc (q - 32), blocks of 16
"""

import json
from pathlib import Path

import numpy as np
import torch

from dtrt.errors import DtrtError
from dtrt.models.blocks import BlockWeight

QK_K = 256
# bytes per block of the file and weights per block of the file (a K-quant's super-block)
LAYOUT = {
    "Q4_0": (18, 32),
    "Q4_1": (20, 32),
    "Q5_0": (22, 32),
    "Q5_1": (24, 32),
    "Q8_0": (34, 32),
    "Q2_K": (84, QK_K),
    "Q3_K": (110, QK_K),
    "Q4_K": (144, QK_K),
    "Q5_K": (176, QK_K),
    "Q6_K": (210, QK_K),
}
FLOATS = {"F32": (np.float32, torch.float32), "F16": (np.float16, torch.float16), "BF16": (np.int16, torch.bfloat16)}
KINDS = (*LAYOUT, *FLOATS)


def _f16(b: np.ndarray) -> np.ndarray:
    """[n, 2] bytes -> fp32 [n, 1]."""
    return b.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """[n, bytes] -> [n, 2 * bytes]: per run of `group` bytes, their low nibbles, then their high ones."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, -1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> the 8 sub-blocks' 6-bit scales and mins, [n, 8] each."""
    n = scales.shape[0]
    d, m, m_d = np.split(scales.reshape(n, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(n, 8), mn.reshape(n, 8)


def _q4_0(b):
    return _nibbles(b[:, 2:], 16), _f16(b[:, :2]), None, 8, 32


def _q4_1(b):
    return _nibbles(b[:, 4:], 16), _f16(b[:, :2]), _f16(b[:, 2:4]), 0, 32


def _fifth_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: 4 bytes whose bit j (little-endian) is code j's fifth bit, and 16 bytes of nibbles -> [n, 32]."""
    return _nibbles(qs, 16) | (np.unpackbits(qh, axis=-1, bitorder="little") << np.uint8(4))


def _q5_0(b):
    return _fifth_bits(b[:, 2:6], b[:, 6:]), _f16(b[:, :2]), None, 16, 32


def _q5_1(b):
    return _fifth_bits(b[:, 4:8], b[:, 8:]), _f16(b[:, :2]), _f16(b[:, 2:4]), 0, 32


def _q8_0(b):
    return b[:, 2:].copy().view(np.int8), _f16(b[:, :2]), None, 0, 32


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K's 64 bytes of 2-bit codes -> [n, 256]: per 32 bytes, their bits 0-1, then 2-3, 4-5, 6-7."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return (q & np.uint8(3)).reshape(n, -1)


def _q2_k(b):
    sc = b[:, :16]
    scale = _f16(b[:, 80:82]) * (sc & np.uint8(0x0F)).astype(np.float32)
    mins = -(_f16(b[:, 82:84]) * (sc >> np.uint8(4)).astype(np.float32))
    return _crumbs(b[:, 16:80]), scale, mins, 0, 16


def _q3_k(b):
    n = b.shape[0]
    high = b[:, :32].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = _crumbs(b[:, 32:96]) | ((high & np.uint8(1)).reshape(n, -1) << np.uint8(2))
    low = (b[:, 96:104].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    up = (b[:, 104:108].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(n, 16)
    sc = ((low & np.uint8(0x0F)) | ((up & np.uint8(3)) << np.uint8(4))).astype(np.int8) - np.int8(32)
    return q, _f16(b[:, 108:110]) * sc.astype(np.float32), None, 4, 16


def _k_scale_min(b):
    sc, mn = _k_scales(b[:, 4:16])
    return _f16(b[:, :2]) * sc.astype(np.float32), -(_f16(b[:, 2:4]) * mn.astype(np.float32))


def _q4_k(b):
    scale, mins = _k_scale_min(b)
    return _nibbles(b[:, 16:], 32), scale, mins, 0, 32


def _q5_k(b):
    scale, mins = _k_scale_min(b)
    n = b.shape[0]
    high = b[:, 16:48].reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    q = _nibbles(b[:, 48:], 32) | ((high & np.uint8(1)).reshape(n, -1) << np.uint8(4))
    return q, scale, mins, 0, 32


def _q6_k(b):
    n = b.shape[0]
    high = b[:, 128:192].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = _nibbles(b[:, :128], 64) | ((high & np.uint8(3)).reshape(n, -1) << np.uint8(4))
    scale = _f16(b[:, 208:210]) * b[:, 192:208].copy().view(np.int8).astype(np.float32)
    return q, scale, None, 32, 16


UNPACK = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def expand(*, name: str, kind: str, data: np.ndarray, where: str = "GGUF file") -> BlockWeight | torch.Tensor:
    """One tensor of a GGUF file from its data as GGUFReader gives it (numpy order: [..., rows, bytes a row] for a
    quantized type): a BlockWeight [..., rows, K], or a float tensor for F32/F16/BF16."""
    if kind in FLOATS:
        np_type, torch_type = FLOATS[kind]
        return torch.from_numpy(np.array(data).view(np.uint8).view(np_type)).view(torch_type)
    if kind not in LAYOUT:
        raise DtrtError(
            f"{where}: tensor {name!r} is {kind}, which dtrt cannot keep as blocks (it reads {', '.join(KINDS)}); "
            "requantize the file to one of those, or export it with --quant none"
        )
    size, per = LAYOUT[kind]
    raw = np.asarray(data).view(np.uint8)
    if raw.ndim == 0 or raw.shape[-1] % size:
        raise DtrtError(
            f"{where}: tensor {name!r} ({kind}) has rows of {raw.shape[-1:]} bytes, not whole {size}-byte blocks; "
            "the file is damaged: download or convert it again"
        )
    lead, blocks = raw.shape[:-1], raw.shape[-1] // size
    q, scale, mins, zero, block = UNPACK[kind](np.ascontiguousarray(raw).reshape(-1, size))
    k = blocks * per

    def shaped(a: np.ndarray, last: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a).reshape(*lead, last))

    return BlockWeight(
        kind=kind,
        q=shaped(q, k),
        scale=shaped(scale, k // block),
        min=None if mins is None else shaped(mins, k // block),
        zero=zero,
        block=block,
    )


def iter_blocks(path: Path):
    """(GGUF name, BlockWeight or float tensor) for every tensor of the file, in the file's order."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    for t in reader.tensors:
        yield t.name, expand(name=t.name, kind=t.tensor_type.name, data=t.data, where=str(path))


def read_blocks(path: Path) -> dict[str, BlockWeight | torch.Tensor]:
    return dict(iter_blocks(path))


BLOCKS_FILE = "gguf_blocks.safetensors"
BLOCKS_FORMAT = "dtrt-gguf-blocks-1"


def write_blocks(checkpoint: Path, rows: dict[str, torch.Tensor], kinds: dict[str, str], source: str):
    """`checkpoint`/BLOCKS_FILE: each quantized tensor's raw block rows (uint8 [rows, bytes a row]) by checkpoint
    name, with its GGUF type in the metadata."""
    from safetensors.torch import save_file

    meta = {"format": BLOCKS_FORMAT, "kinds": json.dumps(kinds, sort_keys=True), "source": source}
    save_file(rows, str(Path(checkpoint) / BLOCKS_FILE), metadata=meta)


def require_blocks(checkpoint: Path) -> Path:
    """`checkpoint`/BLOCKS_FILE, or one line naming the fix where the checkpoint has none."""
    path = Path(checkpoint) / BLOCKS_FILE
    if not path.is_file():
        raise DtrtError(
            f"{checkpoint}: has no {BLOCKS_FILE} (it was not converted from a GGUF file by this dtrt), so --quant gguf "
            "has no file blocks to keep; export from the file itself: dtrt export --gguf FILE"
        )
    return path


def unkept(checkpoint: Path) -> list[str]:
    """The quantized tensors (checkpoint names) that the checkpoint's BLOCKS_FILE records without their rows: types
    this dtrt keeps as blocks that the dtrt which converted it could not (Q5_0 before this one could), so the file
    must be converted again. Empty where it has no such file."""
    from safetensors import safe_open

    path = Path(checkpoint) / BLOCKS_FILE
    if not path.is_file():
        return []
    with safe_open(str(path), "pt") as f:
        return _without_rows(json.loads((f.metadata() or {}).get("kinds", "{}")), f.keys())


def _without_rows(kinds: dict[str, str], held) -> list[str]:
    """The names in a BLOCKS_FILE's `kinds` of a type kept as blocks whose rows are not among `held`."""
    held = set(held)
    return [name for name, kind in kinds.items() if kind in LAYOUT and name not in held]


def checkpoint_blocks(checkpoint: Path) -> dict[str, BlockWeight]:
    """The BlockWeights of a checkpoint converted from a GGUF file (dtrt.zoo.gguf), by checkpoint tensor name;
    one line naming the fix where it has none."""
    from safetensors import safe_open

    path = require_blocks(checkpoint)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != BLOCKS_FORMAT:
            raise DtrtError(f"{path}: not a {BLOCKS_FORMAT} file; convert the GGUF file again")
        kinds = json.loads(meta["kinds"])
        where = f"{path} (from {meta.get('source', 'its GGUF file')})"
        if missing := _without_rows(kinds, f.keys()):
            raise DtrtError(
                f"{where}: holds no blocks of {missing[0]!r} ({kinds[missing[0]]}: an older dtrt could not keep "
                "them); convert the GGUF file again: dtrt export --gguf FILE"
            )
        return {
            name: expand(name=name, kind=kind, data=f.get_tensor(name).numpy() if kind in LAYOUT else None, where=where)
            for name, kind in kinds.items()
        }
