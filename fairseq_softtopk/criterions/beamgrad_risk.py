"""Criterion ``beamgrad_risk``: the peer beamgrad's minimum-risk training, driving this package's models.

``loss = p * L_tf + (1 - p) * L_risk``, as ``soft_beam_search --beam-loss risk``, but the beams come
from ``beamgrad.beam_search`` (exact beam search; EOS-finished beams carried in their slots and
competing; GNMT length penalty ``((5 + length) / 6) ** alpha``; the gradient of each final score
along its own path, the selection held fixed) and the loss is ``beamgrad.losses.minimum_risk``. The
decoder is driven as by ``soft_beam_search`` (the LSTM's step interface, or a Transformer through its
incremental state), its state reordered by the beams' parents. The cost is the same 1 - BLEU+1 on
token ids (:mod:`fairseq_softtopk.modules.sequence_risk`), weighted by the sentence's target tokens.

beamgrad is optional (``pip install --no-build-isolation beamgrad==2.3.0``, compiled against the
installed torch); without it the criterion refuses to start, naming the command.
"""

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import torch
from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.dataclass import FairseqDataclass
from omegaconf import II

from ..modules.incremental_decoder_unroll import IncrementalDecoderUnroll
from ..modules.sequence_risk import sentence_bleu_costs
from ..option_checks import check_bf16, check_number, requested_bf16
from ._soft_beam_search_config import check_max_len
from .loss_terms import teacher_forcing_loss, weighted_risk
from .model_unroll import forward_with_beam_search, training_search_max_len, unroll_kind
from .soft_beam_search import SoftBeamSearchCriterion

INSTALL = "pip install --no-build-isolation beamgrad==2.3.0"


@dataclass
class BeamgradRiskConfig(FairseqDataclass):
    """Options of the beamgrad arm (the names of ``soft_beam_search``'s where they mean the same)."""

    train_beam: int = field(default=5, metadata={"help": "beam size k of beamgrad's search"})
    teacher_forcing_ratio: float = field(default=0.23, metadata={
        "help": "the weight p of the teacher-forcing loss (0.23: the peer's risk + 0.3 x NLL)"})
    label_smoothing: float = field(default=0.0, metadata={"help": "label smoothing of the teacher-forcing term"})
    beam_loss_temperature: float = field(default=1.0, metadata={
        "help": "the temperature of the softmax over the beams' scores"})
    beamgrad_length_penalty: float = field(default=0.0, metadata={
        "help": "beamgrad's GNMT length penalty alpha (0: raw log-likelihoods)"})
    beam_max_len_a: float = field(default=1.2, metadata={
        "help": "the search ends at a * source length + b tokens, as soft_beam_search's"})
    beam_max_len_b: int = field(default=10, metadata={"help": "b of --beam-max-len-a"})
    sentence_avg: bool = II("optimization.sentence_avg")
    bf16: bool = II("common.bf16")  # refused without torch_xla (option_checks.check_bf16)


def check_beamgrad_risk_options(options, vocab_size: Optional[int] = None) -> None:
    """Raises ``ValueError`` naming the first bad option of ``options`` (a namespace or config with the fields
    of :class:`BeamgradRiskConfig`), its value and the allowed range.

    Args:
        vocab_size: the target dictionary's size, where known: beamgrad's first step extends one beam with
            every type but padding (banned; EOS may end a hypothesis there), so ``--train-beam`` fits in that.
    """
    check_bf16(requested_bf16(options))
    high = vocab_size - 1 if vocab_size is not None else None
    why = "the risk of one hypothesis has no gradient"
    if high is not None:
        why += f"; the first decoding step extends one beam: {high} candidates, the {vocab_size} types but padding"
    check_number("train_beam", options.train_beam, 2, high, integer=True, why=why)
    check_number("teacher_forcing_ratio", options.teacher_forcing_ratio, 0.0, 1.0, high_open=True,
                 why="1 would run no search")
    check_number("label_smoothing", options.label_smoothing, 0.0, 1.0, high_open=True)
    check_number("beam_loss_temperature", options.beam_loss_temperature, 0.0, low_open=True)
    check_number("beamgrad_length_penalty", options.beamgrad_length_penalty, 0.0, why="beamgrad's BeamOptions")
    check_max_len(options.beam_max_len_a, options.beam_max_len_b)


def import_beamgrad():
    """The beamgrad module, or an ImportError that names the install command."""
    try:
        import beamgrad
    except ImportError as error:
        raise ImportError(f"--criterion beamgrad_risk needs the optional package beamgrad: {INSTALL} "
                          f"(it compiles against the installed torch)") from error
    return beamgrad


def reorder_state(decoder, state, order: torch.Tensor):
    """``state`` with its rows in ``order`` (each beam's parent): a Transformer's caches, or the LSTM's tensors."""
    if isinstance(decoder, IncrementalDecoderUnroll):
        return decoder.mix_state(state, None, order)
    return type(state)(*(tensor.index_select(0, order) for tensor in state))


@register_criterion("beamgrad_risk", dataclass=BeamgradRiskConfig)
class BeamgradRiskCriterion(FairseqCriterion):
    def __init__(self, task, train_beam=5, teacher_forcing_ratio=0.23, label_smoothing=0.0, beam_loss_temperature=1.0,
                 beamgrad_length_penalty=0.0, beam_max_len_a=1.2, beam_max_len_b=10, sentence_avg=False, bf16=False):
        super().__init__(task)
        options = SimpleNamespace(train_beam=train_beam, teacher_forcing_ratio=teacher_forcing_ratio,
                                  label_smoothing=label_smoothing, beam_loss_temperature=beam_loss_temperature,
                                  beamgrad_length_penalty=beamgrad_length_penalty, beam_max_len_a=beam_max_len_a,
                                  beam_max_len_b=beam_max_len_b, bf16=bf16)
        check_beamgrad_risk_options(options, vocab_size=len(task.target_dictionary))  # checked also without beamgrad
        self.beamgrad = import_beamgrad()
        self.beam, self.p, self.label_smoothing = train_beam, teacher_forcing_ratio, label_smoothing
        self.temperature, self.alpha = beam_loss_temperature, beamgrad_length_penalty
        self.max_len_a, self.max_len_b = beam_max_len_a, beam_max_len_b
        self.sentence_avg = sentence_avg
        self.eos = task.target_dictionary.eos()

    def search(self, encoder, decoder, encoder_out, batch: int, bos: int, max_len: int, device):
        """``beamgrad.beam_search`` over ``decoder`` (the step interface), ``max_len + 1`` steps at most."""
        beamgrad, k = self.beamgrad, self.beam
        rows = torch.arange(batch, device=device)
        enc = encoder.reorder_encoder_out(encoder_out, rows.repeat_interleave(k))
        state = decoder.initial_state(enc)
        banned = torch.tensor([self.padding_idx], dtype=torch.long, device=device)

        def step(beams):
            nonlocal state
            if beams.step == 0:
                tokens = torch.full((batch * k,), bos, dtype=torch.long, device=device)
            else:
                order = (rows.unsqueeze(1) * k + beams.parents.to(device).clamp(min=0)).view(-1)
                state = reorder_state(decoder, state, order)
                tokens = beams.tokens.to(device).clamp(min=0).view(-1)
            lprobs, state = decoder.step(decoder.embed(tokens), state, enc)
            return lprobs.index_fill(-1, banned, -float("inf")).view(batch, k, -1)

        options = beamgrad.BeamOptions(beam_size=k, eos_token=self.eos, min_length=1,
                                       length_penalty_alpha=self.alpha, banned_tokens=(self.padding_idx,))
        return beamgrad.beam_search(step, options, max_steps=max_len + 1, batch_size=batch, device=device)

    def forward(self, model, sample, reduce=True):
        target = sample["target"]
        net_input = sample["net_input"]
        bos = net_input["prev_output_tokens"][0, 0].item()
        max_len = training_search_max_len(model, net_input, self.max_len_a, self.max_len_b)

        def beam_search(encoder, decoder, encoder_out):
            return self.search(encoder, decoder, encoder_out, target.size(0), bos, max_len, target.device)

        net_output, result = forward_with_beam_search(model, net_input, beam_search, bos, unroll_kind(model))
        tf_loss, tf_nll, mask, _ = teacher_forcing_loss(model, net_output, target, self.padding_idx,
                                                        self.label_smoothing)
        hypotheses = torch.where(result.sequences < 0, self.padding_idx, result.sequences).to(target.device)
        costs = sentence_bleu_costs(hypotheses, target, self.eos, self.padding_idx)
        risk = self.beamgrad.losses.minimum_risk(result, costs, self.temperature, reduction="none")
        beam_loss = weighted_risk(risk, mask, self.sentence_avg)
        loss = self.p * tf_loss + (1.0 - self.p) * beam_loss
        ntokens = sample["ntokens"]
        logging_output = {
            "loss": loss.data, "nll_loss": tf_nll.data, "tf_loss": tf_loss.data, "beam_loss": beam_loss.data,
            "beam_nll_loss": 0.0, "beam_risk_sum": risk.detach().sum().data, "ntokens": ntokens,
            "nsentences": target.size(0), "sample_size": target.size(0) if self.sentence_avg else ntokens,
        }
        return loss, logging_output["sample_size"], logging_output

    reduce_metrics = staticmethod(SoftBeamSearchCriterion.reduce_metrics)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True
