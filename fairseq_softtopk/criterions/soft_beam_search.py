"""Criterion ``soft_beam_search``: teacher forcing mixed with (soft or hard) beam-search training.

``loss = p * L_tf + (1 - p) * L_beam`` (Xie et al. 2020, section 5.2), where ``L_tf`` is the
label-smoothed NLL of the gold target under teacher forcing and ``L_beam`` the label-smoothed
NLL of the gold tokens along the best beam of a beam search unrolled for as many steps as the
target has tokens (:mod:`fairseq_softtopk.modules.beam_search`). With ``--beam-loss risk``,
``L_beam`` is instead the expected cost (1 - sentence BLEU+1 on token ids) of each sentence's k
finished hypotheses, under a softmax of their length-normalised scores at
``--beam-loss-temperature``, weighted by the sentence's number of target tokens
(:mod:`fairseq_softtopk.modules.sequence_risk`), from a search that decodes as fairseq-generate
does: EOS ends a hypothesis, ``--beam-lenpen``, a maximum length from the source
(:mod:`fairseq_softtopk.modules.beam_search_to_eos`). Minimum-risk training on the beams, through
the soft selection in soft mode. ``--topk-mode hard`` is
the paper's ablation: the same unrolling with the exact top-k.

``--topk-epsilon-start`` with ``--topk-epsilon-anneal-updates`` anneals epsilon geometrically
from a larger start to ``--topk-epsilon`` (the model must record fairseq's update number, as
``softtopk_lstm`` does).

In soft mode, ``--topk-grad`` decides what flows back through the selection: the exact
gradient (``full``, the paper's), the same capped per sentence and step (``capped``), or
nothing (``none``: soft forward pass, gradient only through the mixed embeddings and states).
Logged besides the losses: ``topk_sharpness``, ``topk_near_tie`` (share of steps where two of
the k + 1 best candidates are within epsilon), ``topk_newton`` (Newton iterations per batched
solve; soft mode), ``topk_mixed`` (candidates mixed into a step's new beams, per sentence: k in
hard mode, the support with ``--topk-regularizer quadratic``), and, from the backward pass, ``selgrad_log10``
(mean log10 norm of the gradient reaching a step's selection, per sentence), ``selgrad_capped``
and ``selgrad_over100`` (shares of those above the cap and above 100 gold-token gradients), and with
``--log-term-gnorm-interval N``, every N-th training batch, ``tf_gnorm`` and ``beam_gnorm``: the gradient
norms of the two weighted terms apart (:mod:`.term_gradient_norms`).

Models: the plugin's LSTM accepts ``beam_search=`` in ``forward``, and the unrolling runs inside
it; a Transformer (the plugin's ``softtopk_transformer*``, fairseq's ``transformer*``) runs its
teacher-forcing forward, and its decoder is then driven step by step through fairseq's
incremental state, the self-attention caches mixed over beams
(:mod:`fairseq_softtopk.modules.incremental_decoder_unroll`). Any other model gets an error naming
what it lacks (:mod:`.model_unroll`). The teacher-forcing term is :mod:`.loss_terms`'s, the selection
gradient's statistics :mod:`.selection_gradient_stats`'s.
"""

import dataclasses
import math
from types import SimpleNamespace
from typing import List, Optional

from fairseq import metrics, utils
from fairseq.criterions import FairseqCriterion, register_criterion

from ..modules.beam_search_config import annealed_epsilon
from ..modules.search_losses import gold_token_loss, risk_loss
from ..modules.selection_memory import selection_memory_problem
from ..option_error import OptionError
from .. import search as search_api
from ._soft_beam_search_config import SoftBeamSearchConfig, check_soft_beam_search_options, resolve_renamed
from .loss_terms import teacher_forcing_loss, weighted_risk
from .model_unroll import forward_with_beam_search, training_search_max_len, unroll_kind
from .selection_gradient_stats import SelectionGradientStats
from .term_gradient_norms import TermGradientNorms


@register_criterion("soft_beam_search", dataclass=SoftBeamSearchConfig)
class SoftBeamSearchCriterion(FairseqCriterion):
    def __init__(self, task, train_beam=5, teacher_forcing_ratio=0.8, topk_mode="soft", topk_epsilon=0.03,
                 topk_grad="capped", label_smoothing=0.0, topk_cost="linear", topk_tol=1e-4, topk_max_iter=50,
                 topk_candidate_pool=0, topk_window_width=-1, topk_fixed_iterations=False, topk_compile="none", topk_grad_cap=0.3,
                 topk_epsilon_start=0.0, topk_epsilon_anneal_updates=0, topk_epsilon_relative=0.0,
                 candidate_pool=None, selection_grad=None, selection_grad_cap=None, sentence_avg=False,
                 beam_loss="gold", beam_loss_temperature=1.0, beam_lenpen=1.0, beam_max_len_a=1.2, beam_max_len_b=10,
                 topk_regularizer="entropic", topk_backend="auto", beam_risk_cost="bleu", log_term_gnorm_interval=0,
                 bf16=False, cpu=False, batch_size=None):
        # the keyword arguments (the config's fields, as build_criterion fills them): no other local exists yet
        given = SimpleNamespace(**{name: value for name, value in locals().items() if name not in ("self", "task")
                                   and not name.startswith("__")})
        super().__init__(task)
        # the deprecated names (renamed_options), then every check under the new names, before the first update
        o = resolve_renamed(given)
        check_soft_beam_search_options(o, vocab_size=len(task.target_dictionary))
        self.lenpen, self.max_len_a, self.max_len_b = o.beam_lenpen, o.beam_max_len_a, o.beam_max_len_b
        self.beam_loss, self.beam_loss_temperature = str(o.beam_loss), o.beam_loss_temperature
        self.risk_cost = str(o.beam_risk_cost)
        self.term_gnorms = TermGradientNorms(o.log_term_gnorm_interval)
        self.eos = task.target_dictionary.eos()
        self.epsilon_schedule = (o.topk_epsilon_start, o.topk_epsilon_anneal_updates) if o.topk_epsilon_start > 0 \
            else None
        # the cap is given relative to one gold token's gradient in the beam term, (1 - p); p = 1 runs no search
        unit = 1.0 - o.teacher_forcing_ratio if o.teacher_forcing_ratio < 1.0 else 1.0
        self.search = search_api.BeamSearchConfig(beam=o.train_beam, mode=str(o.topk_mode), epsilon=o.topk_epsilon,
                                                  cost=str(o.topk_cost), tol=o.topk_tol, max_iter=o.topk_max_iter,
                                                  candidate_pool=o.topk_candidate_pool, selection_grad=str(o.topk_grad),
                                                  selection_grad_cap=o.topk_grad_cap * unit,
                                                  epsilon_relative=o.topk_epsilon_relative,
                                                  fixed_iterations=bool(o.topk_fixed_iterations),
                                                  window_width=o.topk_window_width,
                                                  regularizer=str(o.topk_regularizer),
                                                  backend=str(o.topk_backend),
                                                  compile="" if str(o.topk_compile) == "none" else str(o.topk_compile))
        self.p = o.teacher_forcing_ratio
        self.label_smoothing = o.label_smoothing
        self.vocab_size = len(task.target_dictionary)
        #: set to a list to collect every selection-gradient norm (scripts/diagnostics/diagnose_beam_gradients.py)
        self.record_selection_grads: Optional[List[float]] = None
        self.sentence_avg = o.sentence_avg

    def search_config(self, model) -> search_api.BeamSearchConfig:
        """The search's options at the model's current update (the epsilon schedule, if any)."""
        if self.epsilon_schedule is None:
            return self.search
        update = getattr(model, "num_updates", None)
        if update is None:
            raise ValueError(f"--topk-epsilon-start needs a model that records its update number "
                             f"(set_num_updates); {type(model).__name__} does not")
        start, anneal_updates = self.epsilon_schedule
        return dataclasses.replace(self.search, epsilon=annealed_epsilon(start, self.search.epsilon, update,
                                                                          anneal_updates))

    def forward(self, model, sample, reduce=True):
        target = sample["target"]
        bos = sample["net_input"]["prev_output_tokens"][0, 0].item()
        search = self.search_config(model)

        run_beam = self.p < 1.0
        if run_beam and search.mode == "soft" and search.regularizer == "entropic":
            problem = selection_memory_problem(target.size(0), search.beam, self.vocab_size, search.candidate_pool,
                                               target.device)
            if problem:
                raise OptionError(f"--train-beam {search.beam} {problem}, in a batch of this size: lower --train-beam, "
                                  f"or the batch (--max-tokens, --batch-size)")
        observe = run_beam and search.mode == "soft" and search.selection_grad != "none" and model.training
        stats = None
        if observe:
            stats = SelectionGradientStats(search.grad_cap, 1.0 - self.p, target.device,
                                           self.record_selection_grads)

        def beam_search(encoder, decoder, encoder_out):
            if self.beam_loss == "risk":  # a search that decodes as fairseq-generate does
                max_len = training_search_max_len(model, sample["net_input"], self.max_len_a, self.max_len_b)
                return search_api.beam_search_to_eos(
                    decoder, encoder_out, target.size(0), pad=self.padding_idx, bos=bos, eos=self.eos, max_len=max_len,
                    lenpen=self.lenpen, config=search, reorder_encoder_out=encoder.reorder_encoder_out,
                    grad_observer=stats, device=target.device)
            return search_api.beam_search(decoder, encoder_out, target, pad=self.padding_idx, bos=bos, config=search,
                                          reorder_encoder_out=encoder.reorder_encoder_out, grad_observer=stats)

        if run_beam:
            net_output, beam = forward_with_beam_search(model, sample["net_input"], beam_search, bos,
                                                        unroll_kind(model))
        else:
            net_output = model(**sample["net_input"])
        tf_loss, tf_nll, mask, vocab = teacher_forcing_loss(model, net_output, target, self.padding_idx,
                                                            self.label_smoothing)
        risk = None
        if run_beam and self.beam_loss == "risk":  # the finished hypotheses, read up to their EOS
            risk = risk_loss(beam, target, self.eos, self.padding_idx, self.beam_loss_temperature,
                             self.risk_cost)  # (batch,)
            beam_loss = weighted_risk(risk, mask, self.sentence_avg)
            beam_nll = beam_loss.new_zeros(())  # no gold path in a search that stops at EOS
        elif run_beam:
            beam_loss, beam_nll, _ = gold_token_loss(beam, target, self.padding_idx, self.label_smoothing, vocab)
        else:
            beam_loss = beam_nll = tf_loss.new_zeros(())
        tf_term, beam_term = self.p * tf_loss, (1.0 - self.p) * beam_loss
        if run_beam and beam.scale_probe is not None:
            # a zero whose gradient is the loss scale (fp16/amp): the selection gradient's cap follows it
            beam_term = beam_term + beam.scale_probe
        loss = tf_term + beam_term
        ntokens = sample["ntokens"]
        sample_size = target.size(0) if self.sentence_avg else ntokens
        term_gnorms = self.term_gnorms(model, tf_term, beam_term, sample_size, stats) \
            if run_beam and model.training else {}
        logging_output = {
            "loss": loss.data, "nll_loss": tf_nll.data, "tf_loss": tf_loss.data, "beam_loss": beam_loss.data,
            "beam_nll_loss": beam_nll.data, "ntokens": ntokens, "nsentences": target.size(0),
            "sample_size": sample_size,
        }
        if risk is not None:
            logging_output["beam_risk_sum"] = risk.detach().sum().data
        if run_beam:  # sums on the device (no host read here); ntokens = the unpadded target positions
            if risk is not None:  # the steps of each sentence until it had its k hypotheses
                logging_output["topk_sharpness_sum"] = beam.sharpness_sum.data
                logging_output["topk_sharpness_count"] = beam.sharpness_count.data
                logging_output["topk_near_tie_sum"] = beam.near_tie_sum.data
                logging_output["topk_steps"] = beam.sharpness_count.data / search.beam
                solves = beam.steps - 1  # the last step only finishes hypotheses
            else:
                logging_output["topk_sharpness_sum"] = (beam.sharpness * mask.unsqueeze(-1)).sum().data
                logging_output["topk_sharpness_count"] = ntokens * search.beam
                logging_output["topk_near_tie_sum"] = (beam.near_tie & mask).sum().data
                logging_output["topk_steps"] = ntokens
                solves = target.size(1)
            logging_output["topk_unconverged"] = beam.n_unconverged  # with fixed iterations: a tensor
            if beam.mixed_count is not None:
                logging_output["topk_mixed_sum"] = beam.mixed_sum.data
                logging_output["topk_mixed_count"] = beam.mixed_count.data
            if search.mode == "soft":  # one batched solve per decoding step
                logging_output["topk_newton_iters"] = beam.newton_iters
                logging_output["topk_solves"] = solves
                if self.epsilon_schedule is not None:  # summed over workers: divided by the solves' weight
                    logging_output["topk_epsilon_sum"] = search.epsilon * solves
        if stats is not None:
            logging_output.update(stats.logging_output())
        logging_output.update(term_gnorms)
        return loss, sample_size, logging_output

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        def total(key):
            return sum(log.get(key, 0) for log in logging_outputs)

        sample_size, ntokens = total("sample_size"), total("ntokens")
        metrics.log_scalar("loss", total("loss") / sample_size / math.log(2), sample_size, round=3)
        for key in ("tf_loss", "beam_loss"):
            metrics.log_scalar(key, total(key) / sample_size / math.log(2), sample_size, round=3)
        metrics.log_scalar("nll_loss", total("nll_loss") / ntokens / math.log(2), ntokens, round=3)
        metrics.log_scalar("beam_nll_loss", total("beam_nll_loss") / ntokens / math.log(2), ntokens, round=3)
        metrics.log_derived("ppl", lambda meters: utils.get_perplexity(meters["nll_loss"].avg))
        if any("beam_risk_sum" in log for log in logging_outputs):
            sentences = total("nsentences")
            metrics.log_scalar("beam_risk", total("beam_risk_sum") / sentences, sentences, round=4)
        count = total("topk_sharpness_count")
        if count:
            metrics.log_scalar("topk_sharpness", total("topk_sharpness_sum") / count, count, round=3)
            metrics.log_scalar("topk_unconverged", total("topk_unconverged"), round=0)
        mixed = total("topk_mixed_count")
        if mixed:
            metrics.log_scalar("topk_mixed", total("topk_mixed_sum") / mixed, mixed, round=2)
        steps = total("topk_steps")
        if steps:
            metrics.log_scalar("topk_near_tie", total("topk_near_tie_sum") / steps, steps, round=3)
        solves = total("topk_solves")
        if solves:
            metrics.log_scalar("topk_newton", total("topk_newton_iters") / solves, solves, round=1)
            if any("topk_epsilon_sum" in log for log in logging_outputs):
                metrics.log_scalar("topk_epsilon", total("topk_epsilon_sum") / solves, solves, round=4)
        measured = total("term_gnorm_count")
        if measured:
            for key in ("tf_gnorm", "beam_gnorm"):
                metrics.log_scalar(key, total(key + "_sum") / measured, measured, round=4)
        observed = total("selgrad_count")
        if observed:
            metrics.log_scalar("selgrad_log10", total("selgrad_log10_sum") / observed, observed, round=2)
            metrics.log_scalar("selgrad_capped", total("selgrad_capped") / observed, observed, round=3)
            metrics.log_scalar("selgrad_over100", total("selgrad_over100") / observed, observed, round=4)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True
