"""The target stage written: exported, then its linear layers quantized as the export asks; in this process, or
with `dtrt export --jobs 2` in a second process while this one exports the drafter stages. torch.onnx's export runs
on one core, and the target is about half of a pair's export: on a 2-core VM SmolLM2's gguf export took 27-30 s
against 37 s. The second process loads its own copy of the target from the checkpoint (a loaded model does not cross
processes); it writes `target.onnx` and its data into the staging directory and nothing else, and this process
folds them into weights.data after the drafter stages, as a one-process export does, so the export's files are the
same bytes either way."""

import os
import pickle
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from dtrt.errors import DtrtError
from dtrt.exporter.gguf_target import export_gguf_target
from dtrt.exporter.onnx_export import export_stage
from dtrt.exporter.target_quant import quantize_target


@dataclass(frozen=True)
class TargetJob:
    """The target stage as the second process writes it."""

    target: Path
    """The target's checkpoint directory."""
    dtype: str
    """The export's dtype (fp32, fp16, bf16)."""
    taps: tuple[int, ...]
    """The target layers the drafters read."""
    root: Path
    """The staging directory the stage is written into."""
    max_context: int
    quant: object = None
    """The target's QuantSpec (None: not quantized)."""
    names: tuple = ()
    """The quantized weights by their names in the stage's graph."""


def quantize_target_stage(path: Path, quant, blocks, names: list, log) -> int:
    """The target stage at `path` with its linear layers as `quant` says (`blocks`: a GGUF target's own blocks);
    the number of products written."""
    t0 = time.perf_counter()
    if blocks is not None:
        log(f"keeping the target's linear layers as its GGUF file's blocks ({quant.name})")
        kept, products = export_gguf_target(path, quant, blocks, names)
        log(f"{len(kept)} weights kept as blocks in {time.perf_counter() - t0:.1f}s, {products} products")
    else:
        log(f"quantizing the target's linear layers to {quant.name} ({quant.method})")
        done, products = quantize_target(path, quant, names)
        log(f"{len(done)} weights quantized in {time.perf_counter() - t0:.1f}s, {products} products")
    return products


def write_target(stage, root: Path, *, max_context: int, quant, blocks, names, log) -> int | None:
    """The target `stage` exported into `root`, then its linear layers quantized (`quant`, `names`; `blocks`: a GGUF
    target's own); the number of products written (None: not quantized)."""
    export_stage(stage, root / f"{stage.name}.onnx", max_context, max_context)
    return None if quant is None else quantize_target_stage(root / f"{stage.name}.onnx", quant, blocks, names, log)


def _run(job: TargetJob) -> tuple:
    """The second process's work: the target loaded, exported and quantized; ("done", products, seconds, log lines),
    ("raise", the DtrtError or OSError to raise) or ("error", a bug's traceback)."""
    try:
        from dtrt.exporter.stage_modules import target_stage
        from dtrt.models.checkpoint import load_target, parse_dtype
        from dtrt.models.gguf_blocks import checkpoint_blocks
        from dtrt.models.quant_spec import GgufQuant

        t0, lines = time.perf_counter(), []
        target = load_target(job.target, parse_dtype(job.dtype))
        blocks = checkpoint_blocks(job.target) if isinstance(job.quant, GgufQuant) else None
        stage = target_stage(target, job.taps)
        products = write_target(
            stage,
            job.root,
            max_context=job.max_context,
            quant=job.quant,
            blocks=blocks,
            names=list(job.names),
            log=lines.append,
        )
        return "done", products, time.perf_counter() - t0, lines
    except (DtrtError, OSError) as e:  # a refusal, a full disk, a file it may not write: raised again there, as is
        return "raise", e
    except Exception:  # a bug: its traceback goes back whole
        return "error", traceback.format_exc()


class SecondProcess:
    """The target stage's export in a process of its own (`python -m dtrt.exporter.target_writer`: a fresh
    interpreter, so neither this process's threads nor its `__main__` are copied into it), started on entering (a
    context): `result()` waits for it and gives (products, seconds, log lines); leaving stops a process that has not
    finished, so an export that fails here leaves nothing writing into its staging directory."""

    def __init__(self, job: TargetJob):
        self.job = job

    def __enter__(self):
        read, write = os.pipe()
        # it imports dtrt from where this process did; a session of its own, so a Ctrl-C reaches this process
        # only, which stops it on leaving
        home = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (home, os.environ.get("PYTHONPATH"))))}
        try:
            cmd = [sys.executable, "-m", __name__, str(write)]
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, pass_fds=(write,), env=env, start_new_session=True)
        finally:
            os.close(write)
        self.out = os.fdopen(read, "rb")
        try:
            pickle.dump(self.job, self.proc.stdin)
            self.proc.stdin.close()
        except BrokenPipeError:
            pass  # it ended at once: result() says so
        return self

    def result(self) -> tuple[int | None, float, list[str]]:
        try:
            msg = pickle.load(self.out)
        except EOFError:
            code = self.proc.wait()
            raise DtrtError(
                f"the target stage's export process ended (exit code {code}) before it finished; export with --jobs 1"
            ) from None
        self.proc.wait()
        if msg[0] == "done":
            return msg[1], msg[2], msg[3]
        if msg[0] == "raise":
            raise msg[1]
        raise RuntimeError(f"the target stage's export process failed:\n{msg[1]}")

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait()
        self.out.close()


if __name__ == "__main__":
    with os.fdopen(int(sys.argv[1]), "wb") as _out:
        pickle.dump(_run(pickle.load(sys.stdin.buffer)), _out)
