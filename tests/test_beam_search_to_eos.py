"""The training search that decodes as fairseq-generate (modules/beam_search_to_eos.py) and the risk loss on its
hypotheses (--beam-loss risk), in float64, against fairseq's own SequenceGenerator, sacrebleu and finite
differences, for the plugin's LSTM, the plugin's Transformer and fairseq's transformer."""

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from builders import build_criterion, build_model, build_stock_transformer, build_transformer, make_sample
from conftest import word_dictionary

from fairseq_softtopk.modules.beam_search import BeamSearchConfig
from fairseq_softtopk.modules.beam_search_to_eos import search_max_len, unroll_beam_search_to_eos
from fairseq_softtopk.modules.incremental_decoder_unroll import IncrementalDecoderUnroll
from fairseq_softtopk.modules.sequence_risk import expected_risk, sentence_bleu_costs, strip_sequence


def favouring_eos(model, eos: int, bias: float):
    """The model with ``bias`` added to its EOS logit, so that hypotheses end at several lengths."""
    output_layer = model.decoder.output_layer
    shift = torch.zeros(len(model.decoder.dictionary), dtype=torch.float64)
    shift[eos] = bias
    model.decoder.output_layer = lambda features: output_layer(features) + shift.to(features.dtype)
    return model


def _sharpened_transformer(build):
    def make(dictionary):
        model = build(dictionary, share_all_embeddings=False)
        with torch.no_grad():
            model.decoder.output_projection.weight.mul_(3.0)
        return favouring_eos(model, dictionary.eos(), 1.8)
    return make


# (the EOS biases: hypotheses of several lengths in the test's batch)
MODELS = {"softtopk_lstm": lambda dictionary: favouring_eos(build_model(dictionary, scale=3.0), dictionary.eos(), 0.4),
          "softtopk_transformer": _sharpened_transformer(build_transformer),
          "transformer": _sharpened_transformer(build_stock_transformer)}


@pytest.fixture(autouse=True)
def softmax_in_the_models_dtype(monkeypatch):
    """fairseq's incremental attention takes its softmax in float32; float64 here (see test_transformer_beam_search)."""
    import fairseq.utils

    monkeypatch.setattr(fairseq.utils, "softmax", lambda x, dim, onnx_trace=False: torch.softmax(x, dim=dim))


@pytest.fixture
def dictionary():
    return word_dictionary(13)


def step_interface(model, eos):
    """The decoder as the search drives it: the LSTM's own step interface, a Transformer's through its caches."""
    return model.decoder if hasattr(model.decoder, "step") else IncrementalDecoderUnroll(model.decoder, eos)


def search(model, sample, dictionary, max_len_a=1.0, max_len_b=2, lenpen=0.6, **config):
    encoder_out = model.encoder(sample["net_input"]["src_tokens"], src_lengths=sample["net_input"]["src_lengths"])
    max_len = search_max_len(sample["net_input"]["src_tokens"].size(1), max_len_a, max_len_b,
                             model.max_decoder_positions())
    eos = dictionary.eos()
    return unroll_beam_search_to_eos(step_interface(model, eos), encoder_out, model.encoder.reorder_encoder_out,
                                     sample["target"].size(0), dictionary.pad(), eos, eos, BeamSearchConfig(**config),
                                     max_len, lenpen)


@pytest.mark.parametrize("lenpen", [0.6, 1.0])
@pytest.mark.parametrize("architecture", sorted(MODELS))
def test_hard_mode_finishes_the_hypotheses_of_fairseqs_sequence_generator(dictionary, rng, architecture, lenpen):
    """Tokens (EOS included) and length-normalised scores of every finished hypothesis, best first, as
    fairseq-generate's SequenceGenerator (beam 3, max length 1.0 * source + 2, the length penalty)."""
    model = MODELS[architecture](dictionary).eval()
    sample = make_sample(dictionary, rng, [5, 3, 4, 6], src_len=7)
    generator = SequenceGenerator([model], dictionary, beam_size=3, max_len_a=1.0, max_len_b=2, len_penalty=lenpen)
    with torch.no_grad():
        hypotheses = generator.generate([model], sample)
        out = search(model, sample, dictionary, lenpen=lenpen, beam=3, mode="hard")
    lengths = set()
    for s, finished in enumerate(hypotheses):
        assert len(finished) == 3
        for r, hypothesis in enumerate(finished):
            length = int(out.lengths[s, r])
            assert out.tokens[s, r, :length].tolist() == hypothesis["tokens"].tolist(), (s, r)
            assert bool((out.tokens[s, r, length:] == dictionary.pad()).all())
            # fairseq's log-probabilities are float32 (get_normalized_probs), the search's float64
            assert float(out.scores[s, r]) == pytest.approx(float(hypothesis["score"]), abs=1e-5)
            lengths.add(length)
    assert len(lengths) >= 2  # hypotheses of several lengths
    assert out.steps <= 7 + 2 + 1


@pytest.mark.parametrize("architecture", sorted(MODELS))
def test_soft_mode_tends_to_hard_mode(dictionary, rng, architecture):
    model = MODELS[architecture](dictionary)
    sample = make_sample(dictionary, rng, [5, 3, 4], src_len=6)
    with torch.no_grad():
        hard = search(model, sample, dictionary, beam=3, mode="hard")
        soft = search(model, sample, dictionary, beam=3, mode="soft", epsilon=1e-6, tol=1e-9)
        blurred = search(model, sample, dictionary, beam=3, mode="soft", epsilon=1.0, tol=1e-9)
    assert torch.equal(soft.tokens, hard.tokens) and torch.equal(soft.lengths, hard.lengths)
    torch.testing.assert_close(soft.scores, hard.scores, rtol=0, atol=1e-9)
    assert float(soft.sharpness_sum / soft.sharpness_count) > 0.999
    assert float((blurred.scores - hard.scores).abs().max()) > 1e-3  # a soft selection does differ


@pytest.mark.parametrize("mode", ["soft", "hard"])
def test_gradcheck_of_the_risk_of_the_finished_hypotheses(dictionary, rng, mode):
    """The expected cost of the finished hypotheses (costs held fixed: piecewise constant) against finite
    differences in the encoder states (soft: through the selections too), for every model."""
    for architecture, build in MODELS.items():
        model = build(dictionary)
        sample = make_sample(dictionary, rng, [3, 2], src_len=4)
        encoder_out = model.encoder(sample["net_input"]["src_tokens"], src_lengths=sample["net_input"]["src_lengths"])
        is_lstm = architecture == "softtopk_lstm"
        states = (encoder_out.states if is_lstm else encoder_out["encoder_out"][0]).detach().clone()
        states.requires_grad_(True)
        eos = dictionary.eos()
        config = BeamSearchConfig(beam=2, mode=mode, epsilon=0.5, tol=1e-12, selection_grad="full")

        def run(encoder_states):
            replaced = (encoder_out._replace(states=encoder_states) if is_lstm
                        else {**encoder_out, "encoder_out": [encoder_states]})
            return unroll_beam_search_to_eos(step_interface(model, eos), replaced, model.encoder.reorder_encoder_out,
                                             2, dictionary.pad(), eos, eos, config, max_len=5, lenpen=0.6)

        with torch.no_grad():
            out = run(states)
        costs = sentence_bleu_costs(out.tokens, sample["target"], eos, dictionary.pad())
        costs = costs + torch.arange(2, dtype=torch.float64)  # distinct costs: no gradient vanishes by symmetry
        assert torch.autograd.gradcheck(lambda s: expected_risk(run(s).scores, costs, 0.7), (states,),
                                        eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True), architecture


@pytest.mark.parametrize("architecture", sorted(MODELS))
def test_the_risk_loss_is_the_expected_cost_of_fairseq_generates_hypotheses(dictionary, rng, architecture):
    """--beam-loss risk in hard mode: the beam term is sum_s len_s * sum_r softmax(score / T)_r (1 - BLEU+1), over
    the hypotheses of fairseq's SequenceGenerator scored by sacrebleu (add-one smoothing, on the token ids)."""
    from sacrebleu.metrics import BLEU

    bleu = BLEU(tokenize="none", smooth_method="add-k", smooth_value=1, effective_order=False)
    model = MODELS[architecture](dictionary)
    lengths = [5, 3, 4]
    sample = make_sample(dictionary, rng, lengths, src_len=7)
    eos, pad = dictionary.eos(), dictionary.pad()
    generator = SequenceGenerator([model], dictionary, beam_size=3, max_len_a=1.0, max_len_b=2, len_penalty=0.6)
    with torch.no_grad():
        hypotheses = generator.generate([model.eval()], sample)
        model.train()
        # references that share n-grams with the hypotheses (with random ones every cost would be 1)
        for s, length in enumerate(lengths):
            body = strip_sequence(hypotheses[s][1]["tokens"].tolist(), eos, pad)[:length - 1]
            sample["target"][s, :len(body)] = torch.tensor(body, dtype=torch.long)
        criterion = build_criterion(dictionary, topk_mode="hard", beam_loss="risk", beam_loss_temperature=0.5,
                                    beam_lenpen=0.6, beam_max_len_a=1.0, beam_max_len_b=2)
        _, _, log = criterion(model, sample)
    expected = 0.0
    for s, length in enumerate(lengths):
        reference = " ".join(map(str, strip_sequence(sample["target"][s].tolist(), eos, pad)))
        costs = [1 - bleu.sentence_score(" ".join(map(str, strip_sequence(h["tokens"].tolist(), eos, pad))),
                                         [reference]).score / 100 for h in hypotheses[s]]
        weights = torch.softmax(torch.tensor([float(h["score"]) for h in hypotheses[s]], dtype=torch.float64) / 0.5, -1)
        expected += length * float(sum(w * c for w, c in zip(weights.tolist(), costs)))
    assert float(log["beam_loss"]) == pytest.approx(expected, rel=1e-5)
    assert 0.3 < float(log["beam_risk_sum"]) < 2.7 and float(log["beam_nll_loss"]) == 0.0


def test_a_maximum_length_without_room_for_a_token_is_refused():
    with pytest.raises(ValueError, match=r"maximum length is 0 \(max_len_a 0.0 \* source length 5 \+ max_len_b 0\)"):
        search_max_len(5, 0.0, 0, None)
    assert search_max_len(5, 1.2, 10, None) == 16 and search_max_len(5, 1.2, 10, 8) == 7
