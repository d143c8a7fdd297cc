"""``torch.library`` ops around the Triton kernels of :func:`~fairseq_softtopk.ops.sorted_soft_topk`.

* ``fairseq_softtopk::sorted_soft_topk_forward``: the whole semi-dual Newton solve of every row on the
  device, one launch (``sorted_soft_topk_triton._sorted_forward_kernel``; rows longer than :data:`WINDOW_MAX` on
  the torch path's certified candidate window, in scratch memory); returns the plan ``(rows, k + 1, n)`` (the
  torch path's layout) and per row the iterations used and the marginal error reached, as tensors;
* ``fairseq_softtopk::sorted_soft_topk_backward``: the implicit gradient, one launch.

Both have fake (meta) implementations and the forward an autograd rule (``torch.compile``,
``torch.library.opcheck``). The kernels module imports ``triton`` and is loaded on the first launch; importing
this module needs torch only. The ``k + 1`` anchors are held in registers: ``k`` is capped at
:data:`MAX_K` (beyond it the torch path runs, counted under ``fallback_counts()["rank_count"]``).
"""

import math
from pathlib import Path
from typing import Tuple

import torch
from torch import Tensor

from .._common import PreparedScores
from .._solver_info import SolverInfo
from ..candidate_window import candidate_window
from ..semi_dual import subnormal_cut
from ..semi_dual_warm_start import hard_start
from .backend import record_fallback, resolve_backend
from .loading import check_device, launch, load_kernels
from .soft_topk_op import _float32_halves, _launch_options

KERNEL_FILE = Path(__file__).with_name("sorted_soft_topk_triton.py")
#: the passes over entries every sorted kernel family imports (device functions only)
PASSES_FILE = Path(__file__).with_name("sorted_soft_topk_passes_triton.py")
#: the largest k the kernels take: the programs hold the k x k Newton system, the Gram matrix and its trial copy
#: as (KP, KP) float64/float32 register tiles, KP the next power of two >= k + 1. Compiled for sm_90 (Triton 3.9,
#: MAX_TILE entries, 4 warps), KP = 32 takes 230-255 registers a thread without spilling in both dtypes; at
#: KP = 64 the forward spills (68 bytes a thread in float32, 772 in float64). Beam sizes are far below 31. Triton 3.6
#: (the GPU machines' so far) spills a little in the forward already (80 bytes a thread at KP = 32 in float32, 36 at
#: KP = 16 in float64; the compile tests hold these as a ceiling).
MAX_K = 31
#: entries of a (BLOCK, KP) tile at most, on a GPU (BLOCK = MAX_TILE / KP entries of the row: 64 at KP = 16); at
#: 2048 entries (8 warps) the forward spills at KP = 16 ...
MAX_TILE = 1024
#: ... and under the interpreter, whose cost grows with the block iterations, not the entries
INTERPRETER_MAX_TILE = 1 << 17
#: rows of at most this many anchors (k + 1) take the passes over entries with the anchors unrolled (one entry a
#: thread, every anchor's values in registers of their own, no padded lane): every pass of the many-programs-a-row
#: kernels, the one-program backward and the one-program forward's plan (its solve keeps the tiles: unrolled beside
#: the solver's state it spills on sm_90). More anchors take the (BLOCK, KP) tiles. At 8 anchors a float64 pass
#: holds its 36 Gram terms and 8 counts in registers without spilling on sm_90 and sm_80 (the compile tests)
UNROLL_MAX_ANCHORS = 8
#: entries per iteration of the unrolled passes at most: one a thread of 4 warps; and under the interpreter
UNROLLED_BLOCK = 128
INTERPRETER_UNROLLED_BLOCK = 1 << 15
#: rows longer than this solve on the torch path's candidate window (see ``_sorted_forward_kernel``): the entries
#: at or above the row's floor, up to WINDOW_MAX of them, compacted into scratch memory; more: the whole row. At
#: the beam search's shape (38,840 candidates, k = 5, epsilon 0.03, log-probabilities) windows hold about 100
#: entries. Shorter rows solve on the whole row.
WINDOW_MAX = 4096
#: the window's first guess of the rank/rest boundary's distance below the (k+1)-th best, in epsilons (the torch
#: path's ``semi_dual_newton._WINDOW_GAP``; the kernels' ``WINDOW_GAP``)
WINDOW_GAP = 2.0
#: rows whose plan has more entries than this run on the torch path: offsets within a row are int32
MAX_PLAN_ENTRIES = 2 ** 31 - 2 ** 17

_kernel_modules = {}  # the loaded kernels module (one entry)


def kernel_module():
    """The kernels module (``sorted_soft_topk_triton.py``), loaded on first use.

    Raises:
        RuntimeError: the kernels and triton's own library were defined in different modes (``TRITON_INTERPRET``
            set or cleared after triton was imported).
    """
    if "module" not in _kernel_modules:
        _kernel_modules["module"] = load_kernels(KERNEL_FILE, f"{__package__}.sorted_soft_topk_triton",
                                                 "_sorted_forward_kernel")
    return _kernel_modules["module"]


def anchor_lanes(k: int) -> int:
    """``KP``: the ``k + 1`` anchors padded to a power of two, at least 16 (``tl.dot``'s smallest size)."""
    return max(16, 1 << k.bit_length())


def unrolled_anchors(k: int) -> int:
    """The kernels' ``K1``: ``k + 1`` where the passes unroll the anchors, 0 where they take ``(BLOCK, KP)`` tiles."""
    return k + 1 if k + 1 <= UNROLL_MAX_ANCHORS else 0


def block_size(n: int, k: int, interpret: bool, unroll: bool = False) -> int:
    """Entries per block iteration: the next power of two of ``n``, at least 16, at most a tile's entries / KP (with
    ``unroll`` and k's anchors unrolled: at most ``UNROLLED_BLOCK``)."""
    if unroll and unrolled_anchors(k):
        cap = INTERPRETER_UNROLLED_BLOCK if interpret else UNROLLED_BLOCK
    else:
        cap = (INTERPRETER_MAX_TILE if interpret else MAX_TILE) // anchor_lanes(k)
    return max(16, min(1 << max(n - 1, 0).bit_length(), cap))


def pass_options(block: int, k: int, unroll: bool = True) -> dict:
    """The constexpr ``K1`` and the compiler options of a kernel whose passes take ``block`` entries an iteration:
    with the anchors unrolled one entry a thread (warps: ``block / 32``, 1 to 8), in tiles by the tile's size."""
    anchors = unrolled_anchors(k) if unroll else 0
    if anchors:
        return dict(K1=anchors, num_warps=max(1, min(8, block // 32)), enable_fp_fusion=True)
    return dict(K1=0, **_launch_options(block * anchor_lanes(k)))


def _kernels_for(t: Tensor):
    """``(kernels module, interpreted)`` for tensors on ``t``'s device (raises where the kernels cannot run)."""
    module = kernel_module()
    check_device(module, t)
    return module, module.INTERPRETED


def _ridge(dtype: torch.dtype) -> float:
    """``solve_ridged``'s ridge, relative to the largest diagonal entry: ten ulps of the plan's dtype."""
    return 10 * torch.finfo(dtype).eps


def launch_forward(z: Tensor, valid: Tensor, eps: Tensor, top: Tensor, n_valid: Tensor, k: int, tol: float,
                   max_iter: int, has_mask: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """Runs the forward kernel; arguments as :func:`sorted_soft_topk_forward`'s. Returns ``(P, n_iter, err)``."""
    rows, n = z.shape
    z = z.contiguous()
    plan = z.new_empty((rows, k + 1, n))
    n_iter = z.new_empty((rows,), dtype=torch.int32)
    err = z.new_empty((rows,), dtype=torch.float64)
    if rows == 0:
        return plan, n_iter, err
    module, interpret = _kernels_for(z)
    block = block_size(n, k, interpret)
    g0 = hard_start(top, n_valid == k, eps, k).contiguous()  # (rows, k + 1) float64, on the device
    wmax = WINDOW_MAX if n > WINDOW_MAX else 0
    if wmax:
        floor, margin = window_floor(top, n_valid, eps, k, tol)
        scratch = window_buffer(z, rows, wmax)
    else:  # not read
        floor, margin, scratch = z.new_empty(1), err.new_empty(1), z.new_empty(1)
    tol_hi, tol_lo = _float32_halves(float(tol))
    launch(module._sorted_forward_kernel, (rows,),
        z, valid.contiguous().view(torch.uint8), eps.reshape(rows).contiguous(), n_valid.contiguous(), g0, floor,
        margin, scratch, plan, n_iter, err, n, k, tol_hi, tol_lo, max_iter, subnormal_cut(z.dtype, k),
        _ridge(z.dtype), HAS_MASK=has_mask, BLOCK=block, KP=anchor_lanes(k), WMAX=wmax,
        K1=unrolled_anchors(k), **_launch_options(block * anchor_lanes(k)))
    return plan, n_iter, err


def window_floor(top: Tensor, n_valid: Tensor, eps: Tensor, k: int, tol: float) -> Tuple[Tensor, Tensor]:
    """The first window's floor and the certification's margin, as ``semi_dual_newton.newton_solve`` computes
    them (on the device, no host read): ``(floor (rows,) in top's dtype, -inf for rows without a rest anchor;
    margin (rows,) float64, the log of the share of a rank each entry left out may carry)``."""
    out_of_window = (n_valid - k).clamp_min(1).double().unsqueeze(-1)  # at most n_valid - k entries left out
    margin = torch.log(0.01 * tol / out_of_window)
    edge = top[:, -1:] if top.shape[-1] > k else top[:, -1:] - 1.0
    floor = candidate_window(edge, k, eps, tol, out_of_window, boundary_gap=WINDOW_GAP)
    floor = torch.where((n_valid == k).unsqueeze(-1), torch.full_like(edge, -math.inf), floor)
    return floor.reshape(-1).contiguous(), margin.reshape(-1).contiguous()


def window_buffer(z: Tensor, rows: int, wmax: int) -> Tensor:
    """The forward kernel's scratch memory: ``(rows, wmax)`` in ``z``'s dtype, each row's window of entries."""
    return z.new_empty((rows, wmax))


def launch_backward(plan: Tensor, grad: Tensor, eps: Tensor, no_rest: Tensor) -> Tensor:
    """Runs the backward kernel; arguments as :func:`sorted_soft_topk_backward`'s. Returns ``(rows, n)``."""
    rows, anchors, n = plan.shape
    k = anchors - 1
    plan = plan.contiguous()
    grad = grad.to(plan.dtype).contiguous()  # the view's gradient: laid out as the plan
    grad_z = plan.new_empty((rows, n))
    if rows == 0:
        return grad_z
    module, interpret = _kernels_for(plan)
    block = block_size(n, k, interpret, unroll=True)
    launch(module._sorted_backward_kernel, (rows,),
        plan, grad, eps.reshape(rows).to(plan.dtype).contiguous(), no_rest.contiguous().view(torch.uint8), grad_z,
        n, k, _ridge(plan.dtype), BLOCK=block, KP=anchor_lanes(k), **pass_options(block, k))
    return grad_z


@torch.library.custom_op("fairseq_softtopk::sorted_soft_topk_forward", mutates_args=())
def sorted_soft_topk_forward(x: Tensor, z: Tensor, valid: Tensor, eps: Tensor, grad_eps: Tensor, top: Tensor,
                             n_valid: Tensor, k: int, tol: float, max_iter: int,
                             has_mask: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """The sorted soft top-k plan of prepared rows (see :class:`~fairseq_softtopk.ops._common.PreparedScores`).

    Args:
        x: ``(rows, n)`` oriented scores the plan is differentiated with respect to (not read).
        z: ``(rows, n)`` float32/float64 prepared scores, 0 where excluded. valid: ``(rows, n)`` bool (read
            only with ``has_mask``). eps: ``(rows, 1)`` temperatures of the solve; grad_eps: ``(rows, 1)`` in the
            scores' units (the backward's). top: ``(rows, min(k + 1, n))`` the largest valid ``z``, decreasing.
            n_valid: ``(rows,)`` valid counts in ``z``'s dtype.
        k (``<=`` :data:`MAX_K`), tol, max_iter: as :func:`~fairseq_softtopk.ops.sorted_soft_topk`'s.
    Returns:
        ``(P, n_iter, err)``: the plan ``(rows, k + 1, n)`` in ``z``'s dtype (anchors first, the rest last),
        ``n_iter`` ``(rows,)`` int32 (the iterations of all of a row's solves), ``err`` ``(rows,)`` float64 (the
        marginal error of the problem solved last: rows longer than :data:`WINDOW_MAX`, the certified window's,
        whose rest anchor's target is its count minus k, as the torch path's; otherwise the whole row's).
    """
    return launch_forward(z, valid, eps, top, n_valid, k, tol, max_iter, has_mask)


@sorted_soft_topk_forward.register_fake
def _sorted_soft_topk_forward_fake(x, z, valid, eps, grad_eps, top, n_valid, k, tol, max_iter, has_mask):
    rows, n = z.shape
    return (z.new_empty((rows, k + 1, n)), z.new_empty((rows,), dtype=torch.int32),
            z.new_empty((rows,), dtype=torch.float64))


@torch.library.custom_op("fairseq_softtopk::sorted_soft_topk_backward", mutates_args=())
def sorted_soft_topk_backward(plan: Tensor, grad: Tensor, eps: Tensor, no_rest: Tensor) -> Tensor:
    """``SortedSoftTopKFunction._vjp`` of the forward's plan ``(rows, k + 1, n)`` for the plan's gradient
    ``grad`` (its shape; the rest anchor's row is ignored), ``eps`` ``(rows, 1)`` in the scores' units,
    ``no_rest`` ``(rows,)`` bool. Returns ``(rows, n)`` in the plan's dtype."""
    return launch_backward(plan, grad, eps, no_rest)


@sorted_soft_topk_backward.register_fake
def _sorted_soft_topk_backward_fake(plan, grad, eps, no_rest):
    return plan.new_empty((plan.shape[0], plan.shape[2]))


def _setup_context(ctx, inputs, output):
    grad_eps, n_valid, k = inputs[4], inputs[6], inputs[7]
    plan, n_iter, err = output
    ctx.save_for_backward(plan, grad_eps, n_valid == k)
    ctx.mark_non_differentiable(n_iter, err)


def implicit_backward(backward_op, n_inputs: int):
    """The autograd rule of a forward op with :func:`sorted_soft_topk_forward`'s outputs and context: the scores'
    gradient (the op's first input) by ``backward_op(plan, grad_plan, grad_eps, no_rest)``, none for its other
    ``n_inputs - 1`` inputs."""
    def backward(ctx, grad_plan, grad_n_iter, grad_err):
        plan, grad_eps, no_rest = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            with torch.profiler.record_function("softtopk::sorted_soft_topk_backward"):  # the torch path's range
                grad_x = backward_op(plan, grad_plan, grad_eps, no_rest)
        return (grad_x,) + (None,) * (n_inputs - 1)

    return backward


sorted_soft_topk_forward.register_autograd(implicit_backward(sorted_soft_topk_backward, 11),
                                           setup_context=_setup_context)


def use_sorted_soft_topk_kernel(backend: str, scores: Tensor, n: int, k: int) -> bool:
    """The dispatch point of :func:`~fairseq_softtopk.ops.sorted_soft_topk`: whether a call runs the kernels.

    ``backend`` resolved on ``scores``' device (:func:`~.backend.resolve_backend`). Calls the kernels cannot take
    run on the torch path, counted: ``k >`` :data:`MAX_K` under ``"rank_count"`` (warned where ``"triton"`` was
    asked for by name: ``"auto"`` picks the torch path for large k on purpose), plans of more than
    :data:`MAX_PLAN_ENTRIES` entries a row under ``"row_length"`` (warned).
    """
    if resolve_backend(backend, scores) == "torch":
        return False
    if k > MAX_K:
        record_fallback("rank_count", "sorted_soft_topk", warn=backend == "triton")
        return False
    if (k + 1) * n > MAX_PLAN_ENTRIES:
        record_fallback("row_length", "sorted_soft_topk")
        return False
    return True


def sorted_soft_topk_kernel(x: Tensor, prep: PreparedScores, k: int, tol: float, max_iter: int,
                            sync_free: bool = False) -> Tuple[Tensor, SolverInfo]:
    """The kernels' sorted soft top-k of prepared rows: ``(out, info)``, ``out`` ``(rows, n, k)``, a view of the
    plan differentiable in ``x``; ``info``'s fields are 0-dim tensors (``n_iter`` the largest count of a row).

    Few long rows (``sorted_soft_topk_split_op.use_split_kernels``) run on the many-programs-a-row kernels, which
    read whether a row goes on every few rounds unless ``sync_free``; the others on one program a row (never a
    host read)."""
    from . import sorted_soft_topk_split_op as split  # it imports this module

    args = (x, prep.z, prep.valid, prep.eps, prep.grad_eps, prep.top, prep.n_valid, k, tol, max_iter,
            not prep.all_valid)
    if split.use_split_kernels(*prep.z.shape):
        plan, n_iter, err = split.sorted_soft_topk_split_forward(*args, sync_free)
    else:
        plan, n_iter, err = sorted_soft_topk_forward(*args)
    if err.shape[0]:
        max_err, max_iter_used = err.amax(), n_iter.amax()
    else:
        max_err, max_iter_used = err.new_zeros(()), n_iter.new_zeros(())
    return plan[:, :k].transpose(1, 2), SolverInfo(converged=max_err <= tol, n_iter=max_iter_used,
                                                   marginal_error=max_err)
