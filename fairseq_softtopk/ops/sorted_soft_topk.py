"""Sorted SOFT top-k (Xie et al., NeurIPS 2020, section 2.3 and appendix B): the operator and its backward.

Entropic OT between the n valid scores (mass 1 each, in count units) and k+1 anchors
``y = k, k-1, ..., 0``: anchor ``r < k`` receives one element (rank r, r = 0 the best) and
anchor ``k`` the other ``n - k``. With the linear cost ``-z_i * y_r`` (see ``_common``), the
plan's rows are softmaxes over anchors,

    P_ir = softmax_r(z_i * y_r / eps + g_r),        output A[i, r] = P_ir, r < k,

and the anchor potentials ``g`` (``g_k = 0``) maximise the concave semi-dual

    F(g) = sum_{r<k} g_r - sum_i logsumexp_r(z_i * y_r / eps + g_r),

whose gradient is the marginal violation ``1 - sum_i P_ir`` and whose negative Hessian is
the paper's ``K = diag(sum_i P_i) - sum_i P_i P_i^T`` (k x k). The forward pass solves it
by damped Newton (:mod:`.semi_dual_newton`): a few iterations from the hard thresholds,
where Sinkhorn needs hundreds at small epsilon. The backward pass differentiates the
optimality condition ``grad F(g) = 0`` (implicit function theorem): one k x k solve per row.
"""

from typing import Optional

import torch
from torch import Tensor

from ._common import check_inputs, hard_topk_indices, oriented_rows, prepare_scores, restore_shape
from ._solver_info import SolverInfo, warn_if_unconverged
from .kernels import sorted_soft_topk_op
from .kernels.backend import check_backend
from .semi_dual import anchors
from .semi_dual_hessian import anchor_hessian, solve_ridged
from .semi_dual_newton import fixed_newton_solve, newton_solve


class SortedSoftTopKFunction(torch.autograd.Function):
    """Sorted soft top-k from a solved plan; backward by implicit differentiation (O(nk))."""

    @staticmethod
    def forward(z: Tensor, P: Tensor, eps: Tensor, no_rest: Tensor, blocked: bool = True) -> Tensor:
        # (rows, n, k) as a transposed view of the plan's rank rows: a contiguous copy of the
        # largest tensor of the forward pass would cost more than the whole backward's reductions
        return P[:, :-1].transpose(1, 2)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, P, eps, no_rest, *blocked = inputs
        ctx.save_for_backward(P, eps, no_rest)
        ctx.blocked = blocked[0] if blocked else True  # the Hessian's blocked Gram product (host reads)

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
            return None, None, None, None, None
        with torch.profiler.record_function("softtopk::sorted_soft_topk_backward"):
            return SortedSoftTopKFunction._vjp(P, eps, no_rest, grad_output, ctx.blocked), None, None, None, None

    @staticmethod
    def _vjp(P: Tensor, eps: Tensor, no_rest: Tensor, grad_output: Tensor, blocked: bool = True) -> Tensor:
        """``dL/dz`` ``(rows, n)`` from ``dL/dA`` ``(rows, n, k)`` (see :meth:`backward`)."""
        # sizes by .size(dim), not .shape: under torch.compile a whole .shape read in a backward
        # pass fixes every dimension of P, so each new batch size would compile the solve again
        k = P.size(1) - 1
        P_ranks = P[:, :k]  # G is 0 on the rest anchor: only the rank rows enter the sums
        y = anchors(k, P)[:k].expand(P.size(0), 1, k)  # (rows, 1, k)
        PG = P_ranks * grad_output.to(P.dtype).transpose(1, 2)  # (rows, k, n)
        # Sums over the k ranks as small matrix products, each one pass over a (k, n) tensor.
        G_bar, yPG = torch.bmm(torch.cat([torch.ones_like(y), y], dim=1), PG).unbind(1)  # (rows, n) each
        # b in the precision of the plan: float32 sums over n are cascaded, the k x k solve is float64
        b = PG.sum(-1).double() - torch.bmm(P_ranks, G_bar.unsqueeze(-1)).squeeze(-1).double()
        u = solve_ridged(anchor_hessian(P, k, no_rest, blocked), b, P.dtype, blocked).to(P.dtype)  # (rows, k)
        y_bar, Pyu, Pu = torch.bmm(torch.cat([y, y * u.unsqueeze(1), u.unsqueeze(1)], dim=1), P_ranks).unbind(1)
        # (direct - implicit) with direct = yPG - G_bar y_bar and implicit = Pyu - y_bar Pu; out of
        # place: under torch.compile, in-place updates of unbind's views also fix the batch size
        return (yPG - Pyu - y_bar * (G_bar - Pu)) / eps


def sorted_soft_topk(scores: Tensor, k: int, *, dim: int = -1, largest: bool = True, epsilon: float = 0.1,
                     mask: Optional[Tensor] = None, tol: float = 1e-5, max_iter: int = 50,
                     cost: str = "linear", hard: bool = False, return_info: bool = False, warn: bool = True,
                     fixed_iterations: bool = False, backend: str = "auto"):
    """Sorted SOFT top-k: a smoothed "which element has rank r" for the k best ranks.

    The hard counterpart is the permutation slice ``P[i, r] = 1`` iff ``i ==
    torch.topk(scores, k).indices[r]``; this returns, for every entry ``i`` and rank ``r``,
    a soft indicator: columns sum to 1 (one element per rank), each entry's row sums to at
    most 1, and it tends to the hard slice as ``epsilon -> 0``.

    Args:
        scores: ``(*, n, *)`` floating tensor (float16/bfloat16 are solved in float32), of any
            finite magnitude (rows near the dtype's limits are rescaled: see :mod:`._common`).
        k: number of ranks, ``1 <= k <= `` valid entries per row.
        dim: dimension holding the ``n`` candidates.
        largest: rank 0 is the largest (True) or the smallest (False) score.
        epsilon: entropic regularisation, > 0, in the unit that ``cost`` gives it.
        mask: optional bool tensor of ``scores``' shape, True = excluded; ``-inf`` entries
            (``+inf`` with ``largest=False``) are excluded too. Excluded entries get exactly 0.
        tol: relative marginal error at which Newton stops (see :class:`SolverInfo`).
        max_iter: iterations at most (``info.n_iter <= max_iter``): Newton steps and the
            Sinkhorn-like rescaling steps that may precede them, over all the solves on candidate
            windows (the warm start on a histogram of large rows is not counted).
        cost: ``"linear"`` (default; anchors ``k, ..., 0`` with cost ``-x_i * y_r``, epsilon in
            the units of the scores: with log-likelihood scores, in nats, at any vocabulary
            size), ``"sqeuclidean"`` (squared distance, same plan as linear at epsilon/2) or
            ``"paper"`` (squared distance divided by its row maximum, as the authors' code:
            anchors ``k, k-1, ..., 0``, nu = [1/n]*k + [(n-k)/n], output n times the first k
            columns of the plan).
        hard: return the exact permutation slices (no gradient through the selection).
        return_info: also return a :class:`SolverInfo`.
        warn: emit a :class:`SoftTopKConvergenceWarning` when the solve misses ``tol``
            (``info.converged`` False); False for callers that check ``info.converged`` themselves.
        fixed_iterations: exactly ``max_iter`` iterations (rescaling and Newton steps, each one
            plan evaluation and, for Newton, one k x k solve) on all n entries, with on-device
            convergence masks and no host synchronisation, so that the call can be captured by
            CUDA graphs and compiled with ``torch.compile(fullgraph=True)``. The data are not
            checked or rescaled (as :func:`~fairseq_softtopk.ops.soft_topk`'s option), no
            warning is emitted, ``info``'s ``converged`` and ``marginal_error`` are 0-dim
            tensors, and the plan's logits are formed in float64. Converged rows stop moving:
            where every row converges the result is the default's up to ``tol``. A budget of
            10-20 suits k <= 10 (the default solve takes 2-8); every iteration is paid for.
        backend: ``"auto"`` (default): the kernels below for CUDA tensors when ``triton`` imports,
            ``"torch"`` otherwise (CPU tensors keep the torch path). ``"torch"``: the solver above, in
            torch operations. ``"triton"``: fused Triton kernels (:mod:`fairseq_softtopk.ops.kernels`),
            one launch for the whole solve of every row (the same hard start, rescaling and damped
            Newton steps, decided per row on the device, on all n entries: no candidate window or
            histogram start), one for the backward; CUDA tensors, or CPU tensors under Triton's
            interpreter (``TRITON_INTERPRET=1``, for tests). The same values and gradients as
            ``"torch"`` up to the tolerance (float32 at the default ``tol``: about 1e-6; float64 at
            ``tol=1e-12``: about 1e-15); ``info``'s fields are then 0-dim tensors (``n_iter`` the
            largest count of a row; with ``fixed_iterations=True`` each row still stops when it
            converges). Every cost runs on them. ``k`` up to 31 (the ``k + 1`` anchors are held in
            registers): a larger ``k`` runs the torch path, counted in ``fallback_counts()["rank_count"]``
            (and, for ``"triton"``, reported by a warning). The kernels are not timed on a GPU yet.

    Returns:
        ``(*, n, *, k)`` tensor in ``scores``' dtype: the rank dimension is appended last and
        ``n`` stays at ``dim``. With ``return_info=True``, ``(tensor, info)``. In float32/64 the
        soft result is a view of the transport plan, laid out rank-major (not contiguous: use
        ``reshape`` rather than ``view``, and ``clone`` before modifying it in place).

    Warns:
        SoftTopKConvergenceWarning: the solver stopped (``max_iter`` reached, or no more progress
        at the dtype's resolution) with a marginal error above ``tol``; the result is returned
        all the same. Python's default filter shows it once per call site.
    """
    k, epsilon, tol, max_iter = check_inputs(scores, k, epsilon, mask, cost, tol, max_iter, dim, largest)
    dim = int(dim)
    kernel = False
    if backend != "torch":  # the default pays nothing for the option
        check_backend(backend)
        kernel = not hard and sorted_soft_topk_op.use_sorted_soft_topk_kernel(backend, scores, scores.shape[dim], k)
    # a named range for torch.profiler (scripts/bench/bench_train.py reads it)
    with torch.profiler.record_function("softtopk::sorted_soft_topk"):
        prep = prepare_scores(scores, k, dim, largest, epsilon, mask, cost, n_anchor_steps=k,
                              checks=not fixed_iterations)
        if hard:
            idx = hard_topk_indices(prep.z, k, prep.valid, largest=True)  # (rows, k)
            out = torch.zeros(*prep.z.shape, k, dtype=prep.z.dtype, device=prep.z.device)  # (rows, n, k)
            out.scatter_(1, idx.unsqueeze(1), 1.0)
            info = SolverInfo(True, 0, 0.0)
        elif kernel:
            out, info = sorted_soft_topk_op.sorted_soft_topk_kernel(oriented_rows(scores, dim, prep), prep, k, tol,
                                                                    max_iter, fixed_iterations)
        else:
            solve = fixed_newton_solve if fixed_iterations else newton_solve
            P, info = solve(prep, k, tol, max_iter)
            out = SortedSoftTopKFunction.apply(oriented_rows(scores, dim, prep), P, prep.grad_eps, prep.n_valid == k,
                                               not fixed_iterations)
        out = restore_shape(out, scores, dim, extra=(k,)).to(scores.dtype)
    if warn and not fixed_iterations:
        warn_if_unconverged(info, "sorted_soft_topk", tol, max_iter)
    return (out, info) if return_info else out
