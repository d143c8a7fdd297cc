"""The soft beam-search losses for Hugging Face models (Seq2SeqBeamSearchLoss, CausalLMBeamSearchLoss): their two
terms against independent computations, and training with them (plain loops, Trainer's compute_loss_func) lowers
them."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_huggingface_adapters import _labels, _sources, tiny  # noqa: E402

from fairseq_softtopk.adapters.huggingface import Seq2SeqSearchDecoder  # noqa: E402
from fairseq_softtopk.adapters.huggingface_loss import Seq2SeqBeamSearchLoss  # noqa: E402
from fairseq_softtopk.search import BeamSearchConfig, beam_search, gold_token_loss  # noqa: E402


def _batch(model, lengths=(5, 3)):
    ids, mask = _sources("marian")
    ids = ids.masked_fill(mask == 0, model.config.pad_token_id)
    labels = _labels(list(lengths))
    shifted = torch.cat([torch.full((labels.shape[0], 1), model.config.decoder_start_token_id), labels[:, :-1]], 1)
    decoder_input_ids = shifted.masked_fill(shifted == -100, model.config.pad_token_id)
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder_input_ids}, labels


def _trainer_losses(trainer_class, arguments_class, model, rows, loss_fn, out_dir):
    """The logged losses of 12 updates of ``trainer_class`` on ``rows`` (dicts of tensors) with ``loss_fn``."""
    def collate(features):
        return {key: torch.stack([f[key] for f in features]) for key in features[0]}

    args = arguments_class(
        output_dir=str(out_dir), max_steps=12, per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    trainer = trainer_class(model=model, args=args, train_dataset=rows, data_collator=collate,
                            compute_loss_func=loss_fn)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@torch.no_grad()
def test_teacher_forcing_alone_is_the_cross_entropy_per_token():
    model = tiny("marian")
    inputs, labels = _batch(model)
    loss_fn = Seq2SeqBeamSearchLoss(model, teacher_forcing_ratio=1.0)
    logits = model(**inputs).logits
    expected = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100)
    torch.testing.assert_close(loss_fn(model(**inputs), labels), expected)


@torch.no_grad()
def test_the_beam_term_is_the_search_on_the_recorded_encoder_output():
    """p = 0, hard: the gold-token NLL of a search run from a separate encoder call with the batch's mask."""
    model = tiny("marian")
    inputs, labels = _batch(model)
    config = BeamSearchConfig(beam=3, mode="hard")
    loss_fn = Seq2SeqBeamSearchLoss(model, config, teacher_forcing_ratio=0.0)
    got = loss_fn(model(**inputs), labels, num_items_in_batch=7)
    decoder = Seq2SeqSearchDecoder(model)
    out = beam_search(decoder, decoder.encode(inputs["input_ids"], inputs["attention_mask"]), labels, pad=-100,
                      bos=decoder.bos, config=config)
    torch.testing.assert_close(got, gold_token_loss(out, labels, pad=-100).loss / 7)
    loss_fn.remove()
    assert not model._forward_pre_hooks
    # the default search: the fairseq criterion's (the selection gradient capped at 0.3 label-token gradients)
    default = Seq2SeqBeamSearchLoss(model, teacher_forcing_ratio=0.8).config
    assert (default.beam, default.epsilon, default.selection_grad) == (5, 0.1, "capped")
    assert abs(default.selection_grad_cap - 0.3 * 0.2) < 1e-15


@torch.no_grad()
def test_a_mask_passed_by_position_reaches_the_search():
    """model(ids, mask, decoder_ids) gives the loss of model(input_ids=ids, attention_mask=mask, ...): the search
    attends to the sentences' tokens, not their padding (the positional mask was dropped before, silently)."""
    model = tiny("marian")
    inputs, labels = _batch(model)
    assert (inputs["attention_mask"] == 0).any()  # padding the mask must hide
    loss_fn = Seq2SeqBeamSearchLoss(model, BeamSearchConfig(beam=3, mode="hard"), teacher_forcing_ratio=0.0)
    by_keyword = loss_fn(model(**inputs), labels)
    by_position = loss_fn(model(inputs["input_ids"], inputs["attention_mask"], inputs["decoder_input_ids"]), labels)
    unmasked = loss_fn(model(input_ids=inputs["input_ids"], decoder_input_ids=inputs["decoder_input_ids"]), labels)
    assert torch.equal(by_position, by_keyword) and not torch.equal(unmasked, by_keyword)


@pytest.mark.parametrize("options, message", [
    (dict(teacher_forcing_ratio="0.5"), r"teacher_forcing_ratio must be a number in \[0, 1\], got '0.5'"),
    (dict(teacher_forcing_ratio=None), r"teacher_forcing_ratio must be a number in \[0, 1\], got None"),
    (dict(label_smoothing=1.5), r"label_smoothing must be a number in \[0, 1\), got 1.5"),
    (dict(config={"beam": 2}), "config must be a BeamSearchConfig"),
])
def test_bad_loss_options_are_named_when_it_is_built(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Seq2SeqBeamSearchLoss(tiny("marian"), **options)


def _plain_loop_losses(model, inputs, labels, loss_fn, updates=15):
    """The losses of ``updates`` Adam steps (lr 1e-2) of ``loss_fn`` on one batch."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(updates):
        loss = loss_fn(model(**inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def test_a_plain_training_loop_lowers_the_soft_loss():
    model = tiny("marian").train()
    inputs, labels = _batch(model)
    loss_fn = Seq2SeqBeamSearchLoss(model, BeamSearchConfig(beam=3, epsilon=0.1), teacher_forcing_ratio=0.5)
    losses = _plain_loop_losses(model, inputs, labels, loss_fn)
    assert losses[-1] < 0.8 * losses[0], losses


def test_trainer_with_compute_loss_func_lowers_the_loss(tmp_path):
    pytest.importorskip("accelerate")
    model = tiny("marian")
    inputs, labels = _batch(model)
    rows = [{key: value[b] for key, value in dict(inputs, labels=labels).items()} for b in range(2)] * 4
    loss_fn = Seq2SeqBeamSearchLoss(model, BeamSearchConfig(beam=2, epsilon=0.1), teacher_forcing_ratio=0.5)
    losses = _trainer_losses(transformers.Seq2SeqTrainer, transformers.Seq2SeqTrainingArguments, model, rows,
                             loss_fn, tmp_path)
    assert len(losses) == 12 and sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses


def test_a_causal_lm_trains_through_the_soft_search():
    """GPT-2 continuing left-padded prompts: the gold-token loss of the soft search, in a plain loop."""
    from fairseq_softtopk.adapters.huggingface import CausalLMSearchDecoder

    model = tiny("gpt2").train()
    decoder = CausalLMSearchDecoder(model)
    ids, mask = _sources("gpt2")
    prompt = decoder.prompt(ids.masked_fill(mask == 0, 0), mask)
    labels = _labels([4, 3])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        out = beam_search(decoder, prompt, labels, pad=-100, bos=decoder.bos, config=BeamSearchConfig(beam=3))
        loss = gold_token_loss(out, labels, pad=-100).loss / 7
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.8 * losses[0], losses


def test_the_soft_search_and_the_loss_pass_the_device_check():
    """Every tensor the adapters, the loss and the search create takes the data's device and dtype (float64
    here), in the forward and the backward pass (tests/device_check.py: no GPU needed)."""
    from device_check import package_device_check

    for family in ("marian", "gpt2"):
        model = tiny(family, torch.float64)
        if family == "marian":
            inputs, labels = _batch(model)
            loss_fn = Seq2SeqBeamSearchLoss(model, BeamSearchConfig(beam=3, selection_grad="capped"), 0.5)
            with package_device_check() as check:
                loss_fn(model(**inputs), labels).backward()
        else:
            from fairseq_softtopk.adapters.huggingface import CausalLMSearchDecoder

            decoder = CausalLMSearchDecoder(model)
            ids, mask = _sources("gpt2")
            labels = _labels([4, 3])
            with package_device_check() as check:
                out = beam_search(decoder, decoder.prompt(ids.masked_fill(mask == 0, 0), mask), labels, pad=-100,
                                  bos=decoder.bos, config=BeamSearchConfig(beam=3))
                gold_token_loss(out, labels, pad=-100).loss.backward()
        assert check.sites, family  # the check saw the package's factories


def test_a_loss_scale_scales_the_gradients_exactly_with_the_capped_selection_gradient():
    """fp16/amp multiply the loss before the backward pass: with the selection gradient capped, the cap follows
    that factor (the search's scale probe), so the update does not change; the control: the cap acts here."""
    model = tiny("marian", torch.float64)
    inputs, labels = _batch(model)

    def gradients(scale, selection_grad="capped"):
        model.zero_grad()
        config = BeamSearchConfig(beam=3, epsilon=0.5, tol=1e-10, selection_grad=selection_grad,
                                  selection_grad_cap=1e-3)
        loss_fn = Seq2SeqBeamSearchLoss(model, config, teacher_forcing_ratio=0.5)
        (scale * loss_fn(model(**inputs), labels)).backward()
        loss_fn.remove()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    reference = gradients(1.0)
    torch.testing.assert_close(gradients(2.0 ** 12) / 2.0 ** 12, reference, rtol=1e-9, atol=1e-12)
    full = gradients(1.0, "full")
    assert float((full - reference).norm() / full.norm()) > 1e-3  # the cap changed the gradient


def _causal_batch():
    """Right-padded prompt + continuation rows, as a supervised fine-tuning collator makes them: labels are the
    continuation's ids, -100 on the prompt and the padding."""
    rows = [([5, 6, 7], [8, 9, 10, 1]), ([11, 12], [13, 14, 1])]
    L = max(len(p) + len(c) for p, c in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for b, (prompt, cont) in enumerate(rows):
        n = len(prompt) + len(cont)
        ids[b, :n] = torch.tensor(prompt + cont)
        mask[b, :n] = 1
        labels[b, len(prompt):n] = torch.tensor(cont)
    return rows, {"input_ids": ids, "attention_mask": mask}, labels


@torch.no_grad()
def test_causal_lm_loss_terms_against_independent_computations():
    from fairseq_softtopk.adapters.huggingface import CausalLMSearchDecoder
    from fairseq_softtopk.adapters.huggingface_loss import CausalLMBeamSearchLoss

    model = tiny("gpt2")
    rows, inputs, labels = _causal_batch()
    tf = CausalLMBeamSearchLoss(model, teacher_forcing_ratio=1.0)
    logits = model(**inputs).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=-100)
    torch.testing.assert_close(tf(model(**inputs), labels), expected)
    tf.remove()
    config = BeamSearchConfig(beam=3, mode="hard")
    beam = CausalLMBeamSearchLoss(model, config, teacher_forcing_ratio=0.0)
    got = beam(model(**inputs), labels)
    prompt_ids = torch.tensor([[5, 6, 7], [0, 11, 12]])  # left-padded by hand
    continuation = torch.tensor([[8, 9, 10, 1], [13, 14, 1, -100]])
    decoder = CausalLMSearchDecoder(model)
    out = beam_search(decoder, decoder.prompt(prompt_ids, prompt_ids.ne(0).long()), continuation, pad=-100,
                      bos=decoder.bos, config=config)
    torch.testing.assert_close(got, gold_token_loss(out, continuation, pad=-100).loss / 7)
    with pytest.raises(ValueError, match="a row with labels needs a prompt"):
        beam(model(**inputs), inputs["input_ids"])


def test_rows_and_batches_without_labels_train_nothing_and_give_no_nan():
    """Every label -100 (truncation can leave only a prompt): the loss is 0 with a zero gradient, not 0 / 0; such a
    row among others is left out of the search and the loss is the other rows' alone."""
    from fairseq_softtopk.adapters.huggingface_loss import CausalLMBeamSearchLoss

    config = BeamSearchConfig(beam=3, mode="hard")
    model = tiny("gpt2")
    rows, inputs, labels = _causal_batch()
    loss_fn = CausalLMBeamSearchLoss(model, config, teacher_forcing_ratio=0.5)
    # decoder-only: the second row without labels gives the first row's loss alone
    empty_second = labels.clone()
    empty_second[1] = -100
    first_only = {key: value[:1] for key, value in inputs.items()}
    torch.testing.assert_close(loss_fn(model(**inputs), empty_second), loss_fn(model(**first_only), labels[:1]))
    nothing = torch.full_like(labels, -100)
    loss = loss_fn(model(**inputs), nothing)
    loss.backward()
    assert float(loss) == 0.0 and all(p.grad is None or not p.grad.any() for p in model.parameters())
    loss_fn.remove()
    # encoder-decoder: the same for a batch without labels, with and without Trainer's token count
    model = tiny("marian")
    inputs, labels = _batch(model)
    loss_fn = Seq2SeqBeamSearchLoss(model, config, teacher_forcing_ratio=0.5)
    for count in (None, 7):
        loss = loss_fn(model(**inputs), torch.full_like(labels, -100), num_items_in_batch=count)
        loss.backward()
        assert float(loss) == 0.0 and all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_trainer_trains_a_causal_lm_with_the_soft_beam_search_loss(tmp_path):
    pytest.importorskip("accelerate")
    from fairseq_softtopk.adapters.huggingface_loss import CausalLMBeamSearchLoss

    model = tiny("gpt2")
    _, inputs, labels = _causal_batch()
    rows = [{key: value[b] for key, value in dict(inputs, labels=labels).items()} for b in range(2)] * 4
    loss_fn = CausalLMBeamSearchLoss(model, BeamSearchConfig(beam=2, epsilon=0.1), teacher_forcing_ratio=0.5)
    losses = _trainer_losses(transformers.Trainer, transformers.TrainingArguments, model, rows, loss_fn, tmp_path)
    assert len(losses) == 12 and sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses


def test_labels_padded_with_the_pad_id_are_refused():
    """Labels padded with the tokenizer's pad id (not -100) would train the model to emit padding: refused, naming
    the fix; the pad id inside a row, and a model whose pad is its EOS (a label then), are taken."""
    model = tiny("marian")  # pad 0, EOS 1
    inputs, labels = _batch(model)
    loss_fn = Seq2SeqBeamSearchLoss(model, teacher_forcing_ratio=1.0)
    with pytest.raises(ValueError, match="padded with the model's pad id 0: pad labels with -100"):
        loss_fn(model(**inputs), labels.masked_fill(labels == -100, 0))
    # the pad id inside a row is a label (a model that pads with its unknown token)
    inside = labels.clone()
    inside[0, 1] = 0
    assert torch.isfinite(loss_fn(model(**inputs), inside))
    loss_fn.remove()
    model.config.pad_token_id = model.config.eos_token_id
    loss_fn = Seq2SeqBeamSearchLoss(model, teacher_forcing_ratio=1.0)
    assert torch.isfinite(loss_fn(model(**inputs), labels.masked_fill(labels == -100, 1)))


def _expected_risk_term(finished, references, counts, eos, pad, unit_scale, temperature=1.0):
    """sum over sentences of counts[b] (its label tokens) x sum_l softmax(scores / T)_l * unit_scale *
    (1 - BLEU+1(hyp_l, ref)), hypothesis by hypothesis (read up to their EOS); and the costs, to check they differ."""
    from fairseq_softtopk.modules.sequence_risk import sentence_bleu, strip_sequence

    total, all_costs = 0.0, []
    for b in range(finished.scores.shape[0]):
        reference = strip_sequence(references[b], eos, pad)
        weights = torch.softmax(finished.scores[b].double() / temperature, -1)
        costs = [unit_scale * (1.0 - sentence_bleu(strip_sequence(hyp.tolist(), eos, pad), reference))
                 for hyp in finished.tokens[b]]
        all_costs += costs
        total += counts[b] * float((weights * torch.tensor(costs, dtype=torch.float64)).sum())
    return total, all_costs


def _hypothesis(finished, b, slot):
    """Sentence ``b``'s finished hypothesis ``slot`` (best first), its EOS included, as a list."""
    return finished.tokens[b, slot, :int(finished.lengths[b, slot])].tolist()


@torch.no_grad()
def test_the_risk_term_is_the_expected_cost_of_a_search_until_eos():
    """beam_loss="risk", p = 0: each sentence's expected cost (BLEU points) of the hypotheses of a search that
    stops at EOS or at step 1.2 * source length + 10, counted once per label token, divided by the token count."""
    from fairseq_softtopk.search import beam_search_to_eos

    model = tiny("marian")  # pad 0 (the search's padding), EOS 1
    inputs, _ = _batch(model)
    config = BeamSearchConfig(beam=3, mode="hard")
    decoder = Seq2SeqSearchDecoder(model)
    max_len = int(1.2 * inputs["input_ids"].shape[1] + 10)
    finished = beam_search_to_eos(decoder, decoder.encode(inputs["input_ids"], inputs["attention_mask"]), 2,
                                  pad=0, bos=decoder.bos, eos=1, max_len=max_len, config=config)
    assert finished.tokens.shape[-1] <= max_len + 1
    # references the hypotheses partly match (a hard search does not read them): costs from 0 to 100
    references = [_hypothesis(finished, 0, 0), _hypothesis(finished, 1, 1)[:3] + [7, 1]]
    labels = torch.full((2, max(map(len, references))), -100)
    for b, reference in enumerate(references):
        labels[b, :len(reference)] = torch.tensor(reference)
    loss_fn = Seq2SeqBeamSearchLoss(model, config, teacher_forcing_ratio=0.0, beam_loss="risk",
                                    risk_cost="bleu_points", risk_temperature=0.5)
    decoder_inputs = torch.cat([torch.zeros(2, 1, dtype=torch.long), labels[:, :-1].clamp_min(0)], 1)
    got = loss_fn(model(**dict(inputs, decoder_input_ids=decoder_inputs)), labels, num_items_in_batch=8)
    expected, costs = _expected_risk_term(finished, references, list(map(len, references)), 1, 0, 100.0,
                                          temperature=0.5)
    assert min(costs) == 0.0 and 0 < max(costs) and len(set(costs)) > 2
    assert abs(float(got) - expected / 8) < 1e-5 * expected


@torch.no_grad()
def test_a_causal_lm_risk_term_continues_the_prompts_until_eos():
    from fairseq_softtopk.adapters.huggingface import CausalLMSearchDecoder
    from fairseq_softtopk.adapters.huggingface_loss import CausalLMBeamSearchLoss
    from fairseq_softtopk.search import beam_search_to_eos

    model = tiny("gpt2")  # no pad token: the search pads with BOS 0; EOS 1
    config = BeamSearchConfig(beam=3, mode="hard")
    prompts = [[5, 6, 7], [11, 12]]
    prompt_ids = torch.tensor([[5, 6, 7], [0, 11, 12]])  # left-padded
    decoder = CausalLMSearchDecoder(model)
    max_len = 6  # max_len_a 0 x the longest continuation + max_len_b 6
    finished = beam_search_to_eos(decoder, decoder.prompt(prompt_ids, prompt_ids.ne(0).long()), 2, pad=0,
                                  bos=decoder.bos, eos=1, max_len=max_len, config=config)
    continuations = [_hypothesis(finished, 0, 1), [13, 14, 15, 1]]
    assert 0 not in sum(continuations, [])
    L = max(len(p) + len(c) for p, c in zip(prompts, continuations))
    ids, labels = torch.zeros(2, L, dtype=torch.long), torch.full((2, L), -100)
    mask = torch.zeros_like(ids)
    for b, (prompt, cont) in enumerate(zip(prompts, continuations)):  # right-padded, as a collator makes them
        ids[b, :len(prompt) + len(cont)] = torch.tensor(prompt + cont)
        mask[b, :len(prompt) + len(cont)] = 1
        labels[b, len(prompt):len(prompt) + len(cont)] = torch.tensor(cont)
    loss_fn = CausalLMBeamSearchLoss(model, config, teacher_forcing_ratio=0.0, beam_loss="risk", max_len_a=0.0,
                                     max_len_b=6)
    got = loss_fn(model(input_ids=ids, attention_mask=mask), labels)
    expected, costs = _expected_risk_term(finished, continuations, list(map(len, continuations)), 1, 0, 1.0)
    assert min(costs) == 0.0 and len(set(costs)) > 2
    n_labels = sum(map(len, continuations))  # each predicted from the position before it
    assert abs(float(got) - expected / n_labels) < 1e-5 * expected


@pytest.mark.parametrize("options, message", [
    (dict(beam_loss="mrt"), r"beam_loss must be one of \('gold', 'risk'\)"),
    (dict(beam_loss="risk", risk_cost="chrf"), "risk_cost must be one of"),
    (dict(beam_loss="risk", risk_temperature=0), "risk_temperature must be a number > 0"),
    (dict(beam_loss="risk", lenpen=float("nan")), "lenpen must be a finite number"),
    (dict(beam_loss="risk", max_len_b=2.5), "max_len_b an integer >= 0"),
    (dict(beam_loss="risk", search_pad=1), r"search_pad must be a token id other than EOS \(1\)"),
])
def test_bad_risk_options_are_named_when_the_loss_is_built(options, message):
    with pytest.raises(ValueError, match=message):
        Seq2SeqBeamSearchLoss(tiny("marian"), **options)


def test_a_model_without_a_token_to_pad_the_search_is_told_to_name_one():
    from fairseq_softtopk.adapters.huggingface_loss import CausalLMBeamSearchLoss

    model = tiny("gpt2")
    model.config.bos_token_id = model.config.eos_token_id  # as GPT-2's own: BOS = EOS, no pad
    with pytest.raises(ValueError, match="pass search_pad="):
        CausalLMBeamSearchLoss(model, beam_loss="risk")
    assert CausalLMBeamSearchLoss(model, beam_loss="risk", search_pad=0).search_pad == 0


def test_a_plain_training_loop_lowers_the_risk_loss():
    """p = 0.5, the cost in BLEU points (Edunov et al.'s setting): the loss falls over a few updates."""
    model = tiny("marian").train()
    inputs, labels = _batch(model)
    labels[0, 4], labels[1, 2] = 1, 1
    loss_fn = Seq2SeqBeamSearchLoss(model, BeamSearchConfig(beam=3, epsilon=0.1, selection_grad="full"),
                                    teacher_forcing_ratio=0.5, beam_loss="risk", risk_cost="bleu_points", max_len_b=4)
    losses = _plain_loop_losses(model, inputs, labels, loss_fn)
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("loss_class, p", [("seq2seq", 1.0), ("seq2seq", 0.0), ("causal", 1.0), ("causal", 0.5)])
def test_a_label_outside_the_vocabulary_is_named_with_its_row(loss_class, p):
    """An id >= the vocabulary's size indexed past the logits (a raw "index out of bounds", a device-side assert on
    CUDA), a negative one other than -100 was read as token 0 by teacher forcing: both refused, naming the id, the
    vocabulary's size and the row, whatever the loss's weights."""
    from fairseq_softtopk.adapters.huggingface_loss import CausalLMBeamSearchLoss

    if loss_class == "seq2seq":
        model = tiny("marian")
        inputs, labels = _batch(model)
        loss_fn = Seq2SeqBeamSearchLoss(model, BeamSearchConfig(beam=2, mode="hard"), teacher_forcing_ratio=p)
    else:
        model = tiny("gpt2")
        _, inputs, labels = _causal_batch()
        loss_fn = CausalLMBeamSearchLoss(model, BeamSearchConfig(beam=2, mode="hard"), teacher_forcing_ratio=p)
    for bad in (65, 40, -5):
        wrong = labels.clone()
        wrong[1, 3] = bad
        with pytest.raises(ValueError, match=rf"^label {bad} \(row 1, position 3\) is no token id of the model's "
                                             rf"vocabulary of 40 .*labels must be in \[0, 40\) or -100"):
            loss_fn(model(**inputs), wrong)
    assert torch.isfinite(loss_fn(model(**inputs), labels))  # the control: the same batch, valid ids


def _reference_beam_term(model, prompt, continuation, config):
    """The gold-token NLL of the hard search continuing ``prompt`` along ``continuation`` (one row)."""
    from fairseq_softtopk.adapters.huggingface import CausalLMSearchDecoder

    decoder = CausalLMSearchDecoder(model)
    ids = torch.tensor([prompt])
    target = torch.tensor([continuation])
    out = beam_search(decoder, decoder.prompt(ids), target, pad=-100, bos=decoder.bos, config=config)
    return gold_token_loss(out, target, pad=-100).loss


@torch.no_grad()
def test_a_causal_lm_row_with_a_masked_span_inside_its_labels_is_refused():
    """Multi-turn chat rows: labels [-100 x 3, a, b, -100, c] (the model's own turn masked in between). The search
    continued the prompt with [a, b, c], a sequence that never occurs, whatever the masked token: the beam term did
    not depend on it. Now refused, naming the rule and what to do; teacher forcing alone (p = 1, no search) takes
    such rows, and a row with -100 only before and after its labels is searched as before."""
    from fairseq_softtopk.adapters.huggingface_loss import CausalLMBeamSearchLoss

    model = tiny("gpt2")
    config = BeamSearchConfig(beam=3, mode="hard")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 1]])
    labels = torch.tensor([[-100, -100, -100, 8, 9, -100, 11, 1]])
    loss_fn = CausalLMBeamSearchLoss(model, config, teacher_forcing_ratio=0.0)
    with pytest.raises(ValueError, match=r"^row 0 has -100 at position 5, between its labels \(positions 3 to 7\): "
                                         r".*one contiguous run .*its own row.*teacher_forcing_ratio=1.0"):
        loss_fn(model(input_ids=ids), labels)
    teacher = CausalLMBeamSearchLoss(model, config, teacher_forcing_ratio=1.0)
    assert torch.isfinite(teacher(model(input_ids=ids), labels))
    # -100 after the run (attended tokens that are not trained): the search follows the run alone
    tail = torch.tensor([[-100, -100, -100, 8, 9, 10, -100, -100]])
    expected = _reference_beam_term(model, [5, 6, 7], [8, 9, 10], config) / 3
    torch.testing.assert_close(loss_fn(model(input_ids=ids), tail), expected)
