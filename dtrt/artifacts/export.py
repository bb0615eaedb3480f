"""The export directory contract: `manifest.json` next to one ONNX file per stage, checked on every load."""

import json
from dataclasses import dataclass, field
from pathlib import Path

from dtrt import __version__
from dtrt.artifacts.files import MANIFEST
from dtrt.artifacts.memo import checkpoint_hashes
from dtrt.artifacts.verify import check_files
from dtrt.errors import DtrtError
from dtrt.models.quant_spec import GgufQuant, QuantSpec, quant_from_json

FORMAT = "dtrt-export"

# what this dtrt's exports hold beyond what the manifest's other fields say: 2 = one shared weights file and the
# domino.chain stage; 3 = a quantized target's ordered attention planned once per call (TreeAttentionOrderPlan);
# 4 = RoPE as one gather per rotation, a quantized target's products of one activation merged (q/k/v, gate/up);
# 5 = a quantized target's ordered attention without an If per layer (prefills: an empty tail); 6 = the target
# reads its past from the runtime's whole K/V buffer (past_positions gives the past's length); 7 = a quantized
# target's ordered attention sums the head's weights with a ReduceSum (no ones column on the whole past); 8 = its
# layers never join their past with the new tokens (scores side by side, values read from the cache); 9 = its
# rotations as ONNX RotaryEmbedding (opset 23); 10 = int8 drafter stages with 7-bit weights (dtrt.exporter.quantize);
# 11 = a quantized target's layers read their past keys from the K cache too (no per-layer slice of it); 12 = the
# drafters' block stages take `rows` and return the base logits of those rows only (scorer_setup any rows); 13 = a
# block stage may cover a reduced draft vocabulary, kept beside it (<kind>.d2t.safetensors, dtrt.models.draft_vocab);
# 14 = a block's attention never joins the context with the block nor repeats it per query head
# (dtrt.models.drafter.split_attention), and the TreeAttention function repeats no K/V head per query head either
# (dtrt.ops.functions.tree_attention); 15 = a block stage over a draft vocabulary returns its base logits over the
# subset's columns (no scatter into the whole vocabulary; dtrt.tree.scorer.Round); 16 = a block stage reads its
# context cache as one position-major input per draft layer (dtrt.models.drafter.block_cache_inputs). The export made
# on first use is made again when it is older.
LAYOUT = 16


@dataclass
class Export:
    path: Path
    manifest: dict
    _vocabs: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # kind -> DraftVocab, read once

    def stage(self, name: str) -> Path:
        return self.path / self.manifest["stages"][name]["file"]

    @property
    def drafters(self) -> dict:
        return self.manifest.get("drafters", {})

    @property
    def domino_head(self) -> bool:
        """Whether it holds Domino's correction head (a Domino drafter's scorer: the Domino methods need it)."""
        return "gru_dim" in self.drafters.get("domino", {})

    def draft_vocab(self, kind: str):
        """The DraftVocab the `kind` drafter's block stage covers (None: the whole vocabulary)."""
        from dtrt.models.draft_vocab import load_draft_vocab

        rec = self.drafters.get(kind, {}).get("draft_vocab")
        if not rec:
            return None
        if kind not in self._vocabs:
            vocab = load_draft_vocab(self.path / rec["file"], rec["vocab_size"])
            if vocab.sha256 != rec["sha256"]:
                raise DtrtError(f"{self.path / rec['file']}: is not the subset {self.path / MANIFEST} records")
            self._vocabs[kind] = vocab
        return self._vocabs[kind]

    @property
    def dtype(self) -> str:
        return self.manifest["dtype"]

    @property
    def quant(self) -> QuantSpec | GgufQuant | None:
        """The target's weight-only quantization (None: its weights are in the export's dtype)."""
        q = self.manifest.get("quant")
        return quant_from_json(q) if q else None

    @property
    def quant_name(self) -> str:
        return self.quant.name if self.quant else "none"

    @property
    def target_kind(self) -> str:
        """`an int4 target` or `a full-precision target`, for messages."""
        if isinstance(self.quant, GgufQuant):
            return f"a {self.quant_name} target (its GGUF file's blocks)"
        return f"an {self.quant_name} target" if self.quant else "a full-precision target"

    @property
    def max_context(self) -> int:
        return int(self.manifest["max_context"])

    def fix_hint(self, *, drafter: bool = False, **changes) -> str:
        """The `dtrt export` command that rewrites this export with its recorded flags (and any `changes`; `drafter`:
        with a drafter where it has none)."""
        m = self.manifest
        src = m.get("source", {})
        how = f"--model {src['model']}" if src.get("model") else "--target DIR --drafter DIR"
        if src.get("gguf"):
            how = f"--gguf {src['gguf']}" + (" --drafter DIR" if src.get("drafters") or drafter else "")
        flags = {
            "dtype": m.get("dtype"),
            "max_context": m.get("max_context"),
            "budget": m.get("budget"),
            "topm": m.get("topm"),
            "node_topk": m.get("node_topk"),
            "drafter_quant": None if m.get("drafter_quant", "none") == "none" else m["drafter_quant"],
            "drafters": ",".join(m["drafters_asked"]) if m.get("drafters_asked") else None,
            "draft_vocab": m.get("draft_vocab_asked"),
            **quant_flags(m.get("quant")),
        } | changes
        if flags.get("quant") in (None, "none"):  # the default: no quantization flags
            flags.update(quant=None, quant_block=None, quant_method=None)
        elif flags["quant"] in ("gguf", "gguf-a8"):  # the file's own blocks: no block or method of ours
            flags.update(quant_block=None, quant_method=None)
        elif flags["quant"] == "int8":  # per channel: no block
            flags.update(quant_block=None)
        opts = "".join(f" --{k.replace('_', '-')} {v}" for k, v in flags.items() if v is not None)
        return f"dtrt export {how}{opts} --out {self.path} --force"


@dataclass(frozen=True)
class ExportContents:
    """What an export's manifest says it was made from and holds, read without any check: the defaults of a run over
    it (dtrt.launch.start.resolve_spec). Loading it (load_export) checks it."""

    model: str | None
    """The registry model it was exported from (None: checkpoints of one's own, or a GGUF file)."""
    quant: str
    """Its target's quantization (none, int8, int4, gguf, gguf-a8)."""
    drafters: tuple[str, ...]
    """The drafter kinds it holds (dflash, domino)."""
    domino_head: bool
    """Whether it holds Domino's correction head."""


def peek_export(path) -> ExportContents | None:
    """An export's contents as its manifest records them; None where the manifest cannot be read (load_export then
    says why, in one line)."""
    try:
        exp = Export(Path(path), json.loads((Path(path) / MANIFEST).read_text()))
        return ExportContents(
            model=exp.manifest.get("source", {}).get("model"),
            quant=exp.quant_name,
            drafters=tuple(sorted(exp.drafters)),
            domino_head=exp.domino_head,
        )
    except (OSError, ValueError, TypeError, KeyError, AttributeError, DtrtError):
        return None


def serving_drafter(*, needs_head: bool, drafters, domino_head: bool) -> str | None:
    """The drafter kind of an export that serves a method: Domino's where the method scores with its correction
    head, else DFlash's, else a Domino drafter's body; None where the export holds none that does."""
    if needs_head:
        return "domino" if domino_head else None
    return next((k for k in ("dflash", "domino") if k in drafters), None)


def quant_flags(q: dict | None) -> dict:
    """`dtrt export`'s flags for a manifest's `quant` entry."""
    if not q:
        return {"quant": None}
    if q.get("format") == "gguf":
        return {"quant": quant_from_json(q).name}
    flags = {"quant": f"int{q['bits']}", "quant_block": q.get("block")}
    return flags | ({"quant_method": q["method"]} if q.get("method", "rtn") != "rtn" else {})


def read_manifest(path: Path, fmt: str, what: str, how: str) -> dict:
    """The manifest of the artifact directory `path` (`what` it should be) in format `fmt`; `how` makes one."""
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise DtrtError(f"{mpath}: not found, so {path} is not {what}; {how}")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DtrtError(f"{mpath}: not valid JSON ({e.__class__.__name__}); {how}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != fmt:
        raise DtrtError(f"{mpath}: not a {fmt.replace('-', ' ')} manifest; {how}")
    return manifest


def load_export(path, full_check: bool = False) -> Export:
    """Read and check an export directory: manifest present and from this dtrt, every file present with its
    recorded size and sha256 (hashed where the file changed since it was last verified; every file when
    `full_check`). Errors name the file and the command that fixes it."""
    path = Path(path)
    if not path.is_dir():
        raise DtrtError(f"{path}: export directory not found; create it with `dtrt export --model NAME --out {path}`")
    manifest = read_manifest(
        path, FORMAT, "a complete dtrt export", f"re-export it with `dtrt export ... --out {path} --force`"
    )
    exp = Export(path, manifest)
    if manifest.get("dtrt_version") != __version__:
        raise DtrtError(
            f"{path / MANIFEST}: written by dtrt {manifest.get('dtrt_version')}, this is dtrt {__version__}; "
            f"re-export with `{exp.fix_hint()}`"
        )
    check_files(path, manifest.get("files"), f"re-export with `{exp.fix_hint()}`", full=full_check)
    return exp


def check_source(exp: Export, target: Path, model: str | None = None, drafters: dict | None = None):
    """An export used together with checkpoints (parity, --model with --export) must come from them: the
    model name, and the sha256 of the target's (and the drafters', kind -> path) config and weights."""
    src = exp.manifest["source"]
    mpath = exp.path / MANIFEST
    if model is not None and src.get("model") not in (None, model):
        raise DtrtError(
            f"{mpath}: exported from model {src['model']!r}, not {model!r}; "
            f"use another --export or run `dtrt export --model {model} --out DIR`"
        )
    checks = [("target", Path(target), src["target_hashes"])]
    checks += [
        (f"{kind} drafter", Path(p), src["drafters"][kind]["hashes"])
        for kind, p in (drafters or {}).items()
        if kind in src["drafters"]
    ]
    for what, path, hashes in checks:
        if not path.is_dir():
            raise DtrtError(
                f"{path}: the {what} checkpoint this export was made from is not found; "
                f"restore it or re-export with `{exp.fix_hint()}`"
            )
        if checkpoint_hashes(path) != hashes:
            raise DtrtError(
                f"{mpath}: exported from another {what} checkpoint than {path}; re-export with `{exp.fix_hint()}`"
            )
