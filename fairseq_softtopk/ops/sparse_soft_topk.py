"""Sparse soft top-k: the top-k mask with quadratic regularisation, which has exact zeros.

Sander, Puigcerver, Djolonga, Peyre and Blondel (ICML 2023), "Fast, Differentiable and Sparse
Top-k: a Convex Analysis Perspective", with ``p = 2``: the mask

    y = argmax_{0 <= y <= 1, sum y = k}  <x, y> - (lambda / 2) ||y||^2  =  clip((x - tau) / lambda, 0, 1),

the Euclidean projection of ``x / lambda`` onto the capped simplex. It is the quadratically
regularised counterpart of :func:`~fairseq_softtopk.ops.soft_topk` (whose entropic mask is a
sigmoid of ``(x - t) / epsilon``): the same transport problem between the scores and the anchors
``{1, 0}`` with a quadratic instead of an entropic regulariser (at ``lambda / 2`` in the plan's
count units). Entries more than ``lambda`` below the threshold get exactly 0, those above it exactly 1.

The threshold is exact (:func:`.simplex_projection.capped_simplex_threshold`: a sort and a search
over breakpoints, no iteration), searched among the entries above ``x_(k+1) - lambda`` only (the
others get 0 whatever the threshold; one host read for the window's width). The backward pass is closed-form: with
``F`` the entries strictly inside ``(0, 1)``, ``dy/dx = (diag(1_F) - 1_F 1_F^T / |F|) / lambda``.

The search runs on the rows of :func:`.sparse_rows.sparse_rows`: the scores minus the k-th best, in units of
lambda, clamped to ``[-3, 1]`` where that cannot change the mask, so that it keeps its precision whatever the
magnitude of the scores relative to lambda (the scores divided first, ``1e7`` over ``lambda = 1`` in float32 had
no digits left below 1 and prefix sums off by more than 1).
"""

from typing import Optional

import torch
from torch import Tensor

from ..number_checks import is_positive_number
from ._common import check_inputs, oriented_rows, refuse_tensor, restore_shape, threshold_vjp
from .kernels import sparse_soft_topk_op
from .kernels.backend import check_backend
from .simplex_projection import capped_cubic_threshold, capped_simplex_threshold
from .sparse_rows import UNSORTED_GAP_CAP, sparse_rows


def check_regularization(regularization: float, p: float) -> None:
    """Raises ``ValueError`` naming the problem for a bad ``regularization`` or ``p``."""
    refuse_tensor("regularization", regularization)
    if not is_positive_number(regularization):
        raise ValueError(f"regularization must be a finite number > 0, got {regularization!r}")
    if p not in SUPPORTED_P:
        raise ValueError(f"p={p!r} is not supported: p must be 2 (the quadratic regulariser) or 4/3")


#: the regulariser exponents with an exact threshold: 2 (piecewise linear mask) and 4/3 (cubic mask)
SUPPORTED_P = (2, 4 / 3)


class SparseSoftTopKFunction(torch.autograd.Function):
    """The mask ``clip((z - tau) / lambda, 0, 1) ** power`` from its solved threshold (``power`` 1 for p = 2, 3 for
    p = 4/3); closed-form backward."""

    @staticmethod
    def forward(z: Tensor, shifted: Tensor, regularization: Tensor, power: int) -> Tensor:
        return shifted.clamp(0.0, 1.0) ** power  # shifted = (z - tau) / lambda, -inf where excluded

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, shifted, regularization, power = inputs
        ctx.save_for_backward(shifted.clamp(0.0, 1.0), regularization)
        ctx.power = power

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        # y_i = s_i ** power, s_i = (z_i - tau) / lambda, on the free entries F (0 < s < 1), with tau(z) keeping
        # sum y = k: with w_i = power * s_i ** (power - 1) (0 off F), dy_i/dz_j = w_i (delta_ij - w_j / sum w) / lambda,
        # so the vector-Jacobian product is grad_z_j = w_j (g_j - sum_i w_i g_i / sum_i w_i) / lambda.
        s, regularization = ctx.saved_tensors
        grad_z = None
        if ctx.needs_input_grad[0]:
            free = (s > 0) & (s < 1)
            grad_z = threshold_vjp(torch.where(free, ctx.power * s ** (ctx.power - 1), 0.0), grad_output,
                                   regularization)
        return grad_z, None, None, None


#: rows up to this long are searched whole: a short sort costs less than the window's host read and top-k
_WINDOW_MIN_N = 256


def _threshold_window(x: Tensor, top: Tensor, n_valid: Tensor, k: int) -> Tensor:
    """The entries of ``x`` ``(rows, n)`` that can be above the threshold, as ``(rows, m)`` (``-inf`` padded).

    ``tau >= x_(k+1) - 1`` (else the k + 1 best would all weigh 1), so entries at or below ``x_(k+1) - 1`` get
    0 and do not move ``tau``; the threshold search then sorts the ``m`` others only. One host read (``m``).
    """
    n = x.shape[1]
    if top.shape[1] <= k or n <= _WINDOW_MIN_N:
        return x
    floor = torch.where(n_valid > k, top[:, k] - 1.0, -torch.inf).unsqueeze(-1)
    m = int((x > floor).sum(-1).max())
    if 2 * m >= n:
        return x
    return torch.where(x > floor, x, -torch.inf).topk(m, dim=-1, sorted=False).values


def sparse_soft_topk(scores: Tensor, k: int, *, dim: int = -1, largest: bool = True, regularization: float = 0.1,
                     p: float = 2, mask: Optional[Tensor] = None, hard: bool = False, backend: str = "auto") -> Tensor:
    """Sparse soft top-k mask: a differentiable ``torch.topk`` indicator with exact zeros and ones.

    Returns ``clip((x - tau) / regularization, 0, 1)`` along ``dim``, ``tau`` such that it sums
    to ``k``: the projection of ``x / regularization`` onto ``{0 <= y <= 1, sum y = k}``
    (Sander et al., ICML 2023, ``p = 2``). Entries farther than ``regularization`` below the
    threshold get exactly 0 (and gradient 0), entries above it exactly 1; as ``regularization
    -> 0`` it becomes the hard top-k indicator, and as it grows, the uniform ``k / n``. Tied scores
    get equal values. Unlike :func:`~fairseq_softtopk.ops.soft_topk` there is no tolerance: the
    threshold is exact up to rounding, at any magnitude of the scores relative to ``regularization``.

    Args:
        scores: ``(*, n, *)`` floating tensor (float16/bfloat16 are solved in float32).
        k: number of entries to select, ``1 <= k <=`` valid entries per row.
        dim: dimension holding the ``n`` candidates.
        largest: select the largest (True) or the smallest (False) scores.
        regularization: ``lambda > 0``, in the units of the scores: entries within ``lambda``
            of the threshold share the selection.
        p: the regulariser ``(lambda / p) sum y^p``: ``2`` (the mask above) or ``4/3``, the smooth mask
            ``clip((x - tau) / lambda, 0, 1) ** 3`` (its derivative vanishes where an entry enters the
            support; exact too: :func:`.simplex_projection.capped_cubic_threshold`).
        mask: optional bool tensor of ``scores``' shape, True = excluded. Entries equal to
            ``-inf`` (``+inf`` when ``largest=False``) are excluded too. Excluded entries get
            exactly 0 and zero gradient.
        hard: return the exact top-k indicator instead (no gradient).
        backend: ``"auto"`` (default): the kernels below for CUDA tensors when ``triton`` imports,
            ``"torch"`` otherwise (CPU tensors keep the torch path). ``"torch"``: the sort-based threshold
            above, in torch operations. ``"triton"``: a fused Triton kernel
            (:mod:`fairseq_softtopk.ops.kernels`) that finds every row's exact threshold in one launch,
            without a sort or a host read (a search over the mask's linear, or cubic, pieces), and one
            launch for the closed-form backward; CUDA tensors, or CPU tensors under Triton's interpreter
            (``TRITON_INTERPRET=1``, for tests). The same values (the same exact zeros and ones, the
            others within a few units of rounding) and gradients as ``"torch"``, for both ``p``. The
            kernels are not timed on a GPU yet.

    Returns:
        Tensor of ``scores``' shape and dtype, values in ``[0, 1]`` summing to ``k`` along ``dim``.

    Raises:
        ValueError: bad arguments, NaN scores, ``+inf`` (``-inf`` with ``largest=False``), or fewer
        than ``k`` valid entries in a row.

    Example::

        >>> sparse_soft_topk(torch.tensor([3.0, 1.0, 2.0, 0.0]), k=2, regularization=0.5)
        tensor([1., 0., 1., 0.])
        >>> sparse_soft_topk(torch.tensor([3.0, 1.0, 1.2, 0.0]), k=2, regularization=0.5)
        tensor([1.0000, 0.3000, 0.7000, 0.0000])
    """
    check_regularization(regularization, p)
    k, regularization, _, _ = check_inputs(scores, k, regularization, mask, "linear", 1.0, 1, dim, largest)
    dim = int(dim)
    kernel = False
    if backend != "torch":  # the default pays nothing for the option
        check_backend(backend)
        kernel = not hard and sparse_soft_topk_op.use_sparse_soft_topk_kernel(backend, scores, scores.shape[dim])
    with torch.profiler.record_function("softtopk::sparse_soft_topk"):
        # the rows in units of lambda, relative to the k-th best, clamped to [-3, 1] (.sparse_rows)
        prep = sparse_rows(scores, k, dim, largest, regularization, mask, sorted_ranks=False)
        if hard:
            out = torch.zeros_like(prep.z).scatter_(-1, prep.top_index[:, :k], 1.0)
        elif kernel:
            grad_lambda = torch.full_like(prep.eps, min(regularization, torch.finfo(prep.eps.dtype).max))
            out = sparse_soft_topk_op.sparse_soft_topk_kernel(oriented_rows(scores, dim, prep), prep, k, grad_lambda,
                                                              1 if p == 2 else 3)
        else:
            x = prep.z if prep.all_valid else torch.where(prep.valid, prep.z, -torch.inf)
            threshold = capped_simplex_threshold if p == 2 else capped_cubic_threshold
            tau = threshold(_threshold_window(x, prep.top, prep.n_valid, k), torch.full_like(prep.eps, k))
            # a gap >= 1 below the k-th best (x_(k) = 0, x_(k+1) = -gap): the hard top-k, from a threshold in the
            # middle of [x_(k+1), x_(k) - 1] whose clip is exactly 0 or 1 (rounding cannot leave 1 - 1e-7)
            gap = -prep.top[:, k:] if prep.top.shape[1] > k else torch.full_like(tau, UNSORTED_GAP_CAP)
            tau = torch.where(gap >= 1.0, -0.5 * (gap + 1.0), tau)
            # lambda for the backward (1 / lambda); beyond the dtype's range the gradient is below its smallest number
            grad_lambda = torch.full_like(prep.eps, min(regularization, torch.finfo(prep.eps.dtype).max))
            out = SparseSoftTopKFunction.apply(oriented_rows(scores, dim, prep), x - tau, grad_lambda,
                                               1 if p == 2 else 3)
        out = restore_shape(out, scores, dim).to(scores.dtype)
    return out
