"""Triton kernels of :func:`~fairseq_softtopk.ops.sorted_soft_topk`: the semi-dual Newton solve, its implicit backward.

The torch path (:func:`~fairseq_softtopk.ops.semi_dual_newton.newton_solve`) launches dozens of kernels per
Newton iteration and reads its stopping tests on the host; here one program solves one row to the end:

* forward (:func:`_sorted_forward_kernel`): the anchor potentials ``g`` (``k + 1`` of them, padded to ``KP``
  lanes) live in float64 registers. Each plan evaluation is one pass over the row in ``(BLOCK, KP)`` tiles
  (:func:`_evaluate`): the logits ``z_i y_r / eps + g_r`` in float64 (log2 units), the softmax over anchors in
  the scores' dtype, and the anchor counts (float64), the objective's log-normalisers (float64) and the Gram
  matrix ``sum_i P_i P_i^T`` (``tl.dot`` of the tile's transpose with itself, IEEE precision) accumulated.
  Then the torch path's steps, decided in-kernel: Sinkhorn-like rescaling while it pays off, damped Newton
  (the ``k x k`` system ``K = diag(counts) - sum_i P_i P_i^T`` plus a ridge, solved by Gaussian elimination
  on a ``(KP, KP)`` float64 register tile, :func:`_solve_ridged`) with an error-or-Armijo backtracking line
  search, the stall and convergence tests. Rows longer than ``WMAX`` solve, as the torch path, on the entries
  at or above a floor below the (k+1)-th best (:func:`_compact` copies them to scratch memory in one pass), the
  window certified from the solution and widened where it is not (:func:`_window_solve`). A last pass writes
  the plan ``(k + 1, n)``;
* backward (:func:`_sorted_backward_kernel`): the ``_vjp`` of ``SortedSoftTopKFunction``, two passes over the
  plan (``b`` and ``K``, then the gradient) around one in-kernel ``k x k`` solve.

This module imports ``triton``: ``sorted_soft_topk_op.kernel_module`` loads it on the first launch (the package
never imports it otherwise). Only APIs present in Triton 3.6 are used.
"""

import triton
import triton.language as tl

# the torch path's constants (semi_dual_newton): Armijo's slope factor, trials per line search, rescaling steps at
# most and the error ratio each must gain to go on; kernels read globals only as constexpr
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
ARMIJO = tl.constexpr(1e-4)
MAX_BACKTRACK = tl.constexpr(12)
RESCALE_STEPS = tl.constexpr(4)
RESCALE_GAIN = tl.constexpr(8.0)
# the candidate window's (semi_dual_newton._WINDOW_GAP: the first guess of the rank/rest boundary's distance below
# the (k+1)-th best, in epsilons), and the windows a row solves at most before it solves the whole row
WINDOW_GAP = tl.constexpr(2.0)
MAX_WINDOWS = tl.constexpr(4)


@triton.jit
def _div(x, y):
    """``x / y`` rounded as IEEE division (torch's), whatever Triton's default division for float32."""
    if x.dtype == tl.float32:
        return tl.math.div_rn(x, y)
    else:
        return x / y


@triton.jit
def _plan_tile(Z, VALID, offs, n, use_mask, y_eps2, shift, anchor, k, CUT, HAS_MASK: tl.constexpr):
    """``(P, valid, log2 normaliser)`` of the entries ``offs``: ``P`` ``(BLOCK, KP)`` in the scores' dtype,
    the softmax over the ``k + 1`` anchors of ``z_i y_r / eps + g_r`` (0 on padded lanes and excluded entries),
    the exponents clamped at ``CUT`` as the torch path's; ``VALID`` is read only with ``HAS_MASK`` and
    ``use_mask``."""
    inside = offs < n
    z = tl.load(Z + offs, mask=inside, other=0.0)
    valid = inside
    if HAS_MASK:
        valid = valid & (tl.load(VALID + offs, mask=tl.where(use_mask, inside, False), other=1) != 0)
    used = anchor <= k  # (1, KP)
    logits = z.to(tl.float64)[:, None] * y_eps2 + shift
    logits = tl.where(used, logits, float("-inf"))
    top = tl.max(logits, axis=1)
    e = tl.exp2(tl.maximum((logits - top[:, None]).to(z.dtype), CUT))
    e = tl.where(used, e, 0.0)
    # excluded entries: total = inf, so P = e / inf = 0. Not tl.where(valid, ...) on P: triton 3.6 sizes a dot's
    # operands by the narrowest load they derive from elementwise (VALID's 8 bits) and cannot lower the float64
    # tl.dot of the Gram matrix so; the sum hides that load from it
    total = tl.sum(tl.where(valid[:, None], e, float("inf")), axis=1)
    P = _div(e, total[:, None])
    P = tl.where((z == z)[:, None], P, float("nan"))  # NaN scores (unchecked calls) give NaN, as in torch
    return P, valid, tl.log2(total.to(tl.float64)) + top


@triton.jit
def _row_constants(EPS, N_VALID, row, k, KP: tl.constexpr):
    """``(y_eps2 (1, KP), rest_bias (KP,), no_rest, n_valid float64, anchor (1, KP))`` of a row: the anchors
    ``y_r = k - r`` over epsilon in log2 units, and the rest anchor (lane k) of rows without one (exactly k valid
    entries), which takes no mass and has no marginal error."""
    eps = tl.load(EPS + row).to(tl.float64)
    n_valid = tl.load(N_VALID + row).to(tl.float64)
    no_rest = n_valid == tl.cast(k, tl.float64)
    lane = tl.arange(0, KP)
    y_eps2 = (tl.where(lane <= k, k - lane, 0).to(tl.float64) * (LOG2E / eps))[None, :]
    rest_bias = tl.where(lane == k, tl.where(no_rest, float("-inf"), 0.0), 0.0)
    return y_eps2, rest_bias, no_rest, n_valid, lane[None, :]


@triton.jit
def _evaluate_tiles(Z, VALID, first, stop, n, use_mask, g, y_eps2, rest_bias, anchor, k, CUT, HAS_MASK: tl.constexpr,
                    BLOCK: tl.constexpr, KP: tl.constexpr):
    """One pass over the entries ``first`` to ``stop`` of the row (of ``n``) at potentials ``g`` ``(KP,)``:
    ``(counts (KP,) float64, sum_i lse_i (log2 units, float64), Gram (KP, KP) in the scores' dtype)``."""
    shift = ((g + rest_bias) * LOG2E)[None, :]
    counts = tl.zeros((KP,), dtype=tl.float64)
    lse = tl.zeros((BLOCK,), dtype=tl.float64)
    gram = tl.zeros((KP, KP), dtype=Z.dtype.element_ty)
    for start in range(first, stop, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        P, valid, lse_i = _plan_tile(Z, VALID, offs, n, use_mask, y_eps2, shift, anchor, k, CUT, HAS_MASK)
        counts += tl.sum(P.to(tl.float64), axis=0)
        lse += tl.where(valid, lse_i, 0.0)
        gram += tl.dot(tl.trans(P), P, input_precision="ieee")
    return counts, tl.sum(lse, axis=0), gram


@triton.jit
def _lane(vector, r, KP: tl.constexpr):
    """Lane ``r`` of a ``(KP,)`` vector, as a scalar (exact: the one value plus zeros)."""
    return tl.sum(tl.where(tl.arange(0, KP) == r, vector, 0.0), axis=0)


@triton.jit
def _anchor_terms(g, y_eps2, rest_bias, K1: tl.constexpr, KP: tl.constexpr):
    """``(unit, shifts)``: anchor r's logit of score z is ``z * unit * (K1 - 1 - r) + shifts[r]`` in log2 units,
    ``unit = 1 / eps`` (:func:`_row_constants`' ``y_eps2`` at ``y = 1``) and ``shifts`` a tuple of ``K1`` float64
    scalars, the tiles' shift at potentials ``g`` ``(KP,)`` (``g_r``, the rest anchor's ``-inf`` in rows without
    one). One slope held, not ``K1``: the unrolled passes run short of registers before anything else."""
    shift = (g + rest_bias) * LOG2E
    shifts = ()
    for r in tl.static_range(K1):
        shifts = shifts + (_lane(shift, r, KP),)
    return _lane(tl.reshape(y_eps2, (KP,)), K1 - 2, KP), shifts


@triton.jit
def _entry_plan(Z, VALID, offs, n, use_mask, unit, shifts, CUT, HAS_MASK: tl.constexpr, K1: tl.constexpr):
    """``(P, valid, log2 normaliser)`` of the entries ``offs`` ``(BLOCK,)``, ``P`` a tuple of ``K1`` ``(BLOCK,)``
    vectors in the scores' dtype: :func:`_plan_tile`'s softmax over the anchors (the same operations, its clamp at
    ``CUT``, 0 on excluded entries, NaN for NaN scores; ``VALID`` read with ``HAS_MASK`` and ``use_mask``), one
    anchor at a time."""
    inside = offs < n
    z = tl.load(Z + offs, mask=inside, other=0.0)
    valid = inside
    if HAS_MASK:
        valid = valid & (tl.load(VALID + offs, mask=tl.where(use_mask, inside, False), other=1) != 0)
    z_unit = z.to(tl.float64) * unit
    logits = ()
    for r in tl.static_range(K1):
        logits = logits + (z_unit * (K1 - 1 - r) + shifts[r],)
    top = logits[0]
    for r in tl.static_range(1, K1):
        top = tl.maximum(top, logits[r])
    e = ()
    total = tl.zeros(z.shape, dtype=z.dtype)
    for r in tl.static_range(K1):
        e = e + (tl.exp2(tl.maximum((logits[r] - top).to(z.dtype), CUT)),)
        total += e[r]
    total = tl.where(valid, total, float("inf"))  # excluded entries: P = e / inf = 0
    inverse = _div(tl.full(total.shape, 1.0, total.dtype), total)  # one division an entry, not K1
    P = ()
    for r in tl.static_range(K1):
        P = P + (tl.where(z == z, e[r] * inverse, float("nan")),)
    return P, valid, tl.log2(total.to(tl.float64)) + top


@triton.jit
def _zeros_tuple(count: tl.constexpr, BLOCK: tl.constexpr, dtype: tl.constexpr):
    """``count`` zero ``(BLOCK,)`` vectors of ``dtype``: per-lane accumulators, one a sum."""
    out = ()
    for unused in tl.static_range(count):
        out = out + (tl.zeros((BLOCK,), dtype=dtype),)
    return out


@triton.jit
def _add_gram(gram, P, K1: tl.constexpr):
    """``gram`` plus the entries' ``P_r P_s``, entry by entry: the kept Gram terms ``(r, s)``, ``r <= s``, a tuple
    of ``K1 (K1 + 1) / 2`` in row order (term ``(r, s)`` at ``r K1 - r (r - 1) / 2 + s - r``)."""
    out = ()
    for r in tl.static_range(K1):
        for s in tl.static_range(r, K1):
            out = out + (gram[len(out)] + P[r] * P[s],)
    return out


@triton.jit
def _evaluate_unrolled(Z, VALID, first, stop, n, use_mask, unit, shifts, CUT, HAS_MASK: tl.constexpr,
                       BLOCK: tl.constexpr, K1: tl.constexpr):
    """:func:`_evaluate` over the entries ``first`` to ``stop`` with the anchors unrolled: ``(counts, sum_i lse_i, gram)``,
    ``counts`` a tuple of ``K1`` float64 ``(BLOCK,)`` sums, ``gram`` of the ``K1 (K1 + 1) / 2`` Gram terms
    (:func:`_add_gram`'s order) in the scores' dtype, each summed per entry lane (reduced by :func:`_as_tiles`)."""
    counts = _zeros_tuple(K1, BLOCK, tl.float64)
    gram = _zeros_tuple(K1 * (K1 + 1) // 2, BLOCK, Z.dtype.element_ty)
    lse = tl.zeros((BLOCK,), dtype=tl.float64)
    for start in range(first, stop, BLOCK):
        P, valid, lse_i = _entry_plan(Z, VALID, start + tl.arange(0, BLOCK), n, use_mask, unit, shifts, CUT,
                                      HAS_MASK, K1)
        lse += tl.where(valid, lse_i, 0.0)
        added = ()
        for r in tl.static_range(K1):
            added = added + (counts[r] + P[r].to(tl.float64),)
        counts = added
        gram = _add_gram(gram, P, K1)
    return counts, tl.sum(lse, axis=0), gram


@triton.jit
def _as_tiles(sums, gram, K1: tl.constexpr, KP: tl.constexpr):
    """The per-lane sums reduced into the KP layout the step kernels read: ``sums`` (a tuple of ``K1`` float64, or
    of fewer) as a ``(KP,)`` float64 vector, ``gram`` as the symmetric ``(KP, KP)`` matrix in its terms' dtype (0 on
    padding).

    The vector's lanes after the sums hold 0, or NaN where a sum is NaN: as the tiles' padded lanes do (their plan
    is NaN on every lane of a NaN score), so that a NaN row's marginal error is NaN, not the max of its finite
    lanes (a reduction's max drops NaN)."""
    lane = tl.arange(0, KP)
    ri = lane[:, None]
    ci = lane[None, :]
    vector = tl.zeros((KP,), dtype=tl.float64)
    padding = tl.cast(0.0, tl.float64)
    for r in tl.static_range(len(sums)):
        total = tl.sum(sums[r], axis=0)
        vector = tl.where(lane == r, total, vector)
        padding += 0.0 * total
    vector = tl.where(lane >= len(sums), padding, vector)
    matrix = tl.zeros((KP, KP), dtype=gram[0].dtype)
    for r in tl.static_range(K1):
        for s in tl.static_range(r, K1):
            matrix = tl.where(((ri == r) & (ci == s)) | ((ri == s) & (ci == r)),
                              tl.sum(gram[r * K1 - r * (r - 1) // 2 + s - r], axis=0), matrix)
    return vector, matrix


@triton.jit
def _evaluate(Z, VALID, first, stop, n, use_mask, g, y_eps2, rest_bias, anchor, k, CUT, HAS_MASK: tl.constexpr,
              BLOCK: tl.constexpr, KP: tl.constexpr, K1: tl.constexpr):
    """One pass over the entries ``first`` to ``stop`` of the row (of ``n``) at potentials ``g`` ``(KP,)``:
    ``(counts (KP,) float64, sum_i lse_i (log2 units, float64), Gram (KP, KP) in the scores' dtype)``; ``K1 > 0``
    (``k + 1``): the anchors unrolled (:func:`_evaluate_unrolled`), else in ``(BLOCK, KP)`` tiles."""
    if K1 > 0:
        unit, shifts = _anchor_terms(g, y_eps2, rest_bias, K1, KP)
        sums, lse, terms = _evaluate_unrolled(Z, VALID, first, stop, n, use_mask, unit, shifts, CUT, HAS_MASK,
                                              BLOCK, K1)
        counts, gram = _as_tiles(sums, terms, K1, KP)
    else:
        counts, lse, gram = _evaluate_tiles(Z, VALID, first, stop, n, use_mask, g, y_eps2, rest_bias, anchor, k, CUT,
                                            HAS_MASK, BLOCK, KP)
    return counts, lse, gram


@triton.jit
def _marginal_error(counts, target, inv_target):
    """``max_r |counts_r - target_r| / target_r`` (0 on the rest anchor of rows without one, and on padding)."""
    return tl.max(tl.abs(counts * inv_target - target * inv_target), axis=0)


@triton.jit
def _hessian(gram, k, no_rest, KP: tl.constexpr):
    """``K = sum_i diag(P_i) - P_i P_i^T`` over the k ranks, float64 ``(KP, KP)`` (identity on padding).

    As ``anchor_hessian``: off-diagonal ``-G_rs``, diagonal ``sum_{s != r} G_rs`` over all ``k + 1`` anchors
    (equal to ``sum_i P_ir (1 - P_ir)``, without its cancellation), ``1`` added everywhere in rows without a
    rest anchor (their constant null vector)."""
    ri = tl.arange(0, KP)[:, None]
    ci = tl.arange(0, KP)[None, :]
    off = tl.where(ri == ci, 0.0, gram.to(tl.float64))
    diagonal = tl.sum(off, axis=1)[:, None]  # columns past k are 0
    K = tl.where(ri == ci, diagonal, -off) + tl.where(no_rest, 1.0, 0.0)
    ranks = (ri < k) & (ci < k)
    return tl.where(ranks, K, tl.where(ri == ci, 1.0, 0.0))


@triton.jit
def _solve_ridged(K, rhs, k, RIDGE, KP: tl.constexpr):
    """``(K + ridge I)^{-1} rhs`` over the first k lanes (``solve_ridged``: the ridge is ``RIDGE`` times the
    largest diagonal entry), by Gauss-Jordan elimination without pivoting (``K`` is symmetric positive
    semi-definite, the ridge makes the pivots positive) on the float64 register tile, ``rhs`` carried in
    column k (free: the ranks are lanes ``0..k-1``): k rank-one updates, no back substitution.

    Row and column j are taken by products with one-hot matrices (``tl.dot``: exact, each output one term
    plus zeros), broadcast as the update needs them; a reduction per step would cost as much on a GPU and,
    under the interpreter, is a nested kernel call of its own (milliseconds each)."""
    ri = tl.arange(0, KP)[:, None]
    ci = tl.arange(0, KP)[None, :]
    lane = tl.arange(0, KP)
    diagonal = tl.sum(tl.where(ri == ci, K, 0.0), axis=1)
    ridge = tl.maximum(tl.max(tl.where(lane < k, diagonal, 0.0), axis=0) * RIDGE, 1e-300)
    A = K + tl.where((ri == ci) & (ri < k), ridge, 0.0)
    A = tl.where((ci == k) & (ri < k), rhs[:, None], A)  # K's column k is 0 on the ranks
    for j in range(0, k):
        pick_col = tl.where(ri == j, 1.0, 0.0).to(tl.float64)  # A @ pick_col: column j in every column
        row_j = tl.dot(tl.where(ci == j, 1.0, 0.0).to(tl.float64), A, input_precision="ieee")  # row j, every row
        col_j = tl.dot(A, pick_col, input_precision="ieee")
        pivot = tl.dot(row_j, pick_col, input_precision="ieee")
        # every other row loses its multiple of row j: column j becomes the pivot alone
        A = A - tl.where(ri == j, 0.0, col_j / pivot) * row_j
    solved = tl.sum(tl.where(ci == k, A, 0.0), axis=1) / tl.sum(tl.where(ri == ci, A, 0.0), axis=1)
    return tl.where(lane < k, solved, 0.0)


@triton.jit
def _next_trial(g, counts, lse, gram, step, alpha, F, slope, n_newton, in_rescale, tries, target, no_rest, k, RIDGE,
                KP: tl.constexpr):
    """The next point :func:`_newton` evaluates, after the first: a Sinkhorn-like rescaling while it pays off, a
    Newton step from the point reached (``tries == 0``), or half the last step (backtracking). Returns ``(trial,
    step, alpha, F, slope, n_newton)``."""
    lane = tl.arange(0, KP)
    if in_rescale != 0:  # Sinkhorn-like: g_r += log(target_r / count_r), relative to the rest anchor's
        log_ratio = tl.log(target / tl.maximum(counts, 1e-300))
        rest_shift = tl.where(no_rest, 0.0, tl.sum(tl.where(lane == k, log_ratio, 0.0), axis=0))
        trial = g + tl.where(lane < k, tl.minimum(tl.maximum(log_ratio - rest_shift, -50.0), 50.0), 0.0)
    elif tries == 0:  # a Newton step from the point reached (semi_dual_newton._maximise)
        n_newton += 1
        grad = tl.where(lane < k, target - counts, 0.0)
        step = _solve_ridged(_hessian(gram, k, no_rest, KP), grad, k, RIDGE, KP)
        step = tl.where((step == step) & (tl.abs(step) < float("inf")), step, 0.0)  # nan_to_num
        F = tl.sum(tl.where(lane < k, g, 0.0), axis=0) - LN2 * lse
        slope = tl.sum(grad * step, axis=0)
        alpha = tl.cast(1.0, tl.float64)
        trial = g + step
    else:  # backtracking
        alpha = 0.5 * alpha
        trial = g + alpha * step
    return trial, step, alpha, F, slope, n_newton


@triton.jit
def _judge_trial(trial, t_counts, t_lse, t_gram, t_err, g, counts, lse, gram, err, F, alpha, slope, fresh, going,
                 rescaled, stalled, tries, in_rescale, n_newton, budget, tol, k, KP: tl.constexpr):
    """:func:`_newton`'s decision on an evaluated trial and whether the solve goes on: the first trial is kept
    whatever its error, a rescaling if it lowers the error, a Newton trial if it lowers the error or passes Armijo's
    test on the semi-dual ``F``. Returns ``(g, counts, lse, gram, err, going, rescaled, stalled, tries, in_rescale,
    active)`` (the point reached, the steps' state, whether the next trial is a rescaling, whether there is one)."""
    lane = tl.arange(0, KP)
    if fresh != 0:
        accept = fresh != 0  # whatever its error (NaN data: NaN results, as the torch path's)
        going = tl.where(t_err > 1.0, 1, 0)
    elif in_rescale != 0:
        rescaled += 1
        accept = t_err < err
        going = tl.where(accept & (t_err * RESCALE_GAIN <= err) & (t_err > tol), 1, 0)
    else:
        # a step is kept if it lowers the marginal error or passes Armijo's test on F
        t_F = tl.sum(tl.where(lane < k, trial, 0.0), axis=0) - LN2 * t_lse
        accept = (t_err < err) | (t_F >= F + ARMIJO * alpha * slope)
        tries += 1
        if accept | (tries >= MAX_BACKTRACK):
            # at the floating-point floor progress stops: three steps without 1% less error end the solve
            stalled = tl.where(t_err < 0.99 * err, 0, stalled + 1)
            tries = 0
    g = tl.where(accept, trial, g)
    counts = tl.where(accept, t_counts, counts)
    lse = tl.where(accept, t_lse, lse)
    gram = tl.where(accept, t_gram, gram)
    err = tl.where(accept, t_err, err)
    in_rescale = tl.where((going != 0) & (rescaled < tl.minimum(budget, RESCALE_STEPS)), 1, 0)
    newton_goes_on = (err > tol) & (stalled < 3) & (n_newton < budget - rescaled)
    active = tl.where((in_rescale != 0) | (tries > 0) | newton_goes_on, 1, 0)
    return g, counts, lse, gram, err, going, rescaled, stalled, tries, in_rescale, active


@triton.jit
def _newton(SRC, VALID, count, use_mask, g, target, inv_target, no_rest, y_eps2, rest_bias, anchor, k, tol, budget,
            CUT, RIDGE, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, KP: tl.constexpr,
            K1: tl.constexpr):
    """The solve from ``g`` on the ``count`` entries at ``SRC`` (``VALID`` read where ``use_mask``): at most
    ``budget`` iterations. Returns ``(g, err, iterations)``; ``budget = 0``: the point ``g`` evaluated.

    Each trial (the start, a rescaling, or a Newton step at some length: :func:`_next_trial`) is one evaluation,
    judged by :func:`_judge_trial`; the many-programs-a-row kernels (``sorted_soft_topk_split_triton``) take the
    same two steps around their split evaluation."""
    # The point reached (potentials, counts, log-normalisers, Gram matrix, error) and the state of the steps
    # (one evaluation call site: the kernel's code holds one copy of the pass).
    counts = tl.zeros((KP,), dtype=tl.float64)
    lse = tl.cast(0.0, tl.float64)
    gram = tl.zeros((KP, KP), dtype=SRC.dtype.element_ty)
    err = tl.cast(float("inf"), tl.float64)
    step = tl.zeros((KP,), dtype=tl.float64)
    alpha = tl.cast(1.0, tl.float64)
    F = tl.cast(0.0, tl.float64)
    slope = tl.cast(0.0, tl.float64)
    fresh = 1  # the first trial is the start itself
    going = 0  # rescaling goes on (semi_dual_newton._rescale)
    rescaled = 0
    n_newton = 0
    stalled = 0
    tries = 0  # trials of the Newton step in progress (0: none in progress)
    in_rescale = 0
    active = 1
    while active != 0:
        if fresh != 0:
            trial = g
        else:
            trial, step, alpha, F, slope, n_newton = _next_trial(g, counts, lse, gram, step, alpha, F, slope,
                                                                 n_newton, in_rescale, tries, target, no_rest, k,
                                                                 RIDGE, KP)
        t_counts, t_lse, t_gram = _evaluate(SRC, VALID, 0, count, count, use_mask, trial, y_eps2, rest_bias, anchor,
                                            k, CUT, HAS_MASK, BLOCK, KP, K1)
        t_err = _marginal_error(t_counts, target, inv_target)
        g, counts, lse, gram, err, going, rescaled, stalled, tries, in_rescale, active = _judge_trial(
            trial, t_counts, t_lse, t_gram, t_err, g, counts, lse, gram, err, F, alpha, slope, fresh, going,
            rescaled, stalled, tries, in_rescale, n_newton, budget, tol, k, KP)
        fresh = 0
    return g, err, rescaled + n_newton


@triton.jit
def _compact(Z, VALID, WIN, n, cut, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, WMAX: tl.constexpr):
    """One pass over the row: its valid entries at or above ``cut``, in row order, to ``WIN`` (the first
    ``WMAX`` of them). Returns ``(m, best left-out entry (-inf: none), whether the row holds a NaN)``."""
    m = tl.cast(0, tl.int32)
    best_out = tl.cast(float("-inf"), Z.dtype.element_ty)
    nan = tl.cast(0, tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < n
        z = tl.load(Z + offs, mask=inside, other=0.0)
        valid = inside
        if HAS_MASK:
            valid = valid & (tl.load(VALID + offs, mask=inside, other=0) != 0)
        keep = valid & (z >= cut)
        slot = m + tl.cumsum(keep.to(tl.int32), axis=0) - 1  # the entry's place in the window
        tl.store(WIN + slot, z, mask=keep & (slot < WMAX))
        m += tl.sum(keep.to(tl.int32), axis=0)
        best_out = tl.maximum(best_out, tl.max(tl.where(valid & (z < cut), z, float("-inf")), axis=0))
        nan = tl.maximum(nan, tl.max(tl.where(valid & (z != z), 1, 0), axis=0))
    return m, best_out, nan


@triton.jit
def _targets(n_solved, no_rest, k, KP: tl.constexpr):
    """``(target, 1 / target)`` ``(KP,)`` of a problem of ``n_solved`` valid entries (float64): 1 per rank,
    ``n_solved - k`` for the rest anchor (its inverse 0 in rows without one), 0 on padding."""
    lane = tl.arange(0, KP)
    kf = tl.cast(k, tl.float64)
    target = tl.where(lane == k, n_solved - kf, 1.0)
    inv_rest = tl.where(no_rest, 0.0, 1.0 / tl.maximum(n_solved - kf, 1.0))
    return target, tl.where(lane < k, 1.0, tl.where(lane == k, inv_rest, 0.0))


@triton.jit
def _window_solve(Z, VALID, WIN, n, cut, margin, g0, n_valid, no_rest, eps_z, y_eps2, rest_bias, anchor, k, tol,
                  max_iter, CUT, RIDGE, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, KP: tl.constexpr,
                  WMAX: tl.constexpr, K1: tl.constexpr):
    """The solve on the row's certified candidate window (see :func:`_sorted_forward_kernel`), from the first
    floor ``cut``. Returns ``(g, err, iterations, whether the solution is a certified window's, its floor)``."""
    lane = tl.arange(0, KP)
    eps = eps_z.to(tl.float64)
    g = g0
    err = tl.cast(float("inf"), tl.float64)
    best_out = tl.cast(float("-inf"), Z.dtype.element_ty)
    used = 0  # iterations of the solves so far
    windowed = 1
    windows = 0
    solving = 1
    while solving != 0:
        src = Z
        count = n
        n_solved = n_valid
        if windowed != 0:
            m, best_out, nan = _compact(Z, VALID, WIN, n, cut, HAS_MASK, BLOCK, WMAX)
            if (m > WMAX) | (nan != 0):  # the whole row, from the hard start
                windowed = 0
                g = g0
            else:
                src = WIN
                count = m
                n_solved = m.to(tl.float64)
        target, inv_target = _targets(n_solved, no_rest, k, KP)
        g, err, n_iter = _newton(src, VALID, count, windowed == 0, g, target, inv_target, no_rest, y_eps2,
                                 rest_bias, anchor, k, tol, max_iter - used, CUT, RIDGE, HAS_MASK, BLOCK, KP, K1)
        used += n_iter
        solving = 0
        if windowed != 0:
            # the best entry left out must give every rank less than exp(margin) of its mass
            rank_logit = best_out.to(tl.float64) * tl.where(lane < k, k - lane, 1).to(tl.float64) / eps + g
            rank_logit = tl.max(tl.where(lane < k, rank_logit, float("-inf")), axis=0)
            if tl.where(rank_logit < margin, 0, 1) != 0:  # uncertified (NaN included)
                solving = 1
                windows += 1
                if used >= max_iter:  # no iteration left: the whole row evaluated where the window ended
                    windowed = 0
                elif windows >= MAX_WINDOWS:
                    windowed = 0
                    g = g0
                else:  # widen the window, as the torch path does
                    cut = cut + (margin - WINDOW_GAP).to(Z.dtype.element_ty) * eps_z
    return g, err, used, windowed, cut


@triton.jit
def _plan_pass(Z, VALID, PLAN, first, stop, n, g, y_eps2, rest_bias, anchor, k, CUT, windowed, cut,
               HAS_MASK: tl.constexpr, LEFT_OUT: tl.constexpr, BLOCK: tl.constexpr, KP: tl.constexpr,
               K1: tl.constexpr):
    """The plan ``(k + 1, n)`` at ``PLAN`` on the entries ``first`` to ``stop`` at potentials ``g``; with
    ``LEFT_OUT`` and ``windowed`` nonzero, the valid entries below ``cut`` (those a certified window left out)
    exactly on the rest anchor. ``K1 > 0``: the anchors unrolled (each anchor's row written on its own), else
    ``(BLOCK, KP)`` tiles."""
    if K1 > 0:
        unit, shifts = _anchor_terms(g, y_eps2, rest_bias, K1, KP)
        for start in range(first, stop, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            P, valid, lse_i = _entry_plan(Z, VALID, offs, n, True, unit, shifts, CUT, HAS_MASK, K1)
            if LEFT_OUT:
                if windowed != 0:
                    out = tl.load(Z + offs, mask=offs < n, other=0.0) < cut
                    left_out = ()
                    for r in tl.static_range(K1):
                        on_rest = tl.where(valid & (r == K1 - 1), 1.0, 0.0).to(P[r].dtype)
                        left_out = left_out + (tl.where(out, on_rest, P[r]),)
                    P = left_out
            for r in tl.static_range(K1):
                tl.store(PLAN + r * n + offs, P[r], mask=offs < n)
    else:
        shift = ((g + rest_bias) * LOG2E)[None, :]
        for start in range(first, stop, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            P, valid, lse_i = _plan_tile(Z, VALID, offs, n, True, y_eps2, shift, anchor, k, CUT, HAS_MASK)
            if LEFT_OUT:
                if windowed != 0:
                    out = (tl.load(Z + offs, mask=offs < n, other=0.0) < cut)[:, None]
                    P = tl.where(out, tl.where(valid[:, None] & (anchor == k), 1.0, 0.0).to(P.dtype), P)
            tl.store(PLAN + anchor * n + offs[:, None], P, mask=(offs < n)[:, None] & (anchor <= k))


@triton.jit
def _sorted_forward_kernel(Z, VALID, EPS, N_VALID, G0, FLOOR, MARGIN, WIN, PLAN, N_ITER, ERR, n, k, tol_hi, tol_lo,
                           max_iter, CUT, RIDGE, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, KP: tl.constexpr,
                           WMAX: tl.constexpr, K1: tl.constexpr):
    """One program per row: the potentials ``g`` maximising the semi-dual, then the plan.

    With ``WMAX > 0`` (rows longer than ``WMAX``), the torch path's candidate window (``newton_solve``): a pass
    compacts the valid entries at or above the row's floor into ``WIN``, the solve runs on them (the rest
    anchor's target is the window's count minus k), and the best entry left out must give every rank a logit
    below ``MARGIN`` at the solution; where it does not, the floor drops by ``(WINDOW_GAP - MARGIN)`` epsilons
    and the window is solved again (at most ``MAX_WINDOWS`` windows). A window of more than ``WMAX`` entries,
    a row holding a NaN, or ``MAX_WINDOWS`` uncertified windows: the whole row from the hard start, as without
    a window. Iterations count over all the solves together (at most ``max_iter``); a window uncertified when
    they are spent: the whole row evaluated at its potentials. The plan of a certified window is the solution
    on the window's entries, and exactly the rest anchor (1) on the valid entries left out.

    Args (per row; ``n`` entries, row-major, contiguous):
        Z: ``(rows, n)`` prepared scores (0 where excluded). VALID: ``(rows, n)`` uint8, nonzero where the
        entry takes part (read only with ``HAS_MASK``). EPS: ``(rows,)`` temperatures. N_VALID: ``(rows,)``
        valid counts (Z's dtype). G0: ``(rows, k + 1)`` float64 hard start. FLOOR: ``(rows,)`` the first
        window's floor (Z's dtype; ``-inf``: every valid entry). MARGIN: ``(rows,)`` float64, the log of the
        share of a rank each entry left out may carry. WIN: ``(rows, WMAX)`` scratch (Z's dtype); FLOOR,
        MARGIN and WIN are read only with ``WMAX > 0``. PLAN: ``(rows, k + 1, n)`` output. N_ITER: ``(rows,)``
        int32 iterations (rescaling and Newton steps, of every solve). ERR: ``(rows,)`` float64 marginal error
        of the problem last solved (the certified window's, or the whole row's). CUT: the exponent clamp;
        RIDGE: the solve's relative ridge. The solve's passes take ``(BLOCK, KP)`` tiles; the plan's pass, with
        ``K1 > 0`` (``k + 1``), the anchors unrolled (blocks of ``BLOCK``: unrolling the solve's own passes, or
        wider blocks, spills registers on sm_90), else the tiles.
    """
    row = tl.program_id(0).to(tl.int64)
    Z += row * n
    VALID += row * n
    PLAN += row * (k + 1) * n
    tol = tl.cast(tol_hi, tl.float64) + tl.cast(tol_lo, tl.float64)  # scalar arguments: tl.cast, not .to
    eps_z = tl.load(EPS + row)  # the window widens in the scores' units
    y_eps2, rest_bias, no_rest, n_valid, anchor = _row_constants(EPS, N_VALID, row, k, KP)
    lane = tl.arange(0, KP)
    g0 = tl.load(G0 + row * (k + 1) + lane, mask=lane <= k, other=0.0)
    if WMAX > 0:
        g, err, used, windowed, cut = _window_solve(Z, VALID, WIN + row * WMAX, n, tl.load(FLOOR + row),
                                                    tl.load(MARGIN + row), g0, n_valid, no_rest, eps_z, y_eps2,
                                                    rest_bias, anchor, k, tol, max_iter, CUT, RIDGE, HAS_MASK,
                                                    BLOCK, KP, WMAX, 0)
    else:  # the whole row (the kernel's code without the window's)
        target, inv_target = _targets(n_valid, no_rest, k, KP)
        g, err, used = _newton(Z, VALID, n, True, g0, target, inv_target, no_rest, y_eps2, rest_bias, anchor, k,
                               tol, max_iter, CUT, RIDGE, HAS_MASK, BLOCK, KP, 0)
    tl.store(N_ITER + row, used)
    tl.store(ERR + row, err)
    if WMAX > 0:  # valid entries left out of a certified window: on the rest anchor
        _plan_pass(Z, VALID, PLAN, 0, n, n, g, y_eps2, rest_bias, anchor, k, CUT, windowed, cut, HAS_MASK, True,
                   BLOCK, KP, K1)
    else:
        _plan_pass(Z, VALID, PLAN, 0, n, n, g, y_eps2, rest_bias, anchor, k, CUT, 0, 0.0, HAS_MASK, False, BLOCK,
                   KP, K1)


@triton.jit
def _backward_sums_tile(PLAN, GRAD, offs, n, anchor, k):
    """The backward's first pass on the entries ``offs`` of a row's plan ``(k + 1, n)`` and its gradient: their
    terms of ``b_r = sum_i P_ir (G_ir - Gbar_i)`` ``(KP,)`` float64 and of the Gram matrix ``(KP, KP)`` in the
    plan's dtype."""
    rank = anchor < k
    inside = (offs < n)[:, None]
    P = tl.load(PLAN + anchor * n + offs[:, None], mask=inside & (anchor <= k), other=0.0)
    PG = P * tl.load(GRAD + anchor * n + offs[:, None], mask=inside & rank, other=0.0)
    G_bar = tl.sum(PG, axis=1)
    b = tl.sum(PG.to(tl.float64), axis=0) - tl.sum(tl.where(rank, P * G_bar[:, None], 0.0).to(tl.float64), axis=0)
    return b, tl.dot(tl.trans(P), P, input_precision="ieee")


@triton.jit
def _entry_plan_and_gradient(PLAN, GRAD, offs, n, K1: tl.constexpr):
    """``(P, PG, Gbar)`` of the entries ``offs`` of a row's plan ``(K1, n)`` and its gradient, anchor by anchor:
    ``P`` a tuple of ``K1`` ``(BLOCK,)`` vectors (0 outside the row), ``PG`` of ``K1 - 1``, ``P_ir G_ir`` on the
    ranks, ``Gbar_i = sum_r P_ir G_ir``."""
    inside = offs < n
    P = ()
    PG = ()
    for r in tl.static_range(K1):
        P = P + (tl.load(PLAN + r * n + offs, mask=inside, other=0.0),)
    G_bar = tl.zeros(P[0].shape, dtype=P[0].dtype)
    for r in tl.static_range(K1 - 1):
        PG = PG + (P[r] * tl.load(GRAD + r * n + offs, mask=inside, other=0.0),)
        G_bar += PG[r]
    return P, PG, G_bar


@triton.jit
def _backward_grad_tile(PLAN, GRAD, offs, n, anchor, k, u, eps):
    """The backward's second pass: ``grad_z`` ``(BLOCK,)`` of the entries ``offs`` given ``u = K^{-1} b`` ``(1,
    KP)`` in the plan's dtype (see :func:`_sorted_backward_kernel`)."""
    rank = anchor < k
    y = tl.where(rank, k - anchor, 0).to(PLAN.dtype.element_ty)
    inside = (offs < n)[:, None]
    P = tl.load(PLAN + anchor * n + offs[:, None], mask=inside & rank, other=0.0)
    PG = P * tl.load(GRAD + anchor * n + offs[:, None], mask=inside & rank, other=0.0)
    G_bar = tl.sum(PG, axis=1)
    y_bar = tl.sum(P * y, axis=1)
    direct_minus_implicit = tl.sum(y * (PG - P * u), axis=1)
    Pu = tl.sum(P * u, axis=1)
    return _div(direct_minus_implicit - y_bar * (G_bar - Pu), eps)


@triton.jit
def _backward_sums(PLAN, GRAD, first, stop, n, k, BLOCK: tl.constexpr, KP: tl.constexpr, K1: tl.constexpr):
    """The backward's first pass over the entries ``first`` to ``stop`` of a row's plan ``(k + 1, n)`` and its
    gradient: ``(b (KP,) float64, Gram (KP, KP) in the plan's dtype)``, ``b_r = sum_i P_ir (G_ir - Gbar_i)`` on the
    ranks (0 after). ``K1 > 0``: the anchors unrolled, else ``(BLOCK, KP)`` tiles (:func:`_backward_sums_tile`)."""
    if K1 > 0:
        # b over the ranks, the Gram terms over every anchor, per entry lane until the end
        b_lanes = _zeros_tuple(K1 - 1, BLOCK, tl.float64)
        terms = _zeros_tuple(K1 * (K1 + 1) // 2, BLOCK, PLAN.dtype.element_ty)
        for start in range(first, stop, BLOCK):
            P, PG, G_bar = _entry_plan_and_gradient(PLAN, GRAD, start + tl.arange(0, BLOCK), n, K1)
            added = ()
            for r in tl.static_range(K1 - 1):
                added = added + (b_lanes[r] + (PG[r].to(tl.float64) - (P[r] * G_bar).to(tl.float64)),)
            b_lanes = added
            terms = _add_gram(terms, P, K1)
        b, gram = _as_tiles(b_lanes, terms, K1, KP)
    else:
        anchor = tl.arange(0, KP)[None, :]
        b = tl.zeros((KP,), dtype=tl.float64)
        gram = tl.zeros((KP, KP), dtype=PLAN.dtype.element_ty)
        for start in range(first, stop, BLOCK):
            b_tile, gram_tile = _backward_sums_tile(PLAN, GRAD, start + tl.arange(0, BLOCK), n, anchor, k)
            b += b_tile
            gram += gram_tile
    return b, gram


@triton.jit
def _backward_grad(PLAN, GRAD, GRAD_Z, first, stop, n, k, u, eps, BLOCK: tl.constexpr, KP: tl.constexpr,
                   K1: tl.constexpr):
    """The backward's second pass: ``grad_z`` of the entries ``first`` to ``stop`` to ``GRAD_Z`` given ``u = K^{-1}
    b`` ``(KP,)`` in the plan's dtype (see :func:`_sorted_backward_kernel`). ``K1 > 0``: the anchors unrolled
    (:func:`_backward_grad_tile`'s sums over the ranks, ``y_r = k - r``), else ``(BLOCK, KP)`` tiles."""
    if K1 > 0:
        for start in range(first, stop, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            P, PG, G_bar = _entry_plan_and_gradient(PLAN, GRAD, offs, n, K1)
            y_bar = tl.zeros(G_bar.shape, dtype=G_bar.dtype)
            direct_minus_implicit = tl.zeros(G_bar.shape, dtype=G_bar.dtype)
            Pu = tl.zeros(G_bar.shape, dtype=G_bar.dtype)
            for r in tl.static_range(K1 - 1):
                u_r = _lane(u, r, KP)
                y_r = tl.cast(K1 - 1 - r, PLAN.dtype.element_ty)
                y_bar += P[r] * y_r
                direct_minus_implicit += y_r * (PG[r] - P[r] * u_r)
                Pu += P[r] * u_r
            tl.store(GRAD_Z + offs, _div(direct_minus_implicit - y_bar * (G_bar - Pu), eps), mask=offs < n)
    else:
        anchor = tl.arange(0, KP)[None, :]
        for start in range(first, stop, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            tl.store(GRAD_Z + offs, _backward_grad_tile(PLAN, GRAD, offs, n, anchor, k, u[None, :], eps),
                     mask=offs < n)


@triton.jit
def _sorted_backward_kernel(PLAN, GRAD, EPS, NO_REST, GRAD_Z, n, k, RIDGE, BLOCK: tl.constexpr, KP: tl.constexpr,
                            K1: tl.constexpr):
    """One program per row: ``SortedSoftTopKFunction._vjp``.

    With ``G`` the plan's gradient on the ranks, ``Gbar_i = sum_r P_ir G_ir``, ``b_r = sum_i P_ir (G_ir -
    Gbar_i)``, ``u = K^{-1} b`` and ``ybar_i = sum_r P_ir y_r``: ``grad_z_i = (sum_r P_ir y_r (G_ir - u_r) -
    ybar_i (Gbar_i - sum_r P_ir u_r)) / eps``.

    Args: PLAN, GRAD: ``(rows, k + 1, n)`` contiguous (the forward's plan, its gradient: the rest anchor's row
    is not read); EPS: ``(rows,)`` temperatures in the scores' units (``inf``: gradient 0); NO_REST:
    ``(rows,)`` uint8, rows with exactly k valid entries; GRAD_Z: ``(rows, n)`` the result.
    """
    row = tl.program_id(0).to(tl.int64)
    PLAN += row * (k + 1) * n
    GRAD += row * (k + 1) * n
    GRAD_Z += row * n
    eps = tl.load(EPS + row)
    no_rest = tl.load(NO_REST + row) != 0
    b, gram = _backward_sums(PLAN, GRAD, 0, n, n, k, BLOCK, KP, K1)
    u = _solve_ridged(_hessian(gram, k, no_rest, KP), b, k, RIDGE, KP).to(PLAN.dtype.element_ty)
    _backward_grad(PLAN, GRAD, GRAD_Z, 0, n, n, k, u, eps, BLOCK, KP, K1)
