#!/usr/bin/env python
"""Per-sentence gradient sizes of beam-search training, hard vs soft variants, from a checkpoint.

For each of ``--sentences`` training sentences (a seeded sample) and each variant (a set of
``soft_beam_search`` criterion flags), this runs the criterion on that sentence alone, in
training mode (dropout seeded per sentence, the same for every variant), back-propagates the
summed loss and divides the gradient by the target tokens, as fairseq does (the selection
gradient's cap acts on the summed loss's gradient, as in training), and takes its norm. It prints,
per variant, the quantiles (median, p90, p99, max) of those norms and their ratio to the hard
variant's median; the norms of the gradient reaching each step's selection (per sentence and
step, before any cap, in units of one gold token's beam-term gradient ``1 - p``); the share of
steps with a near tie at a rank boundary; and the selection's sharpness. Minutes on a CPU::

    python scripts/diagnostics/diagnose_beam_gradients.py CHECKPOINT DATA_BIN --sentences 200

Built-in variants (``--variants``; default: all): ``hard``; ``soft_full`` (the paper's exact
gradient, linear cost); ``soft`` (the criterion's default); ``soft_none`` (no gradient through
the selection); ``soft_paper`` (the paper's cost and epsilon 0.1). ``--variant NAME="FLAGS"``
adds one, e.g. ``--variant eps03="--topk-epsilon 0.03 --topk-grad-cap 0.5"``; every
variant also gets ``--common`` (default: ``--train-beam 5 --teacher-forcing-ratio 0.8
--label-smoothing 0.1``, the fine-tuning configs' settings).
"""

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's package (a pinned worktree's too)
from fairseq_softtopk.experiments.checkpoint_sample import (add_sample_arguments, load_model,  # noqa: E402
                                                            quantiles, quiet_logging, sample_sentences,
                                                            training_cfg)

VARIANTS = {
    "hard": "--topk-mode hard",
    "soft_full": "--topk-mode soft --topk-grad full",
    "soft": "--topk-mode soft",
    "soft_none": "--topk-mode soft --topk-grad none",
    "soft_paper": "--topk-mode soft --topk-grad full --topk-cost paper --topk-epsilon 0.1",
}
COMMON = "--train-beam 5 --teacher-forcing-ratio 0.8 --label-smoothing 0.1"


def diagnose_variant(model, criterion, batches: List[dict], seed: int) -> dict:
    """Per-sentence gradient norms and per-step selection-gradient norms of one criterion."""
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norms, step_norms, ties, sharp, steps = [], [], 0.0, 0.0, 0
    model.train()
    for i, sample in enumerate(batches):
        torch.manual_seed(seed + i)  # the same dropout masks for every variant
        model.zero_grad(set_to_none=True)
        criterion.record_selection_grads = step_norms  # every norm, not only the logged sums
        loss, sample_size, log = criterion(model, sample)
        loss.backward()  # as fairseq: the summed loss, then the gradients divided by the sample size
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params
                                                      if p.grad is not None]))
        grad_norms.append(float(total) / sample_size)
        criterion.record_selection_grads = None
        n = int(log.get("topk_steps", 0))
        steps += n
        ties += float(log.get("topk_near_tie_sum", 0))
        sharp += float(log.get("topk_sharpness_sum", 0)) / max(1, int(log.get("topk_sharpness_count", 1))) * n
    return {"grad_norm": quantiles(grad_norms), "grad_norms": grad_norms,
            "selection_grad": quantiles(step_norms) if step_norms else None,
            "near_tie": ties / max(1, steps), "sharpness": sharp / max(1, steps)}


def format_table(results: Dict[str, dict], baseline: str) -> str:
    base = results[baseline]["grad_norm"]["median"] if baseline in results else None
    lines = ["| variant | grad median | p90 | p99 | max | median / hard | sentences > 100x hard median "
             "| selection grad per step, median / p99 / max (x (1-p)) | near ties | sharpness |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        g = r["grad_norm"]
        ratio = f"{g['median'] / base:.2f}x" if base else "-"
        over = f"{100 * sum(x > 100 * base for x in r['grad_norms']) / len(r['grad_norms']):.1f}%" if base else "-"
        s = r["selection_grad"]
        sel = "-" if s is None else f"{s['median']:.3g} / {s['p99']:.3g} / {s['max']:.3g}"
        lines.append(f"| {name} | {g['median']:.3g} | {g['p90']:.3g} | {g['p99']:.3g} | {g['max']:.3g} | {ratio} "
                     f"| {over} | {sel} | {100 * r['near_tie']:.1f}% | {r['sharpness']:.3f} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sample_arguments(parser, "a softtopk_lstm model", "train", 200)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), help=f"built-in variants: {list(VARIANTS)}")
    parser.add_argument("--variant", action="append", default=[], metavar='NAME="FLAGS"',
                        help="an extra variant: criterion flags of fairseq-train")
    parser.add_argument("--common", default=COMMON, help="flags every variant gets (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", type=Path, help="also write the results (with every norm) here")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    opts = build_parser().parse_args(argv)
    quiet_logging(opts.threads)
    unknown = [v for v in opts.variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; built-in: {list(VARIANTS)}")
    variants = {name: VARIANTS[name] for name in opts.variants}
    for item in opts.variant:
        name, sep, flags = item.partition("=")
        if not sep or not name:
            raise SystemExit(f'--variant looks like NAME="FLAGS", got {item!r}')
        variants[name] = flags
    task, model, arch = load_model(opts.checkpoint, opts.data_bin)
    batches = sample_sentences(task, opts.subset, opts.sentences, opts.seed, opts.max_len)
    print(f"{opts.checkpoint} ({arch}), {len(batches)} {opts.subset} sentences, common flags: {opts.common}",
          flush=True)
    results = {}
    for name, flags in variants.items():
        start = time.time()
        cfg = training_cfg(opts.data_bin, arch, shlex.split(opts.common) + shlex.split(flags))
        criterion = task.build_criterion(cfg.criterion)
        results[name] = {"flags": flags, **diagnose_variant(model, criterion, batches, opts.seed)}
        print(f"  {name}: {time.time() - start:.0f} s", flush=True)
    baseline = "hard" if "hard" in results else next(iter(results))
    print(format_table(results, baseline))
    if opts.json:
        opts.json.write_text(json.dumps({"checkpoint": str(opts.checkpoint), "common": opts.common,
                                         "variants": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
