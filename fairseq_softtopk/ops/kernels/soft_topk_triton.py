"""Triton kernels of :func:`~fairseq_softtopk.ops.soft_topk`'s linear-cost solve and its implicit backward.

The torch path (``_threshold_solve`` in ``ops/soft_topk.py``) launches a dozen kernels per Newton
iteration and reads the convergence test on the host; here one program solves one row to the end:

* forward (:func:`_soft_topk_threshold_kernel`): one pass writes ``s = z / eps`` (``-inf`` where excluded)
  into the logits buffer and finds the row's smallest valid score; then the safeguarded Newton of the torch
  path, the threshold ``t``, its bracket and the stopping test in float64 registers, each iteration one
  pass over ``s`` (two sums: ``sum sigmoid`` and its slope); then one pass writes the logits and the output;
* backward (:func:`_soft_topk_backward_kernel`): ``threshold_vjp``, two O(n) passes (the sums
  ``sum w`` and ``sum w g``, then the gradient).

Rows longer than ``BLOCK`` are walked in blocks. The O(n) work runs in the scores' dtype as the torch
path's does (``t`` rounded to it), the sums accumulate in float64 (more accurate than the torch path's
float32 sums at any ``n``), and every scalar (threshold, bracket, error) is float64. Float scalars are
passed to Triton as float32, so ``tol`` travels as two float32 halves (``tol_hi + tol_lo``).

This module imports ``triton``: ``soft_topk_op.kernel_module`` loads it on the first launch (the package never
imports it otherwise). Only APIs present in Triton 3.6 are used.
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
def _sigmoid_sums(S, n, t, LIMIT: tl.constexpr, BLOCK: tl.constexpr):
    """``(sum_i sigmoid(s_i - t), sum_i sigmoid * (1 - sigmoid))`` over a row of ``s`` (float64 sums);
    the logits are clamped to ``[-LIMIT, LIMIT]`` like the torch path's."""
    acc = tl.zeros((BLOCK,), dtype=tl.float64)
    acc_slope = tl.zeros((BLOCK,), dtype=tl.float64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < n
        s = tl.load(S + offs, mask=inside, other=float("-inf"))
        sig = tl.sigmoid(_clamped(s - t, LIMIT))
        sig = tl.where(inside, sig, 0.0)
        acc += sig.to(tl.float64)
        acc_slope += (sig - sig * sig).to(tl.float64)
    return tl.sum(acc, axis=0), tl.sum(acc_slope, axis=0)


@triton.jit
def _stop_test(total, k, full, denom, t, lo, hi, tol, RESOLUTION: tl.constexpr):
    """``(excess, err, done)`` of an evaluation: the torch path's marginal error and stopping rule."""
    excess = total - k
    err = tl.where(full, 0.0, tl.abs(excess) / denom)
    done = (err <= tol) | (hi - lo <= RESOLUTION * (1.0 + tl.abs(t)))
    return excess, err, done


@triton.jit
def _clamped(x, LIMIT: tl.constexpr):
    """``x`` clamped to ``[-LIMIT, LIMIT]``, as the torch path clamps the logits."""
    return tl.minimum(tl.maximum(x, -LIMIT), LIMIT)


@triton.jit
def _hard_start(best, kth, after, has_after, full, n_valid, kf, eps64):
    """``(t, span, hi, denom)`` of a row (or of each row of a vector of them), float64: the hard threshold that
    starts Newton (midway between the k-th and (k+1)-th best score, in units of eps), the half-width of a bracket
    that always holds (the sum > k at ``lo``, < k at ``hi``), its upper end, and the marginal error's denominator."""
    after = tl.where(has_after & (full == 0), after, kth - 1.0)
    t = 0.5 * (kth + after) / eps64
    span = tl.log(n_valid) + 2.0
    hi = best / eps64 + span
    denom = tl.maximum(tl.minimum(n_valid - kf, kf), 1.0)
    return t, span, hi, denom


@triton.jit
def _bracketed_newton(t, lo, hi, excess, slope):
    """One step of the torch path's safeguarded Newton: the bracket narrowed to ``t``'s side, then Newton's point
    where it lies inside, else the bracket's midpoint. Returns ``(t, lo, hi)``."""
    lo = tl.where(excess > 0, tl.maximum(lo, t), lo)
    hi = tl.where(excess < 0, tl.minimum(hi, t), hi)
    newton = t + excess / tl.maximum(slope, 1e-300)
    inside_bracket = (newton > lo) & (newton < hi) & (slope > 0)
    return tl.where(inside_bracket, newton, 0.5 * (lo + hi)), lo, hi


@triton.jit
def _logits(s, t, full, LIMIT: tl.constexpr):
    """The output's logits from ``s = z / eps`` at the threshold ``t`` (in ``s``'s dtype): clamped, ``+inf`` on
    full rows, ``-inf`` where excluded."""
    logits = tl.where(full, float("inf"), _clamped(s - t, LIMIT))
    return tl.where(s == float("-inf"), float("-inf"), logits)


@triton.jit
def _soft_topk_threshold_kernel(Z, VALID, EPS, TOP, N_VALID, S, OUT, N_ITER, ERR,
                                n, top_cols, k, tol_hi, tol_lo, max_iter,
                                HAS_MASK: tl.constexpr, LIMIT: tl.constexpr, RESOLUTION: tl.constexpr,
                                BLOCK: tl.constexpr):
    """One program per row: ``t`` with ``sum_i sigmoid(z_i / eps - t) = k``, then the logits and the output.

    Args (per row ``r`` of ``rows``; ``n`` entries, row-major, contiguous):
        Z: ``(rows, n)`` prepared scores (0 where excluded). VALID: ``(rows, n)`` uint8, nonzero where the
        entry takes part (read only with ``HAS_MASK``). EPS: ``(rows,)`` temperatures. TOP: ``(rows,
        top_cols)`` the largest valid scores, decreasing. N_VALID: ``(rows,)`` valid counts (Z's dtype).
        S: ``(rows, n)`` output: the logits ``clamp(z / eps - t)``, ``+inf`` on full rows, ``-inf`` where
        excluded (it holds ``z / eps`` during the solve). OUT: ``(rows, n)`` ``sigmoid`` of the logits.
        N_ITER: ``(rows,)`` int32 iterations. ERR: ``(rows,)`` float64 marginal error reached.
    """
    row = tl.program_id(0).to(tl.int64)
    Z += row * n
    VALID += row * n
    S += row * n
    OUT += row * n
    TOP += row * top_cols
    tol = tl.cast(tol_hi, tl.float64) + tl.cast(tol_lo, tl.float64)  # scalar arguments: tl.cast, not .to
    eps = tl.load(EPS + row)
    eps64 = eps.to(tl.float64)
    n_valid = tl.load(N_VALID + row).to(tl.float64)
    kf = tl.cast(k, tl.float64)
    full = n_valid == kf  # every valid entry selected: A = 1, no threshold exists
    t, span, hi, denom = _hard_start(tl.load(TOP).to(tl.float64), tl.load(TOP + k - 1).to(tl.float64),
                                     tl.load(TOP + k, mask=top_cols > k, other=0.0).to(tl.float64), top_cols > k,
                                     full, n_valid, kf, eps64)
    # pass 0: s = z / eps (-inf where excluded) into S, and the smallest valid z for the bracket
    z_min = tl.full((BLOCK,), float("inf"), Z.dtype.element_ty)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < n
        z = tl.load(Z + offs, mask=inside, other=0.0)
        valid = inside
        if HAS_MASK:
            valid = valid & (tl.load(VALID + offs, mask=inside, other=0) != 0)
        tl.store(S + offs, tl.where(valid, _div(z, eps), float("-inf")), mask=inside)
        z_min = tl.minimum(z_min, tl.where(valid, z, float("inf")))
    lo = tl.min(z_min, axis=0).to(tl.float64) / eps64 - span
    tl.debug_barrier()  # S is read back by other threads of this program
    total, slope = _sigmoid_sums(S, n, t.to(Z.dtype.element_ty), LIMIT, BLOCK)
    excess, err, done = _stop_test(total, kf, full, denom, t, lo, hi, tol, RESOLUTION)
    n_iter = 1
    while (n_iter < max_iter) & (done == 0):
        t, lo, hi = _bracketed_newton(t, lo, hi, excess, slope)
        n_iter += 1
        total, slope = _sigmoid_sums(S, n, t.to(Z.dtype.element_ty), LIMIT, BLOCK)
        excess, err, done = _stop_test(total, kf, full, denom, t, lo, hi, tol, RESOLUTION)
    tl.store(N_ITER + row, n_iter)
    tl.store(ERR + row, err)
    t_row = t.to(Z.dtype.element_ty)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < n
        s = tl.load(S + offs, mask=inside, other=float("-inf"))
        logits = _logits(s, t_row, full, LIMIT)
        tl.store(S + offs, logits, mask=inside)
        tl.store(OUT + offs, tl.sigmoid(logits), mask=inside)


@triton.jit
def _soft_topk_backward_kernel(LOGITS, GRAD, EPS, GRAD_Z, n, BLOCK: tl.constexpr):
    """One program per row: ``grad_z = w / eps * (g - sum_i w_i g_i / sum_i w_i)``, ``w = A (1 - A)``.

    Args: LOGITS, GRAD, GRAD_Z: ``(rows, n)`` contiguous (the forward's logits, the output's gradient,
    the result); EPS: ``(rows,)`` temperatures in the scores' units (``inf``: gradient 0).
    """
    row = tl.program_id(0).to(tl.int64)
    LOGITS += row * n
    GRAD += row * n
    GRAD_Z += row * n
    eps = tl.load(EPS + row)
    acc_w = tl.zeros((BLOCK,), dtype=tl.float64)
    acc_wg = tl.zeros((BLOCK,), dtype=tl.float64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < n
        logits = tl.load(LOGITS + offs, mask=inside, other=float("-inf"))
        g = tl.load(GRAD + offs, mask=inside, other=0.0)
        w = tl.sigmoid(logits) * tl.sigmoid(-logits)  # 0 where excluded (logit -inf) or full (+inf)
        acc_w += w.to(tl.float64)
        acc_wg += (w * g).to(tl.float64)
    w_sum = tl.sum(acc_w, axis=0)
    mean_g = tl.sum(acc_wg, axis=0) / tl.where(w_sum > 0, w_sum, 1.0)
    mean_row = mean_g.to(GRAD.dtype.element_ty)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < n
        logits = tl.load(LOGITS + offs, mask=inside, other=float("-inf"))
        g = tl.load(GRAD + offs, mask=inside, other=0.0)
        w = tl.sigmoid(logits) * tl.sigmoid(-logits)
        tl.store(GRAD_Z + offs, _div(w, eps) * (g - mean_row), mask=inside)


@triton.jit
def _short_rows_tile(Z, VALID, EPS, first, rows, n, HAS_MASK: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK: tl.constexpr):
    """``(row indices (ROWS,), in-bounds (ROWS, BLOCK), valid, z, eps)`` of the ``ROWS`` rows from ``first``."""
    r = first + tl.arange(0, ROWS)
    row_ok = r < rows
    cols = tl.arange(0, BLOCK)
    inside = row_ok[:, None] & (cols[None, :] < n)
    offs = r.to(tl.int64)[:, None] * n + cols[None, :]
    z = tl.load(Z + offs, mask=inside, other=0.0)
    valid = inside
    if HAS_MASK:
        valid = valid & (tl.load(VALID + offs, mask=inside, other=0) != 0)
    eps = tl.load(EPS + r, mask=row_ok, other=1.0)
    return r, offs, row_ok, inside, valid, z, eps


@triton.jit
def _short_sums(s, inside, t, LIMIT: tl.constexpr):
    """:func:`_sigmoid_sums` of each row of the ``(ROWS, BLOCK)`` tile ``s`` at its threshold ``t`` ``(ROWS,)``."""
    sig = tl.where(inside, tl.sigmoid(_clamped(s - t.to(s.dtype)[:, None], LIMIT)), 0.0)
    return tl.sum(sig.to(tl.float64), axis=1), tl.sum((sig - sig * sig).to(tl.float64), axis=1)


@triton.jit
def _soft_topk_short_rows_kernel(Z, VALID, EPS, TOP, N_VALID, S, OUT, N_ITER, ERR, rows, n, top_cols, k, tol_hi,
                                 tol_lo, max_iter, HAS_MASK: tl.constexpr, LIMIT: tl.constexpr,
                                 RESOLUTION: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """:func:`_soft_topk_threshold_kernel` for rows of at most ``BLOCK`` entries, ``ROWS`` rows a program (top-k
    attention's shapes: thousands of rows of a few dozen keys). Each row's scores stay in registers for the whole
    solve (no pass over memory per iteration); every row takes the same steps as in the one-row kernel, and the
    program iterates while one of its rows goes on. Arguments as that kernel's, ``rows`` the row count."""
    first = tl.program_id(0) * ROWS
    r, offs, row_ok, inside, valid, z, eps = _short_rows_tile(Z, VALID, EPS, first, rows, n, HAS_MASK, ROWS, BLOCK)
    tol = tl.cast(tol_hi, tl.float64) + tl.cast(tol_lo, tl.float64)
    eps64 = eps.to(tl.float64)
    kf = tl.cast(k, tl.float64)
    n_valid = tl.load(N_VALID + r, mask=row_ok, other=k + 1).to(tl.float64)
    full = n_valid == kf
    top = TOP + r.to(tl.int64) * top_cols
    t, span, hi, denom = _hard_start(tl.load(top, mask=row_ok, other=0.0).to(tl.float64),
                                     tl.load(top + k - 1, mask=row_ok, other=0.0).to(tl.float64),
                                     tl.load(top + k, mask=tl.where(top_cols > k, row_ok, False), other=0.0)
                                     .to(tl.float64), top_cols > k, full, n_valid, kf, eps64)
    s = tl.where(valid, _div(z, eps[:, None]), float("-inf"))
    lo = tl.min(tl.where(valid, z, float("inf")), axis=1).to(tl.float64) / eps64 - span
    total, slope = _short_sums(s, inside, t, LIMIT)
    excess, err, done = _stop_test(total, kf, full, denom, t, lo, hi, tol, RESOLUTION)
    n_iter = tl.full((ROWS,), 1, tl.int32)
    going = (n_iter < max_iter) & (done == 0) & row_ok
    while tl.max(going.to(tl.int32), axis=0) != 0:
        t_next, lo_next, hi_next = _bracketed_newton(t, lo, hi, excess, slope)
        t = tl.where(going, t_next, t)
        lo = tl.where(going, lo_next, lo)
        hi = tl.where(going, hi_next, hi)
        n_iter += going.to(tl.int32)
        t_total, t_slope = _short_sums(s, inside, t, LIMIT)
        t_excess, t_err, t_done = _stop_test(t_total, kf, full, denom, t, lo, hi, tol, RESOLUTION)
        total = tl.where(going, t_total, total)
        slope = tl.where(going, t_slope, slope)
        excess = tl.where(going, t_excess, excess)
        err = tl.where(going, t_err, err)
        done = tl.where(going, t_done, done)
        going = (n_iter < max_iter) & (done == 0) & row_ok
    tl.store(N_ITER + r, n_iter, mask=row_ok)
    tl.store(ERR + r, err, mask=row_ok)
    logits = _logits(s, t.to(s.dtype)[:, None], full[:, None], LIMIT)
    tl.store(S + offs, logits, mask=inside)
    tl.store(OUT + offs, tl.sigmoid(logits), mask=inside)


@triton.jit
def _soft_topk_short_backward_kernel(LOGITS, GRAD, EPS, GRAD_Z, rows, n, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """:func:`_soft_topk_backward_kernel` for rows of at most ``BLOCK`` entries, ``ROWS`` rows a program."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = r < rows
    cols = tl.arange(0, BLOCK)
    inside = row_ok[:, None] & (cols[None, :] < n)
    offs = r.to(tl.int64)[:, None] * n + cols[None, :]
    logits = tl.load(LOGITS + offs, mask=inside, other=float("-inf"))
    g = tl.load(GRAD + offs, mask=inside, other=0.0)
    eps = tl.load(EPS + r, mask=row_ok, other=1.0)
    w = tl.sigmoid(logits) * tl.sigmoid(-logits)
    w_sum = tl.sum(w.to(tl.float64), axis=1)
    mean_g = tl.sum((w * g).to(tl.float64), axis=1) / tl.where(w_sum > 0, w_sum, 1.0)
    grad_z = _div(w, eps[:, None]) * (g - mean_g.to(g.dtype)[:, None])
    tl.store(GRAD_Z + offs, grad_z, mask=inside)
