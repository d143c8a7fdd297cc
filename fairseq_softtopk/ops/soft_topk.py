"""SOFT top-k (Xie et al., NeurIPS 2020, section 2.2): the smoothed top-k indicator.

With two anchors the entropic OT plan has a closed form: every row of the plan sums to
``1/n``, so the share of element ``i`` that goes to the "selected" anchor is a sigmoid,

    A_i = sigmoid((z_i - t) / eps_eff),

of the (oriented) score against one scalar threshold ``t`` per row. The column constraint
``sum_i A_i = k`` makes ``t`` the root of a monotone function, found by safeguarded Newton
(bisection when a Newton step leaves the bracket): O(n) per iteration, a handful of
iterations at any epsilon. This is the same fixed point the paper's Sinkhorn iterations
approach; here it is solved to a tolerance.
"""

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from ._common import (PreparedScores, check_inputs, hard_topk_indices, log_floor, oriented_rows, prepare_scores,
                      restore_shape, threshold_vjp)
from ._solver_info import SolverInfo, warn_if_unconverged
from .kernels import soft_topk_op
from .kernels.backend import check_backend


def _threshold_solve(prep: PreparedScores, k: int, tol: float, max_iter: int,
                     fixed_iterations: bool = False) -> Tuple[Tensor, SolverInfo]:
    """Finds ``t`` with ``sum_i sigmoid((z_i - t) / eps) = k`` over the valid entries of each row.

    With ``fixed_iterations`` the loop runs ``max_iter`` times and never reads a value on the
    host: rows that converged keep their ``t`` (an on-device mask), and the info's fields
    are tensors.

    Returns:
        ``(rows, n)`` logits ``(z - t) / eps`` clamped to the dtype's exp range (``-inf``
        where invalid, ``+inf`` everywhere valid when ``k == n_valid``) and the solver info.
    """
    z, valid, n_valid, eps = prep.z, prep.valid, prep.n_valid, prep.eps
    rows = z.shape[0]
    full = n_valid == k  # every valid entry is selected: A = 1, no threshold exists
    dtype = torch.float64  # the scalar threshold is kept in float64; the O(n) work stays in z.dtype
    limit = -log_floor(z.dtype)
    # Excluded entries sit at -inf, so that they add nothing without a mask in the loop.
    scaled = torch.where(valid, z / eps, -math.inf)
    eps64 = eps.squeeze(-1).to(dtype)
    top_vals = prep.top.to(dtype)
    kth = top_vals[:, k - 1]
    next_val = top_vals[:, k] if top_vals.shape[-1] > k else kth - 1.0
    next_val = torch.where(full, kth - 1.0, next_val)
    t = 0.5 * (kth + next_val) / eps64  # the hard threshold (in units of eps): exact as eps -> 0
    # A bracket that always holds: sum_i sigmoid > k at lo and < k at hi.
    span = torch.log(n_valid.to(dtype)) + 2.0
    lo = torch.where(valid, z, math.inf).amin(-1).to(dtype) / eps64 - span
    hi = top_vals[:, 0] / eps64 + span
    # The O(n) work uses t rounded to z's dtype: a bracket narrower than that cannot improve.
    resolution = 4 * torch.finfo(z.dtype).eps
    denom = torch.minimum(n_valid.to(dtype) - k, torch.full_like(n_valid, k, dtype=dtype)).clamp_min(1.0)
    err = torch.zeros(rows, dtype=dtype, device=z.device)
    n_iter = 0
    for n_iter in range(1, max_iter + 1):
        sig = torch.sigmoid((scaled - t.to(z.dtype).unsqueeze(-1)).clamp_(-limit, limit))
        excess = sig.sum(-1).to(dtype) - k  # decreasing in t
        err = torch.where(full, torch.zeros_like(err), excess.abs() / denom)
        done = (err <= tol) | (hi - lo <= resolution * (1.0 + t.abs()))
        if n_iter == max_iter or (not fixed_iterations and bool(done.all())):
            break  # the last t is the one evaluated (and reported)
        lo = torch.where(excess > 0, torch.maximum(lo, t), lo)
        hi = torch.where(excess < 0, torch.minimum(hi, t), hi)
        slope = (sig - sig * sig).sum(-1).to(dtype)  # d(sum sigmoid)/d(-t); only steers Newton
        newton = t + excess / slope.clamp_min(1e-300)
        inside = (newton > lo) & (newton < hi) & (slope > 0)
        t = torch.where(done, t, torch.where(inside, newton, 0.5 * (lo + hi)))
    a = (scaled - t.to(z.dtype).unsqueeze(-1)).clamp_(-limit, limit)
    a = torch.where(full.unsqueeze(-1), math.inf, a)
    a = torch.where(valid, a, -math.inf)
    if fixed_iterations:
        max_err = err.amax() if rows else err.new_zeros(())
        return a, SolverInfo(converged=max_err <= tol, n_iter=n_iter, marginal_error=max_err)
    max_err = float(err.max()) if rows else 0.0
    return a, SolverInfo(converged=max_err <= tol, n_iter=n_iter, marginal_error=max_err)


class SoftTopKFunction(torch.autograd.Function):
    """Soft top-k indicator from the threshold logits; backward by implicit differentiation.

    Forward takes the oriented scores ``z`` only to attach the gradient; the solve happened
    outside (no autograd graph through it).
    """

    @staticmethod
    def forward(z: Tensor, logits: Tensor, eps: Tensor) -> Tensor:
        return torch.sigmoid(logits)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, logits, eps = inputs
        ctx.save_for_backward(logits, eps)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        # A_i = s((z_i - t)/eps) with t(z) defined by sum_i A_i = k. With w_i = A_i (1 - A_i):
        #   dA_i/dz_j = (w_i / eps) (delta_ij - dt/dz_j),   dt/dz_j = w_j / sum_l w_l
        # so the vector-Jacobian product is O(n):
        #   grad_z_j = (w_j / eps) (g_j - sum_i w_i g_i / sum_i w_i).
        logits, eps = ctx.saved_tensors
        grad_z = None
        if ctx.needs_input_grad[0]:
            with torch.profiler.record_function("softtopk::soft_topk_backward"):
                w = torch.sigmoid(logits) * torch.sigmoid(-logits)  # 0 where excluded (logit -inf)
                grad_z = threshold_vjp(w, grad_output, eps)
        return grad_z, None, None


def soft_topk(scores: Tensor, k: int, *, dim: int = -1, largest: bool = True, epsilon: float = 0.1,
              mask: Optional[Tensor] = None, tol: float = 1e-5, max_iter: int = 100,
              cost: str = "linear", hard: bool = False, return_info: bool = False, warn: bool = True,
              fixed_iterations: bool = False, backend: str = "auto"):
    """Smoothed top-k indicator (SOFT top-k, Xie et al. 2020), a differentiable ``torch.topk``.

    ``torch.topk(scores, k).indices`` marks k entries; ``soft_topk`` returns, for every entry,
    how much of it is selected: a value in ``[0, 1]``, summing to ``k`` along ``dim``, that
    tends to the hard indicator as ``epsilon -> 0`` and is smooth in ``scores`` for
    ``epsilon > 0``. Rows (all positions of the other dimensions) are solved independently.

    Args:
        scores: ``(*, n, *)`` floating tensor (float16/bfloat16 are solved in float32), of any
            finite magnitude (rows near the dtype's limits are rescaled: see :mod:`._common`).
        k: number of entries to select, ``1 <= k <= `` valid entries per row.
        dim: dimension holding the ``n`` candidates.
        largest: select the largest (True) or the smallest (False) scores.
        epsilon: entropic regularisation, > 0. Its unit depends on ``cost``.
        mask: optional bool tensor of ``scores``' shape, True = excluded. Entries equal to
            ``-inf`` (``+inf`` when ``largest=False``) are excluded too. Excluded entries get
            exactly 0 and zero gradient.
        tol: relative marginal error at which the solver stops (see :class:`SolverInfo`).
        max_iter: safeguarded Newton iterations at most (``info.n_iter <= max_iter``).
        cost: ``"linear"`` (default): cost ``-x_i * y_j`` with anchors ``{1, 0}``, so that
            ``A_i = sigmoid((x_i - t) / epsilon)``: epsilon is in the units of the scores (nats
            for log-probabilities) and means the same at any ``n``. ``"sqeuclidean"``: the
            paper's squared distance to the anchors without normalisation (same plan as
            ``"linear"`` at ``epsilon / 2``). ``"paper"``: squared distance divided by its row
            maximum (treated as a constant), the paper's meaning of epsilon; the output is
            then ``n`` times the selected column of the paper's plan. With ``largest=False``
            the k smallest go to anchor 0 (the authors' code); ``largest=True`` is its mirror.
        hard: return the exact top-k indicator instead (no gradient through the selection).
        return_info: also return a :class:`SolverInfo`.
        warn: emit a :class:`SoftTopKConvergenceWarning` when the solve misses ``tol``
            (``info.converged`` False); False for callers that check ``info.converged`` themselves.
        fixed_iterations: run exactly ``max_iter`` solver iterations with on-device
            convergence masks and no host synchronisation at all, so that the call can be
            captured by CUDA graphs and compiled with ``torch.compile(fullgraph=True)``. The
            data are not checked (NaN gives NaN, a row with fewer than k valid entries no
            error), rows near the dtype's limits are not rescaled, no warning is emitted,
            and ``info``'s ``converged`` and ``marginal_error`` are 0-dim tensors. Where every
            row converges, the result equals the default's (converged rows stop moving):
            ``max_iter`` of 20-30 covers the linear cost at any ``n`` (the default solve
            takes 3-10 iterations), at a fixed cost per call.
        backend: ``"auto"`` (default): the kernels below for CUDA tensors when ``triton`` imports,
            ``"torch"`` otherwise (CPU tensors keep the torch path). ``"torch"``: the solver above, in
            torch operations. ``"triton"``: fused
            Triton kernels (:mod:`fairseq_softtopk.ops.kernels`), one launch for the whole solve of
            every row, one for the backward, no host synchronisation inside the solve; CUDA tensors,
            or CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, for tests). The same
            values (float32: to about 1e-6) and gradients as ``"torch"``; ``info``'s fields are then
            0-dim tensors (with ``fixed_iterations=True`` each row still stops when it converges:
            ``n_iter`` is the largest count used). Every cost runs on them (each is the linear
            problem at a rescaled epsilon). The kernels are not timed on a GPU yet.

    Returns:
        Tensor of ``scores``' shape and dtype, values in ``[0, 1]``, summing to ``k`` along
        ``dim``; with ``return_info=True``, ``(tensor, info)``.

    Warns:
        SoftTopKConvergenceWarning: the solver stopped (``max_iter`` reached, or the dtype's
        resolution) with a marginal error above ``tol``; the result is returned all the same.
        Python's default filter shows it once per call site.

    Example::

        >>> soft_topk(torch.tensor([3.0, 1.0, 2.0, 0.0]), k=2, epsilon=0.1)
        tensor([1.0000, 0.0067, 0.9933, 0.0000])
    """
    k, epsilon, tol, max_iter = check_inputs(scores, k, epsilon, mask, cost, tol, max_iter, dim, largest)
    dim = int(dim)
    kernel = False
    if backend != "torch":  # the default pays nothing for the option
        check_backend(backend)
        kernel = not hard and soft_topk_op.use_soft_topk_kernel(backend, scores, scores.shape[dim])
    with torch.profiler.record_function("softtopk::soft_topk"):  # a named range for torch.profiler
        prep = prepare_scores(scores, k, dim, largest, epsilon, mask, cost, n_anchor_steps=1,
                              checks=not fixed_iterations)
        if hard:
            out, info = _hard_indicator(prep, k), SolverInfo(True, 0, 0.0)
        elif kernel:
            out, info = soft_topk_op.soft_topk_kernel(oriented_rows(scores, dim, prep), prep, k, tol, max_iter)
        else:
            logits, info = _threshold_solve(prep, k, tol, max_iter, fixed_iterations)
            out = SoftTopKFunction.apply(oriented_rows(scores, dim, prep), logits, prep.grad_eps)
        out = restore_shape(out, scores, dim).to(scores.dtype)
    if warn and not fixed_iterations:
        warn_if_unconverged(info, "soft_topk", tol, max_iter)
    return (out, info) if return_info else out


def _hard_indicator(prep: PreparedScores, k: int) -> Tensor:
    idx = hard_topk_indices(prep.z, k, prep.valid, largest=True)
    return torch.zeros_like(prep.z).scatter_(-1, idx, 1.0)
