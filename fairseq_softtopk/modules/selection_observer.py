"""Observing the beam search's selections: every decoding step's choice of the next beams, as it is made.

Within ``with observe_selections(observer):`` every search of this package that runs in the process (the
public :mod:`fairseq_softtopk.search`, the fairseq criteria, the Hugging Face losses; any thread) calls
``observer(selection)`` once per decoding step that selects next beams, with a :class:`StepSelection`.
Unused, it costs one check of an empty list per step: no tensor operation, no launch, no host read.
"""

import contextlib
from typing import Callable, Iterator, List, NamedTuple

from torch import Tensor

__all__ = ["SelectionObserver", "StepSelection", "observe_selections"]


class StepSelection(NamedTuple):
    """One decoding step's choice of the next beams (tensors detached from autograd; ``batch`` sentences,
    ``beam`` beams, ``V`` tokens, ``m`` candidates kept).

    Attributes:
        step: the decoding step, from 0 (the search that stops at EOS makes no selection at its last step).
        scores: ``(batch, beam * V)`` the candidates' cumulative log-likelihoods as the selection saw them
            (candidate ``i * V + j``: beam ``i`` extended by token ``j``; with ``epsilon_relative`` divided by
            the row's scale; ``-inf`` for candidates that cannot be chosen).
        candidates: ``(batch, m)`` the candidate ids the selection kept (all ``beam * V``, a window or a pool).
        weights: ``(batch, m, beam)`` the weight of each kept candidate in each new beam (one-hot columns in
            hard mode; 0 at padded entries).
        followed: ``(batch, beam)`` the candidate id each new beam follows (the argmax of its column).
        live: ``(batch,)`` bool: the sentences whose selection here can reach the loss.
    """

    step: int
    scores: Tensor
    candidates: Tensor
    weights: Tensor
    followed: Tensor
    live: Tensor


SelectionObserver = Callable[[StepSelection], None]

#: the observers of the open ``observe_selections`` blocks (the search checks it once per step)
OBSERVERS: List[SelectionObserver] = []


@contextlib.contextmanager
def observe_selections(observer: SelectionObserver) -> Iterator[SelectionObserver]:
    """Calls ``observer(StepSelection)`` at every selection of every search run inside the block (see the
    module's docstring); blocks nest, each observer sees every step. Yields ``observer``.

    Raises:
        TypeError: if ``observer`` is not callable.
    """
    if not callable(observer):
        raise TypeError(f"observe_selections needs a callable taking a StepSelection, got {type(observer).__name__}")
    OBSERVERS.append(observer)
    try:
        yield observer
    finally:
        OBSERVERS.remove(observer)


def notify(selection: StepSelection) -> None:
    """Hands ``selection`` to every open observer (the search calls this only when :data:`OBSERVERS` is not
    empty)."""
    for observer in list(OBSERVERS):
        observer(selection)
