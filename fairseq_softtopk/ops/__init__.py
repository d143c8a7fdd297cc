"""Differentiable top-k operators in pure PyTorch (no fairseq import).

``soft_topk`` and ``sorted_soft_topk`` are the SOFT top-k operators of Xie et al. (NeurIPS
2020), solved to a tolerance (threshold root-finding / Newton on the semi-dual) and
differentiated implicitly. ``sinkhorn_log`` is the log-domain Sinkhorn reference, and
:mod:`fairseq_softtopk.ops.paper_algorithm` a re-implementation of the published algorithm,
kept as baselines for tests and benchmarks. ``cap_row_grad_norm`` bounds the gradient that
enters an operator, per row (soft beam search's remedy for gradients compounding over steps).
``candidate_window`` bounds which candidates can carry a non-negligible part of a sorted soft
top-k (the operator's solver and soft beam search both cut their candidates with it).
A solve that misses its tolerance emits :class:`SoftTopKConvergenceWarning`.

``sparse_soft_topk`` and ``sorted_sparse_soft_topk`` are their quadratically regularised
counterparts (Sander et al., ICML 2023; Blondel et al., AISTATS 2018): the same selections with
exact zeros, an exact threshold (unsorted) or Newton to a tolerance (sorted), implicit backward.
``sorted_sparse_soft_topk_window`` returns the sorted plan on the entries that can carry weight only;
``sorted_soft_topk_window`` the sorted SOFT top-k on a static window of each row's best entries, without host
synchronisation, its certificate checked on the device.

``soft_topk(..., backend="triton")`` runs fused Triton kernels instead of the torch path (opt-in; see
:mod:`fairseq_softtopk.ops.kernels`): ``BACKENDS`` lists the choices, and a call the kernels cannot take runs on
the torch path with a :class:`KernelFallbackWarning`.
"""

from ._common import COSTS
from ._solver_info import SoftTopKConvergenceWarning, SolverInfo
from .candidate_window import candidate_window
from .gradient_cap import RowGradientCapFunction, cap_row_grad_norm
from .kernels import BACKENDS, KernelFallbackWarning
from .sinkhorn import sinkhorn_log
from .soft_topk import SoftTopKFunction, soft_topk
from .sorted_soft_topk import SortedSoftTopKFunction, sorted_soft_topk
from .sorted_soft_topk_window import WindowSolverInfo, default_window_width, sorted_soft_topk_window
from .sorted_sparse_soft_topk import SortedSparseSoftTopKFunction, sorted_sparse_soft_topk, sorted_sparse_soft_topk_window
from .sparse_soft_topk import SparseSoftTopKFunction, sparse_soft_topk

__all__ = [
    "BACKENDS",
    "COSTS",
    "KernelFallbackWarning",
    "RowGradientCapFunction",
    "SolverInfo",
    "SoftTopKConvergenceWarning",
    "SoftTopKFunction",
    "SortedSoftTopKFunction",
    "SortedSparseSoftTopKFunction",
    "SparseSoftTopKFunction",
    "WindowSolverInfo",
    "candidate_window",
    "cap_row_grad_norm",
    "default_window_width",
    "sinkhorn_log",
    "soft_topk",
    "sorted_soft_topk",
    "sorted_soft_topk_window",
    "sorted_sparse_soft_topk",
    "sorted_sparse_soft_topk_window",
    "sparse_soft_topk",
]
