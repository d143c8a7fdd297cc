"""Options of the unrolled beam search (:mod:`.beam_search`); the criterion's flags map onto them."""

import math
from dataclasses import dataclass
from typing import Callable

from torch import Tensor

SELECTION_GRADS = ("full", "capped", "none")

#: ``(norms, live)``: called in the backward pass once per step with the ``(batch,)`` norms of
#: the gradient reaching the step's soft top-k (before any cap) and the ``(batch,)`` bool
#: mask of the sentences for which the step's selection matters (steps before their last).
GradientObserver = Callable[[Tensor, Tensor], None]


@dataclass
class BeamSearchConfig:
    """Options of :func:`~.beam_search.unroll_beam_search` (the criterion's flags map onto these)."""

    beam: int = 5
    mode: str = "soft"  # "soft" | "hard"
    epsilon: float = 0.1
    cost: str = "linear"
    tol: float = 1e-4
    max_iter: int = 50
    candidate_pool: int = 0  # 0: all k*V candidates; m > 0: the m best by hard selection
    selection_grad: str = "full"  # soft mode: "full" | "capped" | "none" (see the beam_search module)
    selection_grad_cap: float = 1.0  # "capped": largest gradient norm per sentence and step
    epsilon_relative: float = 0.0  # > 0: per row, epsilon = max(epsilon, this * mean gap of the k+1 best)
    fixed_iterations: bool = False  # soft mode: the search without host synchronisation (select_beams)

    def __post_init__(self):
        if self.selection_grad not in SELECTION_GRADS:
            raise ValueError(f"selection_grad must be one of {SELECTION_GRADS}, got {self.selection_grad!r}")
        if self.selection_grad == "capped" and not self.selection_grad_cap > 0:
            raise ValueError(f"selection_grad_cap must be > 0, got {self.selection_grad_cap}")
        if not self.epsilon_relative >= 0:
            raise ValueError(f"epsilon_relative must be >= 0, got {self.epsilon_relative}")
        if self.epsilon_relative > 0 and self.cost != "linear":
            raise ValueError(f"epsilon_relative needs the linear cost (its epsilon is in units of the scores), "
                             f"got cost {self.cost!r}")

    @property
    def grad_cap(self) -> float:
        """The cap on the selection gradient per sentence and step (``inf`` unless ``"capped"``)."""
        return self.selection_grad_cap if self.selection_grad == "capped" else math.inf
