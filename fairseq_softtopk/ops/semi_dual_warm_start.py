"""Starting potentials of the sorted operator's Newton solve (:mod:`.semi_dual_newton`).

:func:`hard_start` puts each rank boundary midway between consecutive hard-sorted scores (exact as
epsilon -> 0); :func:`binned_start` solves the problem on a histogram of the scores for large, smooth
rows (where many elements share every rank), by the cut-down Newton of :func:`histogram_newton`.
"""

import math
from typing import Optional

import torch
from torch import Tensor

from ._common import hard_topk_indices
from .semi_dual import SemiDualProblem, anchors, rescaling_step
from .semi_dual_hessian import solve_ridged

_BINS = 1024
_MAX_BIN_ITER = 8  # steps on the histogram (4-7 from the hard start in bench_ops' cases)


def hard_start(top: Tensor, no_rest: Tensor, eps: Tensor, k: int) -> Tensor:
    """Potentials whose rank boundaries sit midway between consecutive hard-sorted scores.

    Args:
        top: ``(rows, min(k + 1, n))`` the largest valid scores, decreasing.
        no_rest: ``(rows,)`` rows with exactly k valid entries.
    Returns:
        ``(rows, k + 1)`` float64, ``g_k = 0``.
    """
    top = top.double()
    if top.shape[-1] == k:  # n == k
        top = torch.cat([top, top[:, -1:] - 1.0], dim=-1)
    top[:, k] = torch.where(no_rest, top[:, k - 1] - 1.0, top[:, k])
    thresholds = 0.5 * (top[:, :-1] + top[:, 1:])  # boundary between rank r and r+1
    g = torch.zeros(top.shape[0], k + 1, dtype=torch.float64, device=top.device)
    g[:, :k] = -thresholds.flip(-1).cumsum(-1).flip(-1) / eps.double()
    return g


def histogram_newton(z: Tensor, w: Tensor, n_valid: Tensor, eps: Tensor, k: int, g: Tensor, tol: float,
                      max_iter: int) -> Tensor:
    """Full Newton steps on weighted points (a histogram of the scores) from ``g``; returns the
    potentials with the smallest marginal error seen, ``(rows, k+1)``.

    For the warm start only: the problem that matters is solved afterwards by the safeguarded
    :func:`_maximise`, so a step that overshoots costs iterations there, never correctness.
    On a thousand float64 points the cost is the dispatch of small ops, not arithmetic, so
    this is :class:`SemiDual` and :func:`_maximise` cut to about twenty ops a step: the
    softmax in one op, no line search, the Hessian's diagonal as counts minus the Gram
    diagonal (in float64 its cancellation is harmless for a warm start), and rows more than
    100% off take the Sinkhorn-like step of :func:`_rescale` instead of Newton's.

    Args:
        z, w: ``(rows, m)`` float64 points and their weights (bin counts).
        n_valid: ``(rows,)`` float64, every row ``> k`` (each has a rest anchor).
        eps: ``(rows, 1)`` float64.
        g: ``(rows, k + 1)`` float64 start, ``g_k = 0``.
    """
    y_eps = (anchors(k, z) / eps).unsqueeze(-1)  # (rows, k+1, 1)
    z, w = z.unsqueeze(1), w.unsqueeze(1)
    target = torch.ones_like(g)
    target[:, k] = n_valid - k
    best_g, best_err = g, torch.full_like(g[:, 0], math.inf)
    for step_index in range(max_iter + 1):
        P = torch.softmax(torch.baddbmm(g.unsqueeze(-1), y_eps, z), dim=1)  # (rows, k+1, m)
        Pw = P * w
        counts = Pw.sum(-1)
        err = (counts / target).sub_(1.0).abs_().amax(-1)
        best_g = torch.where((err < best_err).unsqueeze(-1), g, best_g)
        best_err = torch.minimum(err, best_err)
        if step_index == max_iter or not bool((best_err > tol).any()):
            break
        rescale = rescaling_step(target, counts, k)
        K = torch.diag_embed(counts[:, :k]).sub_(torch.bmm(Pw[:, :k], P[:, :k].transpose(1, 2)))
        newton = solve_ridged(K, (target - counts)[:, :k], torch.float64).nan_to_num_(0.0, 0.0, 0.0)
        g = g + torch.nn.functional.pad(torch.where((err > 1.0).unsqueeze(-1), rescale, newton), (0, 1))
    return best_g


def binned_start(problem: SemiDualProblem, g: Tensor, tol: float) -> Optional[Tensor]:
    """Potentials solved on a histogram of the scores, as a warm start for large, smooth problems.

    The problem depends on the scores only through their distribution; with bins much
    narrower than ``eps`` (here 1/16 of it) the binned solution is close to the exact one,
    and Newton on ``_BINS`` weighted points costs little. The best ``k + 1`` scores keep
    their exact values; the histogram is solved to ``tol / 10`` (its own approximation error
    is what remains). Returns None where the hard start is better (bins not narrow enough,
    or n small), or where a row has no rest anchor (exactly k valid entries).
    """
    z, valid, top, eps, all_valid = problem.z, problem.valid, problem.top, problem.eps, problem.all_valid
    n = z.shape[-1]
    if n < 8 * _BINS or bool(problem.no_rest.any()):
        return None
    low = (z if all_valid else torch.where(valid, z, math.inf)).amin(-1, keepdim=True)
    width = (top[:, :1] - low) / _BINS
    if bool((width > eps / 16).any()):
        return None
    weights = z.new_ones(()).expand_as(z) if all_valid else valid.to(z.dtype)
    # low <= z <= top: indices 0.._BINS, the last one only for the best scores (no clamp needed);
    # excluded entries (z = 0 there) fall anywhere with weight 0.
    index = (z - low).div_(width.clamp_min(torch.finfo(z.dtype).tiny)).long()
    if not all_valid:
        index.clamp_(0, _BINS)
    counts = torch.zeros(z.shape[0], _BINS + 1, dtype=z.dtype, device=z.device)
    counts.scatter_add_(1, index, weights)
    sums = torch.zeros_like(counts).scatter_add_(1, index, z if all_valid else z * weights)
    # The top k+1 scores replace their bins' share: they are the ones the ranks resolve.
    top_index = problem.top_index
    if top_index is None:
        top_index = hard_topk_indices(z, top.shape[-1], valid, largest=True)
    top_index = index.gather(1, top_index)
    counts.scatter_add_(1, top_index, -torch.ones_like(top))
    sums.scatter_add_(1, top_index, -top)
    z_bins = torch.cat([top, sums / counts.clamp_min(1.0)], dim=-1)
    w_bins = torch.cat([torch.ones_like(top), counts.clamp_min(0.0)], dim=-1)
    # A thousand points: solved in float64, where Newton reaches any tolerance.
    # Small tensors, over a hundred ops: inference mode skips the autograd dispatch of each.
    with torch.inference_mode():
        g_bins = histogram_newton(z_bins.double(), w_bins.double(), problem.n_valid.double(), eps.double(),
                                   problem.k, g, tol=0.1 * tol, max_iter=_MAX_BIN_ITER)
    return g_bins.clone()  # a normal tensor again
