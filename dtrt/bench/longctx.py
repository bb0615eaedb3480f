"""Long-context prompts for `dtrt bench`: the LONG datasets' documents (dtrt.bench.datasets) cut by the target's
tokenizer so that each whole prompt, SUMMARY_TEMPLATE and chat template included, fills a token-length bin.

A bin of B tokens holds prompts of B tokens, at most SLACK fewer and never more: the document is cut to B less the
template's tokens, the rendered prompt is measured as the contenders encode it, and the cut is moved until it fits (a
cut text can re-encode to a few tokens more or fewer than its slice). Each bin is a dataset of its own in the
records, in --resume's grid and in the report: `NAME/LABEL`, e.g. `essays/4k`.

    lexsum  the documents long enough to fill the bin, in the seeded order of datasets.load, each cut to its first
            tokens. A shorter document is never padded nor joined to another: a bin that fewer documents fill than
            asked for runs those (with a note), one that none fills is skipped (with a note). Prompt id: the
            document's index in the file.
    essays  non-overlapping windows of the essays' one text: the text is split into equal slots, each long enough
            for the bin's tokens (a sample's characters per token, with a margin), a seeded permutation orders the
            slots, and a window starts at the first word of its slot. Prompt id: the window's first character.

The default bins are 2K, 4K, 8K, ... that fit the context with the generation (Pipeline.prompt_room of every
contender), and the largest multiple of 1K that fits when it is larger than those (SmolLM2-135M, 8192 positions,
128 new tokens: 2K, 4K, 7K; from its first-use ONNX Runtime export, 4096 positions: 2K, 3K)."""

import re

import numpy as np

from dtrt.bench.contenders import render
from dtrt.bench.datasets import SUMMARY_TEMPLATE, Document, Prompt
from dtrt.errors import DtrtError

K = 1024
LADDER = tuple(K << i for i in range(1, 8))  # 2K ... 128K
SLACK = 8  # the most tokens a prompt may fall short of its bin
MIN_DOC = 64  # the fewest document tokens a bin must leave room for
SAMPLE = 100_000  # characters of the essays measured for their characters per token
MARGIN = 1.25  # an essay slot holds this many times the characters the bin's tokens take on average
WORD = re.compile(r"\s\S")


def label(b: int) -> str:
    """A bin's name in the dataset column: 4096 -> 4k, 3000 -> 3000."""
    return f"{b // K}k" if b % K == 0 else str(b)


def default_bins(room: int | None) -> list[int]:
    """The ladder's bins of at most `room` prompt tokens, and the largest multiple of 1K that fits if larger
    (None: no context limit, 2K, 4K, 8K)."""
    if room is None:
        return list(LADDER[:3])
    bins = [b for b in LADDER if b <= room]
    top = room // K * K
    if top >= K and (not bins or top > bins[-1]):
        bins.append(top)
    return bins


def resolve_bins(given: list[int] | None, pipe, max_new_tokens: int, names: list[str]) -> list[int]:
    """The bins, ascending: `given` (--context-bins) or the default, checked against `pipe`, the pipeline with the
    least room for a prompt next to `max_new_tokens`."""
    room = pipe.prompt_room(max_new_tokens)
    limit, source = pipe.backend.max_context, pipe.backend.context_source
    if given is None:
        bins = default_bins(room)
        if not bins:
            raise DtrtError(
                f"--datasets {','.join(names)}: with --max-new-tokens {max_new_tokens}, {source} ({limit}) leaves "
                f"room for {room} prompt tokens, less than the smallest bin ({K}); lower --max-new-tokens"
            )
        return bins
    for b in given:
        if room is not None and b > room:
            need = b + limit - room
            fix = pipe.backend.context_fix(need)
            raise DtrtError(
                f"--context-bins {b}: a prompt of {b} tokens + --max-new-tokens {max_new_tokens} + one tree need "
                f"{need} positions, but {source} is {limit}; give bins of at most {room} tokens, lower "
                f"--max-new-tokens{f', or raise the limit with `{fix}`' if fix else ''}"
            )
    return sorted(given)


class Cutter:
    """Measures and cuts prompts as the bench's contenders render (render: the chat template) and encode them."""

    def __init__(self, tokenizer, thinking: bool = False):
        self.tokenizer, self.thinking = tokenizer, thinking
        self.overhead = self.count(SUMMARY_TEMPLATE.format(doc=""))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False, verbose=False)

    def count(self, user: str) -> int:
        """The tokens of the whole prompt whose user message is `user`."""
        return len(self.encode(render(self.tokenizer, [], user, self.thinking)))

    def fill(self, ids: list[int], b: int) -> tuple[str, int] | None:
        """The user message of the longest head of the document `ids` whose prompt fits in `b` tokens, and the
        prompt's tokens; None when it falls more than SLACK short (the document is too short)."""
        best = None
        k = min(len(ids), b - self.overhead)
        for _ in range(8):  # a head's text re-encodes to its length give or take a few tokens: a step or two
            user = SUMMARY_TEMPLATE.format(doc=self.tokenizer.decode(ids[:k]))
            n = self.count(user)
            if n <= b and (best is None or n > best[1]):
                best = (user, n)
            step = min(len(ids), k + b - n)
            if n == b or step == k or step <= 0:
                break
            k = step
        return best if best is not None and best[1] >= b - SLACK else None


def prompts(
    docs: dict[str, list[Document]], bins: list[int], tokenizer, n: int, seed: int, thinking: bool, log
) -> dict[str, list[Prompt]]:
    """`n` prompts per (dataset, bin) of the LONG datasets in `docs`, as datasets `NAME/LABEL`; a bin that no
    document fills is left out with a note."""
    cut = Cutter(tokenizer, thinking)
    low = min(bins)
    if low < cut.overhead + MIN_DOC:
        raise DtrtError(
            f"--context-bins {low}: the summary instruction alone takes {cut.overhead} tokens of this model's "
            f"prompt; give bins of at least {cut.overhead + MIN_DOC} tokens"
        )
    out = {}
    for name, ds in docs.items():
        out |= (_lexsum if name == "lexsum" else _essays)(ds, bins, cut, n, seed, log)
    return out


def _lexsum(docs: list[Document], bins, cut: Cutter, n: int, seed: int, log) -> dict[str, list[Prompt]]:
    order = np.random.default_rng(seed).permutation(len(docs))
    ids: dict[int, list[int]] = {}
    out = {}
    for b in bins:
        need, got = b - cut.overhead, []
        for i in order:
            if len(got) == n:
                break
            doc = docs[i]
            # too few bytes for `need` tokens (a token covers a byte or more, give or take a word-start mark)
            if len(doc.text.encode()) + 8 < need:
                continue
            if i not in ids:
                ids[i] = cut.encode(doc.text)
            if len(ids[i]) >= need and (fit := cut.fill(ids[i], b)) is not None:
                got.append(Prompt(doc.id, (fit[0],)))
        _keep(out, f"lexsum/{label(b)}", got, n, log, f"no other Multi-LexSum document fills {b} tokens", why=(
            f"no Multi-LexSum document fills {b} tokens (the longest has {max(len(d.text) for d in docs)} "
            "characters); documents are not padded or joined"
        ))  # fmt: skip
    return out


def _essays(docs: list[Document], bins, cut: Cutter, n: int, seed: int, log) -> dict[str, list[Prompt]]:
    text = docs[0].text
    sample = text[:SAMPLE]
    chars_per_token = len(sample) / max(1, len(cut.encode(sample)))
    out = {}
    for b in bins:
        size = int((b - cut.overhead) * chars_per_token * MARGIN) + 64  # an essay slot's characters
        got = []
        for s in np.random.default_rng(seed).permutation(len(text) // size):
            if len(got) == n:
                break
            a = int(s) * size
            word = WORD.search(text, a, a + size) if a else None
            start = word.start() + 1 if word else a
            if (fit := cut.fill(cut.encode(text[start : a + size]), b)) is not None:
                got.append(Prompt(str(start), (fit[0],)))
        _keep(out, f"essays/{label(b)}", got, n, log, f"the essays hold no more windows of {b} tokens", why=(
            f"the essays hold no window of {b} tokens"
        ))  # fmt: skip
    return out


def _keep(out: dict, name: str, got: list[Prompt], n: int, log, short: str, why: str):
    """`got` as the dataset `name`, with a note when it holds fewer than `n` prompts (`short` says why), or none
    (`why`)."""
    if not got:
        log(f"{name} skipped: {why}")
        return
    if len(got) < n:
        log(f"{name}: {len(got)} of the {n} prompts asked for; {short}")
    out[name] = got
