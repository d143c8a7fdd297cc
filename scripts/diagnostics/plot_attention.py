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
from typing import Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's package (a pinned worktree's too)
from fairseq_softtopk.experiments.attention_maps import (attention_matrix, load_checkpoint,  # noqa: E402
                                                         pair_from_subset, pair_from_text, panel_title)


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
