#!/usr/bin/env python
"""How many candidates a beam-search step's selection really uses: entropic against quadratic, on a real model.

The soft beam search of a checkpoint (``--topk-mode soft``, entropic, no gradient) runs over ``--sentences``
sentences of ``--subset``; every decoding step's ``k x V`` candidate scores are recorded. For each step and
each regularisation value, this prints

* for the quadratic regulariser (``sorted_sparse_soft_topk``, ``regularization = lambda``): the *support*, the
  candidates with a nonzero weight on some rank (exactly: the others weigh 0), its mean, 90th percentile and
  maximum over steps, and the share of steps where it is exactly the k selected (a hard step);
* for the entropic one (``sorted_soft_topk``, ``epsilon``): the candidates holding a weight above 1e-4 (every
  candidate's weight is positive there: this is a practical support, not an exact one);
* for both: the mean largest weight of a rank (``sharpness``, as the criterion logs it: 1 = hard).

With ``--figure PNG`` it also draws the weights of one real step (the first step of the sample with a near tie
among the k + 1 best, within the largest value of the grid) for the best ``--figure-candidates`` candidates,
entropic and quadratic side by side at the same value::

    python scripts/diagnostics/selection_support.py CHECKPOINT DATA_BIN --sentences 50 \\
        --values 0.01 0.03 0.1 0.3 1.0 --figure figures/selection_weights_entropic_vs_quadratic.png
"""

import argparse
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's package (a pinned worktree's too)
from fairseq_softtopk.experiments.checkpoint_sample import (add_sample_arguments, load_model,  # noqa: E402
                                                            quantiles, quiet_logging, sample_sentences,
                                                            training_cfg)
from fairseq_softtopk.ops import sorted_soft_topk, sorted_sparse_soft_topk  # noqa: E402
from fairseq_softtopk.search import StepSelection, observe_selections  # noqa: E402


def record_step_scores(task, model, arch: str, data_bin: str, batches: List[dict], beam: int) -> List[torch.Tensor]:
    """Every decoding step's ``(k * V,)`` candidate scores of each sentence's soft beam search (no gradient)."""
    cfg = training_cfg(data_bin, arch, ["--train-beam", str(beam), "--teacher-forcing-ratio", "0.8"])
    criterion = task.build_criterion(cfg.criterion)
    recorded: List[torch.Tensor] = []

    def record(selection: StepSelection) -> None:  # the scores the step's selection saw, one row per sentence
        recorded.extend(row.clone() for row in selection.scores)

    model.eval()
    with torch.no_grad(), observe_selections(record):
        for sample in batches:
            criterion(model, sample)
    return recorded


def measure(steps: Sequence[torch.Tensor], beam: int, values: Sequence[float]) -> Dict[str, Dict[float, dict]]:
    """Support and sharpness of both regularisers at each value, over the recorded steps."""
    results: Dict[str, Dict[float, dict]] = {"quadratic": {}, "entropic": {}}
    for value in values:
        for name in results:
            support, sharpness = [], []
            for scores in steps:
                if name == "quadratic":
                    A = sorted_sparse_soft_topk(scores, beam, regularization=value, tol=1e-9)
                    used = int((A.sum(-1) > 0).sum())
                else:
                    A = sorted_soft_topk(scores, beam, epsilon=value, tol=1e-6, warn=False)
                    used = int((A > 1e-4).any(-1).sum())
                support.append(used)
                sharpness.append(float(A.amax(0).mean()))
            results[name][value] = {"support": quantiles(support), "mean_support": statistics.mean(support),
                                    "hard_share": sum(s == beam for s in support) / len(support),
                                    "sharpness": statistics.mean(sharpness)}
    return results


def format_table(results: Dict[str, Dict[float, dict]], beam: int, n: int) -> str:
    lines = [f"| regulariser | value (nats) | candidates used: mean | p90 | max (of {n}) | steps using only the {beam} "
             "selected | sharpness |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, by_value in results.items():
        used = "nonzero weight (exact)" if name == "quadratic" else "weight > 1e-4"
        for value, r in by_value.items():
            s = r["support"]
            lines.append(f"| {name} ({used}) | {value:g} | {r['mean_support']:.1f} | {s['p90']} | {s['max']} | "
                         f"{100 * r['hard_share']:.0f}% | {r['sharpness']:.3f} |")
    return "\n".join(lines)


def plot_step(scores: torch.Tensor, beam: int, value: float, candidates: int, path: Path, title: str) -> None:
    """Weights of the best ``candidates`` candidates on each rank, entropic | quadratic, as heat maps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = scores.argsort(descending=True)[:candidates]
    panels = [("entropic (sorted SOFT top-k), epsilon", sorted_soft_topk(scores, beam, epsilon=value, tol=1e-9)),
              ("quadratic (sorted sparse soft top-k), lambda", sorted_sparse_soft_topk(scores, beam,
                                                                                      regularization=value, tol=1e-9))]
    fig, axes = plt.subplots(1, 2, figsize=(9, 0.28 * candidates + 1.6), sharey=True)
    best = scores[order[0]]
    labels = [f"{float(scores[c] - best):+.3f}" for c in order]
    for ax, (name, A) in zip(axes, panels):
        weights = A[order].numpy()
        ax.imshow(weights, aspect="auto", cmap="viridis", vmin=0, vmax=1)
        for i in range(weights.shape[0]):
            for r in range(beam):
                w = weights[i, r]
                text = "0" if w == 0 else (f"{w:.2f}" if w >= 0.005 else f"{w:.0e}")
                ax.text(r, i, text, ha="center", va="center", fontsize=6, color="white" if w < 0.5 else "black")
        ax.set_xticks(range(beam), [f"rank {r}" for r in range(beam)], fontsize=7)
        zeros = "exact zeros" if "quadratic" in name else "weights below float64's range (0)"
        ax.set_title(f"{name} = {value:g}\n{zeros}: {int((A == 0).sum())} of {A.numel()}", fontsize=8)
    axes[0].set_yticks(range(len(order)), labels, fontsize=6)
    axes[0].set_ylabel("candidate: score - best score (nats)", fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sample_arguments(parser, "the plugin's LSTM or Transformer", "valid", 50)
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--values", type=float, nargs="+", default=[0.01, 0.03, 0.1, 0.3, 1.0],
                        help="epsilon and lambda values, in nats of log-likelihood (the linear cost's units)")
    parser.add_argument("--figure", type=Path, help="write the weights of one real step here (PNG)")
    parser.add_argument("--figure-value", type=float, help="the value drawn (default: the grid's largest)")
    parser.add_argument("--figure-candidates", type=int, default=14)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    opts = build_parser().parse_args(argv)
    quiet_logging(opts.threads)
    task, model, arch = load_model(opts.checkpoint, opts.data_bin)
    batches = sample_sentences(task, opts.subset, opts.sentences, opts.seed, opts.max_len)
    steps = record_step_scores(task, model, arch, opts.data_bin, batches, opts.beam)
    steps = [s.double() for s in steps if int(torch.isfinite(s).sum()) > opts.beam]  # the first step has one beam
    n = steps[0].numel()
    print(f"# command: python {' '.join(sys.argv)}")
    print(f"# {opts.checkpoint} ({arch}), {len(batches)} {opts.subset} sentences, {len(steps)} decoding steps of "
          f"{n} candidates (beam {opts.beam}), entropic search's own steps")
    print(format_table(measure(steps, opts.beam, opts.values), opts.beam, n))
    if opts.figure:
        value = opts.figure_value or max(opts.values)
        for index, scores in enumerate(steps):
            top = scores.topk(opts.beam + 1).values
            if float((top[:-1] - top[1:]).min()) < value:
                break
        plot_step(scores, opts.beam, value, opts.figure_candidates, opts.figure,
                  f"{arch}, {opts.subset} sentence sample, decoding step {index} of the sample: the best "
                  f"{opts.figure_candidates} of {n} candidates")
        print(f"# figure: {opts.figure} (step {index})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
