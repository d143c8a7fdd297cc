"""The terms that the criteria ``soft_beam_search`` and ``beamgrad_risk`` compute besides the search:
the teacher-forcing loss from a fairseq model's output, and the weighting of sentence risks."""

from typing import NamedTuple

import torch

from ..modules.search_losses import smoothed_nll


class TeacherForcingLoss(NamedTuple):
    loss: torch.Tensor  # the label-smoothed NLL of the target's tokens, summed
    nll: torch.Tensor  # their NLL, summed
    mask: torch.Tensor  # (batch, T): the target's tokens (not padding)
    vocab: int  # the size of the output distribution


def teacher_forcing_loss(model, net_output, target: torch.Tensor, pad: int,
                         label_smoothing: float) -> TeacherForcingLoss:
    """The teacher-forcing term of both criteria, from the model's teacher-forced output
    (``model.get_normalized_probs``, fairseq's)."""
    lprobs = model.get_normalized_probs(net_output, log_probs=True)
    mask = target.ne(pad)
    gold = lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    loss, nll = smoothed_nll(gold, lprobs.sum(-1), mask, label_smoothing, lprobs.shape[-1])
    return TeacherForcingLoss(loss, nll, mask, lprobs.shape[-1])


def weighted_risk(risk: torch.Tensor, mask: torch.Tensor, sentence_avg: bool) -> torch.Tensor:
    """The ``(batch,)`` risks summed per target token, as the teacher-forcing term (per sentence with
    ``--sentence-avg``); ``mask`` ``(batch, T)``: the target's tokens."""
    return (risk if sentence_avg else risk * mask.sum(-1)).sum()
