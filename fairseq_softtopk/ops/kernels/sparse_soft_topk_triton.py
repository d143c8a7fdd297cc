"""Triton kernels of :func:`~fairseq_softtopk.ops.sparse_soft_topk`: the exact threshold and the closed-form backward.

The torch path sorts each row (a window of it) and searches the breakpoints; here one program solves one row
without a sort, on the rows of :func:`~fairseq_softtopk.ops.sparse_rows.sparse_rows` (in units of lambda, relative
to the k-th best, clamped to ``[-3, 1]``, so that no number is large):

* forward (:func:`_sparse_threshold_kernel`): ``h(t) = sum_i clip(z_i - t, 0, 1) ** POWER`` (POWER 1 for p = 2,
  3 for p = 4/3) is continuous and decreasing, polynomial between the breakpoints ``z_i`` and ``z_i - 1``. Each
  pass over the row at a trial ``t`` gives ``h(t)`` and, on the side of ``t`` where the root lies, the piece that
  holds ``t``: its ends (the nearest breakpoints, by exact comparisons) and the sums that fix ``h`` on it (the
  count, and for the cube the power sums, of the entries strictly inside ``(0, 1)``). If ``h`` crosses ``k`` on
  that piece, ``tau`` is solved there in registers (p = 2: one division; p = 4/3: Newton on the piece's cubic,
  convex and decreasing, from its left end: monotone, no overshoot, as the torch path's), exact up to rounding
  because the sets are known exactly. Otherwise the piece's far end bounds the root (a bracket of breakpoints
  that starts at ``[z_(k+1) - 1, z_(k)]``) and the next trial is the Newton step, or the bracket's middle when
  that step leaves the bracket or the bracket has not halved in two passes (so the search ends, at worst, when
  the bracket is one piece). A gap ``z_(k) - z_(k+1) >= 1`` gives the hard top-k, from the torch path's threshold.
* backward (:func:`_sparse_backward_kernel`): with ``s = clip(z - tau, 0, 1)`` and ``F = {0 < s < 1}``,
  ``w = POWER s ** (POWER - 1)`` on ``F`` (0 elsewhere), ``grad_z = w / lambda (g - sum w g / sum w)``: two passes.

Per-entry arithmetic of the search runs in float64 (the prepared rows are in ``[-3, 1]``: exact in float64 for
float32 rows), every scalar is float64; the mask is written as the torch path's, ``clip(z - tau, 0, 1)`` in the
rows' dtype with ``tau`` rounded to it. This module imports ``triton``: ``sparse_soft_topk_op.kernel_module``
loads it on the first launch. Only APIs present in Triton 3.6 are used.
"""

import triton
import triton.language as tl


@triton.jit
def _div(x, y):
    """``x / y`` rounded as IEEE division (torch's), whatever Triton's default division for float32."""
    if x.dtype == tl.float32:
        return tl.math.div_rn(x, y)
    else:
        return x / y


@triton.jit
def _piece_sums(Z, VALID, n, t, HAS_MASK: tl.constexpr, POWER: tl.constexpr, BLOCK: tl.constexpr):
    """One pass at the trial threshold ``t`` (float64), with ``d_i = z_i - t`` over the valid entries.

    Returns ``(h, m, c0, c1, s1, s2, s3, right, left)`` (float64): ``h = sum clip(d, 0, 1) ** POWER``; ``m`` the
    count and ``s_j`` the sums of ``d ** j`` over ``0 < d <= 1`` (the entries inside the piece right of ``t``;
    ``s_j`` only for POWER 3); ``c0``, ``c1`` the counts of ``d == 0`` and ``d == 1`` (the piece left of ``t``
    holds ``0 <= d < 1``); ``right``, ``left`` the distances from ``t`` to the nearest breakpoint on each side
    (``inf`` where there is none).
    """
    h = tl.zeros((), dtype=tl.float64)
    m = tl.zeros((), dtype=tl.int32)
    c0 = tl.zeros((), dtype=tl.int32)
    c1 = tl.zeros((), dtype=tl.int32)
    s1 = tl.zeros((), dtype=tl.float64)
    s2 = tl.zeros((), dtype=tl.float64)
    s3 = tl.zeros((), dtype=tl.float64)
    right = tl.full((), float("inf"), tl.float64)
    left = tl.full((), float("inf"), tl.float64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < n
        z = tl.load(Z + offs, mask=valid, other=0.0).to(tl.float64)
        if HAS_MASK:
            valid = valid & (tl.load(VALID + offs, mask=valid, other=0) != 0)
        d = z - t
        y = tl.minimum(tl.maximum(d, 0.0), 1.0)
        if POWER == 3:
            y = y * y * y
        h += tl.sum(tl.where(valid, y, 0.0), axis=0)
        free = valid & (d > 0.0) & (d <= 1.0)
        m += tl.sum(free.to(tl.int32), axis=0)
        c0 += tl.sum((valid & (d == 0.0)).to(tl.int32), axis=0)
        c1 += tl.sum((valid & (d == 1.0)).to(tl.int32), axis=0)
        if POWER == 3:
            df = tl.where(free, d, 0.0)
            s1 += tl.sum(df, axis=0)
            s2 += tl.sum(df * df, axis=0)
            s3 += tl.sum(df * df * df, axis=0)
        # moving t up: a full entry becomes free at d = 1, a free one leaves at d = 0; moving down, the reverse
        up = tl.where(d > 1.0, d - 1.0, tl.where(d > 0.0, d, float("inf")))
        down = tl.where(d < 0.0, -d, tl.where(d < 1.0, 1.0 - d, float("inf")))
        right = tl.minimum(right, tl.min(tl.where(valid, up, float("inf")), axis=0))
        left = tl.minimum(left, tl.min(tl.where(valid, down, float("inf")), axis=0))
    return (h, m.to(tl.float64), c0.to(tl.float64), c1.to(tl.float64), s1, s2, s3, right, left)


@triton.jit
def _piece_excess(u, excess, m, s1, s2, POWER: tl.constexpr):
    """``h(t + u) - k`` on a piece, from ``excess = h(t) - k`` and its free entries' count and power sums."""
    if POWER == 3:
        return excess - 3.0 * u * s2 + 3.0 * u * u * s1 - m * u * u * u
    else:
        return excess - m * u


@triton.jit
def _piece_root(excess, m, s1, s2, ua, POWER: tl.constexpr):
    """The root ``u`` of :func:`_piece_excess` on a piece that holds it, left end ``ua``: p = 2 in closed form,
    p = 4/3 by Newton from ``ua`` (the cubic is convex and decreasing there: the iterates rise to the root)."""
    if POWER == 3:
        u = ua
        for _ in range(40):
            value = _piece_excess(u, excess, m, s1, s2, POWER)
            slope = -3.0 * (s2 - 2.0 * u * s1 + m * u * u)  # -3 sum (d - u)^2
            u = tl.where(slope < 0, u - value / tl.where(slope < 0, slope, -1.0), u)
        return u
    else:
        return tl.where(m > 0, excess / tl.where(m > 0, m, 1.0), 0.0)


@triton.jit
def _sparse_threshold_kernel(Z, VALID, TOP, OUT, BASE, TAU, N_ITER, n, top_cols, k, max_iter,
                             HAS_MASK: tl.constexpr, POWER: tl.constexpr, GAP_CAP: tl.constexpr,
                             RESOLUTION: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: ``tau`` with ``sum_i clip(z_i - tau, 0, 1) ** POWER = k``, then the mask.

    Args (per row; ``n`` entries, row-major, contiguous):
        Z: ``(rows, n)`` prepared rows (``sparse_rows``: 0 where excluded). VALID: ``(rows, n)`` uint8, nonzero
        where the entry takes part (read only with ``HAS_MASK``). TOP: ``(rows, top_cols)`` the best positions,
        ``TOP[k] = -gap``. OUT: ``(rows, n)`` the mask ``clip(z - tau, 0, 1) ** POWER`` (0 where excluded).
        BASE: ``(rows, n)`` ``clip(z - tau, 0, 1)`` (written for POWER 3 only). TAU: ``(rows,)`` float64
        thresholds. N_ITER: ``(rows,)`` int32 passes of the search (0: the hard top-k).
    """
    row = tl.program_id(0).to(tl.int64)
    Z += row * n
    VALID += row * n
    OUT += row * n
    BASE += row * n
    TOP += row * top_cols
    kf = tl.cast(k, tl.float64)
    gap = tl.load(TOP + k, mask=top_cols > k, other=-GAP_CAP)
    gap = -tl.where(top_cols > k, gap, -GAP_CAP)
    # the torch path's threshold of the hard top-k, in the rows' dtype: the middle of [z_(k+1), z_(k) - 1]
    tau_hard = -0.5 * (gap + 1.0)
    done = gap >= 1.0
    # h(lo) >= k + 1 (the k + 1 best at 1), h(hi) <= k - 1 (only the entries above the k-th best count)
    lo = -gap.to(tl.float64) - 1.0
    hi = tl.zeros((), dtype=tl.float64)
    t = 0.5 * (lo + hi)
    width = hi - lo
    stalled = tl.zeros((), dtype=tl.int32)
    n_iter = tl.zeros((), dtype=tl.int32)
    # the piece that holds the root, once found: its trial point, h - k there, its free entries' sums, its ends
    found = tl.zeros((), dtype=tl.int1)
    piece_t = t
    piece_excess = tl.zeros((), dtype=tl.float64)
    piece_m = tl.zeros((), dtype=tl.float64)
    piece_s1 = tl.zeros((), dtype=tl.float64)
    piece_s2 = tl.zeros((), dtype=tl.float64)
    piece_ua = tl.zeros((), dtype=tl.float64)
    piece_ub = tl.zeros((), dtype=tl.float64)
    # the guard changes nothing here; without it triton 3.6 fails to compile (TritonGPUCoalesce) a loop that it
    # can prove never runs (k, top_cols equal and max_iter 1: integer arguments equal to 1 are constants)
    if done == 0:
        while (done == 0) & (n_iter < max_iter):
            h, m, c0, c1, s1, s2, s3, right, left = _piece_sums(Z, VALID, n, t, HAS_MASK, POWER, BLOCK)
            n_iter += 1
            excess = h - kf
            up = excess > 0  # the root is right of t (its piece: 0 < d <= 1), else left (0 <= d < 1)
            m = tl.where(up, m, m - c1 + c0)
            s1 = tl.where(up, s1, s1 - c1)
            s2 = tl.where(up, s2, s2 - c1)
            # the piece's ends relative to t (rows lie in [-3, 1]: 8 is beyond every breakpoint); h(t) = k: t itself
            ua = tl.where(up | (excess == 0), 0.0, -tl.minimum(left, 8.0))
            ub = tl.where(up & (excess != 0), tl.minimum(right, 8.0), 0.0)
            crosses = (_piece_excess(ua, excess, m, s1, s2, POWER) >= 0) & \
                      (_piece_excess(ub, excess, m, s1, s2, POWER) <= 0)
            crosses = crosses | (excess == 0)
            found = found | crosses
            piece_t = tl.where(crosses, t, piece_t)
            piece_excess = tl.where(crosses, excess, piece_excess)
            piece_m = tl.where(crosses, m, piece_m)
            piece_s1 = tl.where(crosses, s1, piece_s1)
            piece_s2 = tl.where(crosses, s2, piece_s2)
            piece_ua = tl.where(crosses, ua, piece_ua)
            piece_ub = tl.where(crosses, ub, piece_ub)
            # no root on this piece: its far end bounds the root
            lo = tl.where(up & (crosses == 0), tl.maximum(lo, t + ub), lo)
            hi = tl.where(up | crosses, hi, tl.minimum(hi, t + ua))
            slope = m
            if POWER == 3:
                slope = 3.0 * s2
            newton = t + excess / tl.where(slope > 0, slope, 1.0)
            stalled = tl.where(hi - lo > 0.5 * width, stalled + 1, 0)
            width = tl.where(stalled == 0, hi - lo, width)
            bisect = (stalled >= 2) | (slope <= 0) | (newton <= lo) | (newton >= hi)
            stalled = tl.where(bisect, 0, stalled)
            width = tl.where(bisect, hi - lo, width)
            t = tl.where(bisect, 0.5 * (lo + hi), newton)
            # a bracket at the resolution of float64 (its middle is the root to rounding) ends the search too
            done = found | (hi - lo <= RESOLUTION * (1.0 + tl.abs(t)))
    u = _piece_root(piece_excess, piece_m, piece_s1, piece_s2, piece_ua, POWER)
    u = tl.minimum(tl.maximum(u, piece_ua), piece_ub)
    tau = tl.where(found, piece_t + u, 0.5 * (lo + hi))  # not found: a collapsed bracket, or max_iter passes
    z_dtype = Z.dtype.element_ty
    tau_row = tl.where(gap >= 1.0, tau_hard, tau.to(z_dtype))
    tl.store(TAU + row, tau_row.to(tl.float64))
    tl.store(N_ITER + row, n_iter)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < n
        z = tl.load(Z + offs, mask=inside, other=0.0)
        valid = inside
        if HAS_MASK:
            valid = valid & (tl.load(VALID + offs, mask=inside, other=0) != 0)
        s = tl.where(valid, tl.minimum(tl.maximum(z - tau_row, 0.0), 1.0), 0.0)
        if POWER == 3:
            tl.store(BASE + offs, s, mask=inside)
            tl.store(OUT + offs, s * s * s, mask=inside)
        else:
            tl.store(OUT + offs, s, mask=inside)


@triton.jit
def _weights(s, POWER: tl.constexpr):
    """``POWER s ** (POWER - 1)`` where ``0 < s < 1``, 0 elsewhere, in ``s``'s dtype (the torch path's rounding)."""
    free = (s > 0) & (s < 1)
    if POWER == 3:
        return tl.where(free, 3.0 * (s * s), 0.0).to(s.dtype)
    else:
        return tl.where(free, 1.0, 0.0).to(s.dtype)


@triton.jit
def _sparse_backward_kernel(BASE, GRAD, LAMBDA, GRAD_Z, n, POWER: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: ``grad_z = w / lambda * (g - sum_i w_i g_i / sum_i w_i)``, ``w = POWER s ** (POWER - 1)``
    where ``0 < s < 1``, 0 elsewhere.

    Args: BASE, GRAD, GRAD_Z: ``(rows, n)`` contiguous (the forward's ``s = clip(z - tau, 0, 1)``, the output's
    gradient, the result); LAMBDA: ``(rows,)`` the regularisation in the scores' units.
    """
    row = tl.program_id(0).to(tl.int64)
    BASE += row * n
    GRAD += row * n
    GRAD_Z += row * n
    lam = tl.load(LAMBDA + row)
    w_sum = tl.zeros((), dtype=tl.float64)
    wg_sum = tl.zeros((), dtype=tl.float64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < n
        s = tl.load(BASE + offs, mask=inside, other=0.0)
        g = tl.load(GRAD + offs, mask=inside, other=0.0)
        w = _weights(s, POWER)
        w_sum += tl.sum(w.to(tl.float64), axis=0)
        wg_sum += tl.sum((w * g).to(tl.float64), axis=0)
    mean_g = wg_sum / tl.where(w_sum > 0, w_sum, 1.0)
    mean_row = mean_g.to(GRAD.dtype.element_ty)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < n
        s = tl.load(BASE + offs, mask=inside, other=0.0)
        g = tl.load(GRAD + offs, mask=inside, other=0.0)
        w = _weights(s, POWER)
        tl.store(GRAD_Z + offs, _div(w, lam) * (g - mean_row), mask=inside)
