"""Triton kernels of :func:`~fairseq_softtopk.ops.sorted_soft_topk_window`: one launch for the whole forward (the
window's preparation, its certificate, the solve, the plan), one for the backward (the implicit gradient, the
row's gradient cap, the scatter into the scores' gradient).

* forward (:func:`_window_forward_kernel`): one program per row reads the row's ``W + 1`` best scores
  (``torch.topk``'s values, decreasing), centres the ``W`` of the window on the best into scratch memory (with
  their validity), starts from the hard start (each rank boundary midway between consecutive scores,
  ``semi_dual_warm_start``), runs the sorted operator's semi-dual Newton solve on them
  (``sorted_soft_topk_triton._newton``: in-kernel stopping tests, no host read), writes the plan ``(k + 1, W)``,
  and flags the row where the ``(W + 1)``-th best lies at or above the floor (``candidate_window``'s, ``depth``
  epsilons under the ``(k + 1)``-th best), or where fewer than ``k`` candidates are finite;
* backward (:func:`_window_backward_kernel`): ``SortedSoftTopKFunction._vjp`` of the window plan (two passes:
  ``b`` and the Gram matrix, then the gradient), a third pass scaling the row to the cap (``gradient_cap``'s rule)
  and storing it at the window's candidates in the ``(rows, n)`` gradient (zeros elsewhere, written first).

This module imports ``triton`` (and the sorted kernels' device functions); ``sorted_soft_topk_window_op`` loads it
on the first launch.
"""

import triton
import triton.language as tl

from fairseq_softtopk.ops.kernels.sorted_soft_topk_passes_triton import LOG2E, _div, _plan_tile
from fairseq_softtopk.ops.kernels.sorted_soft_topk_triton import _hessian, _newton, _solve_ridged, _targets


@triton.jit
def _window_forward_kernel(TOP, Z, VALID, PLAN, OVERFLOW, NO_REST, N_ITER, ERR, PROBE, W, top_stride, k, eps_hi, eps_lo,
                           depth_hi, depth_lo, tol_hi, tol_lo, max_iter, CUT, RIDGE, HAS_OUT: tl.constexpr,
                           BLOCK: tl.constexpr, KP: tl.constexpr):
    """One program per row.

    Args (per row): TOP ``(rows, top_stride)`` the row's best scores, decreasing (``-inf``: excluded), the window its
    first ``W``, with ``HAS_OUT`` the ``(W + 1)``-th after them; Z, VALID ``(rows, W)`` scratch (the window centred,
    0 where excluded; uint8 validity); PLAN ``(rows, k + 1, W)``; OVERFLOW, NO_REST ``(rows,)`` uint8 (rows with
    exactly k valid entries: no rest anchor); N_ITER ``(rows,)`` int32; ERR ``(rows,)`` float64; PROBE a 0-dim
    zero in the scores' dtype (the row cap's scale probe, written by the first program). eps, depth (the
    floor's distance under the (k+1)-th best, in epsilons) and tol as float32 halves (Triton passes Python floats as
    float32).
    """
    row = tl.program_id(0).to(tl.int64)
    if row == 0:
        tl.store(PROBE, tl.zeros((), dtype=PROBE.dtype.element_ty))
    TOP += row * top_stride
    Z += row * W
    VALID += row * W
    PLAN += row * (k + 1) * W
    eps = tl.cast(eps_hi, tl.float64) + tl.cast(eps_lo, tl.float64)
    tol = tl.cast(tol_hi, tl.float64) + tl.cast(tol_lo, tl.float64)
    best = tl.load(TOP)
    n_valid = tl.cast(0.0, tl.float64)
    for start in range(0, W, BLOCK):  # the window centred on its best, and its validity
        offs = start + tl.arange(0, BLOCK)
        inside = offs < W
        v = tl.load(TOP + offs, mask=inside, other=float("-inf"))
        valid = v > float("-inf")
        tl.store(Z + offs, tl.where(valid, v - best, 0.0), mask=inside)
        tl.store(VALID + offs, valid.to(tl.uint8), mask=inside)
        n_valid += tl.sum(valid.to(tl.float64), axis=0)
    lane = tl.arange(0, KP)
    kf = tl.cast(k, tl.float64)
    no_rest = n_valid == kf
    # the hard start (semi_dual_warm_start.hard_start): g_r = -sum_{s >= r, s < k} (z_s + z_{s+1}) / 2 / eps
    z_top = tl.load(TOP + lane, mask=lane <= k, other=0.0).to(tl.float64) - best.to(tl.float64)
    z_next = tl.load(TOP + lane + 1, mask=lane < k, other=0.0).to(tl.float64) - best.to(tl.float64)
    z_next = tl.where(lane == k - 1, tl.where(no_rest, z_top - 1.0, z_next), z_next)  # no rest anchor: k-th best - 1
    threshold = tl.where(lane < k, 0.5 * (z_top + z_next), 0.0)
    ri = tl.arange(0, KP)[:, None]
    ci = tl.arange(0, KP)[None, :]
    g0 = -tl.sum(tl.where((ci >= ri) & (ci < k), threshold[None, :], 0.0), axis=1) / eps
    g0 = tl.where(lane < k, g0, 0.0)
    anchor = lane[None, :]
    y_eps2 = (tl.where(lane <= k, k - lane, 0).to(tl.float64) * (LOG2E / eps))[None, :]
    rest_bias = tl.where(lane == k, tl.where(no_rest, float("-inf"), 0.0), 0.0)
    target, inv_target = _targets(n_valid, no_rest, k, KP)
    g, err, used = _newton(Z, VALID, W, True, g0, target, inv_target, no_rest, y_eps2, rest_bias, anchor, k, tol,
                           max_iter, CUT, RIDGE, True, BLOCK, KP, 0)  # windows of <= 512: (BLOCK, KP) tiles
    tl.store(N_ITER + row, used)
    tl.store(ERR + row, err)
    tl.store(NO_REST + row, no_rest.to(tl.uint8))
    shift = ((g + rest_bias) * LOG2E)[None, :]
    for start in range(0, W, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        P, valid, lse_i = _plan_tile(Z, VALID, offs, W, True, y_eps2, shift, anchor, k, CUT, True)
        tl.store(PLAN + anchor * W + offs[:, None], P, mask=(offs < W)[:, None] & (anchor <= k))
    overflow = (n_valid < kf).to(tl.uint8)  # fewer than k finite candidates: no plan exists
    if HAS_OUT:  # the certificate: the best candidate left out lies under the floor (excluded ones carry nothing)
        depth = (tl.cast(depth_hi, tl.float64) + tl.cast(depth_lo, tl.float64)) * eps
        kth = tl.load(TOP + k)
        outside = tl.load(TOP + W)
        floor = kth - depth.to(kth.dtype)
        overflow = overflow | ((outside > float("-inf")) & (outside >= floor)).to(tl.uint8)
    tl.store(OVERFLOW + row, overflow)


@triton.jit
def _window_grad_tile(PLAN, GRAD, offs, W, k, u, y, anchor, rank, eps):
    """The scores' gradient on the window's entries ``offs`` (``(BLOCK,)``, the plan's dtype) from the row's
    ``u = K^{-1} b`` (``_sorted_backward_kernel``'s second pass)."""
    inside = (offs < W)[:, None]
    P = tl.load(PLAN + anchor * W + offs[:, None], mask=inside & rank, other=0.0)
    PG = P * tl.load(GRAD + offs[:, None] * k + anchor, mask=inside & rank, other=0.0).to(P.dtype)
    G_bar = tl.sum(PG, axis=1)
    y_bar = tl.sum(P * y, axis=1)
    Pu = tl.sum(P * u, axis=1)
    return _div(tl.sum(y * (PG - P * u), axis=1) - y_bar * (G_bar - Pu), eps.to(P.dtype))


@triton.jit
def _window_backward_kernel(PLAN, GRAD, IDS, NO_REST, SCALE, GRAD_SCORES, NORMS, W, ids_stride, n, k, eps_hi, eps_lo,
                            max_norm, RIDGE, HAS_SCALE: tl.constexpr, CAPPED: tl.constexpr, BLOCK: tl.constexpr,
                            KP: tl.constexpr, ZBLOCK: tl.constexpr):
    """One program per row: the window plan's implicit gradient (``_sorted_backward_kernel``'s, the plan's
    gradient read in the ranks' ``(W, k)`` layout; NO_REST the forward's), its norm to ``NORMS`` (float64, divided
    by ``|SCALE|`` where nonzero: the scale probe's gradient, with ``HAS_SCALE``), the row scaled to at most
    ``max_norm`` (times ``|SCALE|``) with ``CAPPED``,
    and stored at the window's candidates ``IDS`` (``(rows, W)``, rows ``ids_stride`` apart) of ``GRAD_SCORES``
    ``(rows, n)``, whose other entries the program sets to zero first (``ZBLOCK`` at a time)."""
    row = tl.program_id(0).to(tl.int64)
    PLAN += row * (k + 1) * W
    GRAD += row * W * k
    IDS += row * ids_stride
    GRAD_SCORES += row * n
    eps = tl.cast(eps_hi, tl.float64) + tl.cast(eps_lo, tl.float64)
    no_rest = tl.load(NO_REST + row) != 0
    lane = tl.arange(0, KP)
    anchor = lane[None, :]
    rank = anchor < k
    y = tl.where(rank, k - anchor, 0).to(PLAN.dtype.element_ty)
    b = tl.zeros((KP,), dtype=tl.float64)
    gram = tl.zeros((KP, KP), dtype=PLAN.dtype.element_ty)
    for start in range(0, W, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = (offs < W)[:, None]
        P = tl.load(PLAN + anchor * W + offs[:, None], mask=inside & (anchor <= k), other=0.0)
        PG = P * tl.load(GRAD + offs[:, None] * k + anchor, mask=inside & rank, other=0.0).to(P.dtype)
        G_bar = tl.sum(PG, axis=1)
        b += tl.sum(PG.to(tl.float64), axis=0) - tl.sum(tl.where(rank, P * G_bar[:, None], 0.0).to(tl.float64),
                                                        axis=0)
        gram += tl.dot(tl.trans(P), P, input_precision="ieee")
    u = _solve_ridged(_hessian(gram, k, no_rest, KP), b, k, RIDGE, KP).to(PLAN.dtype.element_ty)[None, :]
    squares = tl.cast(0.0, tl.float64)
    for start in range(0, W, BLOCK):  # the row's norm
        offs = start + tl.arange(0, BLOCK)
        grad_z = _window_grad_tile(PLAN, GRAD, offs, W, k, u, y, anchor, rank, eps)
        squares += tl.sum(tl.where(offs < W, grad_z.to(tl.float64) * grad_z.to(tl.float64), 0.0), axis=0)
    norm = tl.sqrt(squares)
    scale = tl.cast(1.0, tl.float64)
    if HAS_SCALE:
        scale = tl.abs(tl.load(SCALE).to(tl.float64))
    tl.store(NORMS + row, norm / tl.where(scale > 0, scale, 1.0))  # in units of the loss's gradient
    factor = tl.cast(1.0, tl.float64)
    if CAPPED:
        factor = tl.minimum(tl.cast(max_norm, tl.float64) * scale / tl.maximum(norm, 1e-300), 1.0)
    for start in range(0, n, ZBLOCK):  # the row's gradient is zero outside the window ...
        offs = start + tl.arange(0, ZBLOCK)
        tl.store(GRAD_SCORES + offs, tl.zeros((ZBLOCK,), dtype=GRAD_SCORES.dtype.element_ty), mask=offs < n)
    tl.debug_barrier()  # ... written before the window's entries, by any of the program's threads
    for start in range(0, W, BLOCK):  # the (capped) gradient, at the window's candidates
        offs = start + tl.arange(0, BLOCK)
        grad_z = _window_grad_tile(PLAN, GRAD, offs, W, k, u, y, anchor, rank, eps)
        ids = tl.load(IDS + offs, mask=offs < W, other=0)
        tl.store(GRAD_SCORES + ids, (grad_z.to(tl.float64) * factor).to(grad_z.dtype), mask=offs < W)
