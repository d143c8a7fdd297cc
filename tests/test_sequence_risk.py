"""The risk of the final beams (modules/sequence_risk.py): BLEU+1 against sacrebleu, the expected cost against a
direct sum over the beams, and the criterion's --beam-loss risk."""

import math
import random

import pytest
import torch

from fairseq_softtopk.modules.sequence_risk import (expected_risk, sentence_bleu, sentence_bleu_costs,
                                                    strip_sequence)


def test_sentence_bleu_is_sacrebleus_add_one_sentence_bleu_on_token_ids():
    """sacrebleu's sentence BLEU with smooth_method add-k, k = 1, on the ids written as words (no tokenisation)."""
    from sacrebleu.metrics import BLEU

    reference_bleu = BLEU(tokenize="none", smooth_method="add-k", smooth_value=1, effective_order=False)
    rng = random.Random(0)
    nonzero = 0
    for _ in range(500):
        hypothesis = [rng.randrange(6) for _ in range(rng.randrange(0, 12))]
        reference = [rng.randrange(6) for _ in range(rng.randrange(1, 12))]
        expected = reference_bleu.sentence_score(" ".join(map(str, hypothesis)),
                                                 [" ".join(map(str, reference))]).score / 100
        assert sentence_bleu(hypothesis, reference) == pytest.approx(expected, abs=1e-12)
        nonzero += expected > 0
    assert nonzero > 300
    assert sentence_bleu([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0 and sentence_bleu([], [1, 2]) == 0.0


def test_costs_read_each_beam_up_to_its_first_eos():
    eos, pad = 2, 1
    hypotheses = torch.tensor([[[5, 6, 7, 8, eos, 9], [5, 6, 7, 9, 9, eos]], [[4, 4, eos, 5, 5, 5], [eos, 4, 4, 4, 4, 4]]])
    target = torch.tensor([[5, 6, 7, 8, eos, pad], [4, 4, 4, eos, pad, pad]])
    costs = sentence_bleu_costs(hypotheses, target, eos, pad)
    expected = [[1 - sentence_bleu([5, 6, 7, 8], [5, 6, 7, 8]), 1 - sentence_bleu([5, 6, 7, 9, 9], [5, 6, 7, 8])],
                [1 - sentence_bleu([4, 4], [4, 4, 4]), 1 - sentence_bleu([], [4, 4, 4])]]
    torch.testing.assert_close(costs, torch.tensor(expected, dtype=torch.float64))
    assert costs[0, 0] == 0.0 and costs[1, 1] == 1.0
    assert strip_sequence([3, pad, 4], eos, pad) == [3]


def test_expected_risk_is_the_softmax_weighted_sum_of_the_costs_and_its_gradient():
    rng = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 4, generator=rng, dtype=torch.float64, requires_grad=True)
    costs = torch.rand(3, 4, generator=rng, dtype=torch.float64)
    for temperature in (1.0, 0.5):
        risk = expected_risk(scores, costs, temperature)
        for b in range(3):
            weights = [math.exp(float(s) / temperature) for s in scores[b]]
            direct = sum(w * float(c) for w, c in zip(weights, costs[b])) / sum(weights)
            assert float(risk[b]) == pytest.approx(direct, abs=1e-12)
        assert torch.autograd.gradcheck(lambda s: expected_risk(s, costs, temperature), (scores,))
    # a beam that does not exist (-inf score) gets no weight
    masked = scores.detach().clone()
    masked[:, -1] = -float("inf")
    torch.testing.assert_close(expected_risk(masked, costs), expected_risk(masked[:, :-1], costs[:, :-1]))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        expected_risk(scores, costs, 0.0)


def test_scaled_costs_in_bleu_points_and_min_max_per_sentence():
    """bleu_points: 100 x the cost; minmax: per sentence over the hypotheses present (finite score), computed here
    directly; a sentence whose hypotheses all cost the same, and empty slots, get 0."""
    from fairseq_softtopk.modules.sequence_risk import scale_costs

    costs = torch.tensor([[0.2, 0.5, 0.4, 0.9], [0.3, 0.3, 0.3, 0.3], [0.6, 0.1, 0.35, 1.0]], dtype=torch.float64)
    scores = torch.tensor([[-1.0, -2.0, -3.0, -float("inf")], [-1.0, -1.5, -2.0, -2.5], [-1.0, -2.0, -3.0, -4.0]],
                          dtype=torch.float64)
    torch.testing.assert_close(scale_costs(costs, scores, "bleu"), costs)
    torch.testing.assert_close(scale_costs(costs, scores, "bleu_points"), costs * 100)
    expected = []
    for row_costs, row_scores in zip(costs.tolist(), scores.tolist()):
        present = [c for c, s in zip(row_costs, row_scores) if math.isfinite(s)]
        low, high = min(present), max(present)
        expected.append([(c - low) / (high - low) if math.isfinite(s) and high > low else 0.0
                         for c, s in zip(row_costs, row_scores)])
    scaled = scale_costs(costs, scores, "minmax")
    torch.testing.assert_close(scaled, torch.tensor(expected, dtype=torch.float64))
    assert scaled[0].tolist() == [0.0, 1.0, pytest.approx(2 / 3), 0.0]  # the empty slot (cost 0.9) is left out
    assert scaled[1].tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="cost must be one of"):
        scale_costs(costs, scores, "chrf")
