"""Differentiable beam search (Xie et al., NeurIPS 2020, section 5.2, Algorithm 2, appendix C.2).

Beam search is unrolled for as many steps as the gold target has tokens, batched over
sentences and beams. At each step the k x V extensions of the k beams are scored by their
cumulative log-likelihood and the *sorted* top-k of these scores picks the next beams:

* soft mode: ``A = sorted_soft_topk(scores)`` of shape ``(k*V, k)``; the next input of beam
  ``l`` is ``sum_{i,j} A[(i,j), l] w_j`` (embedding-weighted tokens), its recurrent state is
  ``sum_i (sum_j A[(i,j), l]) h_i`` (mixed predecessors), and its likelihood is that of the
  candidate ``argmax A[:, l]`` (appendix C.2);
* hard mode: the exact top-k (ordinary beam search); the ablation of the paper, where no
  gradient flows through the selection.

The gradient through the selection (soft mode) is controlled by ``selection_grad``:
``"full"`` is the paper's exact gradient; ``"capped"`` (the default) caps its norm where it enters each
step's operator, per sentence (:func:`fairseq_softtopk.ops.cap_row_grad_norm`), because the
exact gradient compounds over the steps (the selection at step t mixes the states that score
step t + 1) and explodes where candidates are within about epsilon of each other at a rank
boundary; ``"none"`` keeps the soft forward pass and stops the gradient through A (gradient
still flows through the mixed embeddings and states, as weighted sums). The cap is in units of
the loss's own gradient, read from ``BeamSearchOutput.scale_probe`` (which the loss adds), so
that fp16/amp loss scaling changes nothing.

The loss along the search is the gold-token negative log-likelihood along the beam that
ends with the largest likelihood, backtracked through the argmax predecessors.

The decoder only needs the "step on embeddings" interface of
:class:`fairseq_softtopk.models.softtopk_lstm.SoftTopKLSTMDecoder`: ``initial_state``,
``embed``, ``embedding_matrix`` and ``step``; states are NamedTuples of batch-first tensors
(mixed by :func:`mix_state`), or the decoder mixes its own with ``mix_state(state, weights, order)``
(``order``: the predecessors' rows in hard mode, else None), as
:class:`~fairseq_softtopk.modules.incremental_decoder_unroll.IncrementalDecoderUnroll` does for
fairseq's Transformer decoders (the self-attention caches are the state). A decoder may name
``excluded_tokens`` that never extend a beam (a Transformer's padding, which its decoder masks as an
input; fairseq's SequenceGenerator excludes it too).
"""

import dataclasses
import functools
import math
from typing import Callable, List, NamedTuple, Optional, Union

import torch
from torch import Tensor

from .beam_search_config import SELECTION_GRADS, BeamSearchConfig, GradientObserver
from .beam_selection import near_ties, relative_scale, select_beams
from . import selection_observer
from .search_counts import SearchCounts
from .search_input_checks import (bad_lprobs, bad_lprobs_error, check_beam_fits, check_gold_target, check_step_output,
                                  check_token_id)

__all__ = ["SELECTION_GRADS", "BeamSearchConfig", "BeamSearchOutput", "GradientObserver", "mix_embeddings",
           "mix_rows", "mix_state", "unroll_beam_search"]


class BeamSearchOutput(NamedTuple):
    """Results of one unrolled search over a batch.

    Attributes:
        gold_lprobs: ``(batch, T)`` log-probability of the gold token at each step along the
            backtracked best beam (0 at padding).
        smooth_lprobs: ``(batch, T)`` sum over the vocabulary of the log-probabilities along
            the same path (for label smoothing; 0 at padding).
        final_scores: ``(batch, beam)`` cumulative log-likelihoods of each sentence's final beams: those after
            its own last step (its target's length; a shorter sentence's beams run on past it, unused).
        best_beam: ``(batch,)`` index of the final beam the loss follows (the best of ``final_scores``).
        tokens: ``(batch, beam, T)`` token sequence of each final beam (argmax candidates,
            backtracked from the sentence's last step; padding after its length): ``tokens[b, best_beam[b]]``
            is the path of the loss.
        sharpness: ``(batch, T, beam)`` largest weight in each column of A (1 = hard selection).
        near_tie: ``(batch, T)`` bool: two of the k + 1 best candidates of the step are less than
            the (effective, linear-cost) epsilon apart, i.e. a rank boundary is soft there.
        n_unconverged: number of steps whose top-k solve missed its tolerance (with
            ``fixed_iterations``, a 0-dim long tensor: reading it is the search's one host sync).
        newton_iters: Newton iterations of all the steps' soft top-k solves (0 in hard mode).
        scale_probe: a 0-dim zero to add to the loss where the selection gradient is capped or
            observed (None otherwise): through it the cap learns the factor by which the loss is
            multiplied before the backward pass (fp16/amp loss scaling) and follows it, so that
            the update does not depend on that factor (:func:`~fairseq_softtopk.ops.cap_row_grad_norm`).
        mixed_sum, mixed_count: over the (sentence, step) pairs whose selection reaches the loss, the sum of the
            numbers of candidates with a nonzero weight in the new beams (``beam`` in hard mode; the support with
            ``--topk-regularizer quadratic``), and the number of such pairs (0-dim tensors).
    """

    gold_lprobs: Tensor
    smooth_lprobs: Tensor
    final_scores: Tensor
    best_beam: Tensor
    tokens: Tensor
    sharpness: Tensor
    near_tie: Tensor
    n_unconverged: Union[int, Tensor]
    newton_iters: int
    scale_probe: Optional[Tensor] = None
    mixed_sum: Optional[Tensor] = None
    mixed_count: Optional[Tensor] = None


def mix_rows(tensor: Tensor, weights: Tensor) -> Tensor:
    """One state tensor of the new beams, as weighted sums of the old beams' rows.

    Args:
        tensor: ``(batch * beam, ...)``.
        weights: ``(batch, beam_old, beam_new)``; new ``l`` = ``sum_i weights[:, i, l] * old i``.
    """
    batch, beam, _ = weights.shape
    flat = tensor.reshape(batch, beam, -1)  # B x k x (rest)
    return torch.bmm(weights.transpose(1, 2).to(flat.dtype), flat).reshape(tensor.shape)


def mix_state(state: NamedTuple, weights: Tensor) -> NamedTuple:
    """New beam states as weighted sums of the old ones (:func:`mix_rows` of every tensor of ``state``, a
    NamedTuple of ``(batch * beam, ...)`` tensors). Tensors of one dtype are mixed together, by one ``bmm`` on
    their features side by side: on a GPU a launch or two a step, forward and backward, instead of two per tensor
    and the sums of the weights' gradients."""
    tensors = list(state)
    if len(tensors) < 2 or len({(t.dtype, t.device) for t in tensors}) > 1:
        return type(state)(*(mix_rows(tensor, weights) for tensor in state))
    batch, beam, _ = weights.shape
    flats = [tensor.reshape(batch, beam, -1) for tensor in tensors]
    mixed = torch.bmm(weights.transpose(1, 2).to(flats[0].dtype), torch.cat(flats, -1))
    parts = mixed.split([flat.shape[-1] for flat in flats], -1)
    return type(state)(*(part.reshape(tensor.shape) for part, tensor in zip(parts, tensors)))


def mix_embeddings(embeddings: Tensor, tokens: Tensor, A: Tensor) -> Tensor:
    """Soft beam inputs ``inputs[b, l] = sum_c A[b, c, l] * embeddings[tokens[b, c]]``.

    Few candidates (a window or pool, ``m <= V``): one weighted bag of embeddings per new beam
    (``embedding_bag``), so no ``(batch, m, dim)`` gather is stored for the backward pass.
    More candidates than tokens (all ``k * V``): the weights are first summed per token,
    ``(batch, V, beam)``, and multiplied with the embedding matrix.

    Args:
        embeddings: ``(V, dim)``; tokens: ``(batch, m)`` token ids; A: ``(batch, m, beam)``.
    Returns:
        ``(batch * beam, dim)``.
    """
    batch, m, beam = A.shape
    V = embeddings.shape[0]
    if m > V:
        token_weights = A.new_zeros(batch, V, beam).scatter_add(1, tokens.unsqueeze(-1).expand(-1, -1, beam), A)
        return torch.einsum("bvl,vd->bld", token_weights.to(embeddings.dtype), embeddings).reshape(batch * beam, -1)
    bags = tokens.unsqueeze(1).expand(batch, beam, m).reshape(batch * beam, m)
    weights = A.transpose(1, 2).reshape(batch * beam, m).to(embeddings.dtype)
    return torch.nn.functional.embedding_bag(bags, embeddings, mode="sum", per_sample_weights=weights)


class StepRecord(NamedTuple):
    """What one decoding step leaves for backtracking: ``(batch, beam)`` tensors per new beam."""

    predecessor: Tensor  # the old beam of the candidate the new beam follows (argmax of its column of A)
    token: Tensor  # that candidate's token
    cum_score: Tensor  # that candidate's cumulative log-likelihood
    gold_lprobs: Tensor  # per *old* beam: log-probability of the gold token at this step
    smooth_lprobs: Tensor  # per old beam: sum of the log-probabilities over the vocabulary
    sharpness: Tensor  # largest weight in the new beam's column of A
    near_tie: Tensor  # (batch,): see BeamSearchOutput.near_tie


def unroll_beam_search(decoder, encoder_out, reorder_encoder_out: Callable, target: Tensor, pad: int, bos: int,
                       config: BeamSearchConfig, grad_observer: Optional[GradientObserver] = None
                       ) -> BeamSearchOutput:
    """Unrolls (soft or hard) beam search for ``T = target.shape[1]`` steps.

    Args:
        decoder: a decoder with ``initial_state``, ``embed``, ``embedding_matrix`` and ``step`` (and
            optionally ``mix_state``; see the module's docstring).
        encoder_out: the encoder output for ``batch`` sentences.
        reorder_encoder_out: ``(encoder_out, new_order) -> encoder_out`` (to repeat each sentence
            ``beam`` times).
        target: ``(batch, T)`` gold tokens, right-padded with ``pad`` (EOS included).
        bos: the token that starts decoding (fairseq feeds EOS).
        grad_observer: see :data:`GradientObserver` (soft mode with a selection gradient).
    """
    batch, T = target.shape
    k = config.beam
    device = target.device
    embeddings = decoder.embedding_matrix()  # V x D
    excluded = getattr(decoder, "excluded_tokens", None)
    check_token_id("pad", pad)
    check_token_id("bos", bos, embeddings.shape[0])
    if config.mode == "soft":  # the hard top-k keeps -inf beams until there are enough candidates (exhaustive)
        check_beam_fits(k, embeddings.shape[0], excluded if excluded is not None else (), "excluded_tokens")
    check_gold_target(target, pad, embeddings.shape[0], read_values=not config.fixed_iterations)
    enc = reorder_encoder_out(encoder_out, torch.arange(batch, device=device).repeat_interleave(k))
    state = decoder.initial_state(enc)
    inputs = decoder.embed(torch.full((batch * k,), bos, dtype=torch.long, device=device))
    lengths = target.ne(pad).sum(-1)
    if excluded is not None:
        excluded = torch.as_tensor(excluded, dtype=torch.long, device=device)
    cum = None
    records: List[StepRecord] = []
    counts = SearchCounts()
    V = embeddings.shape[0]
    # NaN and +inf log-probabilities: the adaptive soft selection's operator reads the scores on the host (its
    # check refuses them), the hard one and the static window nothing: their steps' counts are read once, after
    # the search
    bad_counts: Optional[List[Tensor]] = [] if (config.mode == "hard" or config.uses_static_window) \
        and not config.fixed_iterations else None
    for t in range(T):
        with torch.profiler.record_function("softtopk::beam_step"):  # one decoding step (counted per step)
            step_lprobs, new_state = decoder.step(inputs, state, enc)  # (B*k) x V
            check_step_output(step_lprobs, batch * k, V, t)
            if bad_counts is not None:
                bad_counts.append(bad_lprobs(step_lprobs))
            lprobs = step_lprobs.view(batch, k, V)
            gold = target[:, t].clamp_min(0).view(batch, 1, 1).expand(batch, k, 1)
            gold_lprobs, smooth_lprobs = lprobs.gather(-1, gold).squeeze(-1), lprobs.sum(-1)
            lprobs = lprobs.to(torch.promote_types(lprobs.dtype, torch.float32))  # scores in >= float32
            if excluded is not None:  # tokens the decoder cannot take as input never extend a beam
                lprobs = lprobs.index_fill(-1, excluded, -float("inf"))
            if cum is None:  # only beam 0 is live at the first step: the others would duplicate it
                cum = torch.full((batch, k), -float("inf"), dtype=lprobs.dtype, device=device)
                cum[:, 0] = 0.0
            scores = (cum.unsqueeze(-1) + lprobs).view(batch, k * V)  # candidate (i, j) -> i*V + j
            # a sentence's last selection reaches no loss term: not live
            try:
                step = next_beams(scores, new_state, decoder, embeddings, config, t < lengths - 1, grad_observer,
                                  counts, t)
            except ValueError:  # the operator's refusal of NaN or +inf scores: name the step that made them
                count = bad_lprobs(step_lprobs)
                if int(count):
                    raise bad_lprobs_error(count, t, step_lprobs.shape) from None
                raise
            cum = scores.gather(1, step.best_cand)
            records.append(StepRecord(step.best_cand // V, step.best_cand % V, cum, gold_lprobs, smooth_lprobs,
                                      step.sharpness, step.near_tie))
            inputs, state = step.inputs, step.state
    if bad_counts:
        bad = torch.stack(bad_counts)
        overflow = counts.n_overflow if counts.n_overflow is not None else bad.new_zeros(())
        n_bad, n_overflow = torch.stack([bad.sum(), overflow]).tolist()  # the search's one read of them
        if n_bad:
            t = int(bad.nonzero()[0, 0])
            raise bad_lprobs_error(bad[t], t, (batch * k, V))
        if n_overflow:  # a row's selection the static window does not certify: the batch again, adaptively
            return unroll_beam_search(decoder, encoder_out, reorder_encoder_out, target, pad, bos,
                                      dataclasses.replace(config, window_width=0), grad_observer)
    gold, smooth, best_beam = _backtrack(records, lengths)
    # a sentence's final beams are those after its own last step (a shorter one's run on past its end)
    last_step = (lengths - 1).clamp_min(0)
    final_scores = torch.stack([r.cum_score for r in records], 1)[torch.arange(batch, device=device), last_step]
    return BeamSearchOutput(gold, smooth, final_scores, best_beam, _beam_tokens(records, lengths, pad),
                            torch.stack([r.sharpness for r in records], 1),
                            torch.stack([r.near_tie for r in records], 1), counts.n_unconverged, counts.newton_iters,
                            counts.scale_probe, counts.mixed_sum, counts.mixed_count)


class NextBeams(NamedTuple):
    """One step's choice of the next beams (``(batch, beam)`` tensors unless said)."""

    best_cand: Tensor  # the candidate (i * V + j) each new beam follows: the argmax of its column of A
    inputs: Tensor  # (batch * beam, dim): the next inputs, the candidates' embeddings mixed by A
    state: object  # the next states, the predecessors' mixed by A
    sharpness: Tensor  # the largest weight in each new beam's column of A
    near_tie: Tensor  # (batch,): see BeamSearchOutput.near_tie


def next_beams(scores: Tensor, new_state, decoder, embeddings: Tensor, config: BeamSearchConfig, live: Tensor,
               grad_observer: Optional[GradientObserver], counts: SearchCounts, t: int = 0) -> NextBeams:
    """Selects the next beams among the candidates' ``(batch, beam * V)`` scores (soft or hard) and mixes their
    inputs and states: the step shared by :func:`unroll_beam_search` and the search that stops at EOS.

    Args:
        new_state: the states after the step, one per old beam; ``decoder`` mixes them itself if it has
            ``mix_state`` (hard mode: by index), else :func:`mix_state` does.
        live: ``(batch,)`` the sentences whose selection here can reach the loss (for ``grad_observer``).
        t: the decoding step (for the observers of :func:`~.selection_observer.observe_selections`).
    """
    batch, n = scores.shape
    k = config.beam
    V = n // k
    top = scores.detach().topk(min(k + 1, n), dim=-1).values
    scale = relative_scale(top, config)
    # the selection sees the rescaled scores (a per-row epsilon); the beams' scores stay as they are
    sel_scores, sel_top = (scores, top) if scale is None else (scores / scale, top / scale)
    observe = None if grad_observer is None else functools.partial(_observe_step, grad_observer, live)
    cand, A, converged, n_iter, probe, window = select_beams(sel_scores, k, config, sel_top[:, -1:], observe)
    counts.add(converged, n_iter, probe, window)
    counts.add_mixed(A, live)
    best_cand = cand.gather(1, followed_candidates(A, sel_scores.detach().gather(1, cand), config))
    if selection_observer.OBSERVERS:  # a diagnostic is watching (observe_selections); else no cost
        selection_observer.notify(selection_observer.StepSelection(t, sel_scores.detach(), cand.detach(), A.detach(),
                                                                   best_cand.detach(), live))
    # next inputs: mixed embeddings of the candidates' tokens; states: mixed predecessors
    with torch.profiler.record_function("softtopk::mix_beams"):
        inputs = mix_embeddings(embeddings, cand % V, A)
        state_weights = torch.zeros(batch, k, k, dtype=A.dtype, device=scores.device).scatter_add_(
            1, (cand // V).unsqueeze(-1).expand(-1, -1, k), A)  # B x k_old x k_new
        mix_decoder_state = getattr(decoder, "mix_state", None)
        if mix_decoder_state is None:
            state = mix_state(new_state, state_weights)
        else:  # the decoder mixes its own state; hard mode: by index (the beams' predecessors)
            order = None
            if config.mode == "hard":
                order = (best_cand // V + torch.arange(batch, device=scores.device).unsqueeze(1) * k).view(-1)
            state = mix_decoder_state(new_state, state_weights, order)
    return NextBeams(best_cand, inputs, state, A.detach().amax(1), near_ties(sel_scores.detach(), sel_top, config))


def followed_candidates(A: Tensor, cand_scores: Tensor, config: BeamSearchConfig) -> Tensor:
    """``(batch, beam)`` the position among the candidates that each new beam follows: the argmax of its column of
    ``A`` ``(batch, m, beam)``. With the quadratic regulariser, a column's largest weight is often shared exactly:
    every candidate whose support spans ranks ``l - 1, l, l + 1`` gives rank ``l`` the same weight (the linear
    cost's term cancels in the projection), so which one is first is decided by rounding; the tie goes to the
    candidate with the best score (``cand_scores`` ``(batch, m)``)."""
    if config.regularizer != "quadratic" or config.mode != "soft":
        return A.argmax(1)
    weights = A.detach()
    tied = weights >= weights.amax(1, keepdim=True) - 16 * torch.finfo(weights.dtype).eps
    return torch.where(tied, cand_scores.unsqueeze(-1), -math.inf).argmax(1)


def _observe_step(grad_observer: GradientObserver, live: Tensor, norms: Tensor) -> None:
    grad_observer(norms, live)


def _beam_tokens(records: List[StepRecord], lengths: Tensor, pad: int) -> Tensor:
    """``(batch, beam, T)`` sequences of each sentence's final beams (those after its step ``length - 1``),
    following argmax predecessors; ``pad`` after the sentence's length."""
    batch, k = records[-1].predecessor.shape
    own = torch.arange(k, device=lengths.device).expand(batch, k)
    beam, out = own, []
    for t in range(len(records) - 1, -1, -1):
        record = records[t]
        beam = torch.where((lengths == t + 1).unsqueeze(1), own, beam)  # the sentence's own last step: start
        out.append(torch.where((t < lengths).unsqueeze(1), record.token.gather(1, beam), pad))
        beam = record.predecessor.gather(1, beam)
    return torch.stack(out[::-1], -1)


def _backtrack(records: List[StepRecord], lengths: Tensor):
    """Follows the argmax predecessors back from the best final beam of each sentence.

    Step ``t`` scored the extensions of the beams alive before it, so the gold token ``t``
    is read from the predecessor that the path's beam after step ``t`` came from.

    Returns:
        ``(gold, smooth, best_beam)``: ``(batch, T)``, ``(batch, T)`` (0 after a sentence's
        length) and ``(batch,)``.
    """
    batch = lengths.shape[0]
    T = len(records)
    rows = torch.arange(batch, device=lengths.device)
    beam = torch.zeros(batch, dtype=torch.long, device=lengths.device)
    gold_path = [None] * T
    smooth_path = [None] * T
    best_beam = torch.zeros_like(beam)
    for t in range(T - 1, -1, -1):
        record = records[t]
        ends_here = lengths == t + 1
        start = record.cum_score.argmax(-1)
        beam = torch.where(ends_here, start, beam)
        best_beam = torch.where(ends_here, start, best_beam)
        predecessor = record.predecessor[rows, beam]
        inside = t < lengths
        gold_path[t] = torch.where(inside, record.gold_lprobs[rows, predecessor], 0.0)
        smooth_path[t] = torch.where(inside, record.smooth_lprobs[rows, predecessor], 0.0)
        beam = predecessor
    return torch.stack(gold_path, 1), torch.stack(smooth_path, 1), best_beam
