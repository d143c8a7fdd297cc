"""Hugging Face ``transformers`` models as search decoders (the ``[hf]`` extra; public API only).

:class:`Seq2SeqSearchDecoder` drives an encoder-decoder (Marian, BART / mBART, T5, M2M100 / NLLB) and
:class:`CausalLMSearchDecoder` a decoder-only model (GPT-2, the Llama family) through
:mod:`fairseq_softtopk.search`:

* the encoder runs once (:meth:`Seq2SeqSearchDecoder.encode`); the search repeats its output per beam;
* each step calls the model on one position with ``inputs_embeds`` (``decoder_inputs_embeds``): a soft input is
  a mixture of ``model.get_input_embeddings()`` outputs (a scale inside the embedding module, as BART's, is
  mixed with it; one the decoder applies to every input, as Marian's, is applied after);
* the state is the model's key/value cache: each layer's keys and values ``(batch * beam, heads, t, dim)`` are
  mixed with the selection's (old beam -> new beam) weights into a new ``DynamicCache`` (hard mode: rows taken
  by index, as ``reorder_cache``); the cross-attention cache of an encoder-decoder is the same for every beam of
  a sentence and is kept.

Only caches whose layers are plain ``DynamicLayer`` can be mixed: a static, sliding-window, quantized or
linear-attention layer holds other state, and the error names it rather than mixing it wrongly. Gradient
checkpointing in training mode makes Hugging Face layers drop their cache: it is refused too.
"""

import inspect
from typing import Any, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from ..modules.beam_search import mix_rows

__all__ = ["CausalLMSearchDecoder", "Seq2SeqSearchDecoder", "mix_cache"]


def _transformers():
    try:
        import transformers
    except ImportError as err:  # the optional extra
        raise ImportError("the Hugging Face adapters need transformers: pip install 'fairseq-softtopk[hf]'") from err
    return transformers


def mix_cache(cache, weights: Tensor, order: Optional[Tensor]):
    """A new cache whose rows are the beams' mixtures: ``weights`` ``(batch, beam_old, beam_new)`` (soft), or the
    rows ``order`` ``(batch * beam,)`` (hard). An ``EncoderDecoderCache`` keeps its cross-attention cache.
    Raises TypeError naming a cache or layer that cannot be mixed."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, EncoderDecoderCache

    if isinstance(cache, EncoderDecoderCache):
        return EncoderDecoderCache(mix_cache(cache.self_attention_cache, weights, order), cache.cross_attention_cache)
    if type(cache) is not DynamicCache:
        raise TypeError(f"a {type(cache).__name__} cannot be mixed over beams (only DynamicCache, or an "
                        f"EncoderDecoderCache of them): use the model's default cache")
    layers = []
    for index, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer:
            raise TypeError(f"layer {index} of the cache is a {type(layer).__name__}, which holds more than keys and "
                            f"values: only DynamicLayer caches can be mixed over beams")
        if order is not None:
            layers.append((layer.keys.index_select(0, order), layer.values.index_select(0, order)))
        else:
            layers.append((mix_rows(layer.keys, weights), mix_rows(layer.values, weights)))
    return DynamicCache(layers)


class _HFSearchDecoder:
    """What both adapters share: the input embeddings, the excluded tokens, the cache mixing."""

    def __init__(self, model, excluded_tokens: Optional[Sequence[int]]):
        checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.2x's name
        if checkpointing is None:
            checkpointing = getattr(model, "is_gradient_checkpointing", False)
        if checkpointing and model.training:
            raise ValueError(f"{type(model).__name__} has gradient checkpointing on: in training mode its layers "
                             f"drop the key/value cache the search mixes (model.gradient_checkpointing_disable())")
        self.model = model
        # the cache's keyword and output field: "cache" from transformers 5.24 (where "past_key_values" warns that
        # it goes in 5.40), "past_key_values" before
        self.cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.embeddings = model.get_input_embeddings()
        pad = model.config.pad_token_id
        self.excluded_tokens = list(excluded_tokens) if excluded_tokens is not None else (
            [] if pad is None else [pad])

    def embed(self, tokens: Tensor) -> Tensor:
        return self.embeddings(tokens)

    def embedding_matrix(self) -> Tensor:
        """``(V, dim)``: the embedding module's output for every token (its scale included)."""
        weight = self.embeddings.weight
        return self.embeddings(torch.arange(weight.shape[0], device=weight.device))

    def mix_state(self, state, weights: Tensor, order: Optional[Tensor]):
        return mix_cache(state, weights, order)

    def _call(self, cache, **inputs):
        """``(the model's output, its new cache)`` for a call with ``cache`` (under the transformers version's name)
        and ``use_cache=True``."""
        out = self.model(**inputs, **{self.cache_name: cache}, use_cache=True)
        return out, getattr(out, self.cache_name)

    @staticmethod
    def _lprobs(logits: Tensor) -> Tensor:
        return torch.log_softmax(logits[:, -1], dim=-1)


class Seq2SeqSearchDecoder(_HFSearchDecoder):
    """A ``transformers`` encoder-decoder as a :class:`~fairseq_softtopk.search.SearchDecoder`.

    Args:
        model: an ``AutoModelForSeq2SeqLM`` model (``config.is_encoder_decoder``).
        excluded_tokens: tokens that never extend a beam (default: the pad token, which a decoder takes as its
            start token here; ``generate`` of Marian models bans it too).

    Use: ``enc = dec.encode(input_ids, attention_mask)``, then
    ``beam_search(dec, enc, labels, pad=-100, bos=dec.bos, config=...)``.
    """

    def __init__(self, model, excluded_tokens: Optional[Sequence[int]] = None):
        _transformers()
        if not getattr(model.config, "is_encoder_decoder", False):
            raise TypeError(f"{type(model).__name__} is not an encoder-decoder: use CausalLMSearchDecoder")
        super().__init__(model, excluded_tokens)
        self.bos = model.config.decoder_start_token_id

    def encode(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None) -> dict:
        """The encoder's output for ``(batch, S)`` sources: ``{"hidden": (batch, S, dim), "mask": (batch, S)}``."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return {"hidden": hidden, "mask": attention_mask}

    def initial_state(self, encoder_out: dict) -> Any:
        return None  # the model builds its default cache at the first step

    def step(self, inputs: Tensor, state, encoder_out: dict):
        out, cache = self._call(state, encoder_outputs=(encoder_out["hidden"],), attention_mask=encoder_out["mask"],
                                decoder_inputs_embeds=inputs.unsqueeze(1))
        return self._lprobs(out.logits), cache


class ContinuationState(NamedTuple):
    """A causal LM's state between steps: its cache, the attention mask over the cache and the next input
    ``(rows, length + 1)``, and whether the next step is the first (it then feeds each prompt's last token)."""

    cache: Any
    mask: Tensor
    first: bool


class CausalLMSearchDecoder(_HFSearchDecoder):
    """A ``transformers`` decoder-only model as a :class:`~fairseq_softtopk.search.SearchDecoder`: the search
    continues prompts.

    The search's "encoder output" is the prompts (:meth:`prompt`: left-padded ``input_ids`` and their attention
    mask). The first state is the cache of each prompt without its last token, and the first step feeds that
    last token (the search's start input, ``bos``, is then unused); positions follow the attention mask, as
    ``generate`` counts them.
    """

    def __init__(self, model, excluded_tokens: Optional[Sequence[int]] = None):
        _transformers()
        if getattr(model.config, "is_encoder_decoder", False):
            raise TypeError(f"{type(model).__name__} is an encoder-decoder: use Seq2SeqSearchDecoder")
        super().__init__(model, excluded_tokens)
        self.bos = 0  # any id: the first step feeds each prompt's last token

    @staticmethod
    def prompt(input_ids: Tensor, attention_mask: Optional[Tensor] = None) -> dict:
        """``{"ids": (batch, P), "mask": (batch, P)}``: the prompts, left-padded
        (``tokenizer.padding_side = "left"``)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if bool((attention_mask[:, -1] == 0).any()):
            raise ValueError("the prompts must be left-padded: the last position of every row must be a token")
        return {"ids": input_ids, "mask": attention_mask}

    def initial_state(self, prompt: dict) -> ContinuationState:
        ids, mask = prompt["ids"], prompt["mask"]
        cache = None
        if ids.shape[1] > 1:
            head = mask[:, :-1]
            positions = (head.cumsum(-1) - 1).clamp_min(0)  # as generate: padding does not shift the positions
            cache = self._call(None, input_ids=ids[:, :-1], attention_mask=head, position_ids=positions)[1]
        return ContinuationState(cache, mask, True)

    def step(self, inputs: Tensor, state: ContinuationState, prompt: dict):
        if state.first:
            inputs = self.embed(prompt["ids"][:, -1])
        positions = state.mask.sum(-1, keepdim=True) - 1
        out, cache = self._call(state.cache, inputs_embeds=inputs.unsqueeze(1), attention_mask=state.mask,
                                position_ids=positions)
        mask = torch.cat([state.mask, state.mask.new_ones(state.mask.shape[0], 1)], 1)
        return self._lprobs(out.logits), ContinuationState(cache, mask, False)

    def mix_state(self, state: ContinuationState, weights: Tensor, order: Optional[Tensor]) -> ContinuationState:
        return ContinuationState(mix_cache(state.cache, weights, order), state.mask, state.first)
