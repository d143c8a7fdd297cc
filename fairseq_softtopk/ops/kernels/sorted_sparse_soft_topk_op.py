"""``torch.library`` ops around the Triton kernels of :func:`~fairseq_softtopk.ops.sorted_sparse_soft_topk`.

* ``fairseq_softtopk::sorted_sparse_soft_topk_forward``: the semi-dual Newton solve of every row and its ranks,
  one launch (``sorted_sparse_soft_topk_triton._sorted_sparse_kernel``); returns the ranks, and per row the
  potentials, the marginal error and the Newton steps, as tensors (nothing read on the host);
* ``fairseq_softtopk::sorted_sparse_soft_topk_backward``: the implicit gradient, one launch.

Both have fake implementations and the forward an autograd rule. The kernels hold ``k + 1`` potentials and a
``(k + 1) x (k + 1)`` Hessian in registers: calls with more than :data:`MAX_K` ranks run on the torch path
(counted). Importing this module needs torch only.
"""

from pathlib import Path
from typing import Tuple

import torch
from torch import Tensor

from .._common import PreparedScores
from .._solver_info import SolverInfo
from ..quadratic_semi_dual import _ARMIJO, _FIXED_BACKTRACK, _MAX_BACKTRACK, _RIDGE
from ..semi_dual_warm_start import hard_start
from .backend import record_fallback, resolve_backend
from .loading import check_device, launch, load_kernels
from .soft_topk_op import MAX_ROW_LENGTH, _float32_halves, _launch_options

KERNEL_FILE = Path(__file__).with_name("sorted_sparse_soft_topk_triton.py")
#: ranks the kernels take at most (k + 1 potentials padded to 32)
MAX_K = 31
#: ``(block, k + 1, k + 1)`` float64 tiles: a block's entries times the padded ranks squared, at most this
TILE = 1 << 10

_kernel_modules = {}


def kernel_module():
    """The kernels module, loaded on first use (see ``soft_topk_op.kernel_module``).

    Raises:
        RuntimeError: the kernels and triton's own library were defined in different modes.
    """
    if "module" not in _kernel_modules:
        _kernel_modules["module"] = load_kernels(KERNEL_FILE, f"{__package__}.sorted_sparse_soft_topk_triton",
                                                 "_sorted_sparse_kernel")
    return _kernel_modules["module"]


def padded_ranks(k: int) -> int:
    """``k + 1`` anchors padded to a power of two (at least 2)."""
    return max(2, 1 << k.bit_length())


def block_size(n: int, k: int) -> int:
    """Entries per block iteration: the ``(block, KP, KP)`` tiles within :data:`TILE`, at most the row."""
    return max(1, min(TILE // padded_ranks(k) ** 2, 1 << max(n - 1, 0).bit_length()))


def _module_for(t: Tensor):
    module = kernel_module()
    check_device(module, t)
    return module


@torch.library.custom_op("fairseq_softtopk::sorted_sparse_soft_topk_forward", mutates_args=())
def sorted_sparse_soft_topk_forward(x: Tensor, z: Tensor, valid: Tensor, b_start: Tensor, n_valid: Tensor,
                                    regularization: Tensor, k: int, tol: float, max_iter: int,
                                    fixed_iterations: bool, has_mask: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The sorted sparse top-k plan's ranks of prepared rows (``sparse_rows(..., sorted_ranks=True)``).

    Args:
        x: ``(rows, n)`` oriented scores in the working dtype (not read: the ranks take its dtype).
        z: ``(rows, n)`` float64 positions in units of lambda, 0 where excluded. valid: ``(rows, n)`` bool
            (read only with ``has_mask``). b_start: ``(rows, k + 1)`` float64 potentials to start from.
            n_valid: ``(rows,)`` valid counts. regularization: ``(rows, 1)`` float64 lambda (the backward's).
        k, tol, max_iter: as the operator's; fixed_iterations: 4 step sizes per Newton step (the torch path's).
    Returns:
        ``(ranks, b, err, n_iter)``: ``(rows, n, k)`` in ``x``'s dtype, ``(rows, k + 1)`` float64, ``(rows,)``
        float64, ``(rows,)`` int32.
    """
    rows, n = z.shape
    ranks = x.new_empty((rows, n, k))
    b = z.new_empty((rows, k + 1), dtype=torch.float64)
    err = z.new_empty((rows,), dtype=torch.float64)
    n_iter = z.new_empty((rows,), dtype=torch.int32)
    if rows == 0:
        return ranks, b, err, n_iter
    module = _module_for(z)
    block = block_size(n, k)
    tol_hi, tol_lo = _float32_halves(float(tol))
    launch(module._sorted_sparse_kernel, (rows,),
        z.contiguous(), valid.contiguous().view(torch.uint8), b_start.double().contiguous(),
        n_valid.double().contiguous(), ranks, b, err, n_iter, n, k, tol_hi, tol_lo, max_iter,
        _FIXED_BACKTRACK if fixed_iterations else _MAX_BACKTRACK, HAS_MASK=has_mask, ARMIJO=_ARMIJO, RIDGE=_RIDGE,
        KP=padded_ranks(k), BLOCK=block, **_launch_options(4096))
    return ranks, b, err, n_iter


@sorted_sparse_soft_topk_forward.register_fake
def _forward_fake(x, z, valid, b_start, n_valid, regularization, k, tol, max_iter, fixed_iterations, has_mask):
    rows, n = z.shape
    return (x.new_empty((rows, n, k)), z.new_empty((rows, k + 1), dtype=torch.float64),
            z.new_empty((rows,), dtype=torch.float64), z.new_empty((rows,), dtype=torch.int32))


@torch.library.custom_op("fairseq_softtopk::sorted_sparse_soft_topk_backward", mutates_args=())
def sorted_sparse_soft_topk_backward(z: Tensor, valid: Tensor, b: Tensor, n_valid: Tensor, grad: Tensor,
                                     regularization: Tensor, has_mask: bool) -> Tensor:
    """The gradient in the scores of the ranks for their gradient ``grad`` ``(rows, n, k)``; ``z``, ``valid``,
    ``n_valid`` as the forward's, ``b`` its potentials, ``regularization`` ``(rows, 1)``. Returns ``(rows, n)`` in
    ``grad``'s dtype."""
    rows, n, k = grad.shape
    grad_z = grad.new_empty((rows, n))
    if rows == 0:
        return grad_z
    module = _module_for(z)
    launch(module._sorted_sparse_backward_kernel, (rows,),
        z.contiguous(), valid.contiguous().view(torch.uint8), b.contiguous(), n_valid.double().contiguous(),
        grad.contiguous(), regularization.reshape(rows).double().contiguous(), grad_z, n, k, HAS_MASK=has_mask,
        RIDGE=_RIDGE, KP=padded_ranks(k), BLOCK=block_size(n, k), **_launch_options(4096))
    return grad_z


@sorted_sparse_soft_topk_backward.register_fake
def _backward_fake(z, valid, b, n_valid, grad, regularization, has_mask):
    return grad.new_empty(grad.shape[:2])


def _setup_context(ctx, inputs, output):
    x, z, valid, _, n_valid, regularization, _, _, _, _, has_mask = inputs
    _, b, err, n_iter = output
    ctx.save_for_backward(z, valid, b, n_valid, regularization)
    ctx.has_mask = has_mask
    ctx.mark_non_differentiable(b, err, n_iter)


def _backward(ctx, grad_ranks, grad_b, grad_err, grad_n_iter):
    # the torch path's SortedSparseSoftTopKFunction.backward (implicit differentiation of the marginals)
    z, valid, b, n_valid, regularization = ctx.saved_tensors
    grad_x = None
    if ctx.needs_input_grad[0]:
        with torch.profiler.record_function("softtopk::sorted_sparse_soft_topk_backward"):  # the torch path's range
            grad_x = sorted_sparse_soft_topk_backward(z, valid, b, n_valid, grad_ranks.contiguous(), regularization,
                                                      ctx.has_mask)
    return (grad_x,) + (None,) * 10


sorted_sparse_soft_topk_forward.register_autograd(_backward, setup_context=_setup_context)


def use_sorted_sparse_kernel(backend: str, scores: Tensor, n: int, k: int, operator: str) -> bool:
    """The dispatch point of the sorted sparse operators: whether a call runs the kernels (``backend`` resolved
    on ``scores``' device); rows longer than the kernels' offsets or more than :data:`MAX_K` ranks are counted
    and run on the torch path.

    Raises:
        ValueError: as :func:`~.backend.resolve_backend`.
    """
    if resolve_backend(backend, scores) == "torch":
        return False
    if n * max(k, 1) > MAX_ROW_LENGTH:
        record_fallback("row_length", operator)
        return False
    if k > MAX_K:
        record_fallback("rank_count", operator)
        return False
    return True


def sorted_sparse_kernel(x: Tensor, prep: PreparedScores, k: int, regularization: float, tol: float, max_iter: int,
                         fixed_iterations: bool) -> Tuple[Tensor, SolverInfo]:
    """The kernels' ranks ``(rows, n, k)`` of prepared rows, differentiable in ``x`` ``(rows, n)``, and the info
    (0-dim tensors)."""
    b_start = hard_start(prep.top, prep.n_valid == k, prep.eps, k)
    b_start = b_start - b_start[:, :1]
    lam = torch.full_like(prep.eps, regularization, dtype=torch.float64)
    ranks, _, err, n_iter = sorted_sparse_soft_topk_forward(x, prep.z, prep.valid, b_start, prep.n_valid, lam, k, tol,
                                                            max_iter, fixed_iterations, not prep.all_valid)
    if err.shape[0]:
        max_err, max_iter_used = err.amax(), n_iter.amax()
    else:
        max_err, max_iter_used = err.new_zeros(()), n_iter.new_zeros(())
    return ranks, SolverInfo(converged=max_err <= tol, n_iter=max_iter_used, marginal_error=max_err)
