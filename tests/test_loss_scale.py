"""Mixed precision: training must not depend on fairseq's loss scale, and half-precision models must train.

fairseq's ``--fp16`` and ``--amp`` optimisers multiply the loss by a dynamic scale (128 at the start,
up to 2^15 and more) before ``backward`` and divide the gradients afterwards. Scaling the loss by
``2^k`` must therefore scale every parameter gradient by exactly ``2^k``: true of any linear
backward pass, and made true of the capped selection gradient (``--topk-grad capped``, the
default) by its scale probe (:mod:`fairseq_softtopk.ops.gradient_cap`). Before the probe the cap
acted on the scaled gradient, so that after unscaling the selection gradient shrank with the scale;
the control test below shows that difference.
"""

from types import SimpleNamespace

import pytest
import torch
from fairseq.tasks import FairseqTask

from builders import build_criterion, build_model, build_stock_transformer, build_transformer, make_sample
from conftest import word_dictionary

from fairseq_softtopk import search as search_api
from fairseq_softtopk.criterions.selection_gradient_stats import SELGRAD_KEYS

#: powers of two as fairseq's scalers use them: the initial fp16 scale, the amp maximum, beyond
EXPONENTS = (7, 15, 24)


@pytest.fixture
def dictionary():
    return word_dictionary(13)


def scaled_train_step(model, criterion, sample, loss_scale: float):
    """fairseq's training step with an optimiser that scales the loss as ``--fp16``/``--amp`` do
    (``(loss * scale).backward()``); returns the logging output and the parameter gradients."""
    optimizer = SimpleNamespace(backward=lambda loss: (loss * loss_scale).backward())
    model.zero_grad(set_to_none=True)
    _, _, log = FairseqTask.train_step(SimpleNamespace(), sample, model, criterion, optimizer, update_num=3)
    return log, [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def assert_gradients_scale_exactly(model, criterion, sample):
    """Every parameter gradient at loss scale ``2^k`` is exactly ``2^k`` times the one at scale 1; returns
    the logging output of the unscaled step."""
    log, reference = scaled_train_step(model, criterion, sample, 1.0)
    assert sum(g is not None and bool(g.abs().sum() > 0) for g in reference) > 5
    for exponent in EXPONENTS:
        _, scaled = scaled_train_step(model, criterion, sample, 2.0 ** exponent)
        for (name, _), g, s in zip(model.named_parameters(), reference, scaled):
            if g is None:
                assert s is None, name
                continue
            # bit for bit: multiplying by a power of two is exact, and so must be everything after it
            assert torch.equal(s, g * 2.0 ** exponent), (name, exponent, float((s - g * 2.0 ** exponent).abs().max()))
    return log


def _sharp_case(dictionary, rng, **options):
    """A model, criterion and batch where the selection gradient is large (peaked scores, small epsilon)."""
    model = build_model(dictionary, scale=6.0)
    criterion = build_criterion(dictionary, topk_epsilon=0.01, topk_grad_cap=0.3, **options)
    return model, criterion, make_sample(dictionary, rng, [9, 7, 8])


@pytest.mark.parametrize("mode", [{}, {"topk_fixed_iterations": True, "topk_max_iter": 30},
                                  {"topk_candidate_pool": 12}, {"topk_regularizer": "quadratic"}],
                         ids=["default", "fixed_iterations", "pool", "quadratic"])
@pytest.mark.parametrize("selection_grad", ["capped", "full", "none"])
def test_soft_beam_search_gradients_scale_exactly_with_the_loss(dictionary, rng, selection_grad, mode):
    model, criterion, sample = _sharp_case(dictionary, rng, topk_grad=selection_grad, **mode)
    log = assert_gradients_scale_exactly(model, criterion, sample)
    if selection_grad == "capped":  # the cap is active: the invariance is not that of a linear pass
        assert float(log["selgrad_capped"]) > 0


def test_hard_beam_search_gradients_scale_exactly_with_the_loss(dictionary, rng):
    model, criterion, sample = _sharp_case(dictionary, rng, topk_mode="hard")
    assert_gradients_scale_exactly(model, criterion, sample)


@pytest.mark.parametrize("mode", [{"topk_grad": "capped"}, {"topk_grad": "full"}, {"topk_mode": "hard"},
                                  {"topk_candidate_pool": 12}, {"topk_fixed_iterations": True, "topk_max_iter": 30},
                                  {"beam_loss": "risk"}, {"beam_loss": "risk", "topk_mode": "hard"},
                                  {"topk_regularizer": "quadratic"}],
                         ids=["capped", "full", "hard", "pool", "fixed_iterations", "risk", "hard_risk", "quadratic"])
@pytest.mark.parametrize("architecture", ["softtopk_transformer", "transformer"])
def test_transformer_beam_search_gradients_scale_exactly_with_the_loss(dictionary, rng, architecture, mode):
    """The Transformer path (caches mixed over beams, the decoder driven on soft embeddings) under loss scaling."""
    model = build_transformer(dictionary) if architecture == "softtopk_transformer" else build_stock_transformer(dictionary)
    with torch.no_grad():  # peaked distributions: large selection gradients, the cap active
        model.decoder.output_projection.weight.mul_(6.0)
    criterion = build_criterion(dictionary, topk_epsilon=1.0, topk_grad_cap=0.01, **mode)
    log = assert_gradients_scale_exactly(model, criterion, make_sample(dictionary, rng, [9, 7, 8]))
    if mode.get("topk_grad") == "capped":
        assert float(log["selgrad_capped"]) > 0


def test_the_logged_selection_gradients_do_not_depend_on_the_loss_scale(dictionary, rng):
    model, criterion, sample = _sharp_case(dictionary, rng)
    logs = [scaled_train_step(model, criterion, sample, scale)[0] for scale in (1.0, 2.0 ** 15)]
    for key in SELGRAD_KEYS:
        assert float(logs[0][key]) == float(logs[1][key]), key


def test_without_the_probe_the_capped_gradient_changes_with_the_loss_scale(dictionary, rng, monkeypatch):
    """The control: with the probe left out of the loss, the cap is absolute and acts on the scaled
    gradient (the behaviour before): the unscaled update differs, by several percent here."""
    unroll = search_api.beam_search
    monkeypatch.setattr(search_api, "beam_search",
                        lambda *args, **kwargs: unroll(*args, **kwargs)._replace(scale_probe=None))
    model, criterion, sample = _sharp_case(dictionary, rng)
    _, reference = scaled_train_step(model, criterion, sample, 1.0)
    _, scaled = scaled_train_step(model, criterion, sample, 128.0)
    flat = torch.cat([g.flatten() for g in reference])
    difference = torch.cat([(s / 128.0 - g).flatten() for g, s in zip(reference, scaled)])
    assert float(difference.norm() / flat.norm()) > 0.01


@pytest.mark.parametrize("normalizer", ["soft_topk", "hard_topk", "sparse_topk"])
def test_topk_attention_gradients_scale_exactly_with_the_loss(dictionary, rng, normalizer):
    """Teacher forcing (p = 1) with top-k attention in the LSTM and in the transformer's encoder-decoder
    and self-attention, and soft beam search on a top-k attention LSTM."""
    sample = make_sample(dictionary, rng, [6, 4, 5], src_len=7)
    tf = build_criterion(dictionary, teacher_forcing_ratio=1.0)
    for model in (build_model(dictionary, scale=3.0, attention_normalizer=normalizer, attention_topk=2),
                  build_transformer(dictionary, attention_normalizer=normalizer, attention_topk=2,
                                    attention_normalize_self_attention=True)):
        assert_gradients_scale_exactly(model, tf, sample)
    model = build_model(dictionary, scale=3.0, attention_normalizer=normalizer, attention_topk=2)
    assert_gradients_scale_exactly(model, build_criterion(dictionary), sample)


#: Largest relative differences from the float32 model (loss, gradient): about 3x the largest seen over
#: ten batches for each case here (float16: 6e-6 and 1.0e-2; bfloat16: 4.4e-5 and 2.9e-2).
HALF_TOLERANCES = {torch.float16: (2e-5, 3e-2), torch.bfloat16: (1.5e-4, 1e-1)}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["half", "bfloat16"])
@pytest.mark.parametrize("case", ["soft", "hard", "soft_topk_attention"])
def test_half_precision_models_train_close_to_float32(dictionary, rng, dtype, case):
    """A model cast to float16 or bfloat16 (what ``--fp16``/``--bf16`` train; the scores and the top-k
    solve stay in float32): finite loss and gradients, within the stated relative tolerances of the
    float32 model with the same weights. Tolerances (loss; norm of the gradients' difference over the
    float32 gradient's): float16 2e-5 and 3e-2, bfloat16 1.5e-4 and 1e-1 (:data:`HALF_TOLERANCES`)."""
    options = {"soft": {}, "hard": {"topk_mode": "hard"}, "soft_topk_attention": {}}[case]
    attention = dict(attention_normalizer="soft_topk", attention_topk=2) if case == "soft_topk_attention" else {}
    sample = make_sample(dictionary, rng, [6, 4, 5], src_len=7)
    criterion = build_criterion(dictionary, topk_epsilon=0.1, **options)
    results = {}
    for precision in (torch.float32, dtype):
        model = build_model(dictionary, scale=2.0, dtype=torch.float32, **attention)
        model.to(precision)
        log, grads = scaled_train_step(model, criterion, sample, 1.0)
        results[precision] = (log["loss"], torch.cat([g.float().flatten() for g in grads if g is not None]))
    loss, grad = results[dtype]
    ref_loss, ref_grad = results[torch.float32]
    assert torch.isfinite(loss) and bool(torch.isfinite(grad).all())
    loss_tol, grad_tol = HALF_TOLERANCES[dtype]
    assert abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)) < loss_tol
    assert _relative(grad, ref_grad) < grad_tol

