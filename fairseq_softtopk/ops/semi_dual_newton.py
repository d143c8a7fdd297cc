"""The solver of sorted SOFT top-k: damped Newton on the semi-dual of its transport problem.

The problem is the canonical one of :mod:`._common` with ``A = k``: entropic OT between the
``n`` valid prepared scores ``z`` of a row (mass 1 each, in count units) and ``k + 1`` anchors
``y = k, k-1, ..., 0`` with the linear cost ``-z_i * y_r`` at temperature ``eps`` (per row).
Anchor ``r < k`` must receive one element (rank r, r = 0 the best) and anchor ``k`` (the rest)
the other ``n - k``. The plan's rows are softmaxes over anchors,

    P_ir = softmax_r(z_i * y_r / eps + g_r),

and the anchor potentials ``g`` (``g_k = 0``) maximise the concave semi-dual

    F(g) = sum_{r<k} g_r - sum_i logsumexp_r(z_i * y_r / eps + g_r),

whose gradient is the marginal violation ``1 - sum_i P_ir`` and whose negative Hessian is
``K = diag(sum_i P_i) - sum_i P_i P_i^T`` (k x k, :func:`~.semi_dual_hessian.anchor_hessian`). :func:`newton_solve`
returns the plan ``(rows, k + 1, n)``, anchors first, once every anchor's marginal is within a
relative ``tol`` (:class:`SolverInfo`); row marginals are exact by construction. How:

* start from potentials whose rank boundaries sit midway between consecutive hard-sorted
  scores (:func:`~.semi_dual_warm_start.hard_start`) or, for large smooth rows, from the solution on a histogram of
  the scores (:func:`~.semi_dual_warm_start.binned_start`);
* Sinkhorn-like rescaling while it pays off (:func:`_rescale`: far from the optimum the
  semi-dual is exponential), then Newton steps with a backtracking line search
  (:func:`_maximise`): a few iterations where Sinkhorn needs hundreds at small epsilon;
* when most elements lie far below the best ``k + 1``, on the window of the others only
  (:func:`~fairseq_softtopk.ops.candidate_window`), confirmed afterwards from the solution.

:class:`~.semi_dual.SemiDual` evaluates the objective, :mod:`.semi_dual_hessian` forms and solves
the k x k systems (also for the operator's backward pass, the implicit differentiation of
``grad F(g) = 0`` in :mod:`.sorted_soft_topk`), :mod:`.semi_dual_warm_start` gives the starting points.
"""

import dataclasses
import math
from typing import Tuple

import torch
from torch import Tensor

from ._common import PreparedScores
from ._solver_info import SolverInfo
from .candidate_window import candidate_window
from .semi_dual import SemiDual, SemiDualPoint, SemiDualProblem, anchors, merge_rows, rescaling_step, take_rows
from .semi_dual_hessian import solve_ridged
from .semi_dual_warm_start import binned_start, hard_start

_ARMIJO = 1e-4
_MAX_BACKTRACK = 12
_RESCALE_STEPS = 4
_RESCALE_GAIN = 8.0  # rescaling continues while each step divides the marginal error by this much
_WINDOW_GAP = 2.0  # first guess of the rank/rest boundary's distance below the (k+1)-th best, in epsilons


def _rescale(dual: SemiDual, point: SemiDualPoint, tol: float, max_steps: int) -> Tuple[SemiDualPoint, int]:
    """Sinkhorn-like steps ``g_r += log(target_r / count_r)`` while they pay off.

    From the hard start at a large epsilon, an anchor can receive a hundred times its mass;
    Newton then only removes about one unit of ``log(count / target)`` per step (the
    semi-dual is exponential there), while one rescaling removes it all, and in smooth
    problems a second one often lands within 1e-4. Rows more than 100% off are rescaled,
    and go on while each step divides their marginal error by :data:`_RESCALE_GAIN` (at
    small epsilon Sinkhorn's linear rate is slow: Newton takes over). A step is kept for the
    rows whose error it lowers. At most ``max_steps`` steps (the solve's iteration budget);
    returns the point reached and the number of steps.
    """
    k, steps = dual.k, 0
    going = point.err > 1.0  # each row's course depends on that row alone
    for _ in range(min(_RESCALE_STEPS, max_steps)):
        if not bool(going.any()):
            break
        step = torch.where(going.unsqueeze(-1), rescaling_step(dual.target, point.counts, k, dual.no_rest), 0.0)
        trial = dual.evaluate(point.g + torch.nn.functional.pad(step, (0, 1)))
        steps += 1
        better = going & (trial.err < point.err)
        going = better & (trial.err * _RESCALE_GAIN <= point.err) & (trial.err > tol)
        point = merge_rows(~better, trial, point)
    return point, steps


def _maximise(dual: SemiDual, g: Tensor, tol: float, max_iter: int) -> Tuple[SemiDualPoint, int]:
    """Damped Newton on the semi-dual from ``g`` (after :func:`_rescale`); returns the point reached
    and the number of iterations, rescaling steps included: at most ``max_iter`` of both together."""
    k = dual.k
    point, rescaled = _rescale(dual, dual.evaluate(g), tol, max_iter)
    n_iter, stalled = 0, 0
    for n_iter in range(1, max_iter - rescaled + 1):
        active = point.err > tol
        if stalled >= 3 or not bool(active.any()):
            n_iter -= 1
            break
        grad = (dual.target - point.counts)[:, :k]
        step = solve_ridged(dual.hessian(point.P), grad, point.P.dtype).nan_to_num_(0.0, 0.0, 0.0)
        step = torch.nn.functional.pad(step.mul_(active.unsqueeze(-1)), (0, 1))  # g_k stays 0
        alpha, F = None, None
        for _ in range(_MAX_BACKTRACK):
            trial = dual.evaluate(point.g + step if alpha is None else torch.addcmul(point.g, alpha, step))
            # A step that lowers the marginal error is accepted; otherwise Armijo on F decides
            # (computed only then: in float32, F's rounding can hide real progress near the optimum).
            ok = (trial.err < point.err) | ~active
            if bool(ok.all()):
                break
            if F is None:
                F, slope = dual.objective(point), (grad * step[:, :k]).sum(-1, keepdim=True)
                alpha = torch.ones_like(slope)  # (rows, 1)
            ok |= (dual.objective(trial) >= F + _ARMIJO * (alpha * slope).squeeze(-1))
            if bool(ok.all()):
                break
            alpha = torch.where(ok.unsqueeze(-1), alpha, 0.5 * alpha)
        # At the floating-point floor (float32 sums over large n), progress stops; give up then.
        stalled = 0 if bool((active & (trial.err < 0.99 * point.err)).any()) else stalled + 1
        point = merge_rows(~ok, trial, point)  # rows whose step never became acceptable keep their potentials
    return point, n_iter + rescaled


def newton_solve(prep: PreparedScores, k: int, tol: float, max_iter: int) -> Tuple[Tensor, SolverInfo]:
    """Maximises the semi-dual of the prepared rows by damped Newton; returns the plan ``(rows, k+1, n)`` and info.

    Elements far below the best ``k + 1`` (in units of epsilon) belong to the rest anchor
    up to ``exp(margin)``; Newton runs on the window of the others only (the top few hundred
    of tens of thousands of beam candidates, say; :func:`candidate_window`, with a first
    boundary gap of :data:`_WINDOW_GAP` epsilons). The window widens until the solution
    confirms that every element left out puts less than ``tol / 100`` in total on the ranks.

    ``max_iter`` bounds the iterations (Newton and rescaling steps) of all the solves together,
    windows and the full problem: each solve gets what the previous ones left, and the info
    reports their sum. Where a window is not confirmed and nothing is left, the full problem is
    evaluated at the last window's potentials (its marginal error is the one reported).
    """
    problem = SemiDualProblem.prepared(prep, k)
    z, valid, n_valid, eps, top = problem.z, problem.valid, problem.n_valid, problem.eps, problem.top
    rows, n = z.shape
    no_rest = problem.no_rest
    g = hard_start(top, no_rest, eps, k)
    # At most n_valid - k elements are left out; each may put exp(margin) on a rank.
    out_of_window = (n_valid - k).clamp_min(1).double().unsqueeze(-1)
    margin = torch.log(0.01 * tol / out_of_window)  # (rows, 1), negative
    edge = top[:, -1:] if top.shape[-1] > k else top[:, -1:] - 1.0
    floor = candidate_window(edge, k, eps, tol, out_of_window, boundary_gap=_WINDOW_GAP)
    cut = torch.where(no_rest.unsqueeze(-1), torch.full_like(edge, -math.inf), floor)
    # Where every entry lies above the cut (smooth problems), one reduction tells, without a mask.
    dense = problem.all_valid and bool((z.amin(-1, keepdim=True) >= cut).all())
    used = 0  # iterations of the window solves so far
    while not dense:
        inside = z >= cut
        if not problem.all_valid:
            inside &= valid
        width = int(inside.sum(-1).max())
        if width > n // 2:
            break
        index = torch.where(inside, z, -math.inf).topk(width, dim=-1).indices
        z_w, inside_w = z.gather(-1, index), inside.gather(-1, index)
        window = SemiDualProblem(z_w, inside_w, inside.sum(-1).to(n_valid.dtype), eps, top, k)
        solved, n_iter = _solve_rows(window, g, tol, max_iter - used)
        used += n_iter
        # The best element left out must give every rank less than exp(margin) of its mass.
        best_out = torch.where(valid & ~inside, z, -math.inf).amax(-1, keepdim=True).double()
        y = anchors(k, g)[:k]
        rank_logit = (best_out * y / eps.double() + solved.g[:, :k]).amax(-1, keepdim=True)
        if bool((rank_logit < margin).all()):
            P = z.new_zeros(rows, k + 1, n)
            P[:, k] = valid.to(z.dtype)
            P.scatter_(2, index.unsqueeze(1).expand(-1, k + 1, -1), solved.P)
            P[:, k].scatter_(1, index, torch.where(inside_w, solved.P[:, k], valid.gather(-1, index).to(z.dtype)))
            return P, _info(solved.err, used, tol)
        if used >= max_iter:  # no iteration left for another solve: the full problem where the window ended
            g = solved.g
            break
        cut = cut + (margin - _WINDOW_GAP).to(z.dtype) * eps  # widen the window and solve again
    solved, n_iter = _solve_rows(problem, g, tol, max_iter - used, warm_start=used < max_iter)
    return solved.P, _info(solved.err, used + n_iter, tol)


def fixed_newton_solve(prep: PreparedScores, k: int, tol: float, max_iter: int) -> Tuple[Tensor, SolverInfo]:
    """:func:`newton_solve` without host synchronisation: exactly ``max_iter`` iterations on all
    ``n`` elements (no candidate windows, no histogram start), for CUDA graphs and
    ``torch.compile(fullgraph=True)``. Returns the plan ``(rows, k + 1, n)`` and an info whose
    ``converged`` and ``marginal_error`` are 0-dim tensors.

    The same steps as :func:`_maximise`, each decided per row on the device: up to
    :data:`_RESCALE_STEPS` Sinkhorn-like rescalings (at most half of ``max_iter``; kept where they
    lower the error, stopped per row as in :func:`_rescale`), then Newton steps whose line search is spread over the
    iterations: a trial at the row's step length ``alpha`` is kept if it lowers the marginal
    error or passes Armijo's test; ``alpha`` doubles (up to 1) after a kept step and halves
    after a rejected one. Rows within ``tol`` stop moving, so the result of a converged call is
    the default solver's up to the tolerance. The plan's logits are formed in float64 (the rule
    that decides it otherwise reads the data).
    """
    problem = SemiDualProblem.prepared(prep, k)
    dual = SemiDual(problem, tol, fixed=True)
    g = hard_start(problem.top, problem.no_rest, problem.eps, k)
    point = dual.evaluate(g)
    going = point.err > 1.0
    n_rescale = min(_RESCALE_STEPS, max_iter // 2)  # steps, as counted by the default solver: at least half Newton
    for _ in range(n_rescale):
        step = torch.where(going.unsqueeze(-1), rescaling_step(dual.target, point.counts, k, dual.no_rest), 0.0)
        trial = dual.evaluate(point.g + torch.nn.functional.pad(step, (0, 1)))
        better = going & (trial.err < point.err)
        going = better & (trial.err * _RESCALE_GAIN <= point.err) & (trial.err > tol)
        point = take_rows(better, trial, point)
    alpha = torch.ones_like(point.err).unsqueeze(-1)  # (rows, 1)
    for _ in range(max_iter - n_rescale):
        active = point.err > tol
        grad = (dual.target - point.counts)[:, :k]
        step = solve_ridged(dual.hessian(point.P), grad, point.P.dtype, blocked=False).nan_to_num_(0.0, 0.0, 0.0)
        step = torch.nn.functional.pad(step * alpha, (0, 1))  # g_k stays 0
        trial = dual.evaluate(point.g + step)
        slope = (grad * step[:, :k]).sum(-1)
        ok = active & ((trial.err < point.err) |
                       (dual.objective(trial) >= dual.objective(point) + _ARMIJO * slope))
        point = take_rows(ok, trial, point)
        alpha = torch.where(ok.unsqueeze(-1), (2.0 * alpha).clamp_max(1.0), 0.5 * alpha)
    max_err = point.err.amax() if point.err.numel() else point.err.new_zeros(())
    return point.P, SolverInfo(converged=max_err <= tol, n_iter=max_iter, marginal_error=max_err)


def _solve_rows(problem: SemiDualProblem, g: Tensor, tol: float, max_iter: int,
                warm_start: bool = True) -> Tuple[SemiDualPoint, int]:
    """Newton from the hard start ``g`` (or a binned warm start, unless ``warm_start`` is False);
    returns the solved point and iterations (``max_iter = 0``: the point at ``g``)."""
    if not problem.all_valid and bool(problem.valid.all()):
        problem = dataclasses.replace(problem, all_valid=True)
    dual = SemiDual(problem, tol)
    warm = binned_start(problem, g, tol) if warm_start else None
    return _maximise(dual, g if warm is None else warm, tol, max_iter)


def _info(err: Tensor, n_iter: int, tol: float) -> SolverInfo:
    max_err = float(err.max()) if err.numel() else 0.0
    return SolverInfo(converged=max_err <= tol, n_iter=n_iter, marginal_error=max_err)
