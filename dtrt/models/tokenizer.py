"""Tokenizers are read from the target's checkpoint directory (tokenizer.json etc.), offline."""

from pathlib import Path

from dtrt.errors import DtrtError


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types for a missing or broken tokenizer
        raise DtrtError(
            f"{path}: no usable tokenizer ({e.__class__.__name__}); the target directory needs "
            "tokenizer.json and tokenizer_config.json"
        ) from None
