"""The beamgrad arm (criterions/beamgrad_risk.py): the peer's search driving this package's models. Skipped
where beamgrad (an optional, compiled extra) is not installed, except the test of the message that says so."""

import sys

import pytest
import torch

from builders import build_model, build_stock_transformer, build_transformer, make_sample
from conftest import word_dictionary

from fairseq_softtopk.modules.beam_search import BeamSearchConfig, unroll_beam_search
from fairseq_softtopk.modules.incremental_decoder_unroll import IncrementalDecoderUnroll
from fairseq_softtopk.modules.sequence_risk import expected_risk, sentence_bleu_costs


@pytest.fixture
def dictionary():
    return word_dictionary(13)


def _criterion(dictionary, **options):
    from types import SimpleNamespace

    from fairseq_softtopk.criterions.beamgrad_risk import BeamgradRiskCriterion

    return BeamgradRiskCriterion(SimpleNamespace(target_dictionary=dictionary), **options)


def test_without_beamgrad_the_criterion_names_the_install_command(dictionary, monkeypatch):
    monkeypatch.setitem(sys.modules, "beamgrad", None)  # import beamgrad raises ImportError
    with pytest.raises(ImportError, match=r"needs the optional package beamgrad: pip install --no-build-isolation "
                                          r"beamgrad==2\.3\.0"):
        _criterion(dictionary)


@pytest.mark.parametrize("build", [build_transformer, build_stock_transformer], ids=["softtopk_transformer", "transformer"])
def test_beamgrads_search_over_the_driven_decoder_is_the_hard_unroll_without_eos(dictionary, rng, build):
    """With EOS disabled and no length penalty beamgrad's search is plain beam search: over a Transformer driven
    through its reordered caches it keeps the beams and scores of the package's hard unroll (which an independent
    loop checks in test_transformer_beam_search)."""
    pytest.importorskip("beamgrad")
    model = build(dictionary, share_all_embeddings=False)
    with torch.no_grad():
        model.decoder.output_projection.weight.mul_(3.0)
    sample = make_sample(dictionary, rng, [5, 5, 5], src_len=7)
    criterion = _criterion(dictionary, train_beam=3)
    criterion.eos = -1  # no EOS: every beam runs max_len + 1 = 5 steps
    bos = dictionary.eos()
    with torch.no_grad():
        encoder_out = model.encoder(sample["net_input"]["src_tokens"], src_lengths=sample["net_input"]["src_lengths"])
        result = criterion.search(model.encoder, IncrementalDecoderUnroll(model.decoder, bos), encoder_out, 3, bos,
                                  4, torch.device("cpu"))
        ours = unroll_beam_search(IncrementalDecoderUnroll(model.decoder, bos), encoder_out,
                                  model.encoder.reorder_encoder_out, sample["target"], dictionary.pad(), bos,
                                  BeamSearchConfig(beam=3, mode="hard"))
    assert torch.equal(result.sequences, ours.tokens)
    torch.testing.assert_close(result.scores.double(), ours.final_scores.double(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("architecture", ["softtopk_lstm", "softtopk_transformer"])
def test_the_beamgrad_arm_trains_through_the_search(dictionary, rng, architecture):
    """The loss is p * tf + (1 - p) * sum_s len_s * minimum_risk, minimum_risk the expected BLEU+1 cost under the
    softmax of beamgrad's scores; its gradient reaches the decoder."""
    beamgrad = pytest.importorskip("beamgrad")
    model = (build_model(dictionary, scale=3.0) if architecture == "softtopk_lstm"
             else build_transformer(dictionary))
    sample = make_sample(dictionary, rng, [5, 3, 4], src_len=7)
    criterion = _criterion(dictionary, train_beam=3, teacher_forcing_ratio=0.0, beam_loss_temperature=0.5,
                           beam_max_len_a=1.0, beam_max_len_b=2)
    captured = []
    original = beamgrad.beam_search
    try:
        beamgrad.beam_search = lambda *a, **k: captured.append(original(*a, **k)) or captured[-1]
        with torch.no_grad():
            criterion(model, sample)
        # references that share n-grams with the hypotheses (with random ones every cost is 1: no gradient)
        first = torch.where(captured[0].sequences < 0, dictionary.pad(), captured[0].sequences)
        for s, length in enumerate([5, 3, 4]):
            sample["target"][s, :length - 1] = first[s, 1, :length - 1]
        loss, sample_size, log = criterion(model, sample)  # the search does not depend on the target
    finally:
        beamgrad.beam_search = original
    assert sample_size == sample["ntokens"]
    result = captured[-1]
    hypotheses = torch.where(result.sequences < 0, dictionary.pad(), result.sequences)
    costs = sentence_bleu_costs(hypotheses, sample["target"], dictionary.eos(), dictionary.pad())
    risk = expected_risk(result.scores.double(), costs, 0.5)
    lengths = sample["target"].ne(dictionary.pad()).sum(-1)
    assert float(loss) == pytest.approx(float((risk * lengths).sum()), rel=1e-6)  # beamgrad scores in float32
    assert 0.3 < float(log["beam_risk_sum"]) < 2.7  # costs between 0 and 1
    loss.backward()
    assert any(float(p.grad.abs().sum()) > 0 for p in model.decoder.parameters() if p.grad is not None)
