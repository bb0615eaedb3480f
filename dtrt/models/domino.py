"""Domino's correction head in the released layout: a bias-free GRU over the realized path and a bottleneck
projection to the full vocabulary, added to the drafter's base logits.

    delta  = W2 . SiLU(W1 [z; s])              W1 = embed_proj.0.weight [E, H+G], W2 = embed_proj.2.weight [V, E]
    s'     = GRU(e(token), s)                  gate order (r, z, n), no biases, e = the target's embedding
"""

import torch
import torch.nn.functional as F
from torch import nn

HEAD_TENSORS = ("prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight")
# where checkpoints keep the head's tensors: flat (the released Domino-b16 files), nested under `logit_head.` (older
# Domino checkpoints) or under `logits_correction.` (the speculators layout); the names below the prefix are the same
HEAD_PREFIXES = ("", "logit_head.", "logits_correction.")
HEAD_MODULES = ("prefix_gru.", "embed_proj.")


class DominoHead(nn.Module):
    def __init__(self, hidden: int, gru_dim: int, emb_dim: int, vocab: int):
        super().__init__()
        self.hidden, self.gru_dim, self.emb_dim, self.vocab = hidden, gru_dim, emb_dim, vocab
        self.prefix_gru = nn.GRU(hidden, gru_dim, num_layers=1, bias=False, batch_first=True)
        self.embed_proj = nn.Sequential(
            nn.Linear(hidden + gru_dim, emb_dim, bias=False), nn.SiLU(), nn.Linear(emb_dim, vocab, bias=False)
        )

    @staticmethod
    def dims_from_shapes(shapes: dict[str, tuple[int, ...]]) -> tuple[int, int]:
        """(G, E) from the checkpoint's tensor shapes."""
        return shapes["prefix_gru.weight_hh_l0"][1], shapes["embed_proj.0.weight"][0]

    @property
    def w2(self):
        return self.embed_proj[2].weight

    def gru(self, x, s):
        """One GRU step. x [..., H] (target embedding of the realized token), s [..., G]."""
        gi = F.linear(x, self.prefix_gru.weight_ih_l0)
        gh = F.linear(s, self.prefix_gru.weight_hh_l0)
        i_r, i_z, i_n = gi.chunk(3, -1)
        h_r, h_z, h_n = gh.chunk(3, -1)
        r = torch.sigmoid(i_r + h_r)
        z = torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        return (1 - z) * n + z * s

    def zero_state(self, *lead, dtype=None, device=None):
        return torch.zeros(*lead, self.gru_dim, dtype=dtype or self.w2.dtype, device=device or self.w2.device)

    def bottleneck(self, z, s):
        """SiLU(W1 [z; s]) [..., E]; z [..., H] is a drafter row, s [..., G] a path state."""
        return F.silu(self.embed_proj[0](torch.cat((z, s), dim=-1)))

    def delta(self, z, s, columns=None):
        """Full-vocabulary correction [..., V], or only the vocabulary entries `columns` [C] ([..., C])."""
        return F.linear(self.bottleneck(z, s), self.w2 if columns is None else self.w2[columns])
