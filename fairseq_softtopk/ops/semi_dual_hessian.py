"""The k x k Hessian of the sorted operator's semi-dual and its solves (:mod:`.semi_dual_newton`).

``K = sum_i (diag(P_i) - P_i P_i^T)`` over the k rank anchors serves twice: Newton steps in the
forward solve and the implicit differentiation of the backward pass (:mod:`.sorted_soft_topk`).
Dense for small k; from k = :data:`_BANDED_MIN_K` on, formed from blocks of elements
(:func:`banded_rank_gram`) and solved by block elimination (:func:`block_tridiagonal_solve`),
since each element's mass sits on a few neighbouring ranks and ``K`` is banded.
"""

from typing import Optional

import torch
from torch import Tensor

# from this k on, the Hessian is formed (banded_rank_gram) and solved (block_tridiagonal_solve) in blocks
_BANDED_MIN_K = 200
_GRAM_MAX_BLOCKS = 64
_GRAM_MIN_BLOCK = 64  # elements: smaller blocks cost more in dispatch than they save


def anchor_hessian(P: Tensor, k: int, no_rest: Optional[Tensor], blocked: bool = True) -> Tensor:
    """``K = sum_i (diag(P_i) - P_i P_i^T)`` over the first k anchors, in float64.

    With ``G = P P^T`` (Gram matrix over all k+1 anchors), the off-diagonal entries are
    ``-G_rs`` and, because every row of the plan sums to 1, the diagonal
    ``sum_i P_ir (1 - P_ir)`` equals ``sum_{s != r} G_rs``: a sum of positive terms, which
    keeps its precision when the plan is nearly hard (``1 - P_ir`` would cancel). Rows
    without a rest anchor (``n_valid == k``) have the constant vector in the null space of
    ``K``; ``1 1^T`` is added there, which changes no solution of a consistent system (their
    right-hand sides sum to 0).

    Args:
        P: ``(rows, k + 1, n)`` plan in count units, anchors first (columns sum to 1 or 0).
        no_rest: ``(rows,)`` bool, or None where every row has a rest anchor.
        blocked: allow :func:`banded_rank_gram` (from ``k >=`` :data:`_BANDED_MIN_K`; it reads
            its blocks' rank ranges on the host); False keeps the dense product (the
            fixed-iteration solver).
    Returns:
        ``(rows, k, k)`` float64.
    """
    if blocked and k >= _BANDED_MIN_K:
        # the rank-rank block from blocks of elements (O(n * band^2)), the rank-rest column directly (O(n * k))
        rest = torch.bmm(P[:, :k], P[:, k:].transpose(1, 2)).double()
        off = torch.cat([banded_rank_gram(P, k), rest], dim=-1)
    else:
        # the k rank rows of the Gram matrix only: (rows, k, k+1), a fresh tensor (modified in place)
        off = torch.bmm(P[:, :k], P.transpose(1, 2)).double()
    off.diagonal(dim1=-2, dim2=-1).zero_()
    K = -off[:, :, :k]
    K.diagonal(dim1=-2, dim2=-1).copy_(off.sum(-1))
    return K if no_rest is None else K + no_rest.double()[:, None, None]


def banded_rank_gram(P: Tensor, k: int, max_blocks: int = _GRAM_MAX_BLOCKS) -> Tensor:
    """``G_rs = sum_i P_ri P_si`` over the ranks ``r, s < k``, ``(rows, k, k)`` float64, in
    ``O(n * w^2)`` for plans whose columns are concentrated on ``w`` neighbouring ranks.

    An element's column of the plan is a softmax over ranks of ``z_i y_r / eps + g_r``, which is
    unimodal in ``r`` near the optimum (``g`` concave): each element puts its mass on a few
    neighbouring ranks, and ``G`` is banded. The dense product costs ``n * k^2`` per row; here
    the elements are ordered by the ranks they reach (entries above ``delta``, one ulp of the
    dtype over ``k + 1``) and cut into at most ``max_blocks`` blocks, and each block adds its
    product over the union of its elements' rank ranges only. Entries left out are below
    ``delta`` by construction, so each ``G_rs`` changes by at most ``delta`` times a column sum
    (at most 1 in count units): below the rounding of ``G``'s largest entries. Correct for any
    plan (only the speed depends on the band); one host synchronisation (the blocks' ranges).

    Args:
        P: ``(rows, k + 1, n)`` plan, anchors first (the rest anchor last).
    """
    rows, _, n = P.shape
    delta = torch.finfo(P.dtype).eps / (k + 1)
    reached = (P[:, :k] > delta).to(torch.uint8)  # (rows, k, n)
    any_reached = reached.amax(1).bool()  # (rows, n)
    first = reached.argmax(1)  # the first maximum: the lowest rank reached
    last = (k - 1) - reached.flip(1).argmax(1)
    # order the elements by the middle of their rank range; elements reaching no rank go last
    order = torch.where(any_reached, first + last, 2 * k).argsort(-1)
    count = int(any_reached.sum(-1).max())
    G = torch.zeros(rows, k, k, dtype=torch.float64, device=P.device)
    if count == 0:
        return G
    block = max(_GRAM_MIN_BLOCK, -(-count // max_blocks))
    n_blocks = -(-count // block)
    order = order[:, : n_blocks * block] if n_blocks * block <= n else torch.nn.functional.pad(
        order, (0, n_blocks * block - n), value=0)
    in_range = torch.arange(n_blocks * block, device=P.device) < n  # padding repeats element 0: masked out
    reached_o = any_reached.gather(1, order) & in_range
    lo = torch.where(reached_o, first.gather(1, order), k).view(rows, n_blocks, block).amin(-1).amin(0)
    hi = torch.where(reached_o, last.gather(1, order), -1).view(rows, n_blocks, block).amax(-1).amax(0) + 1
    for b, (low, high) in enumerate(zip(lo.tolist(), hi.tolist())):
        if high <= low:
            continue
        index = order[:, b * block:(b + 1) * block]
        Pb = P[:, low:high].gather(2, index.unsqueeze(1).expand(-1, high - low, -1))
        if b * block + block > n:  # the padded tail: zero the repeated columns
            Pb = Pb * in_range[b * block:(b + 1) * block].to(P.dtype)
        G[:, low:high, low:high] += torch.bmm(Pb, Pb.transpose(1, 2)).double()
    return G


def solve_ridged(K: Tensor, rhs: Tensor, precision: torch.dtype, blocked: bool = True) -> Tensor:
    """Batched symmetric solve ``K x = rhs`` in float64, with a ridge at the precision of ``K`` (added in place).

    When the ranks split into groups whose boundaries are far apart (relative to epsilon),
    ``K`` is block diagonal up to tiny couplings and nearly singular along each block's
    common shift. Those directions do not change the plan (a common shift of one block's
    potentials moves no mass); the ridge, ten ulps of the dtype ``K`` was computed in
    relative to its largest diagonal entry, keeps rounding noise from being amplified along them.

    Args:
        K: ``(rows, k, k)``; rhs: ``(rows, k)``; precision: dtype the plan was computed in.
        blocked: from ``k >=`` :data:`_BANDED_MIN_K`, solve a banded ``K`` by
            :func:`block_tridiagonal_solve` (its band is read on the host); False: dense.
    """
    diagonal = K.diagonal(dim1=-2, dim2=-1)
    # K's diagonal is a sum of non-negative terms
    ridge = diagonal.amax(-1, keepdim=True).mul_(10 * torch.finfo(precision).eps).clamp_min_(1e-300)
    diagonal.add_(ridge)  # K is a temporary of the callers: modified in place
    if blocked and K.shape[-1] >= _BANDED_MIN_K:
        width = _band_width(K)
        if 2 * width <= K.shape[-1]:
            return block_tridiagonal_solve(K, rhs, width)
    # solve_ex skips the error check (a host sync); a K still singular gives inf/nan, which the callers zero
    return torch.linalg.solve_ex(K, rhs.unsqueeze(-1))[0].squeeze(-1)


def _band_width(K: Tensor) -> int:
    """The smallest ``m`` with ``K[:, r, s] == 0`` wherever ``|r - s| >= m`` (over the batch; one host read)."""
    k = K.shape[-1]
    nonzero = (K != 0).any(0)  # (k, k)
    offsets = torch.arange(k, device=K.device)
    distance = (offsets.unsqueeze(0) - offsets.unsqueeze(1)).abs()
    return int(torch.where(nonzero, distance, 0).max()) + 1


def block_tridiagonal_solve(K: Tensor, rhs: Tensor, width: int) -> Tensor:
    """``K x = rhs`` for symmetric positive definite ``K`` ``(rows, k, k)`` whose entries vanish
    ``width`` or more off the diagonal, in ``O(k * width^2)`` instead of ``O(k^3)``.

    Cut into blocks of ``width`` ranks, ``K`` is block tridiagonal (diagonal blocks ``D_i``,
    couplings ``U_i = K[i, i + 1]``); block elimination (Thomas' algorithm on blocks) goes down
    the Schur complements ``S_{i+1} = D_{i+1} - U_i^T S_i^{-1} U_i`` (positive definite like
    ``K``, so the eliminations are stable) and back up. The Hessian of the sorted operator is
    banded once k is large (:func:`banded_rank_gram`): its k x k solve was the last cost above
    linear in ``n * k``.

    Args:
        rhs: ``(rows, k)``. Returns: ``(rows, k)``.
    """
    k = K.shape[-1]
    cuts = list(range(0, k, width)) + [k]
    blocks = list(zip(cuts[:-1], cuts[1:]))
    X, z = [], []  # X_i = S_i^{-1} U_i and z_i = S_i^{-1} y_i, y the forward-eliminated rhs
    for i, (lo, hi) in enumerate(blocks):
        S = K[:, lo:hi, lo:hi]
        y = rhs[:, lo:hi].unsqueeze(-1)
        if i:
            U = K[:, blocks[i - 1][0]:blocks[i - 1][1], lo:hi]
            S = S - U.transpose(1, 2) @ X[-1]
            y = y - U.transpose(1, 2) @ z[-1]  # X_{i-1}^T y_{i-1} = U^T z_{i-1} (S symmetric)
        right = y if i + 1 == len(blocks) else torch.cat([K[:, lo:hi, hi:blocks[i + 1][1]], y], dim=-1)
        # solve_ex: no error check (a host read); a singular block gives inf/nan, which the callers zero
        solved = torch.linalg.solve_ex(S, right)[0]
        X.append(solved[..., :-1])
        z.append(solved[..., -1:])
    x = [None] * len(blocks)
    x[-1] = z[-1]
    for i in range(len(blocks) - 2, -1, -1):  # x_i = S_i^{-1} (y_i - U_i x_{i+1}) = z_i - X_i x_{i+1}
        x[i] = z[i] - X[i] @ x[i + 1]
    return torch.cat(x, dim=1).squeeze(-1)
