#!/usr/bin/env python
"""What sparse attention buys, in numbers: how concentrated each model's attention is on a test set.

For every checkpoint (e.g. one per normaliser), the teacher-forced encoder-decoder attention
of every target token of the subset (the decoder reads the reference, shifted right; for
transformers the last layer, mean over heads, as ``fairseq-generate --print-alignment``) is
summarised by:

* ``outside top-k``: the share of the attention mass outside the k largest weights of the row
  (0 for a hard top-k normaliser; what a top-k normaliser removes from softmax);
* ``positions > 1%``: the number of source positions with a weight above 0.01;
* ``positions > 0``: the number with a non-zero weight (sparsemax, entmax and hard top-k give
  exact zeros; softmax and soft top-k do not);

averaged over target tokens (padding excluded). Prints a Markdown table; ``--json`` writes it too.

    python scripts/diagnostics/attention_sparsity.py RUN/seed1/softmax/checkpoint_last.pt \\
        RUN/seed1/soft_topk/checkpoint_last.pt DATA/bin --subset test --k 5
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's package (a pinned worktree's too)
from fairseq_softtopk.experiments.attention_maps import load_checkpoint, panel_title  # noqa: E402


@torch.no_grad()
def attention_statistics(model, task, subset: str, k: int, max_tokens: int = 4000) -> Dict[str, float]:
    """Mean over the subset's target tokens of the three statistics (module docstring).

    Returns:
        ``{"outside_topk": ..., "above_1pct": ..., "nonzero": ..., "tokens": n}``.
    """
    task.load_dataset(subset)
    batches = task.get_batch_iterator(task.dataset(subset), max_tokens=max_tokens,
                                      required_batch_size_multiple=1).next_epoch_itr(shuffle=False)
    pad = task.target_dictionary.pad()
    sums = torch.zeros(3, dtype=torch.float64)
    tokens = 0
    for sample in batches:
        net_input = sample["net_input"]
        _, extra = model(**net_input)
        attn = extra["attn"][0].double()  # (batch, tgt_len, src_len)
        rows = sample["target"].ne(pad)  # target tokens that count
        weights = attn[rows]  # (tokens, src_len); padded source positions carry weight 0
        top = weights.topk(min(k, weights.shape[-1]), dim=-1).values.sum(-1)
        sums += torch.stack([(1.0 - top).clamp_min(0.0).sum(), (weights > 0.01).sum(-1).double().sum(),
                             (weights > 0).sum(-1).double().sum()])
        tokens += int(rows.sum())
    means = (sums / max(tokens, 1)).tolist()
    return {"outside_topk": means[0], "above_1pct": means[1], "nonzero": means[2], "tokens": tokens}


def markdown_table(rows: List[dict], k: int) -> str:
    lines = [f"| model | checkpoint | mass outside top-{k} | positions > 1% | positions > 0 | target tokens |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | `{r['checkpoint']}` | {r['outside_topk']:.4f} | {r['above_1pct']:.2f} | "
                     f"{r['nonzero']:.2f} | {r['tokens']} |")
    return "\n".join(lines)


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", type=Path, nargs="+")
    parser.add_argument("data_bin", type=Path, help="the binarised data dir")
    parser.add_argument("--subset", default="test")
    parser.add_argument("--k", type=int, default=5, help="k of the 'mass outside top-k' column (default 5)")
    parser.add_argument("--max-tokens", type=int, default=4000)
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if args.k < 1:
        parser.error(f"--k must be >= 1, got {args.k}")
    rows = []
    for checkpoint in args.checkpoints:
        if not checkpoint.is_file():
            parser.error(f"no checkpoint at {checkpoint}")
        model, task = load_checkpoint(checkpoint, args.data_bin)
        stats = attention_statistics(model, task, args.subset, args.k, args.max_tokens)
        rows.append({"model": panel_title(model, None, None), "checkpoint": str(checkpoint), **stats})
        print(f"{checkpoint}: done ({stats['tokens']} target tokens)", file=sys.stderr, flush=True)
    print(f"# {args.subset} of {args.data_bin}, teacher-forced attention, means over target tokens")
    print(markdown_table(rows, args.k))
    if args.json:
        args.json.write_text(json.dumps({"subset": args.subset, "k": args.k, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
