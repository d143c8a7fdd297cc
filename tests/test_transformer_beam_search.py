"""Beam-search training of Transformers (modules/incremental_decoder_unroll.py), in float64.

The references are independent of the unroll: a plain beam search over the decoder's own token-by-token
incremental forward (fairseq's ``reorder_incremental_state``), the decoder's full (non-incremental)
forward, finite differences (``gradcheck``) and data-parallel training in two processes.
"""

import pytest
import torch

from builders import build_criterion, build_stock_transformer, build_transformer, make_sample
from conftest import word_dictionary

from fairseq_softtopk.modules import beam_search as beam_search_module
from fairseq_softtopk.modules.beam_search import BeamSearchConfig, unroll_beam_search
from fairseq_softtopk.modules.beam_selection import Selection
from fairseq_softtopk.modules.incremental_decoder_unroll import IncrementalDecoderUnroll

ARCHITECTURES = {"softtopk_transformer": build_transformer, "transformer": build_stock_transformer}


@pytest.fixture(autouse=True)
def softmax_in_the_models_dtype(monkeypatch):
    """fairseq's MultiheadAttention computes its softmax in float32 when decoding incrementally, whatever the
    model's dtype; in these float64 tests it keeps float64, so that comparisons and finite differences are
    exact to the float64 rounding."""
    import fairseq.utils

    monkeypatch.setattr(fairseq.utils, "softmax", lambda x, dim, onnx_trace=False: torch.softmax(x, dim=dim))


@pytest.fixture
def dictionary():
    return word_dictionary(13)


def sharpened(model, factor: float = 3.0):
    """The model with its output projection scaled (peaked distributions: beams differ clearly)."""
    with torch.no_grad():
        model.decoder.output_projection.weight.mul_(factor)
    return model


@pytest.fixture(params=sorted(ARCHITECTURES))
def model(request, dictionary):
    return sharpened(ARCHITECTURES[request.param](dictionary, share_all_embeddings=False))


def encode(model, sample):
    return model.encoder(sample["net_input"]["src_tokens"], src_lengths=sample["net_input"]["src_lengths"])


def unroll(model, sample, target=None, **config):
    """The unrolled search over the sample (or ``target``) with the decoder driven on embeddings."""
    bos = int(sample["net_input"]["prev_output_tokens"][0, 0])
    target = sample["target"] if target is None else target
    pad = model.decoder.dictionary.pad()
    return unroll_beam_search(IncrementalDecoderUnroll(model.decoder, bos), encode(model, sample),
                              model.encoder.reorder_encoder_out, target, pad, bos, BeamSearchConfig(**config))


def reference_beam_search(model, sample, beam: int, steps: int):
    """A plain beam search over the decoder's token-by-token incremental forward, written out: every step keeps
    the ``beam`` best of the beam x V extensions but padding; the caches follow by fairseq's
    reorder_incremental_state.

    Returns ``[(tokens (batch, beam, t), scores (batch, beam)) for t = 1..steps]``.
    """
    decoder = model.decoder
    bos = int(sample["net_input"]["prev_output_tokens"][0, 0])
    batch = sample["target"].shape[0]
    enc = encode(model, sample)
    enc = model.encoder.reorder_encoder_out(enc, torch.arange(batch).repeat_interleave(beam))
    tokens = torch.full((batch * beam, 1), bos)
    scores = torch.full((batch, beam), -float("inf"), dtype=torch.float64)
    scores[:, 0] = 0.0
    cache = {}
    history = []
    for _ in range(steps):
        logits, _ = decoder(tokens, encoder_out=enc, incremental_state=cache)
        lprobs = torch.log_softmax(logits[:, -1], dim=-1).view(batch, beam, -1)
        lprobs[..., decoder.padding_idx] = -float("inf")  # as fairseq's SequenceGenerator
        V = lprobs.shape[-1]
        top = (scores.unsqueeze(-1) + lprobs).view(batch, -1).topk(beam, dim=-1)
        order = (top.indices // V + torch.arange(batch).unsqueeze(1) * beam).view(-1)
        decoder.reorder_incremental_state_scripting(cache, order)
        tokens = torch.cat([tokens[order], (top.indices % V).view(-1, 1)], 1)
        scores = top.values
        history.append((tokens[:, 1:].view(batch, beam, -1).clone(), scores.clone()))
    return history


def test_hard_mode_equals_an_independent_beam_search_step_for_step(model, dictionary, rng):
    """After every number of steps T, hard mode keeps exactly the beams and cumulative scores of the plain loop."""
    sample = make_sample(dictionary, rng, [5, 3, 4], src_len=7)
    beam, steps = 3, 5
    with torch.no_grad():
        reference = reference_beam_search(model, sample, beam, steps)
        for t, (tokens, scores) in enumerate(reference, start=1):
            target = torch.full((3, t), dictionary.eos())  # only its length matters to the beams
            out = unroll(model, sample, target, beam=beam, mode="hard")
            assert torch.equal(out.tokens, tokens), t
            torch.testing.assert_close(out.final_scores, scores, rtol=0, atol=1e-12)
    # the beams differ (the comparison is not between copies of one sequence)
    assert len({tuple(seq) for seq in tokens[0].tolist()}) == beam


def test_mixed_caches_equal_a_per_beam_recomputation_for_one_hot_weights(model, dictionary, rng):
    """Three beams decode different prefixes; new beams copy old ones through the *soft* mixing (one-hot
    weights, not an index); the next step's log-probabilities equal the decoder's full forward of each copied
    prefix, from scratch. The input embeddings fed in place of tokens are the tokens' own."""
    decoder = model.decoder
    eos, beam = dictionary.eos(), 3
    sample = make_sample(dictionary, rng, [4], src_len=6)
    prefixes = torch.randint(dictionary.nspecial, len(dictionary), (beam, 3), generator=rng)
    nxt = torch.randint(dictionary.nspecial, len(dictionary), (beam,), generator=rng)
    copy = [2, 0, 2]  # new beam l continues old beam copy[l]
    weights = torch.zeros(1, beam, beam, dtype=torch.float64)
    weights[0, copy, torch.arange(beam)] = 1.0
    unroll_decoder = IncrementalDecoderUnroll(decoder, eos)
    with torch.no_grad():
        enc = model.encoder.reorder_encoder_out(encode(model, sample), torch.zeros(beam, dtype=torch.long))
        state = unroll_decoder.initial_state(enc)
        for tokens in torch.cat([torch.full((beam, 1), eos), prefixes], 1).t():
            _, state = unroll_decoder.step(unroll_decoder.embed(tokens), state, enc)
        state = unroll_decoder.mix_state(state, weights)
        lprobs, _ = unroll_decoder.step(unroll_decoder.embed(nxt), state, enc)
        full_prefix = torch.cat([torch.full((beam, 1), eos), prefixes[copy], nxt.unsqueeze(1)], 1)
        expected = torch.log_softmax(decoder(full_prefix, encoder_out=enc)[0][:, -1], dim=-1)
    torch.testing.assert_close(lprobs, expected, rtol=0, atol=1e-10)


def test_soft_mode_with_one_hot_weights_equals_hard_mode(model, dictionary, rng, monkeypatch):
    """The soft path (embeddings mixed over all k x V candidates, caches mixed by weights) with one-hot weights
    gives hard mode's beams, scores, losses and parameter gradients."""
    sample = make_sample(dictionary, rng, [5, 3, 4], src_len=7)

    def one_hot_selection(scores, beam, config, kth, observe=None):
        batch, n = scores.shape
        A = torch.zeros(batch, n, beam, dtype=scores.dtype)
        A.scatter_(1, scores.detach().topk(beam, dim=-1).indices.unsqueeze(1), 1.0)
        return Selection(torch.arange(n).expand(batch, n), A, True, 0)

    def run(mode):
        model.zero_grad()
        out = unroll(model, sample, beam=3, mode=mode)
        (-(out.gold_lprobs.sum() + out.final_scores.sum())).backward()
        return out, [p.grad.clone() for p in model.parameters() if p.grad is not None]

    hard, hard_grads = run("hard")
    monkeypatch.setattr(beam_search_module, "select_beams", one_hot_selection)
    soft, soft_grads = run("soft")
    assert torch.equal(soft.tokens, hard.tokens)
    torch.testing.assert_close(soft.final_scores, hard.final_scores, rtol=0, atol=1e-12)
    torch.testing.assert_close(soft.gold_lprobs, hard.gold_lprobs, rtol=0, atol=1e-12)
    assert len(soft_grads) == len(hard_grads) > 10
    for s, h in zip(soft_grads, hard_grads):
        torch.testing.assert_close(s, h, rtol=1e-9, atol=1e-12)


def test_soft_mode_tends_to_hard_mode_as_epsilon_shrinks(model, dictionary, rng):
    sample = make_sample(dictionary, rng, [5, 3, 4], src_len=7)
    with torch.no_grad():
        hard = unroll(model, sample, beam=3, mode="hard")
        gaps = []
        for epsilon in (1.0, 1e-1, 1e-2, 1e-4):
            soft = unroll(model, sample, beam=3, mode="soft", epsilon=epsilon, tol=1e-9)
            gaps.append(float((soft.gold_lprobs - hard.gold_lprobs).abs().max()
                              + (soft.final_scores - hard.final_scores).abs().max()))
    assert torch.equal(soft.tokens, hard.tokens)
    assert float(soft.sharpness.min()) > 0.999
    assert min(gaps[:2]) > 1e-2 and gaps[-1] < 1e-6, gaps  # a soft selection differs; a sharp one does not


def search_of_encoder_states(build, dictionary, rng, mode: str):
    """A sharpened tiny model, a batch of 2 sentences (3 and 2 tokens), its encoder states (a leaf that requires
    grad) and the search (beam 2, epsilon 0.5, the exact selection gradient) as a function of encoder states."""
    model = sharpened(build(dictionary, share_all_embeddings=False))
    sample = make_sample(dictionary, rng, [3, 2], src_len=4)
    enc = encode(model, sample)
    states = enc["encoder_out"][0].detach().clone().requires_grad_(True)
    bos = int(sample["net_input"]["prev_output_tokens"][0, 0])
    config = BeamSearchConfig(beam=2, mode=mode, epsilon=0.5, tol=1e-12, selection_grad="full")

    def search(encoder_states):
        return unroll_beam_search(IncrementalDecoderUnroll(model.decoder, bos), {**enc, "encoder_out": [encoder_states]},
                                  model.encoder.reorder_encoder_out, sample["target"], dictionary.pad(), bos, config)

    return sample, states, search


@pytest.mark.parametrize("mode", ["soft", "hard"])
def test_gradcheck_through_three_unrolled_steps(dictionary, rng, mode):
    """The losses of a search (soft: the selections with their exact gradient, the mixed embeddings and caches,
    the backtracking; hard: the reordered caches) against finite differences in the encoder states, for both
    Transformers."""
    for build in ARCHITECTURES.values():
        _, states, search = search_of_encoder_states(build, dictionary, rng, mode)

        def loss(encoder_states):
            out = search(encoder_states)
            return out.gold_lprobs, out.final_scores

        assert torch.autograd.gradcheck(loss, (states,), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("mode", ["soft", "hard"])
def test_the_criterion_trains_both_transformers(dictionary, rng, mode):
    """Through the criterion (the decoder kind found from the model): the beam term's gradient reaches the
    decoder's self-attention (whose caches the search mixes) and the encoder, and the loss is p * tf + (1 - p) *
    beam with the tf term of plain teacher forcing."""
    sample = make_sample(dictionary, rng, [5, 3, 4], src_len=7)
    for build in ARCHITECTURES.values():
        model = build(dictionary)
        loss, _, log = build_criterion(dictionary, topk_mode=mode)(model, sample)
        tf_loss, _, _ = build_criterion(dictionary, teacher_forcing_ratio=1.0)(model, sample)
        torch.testing.assert_close(loss, 0.8 * tf_loss + 0.2 * log["beam_loss"])
        assert float(log["beam_loss"]) > 0
        model.zero_grad()
        (log["beam_loss"] if torch.is_tensor(log["beam_loss"]) and log["beam_loss"].requires_grad else
         build_criterion(dictionary, topk_mode=mode, teacher_forcing_ratio=0.0)(model, sample)[0]).backward()
        self_attention = model.decoder.layers[-1].self_attn.k_proj.weight.grad
        assert self_attention is not None and float(self_attention.abs().sum()) > 0
        assert float(model.encoder.layers[0].fc1.weight.grad.abs().sum()) > 0
