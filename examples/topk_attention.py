"""Top-k attention: softmax(scores + log A), A the SOFT top-k of the scores, next to plain softmax.

    python examples/topk_attention.py   # under a second on a CPU, after the imports
"""

import sys
from pathlib import Path

import math

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, installed or not

from fairseq_softtopk.modules import normalize_attention  # noqa: E402
from fairseq_softtopk.ops import soft_topk  # noqa: E402

# One query attending over eight keys (dimension 4): scaled dot-product scores, as in a Transformer.
query = torch.tensor([[1.0, 0.5, -0.5, 2.0]])                 # (1, 4)
keys = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 1.0, 0.0, 0.8], [-1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.2],
                     [1.0, 1.0, 1.0, 0.5], [-0.5, 0.5, 0.0, -1.0], [0.2, -0.3, 0.4, 0.9], [0.0, 1.0, -1.0, 0.0]])
scores = query @ keys.T / math.sqrt(query.shape[-1])          # (1, 8)
k, epsilon = 3, 0.1  # keep about 3 keys; epsilon in the units of the scores (fairseq's --attention-topk-epsilon)

# The package's normaliser (what --attention-normalizer soft_topk runs inside the models)...
soft = normalize_attention(scores, normalizer="soft_topk", k=k, epsilon=epsilon)
# ...is this formula: the soft top-k indicator A in [0, 1] (summing to k) pushes the other keys towards 0.
A = soft_topk(scores, k=k, epsilon=epsilon)
by_hand = torch.softmax(scores + torch.log(A), dim=-1)
plain = normalize_attention(scores, normalizer="softmax")
hard = normalize_attention(scores, normalizer="hard_topk", k=k)  # softmax over the exact top-k only


def show(label, row, count=True):
    """One row rounded to 3 decimals; with ``count``, how many keys hold more than 1% of the weight."""
    values = " ".join(f"{value:6.3f}" for value in row[0].tolist())
    print(f"{label:<14}{values}" + (f"   keys > 1%: {int((row > 0.01).sum())}" if count else ""))


print(f"one query, {keys.shape[0]} keys; k = {k}, epsilon = {epsilon}")
show("scores", scores, count=False)
show("soft top-k A", A, count=False)
show("softmax", plain)
show("soft_topk", soft)
show("hard_topk", hard)
print(f"soft_topk equals softmax(scores + log A): {torch.allclose(soft, by_hand, atol=1e-6)}")
print(f"weight outside the top {k}: softmax {1 - plain.topk(k).values.sum().item():.3f}, "
      f"soft_topk {1 - soft.topk(k).values.sum().item():.3f}, hard_topk {1 - hard.topk(k).values.sum().item():.3f}")
