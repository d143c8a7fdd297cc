"""The soft beam-search training loss for Hugging Face models, as ``Trainer``'s ``compute_loss_func``.

``loss = p * L_tf + (1 - p) * L_beam`` per label token (Xie et al. 2020, section 5.2; the plugin's fairseq criterion
``soft_beam_search``): ``L_tf`` the NLL of the labels under teacher forcing (the model's own outputs), ``L_beam`` the
NLL of the labels along the best beam of the search (:func:`fairseq_softtopk.search.beam_search`, soft by default),
both label-smoothed as fairseq's ``label_smoothed_cross_entropy``. With ``beam_loss="risk"``, ``L_beam`` is minimum
risk instead (the criterion's ``--beam-loss risk``): the expected cost (``1 - BLEU+1`` on token ids, or in BLEU points)
of the hypotheses of a search that decodes as ``generate`` does, until EOS
(:func:`fairseq_softtopk.search.beam_search_to_eos`, :func:`~fairseq_softtopk.search.risk_loss`), each sentence's risk
counted once per label token. On Multi30k, risk with the cost in BLEU points and ``p = 0.5`` (Edunov et al. 2018's
setting) is the setting measured to gain over continued teacher forcing.

A forward pre-hook on the model records the inputs of its teacher-forced call (the search's own calls are not
recorded):

* :class:`Seq2SeqBeamSearchLoss` (encoder-decoders): the search reuses the encoder output of that call
  (``outputs.encoder_last_hidden_state``: both terms train the encoder) and its attention mask; the batches need
  ``decoder_input_ids`` (``DataCollatorForSeq2Seq(tokenizer, model=model)``) and labels padded with -100;
* :class:`CausalLMBeamSearchLoss` (decoder-only): each row's prompt is its tokens before the first label (labels
  -100 on the prompt and the padding, as for supervised fine-tuning), and the search continues the prompts; a row's
  labels must be one contiguous run (-100 between two labels, as multi-turn chat data has, is refused: the search
  would follow a sequence that never occurs).

Labels other than -100 must be token ids of the model's vocabulary (refused with the id, the vocabulary's size and
the row, before anything indexes with them).

Use::

    loss_fn = Seq2SeqBeamSearchLoss(model, BeamSearchConfig(beam=5, epsilon=0.1), teacher_forcing_ratio=0.8)
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=data, data_collator=collator,
                             compute_loss_func=loss_fn)

or in a plain loop: ``loss_fn(model(**batch_without_labels), labels).backward()``.
"""

import inspect
from typing import List, Optional

import torch
from torch import Tensor

from ..modules.beam_search_config import BeamSearchConfig
from ..modules.beam_search_to_eos import search_max_len
from ..modules.search_input_checks import check_config
from ..modules.search_losses import gold_token_loss, smoothed_nll
from ..modules.sequence_risk import RISK_COSTS
from ..number_checks import is_finite_number, is_integer
from ..search import beam_search, beam_search_to_eos, risk_loss
from .huggingface import CausalLMSearchDecoder, Seq2SeqSearchDecoder

__all__ = ["CausalLMBeamSearchLoss", "Seq2SeqBeamSearchLoss", "default_config"]

IGNORE = -100  # Hugging Face's label padding
BEAM_LOSSES = ("gold", "risk")


def default_config(teacher_forcing_ratio: float, beam: int = 5, epsilon: float = 0.1, grad_cap: float = 0.3
                   ) -> BeamSearchConfig:
    """The search of the fairseq criterion's defaults: the selection gradient capped per sentence and step at
    ``grad_cap`` times one label token's gradient in the beam term, ``1 - p`` (the exact gradient explodes where
    candidates nearly tie: norms to 1e9 on Multi30k)."""
    unit = 1.0 - teacher_forcing_ratio if teacher_forcing_ratio < 1.0 else 1.0
    return BeamSearchConfig(beam=beam, epsilon=epsilon, selection_grad="capped", selection_grad_cap=grad_cap * unit)


def _padding_id(model) -> Optional[int]:
    """The model's pad id where no label can be it: ``None`` where the model has none or pads with its EOS (a label
    then), or with an id of its EOS list."""
    config = getattr(model, "config", None)
    pad, eos = getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)
    if not is_integer(pad) or pad == eos or (isinstance(eos, (list, tuple)) and pad in eos):
        return None
    return pad


def _eos_and_search_pad(model, search_pad: Optional[int]):
    """``(eos, pad)`` of the search until EOS: the model's EOS (the first of a list) and ``search_pad``, else its
    pad token, else its BOS (a token the search must never extend a hypothesis with).

    Raises:
        ValueError: no EOS, or no such token distinct from it.
    """
    config = model.config
    eos = config.eos_token_id
    eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    if not is_integer(eos):
        raise ValueError(f"beam_loss='risk' needs the model's EOS (config.eos_token_id), got {eos!r}")
    if search_pad is None:
        search_pad = next((t for t in (config.pad_token_id, getattr(config, "bos_token_id", None))
                           if is_integer(t) and t != eos), None)
        if search_pad is None:
            raise ValueError("beam_loss='risk': the model's pad and BOS tokens are missing or its EOS; pass "
                             "search_pad=, a token id the search never extends a hypothesis with")
    elif not is_integer(search_pad) or search_pad == eos:
        raise ValueError(f"search_pad must be a token id other than EOS ({eos}), got {search_pad!r}")
    return int(eos), int(search_pad)


class _BeamSearchLoss:
    """Args:
        model: the model being trained (the hook is put on it; :meth:`remove` takes it off).
        config: the search's options (default: :func:`default_config`, the fairseq criterion's defaults with the
            paper's epsilon: soft, beam 5, epsilon 0.1, the selection gradient capped at 0.3 gold-token gradients).
        teacher_forcing_ratio: ``p``; 1 is plain teacher forcing (no search).
        label_smoothing: as fairseq's ``label_smoothed_cross_entropy`` (the teacher-forcing term, and the beam term
            of ``gold``).
        beam_loss: ``"gold"`` (the labels' NLL along the best beam, the paper's) or ``"risk"`` (minimum risk of the
            hypotheses of a search until EOS).
        risk_cost: the cost's unit with ``risk``: ``"bleu"`` (``1 - BLEU+1``), ``"bleu_points"`` (100 times that,
            Edunov et al.'s) or ``"minmax"`` (scaled over each sentence's hypotheses).
        risk_temperature: of the softmax over the hypotheses' scores that weights their costs.
        lenpen: ``generate``'s ``length_penalty`` in the search of ``risk`` (a score divided by length ** lenpen).
        max_len_a, max_len_b: that search stops at step ``a * L + b`` (``L``: the source length; a decoder-only
            model's longest label continuation), as fairseq-generate's ``--max-len-a/-b``.
        search_pad: the token that never extends that search's hypotheses and pads them (default: the model's pad
            token, else its BOS; it must not be its EOS).

    A subclass names its search decoder and says which logits predict which labels (:meth:`_aligned`) and what the
    search runs on (:meth:`_search_inputs`).
    """

    decoder_class: type
    #: appended to the error for logits that do not match the labels
    shape_hint = ""

    def __init__(self, model, config: Optional[BeamSearchConfig] = None, teacher_forcing_ratio: float = 0.8,
                 label_smoothing: float = 0.0, beam_loss: str = "gold", risk_cost: str = "bleu",
                 risk_temperature: float = 1.0, lenpen: float = 1.0, max_len_a: float = 1.2, max_len_b: int = 10,
                 search_pad: Optional[int] = None):
        if not is_finite_number(teacher_forcing_ratio) or not 0.0 <= teacher_forcing_ratio <= 1.0:
            raise ValueError(f"teacher_forcing_ratio must be a number in [0, 1], got {teacher_forcing_ratio!r}")
        if not is_finite_number(label_smoothing) or not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be a number in [0, 1), got {label_smoothing!r}")
        check_config(config, BeamSearchConfig)
        if beam_loss not in BEAM_LOSSES:
            raise ValueError(f"beam_loss must be one of {BEAM_LOSSES}, got {beam_loss!r}")
        if risk_cost not in RISK_COSTS:
            raise ValueError(f"risk_cost must be one of {RISK_COSTS}, got {risk_cost!r}")
        if not is_finite_number(risk_temperature) or risk_temperature <= 0:
            raise ValueError(f"risk_temperature must be a number > 0, got {risk_temperature!r}")
        if not is_finite_number(lenpen):
            raise ValueError(f"lenpen must be a finite number, got {lenpen!r}")
        if not is_finite_number(max_len_a) or max_len_a < 0 or not is_integer(max_len_b) or max_len_b < 0:
            raise ValueError(f"max_len_a must be a number >= 0 and max_len_b an integer >= 0, got {max_len_a!r} "
                             f"and {max_len_b!r}")
        self.beam_loss, self.risk_cost, self.risk_temperature = beam_loss, risk_cost, float(risk_temperature)
        self.lenpen, self.max_len_a, self.max_len_b = float(lenpen), float(max_len_a), int(max_len_b)
        self.eos, self.search_pad = (_eos_and_search_pad(model, search_pad) if beam_loss == "risk"
                                     else (None, None))
        self.decoder = self.decoder_class(model)
        self.config = config if config is not None else default_config(teacher_forcing_ratio)
        self.p = teacher_forcing_ratio
        self.label_smoothing = label_smoothing
        self._inputs: dict = {}
        self._searching = False
        self._hook = model.register_forward_pre_hook(self._record, with_kwargs=True)
        self._signature = inspect.signature(model.forward)
        self._pad_id = _padding_id(model)

    def _record(self, module, args, kwargs):
        if not self._searching:  # by keyword or by position, as the model's forward binds them
            bound = kwargs
            if args:
                try:
                    bound = self._signature.bind_partial(*args, **kwargs).arguments
                except TypeError:  # the call itself fails in forward, with the model's own message
                    pass
            self._inputs = {key: bound.get(key) for key in ("input_ids", "attention_mask")}

    def remove(self) -> None:
        """Takes the hook off the model."""
        self._hook.remove()

    def __call__(self, outputs, labels: Tensor, num_items_in_batch=None) -> Tensor:
        """The loss per label token (``num_items_in_batch`` tokens if given, as ``Trainer`` counts them over
        gradient accumulation; else this batch's). ``outputs``: the model's teacher-forced output for ``labels``.
        A batch without a label token (every label -100, as truncation can leave a long prompt) gives 0 with a zero
        gradient, not 0 / 0; rows without a label are left out of the search."""
        logits = outputs.logits
        if logits.shape[:2] != labels.shape:
            raise ValueError(f"the outputs' logits are {tuple(logits.shape)} but the labels {tuple(labels.shape)}"
                             f"{self.shape_hint}")
        self._check_labels(labels, logits.shape[-1])
        logits, targets = self._aligned(logits, labels)
        lprobs = torch.log_softmax(logits.float(), -1)
        gold = lprobs.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        n_tokens = targets.ne(IGNORE).sum()
        loss = self.p * smoothed_nll(gold, lprobs.sum(-1), targets.ne(IGNORE), self.label_smoothing,
                                     lprobs.shape[-1])[0]
        if self.p < 1.0 and bool(n_tokens > 0):
            context, search_labels = self._search_inputs(outputs, labels)
            self._searching = True
            try:
                if self.beam_loss == "risk":
                    out = beam_search_to_eos(self.decoder, context, search_labels.shape[0], pad=self.search_pad,
                                             bos=self.decoder.bos, eos=self.eos, lenpen=self.lenpen,
                                             max_len=self._max_len(context, search_labels), config=self.config)
                else:
                    out = beam_search(self.decoder, context, search_labels, pad=IGNORE, bos=self.decoder.bos,
                                      config=self.config)
            finally:
                self._searching = False
            if self.beam_loss == "risk":  # each sentence's risk once per label token, as the criterion's
                references = search_labels.masked_fill(search_labels.eq(IGNORE), self.search_pad)
                risk = risk_loss(out, references, self.eos, self.search_pad, self.risk_temperature, self.risk_cost)
                beam_term = (risk * search_labels.ne(IGNORE).sum(-1)).sum()
            else:
                beam_term = gold_token_loss(out, search_labels, IGNORE, self.label_smoothing, lprobs.shape[-1]).loss
            loss = loss + (1.0 - self.p) * beam_term
            if out.scale_probe is not None:  # a zero through which a capped selection gradient follows the factor
                loss = loss + out.scale_probe  # that multiplies the summed loss (the division below, a loss scale)
        return loss / (num_items_in_batch if num_items_in_batch is not None else n_tokens.clamp_min(1))

    def _check_labels(self, labels: Tensor, vocab: int) -> None:
        """Every label is -100 or a token id in ``[0, vocab)`` (a larger one would index past the logits: a raw
        error on the CPU, a device-side assert on CUDA), and no row is padded with the model's pad id; one host read
        where all is well."""
        bad = labels.ne(IGNORE) & ((labels < 0) | (labels >= vocab))
        # a row that ends with the pad id was padded with it (a pad id inside a row can be a label: some models
        # pad with their unknown token)
        padded = labels[:, -1].eq(self._pad_id) if self._pad_id is not None else bad.new_zeros(())
        if not bool(torch.stack([bad.any(), padded.any()]).any()):
            return
        if bool(bad.any()):
            row, position = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"label {int(labels[row, position])} (row {row}, position {position}) is no token id of "
                             f"the model's vocabulary of {vocab} (its logits' last size): labels must be in [0, "
                             f"{vocab}) or {IGNORE} (not trained)")
        raise ValueError(f"the labels are padded with the model's pad id {self._pad_id}: pad labels with -100 "
                         "(DataCollatorForSeq2Seq does, with its default label_pad_token_id), or they train "
                         "the model to emit padding")

    def _aligned(self, logits: Tensor, labels: Tensor):
        """``(logits, labels)`` position by position: the teacher-forcing term's prediction and target."""
        raise NotImplementedError

    def _max_len(self, context, search_labels: Tensor) -> int:
        """The last step of the search until EOS (``max_len_a * L + max_len_b``, :meth:`_length_basis`), within
        the model's positions."""
        length, positions_left = self._length_basis(context, search_labels)
        return search_max_len(length, self.max_len_a, self.max_len_b, positions_left)

    def _length_basis(self, context, search_labels: Tensor):
        """``(L, positions the continuation may use, or None)`` for :meth:`_max_len`."""
        raise NotImplementedError

    def _search_inputs(self, outputs, labels: Tensor):
        """``(the search's encoder output, its target)`` for this batch."""
        raise NotImplementedError


class Seq2SeqBeamSearchLoss(_BeamSearchLoss):
    """The loss for a Hugging Face encoder-decoder (module docstring); ``labels`` ``(batch, T)``."""

    decoder_class = Seq2SeqSearchDecoder
    shape_hint = ": call the model with decoder_input_ids from these labels"

    def _aligned(self, logits: Tensor, labels: Tensor):
        return logits, labels

    def _length_basis(self, context, search_labels: Tensor):
        return context["hidden"].shape[1], getattr(self.decoder.model.config, "max_position_embeddings", None)

    def _search_inputs(self, outputs, labels: Tensor):
        hidden = outputs.encoder_last_hidden_state
        mask = self._inputs.get("attention_mask")
        mask = mask if mask is not None else hidden.new_ones(hidden.shape[:2], dtype=torch.long)
        if mask.shape != hidden.shape[:2]:
            raise ValueError(f"the attention mask recorded from the model's call is {tuple(mask.shape)}, the "
                             f"encoder output {tuple(hidden.shape[:2])}: call the model with keyword arguments")
        return {"hidden": hidden, "mask": mask}, labels


class CausalLMBeamSearchLoss(_BeamSearchLoss):
    """The loss for a Hugging Face decoder-only model (module docstring). ``labels`` ``(batch, L)``: the model's
    input ids where they are trained, -100 on the prompt and the padding (the model predicts position ``i + 1`` at
    ``i``)."""

    decoder_class = CausalLMSearchDecoder

    def _aligned(self, logits: Tensor, labels: Tensor):
        return logits[:, :-1], labels[:, 1:]

    def _search_inputs(self, outputs, labels: Tensor):
        return self.prompts_and_continuations(labels)

    def _length_basis(self, context, search_labels: Tensor):
        positions = getattr(self.decoder.model.config, "max_position_embeddings", None)
        return search_labels.shape[1], None if positions is None else positions - context["ids"].shape[1] + 1

    def prompts_and_continuations(self, labels: Tensor):
        """Each row's prompt (its attended tokens before the first label; left-padded, as the search takes them)
        and continuation (its labels from there, -100-padded on the right), from the recorded call's inputs; a row
        without a label (nothing to train) is left out. The batch needs at least one row with a label, and each
        row's labels must be one contiguous run (no -100 between two labels: refused, as the search cannot follow
        them)."""
        ids, mask = self._inputs.get("input_ids"), self._inputs.get("attention_mask")
        if ids is None or ids.shape != labels.shape:
            raise ValueError("call the model with input_ids= (a keyword argument) of the labels' shape")
        mask = mask if mask is not None else torch.ones_like(ids)
        prompts: List[List[int]] = []
        continuations: List[List[int]] = []
        for row, (row_ids, row_mask, row_labels) in enumerate(zip(ids.tolist(), mask.tolist(), labels.tolist())):
            trained = [i for i, label in enumerate(row_labels) if label != IGNORE]
            if not trained:
                continue
            first, last = trained[0], trained[-1]
            if last - first + 1 != len(trained):
                # the search would continue the prompt with the labels alone, a sequence that never occurs
                gap = next(i for i in range(first, last) if row_labels[i] == IGNORE)
                raise ValueError(f"row {row} has -100 at position {gap}, between its labels (positions {first} to "
                                 f"{last}): the beam term searches one continuation of the prompt, so a row's labels "
                                 f"must be one contiguous run after it (-100 only before, and as padding after); give "
                                 f"each trained span (a chat turn) its own row, what precedes it the prompt, or train "
                                 f"such rows with teacher_forcing_ratio=1.0")
            if first == 0:
                raise ValueError("a row with labels needs a prompt: its first label after position 0 (the token at "
                                 "position 0 is never predicted)")
            prompts.append([t for t, m in zip(row_ids[:first], row_mask[:first]) if m])
            if not prompts[-1]:
                raise ValueError("a row has no attended token before its first label: no prompt to continue")
            continuations.append(row_labels[first:last + 1])
        P, T = max(map(len, prompts)), max(map(len, continuations))
        prompt_ids = ids.new_zeros(len(prompts), P)
        prompt_mask = ids.new_zeros(len(prompts), P)
        continuation = labels.new_full((len(prompts), T), IGNORE)
        for b, (prompt, cont) in enumerate(zip(prompts, continuations)):
            prompt_ids[b, P - len(prompt):] = ids.new_tensor(prompt)
            prompt_mask[b, P - len(prompt):] = 1
            continuation[b, :len(cont)] = labels.new_tensor(cont)
        return CausalLMSearchDecoder.prompt(prompt_ids, prompt_mask), continuation
