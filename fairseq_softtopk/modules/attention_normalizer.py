"""Attention normalisers: scores to weights, with soft top-k attention (SOFT, appendix C.3).

Every normaliser maps attention scores ``s`` over the source positions of a row to weights
that sum to 1 and are exactly 0 on padding:

* ``softmax``: ``softmax(s)``;
* ``hard_topk``: softmax over the k largest scores only, ``softmax(s + log 1[i in topk(s)])``;
* ``soft_topk``: the same with the SOFT top-k indicator ``A = soft_topk(s, k, epsilon)`` in
  place of the hard one, ``softmax(s + log A)`` (Xie et al., NeurIPS 2020, appendix C.3): the
  top-k scores are promoted, the rest pushed towards 0, and the map stays differentiable.
  As ``epsilon -> 0``, ``A`` tends to the hard indicator and ``soft_topk`` to ``hard_topk``;
* ``sparse_topk``: ``softmax(s + log A)`` with the *sparse* soft top-k indicator
  ``A = sparse_soft_topk(s, k, regularization=epsilon)`` (quadratic instead of entropic
  regularisation, Sander et al. 2023): positions more than ``epsilon`` below the threshold get
  ``A = 0`` and so weight exactly 0; at most ``k`` plus the positions within ``epsilon`` of the
  threshold keep a weight;
* ``sparsemax`` and ``entmax15`` (Martins & Astudillo 2016; Peters et al. 2019), from the
  ``entmax`` package: sparse without a fixed k.

A row with k or fewer non-padding positions has nothing to select: the top-k normalisers
give plain softmax for that row (decided per row, in one vectorised pass).
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fairseq_softtopk.ops import soft_topk, sparse_soft_topk
from fairseq_softtopk.ops.kernels.backend import BACKENDS
from fairseq_softtopk.number_checks import is_integer, is_positive_number, is_real

__all__ = ["ATTENTION_NORMALIZERS", "TOPK_NORMALIZERS", "AttentionNormalizer", "normalize_attention"]

#: Names accepted by :func:`normalize_attention` and :class:`AttentionNormalizer`.
ATTENTION_NORMALIZERS = ("softmax", "soft_topk", "hard_topk", "sparse_topk", "sparsemax", "entmax15")
#: The normalisers that need ``k`` (and fall back to softmax on rows with ``k`` or fewer positions).
TOPK_NORMALIZERS = ("soft_topk", "hard_topk", "sparse_topk")

# sparsemax gives 0 to any score below (row max - 1), entmax15 to any below (row max - 2), so
# padding set this far below the row's largest valid score gets 0 and leaves the threshold alone.
_SPARSE_PAD_GAP = 1e3


def check_normalizer_options(normalizer: str, k: Optional[int], epsilon: float, backend: str = "auto") -> None:
    """Raises ``ValueError`` naming the bad value; ``k``/``epsilon`` are checked where used."""
    if backend not in BACKENDS:
        raise ValueError(f"the attention normalizer's backend must be one of {BACKENDS}, got {backend!r}")
    if normalizer not in ATTENTION_NORMALIZERS:
        raise ValueError(f"unknown attention normalizer {normalizer!r}; choose one of {ATTENTION_NORMALIZERS}")
    if normalizer in TOPK_NORMALIZERS and (not is_integer(k) or k < 1):
        raise ValueError(f"the {normalizer} attention normalizer needs an integer k >= 1, got k={k!r}")
    if normalizer in ("soft_topk", "sparse_topk") and not is_positive_number(epsilon):
        raise ValueError(f"the {normalizer} attention normalizer needs a finite epsilon > 0, got "
                         f"{epsilon!r}")


def normalize_attention(scores: Tensor, key_padding_mask: Optional[Tensor] = None, *,
                        normalizer: str = "softmax", k: Optional[int] = None, epsilon: float = 0.1,
                        tol: float = 1e-5, max_iter: int = 100, backend: str = "auto") -> Tensor:
    """Turns attention scores into weights over the last dimension (the source positions).

    Computed in float32 at least (like fairseq's attention softmax) and cast back.

    Args:
        scores: ``(..., src_len)`` floating attention scores. ``-inf`` entries (e.g. from a
            causal mask) are excluded like padding.
        key_padding_mask: optional bool tensor broadcastable to ``scores`` (e.g.
            ``(batch, 1, src_len)`` for ``(batch, tgt_len, src_len)`` scores); True marks
            padding, which gets weight exactly 0 and no gradient.
        normalizer: one of :data:`ATTENTION_NORMALIZERS` (see the module docstring).
        k: number of positions the top-k normalisers keep; needed by ``soft_topk``,
            ``hard_topk`` and ``sparse_topk``, ignored by the others. Rows with at most ``k``
            non-excluded positions get plain softmax.
        epsilon: in the units of the scores: the entropic regularisation of ``soft_topk``
            (``A_i = sigmoid((s_i - t) / epsilon)``) or the quadratic one of ``sparse_topk``
            (``A_i = clip((s_i - t) / epsilon, 0, 1)``); ignored by the others.
        tol: marginal tolerance of the soft top-k solver.
        max_iter: iteration cap of the soft top-k solver.
        backend: the implementation of ``soft_topk`` and ``sparse_topk``'s operator: ``"auto"``,
            ``"torch"`` or ``"triton"`` (:mod:`fairseq_softtopk.ops.kernels`); ignored by the others.

    Returns:
        ``(..., src_len)`` weights, same dtype as ``scores``: non-negative, summing to 1 along
        the last dimension, 0 at padding and ``-inf`` scores. A row with every position
        excluded has nothing to attend to and gets all zeros (plain softmax would give NaN).

    Raises:
        ValueError: for an unknown normaliser or backend, a missing or bad ``k``/``epsilon``, a
            non-bool mask or one that does not broadcast to ``scores``.
    """
    check_normalizer_options(normalizer, k, epsilon, backend)
    if not isinstance(scores, Tensor) or not scores.is_floating_point() or scores.dim() == 0:
        raise ValueError(f"scores must be a floating tensor of shape (..., src_len), got {scores!r:.80}")
    x = scores.to(torch.promote_types(scores.dtype, torch.float32))
    excluded = _excluded_positions(x, key_padding_mask)
    empty_row = excluded.all(-1, keepdim=True)
    if normalizer == "softmax":
        weights = _masked_softmax(x, excluded, empty_row)
    elif normalizer == "hard_topk":
        weights = _hard_topk_attention(x, excluded, empty_row, k)
    elif normalizer == "soft_topk":
        weights = _soft_topk_attention(x, excluded, empty_row, k, epsilon, tol, max_iter, backend)
    elif normalizer == "sparse_topk":
        weights = _soft_topk_attention(x, excluded, empty_row, k, epsilon, tol, max_iter, backend, sparse=True)
    else:
        weights = _sparse_attention(x, excluded, sparse_mapping(normalizer))
    weights = weights.masked_fill(excluded | empty_row, 0.0)
    return weights.to(scores.dtype)


def sparse_mapping(normalizer: str):
    """``entmax.sparsemax`` or ``entmax.entmax15``, imported on first use: the ``entmax`` package is an
    optional dependency (``pip install fairseq-softtopk[sparse-attention]``)."""
    try:
        import entmax
    except ImportError as error:
        raise ImportError(f"--attention-normalizer {normalizer} needs the entmax package: pip install entmax "
                          "(or fairseq-softtopk[sparse-attention])") from error
    return entmax.sparsemax if normalizer == "sparsemax" else entmax.entmax15


def _excluded_positions(x: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
    """``x``-shaped bool: True at padding and at ``-inf`` scores."""
    excluded = x == -math.inf
    if key_padding_mask is None:
        return excluded
    if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
        raise ValueError("key_padding_mask must be a bool tensor (True = pad), got "
                         f"{getattr(key_padding_mask, 'dtype', type(key_padding_mask).__name__)}")
    try:
        return excluded | key_padding_mask.broadcast_to(x.shape)
    except RuntimeError as err:
        raise ValueError(f"key_padding_mask of shape {tuple(key_padding_mask.shape)} does not broadcast "
                         f"to scores of shape {tuple(x.shape)}") from err


def _masked_softmax(x: Tensor, excluded: Tensor, empty_row: Tensor) -> Tensor:
    """Softmax over the non-excluded entries; empty rows get a finite dummy (zeroed by the caller)."""
    logits = x.masked_fill(excluded, -math.inf).masked_fill(empty_row, 0.0)
    return F.softmax(logits, dim=-1)


def _hard_topk_attention(x: Tensor, excluded: Tensor, empty_row: Tensor, k: int) -> Tensor:
    """Softmax over the exact top-k of each row.

    Rows with at most k valid entries need no special case: their top-k already holds every
    valid entry (plus excluded ``-inf`` ones), so they get plain softmax.
    """
    masked = x.masked_fill(excluded, -math.inf)
    top = masked.topk(min(k, x.shape[-1]), dim=-1).indices
    kept = torch.zeros_like(excluded).scatter_(-1, top, True)
    return _masked_softmax(x, excluded | ~kept, empty_row)


def _soft_topk_attention(x: Tensor, excluded: Tensor, empty_row: Tensor, k: int, epsilon: float,
                         tol: float, max_iter: int, backend: str, sparse: bool = False) -> Tensor:
    """``softmax(x + log A)`` with ``A`` the SOFT top-k indicator, or with ``sparse`` the sparse soft top-k
    indicator at ``regularization = epsilon`` (``log A = 0`` on fallback rows)."""
    n = x.shape[-1]
    rows, rows_excluded = x.reshape(-1, n), excluded.reshape(-1, n)  # (rows, src_len)
    selecting = (~rows_excluded).sum(-1) > k  # rows with more than k candidates
    log_a = torch.zeros_like(rows)

    def indicator(scores: Tensor, mask: Tensor) -> Tensor:
        if sparse:
            return sparse_soft_topk(scores, k, regularization=epsilon, mask=mask, backend=backend)
        return soft_topk(scores, k, epsilon=epsilon, mask=mask, tol=tol, max_iter=max_iter, backend=backend)

    if bool(selecting.all()):
        log_a = _safe_log(indicator(rows, rows_excluded))
    elif bool(selecting.any()):
        index = selecting.nonzero().squeeze(1)
        a = indicator(rows.index_select(0, index), rows_excluded.index_select(0, index))
        log_a = log_a.index_copy(0, index, _safe_log(a))
    return _masked_softmax(x + log_a.view_as(x), excluded, empty_row)


def _safe_log(a: Tensor) -> Tensor:
    """``log a`` with ``-inf`` (and zero gradient) where ``a`` is 0 or subnormal.

    Below the smallest normal number ``1 / a`` overflows, and ``0 * inf`` in the backward
    pass would turn the gradient into NaN. Each row of a soft top-k indicator sums to
    ``k >= 1``, so at least one entry per row stays finite.
    """
    positive = a >= torch.finfo(a.dtype).tiny
    return torch.where(positive, torch.log(torch.where(positive, a, torch.ones_like(a))), -math.inf)


def _sparse_attention(x: Tensor, excluded: Tensor, mapping) -> Tensor:
    """``mapping`` (sparsemax or entmax15) with excluded entries set far below the row maximum."""
    row_max = x.detach().masked_fill(excluded, -math.inf).amax(-1, keepdim=True)
    row_max = torch.nan_to_num(row_max, neginf=0.0)  # empty rows (zeroed by the caller)
    return mapping(torch.where(excluded, row_max - _SPARSE_PAD_GAP, x), dim=-1)


class AttentionNormalizer(nn.Module):
    """Holds a normaliser's hyperparameters; :meth:`forward` applies :func:`normalize_attention`.

    Top-k attention is from "Differentiable Top-k with Optimal Transport" (Xie et al., NeurIPS
    2020), appendix C.3: weights ``softmax(s + log A)`` with ``A`` the SOFT top-k indicator.
    The hard counterpart is ``hard_topk`` (``A`` = the exact top-k indicator).

    Args:
        name: one of :data:`ATTENTION_NORMALIZERS`.
        k: positions kept by ``soft_topk``/``hard_topk``/``sparse_topk`` (required by them, ignored by the others).
        epsilon: regularisation in score units: entropic for ``soft_topk``, quadratic for ``sparse_topk``.
        tol: soft top-k solver tolerance.
        max_iter: soft top-k solver iteration cap.
        backend: the operators' implementation, ``"auto"``, ``"torch"`` or ``"triton"``
            (:func:`normalize_attention`).

    Raises:
        ValueError: for an unknown ``name`` or ``backend``, or a missing/bad ``k``/``epsilon``.

    Example::

        >>> norm = AttentionNormalizer("hard_topk", k=1)
        >>> norm(torch.tensor([[2.0, 1.0, 5.0]]), torch.tensor([[False, False, True]]))
        tensor([[1., 0., 0.]])
    """

    def __init__(self, name: str = "softmax", k: Optional[int] = None, epsilon: float = 0.1,
                 tol: float = 1e-5, max_iter: int = 100, backend: str = "auto"):
        super().__init__()
        check_normalizer_options(name, k, epsilon, backend)
        if name in ("soft_topk", "sparse_topk"):  # else a solve fails only once a row has more than k positions
            if not is_positive_number(tol):
                raise ValueError(f"the {name} attention normalizer needs a finite tol > 0, got {tol!r}")
            if not is_integer(max_iter) or max_iter < 1:
                raise ValueError(f"the {name} attention normalizer needs an integer max_iter >= 1, got {max_iter!r}")
        self.name = str(name)  # a fairseq ChoiceEnum member is no str on every Python (its extra_repr must be)
        # Python numbers (numpy scalars converted), as the operators use them and extra_repr prints them
        self.k = int(k) if is_integer(k) else k
        self.epsilon = float(epsilon) if is_real(epsilon) else epsilon
        self.tol = float(tol) if is_real(tol) else tol
        self.max_iter = int(max_iter) if is_integer(max_iter) else max_iter
        self.backend = str(backend)

    def forward(self, scores: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        """Weights from scores.

        Args:
            scores: ``(..., src_len)`` floating scores; ``-inf`` entries count as padding.
            key_padding_mask: optional bool, broadcastable to ``scores``; True = pad.

        Returns:
            ``(..., src_len)`` weights in ``scores``' dtype, each row summing to 1 (all-zero for
            a row with no valid position), exactly 0 on padding.
        """
        return normalize_attention(scores, key_padding_mask, normalizer=self.name, k=self.k,
                                   epsilon=self.epsilon, tol=self.tol, max_iter=self.max_iter,
                                   backend=self.backend)

    def extra_repr(self) -> str:
        if self.name in ("soft_topk", "sparse_topk"):
            backend = "" if self.backend == "auto" else f", backend={self.backend}"
            return f"{self.name}, k={self.k}, epsilon={self.epsilon}{backend}"
        return f"{self.name}, k={self.k}" if self.name == "hard_topk" else self.name
