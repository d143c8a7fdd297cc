"""The sparse operators' rows: the scores with the gaps that cannot matter capped, so that no number is large.

Both quadratic problems (:mod:`.sparse_soft_topk`, :mod:`.sorted_sparse_soft_topk`) depend on a row only through
the differences of its scores in units of ``lambda``, ``x = s / lambda``, and on those differences only up to a
few units: beyond that the solution is the same whatever the gap. So each row is mapped to the row with the
smallest numbers that has the same solution, and the solvers never see a large number (the scores divided by
lambda first, 1e7 over 1 in float32 had no digits left below 1, and 1e20 over 0.1 left the sorted solver's line
search comparing objectives of 1e21 whose differences were below their rounding):

* unsorted: the threshold ``tau`` lies in ``[x_(k+1) - 1, x_(k)]`` (below it the k + 1 best would all weigh 1,
  above it fewer than k entries would weigh anything), so entries above ``x_(k) + 1`` weigh 1 and entries below
  ``x_(k+1) - 1`` weigh 0 whatever ``tau`` is: they are clamped there. Where ``x_(k) - x_(k+1) >= 1`` the
  solution is the hard top-k (``tau`` anywhere in ``[x_(k+1), x_(k) - 1]``), so that gap is capped at 2. The
  row becomes ``clamp((s - s_(k)) / lambda, -gap - 1, 1)``, in ``[-3, 1]``: the difference is taken before the
  division, correctly rounded relative to itself (exact where the two scores are within a factor of 2);
* sorted: if two consecutive sorted scores ``x_(j) > x_(j+1)`` (``j <= k``) are more than 2 apart, the plan
  is block diagonal (the j best on the ranks ``0..j-1``, the others on the ranks ``j..k``: moving mass
  ``delta`` across the gap in both directions gains at least ``delta (gap - 2)``), and each block's plan is
  unchanged when the block is shifted (its anchors' masses are fixed); entries more than 2 below ``x_(k+1)``
  are on the rest anchor alone (the same exchange). So the gaps between the ``k + 1`` best are closed to
  :data:`SORTED_GAP_CAP` and the entries below ``x_(k+1)`` are clamped that far below it: every position is
  within ``(k + 2) SORTED_GAP_CAP`` of 0. The positions are float64 from differences of scores (exact in float64
  for float32 scores), so that those that share ranks keep their exact relative positions whatever the
  magnitude of the scores (a constant per block in the scores' units would be rounded to their resolution).

The map leaves every entry that can carry weight at its exact position relative to the others: the solutions, and
their derivatives (``1 / lambda`` times those in ``x``), are those of the original rows.
"""

import torch
from torch import Tensor

from ._common import PreparedScores, checked_rows, hard_topk_indices, unchecked_rows

#: the sorted rows' largest gap, in units of lambda: anything above 2 leaves the plan unchanged (module docstring);
#: 4 keeps the entries below the window two units of margin from the solver's rest-anchor test
SORTED_GAP_CAP = 4.0
#: the unsorted rows' largest gap between the k-th and (k+1)-th best: any gap >= 1 gives the hard top-k
UNSORTED_GAP_CAP = 2.0


def sparse_rows(scores: Tensor, k: int, dim: int, largest: bool, regularization: float, mask, *,
                sorted_ranks: bool, checks: bool = True) -> PreparedScores:
    """The rows of ``scores`` along ``dim``, oriented (largest first), in units of ``regularization``, capped.

    Args:
        scores, k, dim, largest, regularization, mask: as the operators'.
        sorted_ranks: the sorted problem's map (False: the unsorted one's; module docstring).
        checks: check the data (NaN, infinities, valid counts: one host read); False: no host synchronisation.

    Returns:
        :class:`PreparedScores` with ``z`` ``(rows, n)`` the mapped positions in units of lambda (0 where
        excluded; the working dtype unsorted, float64 sorted), ``eps`` all 1 in that dtype, ``top``
        ``(rows, min(k + 1, n))`` the positions of the best entries (decreasing; ``top[:, k]`` of a row with k
        valid entries is meaningless) and ``top_index`` theirs.

    Raises:
        ValueError: as :func:`~fairseq_softtopk.ops._common.prepare_scores` with ``checks``.
    """
    if checks:
        x, valid, n_valid, all_valid = checked_rows(scores, k, dim, largest, mask)
    else:
        (x, valid), all_valid = unchecked_rows(scores, dim, largest, mask), False
        n_valid = valid.sum(-1)
    sign = 1.0 if largest else -1.0
    s = x if largest else -x
    n = s.shape[-1]
    width = min(k + 1, n)
    if all_valid:
        top, top_index = s.topk(width, dim=-1, sorted=True)
    else:
        top_index = hard_topk_indices(s, width, valid, largest=True)
        # a row's entries past its valid count are -inf: no gap to them is finite
        counted = torch.arange(width, device=s.device) < n_valid.unsqueeze(-1)
        top = torch.where(counted, s.gather(-1, top_index), -torch.inf)
    order = s  # the window of the sorted solver: by the scores, not among the clamped positions' ties
    if regularization > torch.finfo(s.dtype).max / 4:
        # a difference of scores that overflows could still be a few lambdas: scores and lambda divided by 4 (exact)
        s, top, regularization = s / 4, top / 4, regularization / 4
    if sorted_ranks:
        z, top = _sorted_positions(s, top, top_index, regularization)
    else:
        z, top = _unsorted_positions(s, top, k, regularization)
    if not all_valid:
        z = torch.where(valid, z, torch.zeros((), dtype=z.dtype, device=z.device))
    ones = torch.ones(s.shape[0], 1, dtype=z.dtype, device=s.device)  # the positions are in units of lambda
    return PreparedScores(z=z, valid=valid, n_valid=n_valid.to(z.dtype), eps=ones, sign=sign, top=top,
                          top_index=top_index, all_valid=all_valid, order=order)


def in_units_(difference: Tensor, regularization: float) -> Tensor:
    """``difference / regularization`` in ``difference``'s dtype, in place (``difference`` is a temporary), also
    where ``regularization`` is not a normal number of that dtype (divided in float64 then: a float32 ``1e-40``
    would lose its digits or be 0)."""
    info = torch.finfo(difference.dtype)
    if info.tiny <= regularization <= info.max:
        return difference.div_(regularization)
    return (difference.double() / regularization).to(difference.dtype)


def _unsorted_positions(s: Tensor, top: Tensor, k: int, regularization: float):
    """``(z, top)``: ``clamp((s - s_(k)) / lambda, -gap - 1, 1)`` with ``gap = min((s_(k) - s_(k+1)) / lambda, 2)``,
    and the positions of the best ``k + 1`` (the last one ``-gap``)."""
    kth = top[:, k - 1:k]
    if top.shape[1] > k:
        gap = in_units_(kth - top[:, k:], regularization).clamp_max_(UNSORTED_GAP_CAP)  # inf (no k+1-th): the cap
    else:
        gap = torch.full_like(kth, UNSORTED_GAP_CAP)
    z = in_units_(s - kth, regularization).clamp_(min=-gap - 1.0, max=torch.ones_like(gap))
    top = torch.cat([in_units_(top[:, :k] - kth, regularization).clamp_max_(1.0), -gap], dim=-1)
    return z, top


def _sorted_positions(s: Tensor, top: Tensor, top_index: Tensor, regularization: float):
    """``(z, top)`` float64: the k + 1 best at their positions with each gap capped at :data:`SORTED_GAP_CAP`, the
    others at ``(k+1)-th position - min((s_(k+1) - s) / lambda, cap)``, centred between the first and the last of
    the k + 1 (the entropic operators' centring: positions near the rank boundaries keep their digits)."""
    wide = top.double()  # the gaps between the k + 1 best: exact in float64 for float32 scores
    gaps = (wide[:, :-1] - wide[:, 1:]) / regularization
    gaps = torch.where(torch.isfinite(wide[:, 1:]), gaps.clamp_max(SORTED_GAP_CAP), SORTED_GAP_CAP)
    positions = torch.cat([wide.new_zeros(wide.shape[0], 1), -gaps.cumsum(-1)], dim=-1)
    positions = positions - 0.5 * positions[:, -1:]
    # the others' differences to the (k+1)-th best written straight into the float64 rows, then in place: one new
    # (rows, n) tensor (fresh ones cost more than this arithmetic)
    z = torch.sub(top[:, -1:], s, out=torch.empty(s.shape, dtype=torch.float64, device=s.device))
    z.div_(regularization).clamp_max_(SORTED_GAP_CAP).neg_().add_(positions[:, -1:])
    return z.scatter_(-1, top_index, positions), positions
