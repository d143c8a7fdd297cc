"""Seq2SeqBeamSearchLoss (the soft beam-search loss for Hugging Face encoder-decoders): its two terms against
independent computations, and training with it (a plain loop, and Trainer's compute_loss_func) lowers it."""

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
    start = torch.full((labels.shape[0], 1), model.config.decoder_start_token_id)
    decoder_input_ids = torch.cat([start, labels[:, :-1]], 1).masked_fill(
        torch.cat([start, labels[:, :-1]], 1) == -100, model.config.pad_token_id)
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder_input_ids}, labels


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


def test_a_plain_training_loop_lowers_the_soft_loss():
    model = tiny("marian").train()
    inputs, labels = _batch(model)
    loss_fn = Seq2SeqBeamSearchLoss(model, BeamSearchConfig(beam=3, epsilon=0.1), teacher_forcing_ratio=0.5)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss = loss_fn(model(**inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.8 * losses[0], losses


def test_trainer_with_compute_loss_func_lowers_the_loss(tmp_path):
    pytest.importorskip("accelerate")
    model = tiny("marian")
    inputs, labels = _batch(model)
    rows = [{key: value[b] for key, value in dict(inputs, labels=labels).items()} for b in range(2)] * 4

    def collate(features):
        return {key: torch.stack([f[key] for f in features]) for key in features[0]}

    loss_fn = Seq2SeqBeamSearchLoss(model, BeamSearchConfig(beam=2, epsilon=0.1), teacher_forcing_ratio=0.5)
    args = transformers.Seq2SeqTrainingArguments(
        output_dir=str(tmp_path), max_steps=12, per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    trainer = transformers.Seq2SeqTrainer(model=model, args=args, train_dataset=rows, data_collator=collate,
                                          compute_loss_func=loss_fn)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
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
        config = BeamSearchConfig(beam=3, epsilon=0.5, tol=1e-10, selection_grad=selection_grad, selection_grad_cap=1e-3)
        loss_fn = Seq2SeqBeamSearchLoss(model, config, teacher_forcing_ratio=0.5)
        (scale * loss_fn(model(**inputs), labels)).backward()
        loss_fn.remove()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    reference = gradients(1.0)
    torch.testing.assert_close(gradients(2.0 ** 12) / 2.0 ** 12, reference, rtol=1e-9, atol=1e-12)
    full = gradients(1.0, "full")
    assert float((full - reference).norm() / full.norm()) > 1e-3  # the cap changed the gradient
