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
