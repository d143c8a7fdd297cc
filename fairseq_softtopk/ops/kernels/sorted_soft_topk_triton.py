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
  the plan ``(k + 1, n)`` (with ``K1 = k + 1``, small k, the anchors unrolled);
* backward (:func:`_sorted_backward_kernel`): the ``_vjp`` of ``SortedSoftTopKFunction``, two passes over the
  plan (``b`` and ``K``, then the gradient) around one in-kernel ``k x k`` solve (the passes unrolled with
  ``K1 = k + 1``).

The passes over entries are ``sorted_soft_topk_passes_triton``'s; the solver's steps here (:func:`_next_trial`,
:func:`_judge_trial`, :func:`_solve_ridged`) are shared with the many-programs-a-row and the window kernels. This
module imports ``triton``: ``sorted_soft_topk_op.kernel_module`` loads it on the first launch (the package never
imports it otherwise). Only APIs present in Triton 3.6 are used.
"""

import triton
import triton.language as tl

from fairseq_softtopk.ops.kernels.sorted_soft_topk_passes_triton import (_backward_grad, _backward_sums, _evaluate,
                                                                         _plan_pass, _row_constants)

# the torch path's constants (semi_dual_newton): Armijo's slope factor, trials per line search, rescaling steps at
# most and the error ratio each must gain to go on; kernels read globals only as constexpr
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
