"""Pair: where a target and its drafters are on disk, as a plain value (the registry names pairs without importing
torch; dtrt.models.checkpoint loads them)."""

from dataclasses import dataclass
from pathlib import Path

from dtrt.errors import DtrtError


@dataclass
class Pair:
    """Checkpoint directories of a target and its drafters; the tokenizer lives with the target."""

    target: Path
    dflash: Path | None = None
    domino: Path | None = None
    missing_drafter: str | None = None  # why a named pair lacks a drafter and how to get one ({kind}, {dir})

    def drafter_for(self, needs_head: bool) -> Path | None:
        path = (self.domino or None) if needs_head else (self.dflash or self.domino)
        if path is None and self.missing_drafter:
            kind, folder = ("Domino", "domino") if needs_head else ("DFlash", "dflash")
            raise DtrtError(self.missing_drafter.replace("{kind}", kind).replace("{dir}", folder))
        return path
