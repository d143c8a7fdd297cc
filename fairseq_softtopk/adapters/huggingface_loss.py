"""The soft beam-search training loss for a Hugging Face encoder-decoder, as ``Trainer``'s ``compute_loss_func``.

``loss = p * L_tf + (1 - p) * L_beam`` per target token (Xie et al. 2020, section 5.2; the plugin's fairseq
criterion ``soft_beam_search``): ``L_tf`` the NLL of the labels under teacher forcing (the model's own outputs),
``L_beam`` the NLL of the labels along the best beam of the search (:func:`fairseq_softtopk.search.beam_search`,
soft by default), both label-smoothed as fairseq's ``label_smoothed_cross_entropy``. The search reuses the
encoder output of the teacher-forced call (``outputs.encoder_last_hidden_state``: both terms train the encoder)
and the attention mask the model was called with, which a forward pre-hook on the model records.

Use::

    loss_fn = Seq2SeqBeamSearchLoss(model, BeamSearchConfig(beam=5, epsilon=0.1), teacher_forcing_ratio=0.8)
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=data, data_collator=collator,
                             compute_loss_func=loss_fn)

or in a plain loop: ``outputs = model(input_ids=..., attention_mask=..., decoder_input_ids=...)``, then
``loss_fn(outputs, labels).backward()``. Labels are padded with -100 (as ``DataCollatorForSeq2Seq`` pads them),
EOS included.
"""

from typing import Optional

import torch
from torch import Tensor

from ..modules.beam_search_config import BeamSearchConfig
from ..modules.search_losses import gold_token_loss, smoothed_nll
from ..search import beam_search
from .huggingface import Seq2SeqSearchDecoder

__all__ = ["Seq2SeqBeamSearchLoss"]

IGNORE = -100  # Hugging Face's label padding


class Seq2SeqBeamSearchLoss:
    """Args:
        model: the encoder-decoder being trained (the hook is put on it; :meth:`remove` takes it off).
        config: the search's options (default: soft, beam 5, epsilon 0.1).
        teacher_forcing_ratio: ``p``; 1 is plain teacher forcing (no search).
        label_smoothing: as fairseq's ``label_smoothed_cross_entropy``.
    """

    def __init__(self, model, config: Optional[BeamSearchConfig] = None, teacher_forcing_ratio: float = 0.8,
                 label_smoothing: float = 0.0):
        if not 0.0 <= teacher_forcing_ratio <= 1.0:
            raise ValueError(f"teacher_forcing_ratio must be in [0, 1], got {teacher_forcing_ratio}")
        self.decoder = Seq2SeqSearchDecoder(model)
        self.config = config if config is not None else BeamSearchConfig()
        self.p = teacher_forcing_ratio
        self.label_smoothing = label_smoothing
        self._mask: Optional[Tensor] = None
        self._hook = model.register_forward_pre_hook(self._record_mask, with_kwargs=True)

    def _record_mask(self, module, args, kwargs):
        if "decoder_inputs_embeds" not in kwargs:  # not one of the search's own steps
            self._mask = kwargs.get("attention_mask")

    def remove(self) -> None:
        """Takes the hook off the model."""
        self._hook.remove()

    def __call__(self, outputs, labels: Tensor, num_items_in_batch=None) -> Tensor:
        """The loss per target token (``num_items_in_batch`` tokens if given, as ``Trainer`` counts them over
        gradient accumulation; else this batch's). ``outputs``: the model's teacher-forced output for ``labels``
        ``(batch, T)``."""
        logits = outputs.logits
        if logits.shape[:2] != labels.shape:
            raise ValueError(f"the outputs' logits are {tuple(logits.shape)} but the labels {tuple(labels.shape)}: "
                             f"call the model with decoder_input_ids from these labels")
        lprobs = torch.log_softmax(logits.float(), -1)
        mask = labels.ne(IGNORE)
        gold = lprobs.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        vocab = lprobs.shape[-1]
        loss, _ = smoothed_nll(gold, lprobs.sum(-1), mask, self.label_smoothing, vocab)
        loss = self.p * loss
        if self.p < 1.0:
            hidden = outputs.encoder_last_hidden_state
            encoder_mask = self._mask if self._mask is not None else hidden.new_ones(hidden.shape[:2], dtype=torch.long)
            if encoder_mask.shape != hidden.shape[:2]:
                raise ValueError(f"the attention mask recorded from the model's call is {tuple(encoder_mask.shape)}, "
                                 f"the encoder output {tuple(hidden.shape[:2])}: call the model with keyword arguments")
            out = beam_search(self.decoder, {"hidden": hidden, "mask": encoder_mask}, labels, pad=IGNORE,
                              bos=self.decoder.bos, config=self.config)
            loss = loss + (1.0 - self.p) * gold_token_loss(out, labels, IGNORE, self.label_smoothing, vocab).loss
            if out.scale_probe is not None:  # a zero through which a capped selection gradient follows the factor
                loss = loss + out.scale_probe  # that multiplies the summed loss (the division below, a loss scale)
        count = num_items_in_batch if num_items_in_batch is not None else mask.sum()
        return loss / count
