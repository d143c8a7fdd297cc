"""The passes over a row's entries of :func:`~fairseq_softtopk.ops.sorted_soft_topk`'s kernels: device functions
shared by the one-program kernels (``sorted_soft_topk_triton``), the many-programs-a-row kernels
(``sorted_soft_topk_split_triton``) and the window kernels (``sorted_soft_topk_window_triton``).

A pass takes a row's anchors one of two ways:

* ``(BLOCK, KP)`` tiles (``K1 = 0``, any k): the ``k + 1`` anchors padded to ``KP`` lanes (a power of two, at
  least 16: ``tl.dot``'s smallest), the logits ``z_i y_r / eps + g_r`` in float64 (log2 units), the softmax over
  anchors in the scores' dtype, the Gram matrix ``sum_i P_i P_i^T`` by ``tl.dot`` (:func:`_plan_tile`,
  :func:`_evaluate_tiles`, :func:`_backward_sums_tile`, :func:`_backward_grad_tile`);
* the anchors unrolled (``K1 = k + 1``, small k: the beam search's): each entry one lane of a ``(BLOCK,)`` vector,
  one entry a thread, every anchor's logit, plan entry, count and Gram term a value of its own (Triton tuples,
  :func:`_entry_plan`, :func:`_evaluate_unrolled`): no padded lane computes anything, the plan and its gradient are
  read and written one anchor row at a time (contiguous), the per-entry sums reduced once a pass
  (:func:`_as_tiles`, into the tiles' ``KP`` layout the solver reads).

:func:`_evaluate` (the solve's evaluation: counts, log-normalisers, Gram matrix), :func:`_plan_pass` (the plan),
:func:`_backward_sums` and :func:`_backward_grad` (the implicit backward's two passes) take either way by ``K1``.
This module imports ``triton``; only APIs present in Triton 3.6 are used.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


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
        u_lanes = ()  # u's rank lanes as scalars, once a pass (not a reduction each block)
        for r in tl.static_range(K1 - 1):
            u_lanes = u_lanes + (_lane(u, r, KP),)
        for start in range(first, stop, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            P, PG, G_bar = _entry_plan_and_gradient(PLAN, GRAD, offs, n, K1)
            y_bar = tl.zeros(G_bar.shape, dtype=G_bar.dtype)
            direct_minus_implicit = tl.zeros(G_bar.shape, dtype=G_bar.dtype)
            Pu = tl.zeros(G_bar.shape, dtype=G_bar.dtype)
            for r in tl.static_range(K1 - 1):
                y_r = tl.cast(K1 - 1 - r, PLAN.dtype.element_ty)
                y_bar += P[r] * y_r
                direct_minus_implicit += y_r * (PG[r] - P[r] * u_lanes[r])
                Pu += P[r] * u_lanes[r]
            tl.store(GRAD_Z + offs, _div(direct_minus_implicit - y_bar * (G_bar - Pu), eps), mask=offs < n)
    else:
        anchor = tl.arange(0, KP)[None, :]
        for start in range(first, stop, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            tl.store(GRAD_Z + offs, _backward_grad_tile(PLAN, GRAD, offs, n, anchor, k, u[None, :], eps),
                     mask=offs < n)
