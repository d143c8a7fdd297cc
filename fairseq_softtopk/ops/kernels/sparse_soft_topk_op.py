"""``torch.library`` ops around the Triton kernels of :func:`~fairseq_softtopk.ops.sparse_soft_topk`.

* ``fairseq_softtopk::sparse_soft_topk_forward``: the exact threshold of every row and the mask, one launch
  (``sparse_soft_topk_triton._sparse_threshold_kernel``: no sort, no host read); returns the mask, its base
  ``clip(z - tau, 0, 1)`` (p = 4/3), and per row the threshold and the passes used, as tensors;
* ``fairseq_softtopk::sparse_soft_topk_backward``: the closed-form gradient, one launch.

Both have fake (meta) implementations and the forward an autograd rule (``torch.library.opcheck`` passes). The
kernels module imports ``triton`` and is loaded on the first launch (compiled for GPUs, or under Triton's
interpreter when ``TRITON_INTERPRET=1``); importing this module needs torch only.
"""

from pathlib import Path
from typing import Tuple

import torch
from torch import Tensor

from .._common import PreparedScores
from ..sparse_rows import UNSORTED_GAP_CAP
from .backend import record_fallback, resolve_backend
from .loading import check_device, launch, load_kernels
from .soft_topk_op import MAX_ROW_LENGTH, _launch_options

KERNEL_FILE = Path(__file__).with_name("sparse_soft_topk_triton.py")
#: entries per block iteration on a GPU (a row of n entries takes ceil(n / block) iterations per pass) ...
MAX_BLOCK = 2048
#: ... and under the interpreter, whose cost grows with the block iterations, not the entries
INTERPRETER_MAX_BLOCK = 1 << 16
#: passes of the threshold search at most: each halves the bracket at least every third pass, and the bracket
#: (at most 3 wide) reaches float64's resolution within about 55 halvings; typical rows take 2 to 8
MAX_PASSES = 200

_kernel_modules = {}  # the loaded kernels module (one entry)


def kernel_module():
    """The kernels module (``sparse_soft_topk_triton.py``), loaded on first use.

    Raises:
        RuntimeError: the kernels and triton's own library were defined in different modes (``TRITON_INTERPRET``
        set or cleared after triton was imported).
    """
    if "module" not in _kernel_modules:
        _kernel_modules["module"] = load_kernels(KERNEL_FILE, f"{__package__}.sparse_soft_topk_triton",
                                                 "_sparse_threshold_kernel")
    return _kernel_modules["module"]


def block_size(n: int, interpret: bool) -> int:
    """Entries per block iteration for rows of ``n``: the next power of two, at least 16, capped."""
    cap = INTERPRETER_MAX_BLOCK if interpret else MAX_BLOCK
    return max(16, min(1 << max(n - 1, 0).bit_length(), cap))


def _kernels_for(t: Tensor):
    """``(kernels module, block cap mode)`` for tensors on ``t``'s device (raises where the kernels cannot run)."""
    module = kernel_module()
    check_device(module, t)
    return module, module.INTERPRETED


def launch_forward(z: Tensor, valid: Tensor, top: Tensor, k: int, power: int,
                   has_mask: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Runs the forward kernel; arguments as :func:`sparse_soft_topk_forward`'s. Returns ``(out, base, tau,
    n_iter)``."""
    rows, n = z.shape
    z = z.contiguous()
    out = torch.empty_like(z)
    base = z.new_empty((rows, n if power == 3 else 0))
    tau = z.new_empty((rows,), dtype=torch.float64)
    n_iter = z.new_empty((rows,), dtype=torch.int32)
    if rows == 0:
        return out, base, tau, n_iter
    module, interpret = _kernels_for(z)
    block = block_size(n, interpret)
    launch(module._sparse_threshold_kernel, (rows,),
        z, valid.contiguous().view(torch.uint8), top.contiguous(), out, base if power == 3 else out, tau, n_iter,
        n, top.shape[-1], k, MAX_PASSES, HAS_MASK=has_mask, POWER=power, GAP_CAP=UNSORTED_GAP_CAP,
        RESOLUTION=4 * torch.finfo(torch.float64).eps, BLOCK=block, **_launch_options(block))
    return out, base, tau, n_iter


def launch_backward(base: Tensor, grad: Tensor, regularization: Tensor, power: int) -> Tensor:
    """Runs the backward kernel; arguments as :func:`sparse_soft_topk_backward`'s. Returns ``(rows, n)``."""
    rows, n = base.shape
    base = base.contiguous()
    grad = grad.to(base.dtype).contiguous()  # an expanded or permuted gradient is laid out row-major
    grad_z = torch.empty_like(base)
    if rows == 0:
        return grad_z
    module, interpret = _kernels_for(base)
    block = block_size(n, interpret)
    launch(module._sparse_backward_kernel, (rows,), base, grad,
           regularization.reshape(rows).to(base.dtype).contiguous(), grad_z, n, POWER=power, BLOCK=block,
           **_launch_options(block))
    return grad_z


def _check_power(power: int) -> None:
    if power not in (1, 3):
        raise ValueError(f"power must be 1 (p = 2) or 3 (p = 4/3), got {power!r}")


@torch.library.custom_op("fairseq_softtopk::sparse_soft_topk_forward", mutates_args=())
def sparse_soft_topk_forward(x: Tensor, z: Tensor, valid: Tensor, top: Tensor, regularization: Tensor, k: int,
                             power: int, has_mask: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The sparse top-k mask of prepared rows (:func:`~fairseq_softtopk.ops.sparse_rows.sparse_rows`).

    Args:
        x: ``(rows, n)`` oriented scores the mask is differentiated with respect to (not read).
        z: ``(rows, n)`` float32/float64 prepared rows, 0 where excluded. valid: ``(rows, n)`` bool, True where
            the entry takes part (read only with ``has_mask``). top: ``(rows, k + 1)`` the best positions,
            ``top[:, k] = -gap``. regularization: ``(rows, 1)`` lambda in the scores' units (the backward's).
        k: entries selected; power: 1 (p = 2) or 3 (p = 4/3).
    Returns:
        ``(out, base, tau, n_iter)``: ``out`` ``(rows, n)`` ``clip(z - tau, 0, 1) ** power``; ``base`` that clip
        ``(rows, n)`` for power 3, ``(rows, 0)`` for power 1 (``out`` is it); ``tau`` ``(rows,)`` float64; ``n_iter``
        ``(rows,)`` int32 passes of the search.
    Raises:
        ValueError: ``power`` not 1 or 3.
    """
    _check_power(power)
    return launch_forward(z, valid, top, k, power, has_mask)


@sparse_soft_topk_forward.register_fake
def _sparse_soft_topk_forward_fake(x, z, valid, top, regularization, k, power, has_mask):
    _check_power(power)
    rows, n = z.shape
    return (torch.empty_like(z), z.new_empty((rows, n if power == 3 else 0)),
            z.new_empty((rows,), dtype=torch.float64), z.new_empty((rows,), dtype=torch.int32))


@torch.library.custom_op("fairseq_softtopk::sparse_soft_topk_backward", mutates_args=())
def sparse_soft_topk_backward(base: Tensor, grad: Tensor, regularization: Tensor, power: int) -> Tensor:
    """The gradient in ``z`` of the mask ``base ** power`` (``base = clip(z - tau, 0, 1)`` ``(rows, n)``) for the
    mask's gradient ``grad`` (its shape), ``regularization`` ``(rows, 1)``. Returns ``(rows, n)`` in ``base``'s
    dtype."""
    _check_power(power)
    return launch_backward(base, grad, regularization, power)


@sparse_soft_topk_backward.register_fake
def _sparse_soft_topk_backward_fake(base, grad, regularization, power):
    _check_power(power)
    return torch.empty_like(base)


def _setup_context(ctx, inputs, output):
    regularization, power = inputs[4], inputs[6]
    out, base, tau, n_iter = output
    ctx.save_for_backward(out if power == 1 else base, regularization)
    ctx.power = power
    ctx.mark_non_differentiable(base, tau, n_iter)


def _backward(ctx, grad_out, grad_base, grad_tau, grad_n_iter):
    # F = {0 < s < 1}, w = power s ** (power - 1) on F: grad_z = w (g - sum w g / sum w) / lambda
    # (SparseSoftTopKFunction.backward gives the derivation)
    base, regularization = ctx.saved_tensors
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = sparse_soft_topk_backward(base, grad_out, regularization, ctx.power)
    return (grad_x,) + (None,) * 7


sparse_soft_topk_forward.register_autograd(_backward, setup_context=_setup_context)


def use_sparse_soft_topk_kernel(backend: str, scores: Tensor, n: int) -> bool:
    """The dispatch point of :func:`~fairseq_softtopk.ops.sparse_soft_topk`: whether a call runs the kernels.

    ``backend`` resolved on ``scores``' device (:func:`~.backend.resolve_backend`); a call the kernels cannot
    take (rows of ``n`` > :data:`~.soft_topk_op.MAX_ROW_LENGTH`) is counted and reported, and runs on the torch
    path.

    Raises:
        ValueError: as :func:`~.backend.resolve_backend`.
    """
    if resolve_backend(backend, scores) == "torch":
        return False
    if n > MAX_ROW_LENGTH:
        record_fallback("row_length", "sparse_soft_topk")
        return False
    return True


def sparse_soft_topk_kernel(x: Tensor, prep: PreparedScores, k: int, regularization: Tensor,
                            power: int) -> Tensor:
    """The kernels' mask of prepared rows (``prep`` from ``sparse_rows``): ``(rows, n)``, differentiable in ``x``
    ``(rows, n)``; ``regularization`` ``(rows, 1)`` lambda for the backward."""
    return sparse_soft_topk_forward(x, prep.z, prep.valid, prep.top, regularization, k, power,
                                    not prep.all_valid)[0]
