"""The step interface of the unrolled beam search for a fairseq incremental decoder (the Transformers).

A Transformer decoder's "hidden state" after step t is its history: the self-attention keys and
values of every layer for positions 0..t-1, fairseq's *incremental state* (a dict of
``(batch, heads, t, head_dim)`` tensors per attention module). The soft beam update of the paper
(:mod:`fairseq_softtopk.modules.beam_search`) carries over:

* the next input of beam ``l`` is the weighted embedding ``sum_c A[c, l] E[token c]``: it is fed
  in place of the token embedding (a forward hook on ``embed_tokens`` replaces the lookup of the
  step's token), so the decoder scales it and adds the position embedding of step t itself, as
  it does for a token;
* the history of beam ``l`` is the mixture of its predecessors' histories,
  ``cache_l = sum_i w[i, l] cache_i``, for every cached tensor of the self-attentions; the
  encoder-decoder attention caches are the same for every beam of a sentence and are kept;
* hard mode reorders the caches by index, as fairseq's ``reorder_incremental_state``;
* padding never extends a beam (the decoder would mask it as an input; fairseq's generator
  excludes it too).

:class:`IncrementalDecoderUnroll` wraps any decoder built of fairseq ``MultiheadAttention``
modules and an ``embed_tokens`` lookup: the plugin's ``softtopk_transformer`` and fairseq's
``transformer`` family. :func:`incremental_unroll_missing` names what another decoder lacks.
"""

from typing import Dict, List, NamedTuple, Optional

import torch
from torch import Tensor, nn

from .beam_search import mix_rows

__all__ = ["IncrementalDecoderState", "IncrementalDecoderUnroll", "incremental_unroll_missing"]

IncrementalCache = Dict[str, Dict[str, Optional[Tensor]]]


class IncrementalDecoderState(NamedTuple):
    """The beams' state between steps.

    Attributes:
        cache: fairseq's incremental state; every tensor is ``(batch * beam, ...)``.
        length: how many positions the cache holds (the next step's position is ``length``).
    """

    cache: IncrementalCache
    length: int


def _cache_owners(decoder: nn.Module) -> List[nn.Module]:
    """The submodules that keep an incremental state of their own (fairseq's ``with_incremental_state``)."""
    return [m for m in decoder.modules() if m is not decoder and hasattr(m, "_incremental_state_id")]


def incremental_unroll_missing(decoder) -> List[str]:
    """What ``decoder`` lacks for :class:`IncrementalDecoderUnroll`; [] if nothing.

    It needs fairseq's incremental decoding (a ``FairseqIncrementalDecoder``), an ``embed_tokens`` lookup
    (with a ``weight``) through which every step's token enters, and caches whose first dimension is the
    beam: those of fairseq's ``MultiheadAttention`` (a module whose cache layout is unknown, such as
    fairseq's LSTM decoder's, is named).
    """
    from fairseq.models import FairseqIncrementalDecoder

    if not isinstance(decoder, FairseqIncrementalDecoder):
        return ["a fairseq incremental decoder (FairseqIncrementalDecoder)"]
    missing = []
    if type(decoder).reorder_incremental_state is not FairseqIncrementalDecoder.reorder_incremental_state:
        missing.append(f"an incremental state of fairseq MultiheadAttention caches only ({type(decoder).__name__} "
                       f"keeps a state of its own, reordered by its reorder_incremental_state)")
    embed = getattr(decoder, "embed_tokens", None)
    if not isinstance(embed, nn.Module) or not isinstance(getattr(embed, "weight", None), Tensor):
        missing.append("decoder.embed_tokens (a token embedding module with a weight)")
    unknown = sorted({type(m).__name__ for m in _cache_owners(decoder) if not hasattr(m, "encoder_decoder_attention")})
    if unknown:
        missing.append(f"an incremental state of fairseq MultiheadAttention caches only (it has {', '.join(unknown)})")
    return missing


class IncrementalDecoderUnroll:
    """``initial_state`` / ``embed`` / ``embedding_matrix`` / ``step`` / ``mix_state`` of a fairseq
    incremental decoder, for :func:`~fairseq_softtopk.modules.beam_search.unroll_beam_search`.

    Args:
        decoder: e.g. a ``TransformerDecoderBase`` (see :func:`incremental_unroll_missing`).
        bos: the token that starts decoding; the step's token positions are filled with it (only their
            number matters: the decoder reads the position from it, the embedding is replaced).

    Raises:
        ValueError: naming what the decoder lacks.
    """

    def __init__(self, decoder: nn.Module, bos: int):
        missing = incremental_unroll_missing(decoder)
        if missing:
            raise ValueError(f"{type(decoder).__name__} cannot be unrolled step by step on embeddings "
                             f"(missing: {'; '.join(missing)})")
        self.decoder, self.bos = decoder, bos
        # fairseq's decoder masks a padding input (its key is left out of self-attention), which a soft input
        # cannot express: padding never extends a beam, as in fairseq's SequenceGenerator
        self.excluded_tokens = (decoder.padding_idx,) if getattr(decoder, "padding_idx", None) is not None else None
        # encoder-decoder attention: its cache holds the projected encoder states, the same for every beam
        owners = _cache_owners(decoder)
        self.static_keys = frozenset(m._get_full_incremental_state_key("attn_state") for m in owners
                                     if m.encoder_decoder_attention)
        self.known_keys = frozenset(m._get_full_incremental_state_key("attn_state") for m in owners)

    def initial_state(self, encoder_out) -> IncrementalDecoderState:
        return IncrementalDecoderState({}, 0)

    def embed(self, tokens: Tensor) -> Tensor:
        """``(rows,)`` tokens -> ``(rows, dim)`` embeddings as looked up (the decoder scales them)."""
        return self.decoder.embed_tokens(tokens)

    def embedding_matrix(self) -> Tensor:
        return self.decoder.embed_tokens.weight

    def step(self, input_embeddings: Tensor, state: IncrementalDecoderState, encoder_out):
        """One decoding step on ``(rows, dim)`` input embeddings.

        Returns:
            ``(lprobs, state)``: ``(rows, V)`` log-probabilities and the state with this step's
            position added (the cache dict is updated in place, as fairseq does).
        """
        rows = input_embeddings.shape[0]
        # the decoder reads the step's position from the length of the tokens so far
        prefix = torch.full((rows, state.length + 1), self.bos, dtype=torch.long, device=input_embeddings.device)
        replacement = input_embeddings.unsqueeze(1)
        calls = []

        def feed(module, args, output):
            if calls or output.shape != replacement.shape:
                raise RuntimeError(f"{type(self.decoder).__name__} looked up {output.shape} token embeddings in one "
                                   f"incremental step (expected one lookup of {tuple(replacement.shape)}): it cannot "
                                   f"be fed soft embeddings")
            calls.append(True)
            return replacement.to(output.dtype)

        handle = self.decoder.embed_tokens.register_forward_hook(feed)
        try:
            net_output = self.decoder(prefix, encoder_out=encoder_out, incremental_state=state.cache)
        finally:
            handle.remove()
        if not calls:
            raise RuntimeError(f"{type(self.decoder).__name__} did not look its tokens up through embed_tokens")
        logits = net_output[0][:, -1, :]
        if getattr(self.decoder, "adaptive_softmax", None) is not None:
            lprobs = self.decoder.get_normalized_probs((net_output[0][:, -1:], net_output[1]), log_probs=True)[:, -1]
        else:  # fairseq's get_normalized_probs computes in float32 whatever the model's dtype; here >= float32
            lprobs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        return lprobs, IncrementalDecoderState(state.cache, state.length + 1)

    def mix_state(self, state: IncrementalDecoderState, weights: Tensor,
                  order: Optional[Tensor] = None) -> IncrementalDecoderState:
        """The next beams' caches.

        Args:
            weights: ``(batch, beam_old, beam_new)``: new beam ``l`` = ``sum_i weights[:, i, l] * old i``.
            order: ``(batch * beam,)`` the old row each new row copies (hard mode: an index, as fairseq's
                ``reorder_incremental_state``; the weights are then not used).
        """
        if order is not None:
            cache = {key: dict(value) for key, value in state.cache.items()}
            self.decoder.reorder_incremental_state_scripting(cache, order)
            return IncrementalDecoderState(cache, state.length)
        cache = {}
        for key, buffers in state.cache.items():
            if key not in self.known_keys:  # a layout we do not know: mixing along dim 0 could be wrong
                raise ValueError(f"{type(self.decoder).__name__} cached {key!r}, which is not a MultiheadAttention "
                                 f"cache: its beams cannot be mixed")
            if key in self.static_keys:
                cache[key] = buffers
                continue
            mixed = {}
            for name, tensor in buffers.items():
                if tensor is None:
                    mixed[name] = None
                elif not tensor.is_floating_point():
                    raise ValueError(f"cannot mix the cached {name} ({tensor.dtype}) of {key} over beams")
                else:
                    mixed[name] = mix_rows(tensor, weights)
            cache[key] = mixed
        return IncrementalDecoderState(cache, state.length)
