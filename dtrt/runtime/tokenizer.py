"""Tokenizers are read from the target's checkpoint directory (tokenizer.json etc.), offline.

transformers' AutoTokenizer picks the tokenizer class from tokenizer_config.json, config.json (for which it imports
the model's config class: about a second of every start, most of `dtrt run`'s) and tokenizer.json, then calls that
class's `from_pretrained`. The class it picked is remembered for those files as they are, under the transformers
version (dtrt.artifacts.memo), and later loads call the class itself: the same tokenizer, without the config.
Where that class cannot load it (another environment, the same transformers), AutoTokenizer picks again.

A pipeline reads its tokenizer through open_tokenizer: the lean one (dtrt.runtime.lean_tokenizer, which imports no
transformers) where the record made from transformers' tokenizer of these files says it gives the same results.
"""

from pathlib import Path

from dtrt.artifacts import memo
from dtrt.errors import DtrtError

# the files AutoTokenizer reads to pick a class (its class's from_pretrained reads what it needs itself)
CHOICE_FILES = ("tokenizer_config.json", "config.json", "tokenizer.json")


def choice_kind() -> str:
    """The memo's kind for AutoTokenizer's pick: under the transformers version, whose rules pick the class."""
    import transformers

    return f"tokenizer-class/transformers-{transformers.__version__}"


def load_tokenizer(path: Path):
    import transformers

    path = Path(path)
    picked = []

    def pick() -> str:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        picked.append(tokenizer)
        name = type(tokenizer).__name__
        return name if getattr(transformers, name, None) is type(tokenizer) else ""  # "": none to call directly

    try:
        name = memo.stamped(choice_kind(), [path / n for n in CHOICE_FILES], pick)
        if picked:
            return picked[0]
        if name:
            try:
                return getattr(transformers, name).from_pretrained(str(path), local_files_only=True)
            except Exception:  # noqa: BLE001 - the class remembered cannot load it here: AutoTokenizer decides
                pass
        return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types for a missing or broken tokenizer
        raise DtrtError(
            f"{path}: no usable tokenizer ({e.__class__.__name__}); the target directory needs "
            "tokenizer.json and tokenizer_config.json"
        ) from None


def tokenizer_files(path: Path) -> list[Path]:
    """Every file of a tokenizer's directory: whatever transformers reads there (tokenizer.json, its config, a
    chat_template.jinja, special_tokens_map.json, ...) changes the directory's stamps."""
    try:
        return sorted(p for p in Path(path).iterdir() if p.is_file())
    except OSError:
        return []


def open_tokenizer(path: Path):
    """The tokenizer a pipeline reads: a LeanTokenizer (no transformers import) where the record made from
    transformers' tokenizer of these files says it gives the same results, else transformers' (load_tokenizer)."""
    from dtrt.runtime import lean_tokenizer

    path = Path(path)
    loaded = []

    def hf():
        if not loaded:
            loaded.append(load_tokenizer(path))
        return loaded[0]

    record = memo.stamped(lean_tokenizer.record_kind(), tokenizer_files(path), lambda: lean_tokenizer.make_record(hf()))
    if isinstance(record, dict) and record.get("backend"):
        return lean_tokenizer.LeanTokenizer(record, hf)
    return hf()
