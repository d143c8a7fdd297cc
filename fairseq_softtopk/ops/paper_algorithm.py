"""The published SOFT top-k algorithm, re-implemented as a baseline (not used by the package).

Follows the paper's Algorithm 1 and appendix B as published: squared-distance cost divided
by its maximum over the whole batch (detached), a fixed number of Sinkhorn iterations (200
by default; the kernel form above epsilon = 1e-2, falling back to the log-domain form on
NaN, the log-domain form below), and the closed-form backward of appendix B with an explicit
``k x k`` inverse. Tests compare our solvers with it at convergence; ``scripts/bench/bench_ops.py``
times it as published.
"""

from typing import Tuple

import torch
from torch import Tensor


def _sinkhorn_kernel(C: Tensor, mu: Tensor, nu: Tensor, epsilon: float, n_iter: int) -> Tensor:
    G = torch.exp(-C / epsilon)
    v = torch.ones_like(nu) / nu.shape[-1]
    for _ in range(n_iter):
        u = mu / (G * v).sum(-1, keepdim=True)
        v = nu / (G * u).sum(-2, keepdim=True)
    return u * G * v


def _sinkhorn_log_domain(C: Tensor, mu: Tensor, nu: Tensor, epsilon: float, n_iter: int) -> Tensor:
    f = torch.zeros_like(C[..., :1])
    g = torch.zeros_like(C[..., :1, :])
    for _ in range(n_iter):
        f = -epsilon * torch.logsumexp(-(C - g) / epsilon, -1, keepdim=True) + epsilon * torch.log(mu)
        g = -epsilon * torch.logsumexp(-(C - f) / epsilon, -2, keepdim=True) + epsilon * torch.log(nu)
    return torch.exp((-C + f + g) / epsilon)


def _appendix_b_backward(grad_plan: Tensor, plan: Tensor, mu: Tensor, nu: Tensor, epsilon: float) -> Tensor:
    """dL/dC from dL/dGamma by the appendix-B formula (explicit inverse of the k x k kappa)."""
    inv_mu = 1.0 / mu.reshape(1, -1)  # (1, n)
    plan_t = plan[..., :-1]  # Gamma without its last column, (b, n, m-1)
    kappa = torch.diag_embed(nu[..., :-1].reshape(1, -1)) - (plan_t.transpose(-1, -2) * inv_mu.unsqueeze(-2)) @ plan_t
    inv_kappa = torch.inverse(kappa)
    plan_mu = inv_mu.unsqueeze(-1) * plan_t
    L = plan_mu @ inv_kappa  # (b, n, m-1)
    G1 = grad_plan * plan
    g1 = G1.sum(-1)
    G21 = (g1 * inv_mu).unsqueeze(-1) * plan
    g1_L = g1.unsqueeze(-2) @ L  # (b, 1, m-1)
    G22 = (g1_L @ plan_mu.transpose(-1, -2)).transpose(-1, -2) * plan
    G23 = -torch.nn.functional.pad(g1_L, (0, 1)) * plan
    g2 = G1.sum(-2).unsqueeze(-1)[..., :-1, :]  # (b, m-1, 1)
    G31 = -(L @ g2) * plan
    G32 = torch.nn.functional.pad((inv_kappa @ g2).transpose(-1, -2), (0, 1)) * plan
    return (-G1 + G21 + G22 + G23 + G31 + G32) / epsilon


class PaperSinkhornFunction(torch.autograd.Function):
    """Cost ``(b, n, m)`` -> plan, forward by fixed-count Sinkhorn, backward by appendix B."""

    @staticmethod
    def forward(ctx, C: Tensor, mu: Tensor, nu: Tensor, epsilon: float, n_iter: int) -> Tensor:
        with torch.no_grad():
            if epsilon > 1e-2:
                plan = _sinkhorn_kernel(C, mu, nu, epsilon, n_iter)
                if bool(torch.isnan(plan).any()):
                    plan = _sinkhorn_log_domain(C, mu, nu, epsilon, n_iter)
            else:
                plan = _sinkhorn_log_domain(C, mu, nu, epsilon, n_iter)
        ctx.save_for_backward(mu, nu, plan)
        ctx.epsilon = epsilon
        return plan

    @staticmethod
    def backward(ctx, grad_plan: Tensor):
        mu, nu, plan = ctx.saved_tensors
        with torch.no_grad():
            grad_C = _appendix_b_backward(grad_plan, plan, mu, nu, ctx.epsilon)
        return grad_C, None, None, None, None


def paper_soft_topk(scores: Tensor, k: int, epsilon: float = 0.1, n_iter: int = 200,
                    sorted: bool = False) -> Tuple[Tensor, Tensor]:
    """The paper's operator on ``(batch, n)`` scores; returns ``(output, plan)``.

    ``sorted=False`` (Algorithm 1): anchors ``[0, 1]``, nu ``[k/n, (n-k)/n]``, output ``(batch, n)``
    marks the k *smallest* scores. ``sorted=True`` (the appendix code): anchors ``k, ..., 0``,
    nu ``[1/n]*k + [(n-k)/n]``, output ``(batch, n, k)``, rank 0 = the *largest* score.
    The cost is normalised by its maximum over the whole batch, as published.
    """
    b, n = scores.shape
    if sorted:
        anchors = torch.arange(k, -1, -1, dtype=scores.dtype, device=scores.device)
        nu = torch.tensor([1.0 / n] * k + [(n - k) / n], dtype=scores.dtype, device=scores.device)
    else:
        anchors = torch.tensor([0.0, 1.0], dtype=scores.dtype, device=scores.device)
        nu = torch.tensor([k / n, (n - k) / n], dtype=scores.dtype, device=scores.device)
    C = (scores.unsqueeze(-1) - anchors) ** 2
    C = C / C.max().detach()
    mu = torch.full((1, n, 1), 1.0 / n, dtype=scores.dtype, device=scores.device)
    plan = PaperSinkhornFunction.apply(C, mu, nu.view(1, 1, -1), epsilon, n_iter)
    out = n * (plan[..., :k] if sorted else plan[..., 0])
    return out, plan


def paper_marginal_error(plan: Tensor, k: int, sorted: bool) -> float:
    """Our :class:`SolverInfo` measure on a plan of the paper: max relative anchor-mass error."""
    n = plan.shape[-2]
    counts = n * plan.detach().sum(-2)
    target = torch.tensor([1.0] * k + [n - k] if sorted else [k, n - k], dtype=plan.dtype, device=plan.device)
    err = ((counts - target).abs() / target.clamp_min(1.0)).amax()
    return float(err)
