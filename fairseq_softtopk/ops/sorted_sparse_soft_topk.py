"""Sorted sparse soft top-k: the sorted top-k of quadratically regularised OT, with exact zeros.

The transport problem of :func:`~fairseq_softtopk.ops.sorted_soft_topk` (the n valid scores against
the anchors ``k, k-1, ..., 0``; one element per rank, ``n - k`` to the rest) with the regulariser
``(lambda / 2) ||P||^2`` instead of the entropy (Blondel, Seguy and Rolet, AISTATS 2018). Each
element's row of the plan is a Euclidean projection onto the simplex, so most entries are exactly 0:
an element shares ranks only with the elements within about ``lambda`` of it, and elements far below
the k-th best give everything to the rest anchor. :mod:`.quadratic_semi_dual` solves the semi-dual
by Newton steps; the backward pass differentiates its optimality condition (implicit function
theorem), one ``(k + 1) x (k + 1)`` solve per row. The solver sees the float64 rows of
:func:`.sparse_rows.sparse_rows` (units of lambda, gaps of more than 2 lambda between ranks capped: the
same plan), so its line search compares objectives of moderate numbers whatever the magnitude of the scores.
"""

from typing import Optional

import torch
from torch import Tensor

from ._common import check_inputs, oriented_rows, restore_shape, working_dtype
from ._solver_info import SolverInfo, warn_if_unconverged
from .quadratic_semi_dual import quadratic_newton_solve, solve_support_hessian
from .kernels import sorted_sparse_soft_topk_op
from .kernels.backend import check_backend, torch_path_only
from .semi_dual import anchors
from .sparse_rows import sparse_rows
from .sparse_soft_topk import check_regularization


class SortedSparseSoftTopKFunction(torch.autograd.Function):
    """Sorted sparse soft top-k from a solved plan; backward by implicit differentiation (O(m k^2) on the
    solver's window of ``m`` entries: the others, on the rest anchor alone, have no gradient). ``ranks`` is
    the whole rows' ``(rows, n, k)`` or the window's ``(rows, m, k)`` (:func:`sorted_sparse_soft_topk_window`);
    the output is ``ranks``, and the backward reads the window's rows of its gradient either way."""

    @staticmethod
    def forward(z: Tensor, ranks: Tensor, support: Tensor, index: Tensor, regularization: Tensor) -> Tensor:
        return ranks.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        z, _, support, index, regularization = inputs
        ctx.save_for_backward(support, index, regularization)
        ctx.n = z.shape[-1]
        ctx.mark_non_differentiable(support, index)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        # In units of lambda (x = z / lambda), P_i = proj_simplex(x_i y + b) with J_i = diag(s_i) - s_i s_i^T / |s_i|
        # its Jacobian, and sum_i P_i = nu defines b(x). With G_i the output gradient padded by 0 (rest anchor):
        #   dL/dx_i = y^T J_i (G_i - w),   H w = sum_i J_i G_i,   H = sum_i J_i,
        # since H db = -sum_i J_i y dx_i (differentiating the marginals) and J, H are symmetric. Entries whose
        # support is one anchor have J_i = 0: those outside the window add nothing anywhere.
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        with torch.profiler.record_function("softtopk::sorted_sparse_soft_topk_backward"):  # a named range
            support, index, regularization = ctx.saved_tensors
            dtype = grad_output.dtype if grad_output.dtype == torch.float64 else torch.float32
            s = support.to(dtype)
            k = s.shape[-1] - 1
            size = s.sum(-1, keepdim=True).clamp_min(1.0)
            G = grad_output.to(dtype)
            if G.shape[1] != index.shape[1]:  # the whole rows' gradient: its window's rows (m = n: index is 0..n-1)
                G = G.gather(1, index.unsqueeze(-1).expand(-1, -1, k))
            G = torch.cat([G, G.new_zeros(G.shape[:-1] + (1,))], dim=-1)

            def apply_J(a: Tensor) -> Tensor:
                return s * (a - (s * a).sum(-1, keepdim=True) / size)

            w = solve_support_hessian(support, apply_J(G).sum(1).double()).to(dtype)  # (rows, k + 1)
            y = anchors(k, s)
            grad_window = (apply_J(G - w.unsqueeze(1)) * y).sum(-1) / regularization.to(dtype)
            if index.shape[1] == ctx.n:
                return grad_window, None, None, None, None
            grad_z = grad_window.new_zeros(grad_window.shape[0], ctx.n).scatter_(1, index, grad_window)
            return grad_z, None, None, None, None


def _use_kernel(backend: str, scores: Tensor, n: int, k: int, operator: str) -> bool:
    """Whether a call runs the Triton kernels (:func:`.kernels.sorted_sparse_soft_topk_op.use_sorted_sparse_kernel`).

    Raises:
        ValueError: a bad ``backend``, or ``"triton"`` where the kernels cannot run.
    """
    if backend == "torch":  # the default pays nothing for the option
        return False
    check_backend(backend)
    return sorted_sparse_soft_topk_op.use_sorted_sparse_kernel(backend, scores, n, k, operator)


def sorted_sparse_soft_topk(scores: Tensor, k: int, *, dim: int = -1, largest: bool = True,
                            regularization: float = 0.1, mask: Optional[Tensor] = None, tol: float = 1e-6,
                            max_iter: int = 50, hard: bool = False, return_info: bool = False, warn: bool = True,
                            fixed_iterations: bool = False, backend: str = "auto"):
    """Sorted sparse soft top-k: "which element has rank r" for the k best ranks, with exact zeros.

    The quadratically regularised counterpart of :func:`~fairseq_softtopk.ops.sorted_soft_topk`:
    the same marginals (each column sums to 1, each entry's row to at most 1) and the same limits
    (the hard permutation slice as ``regularization -> 0``; the uniform ``1 / n`` per rank as it
    grows), but the plan is sparse: an entry shares ranks only with entries within about
    ``regularization`` of it, and entries well below the k-th best are exactly 0 on every rank.

    Args:
        scores: ``(*, n, *)`` floating tensor (float16/bfloat16 are solved in float32).
        k: number of ranks, ``1 <= k <=`` valid entries per row.
        dim: dimension holding the ``n`` candidates.
        largest: rank 0 is the largest (True) or the smallest (False) score.
        regularization: ``lambda > 0``, in the units of the scores (the temperature of the quadratic
            regulariser; ``epsilon`` of the entropic operator plays the same part).
        mask: optional bool tensor of ``scores``' shape, True = excluded; ``-inf`` entries
            (``+inf`` with ``largest=False``) are excluded too. Excluded entries get exactly 0.
        tol: relative marginal error at which Newton stops (see :class:`SolverInfo`); once the
            supports are found a Newton step is exact, so a small ``tol`` costs little.
        max_iter: Newton iterations at most.
        hard: return the exact permutation slices (no gradient through the selection).
        return_info: also return a :class:`SolverInfo`.
        warn: emit a :class:`SoftTopKConvergenceWarning` when the solve misses ``tol``.
        fixed_iterations: exactly ``max_iter`` Newton iterations (each trying the step sizes 1, 1/2,
            1/4, 1/8) with on-device convergence masks and no host synchronisation; the data are not
            checked, no warning is emitted, and ``info``'s fields are 0-dim tensors.
        backend: ``"auto"`` (default): the kernels below for CUDA tensors when ``triton`` imports,
            ``"torch"`` otherwise. ``"torch"``: the solver above in torch operations. ``"triton"``: fused
            Triton kernels (:mod:`fairseq_softtopk.ops.kernels`), one launch for the whole Newton solve of
            every row (the same steps and line search, no host read, the plan never stored) and one for
            the backward; CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (for tests). The same
            ranks and gradients as ``"torch"`` to rounding once converged (where tied scores put an entry
            exactly on the edge of its support, a kink of the plan, the two may differentiate it on
            different sides); ``info``'s fields are then 0-dim tensors. Up to ``k = 31`` (more ranks run on the torch path, counted in
            ``fallback_counts()["rank_count"]``). The kernels are not timed on a GPU yet.

    Returns:
        ``(*, n, *, k)`` tensor in ``scores``' dtype (the rank dimension appended last, ``n`` at
        ``dim``); with ``return_info=True``, ``(tensor, info)``.
    """
    check_regularization(regularization, 2)
    k, regularization, tol, max_iter = check_inputs(scores, k, regularization, mask, "linear", tol, max_iter, dim,
                                                    largest)
    dim = int(dim)
    kernel = not hard and _use_kernel(backend, scores, scores.shape[dim], k, "sorted_sparse_soft_topk")
    with torch.profiler.record_function("softtopk::sorted_sparse_soft_topk"):
        # the rows in units of lambda with the gaps that cannot matter capped (.sparse_rows)
        prep = sparse_rows(scores, k, dim, largest, regularization, mask, sorted_ranks=True,
                           checks=not fixed_iterations)
        dtype = working_dtype(scores.dtype)  # the positions are float64, the plan is not
        if hard:
            out = torch.zeros(*prep.z.shape, k, dtype=dtype, device=prep.z.device)
            out.scatter_(1, prep.top_index[:, :k].unsqueeze(1), 1.0)
            info = SolverInfo(True, 0, 0.0)
        elif kernel:
            out, info = sorted_sparse_soft_topk_op.sorted_sparse_kernel(
                oriented_rows(scores, dim, prep, dtype), prep, k, regularization, tol, max_iter, fixed_iterations)
        else:
            ranks, support, index, info = quadratic_newton_solve(prep, k, tol, max_iter, fixed_iterations, dtype=dtype)
            out = SortedSparseSoftTopKFunction.apply(oriented_rows(scores, dim, prep, dtype), ranks, support, index,
                                                     torch.full_like(prep.eps, regularization))
        out = restore_shape(out, scores, dim, extra=(k,)).to(scores.dtype)
    if warn and not fixed_iterations:
        warn_if_unconverged(info, "sorted_sparse_soft_topk", tol, max_iter)
    return (out, info) if return_info else out


def sorted_sparse_soft_topk_window(scores: Tensor, k: int, *, regularization: float = 0.1,
                                   mask: Optional[Tensor] = None, tol: float = 1e-6, max_iter: int = 50,
                                   return_info: bool = False, warn: bool = True, backend: str = "auto"):
    """:func:`sorted_sparse_soft_topk` of 2-D rows (largest first), on the entries that can carry weight only.

    The solver works on a window of each row's best ``m`` entries and proves that every entry below it gives
    all of its mass to the rest anchor (weight exactly 0 on every rank). This returns the plan's ranks on that
    window with the window's indices, so that a caller that needs the support only (soft beam search over
    ``k x V`` candidates) never builds, fills or differentiates the ``(rows, n, k)`` tensor: values and
    gradients are those of :func:`sorted_sparse_soft_topk` on the window's entries (scattered into a dense
    ``(rows, n, k)`` tensor of zeros, they are its output). Entries of the window outside the support (and
    masked or ``-inf`` entries that fill a short row's window) get 0 on every rank.

    Args:
        scores: ``(rows, n)`` floating tensor; rank 0 is the largest score.
        k, regularization, mask, tol, max_iter, return_info, warn: as :func:`sorted_sparse_soft_topk`.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``, checked as there; this form has no Triton kernel (the
            kernels solve and store whole rows, which it avoids): a call sent to the kernels runs the torch
            path, counted in ``fallback_counts()["no_kernel"]`` (and, for ``"triton"``, warned).

    Returns:
        ``(ranks, index)``: ``ranks`` ``(rows, m, k)`` in ``scores``' dtype and ``index`` ``(rows, m)`` int64,
        the window's entries (the same ``m`` for every row, ``k <= m <= n``); with ``return_info=True``,
        ``(ranks, index, info)``.
    """
    if not isinstance(scores, Tensor) or scores.dim() != 2:
        raise ValueError(f"sorted_sparse_soft_topk_window takes (rows, n) scores, got "
                         f"{tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__}")
    check_regularization(regularization, 2)
    k, regularization, tol, max_iter = check_inputs(scores, k, regularization, mask, "linear", tol, max_iter, -1)
    # the kernels solve and store whole rows, which is what this form avoids (k x V candidates): the torch path
    torch_path_only(backend, scores, "sorted_sparse_soft_topk_window")
    with torch.profiler.record_function("softtopk::sorted_sparse_soft_topk"):
        prep = sparse_rows(scores, k, -1, True, regularization, mask, sorted_ranks=True)
        dtype = working_dtype(scores.dtype)
        ranks, support, index, info = quadratic_newton_solve(prep, k, tol, max_iter, window_only=True, dtype=dtype)
        out = SortedSparseSoftTopKFunction.apply(oriented_rows(scores, -1, prep, dtype), ranks, support, index,
                                                 torch.full_like(prep.eps, regularization)).to(scores.dtype)
    if warn:
        warn_if_unconverged(info, "sorted_sparse_soft_topk_window", tol, max_iter)
    return (out, index, info) if return_info else (out, index)
