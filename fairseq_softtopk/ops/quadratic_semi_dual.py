"""The solver of sorted sparse soft top-k: Newton on the semi-dual of quadratically regularised OT.

The transport problem is the one of sorted SOFT top-k (:mod:`.semi_dual_newton`): the ``n`` valid
prepared scores ``z`` of a row (mass 1 each, in count units) against ``k + 1`` anchors
``y = k, k-1, ..., 0`` with the linear cost ``-z_i * y_r``; anchor ``r < k`` receives one element
and anchor ``k`` (the rest) the other ``n - k``. The regulariser is ``(lambda / 2) ||P||^2``
instead of the entropy (Blondel, Seguy and Rolet, AISTATS 2018). In units of ``lambda``
(``x = z / lambda``, potentials ``b``), each row of the plan is a Euclidean projection onto the
simplex, which has exact zeros:

    P_i = proj_simplex(x_i * y + b),

and the potentials maximise the concave, piecewise quadratic semi-dual

    F(b) = sum_r nu_r b_r - sum_i [<v_i, P_i> - |P_i|^2 / 2],   v_i = x_i * y + b,

whose gradient is the marginal violation ``nu - sum_i P_i`` and whose negative (generalised) Hessian
is ``H = sum_i J_i``, ``J_i = diag(s_i) - s_i s_i^T / |s_i|`` with ``s_i`` the support of row ``i``.
:func:`quadratic_newton_solve` starts from the hard thresholds (rank boundaries midway between
consecutive sorted scores, exact for small lambda) and takes Newton steps with a backtracking line
search; once the supports settle, a step is exact (the semi-dual is quadratic on that piece). The
plan is formed in float64 (the line search compares objectives), ``(rows, n, k + 1)``: O(n k) memory.
"""

from typing import Tuple

import torch
from torch import Tensor

from ._common import PreparedScores, SolverInfo
from .simplex_projection import project_to_simplex

_ARMIJO = 1e-4
_MAX_BACKTRACK = 12  # halvings of a Newton step at most (adaptive solve)
_FIXED_BACKTRACK = 4  # step sizes tried in every fixed iteration: 1, 1/2, 1/4, 1/8
_RIDGE = 1e-9  # relative to the Hessian's scale: fixes the potentials' free directions (constant shifts)


def anchor_values(k: int, like: Tensor) -> Tensor:
    """``(k + 1,)`` anchors ``k, k-1, ..., 0`` in ``like``'s dtype and device."""
    return torch.arange(k, -1, -1, dtype=like.dtype, device=like.device)


class QuadraticSemiDual:
    """The semi-dual of one batch of rows: plans, objective, gradient and Hessian at potentials ``b``.

    Args:
        x: ``(rows, n)`` float64 scores over lambda (0 where excluded).
        valid: ``(rows, n)`` bool.
        k: ranks.
        nu: ``(rows, k + 1)`` float64 anchor marginals (1 per rank, ``n_valid - k`` for the rest).
    """

    def __init__(self, x: Tensor, valid: Tensor, k: int, nu: Tensor):
        self.x, self.valid, self.k, self.nu = x, valid, k, nu
        self.y = anchor_values(k, x)
        self.no_rest = (nu[:, k] == 0).view(-1, 1, 1)

    def plan(self, b: Tensor) -> Tuple[Tensor, Tensor]:
        """``(P, v)``: plan ``(rows, n, k + 1)`` (0 on excluded rows) and the projected values."""
        v = self.x.unsqueeze(-1) * self.y + b.unsqueeze(1)
        # rows of n_valid == k have no rest anchor: its value is put out of every projection's reach
        v = torch.cat([v[..., :-1], torch.where(self.no_rest, v[..., :-1].amax(-1, keepdim=True) - 2.0,
                                                v[..., -1:])], dim=-1)
        P, _ = project_to_simplex(v)
        return P * self.valid.unsqueeze(-1), v

    def objective(self, b: Tensor, P: Tensor, v: Tensor) -> Tensor:
        """``(rows,)`` ``F(b)``."""
        row_terms = ((v * P).sum(-1) - 0.5 * (P * P).sum(-1)) * self.valid
        return (self.nu * b).sum(-1) - row_terms.sum(-1)

    def marginal_error(self, P: Tensor) -> Tensor:
        """``(rows,)`` ``max_r |sum_i P_ir - nu_r| / nu_r`` (the rest anchor's over ``max(nu, 1)``)."""
        return ((P.sum(1) - self.nu).abs() / self.nu.clamp_min(1.0)).amax(-1)

    def newton_direction(self, P: Tensor) -> Tensor:
        """``(rows, k + 1)`` ``(H + ridge)^{-1} (nu - sum_i P_i)`` in float64."""
        support = (P > 0).to(P.dtype)
        return solve_support_hessian(support, self.nu - P.sum(1))


def support_hessian(support: Tensor) -> Tensor:
    """``H = sum_i (diag(s_i) - s_i s_i^T / |s_i|)`` of ``(rows, n, m)`` support indicators: ``(rows, m, m)``."""
    size = support.sum(-1, keepdim=True).clamp_min(1.0)
    H = -torch.bmm((support / size).transpose(1, 2), support)
    return H + torch.diag_embed(support.sum(1))


def solve_support_hessian(support: Tensor, rhs: Tensor) -> Tensor:
    """``(H + 1 1^T / m + ridge I)^{-1} rhs`` with ``H`` of :func:`support_hessian`, in float64.

    ``H`` annihilates the constant vector (a shift of every potential changes no plan); ``1 1^T / m``
    makes the system regular along it, and a ridge relative to ``H``'s scale along the shifts of
    disconnected groups of anchors (anchors that no row's support links). Right-hand sides that sum to 0
    on each such group (the gradient near the optimum, the backward's) are not changed by either.
    """
    H = support_hessian(support.double())
    m = H.shape[-1]
    scale = H.diagonal(dim1=-2, dim2=-1).amax(-1).clamp_min(1.0).view(-1, 1, 1)
    eye = torch.eye(m, dtype=H.dtype, device=H.device)
    regular = H + 1.0 / m + _RIDGE * scale * eye
    return torch.linalg.solve(regular, rhs.double().unsqueeze(-1)).squeeze(-1)


def hard_start(prep: PreparedScores, k: int, x_scale: Tensor) -> Tensor:
    """``(rows, k + 1)`` potentials (over lambda) whose rank boundaries sit midway between consecutive
    sorted scores: row ``i`` prefers rank ``r`` to ``r + 1`` iff ``x_i > b_{r+1} - b_r``."""
    top = prep.top.double()  # (rows, min(k + 1, n)), best first
    kth = top[:, k - 1: k]
    below = top[:, k: k + 1] if top.shape[-1] > k else kth - 1.0
    below = torch.where((prep.n_valid > k).unsqueeze(-1), below, kth - 1.0)
    boundaries = 0.5 * (top[:, : k - 1] + top[:, 1:k])
    boundaries = torch.cat([boundaries, 0.5 * (kth + below)], dim=-1) * x_scale  # (rows, k)
    return torch.cat([torch.zeros_like(kth), boundaries.cumsum(-1)], dim=-1)


def quadratic_newton_solve(prep: PreparedScores, k: int, tol: float, max_iter: int,
                           fixed_iterations: bool = False) -> Tuple[Tensor, Tensor, SolverInfo]:
    """The plan of the quadratically regularised sorted top-k (module docstring) for prepared rows.

    With ``fixed_iterations`` exactly ``max_iter`` Newton iterations run, each trying the same step
    sizes, with on-device convergence masks and no host synchronisation; the info's fields are tensors.

    Returns:
        ``(P, support, info)``: plan ``(rows, n, k + 1)`` in the prepared dtype (count units, anchors
        last: ranks ``0..k-1``, then the rest), its support (bool, from the float64 plan) and the info.
    """
    rows, n = prep.z.shape
    x_scale = 1.0 / prep.eps.double()  # (rows, 1)
    x = prep.z.double() * x_scale
    nu = torch.ones(rows, k + 1, dtype=torch.float64, device=x.device)
    nu[:, k] = prep.n_valid.double() - k
    dual = QuadraticSemiDual(x, prep.valid, k, nu)
    b = hard_start(prep, k, x_scale)
    P, v = dual.plan(b)
    F = dual.objective(b, P, v)
    err = dual.marginal_error(P)
    n_iter = 0
    for n_iter in range(1, max_iter + 1):
        done = err <= tol
        if not fixed_iterations and bool(done.all()):
            n_iter -= 1
            break
        direction = dual.newton_direction(P)
        slope = (direction * (nu - P.sum(1))).sum(-1)  # directional derivative of F, >= 0
        accepted = done.clone()
        step = 1.0
        for _ in range(_FIXED_BACKTRACK if fixed_iterations else _MAX_BACKTRACK):
            trial_b = b + step * direction
            trial_P, trial_v = dual.plan(trial_b)
            trial_F = dual.objective(trial_b, trial_P, trial_v)
            trial_err = dual.marginal_error(trial_P)
            # Armijo's sufficient ascent; near the optimum the objective's gain falls below its rounding
            # (it is quadratic in the marginal error), and a step that halves the error is taken instead
            take = ~accepted & ((trial_F >= F + _ARMIJO * step * slope) | (trial_err <= 0.5 * err))
            b = torch.where(take.unsqueeze(-1), trial_b, b)
            P = torch.where(take.view(-1, 1, 1), trial_P, P)
            F = torch.where(take, trial_F, F)
            err = torch.where(take, trial_err, err)
            accepted |= take
            if not fixed_iterations and bool(accepted.all()):
                break
            step *= 0.5
    if fixed_iterations:
        max_err = err.amax() if rows else err.new_zeros(())
        info = SolverInfo(converged=max_err <= tol, n_iter=n_iter, marginal_error=max_err)
    else:
        max_err = float(err.max()) if rows else 0.0
        info = SolverInfo(converged=max_err <= tol, n_iter=n_iter, marginal_error=max_err)
    return P.to(prep.z.dtype), P > 0, info
