"""``torch.library`` ops around the Triton kernels of :func:`~fairseq_softtopk.ops.soft_topk` (linear cost).

* ``fairseq_softtopk::soft_topk_forward``: the whole threshold solve of every row on the device, one
  launch (``soft_topk_triton._soft_topk_threshold_kernel``, one program a row; rows of at most
  :data:`SHORT_MAX_LENGTH` entries, top-k attention's, ``_soft_topk_short_rows_kernel``, several rows a program);
  returns the output, the logits, and per row the iterations used and the marginal error reached, as tensors
  (nothing read on the host);
* ``fairseq_softtopk::soft_topk_backward``: the implicit gradient, one launch (the same two shapes).

Both have fake (meta) implementations and the forward an autograd rule, so that they run under
``torch.compile`` and pass ``torch.library.opcheck``. The kernels module imports ``triton`` and is loaded
on the first launch (compiled for GPUs, or under Triton's interpreter when ``TRITON_INTERPRET=1``);
importing this module needs torch only.
"""

import math
import struct
from pathlib import Path
from typing import Tuple

import torch
from torch import Tensor

from .._common import PreparedScores, log_floor
from .._solver_info import SolverInfo
from .backend import record_fallback, resolve_backend
from .loading import check_device, launch, load_kernels

KERNEL_FILE = Path(__file__).with_name("soft_topk_triton.py")
#: entries per block iteration on a GPU (a row of n entries takes ceil(n / block) iterations per pass) ...
MAX_BLOCK = 4096
#: ... and under the interpreter, whose cost grows with the block iterations, not the entries
INTERPRETER_MAX_BLOCK = 1 << 16
#: rows longer than this run on the torch path: the kernels' offsets within a row are int32
MAX_ROW_LENGTH = 2 ** 31 - 2 ** 17
#: rows of at most this many entries (top-k attention's: a few dozen keys) run several to a program, each row's
#: scores held in registers for the whole solve (``_soft_topk_short_rows_kernel``) ...
SHORT_MAX_LENGTH = 256
#: ... SHORT_TILE entries of them a program (64 rows of up to 32 entries, 8 rows of 256)
SHORT_TILE = 2048

_kernel_modules = {}  # the loaded kernels module (one entry)


def kernel_module():
    """The kernels module (``soft_topk_triton.py``), loaded on first use (:func:`.loading.load_kernels`).

    Raises:
        RuntimeError: the kernels and triton's own library were defined in different modes.
    """
    if "module" not in _kernel_modules:
        _kernel_modules["module"] = load_kernels(KERNEL_FILE, f"{__package__}.soft_topk_triton",
                                                 "_soft_topk_threshold_kernel")
    return _kernel_modules["module"]


def block_size(n: int, interpret: bool) -> int:
    """Entries per block iteration for rows of ``n``: the next power of two, at least 16, capped."""
    cap = INTERPRETER_MAX_BLOCK if interpret else MAX_BLOCK
    return max(16, min(1 << max(n - 1, 0).bit_length(), cap))


def _launch_options(block: int) -> dict:
    """Compiler options of a launch: warps by block size; floating-point contraction (FMA) as Triton has always
    defaulted to, named so that Triton 3.9's notice of a future default change does not fire."""
    return dict(num_warps=4 if block <= 1024 else 8, enable_fp_fusion=True)


def _kernels_for(t: Tensor):
    """``(kernels module, interpreted)`` for tensors on ``t``'s device (raises where the kernels cannot run)."""
    module = kernel_module()
    check_device(module, t)
    return module, module.INTERPRETED


def _float32_halves(value: float) -> Tuple[float, float]:
    """``(hi, lo)``, both float32 numbers, with ``hi + lo`` = ``value`` to about 2**-48 relative (Triton passes
    Python floats as float32)."""
    try:
        hi = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value), 0.0
    return hi, value - hi


def rows_per_program(rows: int, block: int) -> int:
    """Rows a program of the short-row kernels takes: SHORT_TILE entries' worth, a power of two, no more than the
    rows rounded up to one."""
    return max(1, min(SHORT_TILE // block, 1 << max(rows - 1, 0).bit_length()))


def launch_forward(z: Tensor, valid: Tensor, eps: Tensor, top: Tensor, n_valid: Tensor, k: int, tol: float,
                   max_iter: int, has_mask: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Runs the forward kernel; arguments as :func:`soft_topk_forward`'s. Returns ``(out, logits, n_iter, err)``."""
    rows, n = z.shape
    z = z.contiguous()
    logits, out = torch.empty_like(z), torch.empty_like(z)
    n_iter = z.new_empty((rows,), dtype=torch.int32)
    err = z.new_empty((rows,), dtype=torch.float64)
    if rows == 0:
        return out, logits, n_iter, err
    module, interpret = _kernels_for(z)
    block = block_size(n, interpret)
    tensors = (z, valid.contiguous().view(torch.uint8), eps.reshape(rows).contiguous(), top.contiguous(),
               n_valid.contiguous(), logits, out, n_iter, err)
    scalars = (n, top.shape[-1], k, *_float32_halves(float(tol)), max_iter)
    constants = dict(HAS_MASK=has_mask, LIMIT=-log_floor(z.dtype), RESOLUTION=4 * torch.finfo(z.dtype).eps)
    if n <= SHORT_MAX_LENGTH:
        per_program = rows_per_program(rows, block)
        launch(module._soft_topk_short_rows_kernel, (math.ceil(rows / per_program),), *tensors, rows, *scalars,
               ROWS=per_program, BLOCK=block, **constants, **_launch_options(per_program * block))
    else:
        launch(module._soft_topk_threshold_kernel, (rows,), *tensors, *scalars, BLOCK=block, **constants,
               **_launch_options(block))
    return out, logits, n_iter, err


def launch_backward(logits: Tensor, grad: Tensor, eps: Tensor) -> Tensor:
    """Runs the backward kernel; arguments as :func:`soft_topk_backward`'s. Returns ``(rows, n)`` ``grad_z``."""
    rows, n = logits.shape
    logits = logits.contiguous()
    grad = grad.to(logits.dtype).contiguous()  # an expanded or permuted gradient is laid out row-major
    grad_z = torch.empty_like(logits)
    if rows == 0:
        return grad_z
    module, interpret = _kernels_for(logits)
    block = block_size(n, interpret)
    tensors = (logits, grad, eps.reshape(rows).to(logits.dtype).contiguous(), grad_z)
    if n <= SHORT_MAX_LENGTH:
        per_program = rows_per_program(rows, block)
        launch(module._soft_topk_short_backward_kernel, (math.ceil(rows / per_program),), *tensors, rows, n,
               ROWS=per_program, BLOCK=block, **_launch_options(per_program * block))
    else:
        launch(module._soft_topk_backward_kernel, (rows,), *tensors, n, BLOCK=block, **_launch_options(block))
    return grad_z


@torch.library.custom_op("fairseq_softtopk::soft_topk_forward", mutates_args=())
def soft_topk_forward(x: Tensor, z: Tensor, valid: Tensor, eps: Tensor, grad_eps: Tensor, top: Tensor,
                      n_valid: Tensor, k: int, tol: float, max_iter: int,
                      has_mask: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The soft top-k indicator of prepared rows (see :class:`~fairseq_softtopk.ops._common.PreparedScores`).

    Args:
        x: ``(rows, n)`` oriented scores the output is differentiated with respect to (not read: the
            solve reads ``z``, their prepared copy).
        z: ``(rows, n)`` float32/float64 prepared scores, 0 where excluded. valid: ``(rows, n)`` bool, True
            where the entry takes part (read only with ``has_mask``). eps: ``(rows, 1)`` temperatures of the
            solve; grad_eps: ``(rows, 1)`` in the scores' units (the backward's). top: ``(rows, min(k + 1,
            n))`` the largest valid ``z``, decreasing. n_valid: ``(rows,)`` valid counts in ``z``'s dtype.
        k, tol, max_iter: as :func:`~fairseq_softtopk.ops.soft_topk`'s.
    Returns:
        ``(out, logits, n_iter, err)``: ``out`` and ``logits`` ``(rows, n)`` in ``z``'s dtype
        (``out = sigmoid(logits)``), ``n_iter`` ``(rows,)`` int32, ``err`` ``(rows,)`` float64.
    """
    return launch_forward(z, valid, eps, top, n_valid, k, tol, max_iter, has_mask)


@soft_topk_forward.register_fake
def _soft_topk_forward_fake(x, z, valid, eps, grad_eps, top, n_valid, k, tol, max_iter, has_mask):
    rows = z.shape[0]
    return (torch.empty_like(z), torch.empty_like(z), z.new_empty((rows,), dtype=torch.int32),
            z.new_empty((rows,), dtype=torch.float64))


@torch.library.custom_op("fairseq_softtopk::soft_topk_backward", mutates_args=())
def soft_topk_backward(logits: Tensor, grad: Tensor, eps: Tensor) -> Tensor:
    """``threshold_vjp`` of the forward's ``(rows, n)`` logits for the output's gradient ``grad`` (its shape),
    ``eps`` ``(rows, 1)`` in the scores' units. Returns ``(rows, n)`` in the logits' dtype."""
    return launch_backward(logits, grad, eps)


@soft_topk_backward.register_fake
def _soft_topk_backward_fake(logits, grad, eps):
    return torch.empty_like(logits)


def _setup_context(ctx, inputs, output):
    grad_eps = inputs[4]
    _, logits, n_iter, err = output
    ctx.save_for_backward(logits, grad_eps)
    ctx.mark_non_differentiable(logits, n_iter, err)


def _backward(ctx, grad_out, grad_logits, grad_n_iter, grad_err):
    # A_i = sigmoid(z_i / eps - t(z)) with sum_i A_i = k: grad_z = w (g - sum w g / sum w) / eps, w = A (1 - A)
    # (SoftTopKFunction.backward gives the derivation).
    logits, grad_eps = ctx.saved_tensors
    grad_x = None
    if ctx.needs_input_grad[0]:
        with torch.profiler.record_function("softtopk::soft_topk_backward"):  # the torch path's range
            grad_x = soft_topk_backward(logits, grad_out, grad_eps)
    return (grad_x,) + (None,) * 10


soft_topk_forward.register_autograd(_backward, setup_context=_setup_context)


def use_soft_topk_kernel(backend: str, scores: Tensor, n: int) -> bool:
    """The dispatch point of :func:`~fairseq_softtopk.ops.soft_topk`: whether a call runs the kernels.

    ``backend`` resolved on ``scores``' device (:func:`~.backend.resolve_backend`); a call the kernels
    cannot take (rows of ``n`` > :data:`MAX_ROW_LENGTH`) is counted and reported, and runs on the torch path.
    """
    if resolve_backend(backend, scores) == "torch":
        return False
    if n > MAX_ROW_LENGTH:
        record_fallback("row_length", "soft_topk")
        return False
    return True


def soft_topk_kernel(x: Tensor, prep: PreparedScores, k: int, tol: float, max_iter: int) -> Tuple[Tensor, SolverInfo]:
    """The kernels' soft top-k of prepared rows: ``(out, info)``, ``out`` ``(rows, n)``, differentiable in ``x``.

    ``info``'s fields are 0-dim tensors on the rows' device (``n_iter`` int32, ``marginal_error`` float64,
    ``converged`` bool), read on the host only when the caller reads them.
    """
    out, _, n_iter, err = soft_topk_forward(x, prep.z, prep.valid, prep.eps, prep.grad_eps, prep.top, prep.n_valid,
                                            k, tol, max_iter, not prep.all_valid)
    if err.shape[0]:
        max_err, max_iter_used = err.amax(), n_iter.amax()
    else:
        max_err, max_iter_used = err.new_zeros(()), n_iter.new_zeros(())
    return out, SolverInfo(converged=max_err <= tol, n_iter=max_iter_used, marginal_error=max_err)
