"""``torch.library`` ops around the Triton kernels of :func:`~fairseq_softtopk.ops.sorted_soft_topk_window`.

* ``fairseq_softtopk::sorted_soft_topk_window_forward``: from each row's ``W + 1`` best scores (``torch.topk``'s
  values), the window's plan ``(rows, k + 1, W)``, the rows whose certificate fails, and the solver's iterations
  and marginal error per row, one launch (``sorted_soft_topk_window_triton._window_forward_kernel``);
* ``fairseq_softtopk::sorted_soft_topk_window_backward``: the scores' ``(rows, n)`` gradient (zeros, and at the
  window's candidates the window plan's implicit gradient, capped per row) and each row's norm, one launch.

:class:`WindowKernelFunction` ties them into one differentiable selection: ``torch.topk`` and the forward kernel
(the row cap's scale probe written by it) forward, the backward kernel backward. Both ops have fake (meta)
implementations. Importing this module needs torch only.
"""

import math
from pathlib import Path
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from ..semi_dual import subnormal_cut
from .backend import record_fallback, resolve_backend
from .loading import check_device, launch, load_kernels
from .soft_topk_op import _float32_halves, _launch_options
from .sorted_soft_topk_op import MAX_K, _ridge, anchor_lanes, block_size

KERNEL_FILE = Path(__file__).with_name("sorted_soft_topk_window_triton.py")
#: entries a backward program sets to zero per store (its row outside the window)
ZERO_BLOCK = 1024
#: the widest window the kernels take (the forward keeps it in scratch memory, a few passes over it per iteration)
MAX_WIDTH = 1 << 14

_kernel_modules = {}  # the loaded kernels module (one entry)


def kernel_module():
    """The kernels module (``sorted_soft_topk_window_triton.py``), loaded on first use."""
    if "module" not in _kernel_modules:
        _kernel_modules["module"] = load_kernels(KERNEL_FILE, f"{__package__}.sorted_soft_topk_window_triton",
                                                 "_window_forward_kernel")
    return _kernel_modules["module"]


def _kernels_for(t: Tensor):
    module = kernel_module()
    check_device(module, t)
    return module, module.INTERPRETED


@torch.library.custom_op("fairseq_softtopk::sorted_soft_topk_window_forward", mutates_args=())
def window_forward(top: Tensor, k: int, width: int, epsilon: float, depth: float, tol: float,
                   max_iter: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The window's plan from ``top`` ``(rows, W or W + 1)``, each row's best scores, decreasing (``-inf``:
    excluded; the ``(W + 1)``-th, where given, decides the certificate: flagged at or above ``depth`` epsilons
    under the ``(k + 1)``-th best). Returns ``(plan (rows, k + 1, W) in top's dtype, overflow (rows,) bool, no_rest
    (rows,) bool, n_iter (rows,) int32, err (rows,) float64, probe)``, ``probe`` a 0-dim zero in top's dtype (the
    row cap's scale probe: the kernel writes it, saving a launch)."""
    rows = top.shape[0]
    top = top.contiguous()
    plan = top.new_empty((rows, k + 1, width))
    overflow = top.new_empty((rows,), dtype=torch.bool)
    no_rest = top.new_empty((rows,), dtype=torch.bool)
    n_iter = top.new_empty((rows,), dtype=torch.int32)
    err = top.new_empty((rows,), dtype=torch.float64)
    if rows == 0:
        return plan, overflow, no_rest, n_iter, err, top.new_zeros(())
    probe = top.new_empty(())
    module, interpret = _kernels_for(top)
    block = block_size(width, k, interpret)
    scratch, valid = top.new_empty((rows, width)), top.new_empty((rows, width), dtype=torch.uint8)
    launch(module._window_forward_kernel, (rows,), top, scratch, valid, plan, overflow.view(torch.uint8),
           no_rest.view(torch.uint8), n_iter, err, probe, width, top.shape[1], k, *_float32_halves(epsilon),
           *_float32_halves(depth), *_float32_halves(tol), max_iter, subnormal_cut(top.dtype, k), _ridge(top.dtype),
           HAS_OUT=top.shape[1] > width, BLOCK=block, KP=anchor_lanes(k), **_launch_options(block * anchor_lanes(k)))
    return plan, overflow, no_rest, n_iter, err, probe


@window_forward.register_fake
def _window_forward_fake(top, k, width, epsilon, depth, tol, max_iter):
    rows = top.shape[0]
    return (top.new_empty((rows, k + 1, width)), top.new_empty((rows,), dtype=torch.bool),
            top.new_empty((rows,), dtype=torch.bool), top.new_empty((rows,), dtype=torch.int32),
            top.new_empty((rows,), dtype=torch.float64), top.new_empty(()))


@torch.library.custom_op("fairseq_softtopk::sorted_soft_topk_window_backward", mutates_args=())
def window_backward(plan: Tensor, grad: Tensor, index: Tensor, no_rest: Tensor, scale: Optional[Tensor], n: int,
                    epsilon: float, max_norm: float) -> Tuple[Tensor, Tensor]:
    """The scores' gradient ``(rows, n)`` from the window plan ``(rows, k + 1, W)`` and its ranks' gradient
    ``grad`` ``(rows, W, k)``: nonzero at the window's candidates ``index[:, :W]`` only, each row scaled to L2 norm
    at most ``max_norm`` (``inf``: not scaled) times ``|scale|`` (the scale probe's 0-dim gradient; None: 1).
    Returns ``(grad_scores, norms)``, ``norms`` ``(rows,)`` float64 the rows' norms before the cap, divided by
    ``|scale|`` where it is not 0 (in units of the loss's gradient, as ``cap_row_grad_norm``'s observer)."""
    rows, anchors, width = plan.shape
    k = anchors - 1
    grad_scores = plan.new_empty((rows, n))  # the kernel writes every entry
    norms = plan.new_empty((rows,), dtype=torch.float64)
    if rows == 0:
        return grad_scores, norms
    module, interpret = _kernels_for(plan)
    block = block_size(width, k, interpret)
    index = index if index.stride(-1) == 1 else index.contiguous()
    launch(module._window_backward_kernel, (rows,), plan.contiguous(), grad.to(plan.dtype).contiguous(), index,
           no_rest.view(torch.uint8), plan if scale is None else scale, grad_scores, norms, width, index.stride(0), n,
           k, *_float32_halves(epsilon), max_norm if math.isfinite(max_norm) else 0.0, _ridge(plan.dtype),
           HAS_SCALE=scale is not None, CAPPED=math.isfinite(max_norm), BLOCK=block, KP=anchor_lanes(k),
           ZBLOCK=ZERO_BLOCK, **_launch_options(block * anchor_lanes(k)))
    return grad_scores, norms


@window_backward.register_fake
def _window_backward_fake(plan, grad, index, no_rest, scale, n, epsilon, max_norm):
    return plan.new_empty((plan.shape[0], n)), plan.new_empty((plan.shape[0],), dtype=torch.float64)


class WindowKernelFunction(torch.autograd.Function):
    """``(ranks (rows, W, k), index (rows, W), overflow, n_iter, err, probe)`` of ``scores`` ``(rows, n)``: the
    kernels' window selection, differentiable in ``scores`` (zero outside the window), with the row cap of
    :func:`~fairseq_softtopk.ops.cap_row_grad_norm` applied to the scores' gradient in the backward kernel
    (``probe``: its scale probe, a 0-dim zero to add to the loss, or None without a cap or observer)."""

    @staticmethod
    def forward(ctx, scores: Tensor, k: int, width: int, epsilon: float, depth: float, tol: float, max_iter: int,
                max_norm: float, observer: Optional[Callable[[Tensor], None]], with_probe: bool):
        n = scores.shape[1]
        top, index = scores.detach().topk(min(width + 1, n), dim=-1, sorted=True)
        plan, overflow, no_rest, n_iter, err, probe = window_forward(top, k, width, epsilon, depth, tol, max_iter)
        probe = probe if with_probe else None
        ctx.save_for_backward(plan, index, no_rest)
        ctx.shape, ctx.epsilon, ctx.max_norm, ctx.observer = (n, width), epsilon, max_norm, observer
        ctx.set_materialize_grads(False)
        ids = index[:, :width]
        ctx.mark_non_differentiable(ids, overflow, n_iter, err)
        return plan[:, :k].transpose(1, 2), ids, overflow, n_iter, err, probe

    @staticmethod
    def backward(ctx, grad_ranks, grad_ids, grad_overflow, grad_n_iter, grad_err, grad_probe):
        if grad_ranks is None:
            return (None,) * 10
        plan, index, no_rest = ctx.saved_tensors
        n, width = ctx.shape
        with torch.profiler.record_function("softtopk::sorted_soft_topk_backward"):
            grad, norms = window_backward(plan, grad_ranks, index[:, :width], no_rest, grad_probe, n, ctx.epsilon,
                                          ctx.max_norm)
        if ctx.observer is not None:  # in units of the loss's gradient (the kernel's), as cap_row_grad_norm's
            ctx.observer(norms)
        return (grad,) + (None,) * 9


def use_window_kernel(backend: str, scores: Tensor, k: int, width: int) -> bool:
    """The dispatch point of :func:`~fairseq_softtopk.ops.sorted_soft_topk_window`: whether a call runs the
    kernels (``backend`` resolved on ``scores``' device). ``k > MAX_K`` and windows wider than
    :data:`MAX_WIDTH` run on the torch path, counted in ``fallback_counts()``; so do windows of ``k`` entries
    (every candidate is a rank: nothing to solve)."""
    if resolve_backend(backend, scores) == "torch" or width <= k:
        return False
    if k > MAX_K:
        record_fallback("rank_count", "sorted_soft_topk_window", warn=backend == "triton")
        return False
    if width > MAX_WIDTH:
        record_fallback("row_length", "sorted_soft_topk_window")
        return False
    return True
