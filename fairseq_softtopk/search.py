"""The differentiable beam search as a public API: any decoder, no fairseq (importing this needs torch only).

A training search is unrolled over a batch of sentences, ``beam`` hypotheses each. At every step the
``beam x V`` extensions are scored by their cumulative log-likelihood and the next beams are chosen by the
sorted SOFT top-k (``mode="soft"``, the paper's: the next inputs are the candidates' embeddings mixed by the
selection, the next states the predecessors' mixed), the exact top-k (``"hard"``, the ablation) or the sparse
top-k (``regularizer="quadratic"``). Two searches and their losses:

* :func:`beam_search` runs as many steps as the gold target has tokens; :func:`gold_token_loss` is the NLL of
  the gold tokens along the beam that ends best (Xie et al. 2020, section 5.2);
* :func:`beam_search_to_eos` decodes as a generator does (EOS finishes a hypothesis, a length penalty);
  :func:`risk_loss` is the expected ``1 - BLEU+1`` of the finished hypotheses.

The decoder is anything with the four methods of :class:`SearchDecoder` (a state is any value the decoder
understands; if it is a NamedTuple of ``(batch * beam, ...)`` tensors the search mixes it, otherwise the
decoder mixes it itself with ``mix_state``). Adapters exist for the plugin's fairseq models and fairseq's
Transformer decoders (:mod:`fairseq_softtopk.modules.incremental_decoder_unroll`).

:func:`observe_selections` (a context manager) hands every step's selection, a :class:`StepSelection`, to a
callback: for diagnostics, at no cost when unused.

Example (a decoder ``dec`` and an encoder output ``enc`` for ``batch`` sentences; ``target`` padded with
``pad``, EOS included)::

    from fairseq_softtopk.search import BeamSearchConfig, beam_search, gold_token_loss

    out = beam_search(dec, enc, target, pad=pad, bos=bos, config=BeamSearchConfig(beam=5, epsilon=0.1))
    loss = gold_token_loss(out, target, pad).loss / target.ne(pad).sum()
    loss.backward()
"""

from typing import Any, Callable, Optional, Protocol, Tuple, runtime_checkable

import torch
from torch import Tensor

from .modules.beam_search import BeamSearchOutput, mix_rows, unroll_beam_search
from .modules.beam_search_config import BeamSearchConfig, GradientObserver
from .modules.beam_search_to_eos import FinishedBeams, unroll_beam_search_to_eos
from .modules.search_input_checks import check_batch, check_config, check_encoder_batch
from .modules.search_losses import GoldTokenLoss, gold_token_loss, risk_loss
from .modules.selection_observer import StepSelection, observe_selections

__all__ = ["BeamSearchConfig", "BeamSearchOutput", "FinishedBeams", "GoldTokenLoss", "SearchDecoder", "StepSelection",
           "beam_search", "beam_search_to_eos", "check_decoder", "gold_token_loss", "mix_rows", "observe_selections",
           "repeat_rows", "risk_loss"]


@runtime_checkable
class SearchDecoder(Protocol):
    """What the search needs of a decoder; ``R = batch * beam`` rows, beam-major within a sentence.

    Optional members: ``mix_state(state, weights, order) -> state`` mixes the decoder's own state
    (``weights`` ``(batch, beam_old, beam_new)``: new beam ``l`` is ``sum_i weights[:, i, l] * old i``;
    ``order`` ``(R,)``: in hard mode the old row each new row copies, else None); without it the state must be
    a NamedTuple of ``(R, ...)`` tensors, mixed row-wise. ``excluded_tokens``: token ids that never extend a
    beam (padding, say).
    """

    def initial_state(self, encoder_out: Any) -> Any:
        """The state before the first step, from the encoder output already repeated per beam."""

    def embed(self, tokens: Tensor) -> Tensor:
        """``(R,)`` token ids -> ``(R, dim)`` the inputs the decoder takes for them."""

    def embedding_matrix(self) -> Tensor:
        """``(V, dim)``: the input of every token (a soft input is a weighted sum of its rows)."""

    def step(self, inputs: Tensor, state: Any, encoder_out: Any) -> Tuple[Tensor, Any]:
        """One step on ``(R, dim)`` inputs: ``((R, V) log-probabilities of the next token, the new state)``."""


def check_decoder(decoder) -> None:
    """Raises TypeError naming what ``decoder`` lacks of :class:`SearchDecoder`."""
    missing = [name for name in ("initial_state", "embed", "embedding_matrix", "step")
               if not callable(getattr(decoder, name, None))]
    if missing:
        raise TypeError(f"{type(decoder).__name__} cannot be searched: it has no {', '.join(missing)} "
                        f"(see fairseq_softtopk.search.SearchDecoder)")


def repeat_rows(encoder_out: Any, order: Tensor) -> Any:
    """The default ``reorder_encoder_out``: rows ``order`` of every tensor in ``encoder_out`` (a tensor, or
    tuples, lists and dicts of them, batch first; None and other values kept)."""
    if torch.is_tensor(encoder_out):
        return encoder_out.index_select(0, order.to(encoder_out.device))
    if isinstance(encoder_out, dict):
        return {key: repeat_rows(value, order) for key, value in encoder_out.items()}
    if isinstance(encoder_out, tuple) and hasattr(encoder_out, "_fields"):
        return type(encoder_out)(*(repeat_rows(value, order) for value in encoder_out))
    if isinstance(encoder_out, (tuple, list)):
        return type(encoder_out)(repeat_rows(value, order) for value in encoder_out)
    return encoder_out


def beam_search(decoder: SearchDecoder, encoder_out: Any, target: Tensor, *, pad: int, bos: int,
                config: Optional[BeamSearchConfig] = None, reorder_encoder_out: Callable = repeat_rows,
                grad_observer: Optional[GradientObserver] = None) -> BeamSearchOutput:
    """The search unrolled for ``T = target.shape[1]`` steps, along the gold target (for :func:`gold_token_loss`).

    Args:
        encoder_out: for ``batch = target.shape[0]`` sentences; ``reorder_encoder_out(encoder_out, order)`` takes
            its rows ``order`` (default :func:`repeat_rows`).
        target: ``(batch, T)`` gold tokens, EOS included, right-padded with ``pad`` (any id, -100 included).
        bos: the token whose input starts decoding.
        config: the search's options (default: soft, beam 5, epsilon 0.1).
    """
    check_decoder(decoder)
    check_config(config, BeamSearchConfig)
    if not torch.is_tensor(target) or target.dim() != 2 or target.shape[1] == 0:
        raise ValueError(f"target must be a (batch, T) tensor with T >= 1, got "
                         f"{tuple(target.shape) if torch.is_tensor(target) else type(target).__name__}")
    if reorder_encoder_out is repeat_rows:
        check_encoder_batch(encoder_out, target.shape[0], "the target has")
    return unroll_beam_search(decoder, encoder_out, reorder_encoder_out, target, pad, bos,
                              config if config is not None else BeamSearchConfig(), grad_observer)


def beam_search_to_eos(decoder: SearchDecoder, encoder_out: Any, batch: int, *, pad: int, bos: int, eos: int,
                       max_len: int, lenpen: float = 1.0, config: Optional[BeamSearchConfig] = None,
                       reorder_encoder_out: Callable = repeat_rows, grad_observer: Optional[GradientObserver] = None,
                       device: Optional[torch.device] = None) -> FinishedBeams:
    """The search that decodes as a generator does, until every sentence has ``beam`` hypotheses finished by
    ``eos`` or step ``max_len`` (for :func:`risk_loss`): ``pad`` never extends a beam, a finished score is
    divided by ``length ** lenpen`` (the length counting the EOS)."""
    check_decoder(decoder)
    check_config(config, BeamSearchConfig)
    check_batch(batch)
    if reorder_encoder_out is repeat_rows:
        check_encoder_batch(encoder_out, batch, "batch= says")
    return unroll_beam_search_to_eos(decoder, encoder_out, reorder_encoder_out, batch, pad, bos, eos,
                                     config if config is not None else BeamSearchConfig(), max_len, lenpen,
                                     grad_observer=grad_observer, device=device)

