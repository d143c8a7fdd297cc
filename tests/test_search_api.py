"""The public search API (fairseq_softtopk.search) with a decoder written here, not the plugin's: the hard search
against a plain beam-search loop, the gold-token loss along its best beam, labels padded with -100, the soft
search's gradient against finite differences, and the risk loss against the BLEU+1 of the hypotheses."""

import math
import re
import subprocess
import sys
from typing import NamedTuple

import pytest
import torch
from torch import nn

from fairseq_softtopk.modules.sequence_risk import sentence_bleu, strip_sequence
from fairseq_softtopk.search import (BeamSearchConfig, SearchDecoder, beam_search, beam_search_to_eos,
                                     check_decoder, gold_token_loss, observe_selections, repeat_rows, risk_loss)

V, DIM, HIDDEN, BOS, EOS = 9, 4, 6, 1, 2


class GRUState(NamedTuple):
    hidden: torch.Tensor  # (rows, HIDDEN)


class GRUDecoder(nn.Module):
    """The smallest decoder of the protocol: the encoder output is an initial hidden state per sentence."""

    def __init__(self, seed=0, dtype=torch.float64):
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.cell, self.out = nn.Embedding(V, DIM), nn.GRUCell(DIM, HIDDEN), nn.Linear(HIDDEN, V)
        with torch.no_grad():
            self.out.weight.mul_(4.0)  # peaked distributions: beams differ
        self.to(dtype)

    def initial_state(self, encoder_out):
        return GRUState(torch.tanh(encoder_out["hidden"]))

    def embed(self, tokens):
        return self.emb(tokens)

    def embedding_matrix(self):
        return self.emb.weight

    def step(self, inputs, state, encoder_out):
        hidden = self.cell(inputs, state.hidden)
        return torch.log_softmax(self.out(hidden), -1), GRUState(hidden)


def plain_beam_search(decoder, hidden, target, k):
    """Beam search written out for one sentence (``hidden`` ``(HIDDEN,)``, ``target`` its tokens, no padding):
    each beam keeps its score, tokens and the log-probabilities it gave the gold tokens."""
    beams = [(0.0, [], [], torch.tanh(hidden), BOS)]
    for gold in target.tolist():
        candidates = []
        for score, tokens, gold_lprobs, h, last in beams:
            h_new = decoder.cell(decoder.emb.weight[last].unsqueeze(0), h.unsqueeze(0)).squeeze(0)
            lprobs = torch.log_softmax(decoder.out(h_new), -1)
            for token in range(V):
                candidates.append((score + float(lprobs[token]), tokens + [token], gold_lprobs + [float(lprobs[gold])],
                                   h_new, token))
        beams = sorted(candidates, key=lambda c: -c[0])[:k]
    return beams


def _batch(lengths, seed=3, pad=-100):
    g = torch.Generator().manual_seed(seed)
    target = torch.full((len(lengths), max(lengths)), pad, dtype=torch.long)
    for b, n in enumerate(lengths):
        target[b, :n] = torch.randint(3, V, (n,), generator=g)
        target[b, n - 1] = EOS
    hidden = torch.randn(len(lengths), HIDDEN, generator=g, dtype=torch.float64)
    return {"hidden": hidden}, target


def test_the_decoder_written_here_is_a_search_decoder():
    assert isinstance(GRUDecoder(), SearchDecoder)


@torch.no_grad()
def test_hard_search_equals_a_plain_beam_search_and_the_loss_follows_its_best_beam():
    decoder, k = GRUDecoder(), 3
    encoder_out, target = _batch([5, 3, 4])  # padded with -100, as Hugging Face labels are
    out = beam_search(decoder, encoder_out, target, pad=-100, bos=BOS, config=BeamSearchConfig(beam=k, mode="hard"))
    nll = 0.0
    for b, length in enumerate([5, 3, 4]):
        beams = plain_beam_search(decoder, encoder_out["hidden"][b], target[b, :length], k)
        if length == target.shape[1]:  # the longest sentence: the final beams are the search's
            torch.testing.assert_close(out.final_scores[b], torch.tensor([c[0] for c in beams], dtype=torch.float64))
            assert out.tokens[b].tolist() == [c[1] for c in beams]
        best = beams[0]
        nll -= sum(best[2])
    loss = gold_token_loss(out, target, pad=-100)
    torch.testing.assert_close(loss.nll, torch.tensor(nll, dtype=torch.float64))
    assert int(loss.ntokens) == 12 and torch.equal(loss.loss, loss.nll)


@torch.no_grad()
def test_label_smoothing_mixes_in_the_mean_log_probability():
    decoder = GRUDecoder()
    encoder_out, target = _batch([4, 4])
    out = beam_search(decoder, encoder_out, target, pad=-100, bos=BOS, config=BeamSearchConfig(beam=2, mode="hard"))
    smoothed = gold_token_loss(out, target, pad=-100, label_smoothing=0.1, vocab=V)
    eps_i = 0.1 / (V - 1)
    expected = (1 - 0.1 - eps_i) * smoothed.nll - eps_i * out.smooth_lprobs.sum()
    torch.testing.assert_close(smoothed.loss, expected)
    with pytest.raises(ValueError, match="vocabulary's size"):
        gold_token_loss(out, target, pad=-100, label_smoothing=0.1)
    with pytest.raises(ValueError, match="target is"):
        gold_token_loss(out, target[:, :3], pad=-100)


def test_soft_search_tends_to_the_hard_search():
    decoder = GRUDecoder()
    encoder_out, target = _batch([4, 4, 4])
    hard = beam_search(decoder, encoder_out, target, pad=-100, bos=BOS, config=BeamSearchConfig(beam=3, mode="hard"))
    soft = beam_search(decoder, encoder_out, target, pad=-100, bos=BOS,
                       config=BeamSearchConfig(beam=3, epsilon=1e-5, tol=1e-9, max_iter=200))
    torch.testing.assert_close(soft.final_scores, hard.final_scores, atol=1e-4, rtol=0)
    assert torch.equal(soft.tokens, hard.tokens)


def test_soft_search_gradient_matches_finite_differences():
    """float64 gradcheck of the gold-token loss in the encoder output: through the first state, every step's
    soft selection (implicit gradient of the sorted SOFT top-k) and the mixed inputs and states."""
    decoder = GRUDecoder(seed=1)
    encoder_out, target = _batch([3, 3], seed=5)
    config = BeamSearchConfig(beam=2, epsilon=0.5, tol=1e-12, max_iter=200, selection_grad="full")

    def loss(hidden):
        out = beam_search(decoder, {"hidden": hidden}, target, pad=-100, bos=BOS, config=config)
        return gold_token_loss(out, target, pad=-100).loss

    hidden = encoder_out["hidden"].clone().requires_grad_(True)
    assert float(torch.autograd.grad(loss(hidden), hidden)[0].abs().max()) > 0
    assert torch.autograd.gradcheck(loss, (hidden,), eps=1e-6, atol=1e-6, rtol=1e-4)


@torch.no_grad()
def test_search_to_eos_and_its_risk_loss():
    decoder, k = GRUDecoder(seed=2), 3
    encoder_out, target = _batch([4, 5])
    finished = beam_search_to_eos(decoder, encoder_out, 2, pad=0, bos=BOS, eos=EOS, max_len=6,
                                  config=BeamSearchConfig(beam=k, mode="hard"))
    assert finished.scores.shape == (2, k) and torch.isfinite(finished.scores).all()
    assert (finished.tokens.gather(2, (finished.lengths - 1).unsqueeze(-1)) == EOS).all()
    risk = risk_loss(finished, target.clamp_min(0), eos=EOS, pad=0, temperature=0.5)
    for b in range(2):
        reference = strip_sequence(target[b].clamp_min(0).tolist(), EOS, 0)
        costs = torch.tensor([1 - sentence_bleu(strip_sequence(h, EOS, 0), reference)
                              for h in finished.tokens[b].tolist()], dtype=torch.float64)
        weights = torch.softmax(finished.scores[b] / 0.5, -1)
        assert math.isclose(float(risk[b]), float((weights * costs).sum()), rel_tol=1e-12)


@torch.no_grad()
@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_observe_selections_sees_each_step_of_the_search_as_it_selects(mode):
    """The observer is called once per step, in order, with the selection the search made: the first step's
    scores are the decoder's log-probabilities written out here, the followed candidates backtracked give the
    search's final beams and scores, the weights its sharpness; hard mode follows the k best scores. Closed
    after the block; a search to EOS is observed too (every step but its last, which only finishes)."""
    decoder, k = GRUDecoder(), 3
    encoder_out, target = _batch([5, 3, 4])
    batch, T = target.shape
    seen = []
    with observe_selections(seen.append):
        out = beam_search(decoder, encoder_out, target, pad=-100, bos=BOS,
                          config=BeamSearchConfig(beam=k, mode=mode, epsilon=0.05))
    assert [s.step for s in seen] == list(range(T))
    first = torch.log_softmax(decoder.out(decoder.cell(decoder.emb.weight[BOS].expand(batch, DIM),
                                                       torch.tanh(encoder_out["hidden"]))), -1)
    torch.testing.assert_close(seen[0].scores[:, :V], first)
    assert torch.isinf(seen[0].scores[:, V:]).all()  # only beam 0 is live at the first step
    # each sentence's final beams are those after its own last step: traced back from there
    lengths = torch.tensor([5, 3, 4])
    own = torch.arange(k).expand(batch, k)
    beam, tokens = own, []
    for selection in reversed(seen):
        beam = torch.where((lengths == selection.step + 1).unsqueeze(1), own, beam)
        followed = selection.followed.gather(1, beam)
        tokens.append(torch.where((selection.step < lengths).unsqueeze(1), followed % V, -100))
        beam = followed // V
    assert torch.equal(torch.stack(tokens[::-1], -1), out.tokens)
    final = torch.stack([seen[n - 1].scores.gather(1, seen[n - 1].followed)[b] for b, n in enumerate(lengths.tolist())])
    torch.testing.assert_close(final, out.final_scores)
    torch.testing.assert_close(torch.stack([s.weights.amax(1) for s in seen], 1), out.sharpness)
    assert [s.live.tolist() for s in seen] == [[t < n - 1 for n in (5, 3, 4)] for t in range(T)]
    if mode == "hard":
        for selection in seen:
            assert torch.equal(selection.followed, selection.scores.topk(k).indices)
    beam_search(decoder, encoder_out, target, pad=-100, bos=BOS, config=BeamSearchConfig(beam=k, mode=mode))
    assert len(seen) == T  # the observer is gone after the block
    with observe_selections(seen.append):
        finished = beam_search_to_eos(decoder, encoder_out, batch, pad=0, bos=BOS, eos=EOS, max_len=6,
                                      config=BeamSearchConfig(beam=k, mode=mode))
    assert [s.step for s in seen[T:]] == list(range(finished.steps - 1))
    with pytest.raises(TypeError, match="observe_selections needs a callable.*got list"):
        with observe_selections([]):
            pass


@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_a_sentence_in_a_batch_gets_the_beams_of_its_own_search(mode):
    """A sentence shorter than the batch's longest target: its final beams, their scores, the best beam and the
    loss along it are those of a search over that sentence alone (the beams after its own last step), and
    tokens[b, best_beam[b]] is the path whose gold-token log-probabilities the loss sums."""
    decoder, k = GRUDecoder(seed=3), 3
    encoder_out, target = _batch([5, 3, 4])
    config = BeamSearchConfig(beam=k, mode=mode, epsilon=0.3, tol=1e-12)
    with torch.no_grad():
        out = beam_search(decoder, encoder_out, target, pad=-100, bos=BOS, config=config)
        for b, n in enumerate([5, 3, 4]):
            alone = beam_search(decoder, {"hidden": encoder_out["hidden"][b:b + 1]}, target[b:b + 1, :n], pad=-100,
                                bos=BOS, config=config)
            torch.testing.assert_close(out.final_scores[b], alone.final_scores[0], atol=1e-9, rtol=0)
            assert out.tokens[b, :, :n].tolist() == alone.tokens[0].tolist()
            assert bool((out.tokens[b, :, n:] == -100).all())
            assert int(out.best_beam[b]) == int(alone.best_beam[0]) == int(out.final_scores[b].argmax())
            torch.testing.assert_close(out.gold_lprobs[b, :n], alone.gold_lprobs[0], atol=1e-9, rtol=0)
        if mode == "hard":  # the loss's path, fed to the decoder step by step, gives the loss's log-probabilities
            for b, n in enumerate([5, 3, 4]):
                path = out.tokens[b, out.best_beam[b], :n]
                hidden, last, lprobs = torch.tanh(encoder_out["hidden"][b:b + 1]), BOS, []
                for t in range(n):
                    hidden = decoder.cell(decoder.emb.weight[last].unsqueeze(0), hidden)
                    lprobs.append(float(torch.log_softmax(decoder.out(hidden), -1)[0, target[b, t]]))
                    last = int(path[t])
                torch.testing.assert_close(out.gold_lprobs[b, :n], torch.tensor(lprobs, dtype=torch.float64),
                                           atol=1e-9, rtol=0)


def test_a_decoder_without_the_protocol_is_named():
    class NoStep:
        def initial_state(self, encoder_out):
            return None

        def embed(self, tokens):
            return tokens

    with pytest.raises(TypeError, match="NoStep cannot be searched: it has no embedding_matrix, step"):
        check_decoder(NoStep())
    with pytest.raises(TypeError, match="no embedding_matrix, step"):
        beam_search(NoStep(), None, torch.zeros(1, 2, dtype=torch.long), pad=0, bos=1)


@pytest.mark.parametrize("options, message", [
    (dict(mode="Soft"), "mode must be one of ('soft', 'hard'), got 'Soft'"),
    (dict(beam=0), "beam must be an integer >= 1, got 0"),
    (dict(beam=2.5), "beam must be an integer >= 1, got 2.5"),
    (dict(epsilon=math.nan), "epsilon must be a finite number > 0"),
    (dict(epsilon=-1.0, mode="hard"), "epsilon must be a finite number > 0"),
    (dict(cost="l1"), "cost must be one of"),
    (dict(tol=0.0), "tol must be a finite number > 0"),
    (dict(max_iter=0), "max_iter must be an integer >= 1"),
    (dict(beam=5, candidate_pool=3), r"candidate_pool must be 0 \(all candidates\) or an integer >= beam \(5\), got 3"),
    (dict(candidate_pool=-1), "candidate_pool must be 0"),
])
def test_bad_search_options_are_named(options, message):
    with pytest.raises(ValueError, match=message if "\\(" in message else re.escape(message)):
        BeamSearchConfig(**options)


def _padded_inside(target):
    target = target.clone()
    target[0, 1] = -100
    return target


@pytest.mark.parametrize("change, message", [
    (lambda enc, t: (enc, _padded_inside(t), {}), r"right-padded with pad \(-100\): row 0 has a token after padding"),
    (lambda enc, t: (enc, t.masked_fill(t.eq(EOS), V), {}), rf"target ids must be in \[0, {V}\) .* from \d+ to {V}$"),
    (lambda enc, t: (enc, t.masked_fill(t.eq(EOS), -1), {}), r"target ids must be in \[0, 9\) .* from -1 to"),
    (lambda enc, t: (enc, t.double(), {}), "target must hold integer token ids, got dtype torch.float64"),
    (lambda enc, t: (enc, t, {"bos": V}), rf"bos must be a token id in \[0, {V}\)"),
    (lambda enc, t: (enc, t, {"pad": None}), "pad must be an integer token id, got None"),
    (lambda enc, t: (enc, t, {"config": BeamSearchConfig(beam=V + 1)}),
     rf"beam {V + 1} exceeds the first step's candidates: the decoder's {V} tokens less 0 excluded_tokens \({V}\)"),
    (lambda enc, t: ({"hidden": enc["hidden"][:1]}, t, {}),
     "encoder_out has tensors of 1 rows but the target has 2 sentences"),
    (lambda enc, t: (enc, t[:1], {}), "encoder_out has tensors of 2 rows but the target has 1 sentences"),
    (lambda enc, t: (enc, t, {"config": {"beam": 2}}), "config must be a BeamSearchConfig"),
])
def test_bad_search_inputs_are_named_before_the_first_step(change, message):
    """Each of these failed deep inside torch, or searched something else without a word (a target padded inside
    was read at the wrong positions; one encoder row too many was dropped; a beam wider than the vocabulary
    failed in the soft selection's solver, naming neither)."""
    decoder = GRUDecoder()
    encoder_out, target = _batch([4, 3])
    encoder_out, target, overrides = change(encoder_out, target)
    kwargs = {"pad": -100, "bos": BOS, "config": BeamSearchConfig(beam=2), **overrides}
    with pytest.raises((ValueError, TypeError), match=message):
        beam_search(decoder, encoder_out, target, **kwargs)


def test_the_soft_beam_may_not_exceed_the_tokens_left_by_excluded_tokens():
    """(The hard search may: it keeps -inf beams until there are candidates enough, as exhaustive search.)"""
    decoder = GRUDecoder()
    decoder.excluded_tokens = [0, 4]
    encoder_out, target = _batch([3])
    with pytest.raises(ValueError, match=rf"beam {V - 1} exceeds .* {V} tokens less 2 excluded_tokens \({V - 2}\)"):
        beam_search(decoder, encoder_out, target, pad=-100, bos=BOS, config=BeamSearchConfig(beam=V - 1))
    out = beam_search(decoder, encoder_out, target, pad=-100, bos=BOS, config=BeamSearchConfig(beam=V - 2))
    assert torch.isfinite(out.final_scores).all()  # every beam a real hypothesis


@pytest.mark.parametrize("overrides, message", [
    (dict(pad=-100), rf"pad must be a token id in \[0, {V}\)"),
    (dict(eos=V), rf"eos must be a token id in \[0, {V}\)"),
    (dict(pad=EOS), rf"eos and pad are the same token \({EOS}\)"),
    (dict(max_len=0), "max_len must be an integer >= 1"),
    (dict(lenpen=math.nan), "lenpen must be a finite number"),
    (dict(batch=0), "batch must be an integer >= 1, got 0"),
    (dict(batch=3), "encoder_out has tensors of 2 rows but batch= says 3 sentences"),
    (dict(config=BeamSearchConfig(beam=V - 1)), rf"beam {V - 1} exceeds .* less 2 never first"),
])
def test_bad_inputs_of_the_search_to_eos_are_named(overrides, message):
    """pad=-100 (a label convention, not a token) failed with an index error; eos == pad and max_len=0 gave -inf
    scores, and the risk then NaN, without a word."""
    encoder_out, _ = _batch([4, 5])
    kwargs = {"batch": 2, "pad": 0, "bos": BOS, "eos": EOS, "max_len": 6, "config": BeamSearchConfig(beam=2),
              **overrides}
    batch = kwargs.pop("batch")
    with pytest.raises(ValueError, match=message):
        beam_search_to_eos(GRUDecoder(), encoder_out, batch, **kwargs)


@torch.no_grad()
def test_the_losses_name_a_target_of_another_batch_and_a_label_smoothing_out_of_range():
    decoder = GRUDecoder(seed=2)
    encoder_out, target = _batch([4, 5])
    finished = beam_search_to_eos(decoder, encoder_out, 2, pad=0, bos=BOS, eos=EOS, max_len=6,
                                  config=BeamSearchConfig(beam=2, mode="hard"))
    for other in (target[:1], torch.cat([target, target]), target[0]):  # one sentence's costs went to both before
        with pytest.raises(ValueError, match=r"target must be \(batch, T\) with the search's batch of 2 sentences"):
            risk_loss(finished, other.clamp_min(0), eos=EOS, pad=0)
    out = beam_search(decoder, encoder_out, target, pad=-100, bos=BOS, config=BeamSearchConfig(beam=2, mode="hard"))
    for smoothing in (1.0, -0.1, math.nan, "0.1"):
        with pytest.raises(ValueError, match=r"label_smoothing must be a number in \[0, 1\)"):
            gold_token_loss(out, target, pad=-100, label_smoothing=smoothing, vocab=V)


def test_repeat_rows_takes_the_rows_of_every_tensor_in_the_encoder_output():
    order = torch.tensor([0, 0, 1, 1])
    a, b = torch.arange(2.0), torch.arange(6).view(2, 3)
    out = repeat_rows({"a": a, "pair": (b, None), "n": 3}, order)
    assert out["a"].tolist() == [0, 0, 1, 1] and out["pair"][0].tolist() == [[0, 1, 2]] * 2 + [[3, 4, 5]] * 2
    assert out["pair"][1] is None and out["n"] == 3


def test_importing_the_search_api_does_not_import_fairseq():
    code = "import sys, fairseq_softtopk.search; assert 'fairseq' not in sys.modules, 'fairseq imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


class FaultyDecoder(GRUDecoder):
    """GRUDecoder whose ``step`` goes wrong at step ``at``: log-probabilities too wide, too narrow, with an extra
    dimension, or with NaN (two entries) or +inf (one) in them."""

    def __init__(self, fault, at=1):
        super().__init__()
        self.fault, self.at, self.calls = fault, at, 0

    def step(self, inputs, state, encoder_out):
        lprobs, state = super().step(inputs, state, encoder_out)
        t, self.calls = self.calls, self.calls + 1
        if t == self.at:
            if self.fault == "wide":
                lprobs = torch.cat([lprobs, lprobs[:, :2]], -1)
            elif self.fault == "narrow":
                lprobs = lprobs[:, :-1]
            elif self.fault == "unsqueezed":
                lprobs = lprobs.unsqueeze(1)
            else:
                lprobs = lprobs.clone()
                if self.fault == "nan":
                    lprobs[0, 3] = lprobs[2, 5] = float("nan")
                else:
                    lprobs[1, 4] = float("inf")
        return lprobs, state


SEARCHES = {"soft": dict(), "hard": dict(mode="hard"), "soft_pool": dict(candidate_pool=4),
            "sparse": dict(regularizer="quadratic")}


def _search(decoder, search, to_eos):
    encoder_out, target = _batch([4, 3])
    config = BeamSearchConfig(beam=3, **SEARCHES[search])
    if to_eos:
        return beam_search_to_eos(decoder, encoder_out, 2, pad=0, bos=BOS, eos=EOS, max_len=5, config=config)
    return beam_search(decoder, encoder_out, target, pad=-100, bos=BOS, config=config)


@pytest.mark.parametrize("to_eos", [False, True])
@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize("fault, got", [("wide", "(6, 11)"), ("narrow", "(6, 8)"), ("unsqueezed", "(6, 1, 9)")])
def test_a_step_of_the_wrong_width_is_named(fault, got, search, to_eos):
    """Log-probabilities wider than the embedding matrix's rows indexed past it (a raw RuntimeError); narrower ones
    at a later step, or (rows, 1, V), were searched as if they were right, silently: named, with the step."""
    with pytest.raises(ValueError, match=rf"^decoder.step returned log-probabilities of shape {re.escape(got)} at "
                                         rf"step 1; the search expects \(6, 9\): \(batch \* beam, V\), V the rows of "
                                         rf"decoder.embedding_matrix\(\)$"):
        _search(FaultyDecoder(fault), search, to_eos)


@pytest.mark.parametrize("to_eos", [False, True])
@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize("fault, count", [("nan", 2), ("inf", 1)])
def test_nan_or_inf_log_probabilities_are_named_with_the_step_and_their_number(fault, count, search, to_eos):
    """NaN log-probabilities gave a NaN loss (the soft and the hard search: the default one's window left them out
    of the selection) or the operator's "scores contain NaN", without the step; now one error names both. The
    control: the same decoder without the fault searches."""
    with pytest.raises(ValueError, match=rf"^decoder.step returned {count} NaN or \+inf log-probabilities at step 1 "
                                         r"\(of its \(6, 9\) output\): each must be finite, or -inf"):
        _search(FaultyDecoder(fault), search, to_eos)
    assert _search(FaultyDecoder(fault, at=99), search, to_eos) is not None


def test_the_step_output_checks_add_no_host_read_to_the_soft_search():
    """The default soft search (the static window) reads nothing on the host in a decoding step, forward or
    backward: its steps' NaN counts and window certificates are read once, after the search, with the target's
    check before it. The adaptive window's NaN check is the selection operator's own (it reads the scores on the
    host to check them): no host synchronisation in a step outside the selection."""
    from fairseq_softtopk.dispatch_count import DispatchCounter

    encoder_out, target = _batch([5, 3, 4])
    for window_width in (-1, 0):
        with DispatchCounter() as counter:
            out = beam_search(GRUDecoder(), encoder_out, target, pad=-100, bos=BOS,
                              config=BeamSearchConfig(beam=3, window_width=window_width))
            (gold_token_loss(out, target, pad=-100).loss + out.scale_probe).backward()
        syncs = counter.by_innermost("syncs")
        assert "beam_step" not in syncs and "backward" not in syncs, syncs
        if window_width:
            assert set(syncs) == {"other"} and syncs["other"] <= 3, syncs
        else:
            assert syncs["sorted_soft_topk"] >= target.shape[1] and syncs["other"] <= 2, syncs


def test_the_default_selection_gradient_is_capped_as_the_criterions():
    """``BeamSearchConfig()`` caps the selection gradient as the fairseq criterion does by default (the exact one
    reached norms of 1e12 on Multi30k and wrecked the model): the same gradient as ``selection_grad="capped"`` with
    the criterion's cap, not the paper's exact one, which stays one argument away."""
    pytest.importorskip("fairseq")
    import dataclasses

    from fairseq_softtopk.criterions.soft_beam_search import SoftBeamSearchConfig

    criterion = {f.name: f.default for f in dataclasses.fields(SoftBeamSearchConfig)}
    default = BeamSearchConfig()
    assert (default.selection_grad, default.selection_grad_cap) == (str(criterion["topk_grad"]),
                                                                    criterion["topk_grad_cap"]) == ("capped", 0.3)
    encoder_out, target = _batch([5, 4], seed=4)
    grads = {}
    for name, options in {"default": {}, "capped": dict(selection_grad="capped", selection_grad_cap=0.3),
                          "full": dict(selection_grad="full")}.items():
        hidden = encoder_out["hidden"].clone().requires_grad_(True)
        out = beam_search(GRUDecoder(seed=1), {"hidden": hidden}, target, pad=-100, bos=BOS,
                          config=BeamSearchConfig(beam=3, epsilon=0.05, **options))
        loss = gold_token_loss(out, target, pad=-100).loss
        grads[name] = torch.autograd.grad(loss if out.scale_probe is None else loss + out.scale_probe, hidden)[0]
    assert torch.equal(grads["default"], grads["capped"])
    assert float((grads["full"] - grads["capped"]).norm()) > 0.01 * float(grads["full"].norm())  # the cap acts
