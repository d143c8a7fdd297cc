"""Options of the unrolled beam search (:mod:`.beam_search`); the criterion's flags map onto them."""

import math
from dataclasses import dataclass
from typing import Callable

from torch import Tensor

from ..ops import COSTS
from ..ops.kernels.backend import BACKENDS
from ..ops.sorted_soft_topk_window import WINDOW_MAX_EPSILON
from ..number_checks import is_integer, is_positive_number

#: ``mode``: the sorted soft top-k selection (the paper's) or the exact top-k (the ablation)
MODES = ("soft", "hard")
SELECTION_GRADS = ("full", "capped", "none")
#: soft mode's operator: the entropic sorted SOFT top-k or the quadratically regularised (sparse) one
REGULARIZERS = ("entropic", "quadratic")
#: ``torch.compile`` modes of the sync-free solve (``compile``); "" = not compiled
COMPILE_MODES = ("", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

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
    #: soft mode: "capped" (the exact gradient, capped per sentence and step: the fairseq criterion's default),
    #: "full" (the paper's exact gradient, which explodes where candidates nearly tie) or "none" (see the beam_search
    #: module)
    selection_grad: str = "capped"
    #: "capped": the largest norm of the gradient reaching a step's selection, per sentence, in gold-token gradients
    #: (one label token's gradient in a summed loss) where ``BeamSearchOutput.scale_probe`` is added to the loss
    #: (the losses and the criterion add it), else absolute; 0.3: the criterion's ``--topk-grad-cap``
    selection_grad_cap: float = 0.3
    epsilon_relative: float = 0.0  # > 0: per row, epsilon = max(epsilon, this * mean gap of the k+1 best)
    fixed_iterations: bool = False  # soft mode: the search without host synchronisation (select_beams)
    #: soft mode, linear cost, entropic, all candidates: the selection's static window of each row's best candidates
    #: (:func:`~fairseq_softtopk.ops.sorted_soft_topk_window`, no host synchronisation a step): -1 its default
    #: width for the scores' shape and epsilon, W > 0 that width, 0 the adaptive window (the solver's, which reads
    #: values on the host every step)
    window_width: int = -1
    compile: str = ""  # with fixed_iterations: the solve under torch.compile in this mode (COMPILE_MODES)
    regularizer: str = "entropic"  # soft mode: "entropic" (sorted_soft_topk) | "quadratic" (sorted_sparse_soft_topk)
    #: the operators' implementation (:mod:`~fairseq_softtopk.ops.kernels`): "auto" | "torch" | "triton"
    backend: str = "auto"

    def __post_init__(self):
        if not is_integer(self.beam) or self.beam < 1:
            raise ValueError(f"beam must be an integer >= 1, got {self.beam!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not is_positive_number(self.epsilon):
            raise ValueError(f"epsilon must be a finite number > 0 (with regularizer 'quadratic': its lambda), got "
                             f"{self.epsilon!r}")
        if self.cost not in COSTS:
            raise ValueError(f"cost must be one of {COSTS}, got {self.cost!r}")
        if not is_positive_number(self.tol):
            raise ValueError(f"tol must be a finite number > 0, got {self.tol!r}")
        if not is_integer(self.max_iter) or self.max_iter < 1:
            raise ValueError(f"max_iter must be an integer >= 1, got {self.max_iter!r}")
        if not is_integer(self.candidate_pool) or (self.candidate_pool != 0 and self.candidate_pool < self.beam):
            raise ValueError(f"candidate_pool must be 0 (all candidates) or an integer >= beam ({self.beam}), got "
                             f"{self.candidate_pool!r}")
        if self.selection_grad not in SELECTION_GRADS:
            raise ValueError(f"selection_grad must be one of {SELECTION_GRADS}, got {self.selection_grad!r}")
        if self.selection_grad == "capped" and not self.selection_grad_cap > 0:
            raise ValueError(f"selection_grad_cap must be > 0, got {self.selection_grad_cap}")
        if not self.epsilon_relative >= 0:
            raise ValueError(f"epsilon_relative must be >= 0, got {self.epsilon_relative}")
        if self.epsilon_relative > 0 and self.cost != "linear":
            raise ValueError(f"epsilon_relative needs the linear cost (its epsilon is in units of the scores), "
                             f"got cost {self.cost!r}")
        if self.regularizer not in REGULARIZERS:
            raise ValueError(f"regularizer must be one of {REGULARIZERS}, got {self.regularizer!r}")
        if self.regularizer == "quadratic" and (self.cost != "linear" or self.compile):
            raise ValueError(f"the quadratic regularizer needs the linear cost and no compile, got cost {self.cost!r} "
                             f"and compile {self.compile!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not is_integer(self.window_width) or self.window_width < -1 or 0 < self.window_width < self.beam:
            raise ValueError(f"window_width must be -1 (the default width), 0 (the adaptive window) or an integer >= "
                             f"beam ({self.beam}), got {self.window_width!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {self.compile!r}")
        if self.compile and not (self.fixed_iterations and self.mode == "soft"):
            raise ValueError("compile needs the sync-free solve (fixed_iterations, soft mode): the default solve reads "
                             "values on the host, which torch.compile cannot trace whole")

    @property
    def uses_static_window(self) -> bool:
        """Whether soft mode selects through :func:`~fairseq_softtopk.ops.sorted_soft_topk_window`: the linear cost,
        the entropic regulariser, every candidate, not the fixed-iteration search, ``window_width`` given, or left
        to its default at an epsilon of at most ``WINDOW_MAX_EPSILON`` (0.1; above it real windows outgrow any
        static width worth taking: the adaptive window serves them)."""
        return (self.mode == "soft" and self.cost == "linear" and self.regularizer == "entropic"
                and not self.candidate_pool and not self.fixed_iterations
                and (self.window_width > 0 or (self.window_width < 0 and self.epsilon <= WINDOW_MAX_EPSILON)))

    @property
    def grad_cap(self) -> float:
        """The cap on the selection gradient per sentence and step (``inf`` unless ``"capped"``)."""
        return self.selection_grad_cap if self.selection_grad == "capped" else math.inf


def annealed_epsilon(start: float, end: float, update: int, anneal_updates: int) -> float:
    """Epsilon at ``update`` of a geometric schedule from ``start`` (update 0) to ``end``.

    Geometric because epsilon acts on a log scale (the split of two candidates a gap ``d``
    apart depends on ``d / epsilon``): each update scales epsilon by the same factor.
    After ``anneal_updates`` updates it stays at ``end``.
    """
    if anneal_updates <= 0 or update >= anneal_updates:
        return end
    return start * (end / start) ** (max(update, 0) / anneal_updates)
