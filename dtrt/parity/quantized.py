"""What `dtrt parity` adds for a quantized target (`dtrt export --quant`).

1. Weights: the target stage under ONNX Runtime with fp32 activations (MatMulNBits accuracy level 0) against the
   PyTorch target multiplying by the same dequantized weights (dtrt.models.quant.dequantized), at the fp32
   tolerance: a wrong integer or scale fails here.
2. Kernel: the stage as the runtime runs it (accuracy level 4: activations quantized to int8 per block of 32)
   against the same reference, at check.ACT_TOLERANCE. Rounding each activation to 8 bits moves every matrix
   product by up to half a step of its block's scale, and the layers compound it: the logits stay close (cosine
   ~0.999) but are no longer within the fp32 bound. The quantized model the methods reproduce is this
   kernel's, not the reference's.
3. Order: that quantized model is what every method reproduces only if a tree's verify rows equal, bit for bit,
   the rows plain decoding computes for the same tokens (a last-bit difference moves an int8 rounding and grows to
   whole logits). The check runs both on this machine's kernels: plain decoding token by token (each call padded
   to the export's min_rows, as the runtime does) and one verify call holding the same chain interleaved with
   distractor branches, and one holding a chain of an odd number of nodes alone (each padded as the runtime pads
   it: target_rows), inside one aligned attention block; every output row must be identical.
"""

import numpy as np
import torch

from dtrt.artifacts.export import Export
from dtrt.runtime.backends.exported import first_rows, pad_rows, pairs_rows, target_rows
from dtrt.runtime.backends.kv import past_feeds
from dtrt.runtime.backends.onnxruntime import NUMPY_TYPES, OrtRunner

ORDER_DEPTH = 6  # chain tokens per order case
CACHE_SPARE = 5  # positions of the cache after the past (NaN: a stage that reads them fails the check)


def order_cases(exp: Export) -> list[int]:
    """Past lengths of the order check: a short past, and one past the first aligned block (when it fits)."""
    align = exp.manifest["ordered_attention"]["align"]
    pasts = [9]
    if align + 5 + 2 * ORDER_DEPTH + 2 <= exp.max_context:
        pasts.append(align + 5)
    return pasts


def order_check(exp: Export, seed: int = 0) -> list[tuple[str, str, np.ndarray, np.ndarray]]:
    """(case, output, plain decoding's rows, the tree's rows) for every target output over the order cases."""
    meta = exp.manifest["ordered_attention"]
    runner = OrtRunner(exp, threads=1)
    runner.open("target")
    vocab = exp.manifest["target"]["vocab_size"]
    rng = np.random.default_rng(seed)
    past_type = NUMPY_TYPES[runner.inputs("target")["past_k"]]
    names = runner.output_names("target")
    even = pairs_rows(exp)

    def run(ids, positions, mask, past_k, past_v):
        past = past_k.shape[2]
        # as the runtime's cache: the past in the first positions of a bigger buffer, the rest not zeros
        spare = [(0, 0), (0, 0), (0, CACHE_SPARE), (0, 0)]
        past_k, past_v = (np.pad(c, spare, constant_values=np.nan) for c in (past_k, past_v))
        out = runner("target", ids=ids, positions=positions, mask=mask, **past_feeds(past_k, past_v, past))
        return {name: t.numpy() for name, t in out.items()}

    def call(ids, positions, mask, past_k, past_v):
        """A target call as the runtime makes it: padded to target_rows."""
        n = len(ids)
        if (rows := target_rows(n, meta["min_rows"], even)) > n:
            padded = pad_rows(*map(torch.from_numpy, (ids, positions, mask)), rows)
            ids, positions, mask = (t.numpy() for t in padded)
        return first_rows(run(ids, positions, mask, past_k, past_v), n)

    rows = []
    for past in order_cases(exp):
        ids = rng.integers(0, vocab, past + ORDER_DEPTH)
        dims = exp.manifest["target"]
        empty = np.zeros((dims["num_layers"], dims["num_kv_heads"], 0, dims["head_dim"]), past_type)
        pre = run(ids[:past], np.arange(past), np.tril(np.ones((past, past), bool)), empty, empty)
        k, v = pre["new_k"], pre["new_v"]
        plain = []
        for i in range(ORDER_DEPTH):  # plain decoding: one token per call over the growing past
            out = call(ids[past + i : past + i + 1], np.array([past + i]), np.ones((1, 1), bool), k, v)
            plain.append(out)
            k, v = np.concatenate([k, out["new_k"]], 2), np.concatenate([v, out["new_v"]], 2)
        # one verify: a distractor sibling before each chain node, the chain at the odd rows
        n = 2 * ORDER_DEPTH
        tokens, positions = np.zeros(n, np.int64), np.zeros(n, np.int64)
        mask = np.zeros((n, n), bool)
        chain: list[int] = []
        for i in range(ORDER_DEPTH):
            for row, token in ((2 * i, rng.integers(0, vocab)), (2 * i + 1, ids[past + i])):
                tokens[row], positions[row] = token, past + i
                mask[row, chain] = True
                mask[row, row] = True
            chain.append(2 * i + 1)
        tree = call(tokens, positions, mask, pre["new_k"], pre["new_v"])
        # and a chain of an odd number of nodes alone, as the runtime calls it
        odd = ORDER_DEPTH - 1 + ORDER_DEPTH % 2
        alone = call(
            ids[past : past + odd],
            past + np.arange(odd),
            np.tril(np.ones((odd, odd), bool)),
            pre["new_k"],
            pre["new_v"],
        )
        for name in names:
            want = np.concatenate([p[name] for p in plain], axis=0 if name in ("logits", "hidden") else -2)
            got = tree[name][chain] if name in ("logits", "hidden") else tree[name][..., chain, :]
            rows.append((f"tree = plain decoding, P={past}", name, want, np.ascontiguousarray(got)))
            want = want[:odd] if name in ("logits", "hidden") else want[..., :odd, :]
            rows.append((f"odd chain = plain decoding, P={past}", name, want, np.ascontiguousarray(alone[name])))
    return rows
