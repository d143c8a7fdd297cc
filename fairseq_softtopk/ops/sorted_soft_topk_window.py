"""Sorted SOFT top-k on a static window of each row's best candidates, without host synchronisation.

A caller that mixes candidates by their weights (soft beam search over ``k x V`` candidates) needs the plan on the
candidates that can carry weight only: :func:`~.candidate_window.candidate_window` bounds them (every candidate
below its floor, ``log(100 n / tol) + log(2 (k+1)^2)`` epsilons under the (k+1)-th best score, gives less than
``tol / 100`` of any rank in total). :func:`sorted_soft_topk_window` takes the ``W`` best candidates of each row
(``torch.topk``: a static shape, no host read), solves the plan on them with a fixed number of iterations
(:func:`~.semi_dual_newton.fixed_newton_solve`, on-device convergence masks) and returns it with the window's
indices. On the Triton kernels (``backend="triton"``, or ``"auto"`` on CUDA) the forward is ``torch.topk`` and one
launch (:mod:`.kernels.sorted_soft_topk_window_op`: the window's preparation, certificate, solve to ``tol`` and
plan), the backward a zero fill and one launch (the implicit gradient, the row cap ``grad_cap``, the scatter to the
window's candidates). The certificate is checked on the device: a row whose ``(W + 1)``-th best candidate is at or
above the floor may put more than ``tol / 100`` of a rank outside the window; it is *flagged*, never passed off as
certified (``info.overflow`` per row, ``info.n_overflow`` their count, both tensors), and its result is the plan of
its ``W`` best candidates alone, which the caller must replace (the dense
:func:`~.sorted_soft_topk.sorted_soft_topk`, or a wider ``width``). Soft beam search reads the count once per batch
and searches a batch with a flagged row again on the dense path.

The gradient is the dense operator's on the window (implicit differentiation of the window's plan,
:class:`~.sorted_soft_topk.SortedSoftTopKFunction`) and zero outside it, which for a certified row is the dense
gradient to the solver's tolerance: the candidates outside carry less than ``tol / 100`` of every rank.
"""

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from ._common import check_inputs
from .candidate_window import candidate_window, window_depth
from .gradient_cap import cap_row_grad_norm
from .kernels.backend import check_backend
from .kernels.sorted_soft_topk_window_op import WindowKernelFunction, use_window_kernel
from .sorted_soft_topk import sorted_soft_topk

__all__ = ["WINDOW_MAX_EPSILON", "WindowSolverInfo", "default_window_width", "sorted_soft_topk_window"]

#: window widths by epsilon (in the scores' units), for k = 5, against the largest certified window (the candidates at
#: or above the floor) of real beam steps of the shipped Multi30k Transformer (38,840 candidates a row): at epsilon
#: 0.03 largest 36 of 832 rows (median 12), 27 of the 128 rows of tests/fixtures (tol 1e-5); at 0.1 largest 214
#: (median 59), 314 of the fixture's. Above 0.1 the windows grow fast (at 0.15, 10 of the fixture's 128 rows need
#: more than 512; at 0.3 most more than 4,096): every candidate (the soft search then keeps its adaptive window)
_WIDTHS = ((0.05, 64), (0.1, 512))
#: the largest epsilon with a static window by default
WINDOW_MAX_EPSILON = _WIDTHS[-1][0]


@dataclass
class WindowSolverInfo:
    """What :func:`sorted_soft_topk_window` reached, per row (tensors: nothing is read on the host), and the rows
    whose window the certificate does not cover. ``converged``, ``n_iter``, ``marginal_error`` and
    ``n_overflow`` are :class:`~._solver_info.SolverInfo`'s summaries, 0-dim tensors computed when read (each a
    launch on a GPU: a caller that keeps the rows' tensors and sums them later launches nothing a call).

    Attributes:
        row_error: ``(rows,)`` float64, each row's relative marginal error (the torch path: the largest over
            rows, for every row).
        row_iterations: ``(rows,)`` integer, each row's iterations (the torch path: the count every row ran).
        overflow: ``(rows,)`` bool, True where the ``(W + 1)``-th best candidate lies at or above the floor: the
            result is the plan of the window's candidates alone, not the dense operator's (solve the row densely);
            True too where the row has fewer than ``k`` finite candidates (no plan exists: the dense operator
            raises its error).
        tol: the tolerance ``converged`` compares with.
        scale_probe: with ``grad_cap`` or ``grad_observer`` (and scores that require grad), the gradient cap's
            0-dim zero to add to the loss (:func:`~.gradient_cap.cap_row_grad_norm`); None otherwise.
    """

    row_error: Tensor
    row_iterations: Tensor
    overflow: Tensor
    tol: float
    scale_probe: Optional[Tensor] = None

    @property
    def marginal_error(self) -> Tensor:
        """0-dim float64: the largest ``row_error`` (0 without rows)."""
        return self.row_error.amax() if self.row_error.numel() else self.row_error.new_zeros(())

    @property
    def converged(self) -> Tensor:
        """0-dim bool: every row reached ``tol``."""
        return self.marginal_error <= self.tol

    @property
    def n_iter(self) -> Tensor:
        """0-dim: the largest ``row_iterations``."""
        return self.row_iterations.amax() if self.row_iterations.numel() else self.row_iterations.new_zeros(())

    @property
    def n_overflow(self) -> Tensor:
        """0-dim int64: the flagged rows' count (read it on the host once, where convenient)."""
        return self.overflow.sum()


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
                            backend: str = "auto", grad_cap: float = math.inf,
                            grad_observer: Optional[Callable[[Tensor], None]] = None):
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
        max_iter: iterations of the solve at most (the torch path runs every one; the kernels stop at ``tol``).
        return_info: also return a :class:`WindowSolverInfo`.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``: on the kernels, the whole forward is ``torch.topk`` and
            one launch, the backward a zero fill and one launch (the cap included).
        grad_cap: :func:`~.gradient_cap.cap_row_grad_norm`'s cap on each row of the scores' gradient, in units of
            the loss's gradient where ``info.scale_probe`` is added to the loss (``inf``: none).
        grad_observer: called in the backward pass with the ``(rows,)`` norms of each row's gradient before the cap.

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
    if not grad_cap > 0:
        raise ValueError(f"grad_cap must be > 0, got {grad_cap}")
    width = min(width, n)
    check_backend(backend)
    with_probe = scores.requires_grad and (grad_observer is not None or math.isfinite(grad_cap))
    with torch.profiler.record_function("softtopk::sorted_soft_topk_window"):
        if use_window_kernel(backend, scores, k, width):
            ranks, index, overflow, n_iter, err, probe = WindowKernelFunction.apply(
                scores, k, width, float(epsilon), window_depth(k, tol, n), tol, max_iter, float(grad_cap), grad_observer,
                with_probe)
            info = WindowSolverInfo(err, n_iter, overflow, tol, probe)
            return (ranks, index, info) if return_info else (ranks, index)
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
        window, probe = scores.gather(1, index), None
        if with_probe:  # the cap on the window's gradient: the row's, which is zero outside it
            window, probe = cap_row_grad_norm(window, grad_cap, grad_observer, return_scale_probe=True)
        ranks, info = sorted_soft_topk(window, k, epsilon=epsilon, tol=tol, max_iter=max_iter, return_info=True,
                                       fixed_iterations=True, backend=backend)
    # the torch path's solve reports its largest error and the iterations every row ran
    iterations = overflow.new_full((rows,), info.n_iter, dtype=torch.int32)
    info = WindowSolverInfo(info.marginal_error.expand(rows), iterations, overflow, tol, probe)
    return (ranks, index, info) if return_info else (ranks, index)
