"""Unrolled beam search (modules/beam_search.py) on a small recurrent decoder."""

import itertools
from typing import NamedTuple

import pytest
import torch
from torch import nn

from conftest import recorded_solves

from fairseq_softtopk.modules.beam_search import BeamSearchConfig, mix_state, unroll_beam_search

BOS, PAD = 0, 1


class TinyState(NamedTuple):
    hidden: torch.Tensor  # (batch, 1, H)
    input_feed: torch.Tensor  # (batch, H)


class TinyDecoder(nn.Module):
    """An Elman RNN decoder with the step-on-embeddings interface of softtopk_lstm."""

    def __init__(self, vocab: int, dim: int = 6, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.cell = nn.RNNCell(2 * dim, dim)
        self.out = nn.Linear(dim, vocab)
        with torch.no_grad():
            self.out.weight.mul_(4.0)  # peaked distributions, so that beams differ clearly

    def initial_state(self, encoder_out):
        return TinyState(encoder_out.unsqueeze(1), torch.zeros_like(encoder_out))

    def embed(self, tokens):
        return self.embed_tokens(tokens)

    def embedding_matrix(self):
        return self.embed_tokens.weight

    def step(self, inputs, state, encoder_out):
        h = self.cell(torch.cat([inputs, state.input_feed], -1), state.hidden[:, 0])
        return torch.log_softmax(self.out(h), -1), TinyState(h.unsqueeze(1), h + encoder_out)

    def sequence_logprob(self, encoder_out, tokens):
        """Log-probability of one token sequence, decoded from scratch (the reference)."""
        state = self.initial_state(encoder_out)
        inputs = self.embed(torch.tensor([BOS]))
        total = 0.0
        for tok in tokens:
            lprobs, state = self.step(inputs, state, encoder_out)
            total += float(lprobs[0, tok])
            inputs = self.embed(torch.tensor([tok]))
        return total


def reorder(encoder_out, order):
    return encoder_out.index_select(0, order)


def run(decoder, enc, target, **kwargs):
    return unroll_beam_search(decoder, enc, reorder, target, PAD, BOS, BeamSearchConfig(**kwargs))


@pytest.fixture
def setup(rng):
    vocab = 5
    decoder = TinyDecoder(vocab)
    enc = torch.randn(2, 6, generator=rng)
    target = torch.tensor([[2, 3, 4, 2], [4, 4, 3, PAD]])
    return decoder, enc, target


def test_mix_state_weights_predecessors():
    state = TinyState(torch.arange(12.0).view(4, 1, 3), torch.arange(12.0).view(4, 3))
    weights = torch.tensor([[[0.0, 1.0], [1.0, 0.0]], [[0.5, 0.0], [0.5, 1.0]]])  # batch 2, beam 2
    mixed = mix_state(state, weights)
    torch.testing.assert_close(mixed.input_feed[0], state.input_feed[1])
    torch.testing.assert_close(mixed.input_feed[1], state.input_feed[0])
    torch.testing.assert_close(mixed.input_feed[2], 0.5 * (state.input_feed[2] + state.input_feed[3]))
    torch.testing.assert_close(mixed.hidden[3], state.hidden[3])


def test_hard_mode_keeping_everything_is_exhaustive_search(rng):
    """With beam >= V^(T-1) nothing is pruned: the final beams are the exact top sequences."""
    vocab, T = 3, 3
    decoder = TinyDecoder(vocab, seed=3)
    enc = torch.randn(1, 6, generator=rng)
    beam = vocab ** (T - 1)
    with torch.no_grad():
        out = run(decoder, enc, torch.zeros(1, T, dtype=torch.long) + 2, beam=beam, mode="hard")
        all_seqs = sorted(((decoder.sequence_logprob(enc, s), s) for s in itertools.product(range(vocab), repeat=T)),
                          reverse=True)[:beam]
    torch.testing.assert_close(out.final_scores[0], torch.tensor([s for s, _ in all_seqs]), atol=1e-5, rtol=0)
    assert [tuple(seq) for seq in out.tokens[0].tolist()] == [seq for _, seq in all_seqs]


def test_hard_mode_equals_reference_beam_search(setup):
    """Each step keeps the k best of the k x V extensions, rescored from scratch per sequence; a sentence's final
    beams are those after its own last step (the second sentence has 3 tokens of the batch's 4), padded after."""
    decoder, enc, target = setup
    k = 3
    with torch.no_grad():
        out = run(decoder, enc, target, beam=k, mode="hard")
        for b, length in enumerate([4, 3]):
            beams = [((), 0.0)]
            for _ in range(length):
                ext = [(seq + (j,), decoder.sequence_logprob(enc[b:b + 1], seq + (j,))) for seq, _ in beams
                       for j in range(decoder.out.out_features)]
                beams = sorted(ext, key=lambda e: -e[1])[:k]
            torch.testing.assert_close(out.final_scores[b], torch.tensor([s for _, s in beams]), atol=1e-5, rtol=0)
            assert [tuple(s) for s in out.tokens[b, :, :length].tolist()] == [s for s, _ in beams]
            assert bool((out.tokens[b, :, length:] == PAD).all())


def test_loss_follows_the_best_beam(setup):
    """gold_lprobs are the gold-token log-probs along the backtracked best final beam."""
    decoder, enc, target = setup
    with torch.no_grad():
        out = run(decoder, enc, target, beam=2, mode="hard")
        for b, length in enumerate([4, 3]):
            prefix = out.tokens[b, out.best_beam[b], :length].tolist()
            expected = []
            state = decoder.initial_state(enc[b:b + 1])
            inputs = decoder.embed(torch.tensor([BOS]))
            for t in range(length):
                lprobs, state = decoder.step(inputs, state, enc[b:b + 1])
                expected.append(float(lprobs[0, target[b, t]]))
                inputs = decoder.embed(torch.tensor([prefix[t]]))
            torch.testing.assert_close(out.gold_lprobs[b, :length], torch.tensor(expected), atol=1e-5, rtol=0)
            assert bool((out.gold_lprobs[b, length:] == 0).all())


def test_soft_mode_tends_to_hard_mode(setup):
    decoder, enc, target = setup
    with torch.no_grad():
        hard = run(decoder, enc, target, beam=3, mode="hard")
        gaps = []
        for epsilon in (1e-1, 1e-2, 1e-4):
            soft = run(decoder, enc, target, beam=3, mode="soft", epsilon=epsilon, tol=1e-6)
            gaps.append(float((soft.gold_lprobs - hard.gold_lprobs).abs().max()))
        assert torch.equal(soft.tokens, hard.tokens)
        assert float(soft.sharpness.min()) > 0.999
    assert gaps[-1] < 1e-4 and gaps[-1] <= gaps[0]


def test_candidate_pool_matches_full_soft_search_when_it_holds_the_mass(setup):
    decoder, enc, target = setup
    with torch.no_grad():
        full = run(decoder, enc, target, beam=2, mode="soft", epsilon=1e-3, tol=1e-7)
        pooled = run(decoder, enc, target, beam=2, mode="soft", epsilon=1e-3, tol=1e-7, candidate_pool=6)
    torch.testing.assert_close(pooled.gold_lprobs, full.gold_lprobs, atol=1e-5, rtol=0)


def _embedding_grad(decoder, enc, target, **kwargs):
    decoder.zero_grad()
    out = run(decoder, enc, target, **kwargs)
    (-out.gold_lprobs.sum()).backward()
    return decoder.embed_tokens.weight.grad.clone(), out


def test_gradients_flow_through_the_selection_only_in_soft_mode(setup):
    _, enc, target = setup
    decoder = TinyDecoder(12)  # more tokens than two beams can use in four steps
    grad_hard, hard = _embedding_grad(decoder, enc, target, beam=2, mode="hard")
    used = set(hard.tokens.flatten().tolist()) | {BOS}
    unused = [v for v in range(12) if v not in used]
    assert unused, "the test needs a token that no beam selected"
    assert bool((grad_hard[unused] == 0).all())
    grad_soft, _ = _embedding_grad(decoder, enc, target, beam=2, mode="soft", epsilon=1.0)
    assert float(grad_soft[unused].abs().sum()) > 0
    # and gradient reaches the decoder's recurrent weights in both modes
    assert decoder.cell.weight_hh.grad is not None and float(decoder.cell.weight_hh.grad.abs().sum()) > 0


@pytest.mark.parametrize("epsilon, regularizer", [(1.0, "entropic"), (0.1, "entropic"), (1.0, "quadratic"),
                                                  (0.3, "quadratic")])
def test_soft_search_gradient_matches_finite_differences(rng, epsilon, regularizer):
    """The whole unrolled soft search (selection, mixing, backtracking) is differentiated exactly, with either
    regulariser of the selection."""
    decoder = TinyDecoder(7).double()
    enc = torch.randn(2, 6, generator=rng, dtype=torch.float64)
    target = torch.tensor([[2, 3, 4, 2], [4, 4, 3, PAD]])
    weight = decoder.out.weight
    start = weight.detach().clone()
    direction = torch.randn(start.shape, generator=rng, dtype=torch.float64)

    def loss_at(w):
        with torch.no_grad():
            weight.copy_(w)
        return -run(decoder, enc, target, beam=3, mode="soft", epsilon=epsilon, tol=1e-12,
                    regularizer=regularizer, selection_grad="full").gold_lprobs.sum()

    decoder.zero_grad()
    loss_at(start).backward()
    analytic = float((weight.grad * direction).sum())
    h = 1e-6
    numeric = (float(loss_at(start + h * direction)) - float(loss_at(start - h * direction))) / (2 * h)
    assert analytic != 0 and analytic == pytest.approx(numeric, rel=1e-6, abs=1e-8)


def test_candidate_window_changes_nothing_at_the_tolerance(rng):
    """The default soft search solves on a window of candidates; the full problem agrees."""
    from fairseq_softtopk.modules.beam_selection import compact_rows
    from fairseq_softtopk.ops import candidate_window, sorted_soft_topk

    scores = torch.cat([torch.randn(4, 6, generator=rng, dtype=torch.float64) * 0.2,
                        -3 - 10 * torch.rand(4, 3000, generator=rng, dtype=torch.float64)], dim=-1)
    scores = scores[:, torch.randperm(3006, generator=rng)]
    kth = scores.topk(4, dim=-1).values[:, -1:]
    inside = scores >= candidate_window(kth, 3, epsilon=0.1, tol=1e-8, n_out=scores.shape[-1])
    assert 4 <= int(inside.sum(-1).min()) and int(inside.sum(-1).max()) < 3006
    full = sorted_soft_topk(scores, 3, epsilon=0.1, tol=1e-10)
    ids, valid = compact_rows(inside)
    window = sorted_soft_topk(scores.gather(1, ids).masked_fill(~valid, -float("inf")), 3, epsilon=0.1, tol=1e-10)
    expected = full.gather(1, ids.unsqueeze(-1).expand(-1, -1, 3)) * valid.unsqueeze(-1)
    torch.testing.assert_close(window, expected, atol=1e-8, rtol=0)
    assert float(full.sum(-1).masked_select(~inside).max()) < 1e-10


def test_compact_rows_lists_the_true_columns_of_each_row(rng):
    from fairseq_softtopk.modules.beam_selection import compact_rows

    mask = torch.rand(7, 40, generator=rng) < 0.3
    mask[3] = False  # an empty row is all padding
    index, valid = compact_rows(mask)
    assert index.shape == (7, int(mask.sum(-1).max()))
    for row in range(7):
        expected = mask[row].nonzero().flatten().tolist()
        assert index[row][valid[row]].tolist() == expected
        assert int(valid[row].sum()) == len(expected)


def test_drop_negligible_keeps_every_rank_within_the_budget(rng):
    from fairseq_softtopk.modules.beam_selection import drop_negligible
    from fairseq_softtopk.ops import sorted_soft_topk

    scores = torch.randn(5, 400, generator=rng, dtype=torch.float64) * 2
    A = sorted_soft_topk(scores, 4, epsilon=0.1, tol=1e-10)
    cand = torch.arange(400).expand(5, -1)
    kept, kept_cand = drop_negligible(A, cand, budget=1e-6)
    assert kept.shape[1] < 400  # most candidates are far below the selected ones
    rebuilt = torch.zeros_like(A).scatter_add_(1, kept_cand.unsqueeze(-1).expand(-1, -1, 4), kept)
    assert float((A - rebuilt).abs().sum(1).max()) < 1e-6  # dropped mass per rank
    assert float((A - rebuilt).min()) >= 0  # only whole candidates are dropped, none is counted twice


def test_mix_embeddings_is_the_weighted_sum_of_token_embeddings(rng):
    from fairseq_softtopk.modules.beam_search import mix_embeddings

    for m in (11, 45):  # fewer candidates than tokens (embedding bags) and more (summed per token)
        embeddings = torch.randn(30, 8, generator=rng, dtype=torch.float64, requires_grad=True)
        tokens = torch.randint(0, 30, (3, m), generator=rng)
        A = torch.rand(3, m, 4, generator=rng, dtype=torch.float64, requires_grad=True)
        expected = torch.einsum("bml,bmd->bld", A, embeddings[tokens]).reshape(12, 8)
        torch.testing.assert_close(mix_embeddings(embeddings, tokens, A), expected)
        assert torch.autograd.gradcheck(lambda e, a: mix_embeddings(e, tokens, a), (embeddings, A))


def reference_soft_beam_search(decoder, enc, target, k, epsilon, relative=0.0, quadratic=False):
    """Algorithm 2 of the paper written out for one sentence, densely (no window, no dropped
    candidates): A over all k*V candidates; beam l's input is sum_{i,j} A[(i,j), l] E[j], its state
    sum_i (sum_j A[(i,j), l]) h_i, its score and predecessor those of argmax_c A[c, l].
    With ``relative`` > 0, each step's epsilon is max(epsilon, relative * mean gap of the k + 1 best
    scores), a constant of the backward pass (a Python float). With ``quadratic``, A is the sorted sparse
    soft top-k (``regularization = epsilon``) of all k*V candidates, and a beam whose largest weight is shared
    follows the best-scored of those candidates.

    Returns ``(gold, final_scores, tokens)``: gold-token log-probs along the backtracked best
    beam ``(T,)``, final cumulative scores ``(k,)`` and final beam sequences ``(k, T)``.
    """
    from fairseq_softtopk.ops import sorted_soft_topk, sorted_sparse_soft_topk

    T = len(target)
    E = decoder.embedding_matrix()
    V = E.shape[0]
    enc_k = enc.expand(k, -1)
    state = decoder.initial_state(enc_k)
    inputs = decoder.embed(torch.full((k,), BOS))
    cum = torch.full((k,), -float("inf"), dtype=E.dtype)
    cum[0] = 0.0
    preds, toks, golds, cums = [], [], [], []
    for t in range(T):
        lprobs, new_state = decoder.step(inputs, state, enc_k)  # (k, V)
        golds.append(lprobs[:, target[t]])
        scores = (cum.unsqueeze(1) + lprobs).reshape(-1)
        step_epsilon = epsilon
        if relative > 0:
            best = sorted(scores.tolist(), reverse=True)[:k + 1]
            step_epsilon = max(epsilon, relative * (best[0] - best[k]) / k)
        if quadratic:
            A = sorted_sparse_soft_topk(scores.unsqueeze(0), k, regularization=step_epsilon, tol=1e-12)[0]
        else:
            A = sorted_soft_topk(scores.unsqueeze(0), k, epsilon=step_epsilon, tol=1e-12)[0]  # (k*V, k)
        next_inputs, next_states, pred, tok, next_cum = [], [], [], [], []
        for l in range(k):
            w = A[:, l].reshape(k, V)
            next_inputs.append((w.sum(0).unsqueeze(1) * E).sum(0))
            beam_w = w.sum(1)
            next_states.append([(beam_w.view(-1, *[1] * (x.dim() - 1)) * x).sum(0) for x in new_state])
            if quadratic:  # exact ties of the largest weight (structural there) go to the best score
                tied = A[:, l] >= A[:, l].max() - 16 * torch.finfo(A.dtype).eps
                c = int(torch.where(tied, scores, -float("inf")).argmax())
            else:
                c = int(A[:, l].argmax())
            pred.append(c // V)
            tok.append(c % V)
            next_cum.append(scores[c])
        inputs = torch.stack(next_inputs)
        state = type(new_state)(*[torch.stack([s[f] for s in next_states]) for f in range(len(new_state))])
        cum = torch.stack(next_cum)
        preds.append(pred)
        toks.append(tok)
        cums.append(cum)
    beam = int(cums[-1].argmax())
    gold = [None] * T
    for t in range(T - 1, -1, -1):
        gold[t] = golds[t][preds[t][beam]]
        beam = preds[t][beam]
    tokens = []
    for l in range(k):
        seq, b = [], l
        for t in range(T - 1, -1, -1):
            seq.append(toks[t][b])
            b = preds[t][b]
        tokens.append(seq[::-1])
    return torch.stack(gold), cums[-1], tokens


@pytest.mark.parametrize("epsilon", [0.3, 1.0])
def test_soft_mode_equals_the_papers_algorithm_written_out(rng, epsilon):
    """Mixed states (not the argmax predecessor's), mixed embeddings, and each beam scored by
    its largest-weight candidate (not the A-weighted expectation), against a dense re-implementation."""
    decoder = TinyDecoder(6, seed=5).double()
    enc = torch.randn(2, 6, generator=rng, dtype=torch.float64)
    target = torch.tensor([[2, 3, 4, 2, 5], [4, 4, 3, 5, PAD]])
    k = 3
    with torch.no_grad():
        out = run(decoder, enc, target, beam=k, mode="soft", epsilon=epsilon, tol=1e-10)
        # the test needs selections that are really soft, else mixing equals following the argmax
        assert float(out.sharpness[:, 1:].min()) < 0.8
        for b, length in enumerate([5, 4]):
            gold, final, tokens = reference_soft_beam_search(decoder, enc[b:b + 1], target[b, :length].tolist(), k,
                                                             epsilon)
            torch.testing.assert_close(out.gold_lprobs[b, :length], gold, atol=1e-7, rtol=0)
            # a shorter sentence's final beams are those after its own last step, padded after it
            torch.testing.assert_close(out.final_scores[b], final, atol=1e-7, rtol=0)
            assert [row[:length] for row in out.tokens[b].tolist()] == tokens
            assert bool((out.tokens[b, :, length:] == PAD).all())


@pytest.mark.parametrize("relative", [0.5, 2.0])
def test_relative_epsilon_equals_the_written_out_algorithm_with_a_per_step_epsilon(rng, relative):
    """``epsilon_relative``: per sentence and step, epsilon = max(epsilon, c * mean gap of the k + 1
    best); values and gradients (the per-step epsilon a constant of the backward pass) against the
    dense re-implementation run with that epsilon step by step."""
    k, epsilon = 3, 0.05
    target = torch.tensor([[2, 3, 4, 2, 5], [4, 4, 3, 5, 2]])
    enc = torch.randn(2, 6, generator=rng, dtype=torch.float64)
    decoder = TinyDecoder(6, seed=5).double()
    out = run(decoder, enc, target, beam=k, mode="soft", epsilon=epsilon, tol=1e-10, epsilon_relative=relative,
              selection_grad="full")
    fixed = run(decoder, enc, target, beam=k, mode="soft", epsilon=epsilon, tol=1e-10)
    # the per-row epsilon makes the selection softer than the floor alone
    assert float(out.sharpness.mean()) < float(fixed.sharpness.mean()) - 0.05
    out.gold_lprobs.sum().backward()
    grads = [p.grad.clone() for p in decoder.parameters()]
    decoder.zero_grad()
    total = 0.0
    for b in range(2):
        gold, final, tokens = reference_soft_beam_search(decoder, enc[b:b + 1], target[b].tolist(), k, epsilon,
                                                         relative)
        torch.testing.assert_close(out.gold_lprobs[b].detach(), gold.detach(), atol=1e-7, rtol=0)
        torch.testing.assert_close(out.final_scores[b].detach(), final.detach(), atol=1e-7, rtol=0)
        assert out.tokens[b].tolist() == tokens
        total = total + gold.sum()
    total.backward()
    for ours, ref in zip(grads, [p.grad for p in decoder.parameters()]):
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)


def test_relative_epsilon_needs_the_linear_cost():
    with pytest.raises(ValueError, match="linear cost"):
        BeamSearchConfig(epsilon_relative=0.5, cost="paper")
    with pytest.raises(ValueError, match="epsilon_relative must be >= 0"):
        BeamSearchConfig(epsilon_relative=-1.0)


def test_near_ties_compares_the_gaps_among_the_k_plus_one_best_with_epsilon():
    from fairseq_softtopk.modules.beam_selection import near_ties

    scores = torch.tensor([[0.0, -1.0, -2.0, -2.05, -9.0],  # ranks 3 / 4 (the rest boundary) 0.05 apart
                           [0.0, -1.0, -2.0, -3.0, -3.01],  # the tie is below the k+1 best: none
                           [0.0, -0.02, -2.0, -4.0, -6.0]])  # ranks 1 / 2 0.02 apart
    top = scores.topk(4, dim=-1).values  # k = 3
    config = BeamSearchConfig(beam=3, epsilon=0.1)
    assert near_ties(scores, top, config).tolist() == [True, False, True]
    assert near_ties(scores, top, BeamSearchConfig(beam=3, epsilon=0.03)).tolist() == [False, False, True]
    # sqeuclidean is the linear problem at epsilon / 2
    assert near_ties(scores, top, BeamSearchConfig(beam=3, epsilon=0.06, cost="sqeuclidean")).tolist() == \
        [False, False, True]


def test_newton_iterations_are_counted_over_the_steps(setup):
    """``newton_iters`` is the sum of the iterations that each step's solve reports (0 in hard mode)."""
    decoder, enc, target = setup
    with recorded_solves() as infos:
        out = run(decoder, enc, target, beam=2, epsilon=0.3, tol=1e-9)
    assert len(infos) == target.shape[1] and sum(i.n_iter for i in infos) > 0
    assert out.newton_iters == sum(i.n_iter for i in infos)
    assert run(decoder, enc, target, beam=2, mode="hard").newton_iters == 0


def test_unconverged_solves_are_counted_not_warned(setup):
    """With max_iter=1 and a tight tol the steps' solves miss their tolerance: n_unconverged counts exactly
    the solves whose info says so, and the search emits no SoftTopKConvergenceWarning (it counts them; a
    warning per step would fill training logs)."""
    import warnings

    from fairseq_softtopk.ops import SoftTopKConvergenceWarning

    decoder, enc, target = setup
    for max_iter, tol in ((1, 1e-12), (50, 1e-4)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with recorded_solves() as infos:
                out = run(decoder, enc, target, beam=2, epsilon=0.3, tol=tol, max_iter=max_iter)
        assert len(infos) == target.shape[1]
        assert out.n_unconverged == [i.converged for i in infos].count(False)
        assert not [w for w in caught if issubclass(w.category, SoftTopKConvergenceWarning)]
        assert (out.n_unconverged > 0) == (max_iter == 1)


@pytest.mark.parametrize("pool", [0, 6])
def test_fixed_iterations_search_equals_the_default_search(rng, pool):
    """The sync-free search (every solve exactly max_iter iterations, no window, nothing dropped) gives the
    default search's beams, losses and gradients where the solves converge, and counts the unconverged
    solves on the device."""
    decoder = TinyDecoder(9).double()
    enc = torch.randn(2, 6, generator=rng, dtype=torch.float64)
    target = torch.tensor([[2, 3, 4, 2, 5], [4, 4, 3, PAD, PAD]])
    options = dict(beam=3, mode="soft", epsilon=0.3, tol=1e-10, candidate_pool=pool)
    grad_default, default = _embedding_grad(decoder, enc, target, **options)
    grad_fixed, fixed = _embedding_grad(decoder, enc, target, fixed_iterations=True, max_iter=30, **options)
    assert torch.equal(fixed.tokens, default.tokens) and torch.equal(fixed.best_beam, default.best_beam)
    torch.testing.assert_close(fixed.gold_lprobs, default.gold_lprobs, atol=1e-9, rtol=0)
    torch.testing.assert_close(fixed.sharpness, default.sharpness, atol=1e-9, rtol=0)
    torch.testing.assert_close(grad_fixed, grad_default, atol=1e-8, rtol=1e-7)
    assert torch.is_tensor(fixed.n_unconverged) and int(fixed.n_unconverged) == 0
    assert fixed.newton_iters == 30 * target.shape[1]
    # one iteration cannot meet tol 1e-10 at any step: every step is counted
    starved = run(decoder, enc, target, fixed_iterations=True, max_iter=1, **options)
    assert int(starved.n_unconverged) == target.shape[1]


def test_fixed_iterations_selection_is_one_graph_without_host_syncs(rng):
    """torch.compile's tracer sees one step's selection whole with fixed_iterations and with the default static
    window; the adaptive window (window_width=0) breaks the graph (its width and the solver's stopping test are
    read on the host), which is what makes this test able to fail."""
    from fairseq_softtopk.modules.beam_selection import select_beams

    scores = (torch.log_softmax(torch.randn(4, 3 * 50, generator=rng), -1)).requires_grad_()
    kth = scores.detach().topk(4, dim=-1).values[:, -1:]

    def selection(config):
        def step(x):
            sel = select_beams(x, 3, config, kth)
            return sel.weights, sel.candidates, sel.converged
        return step

    for pool in (0, 20):
        fixed = BeamSearchConfig(beam=3, epsilon=0.1, candidate_pool=pool, fixed_iterations=True, max_iter=12)
        explained = torch._dynamo.explain(selection(fixed))(scores)
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    explained = torch._dynamo.explain(selection(BeamSearchConfig(beam=3, epsilon=0.1)))(scores)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    adaptive = BeamSearchConfig(beam=3, epsilon=0.1, window_width=0)
    torch._dynamo.reset()
    assert torch._dynamo.explain(selection(adaptive))(scores).graph_break_count > 0


@pytest.mark.parametrize("regularization", [0.3, 1.0])
def test_quadratic_soft_mode_equals_the_written_out_algorithm_with_the_sparse_operator(rng, regularization):
    """--topk-regularizer quadratic: the search mixes only the candidates of the sparse plan's support; the
    dense algorithm over all k*V candidates gives the same beams and scores."""
    decoder = TinyDecoder(6, seed=5).double()
    enc = torch.randn(2, 6, generator=rng, dtype=torch.float64)
    target = torch.tensor([[2, 3, 4, 2, 5], [4, 4, 3, 5, PAD]])
    k = 3
    with torch.no_grad():
        out = run(decoder, enc, target, beam=k, mode="soft", epsilon=regularization, tol=1e-12,
                  regularizer="quadratic")
        assert float(out.sharpness[:, 1:].min()) < 0.9  # really soft selections
        for b, length in enumerate([5, 4]):
            gold, final, tokens = reference_soft_beam_search(decoder, enc[b:b + 1], target[b, :length].tolist(), k,
                                                             regularization, quadratic=True)
            torch.testing.assert_close(out.gold_lprobs[b, :length], gold, atol=1e-9, rtol=0)
            torch.testing.assert_close(out.final_scores[b], final, atol=1e-9, rtol=0)
            assert [row[:length] for row in out.tokens[b].tolist()] == tokens


@pytest.mark.parametrize("window_min", [None, 1], ids=["whole_row", "narrow_window"])
def test_quadratic_search_on_the_support_equals_the_search_on_every_candidate(rng, monkeypatch, window_min):
    """The sync-free search keeps every candidate (nothing dropped); the default keeps the support only: the
    candidates dropped weigh exactly 0, so beams, losses and gradients agree; also where the operator's
    window (what the default selection receives) is narrower than the 27 candidates."""
    if window_min is not None:
        from fairseq_softtopk.ops import quadratic_semi_dual

        monkeypatch.setattr(quadratic_semi_dual, "_WINDOW_MIN", window_min)
    decoder = TinyDecoder(9).double()
    enc = torch.randn(2, 6, generator=rng, dtype=torch.float64)
    target = torch.tensor([[2, 3, 4, 2, 5], [4, 4, 3, PAD, PAD]])
    options = dict(beam=3, mode="soft", epsilon=0.5, tol=1e-12, regularizer="quadratic")
    grad_support, support = _embedding_grad(decoder, enc, target, **options)
    grad_every, every = _embedding_grad(decoder, enc, target, fixed_iterations=True, max_iter=20, **options)
    assert torch.equal(every.tokens, support.tokens)
    torch.testing.assert_close(every.gold_lprobs, support.gold_lprobs, atol=1e-12, rtol=0)
    torch.testing.assert_close(grad_every, grad_support, atol=1e-12, rtol=1e-10)
    assert int(every.n_unconverged) == 0


def test_quadratic_soft_mode_is_hard_mode_below_the_score_gaps(setup):
    decoder, enc, target = setup
    with torch.no_grad():
        hard = run(decoder, enc, target, beam=3, mode="hard")
        sparse = run(decoder, enc, target, beam=3, mode="soft", epsilon=1e-7, regularizer="quadratic")
    assert torch.equal(sparse.tokens, hard.tokens)
    torch.testing.assert_close(sparse.gold_lprobs, hard.gold_lprobs, atol=0, rtol=0)


def test_quadratic_regularizer_needs_the_linear_cost_and_no_compile():
    with pytest.raises(ValueError, match="quadratic regularizer needs the linear cost"):
        BeamSearchConfig(regularizer="quadratic", cost="paper")
    with pytest.raises(ValueError, match="regularizer must be one of"):
        BeamSearchConfig(regularizer="l2")


@pytest.mark.parametrize("options", [dict(mode="hard"), dict(mode="soft", epsilon=0.5, regularizer="quadratic"),
                                     dict(mode="soft", epsilon=0.5, tol=1e-8)], ids=["hard", "quadratic", "entropic"])
def test_mixed_candidates_are_counted_over_the_live_steps(rng, monkeypatch, options):
    """mixed_sum / mixed_count: the candidates with a nonzero weight in the new beams, summed over the steps whose
    selection reaches the loss (k per step in hard mode; the sparse plan's support, recomputed here)."""
    from fairseq_softtopk.modules import beam_search
    from fairseq_softtopk.ops import sorted_sparse_soft_topk

    decoder = TinyDecoder(9).double()
    enc = torch.randn(2, 6, generator=rng, dtype=torch.float64)
    target = torch.tensor([[2, 3, 4, 2, 5], [4, 4, 3, PAD, PAD]])
    recorded, original = [], beam_search.select_beams

    def recording(scores, *args, **kwargs):
        selection = original(scores, *args, **kwargs)
        recorded.append((scores.detach().clone(), selection.weights.detach()))
        return selection

    monkeypatch.setattr(beam_search, "select_beams", recording)
    with torch.no_grad():
        out = run(decoder, enc, target, beam=3, **options)
    live_steps = [t < length - 1 for length in (5, 3) for t in range(5)]
    assert int(out.mixed_count) == sum(live_steps) == 6
    expected = 0
    for t, (scores, weights) in enumerate(recorded):
        for b, length in enumerate((5, 3)):
            if t >= length - 1:
                continue
            if options["mode"] == "hard":
                expected += 3
            elif options.get("regularizer") == "quadratic":
                expected += int((sorted_sparse_soft_topk(scores[b], 3, regularization=0.5).sum(-1) > 0).sum())
            else:
                expected += int((weights[b].sum(-1) > 0).sum())
    assert int(out.mixed_sum) == expected
    if options.get("regularizer") == "quadratic":
        assert 6 * 3 < expected < 6 * 27  # more than the beams, far fewer than all k * V candidates
