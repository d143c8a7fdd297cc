"""Sorted SOFT top-k on a static window of each row's best candidates, without host synchronisation.

A caller that mixes candidates by their weights (soft beam search over ``k x V`` candidates) needs the plan on the
candidates that can carry weight only: :func:`~.candidate_window.candidate_window` bounds them (every candidate
below its floor, ``log(100 n / tol) + log(2 (k+1)^2)`` epsilons under the (k+1)-th best score, gives less than
``tol / 100`` of any rank in total). :func:`sorted_soft_topk_window` takes the ``W`` best candidates of each row
(``torch.topk``: a static shape, no host read), solves the plan on them with a fixed number of iterations
(:func:`~.semi_dual_newton.fixed_newton_solve`, on-device convergence masks) and returns it with the window's
indices. The certificate is checked on the device: a row whose ``(W + 1)``-th best candidate is at or above the
floor may put more than ``tol / 100`` of a rank outside the window; it is *flagged*, never passed off as certified
(``info.overflow`` per row, ``info.n_overflow`` their count, both tensors), and its result is the plan of its ``W``
best candidates alone, which the caller must replace (the dense :func:`~.sorted_soft_topk.sorted_soft_topk`, or a
wider ``width``). Soft beam search reads the count once per batch and searches a batch with a flagged row again on
the dense path.

The gradient is the dense operator's on the window (implicit differentiation of the window's plan,
:class:`~.sorted_soft_topk.SortedSoftTopKFunction`) and zero outside it, which for a certified row is the dense
gradient to the solver's tolerance: the candidates outside carry less than ``tol / 100`` of every rank.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ._common import check_inputs
from ._solver_info import SolverInfo
from .candidate_window import candidate_window
from .kernels.backend import check_backend
from .sorted_soft_topk import sorted_soft_topk

__all__ = ["WindowSolverInfo", "default_window_width", "sorted_soft_topk_window"]

#: window widths by epsilon (in the scores' units), for k = 5: 2-6 times the largest certified window measured on
#: the beam steps of the shipped Multi30k Transformer (832 rows of 38,840 candidates: at epsilon 0.03 a median of 12
#: candidates, p99 26, largest 36; at 0.1 a median of 59, p99 184, largest 214); wider epsilons get wider windows
#: (the floor's depth grows with epsilon); above the last, every candidate
_WIDTHS = ((0.05, 64), (0.15, 512), (0.5, 2048))


@dataclass
class WindowSolverInfo(SolverInfo):
    """:class:`SolverInfo` of :func:`sorted_soft_topk_window` (``converged`` and ``marginal_error`` 0-dim
    tensors), and the rows whose window the certificate does not cover.

    Attributes:
        overflow: ``(rows,)`` bool, True where the ``(W + 1)``-th best candidate lies at or above the floor: the
            result is the plan of the window's candidates alone, not the dense operator's (solve the row densely);
            True too where the row has fewer than ``k`` finite candidates (no plan exists: the dense operator
            raises its error).
        n_overflow: 0-dim int64 tensor, the flagged rows' count (read it on the host once, where convenient).
    """

    overflow: Optional[Tensor] = None
    n_overflow: Optional[Tensor] = None


def default_window_width(n: int, k: int, epsilon: float) -> int:
    """The window's width for rows of ``n`` candidates at ``epsilon``: :data:`_WIDTHS`'s for k = 5, scaled by
    ``(k + 1) / 6`` and rounded up to a power of two for larger k; ``n`` where that is not smaller."""
    for largest_epsilon, width in _WIDTHS:
        if epsilon <= largest_epsilon:
            scaled = width * max(1.0, (k + 1) / 6)
            return min(n, 2 ** math.ceil(math.log2(scaled)))
    return n


def sorted_soft_topk_window(scores: Tensor, k: int, *, epsilon: float = 0.1, width: Optional[int] = None,
                            tol: float = 1e-5, max_iter: int = 20, return_info: bool = False,
                            backend: str = "auto"):
    """:func:`~.sorted_soft_topk.sorted_soft_topk` of 2-D rows (largest first, linear cost) on a static window of
    each row's ``W`` best candidates, with no host synchronisation (CUDA graphs, ``torch.compile``).

    Args:
        scores: ``(rows, n)`` floating tensor; ``-inf`` entries are excluded (each row needs ``k`` finite ones:
            a row with fewer is flagged in ``info.overflow``; the data are not checked otherwise, as with
            ``fixed_iterations=True``: NaN gives NaN).
        k: number of ranks.
        epsilon: entropic regularisation, in the scores' units.
        width: ``W``, the candidates kept a row (``k <= W``; ``n`` at most); None: :func:`default_window_width`.
        tol: the solver's relative marginal error, and the window's budget (``tol / 100`` of every rank outside).
        max_iter: iterations of the fixed solve (every one is run; 10-20 suit k <= 10).
        return_info: also return a :class:`WindowSolverInfo`.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (the window's solve: see ``sorted_soft_topk``).

    Returns:
        ``(ranks, index)``: ``ranks`` ``(rows, W, k)`` in ``scores``' dtype, the weight of each window candidate
        in each rank, and ``index`` ``(rows, W)`` int64, the window's candidates (best first); with
        ``return_info=True``, ``(ranks, index, info)``. Scattered into ``(rows, n, k)`` zeros, a certified row's
        ranks are the dense operator's up to ``tol``.
    """
    if not isinstance(scores, Tensor) or scores.dim() != 2:
        raise ValueError(f"sorted_soft_topk_window takes (rows, n) scores, got "
                         f"{tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__}")
    k, epsilon, tol, max_iter = check_inputs(scores, k, epsilon, None, "linear", tol, max_iter)
    rows, n = scores.shape
    if width is None:
        width = default_window_width(n, k, epsilon)
    elif isinstance(width, bool) or not isinstance(width, int) or not k <= width:
        raise ValueError(f"width must be an integer >= k ({k}), got {width!r}")
    width = min(width, n)
    check_backend(backend)
    with torch.profiler.record_function("softtopk::sorted_soft_topk_window"):
        # one candidate past the window: its score decides the certificate
        top, index = scores.detach().topk(min(width + 1, n), dim=-1, sorted=True)
        if width < n:
            floor = candidate_window(top[:, k:k + 1], k, epsilon, tol, n_out=n)
            outside = top[:, width]  # excluded (-inf) candidates carry nothing, whatever the floor
            overflow = (outside > -math.inf) & (outside >= floor.squeeze(-1))
            index = index[:, :width]
        else:
            overflow = torch.zeros(rows, dtype=torch.bool, device=scores.device)
        # fewer than k finite candidates: no plan (every rank's unit of mass has k - 1 places at most); the solve
        # would return an infeasible one, unconverged, that no certificate covers
        overflow = overflow | (top[:, k - 1] == -math.inf)
        ranks, info = sorted_soft_topk(scores.gather(1, index), k, epsilon=epsilon, tol=tol, max_iter=max_iter,
                                       return_info=True, fixed_iterations=True, backend=backend)
    info = WindowSolverInfo(converged=info.converged, n_iter=info.n_iter, marginal_error=info.marginal_error,
                            overflow=overflow, n_overflow=overflow.sum())
    return (ranks, index, info) if return_info else (ranks, index)
