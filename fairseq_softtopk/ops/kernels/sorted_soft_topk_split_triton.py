"""Triton kernels of :func:`~fairseq_softtopk.ops.sorted_soft_topk` for few, long rows: many programs a row.

The one-program-a-row kernels (``sorted_soft_topk_triton``) walk a row serially: a few rows of 1e5-1e6 entries
leave most of a GPU idle. Here every pass over the scores runs on a ``(rows, chunks)`` grid, ``CHUNK`` entries a
program, and each program writes its partial sums; a small launch of one program a row reduces them and takes
the solver's decision:

* forward: the whole row's semi-dual Newton solve (the one-program kernel's ``_newton``, the same steps and
  tests) as a state machine kept in a per-row float64 state (:data:`STATE` offsets below). A *round* is two
  launches: :func:`_split_evaluate_kernel` evaluates the row at its trial potentials (counts, log-normalisers,
  Gram matrix per chunk), :func:`_split_step_kernel` accepts or rejects the trial and proposes the next one (a
  rescaling, a Newton step or a backtrack), or marks the row done. Programs of rows that are done return at once.
  :func:`_split_plan_kernel` writes the plan ``(k + 1, n)``;
* backward: :func:`_split_backward_sums_kernel` (``b`` and the Gram matrix per chunk),
  :func:`_split_backward_solve_kernel` (one program a row: ``u = K^{-1} b``), :func:`_split_backward_grad_kernel`
  (the gradient per chunk).

The passes over entries take a row's anchors one of two ways. With ``K1 = k + 1`` anchors given (``K1 > 0``: small k,
the beam search's), they are unrolled: each entry is one lane of a ``(BLOCK,)`` vector, one entry a thread, and
every anchor's logit, plan entry, count and Gram term a value of its own (Triton tuples, :func:`_entry_plan`,
:func:`_evaluate_unrolled`): no padded anchor lane computes anything, the plan and its gradient are read and
written one anchor row at a time (contiguous), and the per-entry sums are reduced once a program. With ``K1 = 0``
the one-program kernels' ``(BLOCK, KP)`` tiles are used (``KP`` a power of two, at least 16: ``tl.dot``'s), for
any k. The per-row state and the partial sums keep the ``KP`` layout either way (the step kernel reads them).

The launcher (``sorted_soft_topk_split_op``) decides how many rounds run. This module imports ``triton`` and the
one-program kernels' device functions.
"""

import triton
import triton.language as tl

from fairseq_softtopk.ops.kernels.sorted_soft_topk_triton import (LOG2E, _backward_grad_tile, _backward_sums_tile,
                                                                  _div, _evaluate, _hessian, _judge_trial, _marginal_error,
                                                                  _next_trial, _plan_tile, _row_constants,
                                                                  _solve_ridged, _targets)

# The per-row state, float64, offsets in units of KP (vectors) then scalars after the Gram matrix; the launcher
# reads ACTIVE_AT (whether the row's solve goes on) and allocates state_size(KP) entries a row.
G_AT = tl.constexpr(0)  # the potentials reached
TRIAL_AT = tl.constexpr(1)  # the potentials the next evaluation reads
STEP_AT = tl.constexpr(2)  # the Newton step in progress
COUNTS_AT = tl.constexpr(3)  # the anchors' counts at g
GRAM_AT = tl.constexpr(4)  # the Gram matrix at g (KP x KP, from 4 KP)
# scalars, counted from 4 KP + KP * KP
LSE_AT, ERR_AT, ALPHA_AT, F_AT, SLOPE_AT = (tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3),
                                            tl.constexpr(4))
FRESH_AT, GOING_AT, RESCALED_AT, N_NEWTON_AT = tl.constexpr(5), tl.constexpr(6), tl.constexpr(7), tl.constexpr(8)
STALLED_AT, TRIES_AT, IN_RESCALE_AT, ACTIVE_AT = tl.constexpr(9), tl.constexpr(10), tl.constexpr(11), tl.constexpr(12)


@triton.jit
def _row_state(STATE, row, KP: tl.constexpr):
    """``(state, scalars)``: pointers to a row's solver state and to its scalars (after the vectors and the Gram
    matrix); a row holds ``state_size(KP)`` entries."""
    state = STATE + row * (4 * KP + KP * KP + 16)
    return state, state + 4 * KP + KP * KP


@triton.jit
def _anchor_terms(G, EPS, N_VALID, row, K1: tl.constexpr):
    """``(slopes, shifts)``, tuples of ``K1`` float64 scalars: anchor r's logit of score z is ``z * slopes[r] +
    shifts[r]`` in log2 units, ``y_r / eps`` and ``g_r`` (G ``(K1,)``, the rest anchor's ``-inf`` in rows without
    one), as the one-program kernels' ``_row_constants`` and shift compute them, lane by lane."""
    eps = tl.load(EPS + row).to(tl.float64)
    no_rest = tl.load(N_VALID + row).to(tl.float64) == tl.cast(K1 - 1, tl.float64)
    slopes = ()
    shifts = ()
    for r in tl.static_range(K1):
        slopes = slopes + (tl.cast(K1 - 1 - r, tl.float64) * (LOG2E / eps),)
        if r == K1 - 1:
            shifts = shifts + ((tl.load(G + r) + tl.where(no_rest, float("-inf"), 0.0)) * LOG2E,)
        else:
            shifts = shifts + (tl.load(G + r) * LOG2E,)
    return slopes, shifts


@triton.jit
def _entry_plan(Z, VALID, offs, n, slopes, shifts, CUT, HAS_MASK: tl.constexpr, K1: tl.constexpr):
    """``(P, valid, log2 normaliser)`` of the entries ``offs`` ``(BLOCK,)``, ``P`` a tuple of ``K1`` ``(BLOCK,)``
    vectors in the scores' dtype: ``_plan_tile``'s softmax over the anchors (the same operations, its clamp at
    ``CUT``, 0 on excluded entries, NaN for NaN scores), one anchor at a time."""
    inside = offs < n
    z = tl.load(Z + offs, mask=inside, other=0.0)
    valid = inside
    if HAS_MASK:
        valid = valid & (tl.load(VALID + offs, mask=inside, other=1) != 0)
    logits = ()
    for r in tl.static_range(K1):
        logits = logits + (z.to(tl.float64) * slopes[r] + shifts[r],)
    top = logits[0]
    for r in tl.static_range(1, K1):
        top = tl.maximum(top, logits[r])
    e = ()
    total = tl.zeros(z.shape, dtype=z.dtype)
    for r in tl.static_range(K1):
        e = e + (tl.exp2(tl.maximum((logits[r] - top).to(z.dtype), CUT)),)
        total += e[r]
    total = tl.where(valid, total, float("inf"))  # excluded entries: P = e / inf = 0
    P = ()
    for r in tl.static_range(K1):
        P = P + (tl.where(z == z, _div(e[r], total), float("nan")),)
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
def _evaluate_unrolled(Z, VALID, first, stop, n, slopes, shifts, CUT, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
                       K1: tl.constexpr):
    """``_evaluate`` over the entries ``first`` to ``stop`` with the anchors unrolled: ``(counts, sum_i lse_i, gram)``,
    ``counts`` a tuple of ``K1`` float64 ``(BLOCK,)`` sums, ``gram`` of the ``K1 (K1 + 1) / 2`` Gram terms
    (:func:`_add_gram`'s order) in the scores' dtype, each summed per entry lane (reduced by :func:`_as_tiles`)."""
    counts = _zeros_tuple(K1, BLOCK, tl.float64)
    gram = _zeros_tuple(K1 * (K1 + 1) // 2, BLOCK, Z.dtype.element_ty)
    lse = tl.zeros((BLOCK,), dtype=tl.float64)
    for start in range(first, stop, BLOCK):
        P, valid, lse_i = _entry_plan(Z, VALID, start + tl.arange(0, BLOCK), n, slopes, shifts, CUT, HAS_MASK, K1)
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
    of fewer) as a ``(KP,)`` vector, ``gram`` as the symmetric ``(KP, KP)`` float64 matrix (0 on padding).

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
    matrix = tl.zeros((KP, KP), dtype=tl.float64)
    for r in tl.static_range(K1):
        for s in tl.static_range(r, K1):
            matrix = tl.where(((ri == r) & (ci == s)) | ((ri == s) & (ci == r)),
                              tl.sum(gram[r * K1 - r * (r - 1) // 2 + s - r], axis=0).to(tl.float64), matrix)
    return vector, matrix


@triton.jit
def _split_evaluate_kernel(Z, VALID, EPS, N_VALID, STATE, PART, n, k, CUT, HAS_MASK: tl.constexpr,
                           BLOCK: tl.constexpr, KP: tl.constexpr, CHUNK: tl.constexpr, K1: tl.constexpr):
    """Program ``(row, chunk)``: the plan's sums over the chunk's ``CHUNK`` entries at the row's trial potentials.

    Args: Z ``(rows, n)`` prepared scores, VALID ``(rows, n)`` uint8 (read with ``HAS_MASK``), EPS ``(rows,)``,
    N_VALID ``(rows,)`` (Z's dtype), STATE ``(rows, state_size)`` float64, PART ``(rows, chunks, KP + 1 + KP *
    KP)`` float64: the chunk's counts, its sum of log2-normalisers, its Gram matrix (rows that are done: not
    written); ``K1``: ``k + 1`` (anchors unrolled) or 0 (``(BLOCK, KP)`` tiles).
    """
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    state, scalars = _row_state(STATE, row, KP)
    if tl.load(scalars + ACTIVE_AT) != 0:
        first = chunk * CHUNK
        if K1 > 0:
            slopes, shifts = _anchor_terms(state + TRIAL_AT * KP, EPS, N_VALID, row, K1)
            sums, lse, terms = _evaluate_unrolled(Z + row * n, VALID + row * n, first, first + CHUNK, n, slopes,
                                                  shifts, CUT, HAS_MASK, BLOCK, K1)
            counts, gram = _as_tiles(sums, terms, K1, KP)
        else:
            y_eps2, rest_bias, no_rest, n_valid, anchor = _row_constants(EPS, N_VALID, row, k, KP)
            counts, lse, gram = _evaluate(Z + row * n, VALID + row * n, first, first + CHUNK, n, True,
                                          tl.load(state + TRIAL_AT * KP + tl.arange(0, KP)), y_eps2, rest_bias,
                                          anchor, k, CUT, HAS_MASK, BLOCK, KP)
        _store_part(PART + (row * chunks + chunk) * (KP + 1 + KP * KP), counts, lse, gram, KP)


@triton.jit
def _store_part(part, vector, scalar, gram, KP: tl.constexpr):
    """A program's partial sums, ``(KP,)``, a scalar, ``(KP, KP)``, at ``part`` (float64)."""
    lane = tl.arange(0, KP)
    tl.store(part + lane, vector)
    tl.store(part + KP, scalar)
    tl.store(part + KP + 1 + lane[:, None] * KP + lane[None, :], gram.to(tl.float64))


@triton.jit
def _reduce_parts(PART, row, chunks, KP: tl.constexpr):
    """``(counts (KP,), lse, Gram (KP, KP))`` float64: the chunks' partial sums of a row added up."""
    lane = tl.arange(0, KP)
    counts = tl.zeros((KP,), dtype=tl.float64)
    lse = tl.cast(0.0, tl.float64)
    gram = tl.zeros((KP, KP), dtype=tl.float64)
    for c in range(0, chunks):
        part = PART + (row * chunks + c) * (KP + 1 + KP * KP)
        counts += tl.load(part + lane)
        lse += tl.load(part + KP)
        gram += tl.load(part + KP + 1 + lane[:, None] * KP + lane[None, :])
    return counts, lse, gram


@triton.jit
def _flag(scalars, at):
    """An integer field of the state (stored as float64)."""
    return tl.load(scalars + at).to(tl.int32)


@triton.jit
def _split_step_kernel(EPS, N_VALID, STATE, PART, N_ITER, ERR, chunks, k, tol_hi, tol_lo, max_iter, RIDGE,
                       KP: tl.constexpr):
    """One program a row: one iteration of ``sorted_soft_topk_triton._newton``'s loop, from its evaluation on.

    The trial just evaluated (PART, as :func:`_split_evaluate_kernel` wrote it) is judged by the one-program
    kernel's ``_judge_trial`` (the same tests decide whether the row goes on), and if it does the next trial is
    proposed by its ``_next_trial`` (a rescaling while it pays off, a Newton step, or half the last step). N_ITER
    ``(rows,)`` int32 and ERR ``(rows,)`` float64 are written at every step (the row's iterations and error so far).
    """
    row = tl.program_id(0).to(tl.int64)
    state, scalars = _row_state(STATE, row, KP)
    if _flag(scalars, ACTIVE_AT) != 0:
        tol = tl.cast(tol_hi, tl.float64) + tl.cast(tol_lo, tl.float64)
        y_eps2, rest_bias, no_rest, n_valid, anchor = _row_constants(EPS, N_VALID, row, k, KP)
        lane = tl.arange(0, KP)
        ri = lane[:, None]
        ci = lane[None, :]
        target, inv_target = _targets(n_valid, no_rest, k, KP)
        g = tl.load(state + G_AT * KP + lane)
        trial = tl.load(state + TRIAL_AT * KP + lane)
        step = tl.load(state + STEP_AT * KP + lane)
        counts = tl.load(state + COUNTS_AT * KP + lane)
        gram = tl.load(state + GRAM_AT * KP + ri * KP + ci)
        lse = tl.load(scalars + LSE_AT)
        err = tl.load(scalars + ERR_AT)
        alpha = tl.load(scalars + ALPHA_AT)
        F = tl.load(scalars + F_AT)
        slope = tl.load(scalars + SLOPE_AT)
        fresh = _flag(scalars, FRESH_AT)
        going = _flag(scalars, GOING_AT)
        rescaled = _flag(scalars, RESCALED_AT)
        n_newton = _flag(scalars, N_NEWTON_AT)
        stalled = _flag(scalars, STALLED_AT)
        tries = _flag(scalars, TRIES_AT)
        in_rescale = _flag(scalars, IN_RESCALE_AT)
        # the trial's evaluation judged, and the next trial where the row goes on (as _newton's loop)
        t_counts, t_lse, t_gram = _reduce_parts(PART, row, chunks, KP)
        t_err = _marginal_error(t_counts, target, inv_target)
        g, counts, lse, gram, err, going, rescaled, stalled, tries, in_rescale, active = _judge_trial(
            trial, t_counts, t_lse, t_gram, t_err, g, counts, lse, gram, err, F, alpha, slope, fresh, going,
            rescaled, stalled, tries, in_rescale, n_newton, max_iter, tol, k, KP)
        if active != 0:
            trial, step, alpha, F, slope, n_newton = _next_trial(g, counts, lse, gram, step, alpha, F, slope,
                                                                 n_newton, in_rescale, tries, target, no_rest, k,
                                                                 RIDGE, KP)
        tl.store(state + G_AT * KP + lane, g)
        tl.store(state + TRIAL_AT * KP + lane, trial)
        tl.store(state + STEP_AT * KP + lane, step)
        tl.store(state + COUNTS_AT * KP + lane, counts)
        tl.store(state + GRAM_AT * KP + ri * KP + ci, gram)
        tl.store(scalars + LSE_AT, lse)
        tl.store(scalars + ERR_AT, err)
        tl.store(scalars + ALPHA_AT, alpha)
        tl.store(scalars + F_AT, F)
        tl.store(scalars + SLOPE_AT, slope)
        tl.store(scalars + FRESH_AT, tl.cast(0.0, tl.float64))  # the first trial is behind
        tl.store(scalars + GOING_AT, going.to(tl.float64))
        tl.store(scalars + RESCALED_AT, rescaled.to(tl.float64))
        tl.store(scalars + N_NEWTON_AT, n_newton.to(tl.float64))
        tl.store(scalars + STALLED_AT, stalled.to(tl.float64))
        tl.store(scalars + TRIES_AT, tries.to(tl.float64))
        tl.store(scalars + IN_RESCALE_AT, in_rescale.to(tl.float64))
        tl.store(scalars + ACTIVE_AT, active.to(tl.float64))
        tl.store(N_ITER + row, rescaled + n_newton)
        tl.store(ERR + row, err)


@triton.jit
def _split_plan_kernel(Z, VALID, EPS, N_VALID, STATE, PLAN, n, k, CUT, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
                       KP: tl.constexpr, CHUNK: tl.constexpr, K1: tl.constexpr):
    """Program ``(row, chunk)``: the plan ``(rows, k + 1, n)`` on the chunk's entries at the potentials reached."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    state, scalars = _row_state(STATE, row, KP)
    PLAN += row * (k + 1) * n
    if K1 > 0:
        slopes, shifts = _anchor_terms(state + G_AT * KP, EPS, N_VALID, row, K1)
        for start in range(0, CHUNK, BLOCK):
            offs = chunk * CHUNK + start + tl.arange(0, BLOCK)
            P, valid, lse_i = _entry_plan(Z + row * n, VALID + row * n, offs, n, slopes, shifts, CUT, HAS_MASK, K1)
            for r in tl.static_range(K1):
                tl.store(PLAN + r * n + offs, P[r], mask=offs < n)
    else:
        y_eps2, rest_bias, no_rest, n_valid, anchor = _row_constants(EPS, N_VALID, row, k, KP)
        g = tl.load(state + G_AT * KP + tl.arange(0, KP))
        shift = ((g + rest_bias) * LOG2E)[None, :]
        for start in range(0, CHUNK, BLOCK):
            offs = chunk * CHUNK + start + tl.arange(0, BLOCK)
            P, valid, lse_i = _plan_tile(Z + row * n, VALID + row * n, offs, n, True, y_eps2, shift, anchor, k, CUT,
                                         HAS_MASK)
            tl.store(PLAN + anchor * n + offs[:, None], P, mask=(offs < n)[:, None] & (anchor <= k))


@triton.jit
def _split_backward_sums_kernel(PLAN, GRAD, PART, n, k, BLOCK: tl.constexpr, KP: tl.constexpr,
                                CHUNK: tl.constexpr, K1: tl.constexpr):
    """Program ``(row, chunk)``: the chunk's ``b_r = sum_i P_ir (G_ir - Gbar_i)`` and Gram matrix (see
    ``sorted_soft_topk_triton._sorted_backward_kernel``), to PART ``(rows, chunks, KP + 1 + KP * KP)`` float64."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    PLAN += row * (k + 1) * n
    GRAD += row * (k + 1) * n
    part = PART + (row * tl.num_programs(1) + chunk) * (KP + 1 + KP * KP)
    if K1 > 0:
        # b over the ranks (the rest anchor's is 0), the Gram terms over every anchor, per entry lane
        b = _zeros_tuple(K1 - 1, BLOCK, tl.float64)
        terms = _zeros_tuple(K1 * (K1 + 1) // 2, BLOCK, PLAN.dtype.element_ty)
        for start in range(0, CHUNK, BLOCK):
            offs = chunk * CHUNK + start + tl.arange(0, BLOCK)
            P, PG, G_bar = _entry_plan_and_gradient(PLAN, GRAD, offs, n, K1)
            added = ()
            for r in tl.static_range(K1 - 1):
                added = added + (b[r] + (PG[r].to(tl.float64) - (P[r] * G_bar).to(tl.float64)),)
            b = added
            terms = _add_gram(terms, P, K1)
        b, gram = _as_tiles(b, terms, K1, KP)
    else:
        lane = tl.arange(0, KP)
        b = tl.zeros((KP,), dtype=tl.float64)
        gram = tl.zeros((KP, KP), dtype=PLAN.dtype.element_ty)
        for start in range(0, CHUNK, BLOCK):
            b_tile, gram_tile = _backward_sums_tile(PLAN, GRAD, chunk * CHUNK + start + tl.arange(0, BLOCK), n,
                                                    lane[None, :], k)
            b += b_tile
            gram += gram_tile
    _store_part(part, b, 0.0, gram, KP)


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
def _split_backward_solve_kernel(PART, NO_REST, U, chunks, k, RIDGE, KP: tl.constexpr):
    """One program a row: ``u = K^{-1} b`` from the chunks' sums, to U ``(rows, KP)`` float64."""
    row = tl.program_id(0).to(tl.int64)
    b, unused, gram = _reduce_parts(PART, row, chunks, KP)
    no_rest = tl.load(NO_REST + row) != 0
    tl.store(U + row * KP + tl.arange(0, KP), _solve_ridged(_hessian(gram, k, no_rest, KP), b, k, RIDGE, KP))


@triton.jit
def _split_backward_grad_kernel(PLAN, GRAD, U, EPS, GRAD_Z, n, k, BLOCK: tl.constexpr, KP: tl.constexpr,
                                CHUNK: tl.constexpr, K1: tl.constexpr):
    """Program ``(row, chunk)``: ``grad_z`` ``(rows, n)`` on the chunk's entries (the one-program backward's second
    pass)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    PLAN += row * (k + 1) * n
    GRAD += row * (k + 1) * n
    GRAD_Z += row * n
    eps = tl.load(EPS + row)
    if K1 > 0:
        # _backward_grad_tile's sums over the ranks, anchor by anchor (y_r = k - r)
        for start in range(0, CHUNK, BLOCK):
            offs = chunk * CHUNK + start + tl.arange(0, BLOCK)
            P, PG, G_bar = _entry_plan_and_gradient(PLAN, GRAD, offs, n, K1)
            y_bar = tl.zeros(G_bar.shape, dtype=G_bar.dtype)
            direct_minus_implicit = tl.zeros(G_bar.shape, dtype=G_bar.dtype)
            Pu = tl.zeros(G_bar.shape, dtype=G_bar.dtype)
            for r in tl.static_range(K1 - 1):
                u_r = tl.load(U + row * KP + r).to(PLAN.dtype.element_ty)
                y_r = tl.cast(K1 - 1 - r, PLAN.dtype.element_ty)
                y_bar += P[r] * y_r
                direct_minus_implicit += y_r * (PG[r] - P[r] * u_r)
                Pu += P[r] * u_r
            tl.store(GRAD_Z + offs, _div(direct_minus_implicit - y_bar * (G_bar - Pu), eps), mask=offs < n)
    else:
        lane = tl.arange(0, KP)
        u = tl.load(U + row * KP + lane).to(PLAN.dtype.element_ty)[None, :]
        for start in range(0, CHUNK, BLOCK):
            offs = chunk * CHUNK + start + tl.arange(0, BLOCK)
            tl.store(GRAD_Z + offs, _backward_grad_tile(PLAN, GRAD, offs, n, lane[None, :], k, u, eps),
                     mask=offs < n)
