"""What a beam search's selections add up over its steps (:class:`SearchCounts`): kept per step on the device
and summed once the search is over, so that counting costs no host read and a few launches a batch."""

from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from ..ops.sorted_soft_topk_window import WindowSolverInfo

__all__ = ["SearchCounts"]


class SearchCounts:
    """What a search's selections add up: unconverged solves (a device tensor with fixed iterations, read once
    after the search), Newton iterations, the sum of the gradient cap's scale probes, the candidates mixed into the
    new beams (sums on the device), and the static window's per-row infos, summed once the search is over (a few
    launches a batch rather than a step)."""

    def __init__(self):
        self._unconverged: Union[int, Tensor] = 0
        self._newton_iters: Union[int, Tensor] = 0
        self._probes: List[Tensor] = []
        self._windows: List[WindowSolverInfo] = []
        self._window_sums: Optional[Tuple[Tensor, Tensor, Tensor]] = None
        self.mixed_sum: Optional[Tensor] = None
        self.mixed_count: Optional[Tensor] = None

    def add_mixed(self, weights: Tensor, live: Tensor) -> None:
        """Counts the candidates with a nonzero weight ``(batch, m, beam)`` of the ``live`` ``(batch,)`` sentences."""
        mixed = ((weights.detach().sum(-1) > 0).sum(-1) * live).sum()
        count = live.sum()
        self.mixed_sum = mixed if self.mixed_sum is None else self.mixed_sum + mixed
        self.mixed_count = count if self.mixed_count is None else self.mixed_count + count

    def add(self, converged: Union[bool, Tensor], n_iter: int, probe: Optional[Tensor],
            window: Optional[WindowSolverInfo] = None) -> None:
        if probe is not None:
            self._probes.append(probe)
        if window is not None:  # summed when read
            self._windows.append(window)
            self._window_sums = None
            return
        self._unconverged = (self._unconverged + (~converged).long() if torch.is_tensor(converged)
                             else self._unconverged + int(not converged))
        self._newton_iters = self._newton_iters + n_iter

    def _sum_windows(self) -> Optional[Tuple[Tensor, Tensor, Tensor]]:
        """``(steps that missed the tolerance, Newton iterations (each step's largest), uncertified rows)`` of
        the static window's steps, 0-dim tensors; None without such steps."""
        if self._window_sums is None and self._windows:
            windows = self._windows
            if len({w.row_error.shape for w in windows}) == 1:  # one reduction over the steps' rows
                errors = torch.stack([w.row_error for w in windows]).amax(-1)
                iterations = torch.stack([w.row_iterations for w in windows]).amax(-1)
                overflow = torch.stack([w.overflow for w in windows]).sum()
            else:
                errors = torch.stack([w.marginal_error for w in windows])
                iterations = torch.stack([w.n_iter for w in windows])
                overflow = torch.stack([w.n_overflow for w in windows]).sum()
            self._window_sums = ((errors > windows[0].tol).sum(), iterations.sum(), overflow)
        return self._window_sums

    @property
    def n_unconverged(self) -> Union[int, Tensor]:
        """Steps whose top-k solve missed its tolerance."""
        sums = self._sum_windows()
        return self._unconverged if sums is None else self._unconverged + sums[0]

    @property
    def newton_iters(self) -> Union[int, Tensor]:
        """Newton iterations of the steps' solves."""
        sums = self._sum_windows()
        return self._newton_iters if sums is None else self._newton_iters + sums[1]

    @property
    def n_overflow(self) -> Optional[Tensor]:
        """The static window's uncertified rows over the steps (a device count; None: no step used the window)."""
        sums = self._sum_windows()
        return None if sums is None else sums[2]

    @property
    def newest_overflow(self) -> Optional[Tensor]:
        """The newest static-window step's uncertified rows (a device count; None: no step used the window): what a
        search that reads every step needs, the earlier steps' counts having been read at theirs."""
        return self._windows[-1].n_overflow if self._windows else None

    @property
    def scale_probe(self) -> Optional[Tensor]:
        """The sum of the gradient cap's scale probes (None: no step had one)."""
        if not self._probes:
            return None
        return self._probes[0] if len(self._probes) == 1 else torch.stack(self._probes).sum()
