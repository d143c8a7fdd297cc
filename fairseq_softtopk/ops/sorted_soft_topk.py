"""Sorted SOFT top-k (Xie et al., NeurIPS 2020, section 2.3 and appendix B).

Entropic OT between the n valid scores (mass 1 each, in count units) and k+1 anchors
``y = k, k-1, ..., 0``: anchor ``r < k`` receives one element (rank r, r = 0 the best) and
anchor ``k`` the other ``n - k``. With the linear cost ``-z_i * y_r`` (see ``_common``), the
plan's rows are softmaxes over anchors,

    P_ir = softmax_r(z_i * y_r / eps + g_r),        output A[i, r] = P_ir, r < k,

and the anchor potentials ``g`` (``g_k = 0``) maximise the concave semi-dual

    F(g) = sum_{r<k} g_r - sum_i logsumexp_r(z_i * y_r / eps + g_r),

whose gradient is the marginal violation ``1 - sum_i P_ir`` and whose negative Hessian is
the paper's ``K = diag(sum_i P_i) - sum_i P_i P_i^T`` (k x k). Newton steps with a
backtracking line search converge in a few iterations from the hard thresholds, where
Sinkhorn needs hundreds at small epsilon. The backward pass differentiates the optimality
condition ``grad F(g) = 0`` (implicit function theorem): one k x k solve per row.
"""

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from ._common import SolverInfo, check_inputs, hard_topk_indices, log_floor, prepare_scores, restore_shape
from .soft_topk import _oriented_rows

_ARMIJO = 1e-4
_MAX_BACKTRACK = 12


def _anchors(k: int, like: Tensor) -> Tensor:
    """``(k + 1,)`` anchors ``k, k-1, ..., 0`` in ``like``'s dtype and device."""
    return torch.arange(k, -1, -1, dtype=like.dtype, device=like.device)


def anchor_hessian(P: Tensor, k: int, no_rest: Tensor) -> Tensor:
    """``K = sum_i (diag(P_i) - P_i P_i^T)`` over the first k anchors, in float64.

    With ``G = P P^T`` (Gram matrix over all k+1 anchors), the off-diagonal entries are
    ``-G_rs`` and, because every row of the plan sums to 1, the diagonal
    ``sum_i P_ir (1 - P_ir)`` equals ``sum_{s != r} G_rs``: a sum of positive terms, which
    keeps its precision when the plan is nearly hard (``1 - P_ir`` would cancel). Rows
    without a rest anchor (``n_valid == k``) have the constant vector in the null space of
    ``K``; ``1 1^T`` is added there, which changes no solution of a consistent system (their
    right-hand sides sum to 0).

    Args:
        P: ``(rows, k + 1, n)`` plan in count units, anchors first (columns sum to 1 or 0).
        no_rest: ``(rows,)`` bool.
    Returns:
        ``(rows, k, k)`` float64.
    """
    gram = torch.bmm(P, P.transpose(1, 2)).double()  # (rows, k+1, k+1)
    off = gram.clone()
    off.diagonal(dim1=-2, dim2=-1).zero_()
    K = -off[:, :k, :k]
    K.diagonal(dim1=-2, dim2=-1).copy_(off[:, :k].sum(-1))
    return K + no_rest.double()[:, None, None]


def _solve(K: Tensor, rhs: Tensor) -> Tensor:
    """Batched symmetric solve ``K x = rhs`` in float64, with a tiny ridge for exact singularity."""
    ridge = 1e-13 * K.diagonal(dim1=-2, dim2=-1).abs().amax(-1).clamp_min(1e-300)
    eye = torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)
    return torch.linalg.solve(K + ridge[:, None, None] * eye, rhs.unsqueeze(-1)).squeeze(-1)


class _SemiDual:
    """The semi-dual objective of one batch of rows, evaluated at anchor potentials ``g``.

    Tensors are laid out anchors first, ``(rows, k+1, n)``, so that the softmax over anchors
    is elementwise across ``k+1`` contiguous vectors and the sums over elements are contiguous.
    """

    def __init__(self, z: Tensor, valid: Tensor, n_valid: Tensor, eps: Tensor, k: int):
        self.k, self.floor = k, log_floor(z.dtype)
        self.valid = None if bool(valid.all()) else valid.unsqueeze(1).to(z.dtype)
        self.zy = (_anchors(k, z) / eps).unsqueeze(-1) * z.unsqueeze(1)  # (rows, k+1, n)
        self.no_rest = n_valid == k
        self.rest_bias = torch.where(self.no_rest, -math.inf, 0.0).double()
        self.target = torch.ones(z.shape[0], k + 1, dtype=torch.float64, device=z.device)
        self.target[:, k] = (n_valid - k).double()

    def evaluate(self, g: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """Returns ``(F (rows,), P (rows, k+1, n), counts (rows, k+1), error (rows,))``."""
        shift = g.clone()
        shift[:, self.k] += self.rest_bias
        logits = self.zy + shift.to(self.zy.dtype).unsqueeze(-1)
        # One exp pass gives both the softmax and the logsumexp; in-place to save memory.
        top = logits.amax(1, keepdim=True)
        P = logits.sub_(top).clamp_min_(self.floor).exp_()
        total = P.sum(1, keepdim=True)
        P.div_(total)
        lse = top + total.log()  # (rows, 1, n)
        if self.valid is not None:
            P.mul_(self.valid)
            lse = lse * self.valid
        counts = P.sum(-1).double()  # summing in float64 would copy all of P
        F = (g[:, : self.k] * self.target[:, : self.k]).sum(-1) - lse.double().sum((1, 2))
        rel = (counts - self.target).abs() / self.target.clamp_min(1.0)
        rel[:, self.k] = torch.where(self.no_rest, 0.0, rel[:, self.k])
        return F, P, counts, rel.amax(-1)

    def hard_start(self, top: Tensor, eps: Tensor) -> Tensor:
        """Potentials whose rank boundaries sit midway between consecutive hard-sorted scores.

        Args:
            top: ``(rows, min(k + 1, n))`` the largest valid scores, decreasing.
        """
        k = self.k
        top = top.double()
        if top.shape[-1] == k:  # n == k
            top = torch.cat([top, top[:, -1:] - 1.0], dim=-1)
        top[:, k] = torch.where(self.no_rest, top[:, k - 1] - 1.0, top[:, k])
        thresholds = 0.5 * (top[:, :-1] + top[:, 1:])  # boundary between rank r and r+1
        g = torch.zeros(top.shape[0], k + 1, dtype=torch.float64, device=top.device)
        g[:, :k] = -thresholds.flip(-1).cumsum(-1).flip(-1) / eps.double()
        return g


def _newton_solve(z: Tensor, valid: Tensor, n_valid: Tensor, eps: Tensor, top: Tensor, k: int, tol: float,
                  max_iter: int) -> Tuple[Tensor, SolverInfo]:
    """Maximises the semi-dual by damped Newton; returns the plan ``(rows, k+1, n)`` and info."""
    dual = _SemiDual(z, valid, n_valid, eps, k)
    g = dual.hard_start(top, eps)
    F, P, counts, err = dual.evaluate(g)
    n_iter, stalled = 0, 0
    for n_iter in range(1, max_iter + 1):
        active = err > tol
        if not bool(active.any()) or stalled >= 3:
            n_iter -= 1
            break
        grad = (dual.target - counts)[:, :k]
        step = _solve(anchor_hessian(P, k, dual.no_rest), grad).nan_to_num(0.0, 0.0, 0.0) * active.unsqueeze(-1)
        slope = (grad * step).sum(-1)
        alpha = torch.ones_like(slope)
        for _ in range(_MAX_BACKTRACK):
            g_try = g.clone()
            g_try[:, :k] += alpha.unsqueeze(-1) * step
            F_try, P_try, counts_try, err_try = dual.evaluate(g_try)
            # Armijo on F; in float32 F's rounding can hide real progress near the optimum,
            # so a step that lowers the marginal error is accepted as well.
            ok = (F_try >= F + _ARMIJO * alpha * slope) | (err_try < err) | ~active
            if bool(ok.all()):
                break
            alpha = torch.where(ok, alpha, 0.5 * alpha)
        # At the floating-point floor (float32 sums over large n), progress stops; give up then.
        stalled = stalled + 1 if bool((err_try[active] > 0.99 * err[active]).all()) else 0
        g, F, P, counts, err = g_try, F_try, P_try, counts_try, err_try
    max_err = float(err.max()) if err.numel() else 0.0
    return P, SolverInfo(converged=max_err <= tol, n_iter=n_iter, marginal_error=max_err)


class SortedSoftTopKFunction(torch.autograd.Function):
    """Sorted soft top-k from a solved plan; backward by implicit differentiation (O(nk))."""

    @staticmethod
    def forward(z: Tensor, P: Tensor, eps: Tensor, no_rest: Tensor) -> Tensor:
        return P[:, :-1].transpose(1, 2).contiguous()  # (rows, n, k)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, P, eps, no_rest = inputs
        ctx.save_for_backward(P, eps, no_rest)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        # logits_ir = z_i y_r / eps + g_r(z), P_i = softmax(logits_i), optimality: sum_i P_ir = 1.
        # With G the output gradient padded by a zero column, Gbar_i = sum_r P_ir G_ir and
        # ybar_i = sum_r P_ir y_r:
        #   direct:   eps * dL/dz_i |_g = sum_r P_ir y_r G_ir - Gbar_i ybar_i
        #   implicit: K dg = -sum_i P_i (y - ybar_i) dz_i / eps, so with b_r = sum_i P_ir (G_ir - Gbar_i)
        #             and u = K^{-1} b (k x k solve): eps * dL/dz_i -= sum_r P_ir y_r u_r - ybar_i sum_r P_ir u_r.
        P, eps, no_rest = ctx.saved_tensors  # P: (rows, k+1, n)
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        k = P.shape[1] - 1
        y = _anchors(k, P)
        G = torch.nn.functional.pad(grad_output.to(P.dtype).transpose(1, 2), (0, 0, 0, 1))  # (rows, k+1, n)
        PG = P * G
        G_bar = PG.sum(1)  # (rows, n)
        y_row = y.expand(P.shape[0], 1, -1)  # (rows, 1, k+1)
        y_bar = torch.bmm(y_row, P).squeeze(1)
        direct = torch.bmm(y_row, PG).squeeze(1) - G_bar * y_bar
        b = PG[:, :k].sum(-1, dtype=torch.float64) - torch.bmm(P[:, :k], G_bar.unsqueeze(-1)).squeeze(-1).double()
        u = torch.nn.functional.pad(_solve(anchor_hessian(P, k, no_rest), b), (0, 1)).to(P.dtype)
        weights = torch.stack([y * u, u], dim=1)  # (rows, 2, k+1)
        Pyu, Pu = torch.bmm(weights, P).unbind(1)
        implicit = Pyu - y_bar * Pu
        return (direct - implicit) / eps, None, None, None


def sorted_soft_topk(scores: Tensor, k: int, *, dim: int = -1, largest: bool = True, epsilon: float = 0.1,
                     mask: Optional[Tensor] = None, tol: float = 1e-5, max_iter: int = 50,
                     cost: str = "linear", hard: bool = False, return_info: bool = False):
    """Sorted SOFT top-k: a smoothed "which element has rank r" for the k best ranks.

    The hard counterpart is the permutation slice ``P[i, r] = 1`` iff ``i ==
    torch.topk(scores, k).indices[r]``; this returns, for every entry ``i`` and rank ``r``,
    a soft indicator: columns sum to 1 (one element per rank), each entry's row sums to at
    most 1, and it tends to the hard slice as ``epsilon -> 0``.

    Args:
        scores: ``(*, n, *)`` floating tensor (float16/bfloat16 are solved in float32).
        k: number of ranks, ``1 <= k <= `` valid entries per row.
        dim: dimension holding the ``n`` candidates.
        largest: rank 0 is the largest (True) or the smallest (False) score.
        epsilon: entropic regularisation, > 0, in the unit that ``cost`` gives it.
        mask: optional bool tensor of ``scores``' shape, True = excluded; ``-inf`` entries
            (``+inf`` with ``largest=False``) are excluded too. Excluded entries get exactly 0.
        tol: relative marginal error at which Newton stops (see :class:`SolverInfo`).
        max_iter: Newton iterations at most.
        cost: ``"linear"`` (default; anchors ``k, ..., 0`` with cost ``-x_i * y_r``, epsilon in
            the units of the scores: with log-likelihood scores, in nats, at any vocabulary
            size), ``"sqeuclidean"`` (squared distance, same plan as linear at epsilon/2) or
            ``"paper"`` (squared distance divided by its row maximum, as the authors' code:
            anchors ``k, k-1, ..., 0``, nu = [1/n]*k + [(n-k)/n], output n times the first k
            columns of the plan).
        hard: return the exact permutation slices (no gradient through the selection).
        return_info: also return a :class:`SolverInfo`.

    Returns:
        ``(*, n, *, k)`` tensor in ``scores``' dtype: the rank dimension is appended last and
        ``n`` stays at ``dim``. With ``return_info=True``, ``(tensor, info)``.
    """
    check_inputs(scores, k, epsilon, mask, cost, tol, max_iter)
    prep = prepare_scores(scores, k, dim, largest, epsilon, mask, cost, n_anchor_steps=k)
    if hard:
        idx = hard_topk_indices(prep.z, k, prep.valid, largest=True)  # (rows, k)
        out = torch.zeros(*prep.z.shape, k, dtype=prep.z.dtype, device=prep.z.device)  # (rows, n, k)
        out.scatter_(1, idx.unsqueeze(1), 1.0)
        info = SolverInfo(True, 0, 0.0)
    else:
        P, info = _newton_solve(prep.z, prep.valid, prep.n_valid, prep.eps, prep.top, k, tol, max_iter)
        out = SortedSoftTopKFunction.apply(_oriented_rows(scores, dim, prep), P, prep.eps, prep.n_valid == k)
    out = restore_shape(out, scores, dim, extra=(k,)).to(scores.dtype)
    return (out, info) if return_info else out
