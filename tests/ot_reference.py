"""Independent computations the operator tests compare against (imported by the tests)."""

import math

import torch

from fairseq_softtopk.ops import sinkhorn_log


def sinkhorn_topk(x: torch.Tensor, k: int, epsilon: float, sorted: bool, tol: float = 1e-14):
    """Soft (sorted) top-k of the largest by unrolled log-domain Sinkhorn on the linear cost.

    Args:
        x: ``(rows, n)`` float64 scores (autograd flows through every iteration).
    Returns:
        ``(rows, n)`` (unsorted) or ``(rows, n, k)`` (sorted) outputs, n times the plan.
    """
    rows, n = x.shape
    anchors = torch.arange(k, -1, -1, dtype=x.dtype) if sorted else torch.tensor([1.0, 0.0], dtype=x.dtype)
    masses = [1.0] * k + [n - k] if sorted else [k, n - k]
    log_mu = torch.full((rows, n), -math.log(n), dtype=x.dtype)
    log_nu = torch.log(torch.tensor(masses, dtype=x.dtype) / n).expand(rows, -1)
    plan, _ = sinkhorn_log(-x.unsqueeze(-1) * anchors, log_mu, log_nu, epsilon, tol=tol, max_iter=100000)
    return n * (plan[..., :k] if sorted else plan[..., 0])
