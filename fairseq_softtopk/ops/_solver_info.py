"""What a soft top-k solve reports: :class:`SolverInfo` (``return_info=True``) and the warning where it stopped
above its tolerance; shared by every operator of :mod:`fairseq_softtopk.ops` and their kernels."""

import warnings
from dataclasses import dataclass


@dataclass
class SolverInfo:
    """What the forward solver reached (returned with ``return_info=True``).

    Attributes:
        converged: every row reached ``marginal_error <= tol``.
        n_iter: iterations used (the largest over rows), at most ``max_iter``.
        marginal_error: the largest relative violation of the anchor marginals over rows,
            ``max_r |sum_i A_ir - m_r| / m_r`` with ``m_r`` the number of elements anchor ``r``
            must receive (1 per rank, ``k`` or ``n - k`` otherwise). Row marginals are exact.
    """

    converged: bool
    n_iter: int
    marginal_error: float


class SoftTopKConvergenceWarning(UserWarning):
    """A soft top-k solve stopped at ``max_iter`` (or at the dtype's resolution) above its ``tol``.

    Emitted by :func:`~fairseq_softtopk.ops.soft_topk` and
    :func:`~fairseq_softtopk.ops.sorted_soft_topk` (unless called with ``warn=False``); the
    message is the same for every call with the same arguments, so Python's default filter
    shows it once per call site. Filter it by category, e.g.
    ``warnings.filterwarnings("error", category=SoftTopKConvergenceWarning)`` to make it an error.
    """


def warn_if_unconverged(info: SolverInfo, operator: str, tol: float, max_iter: int) -> None:
    """Emits :class:`SoftTopKConvergenceWarning` at the operator's caller when ``info`` missed ``tol``."""
    if not info.converged:
        # no per-call numbers in the text: the default filter shows one warning per call site and text
        warnings.warn(f"{operator} stopped above its tolerance tol={tol:g} (max_iter={max_iter}): the result's "
                      f"marginals are off by more than tol (return_info=True gives the error); raise max_iter or "
                      f"tol, or pass warn=False where info.converged is checked", SoftTopKConvergenceWarning,
                      stacklevel=3)
