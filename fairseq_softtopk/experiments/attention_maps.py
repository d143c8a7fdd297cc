"""The teacher-forced encoder-decoder attention of a checkpoint's model on one sentence pair, and
the name of its normaliser: what ``scripts/diagnostics/plot_attention.py`` draws and
``scripts/diagnostics/attention_sparsity.py`` summarises.

Transformers (``softtopk_transformer``: a chosen layer and head, or the mean over heads) and the
attentional LSTM (``softtopk_lstm``: its one attention) are supported.
"""

from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np
import torch

import fairseq_softtopk


def load_checkpoint(checkpoint: Path, data_bin: Path):
    """``(model, task)``: the checkpoint's model in eval mode on the CPU, data dir overridden (fairseq's
    ``checkpoint_utils.load_model_ensemble_and_task``)."""
    fairseq_softtopk.register()
    from fairseq import checkpoint_utils

    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoint)], arg_overrides={"data": str(data_bin)})
    return models[0].eval().cpu(), task


def pair_from_text(task, source: str, target: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token ids (with the final ``</s>``) of a source/target text pair, ``(src_len,)`` and ``(tgt_len,)``."""
    def encode(dictionary, line):
        return dictionary.encode_line(line, add_if_not_exist=False, append_eos=True).long()

    return encode(task.source_dictionary, source), encode(task.target_dictionary, target)


def pair_from_subset(task, subset: str, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token ids of pair ``index`` of the binarised ``subset``."""
    task.load_dataset(subset)
    item = task.dataset(subset)[index]
    return item["source"].long(), item["target"].long()


def _has_attention_layers(model) -> bool:
    """Transformer decoders: layers with an encoder-decoder attention each (the LSTM's layers are cells)."""
    layers = getattr(model.decoder, "layers", None)
    return bool(layers) and hasattr(layers[0], "encoder_attn")


@torch.no_grad()
def attention_matrix(model, task, source: torch.Tensor, target: torch.Tensor, layer: Optional[int] = None,
                     head: Optional[int] = None) -> Tuple[np.ndarray, List[str], List[str]]:
    """Teacher-forced encoder-decoder attention of one pair.

    Args:
        source: ``(src_len,)`` long source ids ending in ``</s>``.
        target: ``(tgt_len,)`` long target ids ending in ``</s>``.
        layer: decoder layer (default: the last, which fairseq uses for alignments).
        head: one head's weights (default: the mean over heads).

    Returns:
        ``(weights, source_tokens, target_tokens)``: a ``(tgt_len, src_len)`` float array
        whose row ``t`` is the attention while predicting target token ``t``, and the tokens.
    """
    eos = task.target_dictionary.eos()
    prev_output_tokens = torch.cat([target.new_tensor([eos]), target[:-1]]).unsqueeze(0)  # 1 x tgt_len
    src_tokens = [task.source_dictionary[i] for i in source.tolist()]
    tgt_tokens = [task.target_dictionary[i] for i in target.tolist()]
    if not _has_attention_layers(model):  # the attentional LSTM: one attention, no heads
        if layer is not None or head is not None:
            raise ValueError("--layer and --head are options of transformer models; this decoder has one attention")
        _, extra = model(source.unsqueeze(0), torch.tensor([source.numel()]), prev_output_tokens)
        return extra["attn"][0][0].float().numpy(), src_tokens, tgt_tokens
    layers = model.decoder.layers
    layer = len(layers) - 1 if layer is None else layer
    captured = {}
    hook = layers[layer].encoder_attn.register_forward_hook(
        lambda module, inputs, output: captured.__setitem__("weights", output[1]))
    try:
        _, extra = model(source.unsqueeze(0), torch.tensor([source.numel()]), prev_output_tokens,
                         alignment_layer=layer)
    finally:
        hook.remove()
    if head is None:
        weights = extra["attn"][0][0]  # mean over heads: tgt_len x src_len
    else:
        weights = captured["weights"][head, 0]  # fairseq asks the alignment layer for heads x B x T x S
    return weights.float().numpy(), src_tokens, tgt_tokens


def panel_title(model, layer: Optional[int], head: Optional[int]) -> str:
    """The plotted attention's normaliser (with its k and epsilon where it has them) and, for
    transformers, layer and head."""
    transformer = _has_attention_layers(model)
    if transformer:
        layer = len(model.decoder.layers) - 1 if layer is None else layer
        normalizer = getattr(model.decoder.layers[layer].encoder_attn, "normalizer", None)  # fairseq's own: softmax
    else:
        normalizer = model.decoder.attention.normalizer
    name = "softmax" if normalizer is None else normalizer.name
    if name in ("soft_topk", "sparse_topk", "hard_topk"):
        name += f" k={normalizer.k}" + (f" eps={normalizer.epsilon:g}" if name != "hard_topk" else "")
    if not transformer:
        return name
    heads = f"head {head}" if head is not None else "mean over heads"
    return f"{name}, decoder layer {layer}, {heads}"
