"""The statistics of the gradient reaching each step's selection, which ``soft_beam_search`` logs.

Filled during the backward pass by the search's gradient observer
(:data:`~fairseq_softtopk.modules.beam_search_config.GradientObserver`); logged as ``selgrad_log10``,
``selgrad_capped`` and ``selgrad_over100``.
"""

from typing import List, Optional

import torch

#: logged per sentence and step from the backward pass (see SelectionGradientStats)
SELGRAD_KEYS = ("selgrad_count", "selgrad_log10_sum", "selgrad_capped", "selgrad_over100")


class SelectionGradientStats:
    """Sums, filled during the backward pass, over (sentence, step) pairs whose selection matters.

    The tensors are put into the logging output in the forward pass; fairseq reduces the
    logging outputs only after the backward pass, so they hold the backward's numbers then.

    Args:
        cap: the cap on the norms (``inf`` when not capped).
        unit: the size of one gold token's gradient in the beam term, ``1 - p``.
        record: if a list, every norm (divided by ``unit``) is also appended to it (diagnostics).
    """

    def __init__(self, cap: float, unit: float, device: torch.device, record: Optional[List[float]] = None):
        self.cap, self.unit, self.record = cap, unit, record
        self.sums = torch.zeros(len(SELGRAD_KEYS), dtype=torch.float64, device=device)
        #: set while an extra backward pass runs (:mod:`.term_gradient_norms`): its norms are not counted
        self.paused = False
        self._pending: List[tuple] = []  # (norms, live) of this backward pass's steps, summed as it ends

    def __call__(self, norms: torch.Tensor, live: torch.Tensor) -> None:
        if self.paused:
            return
        norms = norms.detach()
        if self.record is not None:  # diagnostics only: reads the norms on the host
            self.record += (norms.double()[live] / self.unit).tolist()
        # kept until the backward pass ends, then summed at once: a few launches a batch rather than a step
        if not self._pending:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._sum_pending)
            except RuntimeError:  # called outside a backward pass: nothing to wait for
                self._pending.append((norms, live))
                self._sum_pending()
                return
        self._pending.append((norms, live))

    def _sum_pending(self) -> None:
        """Adds the norms observed so far to :attr:`sums` (masked sums, not boolean indexing: no host read)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        with torch.no_grad():
            norms = torch.cat([n for n, _ in pending]).double()
            live = torch.cat([m for _, m in pending]).double()
            self.sums += torch.stack([live.sum(), (norms.clamp_min(1e-12).log10() * live).sum(),
                                      ((norms > self.cap) * live).sum(), ((norms > 100 * self.unit) * live).sum()])

    def logging_output(self) -> dict:
        return {key: self.sums[i] for i, key in enumerate(SELGRAD_KEYS)}
