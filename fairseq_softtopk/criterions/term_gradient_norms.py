"""The gradient norms of the two weighted terms of ``soft_beam_search``'s loss, measured apart.

``loss = p * L_tf + (1 - p) * L_beam``: which term drives the update depends on the sizes of their
gradients, not of the losses (a risk in [0, 1] beside a token NLL moves little). Every N-th training
batch (``--log-term-gnorm-interval N``), each term is differentiated on its own with respect to the
model's parameters (two backward passes more on that batch, the graph kept for fairseq's own), and the
norms are logged as ``tf_gnorm`` and ``beam_gnorm``, divided by the sample size as fairseq divides the
gradient before its ``gnorm``. With data-parallel training each worker measures its own batch; the
logged value is the mean over the measured batches.
"""

from typing import Optional

import torch

#: logged per measured batch (summed over workers, divided by the count in reduce_metrics)
TERM_GNORM_KEYS = ("tf_gnorm_sum", "beam_gnorm_sum", "term_gnorm_count")


def gradient_norm(term: torch.Tensor, params) -> torch.Tensor:
    """The 2-norm of the gradient of the scalar ``term`` with respect to ``params`` (float64; the graph is
    kept; a parameter that ``term`` does not reach adds 0)."""
    grads = torch.autograd.grad(term, params, retain_graph=True, allow_unused=True)
    squares = [g.detach().double().pow(2).sum() for g in grads if g is not None]
    return torch.stack(squares).sum().sqrt() if squares else term.new_zeros((), dtype=torch.float64)


class TermGradientNorms:
    """Measures the two terms' gradient norms on every ``interval``-th call (0: never).

    The first call is measured, then every ``interval``-th: a short run is measured too.
    """

    def __init__(self, interval: int):
        self.interval, self.calls = interval, 0

    def __call__(self, model, tf_term: torch.Tensor, beam_term: torch.Tensor, sample_size,
                 selection_stats: Optional[object] = None) -> dict:
        """The logging output's entries (empty unless this call is measured).

        Args:
            tf_term, beam_term: ``p * L_tf`` and ``(1 - p) * L_beam`` (with the gradient cap's scale probe, whose
                gradient the cap reads), scalars with their graphs.
            selection_stats: the criterion's :class:`.selection_gradient_stats.SelectionGradientStats`, paused
                meanwhile (the extra backward passes would count its norms twice).
        """
        if not self.interval or not torch.is_grad_enabled():
            return {}
        self.calls += 1
        if (self.calls - 1) % self.interval:
            return {}
        params = [p for p in model.parameters() if p.requires_grad]
        if selection_stats is not None:
            selection_stats.paused = True
        try:
            norms = [gradient_norm(term, params) if term.requires_grad else tf_term.new_zeros((), dtype=torch.float64)
                     for term in (tf_term, beam_term)]
        finally:
            if selection_stats is not None:
                selection_stats.paused = False
        size = float(sample_size) or 1.0
        return dict(zip(TERM_GNORM_KEYS, (norms[0] / size, norms[1] / size, 1)))
