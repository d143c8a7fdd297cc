"""Sequence-level risk of the final beams: minimum-risk training (Shen et al., ACL 2016) on a beam search.

The risk of a sentence is the expected cost of its k final beams under a softmax of their scores at a
temperature,

    risk = sum_l softmax(scores / temperature)_l * cost_l,

with ``cost_l = 1 - BLEU+1(beam l, reference)``, the sentence BLEU of Lin and Och (2004): n-gram
precisions up to 4 with 1 added to the matches and to the n-grams of every order n > 1, the brevity
penalty of corpus BLEU, 0 without a matching unigram (sacrebleu's ``smooth_method="add-k"``,
``smooth_value=1``). It is computed on token ids (BPE pieces), the units the model predicts: no
detokenisation inside the training step, and a cost every hypothesis gets exactly, whatever its
surface form. :func:`scale_costs` gives the cost in other units: BLEU points (``100 * (1 - BLEU+1)``, the
unit of Edunov et al., NAACL 2018) or min-max scaled over each sentence's hypotheses (their best 0, their
worst 1), which sizes the risk's gradient against a token loss's. The cost has no gradient; the gradient reaches the scores, and through them (in soft
mode) the selections that built the beams.
"""

import math
from collections import Counter
from typing import List, Sequence

import torch
from torch import Tensor

__all__ = ["RISK_COSTS", "expected_risk", "scale_costs", "sentence_bleu", "sentence_bleu_costs", "strip_sequence"]

MAX_ORDER = 4
#: the units of the cost (:func:`scale_costs`)
RISK_COSTS = ("bleu", "bleu_points", "minmax")


def _ngrams(tokens: Sequence[int], n: int) -> Counter:
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def sentence_bleu(hypothesis: Sequence[int], reference: Sequence[int]) -> float:
    """BLEU+1 of one hypothesis against one reference, in [0, 1] (see the module docstring)."""
    if not hypothesis:
        return 0.0
    log_precision = 0.0
    for n in range(1, MAX_ORDER + 1):
        hyp, ref = _ngrams(hypothesis, n), _ngrams(reference, n)
        matches = sum(min(count, ref[gram]) for gram, count in hyp.items())
        total = max(len(hypothesis) - n + 1, 0)
        if n == 1 and matches == 0:
            return 0.0
        if n > 1:
            matches, total = matches + 1, total + 1
        log_precision += math.log(matches / total) / MAX_ORDER
    ratio = len(reference) / len(hypothesis)
    brevity = 1.0 if ratio <= 1.0 else math.exp(1.0 - ratio)
    return brevity * math.exp(log_precision)


def strip_sequence(tokens: Sequence[int], eos: int, pad: int) -> List[int]:
    """The tokens before the first EOS (or padding): the sentence a decoder would output."""
    out = []
    for token in tokens:
        if token == eos or token == pad:
            break
        out.append(int(token))
    return out


def sentence_bleu_costs(hypotheses: Tensor, target: Tensor, eos: int, pad: int) -> Tensor:
    """``1 - BLEU+1`` of every beam against its sentence's reference.

    Args:
        hypotheses: ``(batch, beam, T)`` token ids of the final beams (read up to their first EOS).
        target: ``(batch, T')`` the references (read up to their EOS or padding).
    Returns:
        ``(batch, beam)`` costs in [0, 1], on the device of ``hypotheses``, float64 (no gradient).
    """
    references = [strip_sequence(row, eos, pad) for row in target.tolist()]  # one host read per batch
    costs = [[1.0 - sentence_bleu(strip_sequence(beam, eos, pad), reference) for beam in beams]
             for beams, reference in zip(hypotheses.tolist(), references)]
    return torch.tensor(costs, dtype=torch.float64, device=hypotheses.device)


def scale_costs(costs: Tensor, scores: Tensor, unit: str = "bleu") -> Tensor:
    """``1 - BLEU+1`` costs in the unit ``unit``.

    Args:
        costs: ``(batch, beam)`` ``1 - BLEU+1`` of each hypothesis (:func:`sentence_bleu_costs`).
        scores: ``(batch, beam)`` their scores: a ``-inf`` slot is no hypothesis (left out of the min-max).
        unit: ``bleu`` (as given, in [0, 1]), ``bleu_points`` (times 100) or ``minmax`` (per sentence,
            ``(cost - min) / (max - min)`` over its hypotheses; 0 where they all cost the same).
    Returns:
        ``(batch, beam)`` the costs (0 in empty slots with ``minmax``).
    """
    if unit == "bleu":
        return costs
    if unit == "bleu_points":
        return costs * 100.0
    if unit != "minmax":
        raise ValueError(f"the risk's cost must be one of {RISK_COSTS}, got {unit!r}")
    present = torch.isfinite(scores)
    low = costs.masked_fill(~present, math.inf).min(-1, keepdim=True).values
    high = costs.masked_fill(~present, -math.inf).max(-1, keepdim=True).values
    spread = high - low
    scaled = (costs - low) / spread.clamp_min(1e-12)
    return torch.where(present & (spread > 0), scaled, torch.zeros_like(scaled))


def expected_risk(scores: Tensor, costs: Tensor, temperature: float = 1.0) -> Tensor:
    """``(batch,)`` expected cost of the beams under ``softmax(scores / temperature)``.

    Args:
        scores: ``(batch, beam)`` the beams' scores (differentiable); ``-inf`` beams get no weight.
        costs: ``(batch, beam)`` their costs.
    """
    if not temperature > 0:
        raise ValueError(f"the risk's temperature must be > 0, got {temperature}")
    weights = torch.softmax(scores / temperature, dim=-1)
    return (weights * costs.to(weights.dtype)).sum(-1)
