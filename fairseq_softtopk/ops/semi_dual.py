"""The semi-dual of the sorted operator's transport problem, evaluated at anchor potentials.

The problem (:mod:`.semi_dual_newton` states it): the plan ``P_ir = softmax_r(z_i * y_r / eps + g_r)``
of the valid scores ``z`` of a row and the anchors ``y = k, ..., 0``, and the concave objective
``F(g) = sum_{r<k} g_r - sum_i logsumexp_r(z_i * y_r / eps + g_r)``. :class:`SemiDual` evaluates the
plan, the anchor counts and the marginal error at potentials ``g`` (and ``F`` where a line search
needs it); :func:`rescaling_step` is the Sinkhorn-like step on the rank potentials, and
:func:`merge_rows` / :func:`take_rows` keep per-row progress. The solvers are in
:mod:`.semi_dual_newton`, their warm starts in :mod:`.semi_dual_warm_start`.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ._common import PreparedScores
from .semi_dual_hessian import anchor_hessian

_LOG2E, _LN2 = 1.0 / math.log(2.0), math.log(2.0)


def anchors(k: int, like: Tensor) -> Tensor:
    """``(k + 1,)`` anchors ``k, k-1, ..., 0`` in ``like``'s dtype and device."""
    return torch.arange(k, -1, -1, dtype=like.dtype, device=like.device)


def subnormal_cut(dtype: torch.dtype, k: int) -> float:
    """Base-2 exponent below which the product of two plan entries (at most ``k + 1`` times smaller
    after normalisation) could be subnormal in ``dtype``: about -60 in float32, -508 in float64."""
    min_exponent = math.log2(torch.finfo(dtype).tiny)  # -126, -1022
    return 0.5 * min_exponent + math.log2(k + 1) + 1.0


@dataclass
class SemiDualProblem:
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
    def prepared(cls, prep: PreparedScores, k: int) -> "SemiDualProblem":
        return cls(prep.z, prep.valid, prep.n_valid, prep.eps, prep.top, k, prep.top_index, prep.all_valid)

    @property
    def no_rest(self) -> Tensor:
        """``(rows,)`` bool: rows with exactly k valid entries, which have no rest anchor."""
        return self.n_valid == self.k


class SemiDualPoint(NamedTuple):
    """The semi-dual at potentials ``g`` (rows, k+1): plan ``P`` (rows, k+1, n), anchor ``counts``
    (rows, k+1) float64, marginal ``err`` (rows,), and the softmax's ``total`` and ``top``
    (rows, 1, n, log2 units) from which :meth:`SemiDual.objective` gets ``F``."""

    g: Tensor
    P: Tensor
    counts: Tensor
    err: Tensor
    total: Tensor
    top: Tensor


class SemiDual:
    """The semi-dual objective of one batch of rows, evaluated at anchor potentials ``g``.

    Tensors are laid out anchors first, ``(rows, k+1, n)``, so that the softmax over anchors
    is elementwise across ``k+1`` contiguous vectors and the sums over elements are contiguous.
    """

    def __init__(self, problem: SemiDualProblem, tol: float, fixed: bool = False):
        z, n_valid, k = problem.z, problem.n_valid, problem.k
        self.fixed = fixed  # no host synchronisation (fixed_newton_solve)
        self.k = k
        self.dtype = z.dtype
        self.cut = subnormal_cut(z.dtype, k)
        self.valid = None if problem.all_valid else problem.valid.unsqueeze(1).to(z.dtype)
        # Logits are kept in base 2 (exp2 is several times faster than exp on CPUs, as accurate)
        # and formed by one rank-1 baddbmm per evaluation, not from a stored (rows, k+1, n)
        # product: one large allocation less (each costs page faults on CPUs). They are formed in
        # float64 where the dtype's rounding would decide the marginals (:func:`choose_logit_dtype`).
        # (without reading the data, float64 wherever the dtype's rounding could matter)
        logit_dtype = torch.float64 if fixed else choose_logit_dtype(problem, tol)
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
    def evaluate(self, g: Tensor) -> "SemiDualPoint":
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
        return SemiDualPoint(g, P, counts, err, total, top)

    def objective(self, point: "SemiDualPoint") -> Tensor:
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


def choose_logit_dtype(problem: SemiDualProblem, tol: float) -> torch.dtype:
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


def merge_rows(keep: Tensor, trial: SemiDualPoint, current: SemiDualPoint) -> SemiDualPoint:
    """``trial`` with the ``keep`` rows (``(rows,)`` bool) of ``current`` copied over it, in place."""
    if bool(keep.any()):
        for new, old in zip(trial, current):
            new[keep] = old[keep]
    return trial


def take_rows(take: Tensor, trial: SemiDualPoint, current: SemiDualPoint) -> SemiDualPoint:
    """``trial`` in the ``take`` rows (``(rows,)`` bool), ``current`` elsewhere, without a host read."""
    return SemiDualPoint(*(torch.where(take.view(-1, *[1] * (new.dim() - 1)), new, old)
                           for new, old in zip(trial, current)))


def rescaling_step(target: Tensor, counts: Tensor, k: int, no_rest: Optional[Tensor] = None) -> Tensor:
    """``(rows, k)`` Sinkhorn-like step ``log(target_r / count_r)`` of the rank potentials.

    ``g_k`` stays 0 (the rest anchor's potential is fixed), so the step is taken relative to
    the rest anchor's own ratio, except in ``no_rest`` rows (``(rows,)`` bool, None: none).
    """
    log_ratio = (target / counts.clamp_min(1e-300)).log()
    rest_shift = log_ratio[:, k:] if no_rest is None else torch.where(no_rest, 0.0, log_ratio[:, k]).unsqueeze(-1)
    return (log_ratio[:, :k] - rest_shift).clamp_(-50.0, 50.0)
