"""Held-out tau of trained drafters, measured exactly as `dtrt train-drafter` measures each checkpoint (DominoTree
at budget 16 and the DFlash chain, T=0, torch backend, `--eval-tokens` new tokens), so a shipped drafter can be set
beside a run's `log.jsonl`. Tau at T=0 does not depend on timing: this runs on a busy machine.

    python benchmarks/held_out_tau.py --model smollm2-135m --drafter shipped=dtrt/assets/smollm2-135m/domino \\
        --drafter new=runs/smollm2/domino --held-out mt-bench --held-out humaneval --eval-prompts 10
"""

import argparse
import itertools
import json

import torch

from dtrt.bench.datasets import held_out_set
from dtrt.launch import resolve_spec
from dtrt.launch.start import load_pair
from dtrt.models.checkpoint import load_drafter, load_target
from dtrt.models.draft_vocab import load_draft_vocab
from dtrt.runtime.tokenizer import load_tokenizer
from dtrt.train.config import TrainConfig
from dtrt.train.trainer import held_out_tau


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="registry name of the target")
    ap.add_argument(
        "--drafter",
        action="append",
        default=[],
        help="NAME=DIR of a Domino checkpoint (repeatable); default: the model's own",
    )
    ap.add_argument(
        "--draft-vocab",
        action="append",
        default=[],
        help="NAME=FILE of a draft vocabulary (dtrt draft-vocab; repeatable): every drafter again over it",
    )
    ap.add_argument("--no-full", action="store_true", help="with --draft-vocab: those vocabularies only")
    ap.add_argument("--held-out", action="append", default=[], help="as train-drafter's (repeatable)")
    ap.add_argument("--eval-prompts", type=int, default=TrainConfig.eval_prompts)
    ap.add_argument("--eval-tokens", type=int, default=TrainConfig.eval_tokens)
    ap.add_argument("--no-chat", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pair = load_pair(resolve_spec(model=args.model, backend="torch"))
    drafters = dict(d.split("=", 1) for d in args.drafter) or {"shipped": pair.domino}
    sets = dict(
        held_out_set(v, pair.target, not args.no_chat, args.eval_prompts) for v in args.held_out or ["mt-bench"]
    )
    target, tokenizer = load_target(pair.target), load_tokenizer(pair.target)
    cfg = TrainConfig(eval_prompts=args.eval_prompts, eval_tokens=args.eval_tokens)
    ids = {name: [tokenizer.encode(p, add_special_tokens=False) for p in texts] for name, texts in sets.items()}
    print("| drafter | " + " | ".join(f"{s} dominotree / dflash" for s in ids) + " | mean |")
    print("|---|" + "---|" * (len(ids) + 1))
    rows = []
    vocabs = ({} if args.no_full else {"full": None}) | {
        v.split("=", 1)[0]: load_draft_vocab(v.split("=", 1)[1], target.cfg.vocab_size) for v in args.draft_vocab
    }
    for (dname, path), (vname, vocab) in itertools.product(drafters.items(), vocabs.items()):
        name = dname if not args.draft_vocab else f"{dname} / {vname}"
        tau = held_out_tau(target, load_drafter(path), tokenizer, ids, cfg, vocab)
        rows.append({"drafter": dname, "draft_vocab": vname, "path": str(path), "tau": tau})
        cells = [f"{t['dominotree']:.2f} / {t['dflash']:.2f}" for t in tau["sets"].values()]
        print(f"| {name} | " + " | ".join(cells) + f" | {tau['dominotree']:.2f} / {tau['dflash']:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
