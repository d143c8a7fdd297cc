"""Which candidates can carry a non-negligible part of a sorted soft top-k: the candidate window.

Sorted SOFT top-k over ``n`` candidates gives each of the k ranks one unit of mass (see
:mod:`.semi_dual_newton`). Candidates far below the ``k + 1`` best, in units of epsilon, put an
exponentially small part of it on the ranks; a solve that leaves them out (to the rest anchor)
changes nothing at the solver's tolerance. Soft beam search shrinks its ``k * V`` candidates to
this window before calling the operator, and the operator's solver works on it.
"""

import math
from typing import Optional, Union

import torch
from torch import Tensor


def candidate_window(kth: Tensor, k: int, epsilon: Union[float, Tensor], tol: float, n_out: Union[int, Tensor],
                     boundary_gap: Optional[float] = None) -> Tensor:
    """The floor of the window: candidates scoring below it carry less than ``tol / 100`` of any rank in total.

    The floor lies ``log(100 * n_out / tol) + boundary_gap`` epsilons below ``kth``, the
    (k+1)-th best score (linear cost; epsilon in the units of the scores). The bound it relies on,
    for the plan ``P_ir = softmax_r(z_i * y_r / eps + g_r)`` of anchors ``y = k, ..., 1, 0``
    (``0`` is the rest anchor, ``g_k = 0``) at the solver's potentials:

    * Every rank's logit ``l_r(z) = z * y_r / eps + g_r`` grows at least as fast as ``z / eps``
      (``y_r >= 1``), and the rest anchor's is 0. Let ``b`` be the rank/rest boundary, where
      ``max_r l_r(b) = 0``: a candidate ``d`` epsilons below it has every ``l_r <= -d``, so
      puts at most ``P_ir <= exp(l_r) <= exp(-d)`` on each rank.
    * The boundary lies at most ``log(k (1 + tol) / (1 - k tol))`` (about ``log k``) epsilons
      below ``kth``: were it ``d'`` below, each of the k+1 best would put at least
      ``sigmoid(d')`` on the ranks, whose total is at most ``k (1 + tol)`` (one unit per rank,
      within the solver's relative tolerance), so ``(k+1) sigmoid(d') <= k (1 + tol)``.
    * So with ``boundary_gap`` at least that, and ``n_out`` at least the number of candidates
      below the floor, each of those puts less than ``tol / (100 n_out)`` on a rank, all of
      them less than ``tol / 100``.

    The callers differ in what they can check afterwards, hence the parameters:

    * soft beam search cuts the k*V candidates before the operator and checks nothing: it uses
      the default ``boundary_gap = log(2 (k+1)^2)``, above the bound whenever ``k tol <= 1/2``,
      and ``n_out = n`` (every candidate column);
    * the solver (:func:`~fairseq_softtopk.ops.semi_dual_newton.newton_solve`) passes
      ``boundary_gap = 2`` (enough for k <= 7 at tol <= 1e-3) and ``n_out = n_valid - k`` per row, and confirms
      the ``tol / 100`` from its solution, widening the window where it does not hold.

    With a Python ``n_out`` the depth is evaluated in Python floats (as ``log(100 n_out / tol) +
    boundary_gap``), with a tensor per row in float64 (as ``boundary_gap - log(0.01 tol / n_out)``)
    and rounded to ``kth``'s dtype before the product with epsilon: the two orders the callers
    had before this function existed, kept so that their results are bit-identical.

    Args:
        kth: ``(rows, 1)`` the (k+1)-th best score of each row (``-inf`` where a row has fewer
            valid candidates: the floor is then ``-inf``, every candidate is kept).
        k: number of ranks (for the default ``boundary_gap``).
        epsilon: the linear cost's temperature, a number or ``(rows, 1)``.
        tol: the solver's tolerance; the window keeps all but ``tol / 100`` of every rank.
        n_out: an upper bound on the number of candidates below the floor, a number or ``(rows, 1)``.
        boundary_gap: how far below ``kth`` (in epsilons) the rank/rest boundary may lie.
    Returns:
        ``(rows, 1)`` in ``kth``'s dtype: the window is the candidates with ``score >= floor``.
    """
    if isinstance(n_out, Tensor):
        depth = _boundary_gap(k, boundary_gap) - torch.log(0.01 * tol / n_out.double())
        return kth - depth.to(kth.dtype) * epsilon
    return kth - window_depth(k, tol, n_out, boundary_gap) * epsilon


def window_depth(k: int, tol: float, n_out: int, boundary_gap: Optional[float] = None) -> float:
    """How far below the (k+1)-th best :func:`candidate_window`'s floor lies, in epsilons, for a Python
    ``n_out``: ``log(100 n_out / tol) + boundary_gap`` (default ``log(2 (k+1)^2)``), in Python floats."""
    return math.log(100.0 * n_out / tol) + _boundary_gap(k, boundary_gap)


def _boundary_gap(k: int, boundary_gap: Optional[float]) -> float:
    """``boundary_gap``, or its default ``log(2 (k+1)^2)``."""
    return math.log(2.0 * (k + 1) ** 2) if boundary_gap is None else boundary_gap
