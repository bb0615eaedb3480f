"""What a quantized target's ordered attention costs: the same export timed as it is and with every layer's
attention taken out (its output replaced by the queries: the rest of the call, weights, norms and rotations, left
as they are), side by side in one process, calls shaped as the runtime makes them (benchmarks/verify_cost.py).
The difference bounds what any faster attention could save; the copy without attention computes nonsense and is
only timed.

    python benchmarks/attention_cost.py --export exports/smollm2-int4 --n 1,2,5 --past 256,1024
"""

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import onnx
from onnx import helper
from verify_cost import add_export_args, exports_from, measure, table

from dtrt.artifacts.export import load_export
from dtrt.artifacts.files import MANIFEST, write_manifest

ATTENTION = "TreeAttentionPlanned"


def without_attention(src: Path, dst: Path) -> Path:
    """A copy of the export at `src` under `dst` whose target's attention returns its queries (the weights file
    linked where it can be)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():  # ONNX Runtime reads external data from the model's own directory only
        if f.is_dir():
            shutil.copytree(f, dst / f.name)
        elif f.name not in ("target.onnx", MANIFEST):
            try:
                os.link(f, dst / f.name)
            except OSError:  # another filesystem
                shutil.copy2(f, dst / f.name)
    model = onnx.load(str(src / "target.onnx"), load_external_data=False)
    fn = next((f for f in model.functions if f.name == ATTENTION), None)
    if fn is None:
        raise SystemExit(f"{src}: its target has no {ATTENTION} (export it with --quant int8 or int4)")
    del fn.node[:]
    fn.node.append(helper.make_node("Identity", [fn.input[0]], [fn.output[0]]))
    onnx.save_model(model, str(dst / "target.onnx"))
    write_manifest(dst, json.loads((src / MANIFEST).read_text()))
    return dst


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_export_args(ap, "int4")
    ap.add_argument("--n", default="1,2,5", help="new tokens per call")
    ap.add_argument("--past", default="256,1024", help="past lengths")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    work = Path(tempfile.mkdtemp(prefix="dtrt-attention-"))
    try:
        exports = {}
        for i, (name, exp) in enumerate(exports_from(args).items()):
            exports[name] = exp
            exports[f"{name} without attention"] = load_export(without_attention(exp.path, work / str(i)))
        rows = measure(exports, ints(args.n), ints(args.past), ints(args.threads), args.repeats, args.warmup, 0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("milliseconds per target call (ratio to the same export's N=1)")
    print(table(rows, ints(args.n)))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
