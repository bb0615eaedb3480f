"""The grammar engines' mask time per token on the CPU: llguidance and xgrammar, one thread, on JSON schemas (nested
objects, enums, arrays, numbers) with a target's tokenizer (SmolLM2-135M-Instruct's by default: the embedded
default's, converted into the dtrt cache on first use).

Each schema's instance (a valid JSON document) is tokenized; for every token the engine computes the mask of the
state before it (timed), then consumes the token. Reported: the median and 90th percentile over every token of every
instance, repeated `--repeats` times, and the grammar's compile time.

    python benchmarks/grammar_mask.py
    python benchmarks/grammar_mask.py --tokenizer DIR --repeats 20 --json out.json
"""

import argparse
import json
import os
import statistics
import time

SCHEMAS = {
    "nested": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "address": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "address"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "address": {"city": "London", "zip": "W1"}},
    ),
    "enum": (
        {
            "type": "object",
            "properties": {
                "colour": {"enum": ["red", "green", "blue"]},
                "size": {"type": "string", "enum": ["small", "medium", "large"]},
            },
            "required": ["colour", "size"],
            "additionalProperties": False,
        },
        {"colour": "green", "size": "large"},
    ),
    "array": (
        {
            "type": "object",
            "properties": {
                "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
                "points": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                        "required": ["x", "y"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["tags", "points"],
            "additionalProperties": False,
        },
        {"tags": ["sea", "haiku"], "points": [{"x": 1, "y": 2}, {"x": -3, "y": 40}]},
    ),
    "numbers": (
        {
            "type": "object",
            "properties": {
                "price": {"type": "number", "minimum": 0},
                "count": {"type": "integer", "minimum": 0, "maximum": 100},
                "ratio": {"type": "number"},
            },
            "required": ["price", "count", "ratio"],
            "additionalProperties": False,
        },
        {"price": 12.5, "count": 7, "ratio": -0.125},
    ),
}


JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # dtrt.runtime.grammar's


def smollm2_tokenizer_dir() -> str:
    from pathlib import Path

    from dtrt.zoo.smollm2 import target_dir

    cache = Path(os.environ.get("DTRT_CACHE", Path.home() / ".cache" / "dtrt"))
    return str(target_dir(cache))


class Llguidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll, self.lt = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer)
        self.mask = llguidance.torch.allocate_token_bitmask(1, self.tokenizer.vocab_size)

    def compile(self, schema):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        matcher = self.ll.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill(self, matcher):
        self.lt.fill_next_token_bitmask(matcher, self.mask, 0)

    def consume(self, matcher, token):
        if not matcher.consume_token(token):
            raise ValueError(f"llguidance refused token {token}: {matcher.get_error()}")


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=len(hf_tokenizer))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self.mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)

    def compile(self, schema):
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher):
        matcher.fill_next_token_bitmask(self.mask)

    def consume(self, matcher, token):
        if not matcher.accept_token(token):
            raise ValueError(f"xgrammar refused token {token}")


def measure(engine, hf_tokenizer, repeats: int) -> dict:
    rows, times = {}, []
    for name, (schema, instance) in SCHEMAS.items():
        tokens = hf_tokenizer.encode(json.dumps(instance), add_special_tokens=False)
        t0 = time.perf_counter()
        matcher = engine.compile(schema)
        compile_s = time.perf_counter() - t0
        per = []
        for _ in range(repeats):
            matcher = engine.compile(schema)
            for t in tokens:
                t0 = time.perf_counter()
                engine.fill(matcher)
                per.append(time.perf_counter() - t0)
                engine.consume(matcher, t)
        times += per
        rows[name] = {"tokens": len(tokens), "compile_ms": compile_s * 1e3, "mask_us_median": _us(per, 0.5)}
    return {"schemas": rows, "mask_us_median": _us(times, 0.5), "mask_us_p90": _us(times, 0.9)}


def _us(xs, q: float) -> float:
    return statistics.quantiles(xs, n=100)[int(q * 100) - 1] * 1e6 if q != 0.5 else statistics.median(xs) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", help="a directory with tokenizer.json (default: SmolLM2-135M-Instruct's)")
    ap.add_argument("--engines", default="llguidance,xgrammar")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    hf = AutoTokenizer.from_pretrained(args.tokenizer or smollm2_tokenizer_dir(), local_files_only=True)
    report = {"tokenizer": args.tokenizer or "smollm2-135m", "vocab": len(hf)}
    for name in args.engines.split(","):
        engine = {"llguidance": Llguidance, "xgrammar": Xgrammar}[name](hf)
        report[name] = measure(engine, hf, args.repeats)
        r = report[name]
        print(f"{name}: mask {r['mask_us_median']:.1f} us median, {r['mask_us_p90']:.1f} us p90 per token")
        for schema, row in r["schemas"].items():
            print(
                f"  {schema:8s} {row['tokens']:3d} tokens  mask {row['mask_us_median']:7.1f} us  "
                f"compile {row['compile_ms']:.1f} ms"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
