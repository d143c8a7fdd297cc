#!/usr/bin/env python
"""Heatmaps of the encoder-decoder attention of one sentence pair (paper figure 6).

Loads each checkpoint with fairseq's ``checkpoint_utils.load_model_ensemble_and_task``, runs the
pair teacher-forced (the decoder reads the reference target, shifted right) and writes the
attention weights as a PNG: source tokens on the x axis, target tokens (the token predicted at
each step) on the y axis; several checkpoints (of one data dir) give panels side by side, e.g.
softmax, soft top-k and entmax-1.5 models. Transformers (``softtopk_transformer``: a chosen
layer and head) and the attentional LSTM (``softtopk_lstm``: its one attention) are supported.
The pair is either given as text (tokenised like the training data) or taken from a binarised
subset by index.

Example::

    python scripts/diagnostics/plot_attention.py softmax/checkpoint_last.pt soft_topk/checkpoint_last.pt \\
        data-bin/toy --subset test --index 3 --output attention.png
"""

import argparse
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's package (a pinned worktree's too)
import fairseq_softtopk  # noqa: E402


def load_checkpoint(checkpoint: Path, data_bin: Path):
    """``(model, task)``: the checkpoint's model in eval mode on the CPU, data dir overridden."""
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


def plot_heatmap(weights: np.ndarray, src_tokens: Sequence[str], tgt_tokens: Sequence[str], output: Path,
                 title: str = "") -> None:
    """Writes a ``(tgt_len, src_len)`` weight matrix as a PNG with the tokens on the axes."""
    plot_heatmaps([(weights, title)], src_tokens, tgt_tokens, output)


def plot_heatmaps(panels: Sequence[Tuple[np.ndarray, str]], src_tokens: Sequence[str], tgt_tokens: Sequence[str],
                  output: Path) -> None:
    """Writes ``(weights, title)`` panels of one sentence pair side by side as a PNG (shared colour scale).

    Args:
        panels: each ``weights`` is ``(tgt_len, src_len)``, rows the attention while predicting
            target token ``t``.
    """
    height, width = panels[0][0].shape
    fig, axes = plt.subplots(1, len(panels), squeeze=False,
                             figsize=(len(panels) * max(4.0, 0.4 * width + 1.5) + 1, max(3.0, 0.4 * height + 1.5)))
    for ax, (weights, title) in zip(axes[0], panels):
        image = ax.imshow(weights, cmap="Greys", vmin=0.0, vmax=1.0, aspect="equal")
        ax.set_xticks(range(width), labels=src_tokens, rotation=90)
        ax.set_yticks(range(height), labels=tgt_tokens)
        ax.xaxis.tick_top()
        ax.set_title(title, fontsize=9, pad=12 + 6 * max(map(len, src_tokens), default=0))
    fig.colorbar(image, ax=list(axes[0]), fraction=0.04 / len(panels))
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120, bbox_inches="tight")
    plt.close(fig)


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
    if name in ("soft_topk", "hard_topk"):
        name += f" k={normalizer.k}" + (f" eps={normalizer.epsilon:g}" if name.startswith("soft") else "")
    if not transformer:
        return name
    heads = f"head {head}" if head is not None else "mean over heads"
    return f"{name}, decoder layer {layer}, {heads}"


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", type=Path, nargs="+", help="one checkpoint, or several for panels side by side")
    parser.add_argument("data_bin", type=Path, help="the binarised data dir (dictionaries)")
    parser.add_argument("--source", help="source sentence, tokenised like the training data")
    parser.add_argument("--target", help="target sentence for teacher forcing")
    parser.add_argument("--subset", default="test", help="binarised subset to take the pair from")
    parser.add_argument("--index", type=int, default=0, help="pair index in --subset")
    parser.add_argument("--layer", type=int, help="decoder layer (transformers; default: last)")
    parser.add_argument("--head", type=int, help="attention head (transformers; default: mean over heads)")
    parser.add_argument("--output", type=Path, default=Path("attention.png"))
    args = parser.parse_args(argv)
    if (args.source is None) != (args.target is None):
        parser.error("--source and --target go together")
    panels = []
    for checkpoint in args.checkpoints:
        model, task = load_checkpoint(checkpoint, args.data_bin)
        if args.source is not None:
            source, target = pair_from_text(task, args.source, args.target)
        else:
            source, target = pair_from_subset(task, args.subset, args.index)
        weights, src_tokens, tgt_tokens = attention_matrix(model, task, source, target, args.layer, args.head)
        panels.append((weights, panel_title(model, args.layer, args.head)))
    plot_heatmaps(panels, src_tokens, tgt_tokens, args.output)
    print(f"wrote {args.output} ({len(panels)} panel(s) of {weights.shape[0]} x {weights.shape[1]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
