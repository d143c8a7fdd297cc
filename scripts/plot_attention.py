#!/usr/bin/env python
"""Heatmap of the encoder-decoder attention of one sentence pair (paper figure 6).

Loads a checkpoint with fairseq's ``checkpoint_utils.load_model_ensemble_and_task``, runs the
pair teacher-forced (the decoder reads the reference target, shifted right) and writes the
chosen layer's attention weights as a PNG: source tokens on the x axis, target tokens (the
token predicted at each step) on the y axis. The pair is either given as text (tokenised
like the training data) or taken from a binarised subset by index.

Example::

    python scripts/plot_attention.py checkpoints/checkpoint_best.pt data-bin/toy \\
        --subset test --index 3 --output attention.png
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
    layers = model.decoder.layers
    layer = len(layers) - 1 if layer is None else layer
    captured = {}
    hook = layers[layer].encoder_attn.register_forward_hook(
        lambda module, inputs, output: captured.__setitem__("weights", output[1]))
    eos = task.target_dictionary.eos()
    prev_output_tokens = torch.cat([target.new_tensor([eos]), target[:-1]]).unsqueeze(0)  # 1 x tgt_len
    try:
        _, extra = model(source.unsqueeze(0), torch.tensor([source.numel()]), prev_output_tokens,
                         alignment_layer=layer)
    finally:
        hook.remove()
    if head is None:
        weights = extra["attn"][0][0]  # mean over heads: tgt_len x src_len
    else:
        weights = captured["weights"][head, 0]  # fairseq asks the alignment layer for heads x B x T x S
    src_tokens = [task.source_dictionary[i] for i in source.tolist()]
    tgt_tokens = [task.target_dictionary[i] for i in target.tolist()]
    return weights.float().numpy(), src_tokens, tgt_tokens


def plot_heatmap(weights: np.ndarray, src_tokens: Sequence[str], tgt_tokens: Sequence[str], output: Path,
                 title: str = "") -> None:
    """Writes a ``(tgt_len, src_len)`` weight matrix as a PNG with the tokens on the axes."""
    height, width = weights.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.4 * width + 2), max(3.0, 0.4 * height + 1.5)))
    image = ax.imshow(weights, cmap="Greys", vmin=0.0, vmax=1.0, aspect="equal")
    ax.set_xticks(range(width), labels=src_tokens, rotation=90)
    ax.set_yticks(range(height), labels=tgt_tokens)
    ax.xaxis.tick_top()
    ax.set_title(title, fontsize=9, pad=12 + 6 * max(map(len, src_tokens), default=0))
    fig.colorbar(image, ax=ax, fraction=0.04)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("data_bin", type=Path, help="the binarised data dir (dictionaries)")
    parser.add_argument("--source", help="source sentence, tokenised like the training data")
    parser.add_argument("--target", help="target sentence for teacher forcing")
    parser.add_argument("--subset", default="test", help="binarised subset to take the pair from")
    parser.add_argument("--index", type=int, default=0, help="pair index in --subset")
    parser.add_argument("--layer", type=int, help="decoder layer (default: last)")
    parser.add_argument("--head", type=int, help="attention head (default: mean over heads)")
    parser.add_argument("--output", type=Path, default=Path("attention.png"))
    args = parser.parse_args(argv)
    if (args.source is None) != (args.target is None):
        parser.error("--source and --target go together")
    model, task = load_checkpoint(args.checkpoint, args.data_bin)
    if args.source is not None:
        source, target = pair_from_text(task, args.source, args.target)
    else:
        source, target = pair_from_subset(task, args.subset, args.index)
    weights, src_tokens, tgt_tokens = attention_matrix(model, task, source, target, args.layer, args.head)
    normalizer = getattr(model.cfg, "attention_normalizer", "softmax")
    layer = len(model.decoder.layers) - 1 if args.layer is None else args.layer
    heads = f"head {args.head}" if args.head is not None else "mean over heads"
    title = f"{normalizer}, decoder layer {layer}, {heads}"
    plot_heatmap(weights, src_tokens, tgt_tokens, args.output, title)
    print(f"wrote {args.output} ({weights.shape[0]} x {weights.shape[1]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
