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

The passes over entries are ``sorted_soft_topk_passes_triton``'s: with ``K1 = k + 1`` (small k) the anchors unrolled,
one entry a thread, with ``K1 = 0`` ``(BLOCK, KP)`` tiles. The per-row state and the partial sums keep the ``KP``
layout either way (the step kernel reads them).

The launcher (``sorted_soft_topk_split_op``) decides how many rounds run. This module imports ``triton``, the passes
and the one-program kernels' solver steps.
"""

import triton
import triton.language as tl

from fairseq_softtopk.ops.kernels.sorted_soft_topk_passes_triton import (_backward_grad, _backward_sums, _evaluate,
                                                                         _plan_pass, _row_constants)
from fairseq_softtopk.ops.kernels.sorted_soft_topk_triton import (_hessian, _judge_trial, _marginal_error, _next_trial,
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
        y_eps2, rest_bias, no_rest, n_valid, anchor = _row_constants(EPS, N_VALID, row, k, KP)
        counts, lse, gram = _evaluate(Z + row * n, VALID + row * n, first, first + CHUNK, n, True,
                                      tl.load(state + TRIAL_AT * KP + tl.arange(0, KP)), y_eps2, rest_bias, anchor, k,
                                      CUT, HAS_MASK, BLOCK, KP, K1)
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
    y_eps2, rest_bias, no_rest, n_valid, anchor = _row_constants(EPS, N_VALID, row, k, KP)
    first = chunk * CHUNK
    _plan_pass(Z + row * n, VALID + row * n, PLAN + row * (k + 1) * n, first, first + CHUNK, n,
               tl.load(state + G_AT * KP + tl.arange(0, KP)), y_eps2, rest_bias, anchor, k, CUT, 0, 0.0, HAS_MASK,
               False, BLOCK, KP, K1)


@triton.jit
def _split_backward_sums_kernel(PLAN, GRAD, PART, n, k, BLOCK: tl.constexpr, KP: tl.constexpr,
                                CHUNK: tl.constexpr, K1: tl.constexpr):
    """Program ``(row, chunk)``: the chunk's ``b_r = sum_i P_ir (G_ir - Gbar_i)`` and Gram matrix (see
    ``sorted_soft_topk_triton._sorted_backward_kernel``), to PART ``(rows, chunks, KP + 1 + KP * KP)`` float64."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    PLAN += row * (k + 1) * n
    GRAD += row * (k + 1) * n
    first = chunk * CHUNK
    b, gram = _backward_sums(PLAN, GRAD, first, first + CHUNK, n, k, BLOCK, KP, K1)
    _store_part(PART + (row * tl.num_programs(1) + chunk) * (KP + 1 + KP * KP), b, 0.0, gram, KP)


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
    first = chunk * CHUNK
    _backward_grad(PLAN, GRAD, GRAD_Z, first, first + CHUNK, n, k,
                   tl.load(U + row * KP + tl.arange(0, KP)).to(PLAN.dtype.element_ty), eps, BLOCK, KP, K1)
