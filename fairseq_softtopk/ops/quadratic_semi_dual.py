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

from typing import Optional, Tuple

import torch
from torch import Tensor

from ._common import PreparedScores
from ._solver_info import SolverInfo
from .semi_dual import anchors
from .semi_dual_warm_start import hard_start
from .simplex_projection import project_to_simplex

_ARMIJO = 1e-4
_MAX_BACKTRACK = 12  # halvings of a Newton step at most (adaptive solve)
_FIXED_BACKTRACK = 4  # step sizes tried in every fixed iteration: 1, 1/2, 1/4, 1/8
_RIDGE = 1e-9  # relative to the Hessian's scale: fixes the potentials' free directions (constant shifts)


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
        self.y = anchors(k, x)
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


def _newton(dual: QuadraticSemiDual, b: Tensor, tol: float, max_iter: int,
            fixed_iterations: bool) -> Tuple[Tensor, Tensor, Tensor, int]:
    """Newton with backtracking from potentials ``b``: ``(P, b, err, n_iter)`` (float64 plan and potentials,
    ``(rows,)`` marginal errors, iterations)."""
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
        slope = (direction * (dual.nu - P.sum(1))).sum(-1)  # directional derivative of F, >= 0
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
    return P, b, err, n_iter


#: the adaptive solve starts on this many of a row's best entries (``+ 4 k``), and widens by 4x until the rest
#: provably gives all its mass to the rest anchor
_WINDOW_MIN = 32


def quadratic_newton_solve(prep: PreparedScores, k: int, tol: float, max_iter: int,
                           fixed_iterations: bool = False, window_only: bool = False,
                           dtype: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor, Tensor, SolverInfo]:
    """The plan of the quadratically regularised sorted top-k (module docstring) for prepared rows.

    The adaptive solve runs on a window of each row's best ``m`` entries with the rest anchor's mass
    ``m_valid - k``, and checks the solution: with potentials ``b``, an entry of score ``x`` gives all of its
    mass to the rest anchor iff ``b_k - b_r - x (k - r) >= 1`` for every rank ``r``, which holds for every
    entry below the window once it holds for the best of them; the window's solution with those entries on
    the rest anchor then satisfies every optimality condition of the whole row (exact, not approximate).
    Where the check fails the window is widened (4x) and the row solved again.

    With ``fixed_iterations`` the whole row is solved in exactly ``max_iter`` Newton iterations, each trying
    the same step sizes, with on-device convergence masks and no host synchronisation; the info's fields are
    then tensors.

    Returns:
        ``(ranks, support, index, info)``: ``ranks`` ``(rows, n, k)`` the ranks' columns of the plan (count
        units) in the prepared dtype; ``support`` ``(rows, m, k + 1)`` bool, the plan's support on the
        entries ``index`` ``(rows, m)`` (the window; every entry outside it is on the rest anchor alone);
        and the info. With ``window_only``, ``ranks`` is the window's ``(rows, m, k)`` (not scattered into
        the whole rows). ``dtype``: the ranks' (default ``prep.z``'s: the sparse operators prepare float64 rows,
        :mod:`.sparse_rows`, and ask for the scores' working dtype).
    """
    rows, n = prep.z.shape
    x_scale = 1.0 / prep.eps.double()  # (rows, 1)
    # the entropic solver's start: rank boundaries midway between consecutive sorted scores, in units of eps;
    # the quadratic plan's rows prefer rank r to r + 1 at the same boundaries. Shifted to b_0 = 0 (a shift of b
    # changes no plan): potentials near 0 keep the line search's objective differences above rounding
    b_start = hard_start(prep.top, prep.n_valid == k, prep.eps, k)
    b_start = b_start - b_start[:, :1]
    m = n if fixed_iterations else min(n, _WINDOW_MIN + 4 * k)
    while True:
        if m < n:
            if prep.order is None:
                values, index = torch.where(prep.valid, prep.z, -torch.inf).topk(m + 1, dim=-1, sorted=True)
            else:  # the best by the scores: z's order, its ties (clamped entries) broken by the scores
                index = torch.where(prep.valid, prep.order, -torch.inf).topk(m + 1, dim=-1, sorted=True).indices
                values = torch.where(prep.valid.gather(-1, index), prep.z.gather(-1, index), -torch.inf)
            outside = values[:, m:].double() * x_scale  # the best entry below the window (-inf: none)
            values, index = values[:, :m], index[:, :m]
            valid = torch.isfinite(values)
            values = torch.where(valid, values, 0.0)
        else:
            index = torch.arange(n, device=prep.z.device).expand(rows, n)
            values, valid, outside = prep.z, prep.valid, None
        nu = torch.ones(rows, k + 1, dtype=torch.float64, device=prep.z.device)
        nu[:, k] = valid.sum(-1).double() - k
        dual = QuadraticSemiDual(values.double() * x_scale, valid, k, nu)
        P, b, err, n_iter = _newton(dual, b_start, tol, max_iter, fixed_iterations)
        if outside is None:
            break
        y = anchors(k, b)[:k]
        room = (b[:, k:] - b[:, :k] - outside * y).amin(-1)  # >= 1: the entries below are on the rest anchor
        if bool(((room >= 1.0) | ~torch.isfinite(outside.squeeze(-1))).all()):
            break
        m = min(n, 4 * m)
    dtype = prep.z.dtype if dtype is None else dtype
    ranks_window = P[..., :k].to(dtype)
    if m < n and not window_only:
        ranks = prep.z.new_zeros(rows, n, k, dtype=dtype)
        ranks.scatter_(1, index.unsqueeze(-1).expand(-1, -1, k), ranks_window)
    else:
        ranks = ranks_window
    if fixed_iterations:
        max_err = err.amax() if rows else err.new_zeros(())
        info = SolverInfo(converged=max_err <= tol, n_iter=n_iter, marginal_error=max_err)
    else:
        max_err = float(err.max()) if rows else 0.0
        info = SolverInfo(converged=max_err <= tol, n_iter=n_iter, marginal_error=max_err)
    return ranks, P > 0, index, info
