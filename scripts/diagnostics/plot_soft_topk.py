#!/usr/bin/env python
"""Soft top-k output against the scores for several epsilon, for both cost scalings (paper fig. 2).

Top row: 50 standard normal scores, k = 5 (the paper's figure 2 setting). Bottom row: the
same at n = 5000, where the paper's scaling (squared distance divided by its maximum) makes
the output nearly uniform at epsilon = 0.1, while the linear cost (epsilon in the units of
the scores) still selects. Writes a PNG.

Usage::

    python scripts/diagnostics/plot_soft_topk.py --out figures/soft_topk_vs_epsilon.png
"""

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's package (a pinned worktree's too)
from fairseq_softtopk.ops import soft_topk  # noqa: E402

EPSILONS = (1.0, 0.1, 0.01, 0.001)


def plot(out: Path, k: int = 5, sizes=(50, 5000), seed: int = 0) -> Path:
    """Draws the grid (rows: n, columns: cost) and saves it to ``out``."""
    fig, axes = plt.subplots(len(sizes), 2, figsize=(11, 4 * len(sizes)), squeeze=False)
    for row, n in enumerate(sizes):
        x = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        order = x.argsort()
        for col, cost in enumerate(("paper", "linear")):
            ax = axes[row][col]
            for epsilon in EPSILONS:
                a = soft_topk(x, k, epsilon=epsilon, cost=cost, largest=False)
                ax.plot(x[order].numpy(), a[order].numpy(), marker=".", markersize=3, linewidth=1,
                        label=f"epsilon={epsilon:g} (max {float(a.max()):.2f})")
            hard = soft_topk(x, k, largest=False, hard=True)
            ax.step(x[order].numpy(), hard[order].numpy(), where="mid", color="black", linewidth=0.8,
                    linestyle="--", label="hard top-k")
            ax.set_title(f"cost={cost!r}, n={n}, k={k} (smallest)")
            ax.set_xlabel("score")
            ax.set_ylabel("soft top-k indicator")
            ax.set_xlim(float(x.min()), float(x.sort().values[min(n - 1, 4 * k)]) + 0.5)
            ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="figures/soft_topk_vs_epsilon.png")
    parser.add_argument("--k", type=int, default=5)
    args = parser.parse_args(argv)
    print(plot(Path(args.out), k=args.k))
    return 0


if __name__ == "__main__":
    sys.exit(main())
