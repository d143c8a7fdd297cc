"""The SOFT top-k operators on one small row of scores: what they return, next to torch.topk, and their gradient.

    python examples/operators.py        # under a second on a CPU, after the imports
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, installed or not

from fairseq_softtopk.ops import soft_topk, sorted_soft_topk  # noqa: E402

# One row of five scores; we select the k = 2 largest (entries 1 and 3).
scores = torch.tensor([[0.1, 2.0, 0.5, 1.5, -1.0]], requires_grad=True)
k = 2
# epsilon is in the units of the scores: 0.5 blurs the selection visibly (0.01 gives the hard top-k to 3 decimals).
epsilon = 0.5


def show(label, tensor):
    """Prints a tensor's values rounded to 3 decimals, one row per line (-0.0 shown as 0.0)."""
    rows = tensor.detach().reshape(-1, tensor.shape[-1]).tolist()
    print(label)
    for row in rows:
        print("   ", " ".join(f"{value + 0.0:7.3f}" for value in row))


# The hard selection: torch.topk's indices, as a 0/1 indicator.
hard = torch.zeros_like(scores).scatter(-1, scores.topk(k).indices, 1.0)
show(f"scores (k = {k}, epsilon = {epsilon})", scores)
show("hard top-k indicator", hard)

# soft_topk: how much of each entry is selected, in [0, 1]; a row sums to k (here 2).
A = soft_topk(scores, k=k, epsilon=epsilon)
show("soft_topk A (sums to k)", A)
print(f"    sum = {A.sum().item():.3f}")

# sorted_soft_topk: P[b, i, r] = how much entry i holds rank r; each rank's column sums to 1.
P = sorted_soft_topk(scores, k=k, epsilon=epsilon)
show("sorted_soft_topk P[0, :, r] for r = 0 (the best), 1", P[0].T)

# Both are differentiable: the gradient of a weighted sum of the selection with respect to the scores.
# It sums to 0: adding a constant to every score leaves the selection unchanged.
values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
(A * values).sum().backward()
show("d(sum_i values_i * A_i) / d scores, values = 1 2 3 4 5", scores.grad)
