"""`dtrt draft-vocab`: a reduced draft vocabulary counted from the target's own answers (FR-Spec's frequency
ranking, calibrated as VocabTrim recommends on the target's generations; SpecForge likewise counts assistant tokens
only).

The subset is the `size` most frequent answer tokens of `dtrt drafter-data` directories (ties: the lower id), plus,
always, every id that ends a generation, the tokenizer's special and added tokens, and the tokens the chat template
itself writes around a turn: a draft must be able to propose the end of an answer and the template's markup.
"""

import torch

from dtrt.errors import DtrtError
from dtrt.models.draft_vocab import DraftVocab
from dtrt.train.conversations import render_chat
from dtrt.train.datagen import load_rows

MARK = "\u2063"  # a character no template writes: what the template adds around it is its markup


def answer_counts(data_dirs, target_path, vocab_size: int) -> tuple[torch.Tensor, int]:
    """Counts [V] of the answer tokens (after each response row's prompt) of the drafter-data directories, and how
    many answer tokens there were."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for d in data_dirs:
        rows, _ = load_rows(d, target_path)
        for row in rows:
            if row.prompt < 0:  # a corpus row: text, not the target's answers
                continue
            counts += torch.bincount(
                torch.tensor(row.tokens[row.response_start :], dtype=torch.long), minlength=vocab_size
            )
    return counts, int(counts.sum())


def template_ids(tokenizer) -> set[int]:
    """The ids of what the chat template writes around a system, user and assistant turn (empty without one)."""
    if not getattr(tokenizer, "chat_template", None):
        return set()
    messages = [
        {"role": "system", "content": MARK},
        {"role": "user", "content": MARK},
        {"role": "assistant", "content": MARK},
    ]
    try:
        text = render_chat(tokenizer, messages)
    except DtrtError:
        text = render_chat(tokenizer, messages[1:])
    ids = set()
    for piece in text.split(MARK):
        if piece:
            ids.update(tokenizer(piece, add_special_tokens=False)["input_ids"])
    return ids


def always_kept(tokenizer, eos_ids) -> set[int]:
    """EOS ids, special and added tokens, and the chat template's markup."""
    keep = set(eos_ids) | set(tokenizer.all_special_ids)
    keep |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return keep | template_ids(tokenizer)


def choose(counts: torch.Tensor, size: int, keep: set[int]) -> torch.Tensor:
    """The `size` ids: `keep`, then the most frequent others (ties: the lower id)."""
    vocab = counts.numel()
    if size < len(keep):
        raise DtrtError(
            f"--size {size}: the ids always kept (EOS, special tokens, chat markup) are {len(keep)} already"
        )
    if size > vocab:
        raise DtrtError(f"--size {size}: the vocabulary has {vocab} tokens")
    order = sorted(range(vocab), key=lambda i: (-int(counts[i]), i))  # stable: ties by id
    chosen = set(keep)
    for i in order:
        if len(chosen) >= size:
            break
        chosen.add(i)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def build_draft_vocab(
    data_dirs, target_path, tokenizer, vocab_size: int, eos_ids, size: int
) -> tuple[DraftVocab, dict]:
    """The subset and what the file records of how it was made (the answer tokens it covers among them)."""
    counts, total = answer_counts(data_dirs, target_path, vocab_size)
    if total == 0:
        raise DtrtError(
            f"--data {', '.join(map(str, data_dirs))}: no answer tokens (only corpus rows?); write "
            "responses with `dtrt drafter-data --prompts FILE`"
        )
    keep = always_kept(tokenizer, eos_ids)
    vocab = DraftVocab.from_ids(choose(counts, size, keep), vocab_size)
    covered = int(counts[vocab.ids].sum())
    meta = {
        "size": vocab.size,
        "answer_tokens": total,
        "coverage": covered / total,
        "always_kept": len(keep),
        "seen": int((counts > 0).sum()),
    }
    return vocab, meta
