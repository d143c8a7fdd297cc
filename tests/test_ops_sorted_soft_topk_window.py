"""sorted_soft_topk_window: the sorted SOFT top-k on a static window of each row's best candidates, against the dense
operator (values and implicit gradients, scattered back), its certificate at the edge of the window, no host
synchronisation, and soft beam search on it (fairseq_softtopk.ops.sorted_soft_topk_window)."""

import math

import pytest
import torch

from fairseq_softtopk.dispatch_count import DispatchCounter
from fairseq_softtopk.ops import candidate_window, default_window_width, sorted_soft_topk, sorted_soft_topk_window


def _scattered(ranks, index, n):
    """``(rows, n, k)``: the window's ranks in place, zeros elsewhere."""
    rows, _, k = ranks.shape
    return ranks.new_zeros(rows, n, k).scatter(1, index.unsqueeze(-1).expand(-1, -1, k), ranks)


def _beam_like(rng, rows=6, n=3000, spread=3.0):
    """Log-probabilities of beams over a vocabulary: a few likely candidates, a long tail."""
    return torch.log_softmax(torch.randn(rows, n, generator=rng, dtype=torch.float64) * spread, -1)


@pytest.mark.parametrize("epsilon", [0.03, 0.1])
def test_certified_rows_are_the_dense_operator_in_values_and_gradient(rng, epsilon):
    x = _beam_like(rng)
    weights = torch.randn(*x.shape, 5, generator=rng, dtype=x.dtype)
    window_x = x.clone().requires_grad_()
    ranks, index, info = sorted_soft_topk_window(window_x, 5, epsilon=epsilon, tol=1e-9, max_iter=30,
                                                 return_info=True)
    assert index.shape == (6, default_window_width(3000, 5, epsilon)) and ranks.shape == (*index.shape, 5)
    assert int(info.n_overflow) == 0 and not bool(info.overflow.any()) and bool(info.converged)
    dense_x = x.clone().requires_grad_()
    dense = sorted_soft_topk(dense_x, 5, epsilon=epsilon, tol=1e-11)
    scattered = _scattered(ranks, index, x.shape[1])
    torch.testing.assert_close(scattered, dense, atol=1e-8, rtol=0)
    (scattered * weights).sum().backward()
    (dense * weights).sum().backward()
    torch.testing.assert_close(window_x.grad, dense_x.grad, atol=1e-7 * dense_x.grad.abs().max().item(), rtol=0)
    outside = torch.ones_like(x, dtype=torch.bool).scatter(1, index, False)
    assert bool((window_x.grad[outside] == 0).all())
    # the window is the best candidates, best first
    torch.testing.assert_close(x.gather(1, index), x.topk(index.shape[1]).values, rtol=0, atol=0)


def _edge_rows(width, n, k, epsilon, tol, gap):
    """Two rows of ``n`` scores: ``width`` of them at 0 (inside the window), the next one ``gap`` above (row 0) or
    below (row 1) the window's floor, the others far below."""
    x = torch.full((2, n), -1e3, dtype=torch.float64)
    x[:, :width] = 0.0
    floor = candidate_window(torch.zeros(2, 1, dtype=torch.float64), k, epsilon, tol, n_out=n)
    x[0, width] = floor[0, 0] + gap
    x[1, width] = floor[1, 0] - gap
    return x


def test_the_certificate_is_the_candidate_just_past_the_window():
    """A row whose (W + 1)-th best candidate lies at or above the floor is flagged; one whose (W + 1)-th lies
    just below it is certified and is the dense operator there (the candidates past the window carry less than
    tol / 100 of every rank). Comparing the W-th candidate, or the floor of another depth, fails this."""
    k, epsilon, tol, width, n = 3, 0.2, 1e-4, 8, 40
    x = _edge_rows(width, n, k, epsilon, tol, gap=1e-3)
    ranks, index, info = sorted_soft_topk_window(x, k, epsilon=epsilon, width=width, tol=tol, return_info=True)
    assert info.overflow.tolist() == [True, False] and int(info.n_overflow) == 1
    dense = sorted_soft_topk(x, k, epsilon=epsilon, tol=1e-10)
    certified = _scattered(ranks, index, n)[1]
    assert float((certified - dense[1]).abs().max()) < tol
    assert float(dense[1, width:].sum(0).max()) < tol / 100  # what the window leaves out, as certified
    # the floor itself is flagged (at or above)
    at_floor = _edge_rows(width, n, k, epsilon, tol, gap=0.0)
    assert sorted_soft_topk_window(at_floor, k, epsilon=epsilon, width=width, tol=tol,
                                   return_info=True)[2].overflow.tolist() == [True, True]


def test_excluded_candidates_never_overflow_and_get_nothing():
    """-inf candidates past the window carry nothing: a row with fewer finite candidates than W is certified, its
    -inf entries in the window get 0 on every rank."""
    x = torch.full((2, 50), -math.inf, dtype=torch.float64)
    x[0, :6] = torch.tensor([3.0, 1.0, 2.0, 0.5, -1.0, 0.0], dtype=torch.float64)
    x[1, 10:14] = torch.tensor([1.0, 1.5, -2.0, 0.2], dtype=torch.float64)
    ranks, index, info = sorted_soft_topk_window(x, 3, epsilon=0.5, width=8, tol=1e-9, max_iter=30,
                                                 return_info=True)
    assert info.overflow.tolist() == [False, False]
    finite = torch.isfinite(x.gather(1, index))
    assert bool((ranks[~finite] == 0).all())
    dense = sorted_soft_topk(x, 3, epsilon=0.5, tol=1e-11)
    torch.testing.assert_close(_scattered(ranks, index, 50), dense, atol=1e-8, rtol=0)


def test_no_host_synchronisation_and_static_shapes(rng):
    """The whole call, forward and backward, reads nothing on the host; its shapes depend on the arguments only
    (the flag is a tensor), overflowing rows included."""
    x = _beam_like(rng, rows=4, n=600).requires_grad_()
    flat = torch.zeros(2, 600, dtype=torch.float64, requires_grad=True)  # every candidate above the floor
    for scores in (x, flat):
        with DispatchCounter() as counter:
            ranks, index, info = sorted_soft_topk_window(scores, 4, epsilon=0.1, width=32, max_iter=12,
                                                         return_info=True)
            (ranks * torch.arange(4.0, dtype=ranks.dtype)).sum().backward()
        assert counter.total("syncs") == 0, counter.by_innermost("syncs")
        assert ranks.shape == (scores.shape[0], 32, 4) and index.shape == (scores.shape[0], 32)
    assert info.overflow.tolist() == [True, True]


def test_float64_gradcheck_of_a_certified_window(rng):
    x = torch.randn(2, 60, generator=rng, dtype=torch.float64) - 30.0  # a tail far below the floor ...
    x[:, :12] = torch.rand(2, 12, generator=rng, dtype=torch.float64)  # ... and the 12 that carry weight
    x.requires_grad_()
    weights = torch.randn(2, 16, 3, generator=rng, dtype=torch.float64)

    def loss(scores):
        ranks, _ = sorted_soft_topk_window(scores, 3, epsilon=0.3, width=16, tol=1e-12, max_iter=40)
        return (ranks * weights).sum()

    _, _, info = sorted_soft_topk_window(x, 3, epsilon=0.3, width=16, tol=1e-12, max_iter=40, return_info=True)
    assert not bool(info.overflow.any())
    assert torch.autograd.gradcheck(loss, (x,), eps=1e-6, atol=1e-6)


def test_the_default_width_and_bad_arguments():
    assert default_window_width(38840, 5, 0.03) == 64 and default_window_width(38840, 5, 0.1) == 512
    assert default_window_width(40, 5, 0.03) == 40 and default_window_width(38840, 5, 1.0) == 38840
    assert default_window_width(38840, 11, 0.03) == 128  # (k + 1) / 6 times, to a power of two
    with pytest.raises(ValueError, match=r"width must be an integer >= k \(3\), got 2"):
        sorted_soft_topk_window(torch.randn(2, 10), 3, width=2)
    with pytest.raises(ValueError, match=r"takes \(rows, n\) scores, got \(10,\)"):
        sorted_soft_topk_window(torch.randn(10), 3)


def _search(window_width, rng_seed=0, beam=3, epsilon=0.1, to_eos=False):
    """A soft beam search of the tiny LSTM over a 13-word dictionary (three sentences), its gold loss and the
    gradient it gives the model's parameters."""
    pytest.importorskip("fairseq")
    from builders import build_model, make_sample
    from conftest import word_dictionary
    from fairseq_softtopk.modules.beam_search import unroll_beam_search
    from fairseq_softtopk.modules.beam_search_config import BeamSearchConfig
    from fairseq_softtopk.modules.beam_search_to_eos import unroll_beam_search_to_eos

    dictionary = word_dictionary(13)
    torch.manual_seed(rng_seed)
    model = build_model(dictionary, scale=3.0)
    sample = make_sample(dictionary, torch.Generator().manual_seed(rng_seed), [5, 3, 4])
    config = BeamSearchConfig(beam=beam, epsilon=epsilon, tol=1e-9, max_iter=50, window_width=window_width,
                              selection_grad="full")
    encoder_out = model.encoder(sample["net_input"]["src_tokens"], src_lengths=sample["net_input"]["src_lengths"])
    if to_eos:
        out = unroll_beam_search_to_eos(model.decoder, encoder_out, model.encoder.reorder_encoder_out, 3,
                                        dictionary.pad(), dictionary.eos(), dictionary.eos(), config, max_len=6)
        loss = out.scores[:, 0].sum()
    else:
        out = unroll_beam_search(model.decoder, encoder_out, model.encoder.reorder_encoder_out, sample["target"],
                                 dictionary.pad(), dictionary.eos(), config)
        loss = out.gold_lprobs.sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("to_eos", [False, True])
def test_the_search_on_the_static_window_is_the_adaptive_one(to_eos):
    """Soft beam search's default selection (the static window, no host read a step) gives the adaptive window's
    loss and gradient (window_width=0, the solver's window read on the host) up to the solver's tolerance."""
    loss, grads = _search(-1, to_eos=to_eos)
    adaptive_loss, adaptive_grads = _search(0, to_eos=to_eos)
    torch.testing.assert_close(loss, adaptive_loss, atol=1e-7, rtol=1e-7)
    for grad, adaptive in zip(grads, adaptive_grads):
        torch.testing.assert_close(grad, adaptive, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("to_eos", [False, True])
def test_a_step_the_window_does_not_certify_makes_the_batch_search_again_adaptively(monkeypatch, to_eos):
    """A window of the beam's width (3 of the 39 candidates, at an epsilon whose floor reaches far below) overflows:
    the flagged rows are never used, the batch is searched again on the adaptive window, whose result it is
    exactly; the selections of the first search were made (so the flag, not the width, sent it back)."""
    from fairseq_softtopk.modules import beam_selection

    calls = []
    real = beam_selection.sorted_soft_topk_window

    def counted(*args, **kwargs):
        calls.append(kwargs["width"])
        return real(*args, **kwargs)

    monkeypatch.setattr(beam_selection, "sorted_soft_topk_window", counted)
    loss, grads = _search(3, epsilon=0.5, to_eos=to_eos)
    assert calls and set(calls) == {3}
    monkeypatch.setattr(beam_selection, "sorted_soft_topk_window", real)
    adaptive_loss, adaptive_grads = _search(0, epsilon=0.5, to_eos=to_eos)
    assert torch.equal(loss, adaptive_loss)
    for grad, adaptive in zip(grads, adaptive_grads):
        assert torch.equal(grad, adaptive)
