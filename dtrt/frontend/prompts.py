"""Prompt files and plain texts as `dtrt bench` (its datasets, `--held-out`) and `dtrt train-drafter` (`--prompts`)
feed the target: each the first user message of a chat, as `dtrt run` renders one, where the target's tokenizer has
a template (Qwen3: thinking off)."""

import json
from pathlib import Path

from dtrt.errors import DtrtError
from dtrt.frontend.requests import has_chat_template, render_chat
from dtrt.runtime.tokenizer import open_tokenizer


def read_prompts(path, target_path: Path, chat: bool, flag: str = "--prompts") -> list[str]:
    """Prompts from JSONL ({"prompt": ...} or {"turns": [...]}) or plain text lines, chat-templated if asked and
    the target's tokenizer has a template: each one's first user message."""
    return as_chat([turns[0] for _, turns in prompt_file(path, flag)], target_path, chat)


def prompt_file(path, flag: str) -> list[tuple[str, tuple[str, ...]]]:
    """(id, the user's turns) of each prompt of a file: JSONL, a line each, {"prompt": "..."} or {"turns": ["...",
    ...]} (a later turn follows the answer to the earlier ones) with an optional "id" (default: the line number);
    any other file, one single-turn prompt a non-blank line. One-line errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise DtrtError(f"{flag} {path}: not found")
    prompts = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            prompts.append((str(i), (line,)))
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise DtrtError(f"{path}:{i}: not valid JSON") from None
        turns = None if not isinstance(rec, dict) else [rec["prompt"]] if "prompt" in rec else rec.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise DtrtError(f"{path}:{i}: needs a 'prompt' string or 'turns', a list of strings")
        prompts.append((str(rec.get("id", i)), tuple(turns)))
    return prompts


def as_chat(texts: list[str], target_path: Path, chat: bool) -> list[str]:
    """Each text as the first user message of a chat, as `dtrt run` and `dtrt bench` render it (Qwen3: thinking
    off), when asked and the target's tokenizer has a template; else the texts themselves."""
    tokenizer = open_tokenizer(target_path)
    if chat and has_chat_template(tokenizer):
        return [render_chat(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    return list(texts)
