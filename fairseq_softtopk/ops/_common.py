"""Input checks, cost scalings and reshaping shared by :func:`soft_topk` and :func:`sorted_soft_topk`.

Every cost the package offers reduces to one canonical problem that the solvers work on:
entropic OT between the valid scores ``z`` of a row (uniform mass) and anchors
``y_r = A, A-1, ..., 0`` (``A = 1`` unsorted, ``A = k`` sorted) with the *linear* cost
``-z_i * y_r`` and a per-row temperature ``eps_eff``. Why this is exact:

* squared distance ``(z_i - y_r)**2 = z_i**2 - 2 z_i y_r + y_r**2``; the ``z_i**2`` and
  ``y_r**2`` terms only shift the row and column potentials, so the plan at ``epsilon``
  equals the linear-cost plan at ``epsilon / 2``;
* the paper divides the squared distance by its maximum ``s`` (detached), which multiplies
  the temperature by ``s``: ``eps_eff = epsilon * s / 2``;
* ``largest=False`` is the mirror image: the plan for ``x`` with anchors ``0, 1, ..., A``
  (the paper's section 2.3) equals the plan for ``z = -x`` with anchors ``A, ..., 0``, up to
  a term linear in ``x_i`` that the row potential absorbs.

The linear-cost plan depends on a row only through ``z / eps_eff``, up to a shift, so a row
may be solved as ``(z / s, eps_eff / s)`` for any ``s > 0``. :func:`prepare_scores` uses this
at extreme magnitudes (any finite scores are accepted): rows whose scores are beyond about the
square root of the dtype's range, or whose temperature is below its inverse, are divided by a
power of two ``s`` (exact), so that centring, the paper's squared distances and the solvers'
logits cannot overflow (:attr:`PreparedScores.scale`). Two limits remain, both where the dtype
cannot tell the difference:

* the logits ``z * y_r / eps_eff`` must stay finite: where a row's range exceeds ``eps_eff``
  by more than about ``finfo.max / (64 (A + 1))`` (``1e36 / (A + 1)`` in float32), ``eps_eff``
  is raised to that bound. The plan is then hard up to terms ``exp(-d / eps_eff)``: only scores
  closer to a rank boundary than ``(A + 1) 1e-35`` of the row's range (float32; ``1e-305`` in
  float64) can get another share, far below the resolution of the scores relative to their range;
* ``eps_eff`` above the dtype's largest number (the paper's cost at scores beyond the root of
  the range) is lowered to it: every logit is then below ``4 / finfo.max``, and the plan is the
  uniform one, as the exact plan is to the dtype's precision.
"""

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..number_checks import is_integer, is_positive_number, is_real

COSTS = ("linear", "sqeuclidean", "paper")


@dataclass
class PreparedScores:
    """Scores flattened to rows and oriented so that the solvers always select the largest.

    Attributes:
        z: ``(rows, n)`` working-dtype oriented scores, centred per row; 0 where excluded.
        valid: ``(rows, n)`` bool, True where the entry takes part.
        n_valid: ``(rows,)`` working-dtype number of valid entries.
        eps: ``(rows, 1)`` working-dtype effective temperature of the linear cost.
        sign: +1 (largest) or -1 (smallest): ``d out / d x = sign * d out / d z``.
        top: ``(rows, min(k + 1, n))`` the largest valid ``z``, in decreasing order (entries
            past a row's valid count are not meaningful).
        top_index: ``(rows, min(k + 1, n))`` their positions in ``z``.
        all_valid: every entry takes part (no mask, no infinity): passes over ``valid`` can be skipped.
        scale: ``(rows, 1)`` float64 powers of two, or None (all 1): ``z`` and ``eps`` are the
            scores and the temperature divided by it (extreme magnitudes, see the module docstring).
        order: ``(rows, n)`` a key that orders the entries as ``z`` does and breaks ``z``'s ties by the
            scores, or None (``z`` itself): the sparse rows clamp the entries that cannot carry weight to
            equal positions, and a solver's window of the best entries must not pick among those ties
            arbitrarily (a device's ``topk`` breaks ties its own way).
    """

    z: Tensor
    valid: Tensor
    n_valid: Tensor
    eps: Tensor
    sign: float
    top: Tensor
    top_index: Tensor
    all_valid: bool = False
    scale: Optional[Tensor] = None
    order: Optional[Tensor] = None

    @property
    def grad_eps(self) -> Tensor:
        """``(rows, 1)`` temperature in the units of the scores, for the backward passes (which
        differentiate the unscaled scores); ``inf`` where it exceeds the dtype (gradient 0)."""
        if self.scale is None:
            return self.eps
        return (self.eps.double() * self.scale).to(self.eps.dtype)


def log_floor(dtype: torch.dtype) -> float:
    """Largest-magnitude exponent whose ``exp`` is still a normal number of ``dtype``.

    Clamping logits there changes results by less than the dtype's smallest normal number,
    and keeps ``exp``/``sigmoid`` off their slow underflow path (3-10x slower on CPUs).
    """
    return math.log(torch.finfo(dtype).tiny) + 1.0


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half precision inputs are solved in float32; float32/float64 as they are."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def refuse_tensor(name: str, value, convert: str = "item()") -> None:
    """``ValueError`` where a number argument (``k``, ``epsilon``, ``tol``, ...) is a tensor: the operators take
    Python or numpy numbers, and are not differentiable in them (a tensor that requires grad would get none)."""
    if isinstance(value, Tensor):
        what = f"a tensor of shape {tuple(value.shape)}" + (" that requires grad" if value.requires_grad else "")
        raise ValueError(f"{name} must be a Python or numpy number, got {what}: pass {name}.{convert} (the operators "
                         f"are not differentiable in {name})")


def check_inputs(scores: Tensor, k: int, epsilon: float, mask: Optional[Tensor], cost: str,
                 tol: float, max_iter: int, dim: int = -1, largest: bool = True) -> Tuple[int, float, float, int]:
    """Raises ``ValueError`` naming the problem for bad arguments (not data-dependent ones).

    Returns:
        ``(k, epsilon, tol, max_iter)`` as Python ``int``/``float`` (numpy scalars, as a sweep over
        ``np.linspace`` gives them, are accepted and converted; a numpy ``dim`` too: the callers take ``int(dim)``).
    """
    if not isinstance(scores, Tensor):
        raise ValueError(f"scores must be a torch.Tensor, got {type(scores).__name__}")
    refuse_tensor("k", k, "item() or int(k)")
    for name, value in (("epsilon", epsilon), ("tol", tol), ("max_iter", max_iter)):
        refuse_tensor(name, value)
    if not scores.is_floating_point():
        raise ValueError(f"scores must have a floating dtype, got {scores.dtype}")
    if scores.dim() == 0:
        raise ValueError("scores must have at least one dimension, got a scalar")
    if not is_integer(dim) or not -scores.dim() <= dim < scores.dim():
        raise ValueError(f"dim must be an integer in [{-scores.dim()}, {scores.dim() - 1}] for scores of shape "
                         f"{tuple(scores.shape)}, got {dim!r}")
    if scores.shape[dim] == 0:
        raise ValueError(f"scores have no candidates: dimension dim={dim} of shape {tuple(scores.shape)} is empty "
                         f"(k={k} cannot be selected from 0 entries)")
    if not is_integer(k) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    if not isinstance(largest, bool):  # a string such as "no" would be truthy: select the largest silently
        raise ValueError(f"largest must be True or False, got {largest!r}")
    if not is_positive_number(epsilon):
        raise ValueError(f"epsilon must be a finite number > 0, got {epsilon!r}")
    if cost not in COSTS:
        raise ValueError(f"cost must be one of {COSTS}, got {cost!r}")
    if not is_real(tol) or not tol > 0:
        raise ValueError(f"tol must be a number > 0, got {tol!r}")
    if not is_integer(max_iter) or max_iter < 1:
        raise ValueError(f"max_iter must be an integer >= 1, got {max_iter!r}")
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            raise ValueError(f"mask must be a bool tensor (True = excluded), got {getattr(mask, 'dtype', type(mask))}")
        if mask.shape != scores.shape:
            raise ValueError(f"mask shape {tuple(mask.shape)} differs from scores shape {tuple(scores.shape)}")
    return int(k), float(epsilon), float(tol), int(max_iter)


def prepare_scores(scores: Tensor, k: int, dim: int, largest: bool, epsilon: float,
                   mask: Optional[Tensor], cost: str, n_anchor_steps: int, checks: bool = True) -> PreparedScores:
    """Flattens ``scores`` to rows along ``dim``, checks the data and computes ``eps_eff``.

    Args:
        scores: ``(*, n, *)`` floating scores, ``n`` along ``dim``.
        n_anchor_steps: ``A``, the largest anchor (1 for top-k, k for sorted top-k).
        checks: look at the data (NaN, infinities, valid counts, extreme magnitudes), which
            reads values on the host. False (the fixed-iteration solvers): no host
            synchronisation; the losing infinity is still excluded, nothing is checked or
            rescaled (NaN gives NaN, a row with fewer than k valid entries gives no error).

    Raises:
        ValueError: NaN scores, the winning infinity (``+inf`` with ``largest=True``), or fewer
            than ``k`` valid entries in a row.
    """
    if not checks:
        return _prepare_unchecked(*unchecked_rows(scores, dim, largest, mask), k, largest, epsilon, cost,
                                  n_anchor_steps)
    x, valid, n_valid, all_valid = checked_rows(scores, k, dim, largest, mask)
    n = x.shape[-1]
    eps = effective_epsilon(x, None if all_valid else valid, epsilon, cost, n_anchor_steps)
    scale = None
    if not _in_safe_range(x, eps, n_anchor_steps):
        x, eps, scale = _rescale_rows(x, None if all_valid else valid, eps, epsilon, cost, n_anchor_steps)
    sign = 1.0 if largest else -1.0
    z = sign * x  # a new tensor, centred in place below
    # Centring does not change the plan (a shift of z is absorbed by the anchor potentials).
    # Centred between the best and the (k+1)-th best score, the elements near the rank
    # boundaries have small |z|, so their logits z * y / eps keep full floating-point precision.
    if all_valid:
        top, top_index = z.topk(min(k + 1, n), dim=-1, sorted=True)
    else:
        top_index = hard_topk_indices(z, min(k + 1, n), valid, largest=True)
        top = z.gather(-1, top_index)
    centre = 0.5 * (top[:, :1] + top[:, -1:])
    z.sub_(centre)
    if not all_valid:
        z = torch.where(valid, z, torch.zeros_like(z))
    return PreparedScores(z=z, valid=valid, n_valid=n_valid.to(x.dtype), eps=eps, sign=sign, top=top - centre,
                          top_index=top_index, all_valid=all_valid, scale=scale)


def checked_rows(scores: Tensor, k: int, dim: int, largest: bool,
                 mask: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, bool]:
    """``scores`` flattened to rows along ``dim`` in the working dtype, with the data checked.

    Returns:
        ``(x, valid, n_valid, all_valid)``: ``x`` ``(rows, n)`` (not oriented; 0 where excluded), ``valid``
        ``(rows, n)`` bool, ``n_valid`` ``(rows,)`` integer counts, ``all_valid`` (no mask, no infinity).
    Raises:
        ValueError: NaN scores, the winning infinity (``+inf`` with ``largest=True``), or fewer than ``k``
        valid entries in a row.
    """
    x = scores.detach().movedim(dim, -1)
    n = x.shape[-1]
    x = x.reshape(-1, n).to(working_dtype(scores.dtype))
    # The common case, every score finite, in one reduction: a sum is finite only if no entry is
    # NaN or infinite (if it overflows, the entry-wise checks below decide).
    excluded = None if mask is None else mask.detach().movedim(dim, -1).reshape(-1, n)
    finite = bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())
    if not finite:
        # a masked entry is ignored whatever it holds (NaN, either infinity), as the losing infinity is
        kept = x if excluded is None else x.masked_fill(excluded, 0.0)
        if torch.isnan(kept).any():
            raise ValueError("scores contain NaN" + ("" if mask is None else " where the mask keeps them"))
        losing_inf, winning_inf = (-float("inf"), float("inf")) if largest else (float("inf"), -float("inf"))
        if (kept == winning_inf).any():
            raise ValueError(f"scores contain {winning_inf}; only {losing_inf} (= excluded) is allowed "
                             f"with largest={largest}")
        valid = x != losing_inf
    else:
        valid = torch.ones_like(x, dtype=torch.bool)
    if excluded is not None:
        valid &= ~excluded
    all_valid = finite and mask is None
    n_valid = torch.full((x.shape[0],), n, device=x.device) if all_valid else valid.sum(-1)
    if x.shape[0] > 0 and int(n_valid.min()) < k:
        raise ValueError(f"k={k} exceeds the number of valid (unmasked, finite) entries in a row "
                         f"(smallest such count: {int(n_valid.min())}, n={n})")
    if not all_valid:
        x = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x, valid, n_valid, all_valid


def unchecked_rows(scores: Tensor, dim: int, largest: bool, mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """:func:`checked_rows` without looking at the data (no host synchronisation): ``(x, valid)``, the losing
    infinity and the masked entries excluded (0 in ``x``), nothing checked."""
    x = scores.detach().movedim(dim, -1)
    n = x.shape[-1]
    x = x.reshape(-1, n).to(working_dtype(scores.dtype))
    valid = x != (-float("inf") if largest else float("inf"))
    if mask is not None:
        valid = valid & ~mask.detach().movedim(dim, -1).reshape(-1, n)
    return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device)), valid


def _prepare_unchecked(x: Tensor, valid: Tensor, k: int, largest: bool, epsilon: float, cost: str,
                       n_anchor_steps: int) -> PreparedScores:
    """:func:`prepare_scores` without host synchronisation (``checks=False``): the same centred rows."""
    n = x.shape[-1]
    eps = effective_epsilon(x, valid, epsilon, cost, n_anchor_steps)
    sign = 1.0 if largest else -1.0
    z = sign * x
    top_index = hard_topk_indices(z, min(k + 1, n), valid, largest=True)
    top = z.gather(-1, top_index)
    centre = 0.5 * (top[:, :1] + top[:, -1:])
    z = torch.where(valid, z - centre, torch.zeros_like(z))
    return PreparedScores(z=z, valid=valid, n_valid=valid.sum(-1).to(x.dtype), eps=eps, sign=sign, top=top - centre,
                          top_index=top_index, all_valid=False, scale=None)


def _in_safe_range(x: Tensor, eps: Tensor, n_anchor_steps: int) -> bool:
    """Whether no row needs :func:`_rescale_rows` (one bound for the whole batch, one host sync).

    ``x`` is 0 where excluded, which can only widen the bound. The magnitudes stay below the
    square root of the dtype's range (the paper's squared distances, centring), the temperature
    above its inverse and below the largest number, and the logits ``z * y / eps`` far from overflow.
    """
    if x.numel() == 0:
        return True
    info = torch.finfo(x.dtype)
    bound = 2.0 ** (_max_exponent(x.dtype) // 2 - 4)  # 2**60 in float32, 2**508 in float64
    high, low, eps_min, eps_max = torch.stack([x.amax(), x.amin(), eps.amin(), eps.amax()]).tolist()
    return (max(high, -low) <= bound and bound * eps_min >= 1.0 and eps_max <= info.max
            and (high - low) * _LOGIT_MARGIN * (n_anchor_steps + 1) <= eps_min * info.max)


def _max_exponent(dtype: torch.dtype) -> int:
    """``e`` with the dtype's largest number in ``[2**(e-1), 2**e)``: 128 in float32, 1024 in float64."""
    return math.frexp(torch.finfo(dtype).max)[1]


#: the logits ``z * y_r / eps`` of a row are kept below ``finfo.max / (_LOGIT_MARGIN (A + 1))``
_LOGIT_MARGIN = 64.0


def _rescale_rows(x: Tensor, valid: Optional[Tensor], eps: Tensor, epsilon: float, cost: str,
                  n_anchor_steps: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Rows at extreme magnitudes divided by a power of two, and temperatures kept in the dtype's range.

    Rows whose largest ``|x|`` exceeds ``2**(maxexp / 2 - 4)`` (``1e18`` in float32), or whose
    temperature is below its inverse, are divided by ``s = 2**e`` with their largest ``|x|``
    in ``[1, 2)`` (``[1, 4)`` at the ends of the range), ``eps_eff`` computed for the scaled
    row in float64; other rows keep ``s = 1`` and their ``eps_eff``, so that divisions by a
    power of two being exact, every row whose logits were representable is solved as before.
    Then ``eps_eff`` is kept between the logits' bound and the dtype's largest number (module
    docstring).

    Args:
        x: ``(rows, n)`` working-dtype scores, 0 where excluded; valid: bool or None (all valid).
        eps: ``(rows, 1)`` :func:`effective_epsilon` of ``x``.
    Returns:
        ``(x / s, eps_eff / s, s)``, ``s`` ``(rows, 1)`` float64.
    """
    info, max_exponent = torch.finfo(x.dtype), _max_exponent(x.dtype)
    half = max_exponent // 2 - 4
    magnitude = x.abs().amax(-1, keepdim=True)
    rescale = (magnitude > 2.0 ** half) | (eps < 2.0 ** -half)
    exponent = torch.frexp(magnitude).exponent - 1  # magnitude / 2**exponent in [1, 2)
    exponent = torch.where(rescale, exponent.clamp(2 - max_exponent, max_exponent - 2), 0).double()
    scale = torch.pow(2.0, exponent)  # exact powers of two, normal numbers in x's dtype
    x = x * torch.pow(2.0, -exponent).to(x.dtype)
    low, high = (bound.double() for bound in _valid_range(x, valid))
    if cost == "paper":  # eps_eff / s = epsilon / 2 * max (x / s - a / s)**2 * s over anchors a in {0, A}
        scaled_eps = 0.5 * epsilon * _farthest_squared_distance(low, high, n_anchor_steps / scale) * scale
    else:
        scaled_eps = (0.5 * epsilon if cost == "sqeuclidean" else float(epsilon)) / scale
    eps64 = torch.where(rescale, scaled_eps, eps.double())
    logit_floor = (n_anchor_steps + 1) * torch.clamp_min(_LOGIT_MARGIN * (high - low), 4.0) / info.max
    eps64 = torch.maximum(eps64, logit_floor).clamp_max_(info.max)
    return x, eps64.to(x.dtype), scale


def effective_epsilon(x: Tensor, valid: Optional[Tensor], epsilon: float, cost: str, n_anchor_steps: int) -> Tensor:
    """``(rows, 1)`` temperature of the equivalent linear-cost problem (see module docstring)."""
    if cost == "linear":
        return torch.full((x.shape[0], 1), float(epsilon), dtype=x.dtype, device=x.device)
    if cost == "sqeuclidean":
        return torch.full((x.shape[0], 1), 0.5 * epsilon, dtype=x.dtype, device=x.device)
    low, high = _valid_range(x, valid)
    return 0.5 * epsilon * _farthest_squared_distance(low, high, n_anchor_steps)


def _valid_range(x: Tensor, valid: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """``(low, high)``: ``(rows, 1)`` smallest and largest valid entry of each row (``valid`` None: all)."""
    if valid is None:  # two reductions: aminmax along a dim is 10x slower on CPUs (torch 2.13)
        return x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    high = torch.where(valid, x, -math.inf).amax(-1, keepdim=True)
    low = torch.where(valid, x, math.inf).amin(-1, keepdim=True)
    return low, high


def _farthest_squared_distance(low: Tensor, high: Tensor, anchor) -> Tensor:
    """The paper cost's normaliser: max over the valid entries and the anchors {0, ..., A} of
    ``(x - a)**2``, attained at ``a = 0`` or ``A`` and at the smallest or largest ``x``."""
    return torch.maximum(torch.maximum(low * low, high * high), torch.maximum((low - anchor) ** 2, (high - anchor) ** 2))


def threshold_vjp(w: Tensor, grad_output: Tensor, eps: Tensor) -> Tensor:
    """``dL/dz`` of a mask ``y_i = f((z_i - t) / eps)`` whose threshold ``t(z)`` keeps ``sum y`` fixed.

    With ``w_i = f'`` at entry ``i`` (0 where excluded or saturated), ``dy_i/dz_j = w_i (delta_ij - w_j / sum w) /
    eps``: the vector-Jacobian product is ``w_j (g_j - sum_i w_i g_i / sum_i w_i) / eps``, O(n), 0 on a row with
    ``sum w = 0``. ``w``: ``(rows, n)``; grad_output: its shape; eps: ``(rows, 1)``.
    """
    g = grad_output.to(w.dtype)
    w_sum = w.sum(-1, keepdim=True)
    mean_g = (w * g).sum(-1, keepdim=True) / torch.where(w_sum > 0, w_sum, torch.ones_like(w_sum))
    return w / eps * (g - mean_g)


def restore_shape(rows: Tensor, scores: Tensor, dim: int, extra: Tuple[int, ...] = ()) -> Tensor:
    """Inverse of the flattening in :func:`prepare_scores`.

    Args:
        rows: ``(rows, n, *extra)``.
    Returns:
        ``scores.shape`` with ``*extra`` appended, ``n`` back at ``dim``.
    """
    moved = scores.movedim(dim, -1).shape
    out = rows.reshape(*moved, *extra)
    return out.movedim(len(moved) - 1, dim if dim >= 0 else scores.dim() + dim)


def oriented_rows(scores: Tensor, dim: int, prep: PreparedScores, dtype: Optional[torch.dtype] = None) -> Tensor:
    """``(rows, n)`` view of ``sign * scores`` that carries autograd back to ``scores``.

    The solvers work on detached copies; the autograd Functions take this tensor as their
    differentiable input (excluded entries are zeroed so that ``-inf`` never enters a gradient).
    ``dtype``: the rows' (default ``prep.z``'s).
    """
    n = scores.shape[dim]
    rows = scores.movedim(dim, -1).reshape(-1, n).to(prep.z.dtype if dtype is None else dtype)
    if prep.all_valid:
        return rows if prep.sign > 0 else -rows
    return prep.sign * torch.where(prep.valid, rows, torch.zeros_like(rows))


def hard_topk_indices(scores: Tensor, k: int, valid: Tensor, largest: bool) -> Tensor:
    """``(rows, k)`` indices of the k best valid entries of ``(rows, n)`` scores, best first."""
    fill = -float("inf") if largest else float("inf")
    # a Python scalar, not scores.new_tensor(fill): on a GPU that would be a host-to-device copy, which waits
    return torch.where(valid, scores, fill).topk(k, dim=-1, largest=largest, sorted=True).indices
