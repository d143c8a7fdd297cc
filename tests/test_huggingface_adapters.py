"""The Hugging Face adapters (fairseq_softtopk.adapters.huggingface) on tiny models built from configs (no
download): the mixed cache against ``reorder_cache``, the hard search against a beam search written here that
recomputes every prefix without a cache, and against ``generate(num_beams=K)``; the soft search's gradient
against finite differences; the errors for what cannot be mixed."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.cache_utils import DynamicCache, EncoderDecoderCache, StaticCache  # noqa: E402

from fairseq_softtopk.adapters.huggingface import CausalLMSearchDecoder, Seq2SeqSearchDecoder, mix_cache  # noqa: E402
from fairseq_softtopk.search import BeamSearchConfig, beam_search, gold_token_loss  # noqa: E402

V = 40


def tiny(family: str, dtype=torch.float32):
    """A tiny model of ``family`` with random weights (its output layer scaled so that beams differ)."""
    torch.manual_seed({"marian": 0, "bart": 1, "t5": 2, "m2m100": 3, "gpt2": 4, "llama": 5}[family])
    enc_dec = dict(vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
                   decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64)
    if family == "marian":
        model = transformers.MarianMTModel(transformers.MarianConfig(
            **enc_dec, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, scale_embedding=True))
    elif family == "bart":
        model = transformers.BartForConditionalGeneration(transformers.BartConfig(
            **enc_dec, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, scale_embedding=True))
    elif family == "m2m100":
        model = transformers.M2M100ForConditionalGeneration(transformers.M2M100Config(
            **enc_dec, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, scale_embedding=True))
    elif family == "t5":
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            # num_layers for both stacks: generate sizes its cache by num_layers
            vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    elif family == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=1))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.to(dtype).eval()


SEQ2SEQ = ["marian", "bart", "t5", "m2m100"]
CAUSAL = ["gpt2", "llama"]


def _sources(family, batch=2, length=6, seed=0):
    """Token ids and attention mask; the second row two tokens shorter: sources padded on the right, prompts on
    the left (as generate needs them)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, -2:] = 0 if family in SEQ2SEQ else 1
        mask[1, :2] = 1 if family in SEQ2SEQ else 0
    return ids, mask


def _labels(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    labels = torch.full((len(lengths), max(lengths)), -100)
    for b, n in enumerate(lengths):
        labels[b, :n] = torch.randint(3, V, (n,), generator=g)
    return labels


def _decoder(family, model):
    return Seq2SeqSearchDecoder(model) if family in SEQ2SEQ else CausalLMSearchDecoder(model)


def _context(family, decoder, ids, mask):
    padded = ids.masked_fill(mask == 0, decoder.model.config.pad_token_id or 0)
    return decoder.encode(padded, mask) if family in SEQ2SEQ else decoder.prompt(padded, mask)


def _next_lprobs(family, model, ids, mask, b, prefix):
    """The log-probabilities after ``prefix`` for sentence ``b``, from the whole sequence (no cache)."""
    keep = mask[b].bool()
    if family in SEQ2SEQ:
        start = model.config.decoder_start_token_id
        logits = model(input_ids=ids[b:b + 1, keep], decoder_input_ids=torch.tensor([[start] + prefix])).logits
    else:
        logits = model(input_ids=torch.cat([ids[b, keep], torch.tensor(prefix, dtype=torch.long)]).unsqueeze(0)).logits
    return torch.log_softmax(logits[0, -1], -1)


def plain_beam_search(family, model, ids, mask, b, gold, k, excluded):
    """Beam search for sentence ``b`` over ``len(gold)`` steps, every prefix recomputed from scratch: beams of
    (score, tokens, the log-probabilities they gave the gold tokens)."""
    beams = [(0.0, [], [])]
    for gold_token in gold:
        candidates = []
        for score, tokens, gold_lprobs in beams:
            lprobs = _next_lprobs(family, model, ids, mask, b, tokens)
            lprobs[excluded] = -float("inf")
            for token in range(V):
                candidates.append((score + float(lprobs[token]), tokens + [token],
                                   gold_lprobs + [float(lprobs[gold_token])]))
        beams = sorted(candidates, key=lambda c: -c[0])[:k]
    return beams


@pytest.mark.parametrize("family", SEQ2SEQ + CAUSAL)
@torch.no_grad()
def test_hard_search_equals_a_beam_search_that_recomputes_every_prefix(family):
    model, k, lengths = tiny(family), 3, [5, 3]
    decoder = _decoder(family, model)
    ids, mask = _sources(family)
    labels = _labels(lengths)
    out = beam_search(decoder, _context(family, decoder, ids, mask), labels, pad=-100, bos=decoder.bos,
                      config=BeamSearchConfig(beam=k, mode="hard"))
    nll = 0.0
    for b, length in enumerate(lengths):
        beams = plain_beam_search(family, model, ids, mask, b, labels[b, :length].tolist(), k, decoder.excluded_tokens)
        if length == max(lengths):
            torch.testing.assert_close(out.final_scores[b], torch.tensor([c[0] for c in beams]), atol=1e-4, rtol=1e-5)
            assert out.tokens[b].tolist() == [c[1] for c in beams]
        nll -= sum(beams[0][2])
    torch.testing.assert_close(gold_token_loss(out, labels, pad=-100).nll, torch.tensor(nll), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("family", ["marian", "t5", "gpt2"])
@torch.no_grad()
def test_hard_search_keeps_the_beams_and_scores_of_generate(family):
    """``generate(num_beams=K)`` with EOS banned runs to its length limit: its K sequences and their summed
    log-probabilities (no length penalty) are the hard search's final beams."""
    model, k, steps = tiny(family), 4, 5
    config = model.config
    eos, pad = config.eos_token_id, config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    banned = sorted({eos, pad})
    decoder = (Seq2SeqSearchDecoder if family in SEQ2SEQ else CausalLMSearchDecoder)(model, excluded_tokens=banned)
    ids, mask = _sources(family, batch=1)
    out = beam_search(decoder, _context(family, decoder, ids, mask), torch.zeros(1, steps, dtype=torch.long),
                      pad=-100, bos=decoder.bos, config=BeamSearchConfig(beam=k, mode="hard"))
    generated = model.generate(input_ids=ids, attention_mask=mask, num_beams=k, num_return_sequences=k,
                               max_new_tokens=steps, length_penalty=0.0, do_sample=False, early_stopping=False,
                               bad_words_ids=[[t] for t in banned], pad_token_id=pad, eos_token_id=eos,
                               forced_eos_token_id=None,
                               output_scores=True, return_dict_in_generate=True)
    continuation = generated.sequences[:, -steps:]
    assert out.tokens[0].tolist() == continuation.tolist()
    torch.testing.assert_close(out.final_scores[0], generated.sequences_scores, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("family", SEQ2SEQ + CAUSAL)
@torch.no_grad()
def test_one_hot_weights_give_the_cache_of_reorder_cache(family):
    model = tiny(family)
    decoder = _decoder(family, model)
    ids, mask = _sources(family, batch=3)  # one sentence's three beams
    context = _context(family, decoder, ids, mask)
    state = decoder.initial_state(context)
    inputs = decoder.embed(torch.tensor([5, 6, 7]))
    for _ in range(2):
        _, state = decoder.step(inputs, state, context)
    order = torch.tensor([2, 0, 1])  # a cycle: the weights' transpose would be another order
    weights = torch.nn.functional.one_hot(order, 3).T.unsqueeze(0).double()  # (1, old, new): new l follows old order[l]
    mixed = decoder.mix_state(state, weights, None)
    cache = state.cache if family in CAUSAL else state
    expected = mix_cache(cache, None, torch.arange(3))  # a copy, then reordered in place as generate does
    expected.reorder_cache(order)
    mixed_cache = mixed.cache if family in CAUSAL else mixed
    for got, want in zip(_layers(mixed_cache), _layers(expected)):
        assert torch.equal(got, want)
    next_state = state._replace(cache=expected) if family in CAUSAL else expected
    got, _ = decoder.step(inputs, mixed, context)
    want, _ = decoder.step(inputs, next_state, context)
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", ["marian", "llama"])
@torch.no_grad()
def test_soft_search_tends_to_the_hard_search(family):
    """As epsilon goes to 0 the soft selection is the hard one: the same beams, scores and gold-token NLL."""
    model = tiny(family, torch.float64)
    decoder = _decoder(family, model)
    ids, mask = _sources(family)
    labels = _labels([4, 3])
    context = _context(family, decoder, ids, mask)
    hard = beam_search(decoder, context, labels, pad=-100, bos=decoder.bos,
                       config=BeamSearchConfig(beam=3, mode="hard"))
    soft = beam_search(decoder, context, labels, pad=-100, bos=decoder.bos,
                       config=BeamSearchConfig(beam=3, epsilon=1e-6, tol=1e-10, max_iter=200))
    assert torch.equal(soft.tokens, hard.tokens)
    torch.testing.assert_close(soft.final_scores, hard.final_scores, atol=1e-6, rtol=0)
    torch.testing.assert_close(gold_token_loss(soft, labels, -100).nll, gold_token_loss(hard, labels, -100).nll)


def _layers(cache):
    self_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
    return [t for layer in self_cache.layers for t in (layer.keys, layer.values)]


@pytest.mark.parametrize("family", ["marian", "gpt2"])
def test_soft_search_gradient_matches_finite_differences(family):
    """float64 gradcheck through three soft steps: in the encoder output (Marian), or in a per-dimension scale of
    every input embedding, prompts' and mixed ones' (GPT-2); through the mixed caches and the selections'
    implicit gradient."""
    model = tiny(family, torch.float64)
    decoder = _decoder(family, model)
    ids, mask = _sources(family)
    labels = _labels([3, 3])
    config = BeamSearchConfig(beam=2, epsilon=0.5, tol=1e-12, max_iter=200, selection_grad="full")
    context = _context(family, decoder, ids, mask)
    if family in SEQ2SEQ:
        def loss(hidden):
            out = beam_search(decoder, dict(context, hidden=hidden), labels, pad=-100, bos=decoder.bos, config=config)
            return gold_token_loss(out, labels, pad=-100).loss

        x = context["hidden"].detach().clone().requires_grad_(True)
    else:
        scale = []
        model.get_input_embeddings().register_forward_hook(lambda module, args, output: output * scale[-1])

        def loss(s):
            scale.append(s)
            out = beam_search(decoder, context, labels, pad=-100, bos=decoder.bos, config=config)
            return gold_token_loss(out, labels, pad=-100).loss

        x = torch.ones(model.config.n_embd, dtype=torch.float64, requires_grad=True)
    assert float(torch.autograd.grad(loss(x), x)[0].abs().max()) > 0
    assert torch.autograd.gradcheck(loss, (x,), eps=1e-6, atol=1e-6, rtol=1e-4)


def test_what_cannot_be_mixed_is_named():
    model = tiny("gpt2")
    static = StaticCache(config=model.config, max_cache_len=8)
    with pytest.raises(TypeError, match="a StaticCache cannot be mixed over beams"):
        mix_cache(static, torch.ones(1, 1, 1), None)
    model.gradient_checkpointing_enable()
    model.train()
    with pytest.raises(ValueError, match="gradient checkpointing"):
        CausalLMSearchDecoder(model)
    with pytest.raises(TypeError, match="is not an encoder-decoder"):
        Seq2SeqSearchDecoder(tiny("llama"))
    with pytest.raises(TypeError, match="is an encoder-decoder"):
        CausalLMSearchDecoder(tiny("t5"))
    with pytest.raises(ValueError, match="left-padded"):
        CausalLMSearchDecoder.prompt(torch.ones(1, 3, dtype=torch.long), torch.tensor([[1, 1, 0]]))


def test_a_sliding_window_layer_is_refused():
    from transformers.cache_utils import DynamicSlidingWindowLayer

    cache = DynamicCache()
    cache.layers.append(DynamicSlidingWindowLayer(sliding_window=4))
    with pytest.raises(TypeError, match="layer 0 of the cache is a DynamicSlidingWindowLayer"):
        mix_cache(cache, torch.ones(1, 1, 1), None)


@pytest.mark.parametrize("family", ["marian", "t5", "gpt2", "llama"])
@torch.no_grad()
def test_the_adapters_pass_the_cache_without_a_deprecation_warning(family, caplog):
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns that it goes in 5.40): the
    adapters use the name of the installed version, so a search warns of nothing, neither as a warning nor in
    transformers' log (tests/test_transformers_versions.py runs this on the lowest and the highest version)."""
    import logging
    import warnings

    model = tiny(family)
    decoder = _decoder(family, model)
    ids, mask = _sources(family)
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="transformers"):
        warnings.simplefilter("error")
        out = beam_search(decoder, _context(family, decoder, ids, mask), _labels([3, 2]), pad=-100, bos=decoder.bos,
                          config=BeamSearchConfig(beam=2))
    assert out.tokens.shape == (2, 2, 3)
    assert not [r.getMessage() for r in caplog.records if "past_key_values" in r.getMessage()]
