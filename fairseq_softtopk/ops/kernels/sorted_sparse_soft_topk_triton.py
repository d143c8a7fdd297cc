"""Triton kernels of :func:`~fairseq_softtopk.ops.sorted_sparse_soft_topk`: the semi-dual Newton solve and the
implicit backward, one program per row.

The torch path (:mod:`~fairseq_softtopk.ops.quadratic_semi_dual`) forms the ``(rows, n, k + 1)`` plan in memory at
every trial point of its line search; here each trial is one pass over the row in blocks, with the ``k + 1``
potentials, the Newton direction, the Hessian and the stopping test in float64 registers (``KP``: ``k + 1``
padded to a power of two):

* forward (:func:`_sorted_sparse_kernel`): from the hard start, Newton steps on the semi-dual with the torch
  path's backtracking (step 1, 1/2, ...: Armijo's ascent, or a step that halves the marginal error) until the
  marginal error is at most ``tol``; each pass projects every entry's ``x_i y + b`` onto the simplex (the
  support by pairwise comparisons: no sort) and sums the marginals, the objective and ``H = sum_i J_i``; the
  direction solves ``(H + 1 1^T / (k + 1) + ridge I) d = nu - sum_i P_i`` by Gauss-Jordan elimination (the
  matrix is symmetric positive definite: no pivoting). Then one pass writes the ranks. The whole row is solved
  (the torch path's window is a saving of memory, not of the solution: entries below it are on the rest anchor
  in both).
* backward (:func:`_sorted_sparse_backward_kernel`): the supports recomputed from the potentials, ``H`` and
  ``sum_i J_i G_i`` in one pass, ``w`` from the same regularised solve, the gradient in a second pass.

This module imports ``triton``: ``sorted_sparse_soft_topk_op.kernel_module`` loads it on the first launch.
"""

import triton
import triton.language as tl


@triton.jit
def _project(X, VALID, offs, n, b, k, no_rest, HAS_MASK: tl.constexpr, KP: tl.constexpr):
    """The plan rows of the entries ``offs``: ``(P, support, valid)``, ``P`` ``(BLOCK, KP)`` float64 the projection
    of ``x_i y + b`` onto the simplex (0 on padding and excluded entries), ``support`` ``P > 0`` as float64."""
    cols = tl.arange(0, KP)
    anchor = cols <= k
    y = (k - cols).to(tl.float64)
    valid = offs < n
    x = tl.load(X + offs, mask=valid, other=0.0).to(tl.float64)
    if HAS_MASK:
        valid = valid & (tl.load(VALID + offs, mask=valid, other=0) != 0)
    v = x[:, None] * y[None, :] + b[None, :]
    # rows with exactly k valid entries have no rest anchor: its value out of every projection's reach
    ranks_max = tl.max(tl.where(anchor[None, :] & (cols[None, :] < k), v, float("-inf")), axis=1)
    v = tl.where((cols[None, :] == k) & (no_rest != 0), ranks_max[:, None] - 2.0, v)
    v = tl.where(anchor[None, :], v, 0.0)
    # the support: v_r c_r > s_r - 1 with c_r, s_r the count and sum of the values >= v_r (ties all in or out)
    ge = (v[:, None, :] >= v[:, :, None]) & anchor[None, None, :]
    c = tl.sum(ge.to(tl.float64), axis=2)
    s = tl.sum(tl.where(ge, v[:, None, :], 0.0), axis=2)
    support = (v * c > s - 1.0) & anchor[None, :]
    size = tl.sum(support.to(tl.float64), axis=1)
    theta = (tl.sum(tl.where(support, v, 0.0), axis=1) - 1.0) / tl.maximum(size, 1.0)
    P = tl.where(anchor[None, :] & valid[:, None], tl.maximum(v - theta[:, None], 0.0), 0.0)
    return P, v, valid


@triton.jit
def _pass(X, VALID, n, b, k, no_rest, HAS_MASK: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
    """One pass at potentials ``b``: ``(column sums (KP,), sum_i [<v_i, P_i> - |P_i|^2 / 2], H (KP, KP))``."""
    colsum = tl.zeros((KP,), dtype=tl.float64)
    terms = tl.zeros((), dtype=tl.float64)
    count = tl.zeros((KP,), dtype=tl.float64)
    gram = tl.zeros((KP, KP), dtype=tl.float64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        P, v, valid = _project(X, VALID, offs, n, b, k, no_rest, HAS_MASK, KP)
        colsum += tl.sum(P, axis=0)
        terms += tl.sum(tl.where(valid, tl.sum(v * P - 0.5 * P * P, axis=1), 0.0), axis=0)
        s = (P > 0).to(tl.float64)
        count += tl.sum(s, axis=0)
        gram += _support_gram(s)
    return colsum, terms, _hessian(count, gram, KP)


@triton.jit
def _support_gram(s):
    """``sum_i s_i s_i^T / |s_i|`` of a block's ``(BLOCK, KP)`` support indicators."""
    size = tl.maximum(tl.sum(s, axis=1), 1.0)
    return tl.sum(s[:, :, None] * (s / size[:, None])[:, None, :], axis=0)


@triton.jit
def _hessian(count, gram, KP: tl.constexpr):
    """``H = diag(count) - gram``: ``sum_i J_i`` from the supports' counts per anchor and their Gram sum."""
    diag = tl.arange(0, KP)[:, None] == tl.arange(0, KP)[None, :]
    return tl.where(diag, count[:, None], 0.0) - gram


@triton.jit
def _solve(H, rhs, k, RIDGE: tl.constexpr, KP: tl.constexpr):
    """``(H + 1 1^T / (k + 1) + ridge max(diag H, 1) I)^{-1} rhs`` over the ``k + 1`` anchors (0 on padding), by
    Gauss-Jordan elimination."""
    rows = tl.arange(0, KP)[:, None]
    cols = tl.arange(0, KP)[None, :]
    anchor = (rows <= k) & (cols <= k)
    diag = rows == cols
    scale = tl.maximum(tl.max(tl.where(diag & anchor, H, 0.0), axis=1), 0.0)
    scale = tl.maximum(tl.max(scale, axis=0), 1.0)
    m = tl.cast(k, tl.float64) + 1.0
    A = tl.where(anchor, H + 1.0 / m + tl.where(diag, RIDGE * scale, 0.0), tl.where(diag, 1.0, 0.0))
    r = tl.where(tl.arange(0, KP) <= k, rhs, 0.0)
    for j in range(0, KP):  # a loop, not unrolled: the code stays small at any KP
        row_j = tl.sum(tl.where(rows == j, A, 0.0), axis=0)  # (KP,) over columns
        col_j = tl.sum(tl.where(cols == j, A, 0.0), axis=1)  # (KP,) over rows
        pivot = tl.sum(tl.where(tl.arange(0, KP) == j, row_j, 0.0), axis=0)
        r_j = tl.sum(tl.where(tl.arange(0, KP) == j, r, 0.0), axis=0)
        factor = tl.where(tl.arange(0, KP) == j, 0.0, col_j / pivot)
        A = A - factor[:, None] * row_j[None, :]
        r = r - factor * r_j
    return r / tl.sum(tl.where(diag, A, 0.0), axis=1)


@triton.jit
def _sorted_sparse_kernel(X, VALID, B_START, N_VALID, RANKS, B, ERR, N_ITER, n, k, tol_hi, tol_lo, max_iter,
                          max_backtrack, HAS_MASK: tl.constexpr, ARMIJO: tl.constexpr, RIDGE: tl.constexpr,
                          KP: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: the potentials ``b`` of the semi-dual's maximum, then the ranks ``P[:, :k]``.

    Args (per row; ``n`` entries): X: ``(rows, n)`` float64 positions in units of lambda (0 where excluded).
    VALID: ``(rows, n)`` uint8 (read only with ``HAS_MASK``). B_START: ``(rows, k + 1)`` float64 start.
    N_VALID: ``(rows,)`` float64 valid counts. RANKS: ``(rows, n, k)`` the ranks' columns of the plan (its
    dtype). B: ``(rows, k + 1)`` float64 potentials reached. ERR: ``(rows,)`` float64 marginal error.
    N_ITER: ``(rows,)`` int32 Newton steps.
    """
    row = tl.program_id(0).to(tl.int64)
    X += row * n
    VALID += row * n
    RANKS += row * n * k
    cols = tl.arange(0, KP)
    anchor = cols <= k
    tol = tl.cast(tol_hi, tl.float64) + tl.cast(tol_lo, tl.float64)
    n_valid = tl.load(N_VALID + row).to(tl.float64)
    no_rest = n_valid == k
    nu = tl.where(cols < k, 1.0, tl.where(anchor, n_valid - k, 0.0))
    b = tl.load(B_START + row * (k + 1) + cols, mask=anchor, other=0.0)
    # one loop over trial points (the start, then each Newton step's step sizes 1, 1/2, ...): one pass per trial,
    # one call site of the pass (the compiled code stays small)
    trial_b = b
    colsum = tl.zeros((KP,), dtype=tl.float64)
    H = tl.zeros((KP, KP), dtype=tl.float64)
    direction = tl.zeros((KP,), dtype=tl.float64)
    F = tl.zeros((), dtype=tl.float64)
    err = tl.full((), float("inf"), tl.float64)
    slope = tl.zeros((), dtype=tl.float64)
    step = tl.zeros((), dtype=tl.float64)
    first = tl.zeros((), dtype=tl.int32) == 0  # True: the start is taken as it is (a tensor: n may be a constant)
    finished = first == 0
    tries = 0
    n_iter = tl.zeros((), dtype=tl.int32)
    while finished == 0:
        trial_colsum, trial_terms, trial_H = _pass(X, VALID, n, trial_b, k, no_rest, HAS_MASK, KP, BLOCK)
        trial_F = tl.sum(nu * trial_b, axis=0) - trial_terms
        trial_err = tl.max(tl.abs(trial_colsum - nu) / tl.maximum(nu, 1.0), axis=0)
        # the torch path's rule: Armijo's ascent, or (near the optimum, where the objective's gain is below its
        # rounding) a step that halves the marginal error
        accepted = first | (trial_F >= F + ARMIJO * step * slope) | (trial_err <= 0.5 * err)
        first = first == 0
        b = tl.where(accepted, trial_b, b)
        colsum = tl.where(accepted, trial_colsum, colsum)
        H = tl.where(accepted, trial_H, H)
        F = tl.where(accepted, trial_F, F)
        err = tl.where(accepted, trial_err, err)
        tries += 1
        # a Newton step ends when a step size is taken or all were tried; the next starts unless converged
        ends = accepted | (tries >= max_backtrack)
        starts = ends & (err > tol) & (n_iter < max_iter)
        finished = ends & (starts == 0)
        gradient = nu - colsum
        new_direction = _solve(H, gradient, k, RIDGE, KP)
        direction = tl.where(starts, new_direction, direction)
        slope = tl.where(starts, tl.sum(new_direction * gradient, axis=0), slope)
        step = tl.where(starts, 1.0, 0.5 * step)
        tries = tl.where(starts, 0, tries)
        n_iter += starts.to(tl.int32)
        trial_b = b + step * direction
    tl.store(B + row * (k + 1) + cols, b, mask=anchor)
    tl.store(ERR + row, err)
    tl.store(N_ITER + row, n_iter)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        P, v, valid = _project(X, VALID, offs, n, b, k, no_rest, HAS_MASK, KP)
        out = RANKS + offs[:, None].to(tl.int64) * k + cols[None, :]
        tl.store(out, P.to(RANKS.dtype.element_ty), mask=(offs[:, None] < n) & (cols[None, :] < k))


@triton.jit
def _rank_rows(GRAD, offs, n, k, KP: tl.constexpr):
    """The ranks' gradient of the entries ``offs`` as ``(BLOCK, KP)`` float64, 0 on the rest anchor and padding."""
    cols = tl.arange(0, KP)
    mask = (offs[:, None] < n) & (cols[None, :] < k)
    return tl.load(GRAD + offs[:, None].to(tl.int64) * k + cols[None, :], mask=mask, other=0.0).to(tl.float64)


@triton.jit
def _sorted_sparse_backward_kernel(X, VALID, B, N_VALID, GRAD, LAMBDA, GRAD_Z, n, k, HAS_MASK: tl.constexpr,
                                   RIDGE: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: ``dL/dx_i = y^T J_i (G_i - w) / lambda``, ``(H + ...) w = sum_i J_i G_i`` (the torch
    path's ``SortedSparseSoftTopKFunction.backward``), ``G_i`` the ranks' gradient padded by 0 (rest anchor).

    Args: X, VALID, N_VALID as the forward's; B: ``(rows, k + 1)`` the forward's potentials; GRAD: ``(rows, n,
    k)``; LAMBDA: ``(rows,)`` float64; GRAD_Z: ``(rows, n)`` (GRAD's dtype).
    """
    row = tl.program_id(0).to(tl.int64)
    X += row * n
    VALID += row * n
    GRAD += row * n * k
    GRAD_Z += row * n
    cols = tl.arange(0, KP)
    anchor = cols <= k
    y = (k - cols).to(tl.float64)
    no_rest = tl.load(N_VALID + row).to(tl.float64) == k
    b = tl.load(B + row * (k + 1) + cols, mask=anchor, other=0.0)
    lam = tl.load(LAMBDA + row)
    count = tl.zeros((KP,), dtype=tl.float64)
    gram = tl.zeros((KP, KP), dtype=tl.float64)
    jg = tl.zeros((KP,), dtype=tl.float64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        P, v, valid = _project(X, VALID, offs, n, b, k, no_rest, HAS_MASK, KP)
        s = (P > 0).to(tl.float64)
        size = tl.maximum(tl.sum(s, axis=1), 1.0)
        G = _rank_rows(GRAD, offs, n, k, KP)
        jg += tl.sum(s * (G - (tl.sum(s * G, axis=1) / size)[:, None]), axis=0)
        count += tl.sum(s, axis=0)
        gram += _support_gram(s)
    w = _solve(_hessian(count, gram, KP), jg, k, RIDGE, KP)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        P, v, valid = _project(X, VALID, offs, n, b, k, no_rest, HAS_MASK, KP)
        s = (P > 0).to(tl.float64)
        size = tl.maximum(tl.sum(s, axis=1), 1.0)
        G = _rank_rows(GRAD, offs, n, k, KP) - w[None, :]
        jgw = s * (G - (tl.sum(s * G, axis=1) / size)[:, None])
        grad = tl.sum(jgw * y[None, :], axis=1) / lam
        tl.store(GRAD_Z + offs, grad.to(GRAD_Z.dtype.element_ty), mask=offs < n)
