"""Prompts for drafter data: conversations read from a JSONL file or text lines, and the prompt text of each turn
(through the target's chat template with thinking off, or plain text for a target without a template). The
user's turns come from the file; every answer is the target's own."""

import json
from dataclasses import dataclass
from pathlib import Path

from dtrt.errors import DtrtError
from dtrt.frontend.requests import render_chat

FORMATS = (
    '{"prompt": "..."}, {"turns": ["...", "..."]} or '
    '{"messages": [{"role": "system"|"user", "content": "..."}, ...]}, one object per line'
)


@dataclass(frozen=True)
class Conversation:
    turns: tuple[str, ...]  # the user's messages, in order; the assistant's answers are generated
    system: str | None = None
    kind: str | None = None  # what the prompt is (code, math, ...), when the file says


def _conversation(rec, where: str) -> Conversation:
    if not isinstance(rec, dict):
        raise DtrtError(f"{where}: expected a JSON object: {FORMATS}")
    kind = rec.get("kind") if isinstance(rec.get("kind"), str) else None
    if isinstance(rec.get("prompt"), str) and rec["prompt"]:
        return Conversation((rec["prompt"],), kind=kind)
    turns = rec.get("turns")
    if isinstance(turns, list) and turns and all(isinstance(t, str) and t for t in turns):
        return Conversation(tuple(turns), kind=kind)
    messages = rec.get("messages")
    if isinstance(messages, list) and messages:
        system, user = None, []
        for j, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("content"), str)):
                raise DtrtError(f"{where}: messages[{j}] needs 'role' and a 'content' string")
            if m.get("role") == "system" and j == 0:
                system = m["content"]
            elif m.get("role") == "user":
                user.append(m["content"])
            elif m.get("role") == "assistant":
                raise DtrtError(
                    f"{where}: messages[{j}] is an assistant message; the answers are the target's own, so give "
                    "only the system message and the user's turns"
                )
            else:
                raise DtrtError(f"{where}: messages[{j}] has role {m.get('role')!r}; expected system (first) or user")
        if user:
            return Conversation(tuple(user), system, kind)
    raise DtrtError(f"{where}: needs a non-empty 'prompt', 'turns' or 'messages': {FORMATS}")


def read_conversations(path) -> list[Conversation]:
    """The conversations of a .jsonl file (see FORMATS), or one single-turn conversation per non-empty line of
    any other file."""
    path = Path(path)
    if not path.is_file():
        raise DtrtError(f"--prompts {path}: not found")
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError as e:
        raise DtrtError(f"--prompts {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            out.append(Conversation((line,)))
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DtrtError(f"{path}:{i}: not valid JSON ({e.msg} at column {e.colno})") from None
        out.append(_conversation(rec, f"{path}:{i}"))
    if not out:
        raise DtrtError(f"--prompts {path}: no prompts in it ({FORMATS})")
    return out


def prompt_text(tokenizer, conv: Conversation, answers: list[str], chat: bool) -> str:
    """The prompt of turn len(answers): the conversation so far, the target's earlier answers included, through
    the chat template (thinking off where the template has it) when `chat`, else the turns' plain text, each
    followed by its answer, separated by blank lines."""
    t = len(answers)
    if not chat:
        parts = ([conv.system] if conv.system else []) + [u + a for u, a in zip(conv.turns, answers)]
        return "\n\n".join([*parts, conv.turns[t]])
    messages = [{"role": "system", "content": conv.system}] if conv.system else []
    for u, a in zip(conv.turns, answers):
        messages += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    messages.append({"role": "user", "content": conv.turns[t]})
    try:
        return render_chat(tokenizer, messages)  # thinking off, as `dtrt run` renders it
    except DtrtError as e:
        raise DtrtError(f"the chat template rejects a conversation ({e}); pass --no-chat to use plain text") from None
