"""One step of the unrolled beam search: the choice of the next beams among the k x V candidates.

:func:`select_beams` takes the candidates' cumulative scores and returns a :class:`Selection`: the
candidates kept (all ``k * V``, the candidate window, or a pool) and the weight ``A`` of each in each
new beam: the sorted SOFT top-k of their scores (soft mode), or one-hot columns (hard mode). The
helpers cut the candidates to those that can carry weight (:func:`compact_rows`,
:func:`drop_negligible`), rescale epsilon per row (:func:`relative_scale`) and flag the steps where a
rank boundary is soft (:func:`near_ties`).
"""

import functools
import math
from typing import Callable, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from ..ops import (candidate_window, cap_row_grad_norm, sorted_soft_topk, sorted_soft_topk_window,
                   sorted_sparse_soft_topk, sorted_sparse_soft_topk_window)
from ..ops._common import effective_epsilon
from ..ops.sorted_soft_topk_window import WindowSolverInfo
from .beam_search_config import BeamSearchConfig


#: iterations of the static window's fixed solve at most (``min(config.max_iter, this)``): the adaptive solver
#: takes 2-8 on beam steps; every one is run
WINDOW_ITERATIONS = 16


class Selection(NamedTuple):
    """One step's choice of the next beams among the candidates ``c = i * V + j`` (beam i, token j).

    Attributes:
        candidates: ``(batch, m)`` candidate ids (all ``k * V`` of them, or a window / pool).
        weights: ``(batch, m, beam)`` A: the weight of each candidate in each new beam
            (one-hot columns in hard mode); the weights of padded entries are 0.
        converged: whether the soft top-k solve met its tolerance (True in hard mode; a 0-dim
            bool tensor with ``fixed_iterations``).
        n_iter: Newton iterations of the solve (0 in hard mode).
        scale_probe: where the selection gradient is capped or observed, the 0-dim zero whose
            gradient sets the cap's unit (:func:`~fairseq_softtopk.ops.cap_row_grad_norm`): the
            loss must add it; else None.
    """

    candidates: Tensor
    weights: Tensor
    converged: Union[bool, Tensor]
    n_iter: int
    scale_probe: Optional[Tensor] = None
    #: with the static window: its solver info, per row (errors, iterations, the rows whose window the
    #: certificate does not cover: their weights are the window's alone, and the search then searches the batch
    #: again on the adaptive window), summed by the search once per batch; ``converged`` and ``n_iter`` are then
    #: True and 0
    window: Optional[WindowSolverInfo] = None


def compact_rows(mask: Tensor) -> Tuple[Tensor, Tensor]:
    """Column indices of the True entries of every row, left-aligned and padded to one width.

    Linear in ``mask.numel()`` (a ``nonzero`` scan), unlike a ``topk`` as wide as the window.

    Args:
        mask: ``(batch, n)`` bool.
    Returns:
        ``index`` ``(batch, w)`` long (0 at padding) and ``valid`` ``(batch, w)`` bool, where
        ``w`` is the largest number of True entries in a row; entries keep their column order.
    """
    batch = mask.shape[0]
    rows, cols = mask.nonzero(as_tuple=True)
    counts = torch.bincount(rows, minlength=batch)
    width = int(counts.max()) if batch else 0
    position = torch.arange(rows.numel(), device=mask.device) - (counts.cumsum(0) - counts)[rows]
    index = torch.zeros(batch, width, dtype=torch.long, device=mask.device)
    index[rows, position] = cols
    valid = torch.arange(width, device=mask.device) < counts.unsqueeze(1)
    return index, valid


def drop_negligible(A: Tensor, cand: Tensor, budget: float) -> Tuple[Tensor, Tensor]:
    """Keeps the candidates whose weight ``sum_l A[c, l]`` is at least ``budget / m``.

    Most candidates of a window are far below the selected ones, with a weight like
    ``exp(-distance / epsilon)``: the soft beams need not mix in their embeddings and states.
    What a row drops weighs less than ``budget`` in total, so in every rank.

    Args:
        A: ``(batch, m, beam)`` weights; cand: ``(batch, m)`` candidate ids.
    Returns:
        ``(A', cand')`` of the kept candidates, ``(batch, w, beam)`` and ``(batch, w)`` with
        ``w <= m`` (rows with fewer are padded with weight-0 candidates).
    """
    batch, m, beam = A.shape
    keep = A.detach().sum(-1) >= budget / m
    index, valid = compact_rows(keep)
    if index.shape[1] == m:
        return A, cand
    kept = A.gather(1, index.unsqueeze(-1).expand(-1, -1, beam)) * valid.unsqueeze(-1)
    return kept, cand.gather(1, index)


def relative_scale(top: Tensor, config: BeamSearchConfig) -> Optional[Tensor]:
    """``(batch, 1)`` factors by which to divide the scores so that ``config.epsilon`` acts as
    ``max(epsilon, epsilon_relative * g)`` per row, ``g`` the mean gap between consecutive scores
    of the k + 1 best (``top``, sorted); ``None`` when the epsilon is not relative.

    With the linear cost the selection depends on the scores only through ``scores / epsilon``,
    so dividing a row by a factor is that row's epsilon multiplied by it. The factor is a
    constant of the backward pass (it only sets the temperature). Rows whose k + 1 best are
    far apart thus keep a soft selection (and a selection gradient) instead of a hard one; rows
    with near ties keep ``epsilon``, the floor.
    """
    if config.epsilon_relative <= 0 or config.mode != "soft":
        return None
    gap = (top[:, :1] - top[:, -1:]) / max(top.shape[1] - 1, 1)
    gap = torch.where(torch.isfinite(gap), gap, torch.zeros_like(gap))
    return (config.epsilon_relative * gap / config.epsilon).clamp_min(1.0)


def near_ties(scores: Tensor, top: Tensor, config: BeamSearchConfig) -> Tensor:
    """Rows where two of the k + 1 best candidates are closer than the effective epsilon.

    Args:
        scores: ``(batch, n)``; top: ``(batch, k + 1)`` their best values, sorted.
    Returns:
        ``(batch,)`` bool.
    """
    if config.cost == "paper":  # (batch, 1): the paper's cost scales epsilon per row
        valid = torch.isfinite(scores)
        eps = effective_epsilon(torch.where(valid, scores, torch.zeros_like(scores)), valid, config.epsilon,
                                config.cost, config.beam)
    else:
        eps = config.epsilon * (0.5 if config.cost == "sqeuclidean" else 1.0)
    gaps = top[:, :-1] - top[:, 1:]
    return (gaps < eps).any(-1)


def select_beams(scores: Tensor, beam: int, config: BeamSearchConfig, kth: Tensor,
                 observe: Optional[Callable[[Tensor], None]] = None) -> Selection:
    """Top-k of the candidates ``scores`` ``(batch, n)``, as a :class:`Selection`.

    With a pool (or in hard mode) only the m best candidates are kept (hard selection), and
    A is computed over them. Otherwise, with the linear cost, the soft top-k runs on the
    :func:`~fairseq_softtopk.ops.candidate_window` of candidates (the others would get less
    than ``tol / 100`` of any rank; padding is ``-inf``, which the operator excludes), and the
    candidates left with a negligible weight are dropped after the solve; with the paper's
    cost, whose scale depends on every candidate, the operator sees all of them.

    With ``config.fixed_iterations`` (soft mode) nothing waits on the device: the window and the
    dropping of negligible candidates, whose widths depend on the data, are skipped (the operator
    sees the pool, or all candidates), and the solve runs exactly ``max_iter`` iterations with
    on-device convergence masks (``sorted_soft_topk(..., fixed_iterations=True)``), so that a
    step can be captured by CUDA graphs or compiled whole. Where every solve converges, the
    result is the default's up to ``tol``.

    Args:
        kth: ``(batch, 1)`` the (k+1)-th best score.
        observe: gets the ``(batch,)`` norms of the gradient reaching the operator.
    """
    batch, n = scores.shape
    with torch.profiler.record_function("softtopk::select_beams"):
        pool = beam if config.mode == "hard" else config.candidate_pool
        if pool and pool < n:
            pool_scores, ids = scores.topk(pool, dim=-1, sorted=True)
        elif config.uses_static_window:  # the operator takes the window itself
            ids, pool_scores = None, scores
        elif not pool and config.cost == "linear" and not config.fixed_iterations and config.regularizer == "entropic":
            floor = candidate_window(kth, beam, config.epsilon, config.tol, n_out=n)
            # NaN is kept in the window (not >= the floor, nor below it): the operator's check then refuses it
            ids, valid = compact_rows(~(scores.detach() < floor))
            pool_scores = scores.gather(1, ids).masked_fill(~valid, -float("inf"))
        else:
            ids = torch.arange(n, device=scores.device).expand(batch, n)
            pool_scores = scores
        if config.mode == "hard":
            A = torch.eye(beam, dtype=scores.dtype, device=scores.device).expand(batch, beam, beam)
            return Selection(ids, A, True, 0)
        if config.uses_static_window:  # no host read: the certificate is counted on the device, the cap fused
            width = None if config.window_width < 0 else config.window_width
            A, ids, info = sorted_soft_topk_window(
                pool_scores.detach() if config.selection_grad == "none" else pool_scores, beam,
                epsilon=config.epsilon, width=width, tol=config.tol, max_iter=min(config.max_iter, WINDOW_ITERATIONS),
                return_info=True, backend=config.backend, grad_cap=config.grad_cap, grad_observer=observe)
            return Selection(ids, A, True, 0, info.scale_probe, info)
        probe = None
        if config.selection_grad == "none":
            pool_scores = pool_scores.detach()
        elif pool_scores.requires_grad and (observe is not None or config.grad_cap < math.inf):
            pool_scores, probe = cap_row_grad_norm(pool_scores, config.grad_cap, observe, return_scale_probe=True)
        if config.regularizer == "quadratic":
            return _sparse_selection(pool_scores, ids, beam, config, probe)
        if config.fixed_iterations:  # every solve runs exactly max_iter iterations
            solve = compiled_fixed_solve(config.compile) if config.compile else fixed_solve
            # compiled, a copy rather than a view: torch.compile guards on the sizes of a view's base too, so a
            # view would compile again whenever a size of its base changes (or stops matching one of the view's)
            A, converged = solve(pool_scores.clone() if config.compile else pool_scores, beam, config.epsilon,
                                 config.cost, config.tol, config.max_iter, config.backend)
            return Selection(ids, A, converged, config.max_iter, probe)
        # no warning per step: the search counts the unconverged solves (BeamSearchOutput.n_unconverged)
        A, info = sorted_soft_topk(pool_scores, beam, epsilon=config.epsilon, cost=config.cost, tol=config.tol,
                                   max_iter=config.max_iter, return_info=True, warn=False, backend=config.backend)
        if ids.shape[1] < n:
            # the same budget as candidate_window's: all but tol / 100 of every rank is kept
            A, ids = drop_negligible(A, ids, config.tol / 100)
        return Selection(ids, A, info.converged, info.n_iter, probe)


def _sparse_selection(scores: Tensor, ids: Tensor, beam: int, config: BeamSearchConfig,
                      probe: Optional[Tensor]) -> Selection:
    """The sorted sparse soft top-k of all the candidates (or the pool) and, unless ``fixed_iterations``, only
    the candidates of its support: the others weigh exactly 0 in every beam, so that dropping them changes
    neither the beams nor any gradient (no window, no tolerance). The operator's window form gives the plan on
    the entries its solver proved could carry weight, so no ``(batch, n, beam)`` tensor is built."""
    if config.fixed_iterations:  # every candidate: no data-dependent width
        A, info = sorted_sparse_soft_topk(scores, beam, regularization=config.epsilon, tol=config.tol,
                                          max_iter=config.max_iter, return_info=True, warn=False,
                                          fixed_iterations=True, backend=config.backend)
        return Selection(ids, A, info.converged, info.n_iter, probe)
    A, window, info = sorted_sparse_soft_topk_window(scores, beam, regularization=config.epsilon, tol=config.tol,
                                                     max_iter=config.max_iter, return_info=True, warn=False,
                                                     backend=config.backend)
    ids = ids.gather(1, window)
    index, valid = compact_rows(A.detach().sum(-1) > 0)
    if index.shape[1] < A.shape[1]:
        A = A.gather(1, index.unsqueeze(-1).expand(-1, -1, beam)) * valid.unsqueeze(-1)
        ids = ids.gather(1, index)
    return Selection(ids, A, info.converged, info.n_iter, probe)


def fixed_solve(scores: Tensor, k: int, epsilon: float, cost: str, tol: float, max_iter: int,
                backend: str = "auto") -> Tuple[Tensor, Tensor]:
    """The sync-free sorted soft top-k of one step: ``(A, converged)``, ``(batch, n, k)`` and a 0-dim bool
    (``backend``: the operator's, :class:`~.beam_search_config.BeamSearchConfig`'s ``backend``)."""
    A, info = sorted_soft_topk(scores, k, epsilon=epsilon, cost=cost, tol=tol, max_iter=max_iter, return_info=True,
                               warn=False, fixed_iterations=True, backend=backend)
    return A, info.converged


@functools.lru_cache(maxsize=None)
def compiled_fixed_solve(mode: str) -> Callable[..., Tuple[Tensor, Tensor]]:
    """:func:`fixed_solve` under ``torch.compile(fullgraph=True, dynamic=True, mode=mode)``, forward and backward
    (one per mode; compiled at its first call, again only for new arguments other than the shapes).

    Every iteration of the solve is a few small operations, so on a GPU the eager solve is bound
    by kernel launches (about 65 per iteration); compiled, the iterations' elementwise work is
    fused into a few kernels each (``scripts/bench/bench_train.py`` counts them).
    """
    return torch.compile(fixed_solve, fullgraph=True, dynamic=True, mode=mode)
