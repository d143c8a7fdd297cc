"""Euclidean projections by sorting: onto the probability simplex and onto the capped simplex.

Both are exact (a sort and a threshold found in closed form, no iteration) and batched over
leading dimensions; they are the building blocks of the quadratically regularised top-k operators
(:mod:`.sparse_soft_topk`, :mod:`.sorted_sparse_soft_topk`), whose outputs have exact zeros.

* :func:`project_to_simplex`: ``argmin_{p >= 0, sum p = 1} ||p - v||^2 = max(v - theta, 0)``.
* :func:`capped_simplex_threshold`: ``tau`` with ``sum_i clip(x_i - tau, 0, 1) = k``, so that
  ``clip(x - tau, 0, 1)`` is the projection of ``x`` onto ``{0 <= y <= 1, sum y = k}``.
"""

from typing import Tuple

import torch
from torch import Tensor


def project_to_simplex(v: Tensor) -> Tuple[Tensor, Tensor]:
    """Projects each row of ``v`` onto the probability simplex.

    Args:
        v: ``(..., m)`` finite values.
    Returns:
        ``(p, theta)``: ``p = max(v - theta, 0)`` of ``v``'s shape (rows sum to 1, exact zeros
        outside the support) and ``theta`` ``(..., 1)``.
    """
    m = v.shape[-1]
    u = v.sort(dim=-1, descending=True).values
    cumulative = u.cumsum(-1) - 1.0
    j = torch.arange(1, m + 1, dtype=v.dtype, device=v.device)
    # the support is the longest prefix of the sorted values with u_j > (sum_{l <= j} u_l - 1) / j;
    # that condition holds exactly on a prefix, so counting it gives the prefix's length
    support = (u * j > cumulative).sum(-1, keepdim=True).clamp_min(1)
    theta = cumulative.gather(-1, support - 1) / support.to(v.dtype)
    return (v - theta).clamp_min(0.0), theta


def capped_simplex_threshold(x: Tensor, k: Tensor) -> Tensor:
    """``tau`` with ``sum_i clip(x_i - tau, 0, 1) = k`` for each row, exact up to rounding.

    ``g(t) = sum_i clip(x_i - t, 0, 1)`` is continuous, piecewise linear and non-increasing, with
    breakpoints at ``x_i`` and ``x_i - 1``. ``g`` is evaluated at all ``2n`` breakpoints at once
    (``x`` sorted, prefix sums from the top, binary searches: O(n log n), no iteration); on the
    segment where it crosses ``k`` the sets ``{x_i >= t + 1}`` (weight 1) and ``{t < x_i < t + 1}``
    (weight ``x_i - t``) are fixed, and ``tau`` solves the linear equation. That solve and one
    correction step use direct sums of terms in ``[-1, 2]``, not the prefix sums, so that ``tau``
    keeps full precision at any magnitude of ``x`` and any ``n`` (the prefix sums only pick the segment).
    Where ``g`` is flat at ``k`` (no entry strictly inside), any ``tau`` of the segment gives the
    same ``clip``; its middle is taken.

    Args:
        x: ``(rows, n)``; excluded entries ``-inf`` (they get weight 0).
        k: ``(rows, 1)`` target sums, ``0 < k <= `` finite entries of the row.
    Returns:
        ``(rows, 1)`` thresholds (finite).
    """
    rows, n = x.shape
    descending = x.sort(dim=-1, descending=True).values  # -inf entries last
    finite = torch.isfinite(descending)
    top = descending[:, :1]
    lowest = torch.where(finite, descending, torch.inf).amin(-1, keepdim=True)
    # Every threshold looked at is >= lowest - 1: excluded entries put at lowest - 2 are below all of them
    # (weight 0), and their breakpoints are replaced by lowest - 1, one of the finite entries'.
    descending = torch.where(finite, descending, lowest - 2.0)
    negated = (-descending).contiguous()  # ascending, for searchsorted (which copies a strided boundary)
    # prefix sums of x - top from the top: the segment's sum only involves the entries above it
    prefix = torch.cat([x.new_zeros(rows, 1), torch.where(finite, descending - top, 0.0).cumsum(-1)], dim=-1)

    def g(t: Tensor) -> Tensor:
        """``sum_i clip(x_i - t, 0, 1)`` for thresholds ``t`` ``(rows, q)``, from the prefix sums."""
        full = torch.searchsorted(negated, -(t + 1.0), side="right")  # x >= t + 1
        above = torch.searchsorted(negated, -t, side="left")  # x > t
        inside = (above - full).to(x.dtype)
        inside_sum = prefix.gather(-1, above) - prefix.gather(-1, full) + (top - t) * inside
        return full.to(x.dtype) + inside_sum

    finite_values = torch.where(finite, descending, lowest)
    breakpoints = torch.cat([finite_values - 1.0, finite_values], dim=-1).sort(dim=-1).values  # (rows, 2n)
    # the last breakpoint with g >= k: g at the first one (min x - 1) is the finite count >= k
    last = ((g(breakpoints) >= k).sum(-1, keepdim=True) - 1).clamp(0, 2 * n - 2)
    t_low, t_high = breakpoints.gather(-1, last), breakpoints.gather(-1, last + 1)
    middle = 0.5 * (t_low + t_high)
    tau = _linear_piece_root(x, k, middle)
    tau = torch.where(torch.isfinite(tau), tau.clamp(t_low, t_high), middle)
    corrected = _linear_piece_root(x, k, tau)  # exact where rounding put tau on a neighbouring piece
    return torch.where(torch.isfinite(corrected), corrected, tau)


def _linear_piece_root(x: Tensor, k: Tensor, t: Tensor) -> Tensor:
    """The root of ``g`` continued linearly from ``t``: ``t + (g(t) - k) / #{t < x < t + 1}``, by
    direct sums (``inf``/``nan`` where no entry is inside: ``g`` is flat there)."""
    shifted = x - t
    inside = ((shifted > 0) & (shifted < 1)).to(x.dtype).sum(-1, keepdim=True)
    excess = shifted.clamp(0.0, 1.0).sum(-1, keepdim=True) - k
    return t + excess / inside


def capped_cubic_threshold(x: Tensor, k: Tensor, newton_steps: int = 40) -> Tensor:
    """``tau`` with ``sum_i clip(x_i - tau, 0, 1) ** 3 = k`` for each row (the top-k mask of the p = 4/3 regulariser).

    ``h(t) = sum_i clip(x_i - t, 0, 1) ** 3`` is continuous and decreasing, with the breakpoints of the p = 2 case
    (``x_i`` and ``x_i - 1``). The segment that crosses ``k`` is found by bisection over the sorted breakpoints,
    with ``h`` summed directly at each (O(n log n), no prefix sums of cubes, which would cancel); on it the sets
    are fixed and, with ``u = t - t_low`` and ``d_i = x_i - t_low`` for the entries inside,
    ``h = full + S3 - 3 u S2 + 3 u^2 S1 - m u^3`` (``S_j = sum d_i^j``): a cubic, decreasing and convex in ``u``, whose
    root Newton's method approaches from ``u = 0`` without overshooting (``newton_steps`` fixed: no host read).

    Args:
        x: ``(rows, n)``; excluded entries ``-inf``.
        k: ``(rows, 1)`` target sums, ``0 < k <=`` finite entries of the row.
    Returns:
        ``(rows, 1)`` thresholds.
    """
    rows, n = x.shape
    finite = torch.isfinite(x)
    lowest = torch.where(finite, x, torch.inf).amin(-1, keepdim=True)
    values = torch.where(finite, x, lowest)
    breakpoints = torch.cat([values - 1.0, values], dim=-1).sort(dim=-1).values  # (rows, 2n), ascending

    def h(t: Tensor) -> Tensor:
        return ((x - t).clamp(0.0, 1.0) ** 3).sum(-1, keepdim=True)

    # invariant: h(breakpoints[lo]) >= k > h(breakpoints[hi]); h(min x - 1) is the finite count >= k
    lo = torch.zeros(rows, 1, dtype=torch.long, device=x.device)
    hi = torch.full((rows, 1), 2 * n - 1, dtype=torch.long, device=x.device)
    for _ in range(max(1, (2 * n).bit_length())):
        mid = (lo + hi) // 2
        above = h(breakpoints.gather(-1, mid)) >= k
        lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
    t_low, t_high = breakpoints.gather(-1, lo), breakpoints.gather(-1, hi)
    middle = 0.5 * (t_low + t_high)
    d = x - t_low
    inside = ((x - middle > 0) & (x - middle < 1)).to(x.dtype)
    full = ((x - middle) >= 1).to(x.dtype).sum(-1, keepdim=True)
    d = torch.where(inside > 0, d, 0.0)
    s1, s2, s3 = (d.sum(-1, keepdim=True), (d * d).sum(-1, keepdim=True), (d ** 3).sum(-1, keepdim=True))
    m = inside.sum(-1, keepdim=True)
    u = torch.zeros_like(t_low)
    for _ in range(newton_steps):
        value = full + s3 - 3 * u * s2 + 3 * u * u * s1 - m * u ** 3 - k
        slope = -3 * (s2 - 2 * u * s1 + m * u * u)  # -3 sum (d_i - u)^2 < 0 on the segment
        u = torch.where(slope < 0, u - value / torch.where(slope < 0, slope, -1.0), u)
    width = t_high - t_low
    return torch.where(m > 0, t_low + u.clamp(torch.zeros_like(width), width), middle)
