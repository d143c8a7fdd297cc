"""Log-domain Sinkhorn for entropic OT: the reference the fast solvers are tested against.

Plain tensor operations only, so autograd can differentiate through the unrolled
iterations (the memory-hungry alternative to implicit differentiation that the paper's
section 7 discusses, and our test oracle for gradients).
"""

from typing import Tuple, Union

import torch
from torch import Tensor


def sinkhorn_log(cost: Tensor, log_mu: Tensor, log_nu: Tensor, epsilon: Union[float, Tensor],
                 max_iter: int = 10000, tol: float = 1e-12, check_every: int = 10) -> Tuple[Tensor, int]:
    """Entropic OT plan ``argmin <C, P> + eps * sum P log P`` s.t. ``P 1 = mu``, ``P^T 1 = nu``.

    Args:
        cost: ``(rows, n, m)`` cost matrices.
        log_mu: ``(rows, n)`` log row masses (``-inf`` removes an entry).
        log_nu: ``(rows, m)`` log column masses.
        epsilon: float, or ``(rows,)`` tensor of per-row temperatures; > 0.
        max_iter: iterations at most (one row and one column update each).
        tol: stop when the L1 row-marginal error of every row is below ``tol`` (the column
            marginals are exact after each column update).
        check_every: how often the error is checked (each check syncs with the device).
    Returns:
        ``(plan (rows, n, m), iterations used)``; differentiable by autograd in ``cost``.
    """
    rows = cost.shape[0]
    eps = torch.as_tensor(epsilon, dtype=cost.dtype, device=cost.device).expand(rows).reshape(rows, 1)
    removed = torch.isinf(log_mu)
    f = torch.zeros_like(log_mu)
    g = torch.zeros_like(log_nu)
    n_iter = 0
    for n_iter in range(1, max_iter + 1):
        # f_i = eps log mu_i - eps logsumexp_j((g_j - C_ij) / eps), and symmetrically for g.
        f = eps * log_mu.masked_fill(removed, 0.0) - eps * torch.logsumexp((g.unsqueeze(1) - cost) / eps.unsqueeze(-1), -1)
        scaled = ((f.unsqueeze(-1) - cost) / eps.unsqueeze(-1)).masked_fill(removed.unsqueeze(-1), -float("inf"))
        g = eps * log_nu - eps * torch.logsumexp(scaled, -2)
        if n_iter % check_every == 0 or n_iter == max_iter:
            row_err = (_plan(cost, f, g, eps, removed).sum(-1) - log_mu.exp()).abs().sum(-1)
            if bool((row_err <= tol).all()):
                break
    return _plan(cost, f, g, eps, removed), n_iter


def _plan(cost: Tensor, f: Tensor, g: Tensor, eps: Tensor, removed: Tensor) -> Tensor:
    logits = (f.unsqueeze(-1) + g.unsqueeze(1) - cost) / eps.unsqueeze(-1)
    return torch.exp(logits.masked_fill(removed.unsqueeze(-1), -float("inf")))
