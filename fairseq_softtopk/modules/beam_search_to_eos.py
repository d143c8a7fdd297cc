"""A training beam search that decodes as ``fairseq-generate`` does: EOS ends a beam, a length penalty.

:func:`~fairseq_softtopk.modules.beam_search.unroll_beam_search` runs exactly as many steps as the gold
target has tokens and never stops a beam (the paper's gold-token loss needs that alignment).
:func:`unroll_beam_search_to_eos` follows fairseq's ``SequenceGenerator`` instead, for losses on the
search's *output* (``--beam-loss risk``):

* padding is never a candidate, EOS not at the first step (``min_len`` 1), and at step ``max_len``
  (``max_len_a * source length + max_len_b``, at most the decoder's positions - 1) only EOS is;
* of the k x V extensions, an EOS candidate among the k best *finishes* a hypothesis (its score the
  cumulative log-likelihood with the EOS, divided by ``length ** lenpen``, length counting the EOS),
  while the sentence has fewer than k finished ones;
* the next k beams are selected among the other candidates: the exact top-k (hard mode, fairseq's
  choice) or the sorted SOFT top-k (soft mode: mixed embeddings and states, as in the gold unroll);
* a sentence is done with k finished hypotheses; the search stops when every sentence is done.

The finished hypotheses' scores are differentiable: in soft mode they depend on the selections through
the mixed inputs and states that scored them. The decisions (which candidate finishes, which candidate a
soft beam follows) are discrete, as in the gold unroll.
"""

import dataclasses
from typing import List, NamedTuple, Optional, Union

import torch
from torch import Tensor

from .beam_search import StepRecord, next_beams
from .search_counts import SearchCounts
from .beam_search_config import BeamSearchConfig, GradientObserver
from .search_input_checks import bad_lprobs, bad_lprobs_error, check_eos_search, check_step_output

__all__ = ["FinishedBeams", "search_max_len", "unroll_beam_search_to_eos"]


class FinishedBeams(NamedTuple):
    """The k finished hypotheses of every sentence, best first.

    Attributes:
        scores: ``(batch, beam)`` length-normalised scores (``-inf`` for a slot left empty).
        tokens: ``(batch, beam, L)`` their tokens, EOS included, padded with ``pad``.
        lengths: ``(batch, beam)`` their lengths (EOS included; 0 for an empty slot).
        steps: decoding steps run.
        sharpness_sum, sharpness_count: the sum and number of the largest weights of the new beams'
            columns of A over the steps where the sentence was not done (1 = hard selection).
        near_tie_sum: steps (over sentences not done) where two of the k + 1 best candidates were closer
            than the effective epsilon.
        n_unconverged, newton_iters, scale_probe, mixed_sum, mixed_count: as in
            :class:`~.beam_search.BeamSearchOutput` (over the steps where the sentence was not done).
    """

    scores: Tensor
    tokens: Tensor
    lengths: Tensor
    steps: int
    sharpness_sum: Tensor
    sharpness_count: Tensor
    near_tie_sum: Tensor
    n_unconverged: Union[int, Tensor]
    newton_iters: int
    scale_probe: Optional[Tensor] = None
    mixed_sum: Optional[Tensor] = None
    mixed_count: Optional[Tensor] = None


def search_max_len(src_len: int, max_len_a: float, max_len_b: int, max_positions: Optional[int]) -> int:
    """The last step's index, as fairseq-generate: ``min(int(a * src_len + b), max_positions - 1)``, ``src_len``
    the batch's (padded) source length."""
    max_len = int(max_len_a * src_len + max_len_b)
    if max_positions is not None:
        max_len = min(max_len, max_positions - 1)
    if max_len < 1:
        raise ValueError(f"the training search's maximum length is {max_len} (max_len_a {max_len_a} * source length "
                         f"{src_len} + max_len_b {max_len_b}): it must allow one token and EOS")
    return max_len


def unroll_beam_search_to_eos(decoder, encoder_out, reorder_encoder_out, batch: int, pad: int, bos: int, eos: int,
                              config: BeamSearchConfig, max_len: int, lenpen: float = 1.0,
                              grad_observer: Optional[GradientObserver] = None,
                              device: Optional[torch.device] = None) -> FinishedBeams:
    """Beam search until every sentence has ``config.beam`` finished hypotheses (or step ``max_len``).

    Args:
        decoder: the step interface of :func:`~.beam_search.unroll_beam_search`.
        encoder_out: for ``batch`` sentences; ``reorder_encoder_out`` repeats it per beam.
        max_len: the step at which only EOS is allowed (:func:`search_max_len`).
        lenpen: fairseq-generate's ``--lenpen``: a finished score is divided by ``length ** lenpen``.
        device: the data's device (default: the embeddings').
    """
    k = config.beam
    embeddings = decoder.embedding_matrix()
    check_eos_search(batch, pad, bos, eos, max_len, lenpen, embeddings.shape[0], k if config.mode == "soft" else None)
    device = device if device is not None else embeddings.device
    rows = torch.arange(batch, device=device)
    enc = reorder_encoder_out(encoder_out, rows.repeat_interleave(k))
    state = decoder.initial_state(enc)
    inputs = decoder.embed(torch.full((batch * k,), bos, dtype=torch.long, device=device))
    banned = torch.tensor([pad], dtype=torch.long, device=device)
    eos_index = torch.tensor([eos], dtype=torch.long, device=device)
    slots = torch.arange(k, device=device)

    cum = None
    fin_scores = fin_steps = fin_beams = None  # (batch, k): normalised score, step of the EOS, beam it ended
    n_finished = torch.zeros(batch, dtype=torch.long, device=device)
    records: List[StepRecord] = []
    counts = SearchCounts()
    sharpness_sum = near_tie_sum = None
    sharpness_count = None
    V = embeddings.shape[0]
    for t in range(max_len + 1):  # always ends at a break: every sentence done, or step max_len
        with torch.profiler.record_function("softtopk::beam_step"):
            lprobs, new_state = decoder.step(inputs, state, enc)
            check_step_output(lprobs, batch * k, V, t)
            bad = bad_lprobs(lprobs)
            lprobs = lprobs.view(batch, k, V).to(torch.promote_types(lprobs.dtype, torch.float32))
            lprobs = lprobs.index_fill(-1, banned, -float("inf"))
            if t == 0:  # fairseq's min_len 1: no empty hypothesis
                lprobs = lprobs.index_fill(-1, eos_index, -float("inf"))
            if t >= max_len:  # only EOS
                only_eos = torch.full_like(lprobs, -float("inf"))
                lprobs = only_eos.index_copy(-1, eos_index, lprobs.index_select(-1, eos_index))
            if cum is None:
                cum = torch.full((batch, k), -float("inf"), dtype=lprobs.dtype, device=device)
                cum[:, 0] = 0.0
                fin_scores = torch.full((batch, k), -float("inf"), dtype=lprobs.dtype, device=device)
                fin_steps = torch.zeros(batch, k, dtype=torch.long, device=device)
                fin_beams = torch.zeros(batch, k, dtype=torch.long, device=device)
                sharpness_sum = lprobs.new_zeros(())
                sharpness_count = lprobs.new_zeros(())
                near_tie_sum = lprobs.new_zeros(())
            scores = (cum.unsqueeze(-1) + lprobs).view(batch, k * V)
            done = n_finished >= k
            # EOS among the k best candidates finishes a hypothesis (in rank order, while the sentence has < k)
            best = scores.detach().topk(k, dim=-1)
            ends = (best.indices % V == eos) & torch.isfinite(best.values) & ~done.unsqueeze(1)
            slot = n_finished.unsqueeze(1) + ends.long().cumsum(1) - ends.long()
            ends = ends & (slot < k)
            placed = ends.unsqueeze(-1) & (slot.unsqueeze(-1) == slots)  # B x candidate x slot
            filled = placed.any(1)
            length = float(t + 1)
            finished = scores.gather(1, best.indices) / length ** lenpen
            fin_scores = torch.where(filled, torch.where(placed, finished.unsqueeze(-1), 0.0).sum(1), fin_scores)
            fin_steps = torch.where(filled, t, fin_steps)
            fin_beams = torch.where(filled, (placed.long() * (best.indices // V).unsqueeze(-1)).sum(1), fin_beams)
            n_finished = n_finished + ends.long().sum(1)
            # one host read per step, as fairseq's generator: whether every sentence is done, the step's NaN and +inf
            # log-probabilities, and the rows the previous step's static window did not certify
            overflow = counts.newest_overflow
            overflow = overflow if overflow is not None else bad.new_zeros(())
            all_done, n_bad, n_overflow = torch.stack([(n_finished >= k).all().long(), bad, overflow]).tolist()
            if n_bad:
                raise bad_lprobs_error(n_bad, t, (batch * k, V))
            if n_overflow:  # a row's selection the static window does not certify: the batch again, adaptively
                return unroll_beam_search_to_eos(decoder, encoder_out, reorder_encoder_out, batch, pad, bos, eos,
                                                 dataclasses.replace(config, window_width=0), max_len, lenpen,
                                                 grad_observer, device)
            if t >= max_len or all_done:
                break
            live = n_finished < k
            # the next beams: the best k other candidates (soft or hard), as in the gold unroll
            scores = scores.view(batch, k, V).index_fill(-1, eos_index, -float("inf")).view(batch, k * V)
            step = next_beams(scores, new_state, decoder, embeddings, config, live, grad_observer, counts, t)
            cum = scores.gather(1, step.best_cand)
            sharpness_sum = sharpness_sum + (step.sharpness * live.unsqueeze(1)).sum()
            sharpness_count = sharpness_count + live.sum() * k
            near_tie_sum = near_tie_sum + (step.near_tie & live).sum()
            records.append(StepRecord(step.best_cand // V, step.best_cand % V, cum, None, None, step.sharpness, None))
            inputs, state = step.inputs, step.state
    steps = len(records) + 1  # the last step only finished hypotheses
    tokens, lengths = _finished_tokens(records, fin_steps, fin_beams, torch.isfinite(fin_scores), steps, pad, eos)
    order = fin_scores.detach().argsort(dim=1, descending=True)
    return FinishedBeams(fin_scores.gather(1, order), tokens.gather(1, order.unsqueeze(-1).expand_as(tokens)),
                         lengths.gather(1, order), steps, sharpness_sum, sharpness_count, near_tie_sum,
                         counts.n_unconverged, counts.newton_iters, counts.scale_probe, counts.mixed_sum,
                         counts.mixed_count)


def _finished_tokens(records: List[StepRecord], fin_steps: Tensor, fin_beams: Tensor, filled: Tensor, steps: int,
                     pad: int, eos: int):
    """``(tokens (batch, k, steps), lengths (batch, k))`` of the finished hypotheses: the EOS at their step,
    before it the tokens of the beam they extended, followed back through the argmax predecessors."""
    batch, k = fin_steps.shape
    columns = torch.arange(steps, device=fin_steps.device)
    tokens = torch.where(filled.unsqueeze(-1) & (columns == fin_steps.unsqueeze(-1)), eos, pad)
    current = fin_beams
    for t in range(len(records) - 1, -1, -1):
        inside = filled & (t < fin_steps)
        current = torch.where(filled & (t == fin_steps - 1), fin_beams, current)
        tokens[:, :, t] = torch.where(inside, records[t].token.gather(1, current), tokens[:, :, t])
        current = torch.where(inside, records[t].predecessor.gather(1, current), current)
    return tokens, torch.where(filled, fin_steps + 1, 0)
