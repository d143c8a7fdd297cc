"""The solver of sorted SOFT top-k: damped Newton on the semi-dual of its transport problem.

The problem is the canonical one of :mod:`._common` with ``A = k``: entropic OT between the
``n`` valid prepared scores ``z`` of a row (mass 1 each, in count units) and ``k + 1`` anchors
``y = k, k-1, ..., 0`` with the linear cost ``-z_i * y_r`` at temperature ``eps`` (per row).
Anchor ``r < k`` must receive one element (rank r, r = 0 the best) and anchor ``k`` (the rest)
the other ``n - k``. The plan's rows are softmaxes over anchors,

    P_ir = softmax_r(z_i * y_r / eps + g_r),

and the anchor potentials ``g`` (``g_k = 0``) maximise the concave semi-dual

    F(g) = sum_{r<k} g_r - sum_i logsumexp_r(z_i * y_r / eps + g_r),

whose gradient is the marginal violation ``1 - sum_i P_ir`` and whose negative Hessian is
``K = diag(sum_i P_i) - sum_i P_i P_i^T`` (k x k, :func:`anchor_hessian`). :func:`newton_solve`
returns the plan ``(rows, k + 1, n)``, anchors first, once every anchor's marginal is within a
relative ``tol`` (:class:`SolverInfo`); row marginals are exact by construction. How:

* start from potentials whose rank boundaries sit midway between consecutive hard-sorted
  scores (:func:`_hard_start`) or, for large smooth rows, from the solution on a histogram of
  the scores (:func:`_binned_start`, :func:`_histogram_newton`);
* Sinkhorn-like rescaling while it pays off (:func:`_rescale`: far from the optimum the
  semi-dual is exponential), then Newton steps with a backtracking line search
  (:func:`_maximise`): a few iterations where Sinkhorn needs hundreds at small epsilon;
* when most elements lie far below the best ``k + 1``, on the window of the others only
  (:func:`~fairseq_softtopk.ops.candidate_window`), confirmed afterwards from the solution.

:func:`anchors`, :func:`anchor_hessian` and :func:`solve_ridged` also serve the operator's
backward pass (implicit differentiation of ``grad F(g) = 0``, in :mod:`.sorted_soft_topk`).
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ._common import PreparedScores, SolverInfo, hard_topk_indices
from .candidate_window import candidate_window

_ARMIJO = 1e-4
_MAX_BACKTRACK = 12
_BINS = 1024
_MAX_BIN_ITER = 8  # steps on the histogram (4-7 from the hard start in bench_ops' cases)
_RESCALE_STEPS = 4
_RESCALE_GAIN = 8.0  # rescaling continues while each step divides the marginal error by this much
_LOG2E, _LN2 = 1.0 / math.log(2.0), math.log(2.0)
_WINDOW_GAP = 2.0
# from this k on, the Hessian is formed (banded_rank_gram) and solved (block_tridiagonal_solve) in blocks
_BANDED_MIN_K = 200
_GRAM_MAX_BLOCKS = 64
_GRAM_MIN_BLOCK = 64  # elements: smaller blocks cost more in dispatch than they save  # first guess of the rank/rest boundary's distance below the (k+1)-th best, in epsilons


def anchors(k: int, like: Tensor) -> Tensor:
    """``(k + 1,)`` anchors ``k, k-1, ..., 0`` in ``like``'s dtype and device."""
    return torch.arange(k, -1, -1, dtype=like.dtype, device=like.device)


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


def _subnormal_cut(dtype: torch.dtype, k: int) -> float:
    """Base-2 exponent below which the product of two plan entries (at most ``k + 1`` times smaller
    after normalisation) could be subnormal in ``dtype``: about -60 in float32, -508 in float64."""
    min_exponent = math.log2(torch.finfo(dtype).tiny)  # -126, -1022
    return 0.5 * min_exponent + math.log2(k + 1) + 1.0


@dataclass
class _Problem:
    """The rows the solver works on: the fields of :class:`PreparedScores` it needs, and k.

    A window of candidates is a problem of its own (its ``z`` gathered from the full one's).

    Attributes:
        z: ``(rows, n)`` scores, 0 where excluded; valid: ``(rows, n)`` bool.
        n_valid: ``(rows,)`` number of valid entries, in ``z``'s dtype.
        eps: ``(rows, 1)`` temperature; k: number of ranks.
        top: ``(rows, min(k + 1, n))`` the largest valid ``z``, decreasing.
        top_index: positions of ``top`` in ``z``, None where not known (found again where needed).
        all_valid: ``valid`` is known to be all True (None is passed for it where it matters).
    """

    z: Tensor
    valid: Tensor
    n_valid: Tensor
    eps: Tensor
    top: Tensor
    k: int
    top_index: Optional[Tensor] = None
    all_valid: bool = False

    @classmethod
    def prepared(cls, prep: PreparedScores, k: int) -> "_Problem":
        return cls(prep.z, prep.valid, prep.n_valid, prep.eps, prep.top, k, prep.top_index, prep.all_valid)

    @property
    def no_rest(self) -> Tensor:
        """``(rows,)`` bool: rows with exactly k valid entries, which have no rest anchor."""
        return self.n_valid == self.k


class _Point(NamedTuple):
    """The semi-dual at potentials ``g`` (rows, k+1): plan ``P`` (rows, k+1, n), anchor ``counts``
    (rows, k+1) float64, marginal ``err`` (rows,), and the softmax's ``total`` and ``top``
    (rows, 1, n, log2 units) from which :meth:`_SemiDual.objective` gets ``F``."""

    g: Tensor
    P: Tensor
    counts: Tensor
    err: Tensor
    total: Tensor
    top: Tensor


class _SemiDual:
    """The semi-dual objective of one batch of rows, evaluated at anchor potentials ``g``.

    Tensors are laid out anchors first, ``(rows, k+1, n)``, so that the softmax over anchors
    is elementwise across ``k+1`` contiguous vectors and the sums over elements are contiguous.
    """

    def __init__(self, problem: _Problem, tol: float, fixed: bool = False):
        z, n_valid, k = problem.z, problem.n_valid, problem.k
        self.fixed = fixed  # no host synchronisation (fixed_newton_solve)
        self.k = k
        self.dtype = z.dtype
        self.cut = _subnormal_cut(z.dtype, k)
        self.valid = None if problem.all_valid else problem.valid.unsqueeze(1).to(z.dtype)
        # Logits are kept in base 2 (exp2 is several times faster than exp on CPUs, as accurate)
        # and formed by one rank-1 baddbmm per evaluation, not from a stored (rows, k+1, n)
        # product: one large allocation less (each costs page faults on CPUs). They are formed in
        # float64 where the dtype's rounding would decide the marginals (:func:`_logit_dtype`).
        # (without reading the data, float64 wherever the dtype's rounding could matter)
        logit_dtype = torch.float64 if fixed else _logit_dtype(problem, tol)
        self.z = z.unsqueeze(1).to(logit_dtype)  # (rows, 1, n)
        self.y_eps2 = (anchors(k, self.z) * (_LOG2E / problem.eps.to(logit_dtype))).unsqueeze(-1)  # (rows, k+1, 1)
        self.no_rest = problem.no_rest
        # Per-evaluation work on (rows, k+1) tensors is a handful of small ops: constants made here.
        self.rest_bias = None
        if fixed or bool(self.no_rest.any()):  # rows with exactly k entries have no rest anchor
            self.rest_bias = torch.zeros(z.shape[0], k + 1, dtype=torch.float64, device=z.device)
            self.rest_bias[:, k] = torch.where(self.no_rest, -math.inf, 0.0)
        self.target = torch.ones(z.shape[0], k + 1, dtype=torch.float64, device=z.device)
        self.target[:, k] = (n_valid - k).double()
        self.inv_target = 1.0 / self.target.clamp_min(1.0)
        self.inv_target[:, k] = torch.where(self.no_rest, 0.0, self.inv_target[:, k])  # no rest: no error
        self.neg_scaled_target = -self.target * self.inv_target  # err = |counts * inv_target - this|
    def evaluate(self, g: Tensor) -> "_Point":
        """The plan, its anchor counts and marginal error at ``g``; the objective is left to :meth:`objective`."""
        shift = (g if self.rest_bias is None else g + self.rest_bias) * _LOG2E
        logits = torch.baddbmm(shift.to(self.z.dtype).unsqueeze(-1), self.y_eps2, self.z)  # log2 units
        # One exp2 pass gives the softmax, and (kept) the log-normaliser; in place to save memory.
        top = logits.amax(1, keepdim=True)
        # Plan entries are kept at or above 2**cut / (k+1), where their products are still normal
        # numbers (subnormal products make every matrix product over the plan 2-3x slower on
        # CPUs): a change of at most n * 2**cut (1e-18 in float32).
        P = logits.sub_(top).to(self.dtype).clamp_min_(self.cut).exp2_()  # float64 logits: cast once small
        total = P.sum(1, keepdim=True)
        P.div_(total)
        if self.valid is not None:
            P.mul_(self.valid)
        counts = P.sum(-1).double()  # summing in float64 would copy all of P
        err = torch.addcmul(self.neg_scaled_target, counts, self.inv_target).abs_().amax(-1)
        return _Point(g, P, counts, err, total, top)

    def objective(self, point: "_Point") -> Tensor:
        """``F(g)`` (rows,) at an evaluated point: only line searches that backtrack need it."""
        lse = point.total.log2().add_(point.top)  # (rows, 1, n), log2 units
        if self.valid is not None:
            lse.mul_(self.valid)
        # the k ranks' targets are 1
        return point.g[:, : self.k].sum(-1) - _LN2 * lse.sum((1, 2), dtype=torch.float64)

    def hessian(self, P: Tensor) -> Tensor:
        """:func:`anchor_hessian` of the plan returned by :meth:`evaluate`."""
        no_rest = None if self.rest_bias is None else self.no_rest  # None: every row has a rest anchor
        return anchor_hessian(P, self.k, no_rest, blocked=not self.fixed)


def _logit_dtype(problem: _Problem, tol: float) -> torch.dtype:
    """The dtype in which the plan's logits are formed: the problem's, or float64 where its rounding would
    keep the marginals from ``tol``.

    A logit ``z_i y_r / eps + g_r`` of magnitude ``L`` (log2 units) is rounded by about
    ``L * 2**-24`` in float32, a relative error of the plan entry; the logits of the elements
    that decide a rank are about ``k * max|z| / eps`` (``z`` is centred on the best ``k + 1``),
    and the large terms cancel only after rounding. At ``k = 100``, scores of unit spread and
    epsilon 0.1 that is an error floor of several 1e-5 (Newton then stalls above a 1e-5
    tolerance). float64 is taken where that estimate (with one ulp, ``finfo.eps``) exceeds
    ``tol / 2``; it costs one ``(rows, k + 1, n)`` float64 temporary per evaluation.
    """
    if problem.z.dtype == torch.float64 or problem.top.numel() == 0:
        return problem.z.dtype
    spread = float((problem.top.abs().amax(-1, keepdim=True) / problem.eps).max())
    rounding = problem.k * spread * _LOG2E * torch.finfo(problem.z.dtype).eps
    return torch.float64 if rounding > tol / 2 else problem.z.dtype


def _hard_start(top: Tensor, no_rest: Tensor, eps: Tensor, k: int) -> Tensor:
    """Potentials whose rank boundaries sit midway between consecutive hard-sorted scores.

    Args:
        top: ``(rows, min(k + 1, n))`` the largest valid scores, decreasing.
        no_rest: ``(rows,)`` rows with exactly k valid entries.
    Returns:
        ``(rows, k + 1)`` float64, ``g_k = 0``.
    """
    top = top.double()
    if top.shape[-1] == k:  # n == k
        top = torch.cat([top, top[:, -1:] - 1.0], dim=-1)
    top[:, k] = torch.where(no_rest, top[:, k - 1] - 1.0, top[:, k])
    thresholds = 0.5 * (top[:, :-1] + top[:, 1:])  # boundary between rank r and r+1
    g = torch.zeros(top.shape[0], k + 1, dtype=torch.float64, device=top.device)
    g[:, :k] = -thresholds.flip(-1).cumsum(-1).flip(-1) / eps.double()
    return g


def _merge(keep: Tensor, trial: _Point, current: _Point) -> _Point:
    """``trial`` with the ``keep`` rows (``(rows,)`` bool) of ``current`` copied over it, in place."""
    if bool(keep.any()):
        for new, old in zip(trial, current):
            new[keep] = old[keep]
    return trial


def _rescaling_step(target: Tensor, counts: Tensor, k: int, no_rest: Optional[Tensor] = None) -> Tensor:
    """``(rows, k)`` Sinkhorn-like step ``log(target_r / count_r)`` of the rank potentials.

    ``g_k`` stays 0 (the rest anchor's potential is fixed), so the step is taken relative to
    the rest anchor's own ratio, except in ``no_rest`` rows (``(rows,)`` bool, None: none).
    """
    log_ratio = (target / counts.clamp_min(1e-300)).log()
    rest_shift = log_ratio[:, k:] if no_rest is None else torch.where(no_rest, 0.0, log_ratio[:, k]).unsqueeze(-1)
    return (log_ratio[:, :k] - rest_shift).clamp_(-50.0, 50.0)


def _rescale(dual: _SemiDual, point: _Point, tol: float, max_steps: int) -> Tuple[_Point, int]:
    """Sinkhorn-like steps ``g_r += log(target_r / count_r)`` while they pay off.

    From the hard start at a large epsilon, an anchor can receive a hundred times its mass;
    Newton then only removes about one unit of ``log(count / target)`` per step (the
    semi-dual is exponential there), while one rescaling removes it all, and in smooth
    problems a second one often lands within 1e-4. Rows more than 100% off are rescaled,
    and go on while each step divides their marginal error by :data:`_RESCALE_GAIN` (at
    small epsilon Sinkhorn's linear rate is slow: Newton takes over). A step is kept for the
    rows whose error it lowers. At most ``max_steps`` steps (the solve's iteration budget);
    returns the point reached and the number of steps.
    """
    k, steps = dual.k, 0
    going = point.err > 1.0  # each row's course depends on that row alone
    for _ in range(min(_RESCALE_STEPS, max_steps)):
        if not bool(going.any()):
            break
        step = torch.where(going.unsqueeze(-1), _rescaling_step(dual.target, point.counts, k, dual.no_rest), 0.0)
        trial = dual.evaluate(point.g + torch.nn.functional.pad(step, (0, 1)))
        steps += 1
        better = going & (trial.err < point.err)
        going = better & (trial.err * _RESCALE_GAIN <= point.err) & (trial.err > tol)
        point = _merge(~better, trial, point)
    return point, steps


def _maximise(dual: _SemiDual, g: Tensor, tol: float, max_iter: int) -> Tuple[_Point, int]:
    """Damped Newton on the semi-dual from ``g`` (after :func:`_rescale`); returns the point reached
    and the number of iterations, rescaling steps included: at most ``max_iter`` of both together."""
    k = dual.k
    point, rescaled = _rescale(dual, dual.evaluate(g), tol, max_iter)
    n_iter, stalled = 0, 0
    for n_iter in range(1, max_iter - rescaled + 1):
        active = point.err > tol
        if stalled >= 3 or not bool(active.any()):
            n_iter -= 1
            break
        grad = (dual.target - point.counts)[:, :k]
        step = solve_ridged(dual.hessian(point.P), grad, point.P.dtype).nan_to_num_(0.0, 0.0, 0.0)
        step = torch.nn.functional.pad(step.mul_(active.unsqueeze(-1)), (0, 1))  # g_k stays 0
        alpha, F = None, None
        for _ in range(_MAX_BACKTRACK):
            trial = dual.evaluate(point.g + step if alpha is None else torch.addcmul(point.g, alpha, step))
            # A step that lowers the marginal error is accepted; otherwise Armijo on F decides
            # (computed only then: in float32, F's rounding can hide real progress near the optimum).
            ok = (trial.err < point.err) | ~active
            if bool(ok.all()):
                break
            if F is None:
                F, slope = dual.objective(point), (grad * step[:, :k]).sum(-1, keepdim=True)
                alpha = torch.ones_like(slope)  # (rows, 1)
            ok |= (dual.objective(trial) >= F + _ARMIJO * (alpha * slope).squeeze(-1))
            if bool(ok.all()):
                break
            alpha = torch.where(ok.unsqueeze(-1), alpha, 0.5 * alpha)
        # At the floating-point floor (float32 sums over large n), progress stops; give up then.
        stalled = 0 if bool((active & (trial.err < 0.99 * point.err)).any()) else stalled + 1
        point = _merge(~ok, trial, point)  # rows whose step never became acceptable keep their potentials
    return point, n_iter + rescaled


def _histogram_newton(z: Tensor, w: Tensor, n_valid: Tensor, eps: Tensor, k: int, g: Tensor, tol: float,
                      max_iter: int) -> Tensor:
    """Full Newton steps on weighted points (a histogram of the scores) from ``g``; returns the
    potentials with the smallest marginal error seen, ``(rows, k+1)``.

    For the warm start only: the problem that matters is solved afterwards by the safeguarded
    :func:`_maximise`, so a step that overshoots costs iterations there, never correctness.
    On a thousand float64 points the cost is the dispatch of small ops, not arithmetic, so
    this is :class:`_SemiDual` and :func:`_maximise` cut to about twenty ops a step: the
    softmax in one op, no line search, the Hessian's diagonal as counts minus the Gram
    diagonal (in float64 its cancellation is harmless for a warm start), and rows more than
    100% off take the Sinkhorn-like step of :func:`_rescale` instead of Newton's.

    Args:
        z, w: ``(rows, m)`` float64 points and their weights (bin counts).
        n_valid: ``(rows,)`` float64, every row ``> k`` (each has a rest anchor).
        eps: ``(rows, 1)`` float64.
        g: ``(rows, k + 1)`` float64 start, ``g_k = 0``.
    """
    y_eps = (anchors(k, z) / eps).unsqueeze(-1)  # (rows, k+1, 1)
    z, w = z.unsqueeze(1), w.unsqueeze(1)
    target = torch.ones_like(g)
    target[:, k] = n_valid - k
    best_g, best_err = g, torch.full_like(g[:, 0], math.inf)
    for step_index in range(max_iter + 1):
        P = torch.softmax(torch.baddbmm(g.unsqueeze(-1), y_eps, z), dim=1)  # (rows, k+1, m)
        Pw = P * w
        counts = Pw.sum(-1)
        err = (counts / target).sub_(1.0).abs_().amax(-1)
        best_g = torch.where((err < best_err).unsqueeze(-1), g, best_g)
        best_err = torch.minimum(err, best_err)
        if step_index == max_iter or not bool((best_err > tol).any()):
            break
        rescale = _rescaling_step(target, counts, k)
        K = torch.diag_embed(counts[:, :k]).sub_(torch.bmm(Pw[:, :k], P[:, :k].transpose(1, 2)))
        newton = solve_ridged(K, (target - counts)[:, :k], torch.float64).nan_to_num_(0.0, 0.0, 0.0)
        g = g + torch.nn.functional.pad(torch.where((err > 1.0).unsqueeze(-1), rescale, newton), (0, 1))
    return best_g


def _binned_start(problem: _Problem, g: Tensor, tol: float) -> Optional[Tensor]:
    """Potentials solved on a histogram of the scores, as a warm start for large, smooth problems.

    The problem depends on the scores only through their distribution; with bins much
    narrower than ``eps`` (here 1/16 of it) the binned solution is close to the exact one,
    and Newton on ``_BINS`` weighted points costs little. The best ``k + 1`` scores keep
    their exact values; the histogram is solved to ``tol / 10`` (its own approximation error
    is what remains). Returns None where the hard start is better (bins not narrow enough,
    or n small), or where a row has no rest anchor (exactly k valid entries).
    """
    z, valid, top, eps, all_valid = problem.z, problem.valid, problem.top, problem.eps, problem.all_valid
    n = z.shape[-1]
    if n < 8 * _BINS or bool(problem.no_rest.any()):
        return None
    low = (z if all_valid else torch.where(valid, z, z.new_tensor(math.inf))).amin(-1, keepdim=True)
    width = (top[:, :1] - low) / _BINS
    if bool((width > eps / 16).any()):
        return None
    weights = z.new_ones(()).expand_as(z) if all_valid else valid.to(z.dtype)
    # low <= z <= top: indices 0.._BINS, the last one only for the best scores (no clamp needed);
    # excluded entries (z = 0 there) fall anywhere with weight 0.
    index = (z - low).div_(width.clamp_min(torch.finfo(z.dtype).tiny)).long()
    if not all_valid:
        index.clamp_(0, _BINS)
    counts = torch.zeros(z.shape[0], _BINS + 1, dtype=z.dtype, device=z.device)
    counts.scatter_add_(1, index, weights)
    sums = torch.zeros_like(counts).scatter_add_(1, index, z if all_valid else z * weights)
    # The top k+1 scores replace their bins' share: they are the ones the ranks resolve.
    top_index = problem.top_index
    if top_index is None:
        top_index = hard_topk_indices(z, top.shape[-1], valid, largest=True)
    top_index = index.gather(1, top_index)
    counts.scatter_add_(1, top_index, -torch.ones_like(top))
    sums.scatter_add_(1, top_index, -top)
    z_bins = torch.cat([top, sums / counts.clamp_min(1.0)], dim=-1)
    w_bins = torch.cat([torch.ones_like(top), counts.clamp_min(0.0)], dim=-1)
    # A thousand points: solved in float64, where Newton reaches any tolerance.
    # Small tensors, over a hundred ops: inference mode skips the autograd dispatch of each.
    with torch.inference_mode():
        g_bins = _histogram_newton(z_bins.double(), w_bins.double(), problem.n_valid.double(), eps.double(),
                                   problem.k, g, tol=0.1 * tol, max_iter=_MAX_BIN_ITER)
    return g_bins.clone()  # a normal tensor again


def newton_solve(prep: PreparedScores, k: int, tol: float, max_iter: int) -> Tuple[Tensor, SolverInfo]:
    """Maximises the semi-dual of the prepared rows by damped Newton; returns the plan ``(rows, k+1, n)`` and info.

    Elements far below the best ``k + 1`` (in units of epsilon) belong to the rest anchor
    up to ``exp(margin)``; Newton runs on the window of the others only (the top few hundred
    of tens of thousands of beam candidates, say; :func:`candidate_window`, with a first
    boundary gap of :data:`_WINDOW_GAP` epsilons). The window widens until the solution
    confirms that every element left out puts less than ``tol / 100`` in total on the ranks.

    ``max_iter`` bounds the iterations (Newton and rescaling steps) of all the solves together,
    windows and the full problem: each solve gets what the previous ones left, and the info
    reports their sum. Where a window is not confirmed and nothing is left, the full problem is
    evaluated at the last window's potentials (its marginal error is the one reported).
    """
    problem = _Problem.prepared(prep, k)
    z, valid, n_valid, eps, top = problem.z, problem.valid, problem.n_valid, problem.eps, problem.top
    rows, n = z.shape
    no_rest = problem.no_rest
    g = _hard_start(top, no_rest, eps, k)
    # At most n_valid - k elements are left out; each may put exp(margin) on a rank.
    out_of_window = (n_valid - k).clamp_min(1).double().unsqueeze(-1)
    margin = torch.log(0.01 * tol / out_of_window)  # (rows, 1), negative
    edge = top[:, -1:] if top.shape[-1] > k else top[:, -1:] - 1.0
    floor = candidate_window(edge, k, eps, tol, out_of_window, boundary_gap=_WINDOW_GAP)
    cut = torch.where(no_rest.unsqueeze(-1), torch.full_like(edge, -math.inf), floor)
    # Where every entry lies above the cut (smooth problems), one reduction tells, without a mask.
    dense = problem.all_valid and bool((z.amin(-1, keepdim=True) >= cut).all())
    used = 0  # iterations of the window solves so far
    while not dense:
        inside = z >= cut
        if not problem.all_valid:
            inside &= valid
        width = int(inside.sum(-1).max())
        if width > n // 2:
            break
        index = torch.where(inside, z, z.new_tensor(-math.inf)).topk(width, dim=-1).indices
        z_w, inside_w = z.gather(-1, index), inside.gather(-1, index)
        window = _Problem(z_w, inside_w, inside.sum(-1).to(n_valid.dtype), eps, top, k)
        solved, n_iter = _solve_rows(window, g, tol, max_iter - used)
        used += n_iter
        # The best element left out must give every rank less than exp(margin) of its mass.
        best_out = torch.where(valid & ~inside, z, z.new_tensor(-math.inf)).amax(-1, keepdim=True).double()
        y = anchors(k, g)[:k]
        rank_logit = (best_out * y / eps.double() + solved.g[:, :k]).amax(-1, keepdim=True)
        if bool((rank_logit < margin).all()):
            P = z.new_zeros(rows, k + 1, n)
            P[:, k] = valid.to(z.dtype)
            P.scatter_(2, index.unsqueeze(1).expand(-1, k + 1, -1), solved.P)
            P[:, k].scatter_(1, index, torch.where(inside_w, solved.P[:, k], valid.gather(-1, index).to(z.dtype)))
            return P, _info(solved.err, used, tol)
        if used >= max_iter:  # no iteration left for another solve: the full problem where the window ended
            g = solved.g
            break
        cut = cut + (margin - _WINDOW_GAP).to(z.dtype) * eps  # widen the window and solve again
    solved, n_iter = _solve_rows(problem, g, tol, max_iter - used, warm_start=used < max_iter)
    return solved.P, _info(solved.err, used + n_iter, tol)


def fixed_newton_solve(prep: PreparedScores, k: int, tol: float, max_iter: int) -> Tuple[Tensor, SolverInfo]:
    """:func:`newton_solve` without host synchronisation: exactly ``max_iter`` iterations on all
    ``n`` elements (no candidate windows, no histogram start), for CUDA graphs and
    ``torch.compile(fullgraph=True)``. Returns the plan ``(rows, k + 1, n)`` and an info whose
    ``converged`` and ``marginal_error`` are 0-dim tensors.

    The same steps as :func:`_maximise`, each decided per row on the device: up to
    :data:`_RESCALE_STEPS` Sinkhorn-like rescalings (at most half of ``max_iter``; kept where they
    lower the error, stopped per row as in :func:`_rescale`), then Newton steps whose line search is spread over the
    iterations: a trial at the row's step length ``alpha`` is kept if it lowers the marginal
    error or passes Armijo's test; ``alpha`` doubles (up to 1) after a kept step and halves
    after a rejected one. Rows within ``tol`` stop moving, so the result of a converged call is
    the default solver's up to the tolerance. The plan's logits are formed in float64 (the rule
    that decides it otherwise reads the data).
    """
    problem = _Problem.prepared(prep, k)
    dual = _SemiDual(problem, tol, fixed=True)
    g = _hard_start(problem.top, problem.no_rest, problem.eps, k)
    point = dual.evaluate(g)
    going = point.err > 1.0
    n_rescale = min(_RESCALE_STEPS, max_iter // 2)  # steps, as counted by the default solver: at least half Newton
    for _ in range(n_rescale):
        step = torch.where(going.unsqueeze(-1), _rescaling_step(dual.target, point.counts, k, dual.no_rest), 0.0)
        trial = dual.evaluate(point.g + torch.nn.functional.pad(step, (0, 1)))
        better = going & (trial.err < point.err)
        going = better & (trial.err * _RESCALE_GAIN <= point.err) & (trial.err > tol)
        point = _take(better, trial, point)
    alpha = torch.ones_like(point.err).unsqueeze(-1)  # (rows, 1)
    for _ in range(max_iter - n_rescale):
        active = point.err > tol
        grad = (dual.target - point.counts)[:, :k]
        step = solve_ridged(dual.hessian(point.P), grad, point.P.dtype, blocked=False).nan_to_num_(0.0, 0.0, 0.0)
        step = torch.nn.functional.pad(step * alpha, (0, 1))  # g_k stays 0
        trial = dual.evaluate(point.g + step)
        slope = (grad * step[:, :k]).sum(-1)
        ok = active & ((trial.err < point.err) |
                       (dual.objective(trial) >= dual.objective(point) + _ARMIJO * slope))
        point = _take(ok, trial, point)
        alpha = torch.where(ok.unsqueeze(-1), (2.0 * alpha).clamp_max(1.0), 0.5 * alpha)
    max_err = point.err.amax() if point.err.numel() else point.err.new_zeros(())
    return point.P, SolverInfo(converged=max_err <= tol, n_iter=max_iter, marginal_error=max_err)


def _take(take: Tensor, trial: _Point, current: _Point) -> _Point:
    """``trial`` in the ``take`` rows (``(rows,)`` bool), ``current`` elsewhere, without a host read."""
    return _Point(*(torch.where(take.view(-1, *[1] * (new.dim() - 1)), new, old) for new, old in zip(trial, current)))


def _solve_rows(problem: _Problem, g: Tensor, tol: float, max_iter: int,
                warm_start: bool = True) -> Tuple[_Point, int]:
    """Newton from the hard start ``g`` (or a binned warm start, unless ``warm_start`` is False);
    returns the solved point and iterations (``max_iter = 0``: the point at ``g``)."""
    if not problem.all_valid and bool(problem.valid.all()):
        problem = dataclasses.replace(problem, all_valid=True)
    dual = _SemiDual(problem, tol)
    warm = _binned_start(problem, g, tol) if warm_start else None
    return _maximise(dual, g if warm is None else warm, tol, max_iter)


def _info(err: Tensor, n_iter: int, tol: float) -> SolverInfo:
    max_err = float(err.max()) if err.numel() else 0.0
    return SolverInfo(converged=max_err <= tol, n_iter=n_iter, marginal_error=max_err)
