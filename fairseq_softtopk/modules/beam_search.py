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
``"full"`` is the paper's exact gradient; ``"capped"`` caps its norm where it enters each
step's operator, per sentence (:func:`fairseq_softtopk.ops.cap_row_grad_norm`), because the
exact gradient compounds over the steps (the selection at step t mixes the states that score
step t + 1) and explodes where candidates are within about epsilon of each other at a rank
boundary; ``"none"`` keeps the soft forward pass and stops the gradient through A (gradient
still flows through the mixed embeddings and states, as weighted sums).

The loss along the search is the gold-token negative log-likelihood along the beam that
ends with the largest likelihood, backtracked through the argmax predecessors.

The decoder only needs the "step on embeddings" interface of
:class:`fairseq_softtopk.models.softtopk_lstm.SoftTopKLSTMDecoder`: ``initial_state``,
``embed``, ``embedding_matrix`` and ``step``; states are NamedTuples of batch-first tensors.
"""

import functools
import math
from dataclasses import dataclass
from typing import Callable, List, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from ..ops import candidate_window, cap_row_grad_norm, sorted_soft_topk
from ..ops._common import effective_epsilon

SELECTION_GRADS = ("full", "capped", "none")

#: ``(norms, live)``: called in the backward pass once per step with the ``(batch,)`` norms of
#: the gradient reaching the step's soft top-k (before any cap) and the ``(batch,)`` bool
#: mask of the sentences for which the step's selection matters (steps before their last).
GradientObserver = Callable[[Tensor, Tensor], None]


@dataclass
class BeamSearchConfig:
    """Options of :func:`unroll_beam_search` (the criterion's flags map onto these)."""

    beam: int = 5
    mode: str = "soft"  # "soft" | "hard"
    epsilon: float = 0.1
    cost: str = "linear"
    tol: float = 1e-4
    max_iter: int = 50
    candidate_pool: int = 0  # 0: all k*V candidates; m > 0: the m best by hard selection
    selection_grad: str = "full"  # soft mode: "full" | "capped" | "none" (module docstring)
    selection_grad_cap: float = 1.0  # "capped": largest gradient norm per sentence and step
    epsilon_relative: float = 0.0  # > 0: per row, epsilon = max(epsilon, this * mean gap of the k+1 best)
    fixed_iterations: bool = False  # soft mode: the search without host synchronisation (select_beams)

    def __post_init__(self):
        if self.selection_grad not in SELECTION_GRADS:
            raise ValueError(f"selection_grad must be one of {SELECTION_GRADS}, got {self.selection_grad!r}")
        if self.selection_grad == "capped" and not self.selection_grad_cap > 0:
            raise ValueError(f"selection_grad_cap must be > 0, got {self.selection_grad_cap}")
        if not self.epsilon_relative >= 0:
            raise ValueError(f"epsilon_relative must be >= 0, got {self.epsilon_relative}")
        if self.epsilon_relative > 0 and self.cost != "linear":
            raise ValueError(f"epsilon_relative needs the linear cost (its epsilon is in units of the scores), "
                             f"got cost {self.cost!r}")

    @property
    def grad_cap(self) -> float:
        """The cap on the selection gradient per sentence and step (``inf`` unless ``"capped"``)."""
        return self.selection_grad_cap if self.selection_grad == "capped" else math.inf


class BeamSearchOutput(NamedTuple):
    """Results of one unrolled search over a batch.

    Attributes:
        gold_lprobs: ``(batch, T)`` log-probability of the gold token at each step along the
            backtracked best beam (0 at padding).
        smooth_lprobs: ``(batch, T)`` sum over the vocabulary of the log-probabilities along
            the same path (for label smoothing; 0 at padding).
        final_scores: ``(batch, beam)`` cumulative log-likelihoods of the final beams.
        best_beam: ``(batch,)`` index of the final beam the loss follows.
        tokens: ``(batch, beam, T)`` token sequence of each final beam (argmax candidates,
            backtracked; undefined after a sentence's length).
        sharpness: ``(batch, T, beam)`` largest weight in each column of A (1 = hard selection).
        near_tie: ``(batch, T)`` bool: two of the k + 1 best candidates of the step are less than
            the (effective, linear-cost) epsilon apart, i.e. a rank boundary is soft there.
        n_unconverged: number of steps whose top-k solve missed its tolerance (with
            ``fixed_iterations``, a 0-dim long tensor: reading it is the search's one host sync).
        newton_iters: Newton iterations of all the steps' soft top-k solves (0 in hard mode).
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


def mix_state(state: NamedTuple, weights: Tensor) -> NamedTuple:
    """New beam states as weighted sums of the old ones.

    Args:
        state: NamedTuple of ``(batch * beam, ...)`` tensors.
        weights: ``(batch, beam_old, beam_new)``; new ``l`` = ``sum_i weights[:, i, l] * old i``.
    """
    batch, beam, _ = weights.shape
    mixed = []
    for tensor in state:
        flat = tensor.reshape(batch, beam, -1)  # B x k x (rest)
        mixed.append(torch.bmm(weights.transpose(1, 2).to(flat.dtype), flat).reshape(tensor.shape))
    return type(state)(*mixed)


def compact_rows(mask: Tensor) -> Tuple[Tensor, Tensor]:
    """Column indices of the True entries of every row, left-aligned and padded to one width.

    Linear in ``mask.numel()`` (a ``nonzero`` scan), unlike a ``topk`` as wide as the window.

    Args:
        mask: ``(batch, n)`` bool.
    Returns:
        ``index`` ``(batch, w)`` long (0 at padding) and ``valid`` ``(batch, w)`` bool, where
        ``w`` is the largest number of True entries in a row; entries keep their column order.
    """
    batch = mask.shape[0]
    rows, cols = mask.nonzero(as_tuple=True)
    counts = torch.bincount(rows, minlength=batch)
    width = int(counts.max()) if batch else 0
    position = torch.arange(rows.numel(), device=mask.device) - (counts.cumsum(0) - counts)[rows]
    index = torch.zeros(batch, width, dtype=torch.long, device=mask.device)
    index[rows, position] = cols
    valid = torch.arange(width, device=mask.device) < counts.unsqueeze(1)
    return index, valid


def drop_negligible(A: Tensor, cand: Tensor, budget: float) -> Tuple[Tensor, Tensor]:
    """Keeps the candidates whose weight ``sum_l A[c, l]`` is at least ``budget / m``.

    Most candidates of a window are far below the selected ones, with a weight like
    ``exp(-distance / epsilon)``: the soft beams need not mix in their embeddings and states.
    What a row drops weighs less than ``budget`` in total, so in every rank.

    Args:
        A: ``(batch, m, beam)`` weights; cand: ``(batch, m)`` candidate ids.
    Returns:
        ``(A', cand')`` of the kept candidates, ``(batch, w, beam)`` and ``(batch, w)`` with
        ``w <= m`` (rows with fewer are padded with weight-0 candidates).
    """
    batch, m, beam = A.shape
    keep = A.detach().sum(-1) >= budget / m
    index, valid = compact_rows(keep)
    if index.shape[1] == m:
        return A, cand
    kept = A.gather(1, index.unsqueeze(-1).expand(-1, -1, beam)) * valid.unsqueeze(-1)
    return kept, cand.gather(1, index)


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


def relative_scale(top: Tensor, config: BeamSearchConfig) -> Optional[Tensor]:
    """``(batch, 1)`` factors by which to divide the scores so that ``config.epsilon`` acts as
    ``max(epsilon, epsilon_relative * g)`` per row, ``g`` the mean gap between consecutive scores
    of the k + 1 best (``top``, sorted); ``None`` when the epsilon is not relative.

    With the linear cost the selection depends on the scores only through ``scores / epsilon``,
    so dividing a row by a factor is that row's epsilon multiplied by it. The factor is a
    constant of the backward pass (it only sets the temperature). Rows whose k + 1 best are
    far apart thus keep a soft selection (and a selection gradient) instead of a hard one; rows
    with near ties keep ``epsilon``, the floor.
    """
    if config.epsilon_relative <= 0 or config.mode != "soft":
        return None
    gap = (top[:, :1] - top[:, -1:]) / max(top.shape[1] - 1, 1)
    gap = torch.where(torch.isfinite(gap), gap, torch.zeros_like(gap))
    return (config.epsilon_relative * gap / config.epsilon).clamp_min(1.0)


def near_ties(scores: Tensor, top: Tensor, config: BeamSearchConfig) -> Tensor:
    """Rows where two of the k + 1 best candidates are closer than the effective epsilon.

    Args:
        scores: ``(batch, n)``; top: ``(batch, k + 1)`` their best values, sorted.
    Returns:
        ``(batch,)`` bool.
    """
    if config.cost == "paper":
        valid = torch.isfinite(scores)
        eps = effective_epsilon(torch.where(valid, scores, torch.zeros_like(scores)), valid, config.epsilon,
                                config.cost, config.beam).squeeze(-1)
    else:
        eps = config.epsilon * (0.5 if config.cost == "sqeuclidean" else 1.0)
    gaps = top[:, :-1] - top[:, 1:]
    return (gaps < torch.as_tensor(eps, dtype=gaps.dtype).reshape(-1, 1)).any(-1)


class Selection(NamedTuple):
    """One step's choice of the next beams among the candidates ``c = i * V + j`` (beam i, token j).

    Attributes:
        candidates: ``(batch, m)`` candidate ids (all ``k * V`` of them, or a window / pool).
        weights: ``(batch, m, beam)`` A: the weight of each candidate in each new beam
            (one-hot columns in hard mode); the weights of padded entries are 0.
        converged: whether the soft top-k solve met its tolerance (True in hard mode; a 0-dim
            bool tensor with ``fixed_iterations``).
        n_iter: Newton iterations of the solve (0 in hard mode).
    """

    candidates: Tensor
    weights: Tensor
    converged: Union[bool, Tensor]
    n_iter: int


class StepRecord(NamedTuple):
    """What one decoding step leaves for backtracking: ``(batch, beam)`` tensors per new beam."""

    predecessor: Tensor  # the old beam of the candidate the new beam follows (argmax of its column of A)
    token: Tensor  # that candidate's token
    cum_score: Tensor  # that candidate's cumulative log-likelihood
    gold_lprobs: Tensor  # per *old* beam: log-probability of the gold token at this step
    smooth_lprobs: Tensor  # per old beam: sum of the log-probabilities over the vocabulary
    sharpness: Tensor  # largest weight in the new beam's column of A
    near_tie: Tensor  # (batch,): see BeamSearchOutput.near_tie


def select_beams(scores: Tensor, beam: int, config: BeamSearchConfig, kth: Tensor,
                 observe: Optional[Callable[[Tensor], None]] = None) -> Selection:
    """Top-k of the candidates ``scores`` ``(batch, n)``, as a :class:`Selection`.

    With a pool (or in hard mode) only the m best candidates are kept (hard selection), and
    A is computed over them. Otherwise, with the linear cost, the soft top-k runs on the
    :func:`~fairseq_softtopk.ops.candidate_window` of candidates (the others would get less
    than ``tol / 100`` of any rank; padding is ``-inf``, which the operator excludes), and the
    candidates left with a negligible weight are dropped after the solve; with the paper's
    cost, whose scale depends on every candidate, the operator sees all of them.

    With ``config.fixed_iterations`` (soft mode) nothing waits on the device: the window and the
    dropping of negligible candidates, whose widths depend on the data, are skipped (the operator
    sees the pool, or all candidates), and the solve runs exactly ``max_iter`` iterations with
    on-device convergence masks (``sorted_soft_topk(..., fixed_iterations=True)``), so that a
    step can be captured by CUDA graphs or compiled whole. Where every solve converges, the
    result is the default's up to ``tol``.

    Args:
        kth: ``(batch, 1)`` the (k+1)-th best score.
        observe: gets the ``(batch,)`` norms of the gradient reaching the operator.
    """
    batch, n = scores.shape
    with torch.profiler.record_function("softtopk::select_beams"):
        pool = beam if config.mode == "hard" else config.candidate_pool
        if pool and pool < n:
            pool_scores, ids = scores.topk(pool, dim=-1, sorted=True)
        elif not pool and config.cost == "linear" and not config.fixed_iterations:
            floor = candidate_window(kth, beam, config.epsilon, config.tol, n_out=n)
            ids, valid = compact_rows(scores.detach() >= floor)
            pool_scores = scores.gather(1, ids).masked_fill(~valid, -float("inf"))
        else:
            ids = torch.arange(n, device=scores.device).expand(batch, n)
            pool_scores = scores
        if config.mode == "hard":
            A = torch.eye(beam, dtype=scores.dtype, device=scores.device).expand(batch, beam, beam)
            return Selection(ids, A, True, 0)
        if config.selection_grad == "none":
            pool_scores = pool_scores.detach()
        elif pool_scores.requires_grad and (observe is not None or config.grad_cap < math.inf):
            pool_scores = cap_row_grad_norm(pool_scores, config.grad_cap, observe)
        # no warning per step: the search counts the unconverged solves (BeamSearchOutput.n_unconverged)
        A, info = sorted_soft_topk(pool_scores, beam, epsilon=config.epsilon, cost=config.cost, tol=config.tol,
                                   max_iter=config.max_iter, return_info=True, warn=False,
                                   fixed_iterations=config.fixed_iterations)
        if ids.shape[1] < n and not config.fixed_iterations:
            # the same budget as candidate_window's: all but tol / 100 of every rank is kept
            A, ids = drop_negligible(A, ids, config.tol / 100)
        return Selection(ids, A, info.converged, info.n_iter)


def unroll_beam_search(decoder, encoder_out, reorder_encoder_out: Callable, target: Tensor, pad: int, bos: int,
                       config: BeamSearchConfig, grad_observer: Optional[GradientObserver] = None
                       ) -> BeamSearchOutput:
    """Unrolls (soft or hard) beam search for ``T = target.shape[1]`` steps.

    Args:
        decoder: a decoder with ``initial_state``, ``embed``, ``embedding_matrix`` and ``step``.
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
    enc = reorder_encoder_out(encoder_out, torch.arange(batch, device=device).repeat_interleave(k))
    state = decoder.initial_state(enc)
    inputs = decoder.embed(torch.full((batch * k,), bos, dtype=torch.long, device=device))
    embeddings = decoder.embedding_matrix()  # V x D
    lengths = target.ne(pad).sum(-1)
    cum = None
    records: List[StepRecord] = []
    n_unconverged = newton_iters = 0
    for t in range(T):
        lprobs, new_state = decoder.step(inputs, state, enc)  # (B*k) x V
        V = lprobs.shape[-1]
        lprobs = lprobs.view(batch, k, V)
        gold = target[:, t].clamp_min(0).view(batch, 1, 1).expand(batch, k, 1)
        gold_lprobs, smooth_lprobs = lprobs.gather(-1, gold).squeeze(-1), lprobs.sum(-1)
        lprobs = lprobs.to(torch.promote_types(lprobs.dtype, torch.float32))  # scores in >= float32
        if cum is None:  # only beam 0 is live at the first step: the others would duplicate it
            cum = torch.full((batch, k), -float("inf"), dtype=lprobs.dtype, device=device)
            cum[:, 0] = 0.0
        scores = (cum.unsqueeze(-1) + lprobs).view(batch, k * V)  # candidate (i, j) -> i*V + j
        top = scores.detach().topk(min(k + 1, k * V), dim=-1).values
        scale = relative_scale(top, config)
        # the selection sees the rescaled scores (a per-row epsilon); the beams' scores stay as they are
        sel_scores, sel_top = (scores, top) if scale is None else (scores / scale, top / scale)
        observe = None
        if grad_observer is not None:  # a sentence's last selection reaches no loss term: not live
            observe = functools.partial(_observe_step, grad_observer, t < lengths - 1)
        cand, A, converged, n_iter = select_beams(sel_scores, k, config, sel_top[:, -1:], observe)
        # a tensor with fixed_iterations: counted on the device, read once after the search
        n_unconverged = n_unconverged + (~converged).long() if torch.is_tensor(converged) else \
            n_unconverged + int(not converged)
        newton_iters += n_iter
        best_cand = cand.gather(1, A.argmax(1))  # (B, k): the candidate each new beam follows
        cum = scores.gather(1, best_cand)
        records.append(StepRecord(best_cand // V, best_cand % V, cum, gold_lprobs, smooth_lprobs,
                                  A.detach().amax(1), near_ties(sel_scores.detach(), sel_top, config)))
        # next inputs: mixed embeddings of the candidates' tokens; states: mixed predecessors
        with torch.profiler.record_function("softtopk::mix_beams"):
            inputs = mix_embeddings(embeddings, cand % V, A)
            state_weights = torch.zeros(batch, k, k, dtype=A.dtype, device=device).scatter_add_(
                1, (cand // V).unsqueeze(-1).expand(-1, -1, k), A)  # B x k_old x k_new
            state = mix_state(new_state, state_weights)
    gold, smooth, best_beam = _backtrack(records, lengths)
    return BeamSearchOutput(gold, smooth, cum, best_beam, _beam_tokens(records),
                            torch.stack([r.sharpness for r in records], 1),
                            torch.stack([r.near_tie for r in records], 1), n_unconverged, newton_iters)


def _observe_step(grad_observer: GradientObserver, live: Tensor, norms: Tensor) -> None:
    grad_observer(norms, live)


def _beam_tokens(records: List[StepRecord]) -> Tensor:
    """``(batch, beam, T)`` sequences of the final beams, following argmax predecessors."""
    last = records[-1].predecessor
    beam = torch.arange(last.shape[1], device=last.device).expand_as(last)
    out = []
    for record in reversed(records):
        out.append(record.token.gather(1, beam))
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
