"""What beam-search training needs of a fairseq model, and how the search is driven through it.

A model runs the unrolled search in one of two ways (:func:`unroll_kind`): inside its own forward
(``forward(..., beam_search=)`` and the decoder's step interface, :data:`UNROLL_INTERFACE`: the plugin's
LSTM), or with its decoder driven step by step through fairseq's incremental state (a Transformer:
:class:`~fairseq_softtopk.modules.incremental_decoder_unroll.IncrementalDecoderUnroll`).
:func:`forward_with_beam_search` runs the teacher-forcing forward and the search either way. Shared by the
criteria ``soft_beam_search`` and ``beamgrad_risk``.
"""

import inspect
from typing import Callable, Dict, List

import torch

from ..modules.beam_search_to_eos import search_max_len
from ..modules.incremental_decoder_unroll import IncrementalDecoderUnroll, incremental_unroll_missing

#: what the unrolled search needs of a model's decoder to run inside the model (softtopk_lstm has it)
UNROLL_INTERFACE = ("initial_state", "embed", "embedding_matrix", "step")

#: the architectures that beam-search training supports (README, docs/beam_search_training.md)
SUPPORTED_ARCHITECTURES = ("the plugin's LSTM (softtopk_lstm*) and fairseq incremental decoders built of "
                           "MultiheadAttention: the plugin's Transformer (softtopk_transformer*) and fairseq's "
                           "transformer family")


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside its wrappers (DistributedDataParallel, fairseq's ModuleProxyWrapper around it, ...)."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def unroll_interface_missing(model) -> List[str]:
    """What ``model`` (or the module its DistributedDataParallel wrappers hold) lacks for running the
    unrolled beam search inside its forward: ``forward(..., beam_search=)`` and the decoder's step
    interface; [] if nothing."""
    inner = unwrapped(model)
    missing = []
    if "beam_search" not in inspect.signature(inner.forward).parameters:
        missing.append("forward(..., beam_search=)")
    decoder = getattr(inner, "decoder", None)
    missing += [f"decoder.{name}" for name in UNROLL_INTERFACE if not callable(getattr(decoder, name, None))]
    return missing


#: unroll_kind's answers, per model class (the model inside its wrappers)
_UNROLL_KINDS: Dict[type, str] = {}


def unroll_kind(model) -> str:
    """How the beam search is unrolled for ``model``: ``"model"`` (inside its forward, the plugin's LSTM)
    or ``"incremental"`` (the decoder driven step by step through fairseq's incremental state, a
    Transformer: :class:`~fairseq_softtopk.modules.incremental_decoder_unroll.IncrementalDecoderUnroll`).
    Found once per model class (the model inside its wrappers).

    Raises:
        ValueError: naming what the model lacks for either.
    """
    cls = type(unwrapped(model))
    if cls not in _UNROLL_KINDS:
        _UNROLL_KINDS[cls] = _find_unroll_kind(model)
    return _UNROLL_KINDS[cls]


def _find_unroll_kind(model) -> str:
    missing = unroll_interface_missing(model)
    if not missing:
        return "model"
    inner = unwrapped(model)
    incremental_missing = incremental_unroll_missing(getattr(inner, "decoder", None))
    if not incremental_missing:
        if not isinstance(getattr(inner, "encoder", None), torch.nn.Module):
            incremental_missing = ["an encoder module"]
        else:
            return "incremental"
    raise ValueError(
        f"--criterion soft_beam_search with --teacher-forcing-ratio < 1 trains through a beam search unrolled "
        f"step by step, which {type(inner).__name__} cannot do: it lacks {', '.join(missing)} (to run the search "
        f"inside its forward) and {'; '.join(incremental_missing)} (to drive its decoder through fairseq's "
        f"incremental state). Beam-search training supports {SUPPORTED_ARCHITECTURES}. With "
        f"--teacher-forcing-ratio 1.0 the criterion is plain teacher forcing and takes any model.")


def training_search_max_len(model, net_input: dict, max_len_a: float, max_len_b: int) -> int:
    """The last step of a training search that stops at EOS, as fairseq-generate's for this batch
    (:func:`~fairseq_softtopk.modules.beam_search_to_eos.search_max_len`)."""
    max_positions = getattr(unwrapped(model), "max_decoder_positions", lambda: None)()
    return search_max_len(net_input["src_tokens"].size(1), max_len_a, max_len_b, max_positions)


def forward_with_beam_search(model, net_input: dict, beam_search: Callable, bos: int, kind: str):
    """``(net_output, search output)``: the teacher-forcing forward and ``beam_search(encoder, decoder,
    encoder_out)``, the decoder as the search drives it (:func:`unroll_kind` ``kind``)."""
    if kind == "model":  # inside the model's forward, which DDP wraps
        return model(**net_input, beam_search=beam_search)
    # a Transformer: the teacher-forcing forward (through the wrappers, so DDP prepares its backward),
    # whose encoder output the search reuses, then the decoder driven step by step. Its parameters get
    # one gradient per backward pass as usual, so DDP's reducer sees nothing new.
    inner = unwrapped(model)
    captured = []
    handle = inner.encoder.register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        net_output = model(**net_input)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"{type(inner).__name__}'s forward ran its encoder {len(captured)} times (expected once)")
    return net_output, beam_search(inner.encoder, IncrementalDecoderUnroll(inner.decoder, bos), captured[0])
