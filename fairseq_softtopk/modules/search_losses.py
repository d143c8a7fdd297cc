"""The losses on a training search's output: the gold-token NLL along the best beam (the paper's) and the
expected risk of the finished hypotheses (minimum-risk training on the beams). Shared by the public search API
(:mod:`fairseq_softtopk.search`) and the fairseq criterion; torch only."""

from typing import NamedTuple

import torch
from torch import Tensor

from .beam_search import BeamSearchOutput
from .beam_search_to_eos import FinishedBeams
from ..number_checks import is_finite_number
from .sequence_risk import expected_risk, scale_costs, sentence_bleu_costs

__all__ = ["GoldTokenLoss", "gold_token_loss", "risk_loss", "smoothed_nll"]


def smoothed_nll(gold_lprobs: Tensor, sum_lprobs: Tensor, mask: Tensor, epsilon: float, vocab: int):
    """Label-smoothed NLL summed over unmasked positions, as fairseq's label_smoothed_nll_loss.

    Args:
        gold_lprobs: ``(...)`` log-probability of the gold token.
        sum_lprobs: ``(...)`` sum of the log-probabilities over the vocabulary.
        mask: ``(...)`` bool, True where the position counts.
    Returns:
        ``(loss, nll_loss)`` scalars.
    """
    nll = -(gold_lprobs * mask).sum()
    smooth = -(sum_lprobs * mask).sum()
    eps_i = epsilon / (vocab - 1)
    return (1.0 - epsilon - eps_i) * nll + eps_i * smooth, nll


class GoldTokenLoss(NamedTuple):
    loss: Tensor  # the label-smoothed NLL of the gold tokens along the best beam, summed over tokens
    nll: Tensor  # their NLL, summed
    ntokens: Tensor  # the target's tokens (not padding): the sum's count


def gold_token_loss(output: BeamSearchOutput, target: Tensor, pad: int, label_smoothing: float = 0.0,
                    vocab: int = 0) -> GoldTokenLoss:
    """The paper's beam loss: the NLL of the gold tokens along the beam that ends best (backtracked).

    Args:
        output: the search's output (:func:`fairseq_softtopk.search.beam_search`) for ``target``.
        target: ``(batch, T)`` the gold tokens the search ran along, padded with ``pad``.
        label_smoothing: as fairseq's ``label_smoothed_cross_entropy`` (needs ``vocab``, the output size).
    """
    if not is_finite_number(label_smoothing) or not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be a number in [0, 1), got {label_smoothing!r}")
    if label_smoothing and vocab < 2:
        raise ValueError(f"label smoothing needs the vocabulary's size (vocab=), got {vocab}")
    if output.gold_lprobs.shape != target.shape:
        raise ValueError(f"the search ran {tuple(output.gold_lprobs.shape)} (batch, steps) but the target is "
                         f"{tuple(target.shape)}")
    mask = target.ne(pad)
    loss, nll = smoothed_nll(output.gold_lprobs, output.smooth_lprobs, mask, label_smoothing, max(vocab, 2))
    return GoldTokenLoss(loss, nll, mask.sum())


def risk_loss(finished: FinishedBeams, target: Tensor, eos: int, pad: int, temperature: float = 1.0,
              cost: str = "bleu") -> Tensor:
    """``(batch,)`` expected ``1 - BLEU+1`` (on token ids) of each sentence's finished hypotheses under a softmax
    of their length-normalised scores at ``temperature`` (differentiable through the scores), the cost in the
    unit ``cost`` (:func:`~fairseq_softtopk.modules.sequence_risk.scale_costs`: ``bleu``, ``bleu_points``
    or ``minmax``).

    Args:
        finished: the output of :func:`fairseq_softtopk.search.beam_search_to_eos`.
        target: ``(batch, T)`` the references, read up to their EOS or padding.
    """
    if not torch.is_tensor(target) or target.dim() != 2 or target.shape[0] != finished.tokens.shape[0]:
        raise ValueError(f"target must be (batch, T) with the search's batch of {finished.tokens.shape[0]} "
                         f"sentences, got {tuple(target.shape) if torch.is_tensor(target) else type(target).__name__}")
    costs = scale_costs(sentence_bleu_costs(finished.tokens, target, eos, pad), finished.scores, cost)
    return expected_risk(finished.scores, costs, temperature)
