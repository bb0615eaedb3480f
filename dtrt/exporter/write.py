"""`dtrt export`: a target and its drafters -> one ONNX graph per stage + manifest.json, written to a temporary
directory next to the output and renamed into place only when complete."""

import shutil
import time
from contextlib import nullcontext
from pathlib import Path

from dtrt import __version__
from dtrt.artifacts.export import FORMAT, LAYOUT, Export, load_export
from dtrt.artifacts.files import require_space, sha256, staging, write_manifest
from dtrt.artifacts.memo import checkpoint_hashes
from dtrt.artifacts.verify import record_verified
from dtrt.errors import DtrtError
from dtrt.exporter.export_config import ExportConfig
from dtrt.exporter.onnx_export import OPSET, export_stage
from dtrt.exporter.precision import fp16_warning, stored_dtype
from dtrt.exporter.quantize import quantize_drafter, quantized_stages
from dtrt.exporter.scorer_stages import scorer_stages
from dtrt.exporter.stage_modules import drafter_stages, target_stage
from dtrt.exporter.target_quant import ordered_attention
from dtrt.exporter.target_writer import SecondProcess, TargetJob, write_target
from dtrt.exporter.weights import WEIGHTS, SharedWeights, disk_need
from dtrt.models.checkpoint import check_pair, load_drafter, load_target, parse_dtype
from dtrt.models.config import HybridConfig
from dtrt.models.draft_vocab import check_vocab_size, draft_vocab_file, resolve_draft_vocab
from dtrt.models.gguf_blocks import checkpoint_blocks
from dtrt.models.pair import Pair
from dtrt.models.quant import weight_names
from dtrt.models.quant_spec import GgufQuant

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
    "config.json",
)


def drafter_dims(d) -> dict:
    cfg = d.cfg
    dims = {
        "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_layers,
        "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "block_size": cfg.block_size,
        "k_draft": cfg.k_draft,
        "mask_token_id": cfg.mask_token_id,
        "shift_label": cfg.shift_label,
        "pure_draft_prefix_len": cfg.pure_draft_prefix_len,
        "target_layer_ids": cfg.target_layer_ids,
    }
    if d.head is not None:
        dims.update(gru_dim=d.head.gru_dim, emb_dim=d.head.emb_dim)
    return dims


def load_models(target_path: Path, drafter_paths: dict, dtype):
    """(target, drafters, taps): the target and its drafters (kind -> (path, drafter); a directory given for both
    kinds is loaded once, under the kind its head says), checked as a pair, and the target layers they read."""
    target = load_target(target_path, dtype)
    drafters = {}
    for kind, path in drafter_paths.items():
        if path is None or any(p == path for p, _ in drafters.values()):
            continue
        d = load_drafter(path, dtype)
        check_pair(target, d, path)
        if list(drafter_paths.values()).count(path) > 1:
            kind = "domino" if d.head is not None else "dflash"
        drafters[kind] = (Path(path), d)
    taps = {tuple(d.cfg.target_layer_ids) for _, d in drafters.values()}
    if len(taps) > 1:
        raise DtrtError(f"the drafters tap different target layers {sorted(taps)}; export them separately")
    return target, drafters, (taps.pop() if taps else ())


def vocab_record(vocab, kind: str) -> dict | None:
    return {**vocab.record(), "file": draft_vocab_file(kind)} if vocab is not None else None


def pair_stages(target, taps, drafters: dict, budget: int, topm: int, node_topk: int, vocabs=None) -> list:
    """Every stage of an export, in manifest order: the target, then per drafter kind its context and block
    stages (base logits over `vocabs[kind]`, None: the whole vocabulary) and, with a Domino head, the scorer and
    frontier stages."""
    stages = [target_stage(target, taps)]
    for kind, d in drafters.items():
        stages += drafter_stages(target, d, kind, (vocabs or {}).get(kind))
        if d.head is not None:
            for stage in scorer_stages(target, d, budget, topm, node_topk):
                stage.name = f"{kind}.{stage.name}"
                stages.append(stage)
    return stages


def write_stages(
    root: Path,
    stages: list,
    *,
    max_context: int,
    quant,
    blocks,
    names,
    drafter_quant: str,
    quantized: list,
    log,
    second: TargetJob | None = None,
):
    """Each drafter stage exported into `root`, a stage in `quantized` rewritten (`drafter_quant`), then its weights
    folded into the shared file before the next stage is written, so the disk holds one stage's own data at a time;
    then the target, its linear layers quantized (`quant`, `names`; `blocks`: a GGUF target's own) and folded last.
    `second`: the target written by a second process meanwhile (dtrt.exporter.target_writer), the same bytes.
    Returns (the manifest's stages, in `stages`' order; the target's quantized products or None; the shared weights'
    totals)."""
    stage_meta, products = {s.name: None for s in stages}, None
    target = next((s for s in stages if s.name == "target"), None)
    order = [s for s in stages if s is not target] + ([target] if target is not None else [])
    step = {s.name: i for i, s in enumerate(order if second is None else [target, *order[:-1]], 1)}
    with SharedWeights(root) as shared, SecondProcess(second) if second is not None else nullcontext() as proc:
        if proc is not None:
            log(f"[{step['target']}/{len(stages)}] exporting target in a second process, beside the other stages")
        for stage in order:
            t0, i = time.perf_counter(), step[stage.name]
            stage_meta[stage.name] = {"file": f"{stage.name}.onnx", "inputs": stage.inputs, "outputs": stage.outputs}
            if stage is target and proc is not None:
                products, seconds, lines = proc.result()
                log(f"[{i}/{len(stages)}] target done in {seconds:.1f}s (in the second process)")
                for line in lines:
                    log(line)
            elif stage is target:
                log(f"[{i}/{len(stages)}] exporting target")
                products = write_target(
                    stage, root, max_context=max_context, quant=quant, blocks=blocks, names=names, log=log
                )
                log(f"[{i}/{len(stages)}] target done in {time.perf_counter() - t0:.1f}s")
            else:
                log(f"[{i}/{len(stages)}] exporting {stage.name}")
                export_stage(stage, root / f"{stage.name}.onnx", max_context, max_context)
                log(f"[{i}/{len(stages)}] {stage.name} done in {time.perf_counter() - t0:.1f}s")
                if stage.name in quantized:
                    quantize_drafter(root / f"{stage.name}.onnx", stage.name, drafter_quant, log)
            shared.fold(f"{stage.name}.onnx")
        return stage_meta, products, shared.totals(log)


def export_pair(
    pair: Pair,
    out: Path,
    cfg: ExportConfig | None = None,
    *,
    model: str | None = None,
    gguf: Path | None = None,
    log=None,
) -> Export:
    """`pair` exported as `cfg` says into `out` (complete or not at all); `model`: the registry name it came from,
    `gguf`: the GGUF file its target was converted from (`dtrt export --gguf`). A Domino drafter serves every
    method (its body is a DFlash drafter), so `drafters=("domino",)` is the smallest export that runs them all."""
    log = log or (lambda msg: None)
    out, cfg = Path(out), cfg or ExportConfig()
    dtype, max_context, budget, topm, node_topk = cfg.dtype, cfg.max_context, cfg.budget, cfg.topm, cfg.node_topk
    drafter_quant, drafter_kinds, quant, draft_vocab = cfg.drafter_quant, cfg.drafters, cfg.quant_spec, cfg.draft_vocab
    if out.exists() and not cfg.force:
        raise DtrtError(f"--out {out}: already exists; pass --force to replace it")
    drafter_paths = {"dflash": pair.dflash, "domino": pair.domino}
    target, drafters, taps = load_models(pair.target, drafter_paths, parse_dtype(dtype))
    if quant is not None and isinstance(target.cfg, HybridConfig):
        raise DtrtError(
            f"--quant {quant.name}: {pair.target} is a hybrid target (Gated DeltaNet layers), whose tree verify "
            "does not reproduce plain decoding bit for bit as a quantized target needs; export it with --quant none"
        )
    if dtype == "fp16" and stored_dtype(pair.target) == "bf16":
        from dtrt.runtime.tokenizer import load_tokenizer

        try:
            tokenizer = load_tokenizer(pair.target)
        except DtrtError:
            tokenizer = None
        if warning := fp16_warning(pair.target, target, tokenizer):
            log(warning)
    if drafter_kinds is not None:
        for kind in drafter_kinds:
            if kind not in drafters:
                have = ", ".join(drafters) or "none"
                raise DtrtError(f"--drafters {kind}: the pair has no {kind} drafter (it has: {have})")
        drafters = {k: v for k, v in drafters.items() if k in drafter_kinds}
    tokenizer_sha = sha256(pair.target / "tokenizer.json") if (pair.target / "tokenizer.json").is_file() else None
    vocabs = {
        k: resolve_draft_vocab(draft_vocab, p, target.cfg.vocab_size, target.cfg.eos_token_id, tokenizer_sha)
        for k, (p, _) in drafters.items()
    }
    for vocab in vocabs.values():
        check_vocab_size(vocab, topm, node_topk)
    stages = pair_stages(target, taps, {k: d for k, (_, d) in drafters.items()}, budget, topm, node_topk, vocabs)
    blocks = checkpoint_blocks(pair.target) if isinstance(quant, GgufQuant) else None
    require_space(out, disk_need(target, *(d for _, d in drafters.values())), "this export")
    # the quantized weights by their names in the target stage's graph (TargetStage.target)
    names = [tuple(f"target.{n}" for n in group) for group in weight_names(target)] if quant is not None else []

    quantized = quantized_stages([s.name for s in stages], drafter_quant)
    second = None
    if cfg.jobs == 2 and len(stages) > 1:
        second = dict(target=Path(pair.target), dtype=dtype, taps=tuple(taps), max_context=max_context)
        second.update(quant=quant, names=tuple(names))

    with staging(out) as tmp:
        stage_meta, products, weights = write_stages(
            tmp,
            stages,
            max_context=max_context,
            quant=quant,
            blocks=blocks,
            names=names,
            drafter_quant=drafter_quant,
            quantized=quantized,
            log=log,
            second=None if second is None else TargetJob(root=tmp, **second),
        )
        for kind, vocab in vocabs.items():  # beside the engines too: parity and the runtime read the subset here
            if vocab is not None:
                vocab.save(tmp / draft_vocab_file(kind))
        (tmp / "tokenizer").mkdir()
        for name in TOKENIZER_FILES:
            if (pair.target / name).is_file():
                shutil.copy2(pair.target / name, tmp / "tokenizer" / name)
        cfg = target.cfg
        manifest = {
            "format": FORMAT,
            "layout": LAYOUT,
            "dtrt_version": __version__,
            "opset": OPSET,
            "op_flavour": "dtrt-functions",
            "dtype": dtype,
            "max_context": max_context,
            "budget": budget,
            "topm": topm,
            "node_topk": node_topk,
            "drafter_quant": drafter_quant,
            "quantized_stages": quantized,
            "quant": None
            if quant is None
            else {"format": "qdq", **quant.to_json(), "weights": len(names), "products": products},
            "ordered_attention": None if quant is None else ordered_attention(quant),
            "drafters_asked": list(drafter_kinds) if drafter_kinds is not None else None,
            "draft_vocab_asked": None if draft_vocab in (None, "auto") else str(draft_vocab),
            "weights": {"file": WEIGHTS, **weights},
            "source": {
                "model": model,
                **({"gguf": str(Path(gguf).resolve())} if gguf is not None else {}),
                "target": str(pair.target.resolve()),
                "target_hashes": checkpoint_hashes(pair.target),
                "drafters": {
                    k: {"path": str(p.resolve()), "hashes": checkpoint_hashes(p)} for k, (p, _) in drafters.items()
                },
            },
            "target": {
                "arch": cfg.arch,
                "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.hidden_size,
                "num_layers": cfg.num_layers,
                "num_kv_heads": cfg.num_kv_heads,
                "head_dim": cfg.head_dim,
                "taps": list(taps),
                "eos_token_id": list(cfg.eos_token_id),
                **(cfg.recurrent_dims() if isinstance(cfg, HybridConfig) else {}),
            },
            "drafters": {
                k: {**drafter_dims(d), "draft_vocab": vocab_record(vocabs[k], k)} for k, (_, d) in drafters.items()
            },
            "stages": stage_meta,
        }
        write_manifest(tmp, manifest)
    record_verified(out, manifest["files"])  # just hashed while writing: the first load need not hash again
    return load_export(out)
